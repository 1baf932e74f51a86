"""Fast single-process tests of the model zoo (models/)."""

import re
import sys

import pytest
import torch
import torch.nn.functional as F

from simplesharded.models import MODELS, build_model, get_model_spec, logits_of
from simplesharded.models.llama3 import precompute_freqs_cis
from simplesharded.models.moe import MoE

# Shrunk debug models keep every test to a few seconds on one CPU core.
TINY = {
    "llama3": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=259, max_seq_len=64),
    "deepseek_v3": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=259, max_seq_len=64,
                        dense_hidden_dim=128, moe_hidden_dim=32, n_routed_experts=4, top_k=2),
    "hf_llama": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=259, max_seq_len=64),
    "gpt": dict(dim=64, n_layers=2, n_heads=4, vocab_size=259, max_seq_len=64),
}
FINAL_NORM = {"gpt": "ln_f"}  # the final norm's module, where it is not "norm"

MOE_VARIANTS = [
    {},  # sigmoid + bias (V3)
    dict(score_func="softmax", route_norm=False, load_balance="aux_loss"),  # V2-like
    dict(capacity_factor=1.0),  # token dropping
]


def tiny(name, seed=0, **overrides):
    torch.manual_seed(seed)
    return build_model(name, "debug", device="cpu", **{**TINY[name], **overrides})


def batch(vocab=259, B=2, S=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, S), generator=g)


def lm_loss(model, tokens):
    logits = logits_of(model(tokens[:, :-1]))
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_shape_debug_flavor(name):
    torch.manual_seed(0)
    model = build_model(name, "debug", device="cpu")
    vocab = get_model_spec(name, "debug")[1].vocab_size
    tokens = batch(vocab, B=2, S=32)
    logits = logits_of(model(tokens))
    assert logits.shape == (2, 32, vocab)
    assert torch.isfinite(logits).all()


def test_fqns():
    names = dict(build_model("llama3", "debug").named_parameters())
    assert "layers.3.attention.wq.weight" in names
    assert "layers.5.feed_forward.w2.weight" in names
    assert {"tok_embeddings.weight", "norm.weight", "output.weight"} <= set(names)
    moe_names = dict(build_model("deepseek_v3", "debug").named_parameters())
    assert "layers.0.feed_forward.w1.weight" in moe_names  # dense first layer
    assert moe_names["layers.1.feed_forward.experts.w1"].shape == (8, 256, 256)  # experts on dim 0
    assert "layers.1.feed_forward.shared_experts.w1.weight" in moe_names


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_loss_falls(name, opt):
    model = tiny(name)
    tokens = batch(S=33)
    optim = (torch.optim.SGD(model.parameters(), lr=0.5) if opt == "sgd"
             else torch.optim.AdamW(model.parameters(), lr=3e-3))
    losses = []
    for _ in range(20):
        loss = lm_loss(model, tokens)
        optim.zero_grad()
        loss.backward()
        optim.step()
        if name == "deepseek_v3":
            model.update_expert_bias()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("variant", MOE_VARIANTS, ids=["bias", "aux_loss", "capacity"])
def test_moe_variants_train(variant):
    model = tiny("deepseek_v3", **variant)
    tokens = batch(S=33)
    loss = lm_loss(model, tokens)
    loss.backward()
    assert model.layers["1"].feed_forward.gate.weight.grad.abs().sum() > 0
    assert model.layers["1"].feed_forward.experts.w2.grad.abs().sum() > 0


def test_aux_loss_reaches_gate():
    grads = []
    for coeff in (0.0, 1.0):
        model = tiny("deepseek_v3", load_balance="aux_loss", aux_loss_coeff=coeff)
        lm_loss(model, batch(S=33)).backward()
        grads.append(model.layers["1"].feed_forward.gate.weight.grad)
    assert not torch.allclose(grads[0], grads[1])


def test_capacity_drops_overflow():
    x = torch.randn(2, 16, 64)
    dropless = tiny("deepseek_v3").layers["1"].feed_forward
    capped = tiny("deepseek_v3", capacity_factor=0.5).layers["1"].feed_forward
    assert capped.capacity(32) == 8 and dropless.capacity(32) == 32
    assert not torch.allclose(capped(x), dropless(x))


