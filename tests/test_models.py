"""Fast single-process tests of the model zoo (models/)."""

import pytest
import torch
import torch.nn.functional as F

from simplesharded.models import MODELS, build_model, get_model_spec
from simplesharded.models.llama3 import precompute_freqs_cis
from simplesharded.models.moe import MoE

# Shrunk debug models keep every test to a few seconds on one CPU core.
TINY = {
    "llama3": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=259, max_seq_len=64),
    "deepseek_v3": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=259, max_seq_len=64,
                        dense_hidden_dim=128, moe_hidden_dim=32, n_routed_experts=4, top_k=2),
}
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
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_shape_debug_flavor(name):
    torch.manual_seed(0)
    model = build_model(name, "debug", device="cpu")
    tokens = batch(model.args.vocab_size, B=2, S=32)
    logits = model(tokens)
    assert logits.shape == (2, 32, model.args.vocab_size)
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


@pytest.mark.parametrize("variant", [("llama3", {})] + [("deepseek_v3", v) for v in MOE_VARIANTS],
                         ids=["llama3", "moe_bias", "moe_aux_loss", "moe_capacity"])
def test_compile_fullgraph_matches_eager(variant):
    name, overrides = variant
    torch._dynamo.reset()
    tokens = batch(S=16)
    ref = tiny(name, **overrides)  # same seed -> same weights, fresh buffers
    # fullgraph=True raises on any graph break.
    compiled = torch.compile(tiny(name, **overrides), backend="aot_eager", fullgraph=True)
    loss_ref, loss_c = lm_loss(ref, tokens), lm_loss(compiled, tokens)
    torch.testing.assert_close(loss_c, loss_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled(tokens), ref(tokens), atol=1e-5, rtol=1e-5)
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
    with pytest.raises(ValueError, match=r"model.name='gpt2' is not one of \['deepseek_v3', 'llama3'\]"):
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


@pytest.mark.parametrize("name", sorted(MODELS))
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
    assert model.norm.weight.eq(1).all()


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