def test_moe_matches_per_token_reference():
    """Dropless routed MoE equals a plain per-token loop over the chosen experts."""
    model = tiny("deepseek_v3", n_shared_experts=0)
    moe = model.layers["1"].feed_forward
    x = torch.randn(2, 5, 64)
    weights, experts, _ = moe.route(x.reshape(-1, 64))
    ref = torch.zeros(10, 64)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    for t in range(10):
        for j in range(moe.top_k):
            e, xt = experts[t, j], x.reshape(-1, 64)[t]
            ref[t] += weights[t, j] * ((F.silu(xt @ w1[e]) * (xt @ w3[e])) @ w2[e])
    torch.testing.assert_close(moe(x).reshape(10, 64), ref, atol=1e-5, rtol=1e-5)


def test_expert_bias_update():
    model = tiny("deepseek_v3")
    model(batch(S=16))
    moe = model.layers["1"].feed_forward
    counts = moe.tokens_per_expert.clone()
    assert counts.sum() == 2 * 16 * moe.top_k
    model.update_expert_bias()
    expected = model.args.bias_update_rate * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(moe.expert_bias, expected)
    assert moe.tokens_per_expert.sum() == 0
    model.eval()
    model(batch(S=16))  # eval does not tally
    assert moe.tokens_per_expert.sum() == 0


@pytest.mark.parametrize("variant", [("llama3", {}), ("hf_llama", {})]
                         + [("deepseek_v3", v) for v in MOE_VARIANTS],
                         ids=["llama3", "hf_llama", "moe_bias", "moe_aux_loss", "moe_capacity"])
def test_compile_fullgraph_matches_eager(variant):
    name, overrides = variant
    torch._dynamo.reset()
    tokens = batch(S=16)
    ref = tiny(name, **overrides)  # same seed -> same weights, fresh buffers
    # fullgraph=True raises on any graph break.
    compiled = torch.compile(tiny(name, **overrides), backend="aot_eager", fullgraph=True)
    loss_ref, loss_c = lm_loss(ref, tokens), lm_loss(compiled, tokens)
    torch.testing.assert_close(loss_c, loss_ref, atol=1e-5, rtol=1e-5)
    # the loss's input shape: another sequence length would recompile (dynamic shapes), more
    # than this test's first compile costs
    inputs = tokens[:, :-1]
    torch.testing.assert_close(logits_of(compiled(inputs)), logits_of(ref(inputs)),
                               atol=1e-5, rtol=1e-5)
    loss_ref.backward()
    loss_c.backward()
    for (n, p), q in zip(ref.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=n)
    if name == "deepseek_v3" and overrides.get("load_balance", "bias") == "bias":
        for m_ref, m_c in zip(ref.moe_layers(), compiled.moe_layers()):
            torch.testing.assert_close(m_c.tokens_per_expert, m_ref.tokens_per_expert)
    torch._dynamo.reset()


@pytest.mark.parametrize("name,flavor,lo,hi", [
    ("llama3", "8B", 8.00e9, 8.06e9),
    ("llama3", "70B", 70.4e9, 70.8e9),
    ("llama3", "405B", 405.5e9, 406.2e9),
    ("deepseek_v3", "16B", 15.6e9, 16.0e9),  # V2-Lite's 15.7B, with MHA in place of MLA
])
def test_published_param_counts(name, flavor, lo, hi):
    model = build_model(name, flavor)  # meta
    n = sum(p.numel() for p in model.parameters())
    assert lo < n < hi, n
    assert model.num_params() == n
    assert all(p.is_meta for p in model.parameters())


def test_flops_per_token():
    llama = build_model("llama3", "8B")
    a = llama.args
    assert llama.num_flops_per_token(8192) == (6 * llama.num_params(exclude_embedding=True)
                                               + 12 * a.n_layers * a.dim * 8192)
    moe = build_model("deepseek_v3", "16B")
    active = moe.num_flops_per_token(0) / 6
    assert 2.2e9 < active < 2.8e9  # ~2.4B active non-embedding params


def test_unknown_name_or_flavor():
    with pytest.raises(ValueError, match=rf"model.name='gpt2' is not one of {re.escape(str(sorted(MODELS)))}"):
        get_model_spec("gpt2", "debug")
    with pytest.raises(ValueError, match=r"model.flavor='3B' is not one of \['16B', 'debug'\]"):
        build_model("deepseek_v3", "3B")
    with pytest.raises(ValueError, match="'n_layer'"):
        build_model("llama3", "debug", n_layer=2)
    with pytest.raises(ValueError, match="n_kv_heads"):
        build_model("llama3", "debug", n_kv_heads=5)


def test_overrides_replace_args():
    model = build_model("llama3", "small", vocab_size=259, max_seq_len=128)
    assert model.args.vocab_size == 259 and model.output.weight.shape[0] == 259
    assert model.freqs_cis.shape[0] == 128
    assert get_model_spec("llama3", "small")[1].vocab_size == 512  # registry unchanged


# transformers' init_weights initialises a module once (then marks it _is_hf_initialized, so a
# second call is a no-op by design): hf_llama's init is checked from meta, where it first runs
# (test_hf_llama_from_meta_then_init_weights).
@pytest.mark.parametrize("name", [n for n in sorted(MODELS) if n != "hf_llama"])
def test_init_weights_in_place_and_deterministic(name):
    model = tiny(name)
    before = {n: (p, p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    torch.manual_seed(123)
    model.init_weights()
    first = {n: p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        obj, ptr, old = before[n]
        assert p is obj and p.data_ptr() == ptr, n
        if p.dim() > 1:
            assert not torch.equal(p, old), f"{n} was not re-initialised"
    torch.manual_seed(123)
    model.init_weights()
    for n, p in model.named_parameters():
        assert torch.equal(p, first[n]), n
    assert model.get_submodule(FINAL_NORM.get(name, "norm")).weight.eq(1).all()


def test_init_weights_from_meta():
    model = build_model("deepseek_v3", "debug")  # meta
    model.to_empty(device="cpu")
    model.init_weights(buffer_device="cpu")
    assert model.freqs_cis.device.type == "cpu"
    a = model.args
    assert torch.equal(model.freqs_cis, precompute_freqs_cis(a.dim // a.n_heads, a.max_seq_len, a.rope_theta))
    assert all(m.expert_bias.eq(0).all() for m in model.moe_layers())
    assert torch.isfinite(model(batch(S=8))).all()


def test_mixed_precision_dtype():
    model = tiny("deepseek_v3").to(torch.bfloat16)
    assert model(batch(S=8)).dtype == torch.bfloat16
    assert isinstance(model.layers["1"].feed_forward, MoE)


# --- hf_llama: transformers' LlamaForCausalLM, unwrapped, with our llama3 flavors' shapes ---

def test_hf_llama_is_transformers_model_with_llama3_shapes():
    from transformers import LlamaForCausalLM
    for flavor in ("debug", "small"):
        hf, ours = build_model("hf_llama", flavor), build_model("llama3", flavor)  # meta
        assert type(hf) is LlamaForCausalLM  # not a wrapper: the module transformers defines
        # same architecture, same sizes: identical parameter count (19.4M for small)
        assert (sum(p.numel() for p in hf.parameters())
                == sum(p.numel() for p in ours.parameters()))
    names = dict(hf.named_parameters())  # small: 6 layers
    assert names["model.layers.5.self_attn.q_proj.weight"].shape == (512, 512)
    assert names["model.layers.0.self_attn.k_proj.weight"].shape == (256, 512)  # 4 kv heads of 64
    assert names["model.layers.3.mlp.down_proj.weight"].shape == (512, 1536)  # ours' FFN width
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(names)
    assert names["lm_head.weight"] is not names["model.embed_tokens.weight"]  # untied
    cfg = hf.config
    assert cfg._attn_implementation == "sdpa" and not cfg.use_cache
    assert cfg.rope_parameters["rope_theta"] == 500000.0 and cfg.rms_norm_eps == 1e-5
    assert build_model("hf_llama", "debug", n_layers=2).config.num_hidden_layers == 2


def _llama3_to_hf(ours, hf):
    """Copy our llama3's weights into transformers' Llama. Our RoPE rotates adjacent pairs
    (2i, 2i+1), transformers' rotates (i, i + head_dim/2) by the same angle: q and k rows are
    regrouped per head to match (the dot products q·k are unchanged by that permutation)."""
    def regroup(w, n_heads):
        return w.unflatten(0, (n_heads, -1, 2)).transpose(1, 2).flatten(0, 2)

    a = ours.args
    sd = {"model.embed_tokens.weight": ours.tok_embeddings.weight,
          "model.norm.weight": ours.norm.weight, "lm_head.weight": ours.output.weight}
    for i, blk in ours.layers.items():
        at, ff, pre = blk.attention, blk.feed_forward, f"model.layers.{i}."
        sd.update({pre + "self_attn.q_proj.weight": regroup(at.wq.weight, a.n_heads),
                   pre + "self_attn.k_proj.weight": regroup(at.wk.weight, a.n_kv_heads),
                   pre + "self_attn.v_proj.weight": at.wv.weight,
                   pre + "self_attn.o_proj.weight": at.wo.weight,
                   pre + "mlp.gate_proj.weight": ff.w1.weight, pre + "mlp.up_proj.weight": ff.w3.weight,
                   pre + "mlp.down_proj.weight": ff.w2.weight,
                   pre + "input_layernorm.weight": blk.attention_norm.weight,
                   pre + "post_attention_layernorm.weight": blk.ffn_norm.weight})
    missing, unexpected = hf.load_state_dict(sd, strict=True)
    assert not missing and not unexpected


def test_hf_llama_computes_what_our_llama3_computes():
    """Same weights, same logits: the flavors really are our llama3's model (RoPE theta, eps,
    GQA grouping, SwiGLU, untied head), written by someone else."""
    ours, hf = tiny("llama3"), tiny("hf_llama", seed=1)
    _llama3_to_hf(ours, hf)
    tokens = batch(S=24)
    torch.testing.assert_close(logits_of(hf(tokens)), ours(tokens), atol=1e-5, rtol=1e-4)


def test_logits_of_either_kind_of_output():
    ours, hf = tiny("llama3"), tiny("hf_llama")
    tokens = batch(S=8)
    out = ours(tokens)
    assert logits_of(out) is out  # our models return the logits tensor itself
    hf_out = hf(tokens)
    assert type(hf_out).__name__ == "CausalLMOutputWithPast"
    assert logits_of(hf_out) is hf_out.logits and hf_out.logits.shape == (2, 8, 259)


def test_hf_llama_from_meta_then_init_weights():
    """The sharded path: built on meta, materialised empty, then initialised in place,
    deterministically, RoPE included (transformers' init_weights recomputes the
    non-persistent inv_freq buffer)."""
    models = []
    for _ in range(2):
        model = build_model("hf_llama", "debug", **TINY["hf_llama"])
        assert all(p.is_meta for p in model.parameters())
        model.to_empty(device="cpu")
        ptrs = [p.data_ptr() for p in model.parameters()]
        torch.manual_seed(0)
        model.init_weights()
        assert [p.data_ptr() for p in model.parameters()] == ptrs
        models.append(model)
    for (n, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(p, q), n
    assert model.model.norm.weight.eq(1).all() and model.lm_head.weight.std() > 0.01
    a = get_model_spec("hf_llama", "debug")[1]
    head_dim = TINY["hf_llama"]["dim"] // TINY["hf_llama"]["n_heads"]
    inv_freq = 1.0 / a.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, inv_freq)
    assert torch.isfinite(logits_of(model(batch(S=8)))).all()


def test_hf_llama_errors_are_one_line():
    with pytest.raises(ValueError, match=r"model.flavor='8B' is not one of \['debug', 'small'\] "
                                         r"\(model.name='hf_llama'\)"):
        build_model("hf_llama", "8B")
    with pytest.raises(ValueError, match="hf_llama has no tensor-parallel styles"):
        get_model_spec("hf_llama", "small")[1].check_tp(2)
    with pytest.raises(ValueError, match="n_kv_heads"):  # llama3's checks hold
        build_model("hf_llama", "debug", n_kv_heads=5)


def test_hf_llama_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what import sees when not installed
    with pytest.raises(ImportError) as e:
        build_model("hf_llama", "debug")
    assert str(e.value) == ("model hf_llama needs transformers: "
                            "pip install 'simplesharded[hf]'")
    build_model("llama3", "debug")  # the rest of the zoo does not need it


@pytest.mark.parametrize("name", ["llama3", "gpt"])
def test_flop_count_of_a_sharded_model_gathers_nothing(name):
    """``num_flops_per_token`` (the trainer's MFU) counts a sharded model's parameters without
    gathering one (no collective: every rank need not call it), and counts what the
    unsharded model counts."""
    from torch.distributed.tensor.debug import CommDebugMode

    import simplesharded as ss
    from simplesharded.tools.cluster_trace import fake_world

    want = tiny(name).num_flops_per_token(32)
    with fake_world(2):
        model = ss.data_parallel(tiny(name), ss.build_mesh(1, -1, "cpu"))
        with CommDebugMode() as comm:
            got = model.num_flops_per_token(32)
    assert comm.get_total_counts() == 0 and got == want, (comm.get_comm_counts(), got, want)
