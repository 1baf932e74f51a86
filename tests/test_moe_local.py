"""The local MoE's "sorted" routed path (each expert runs only its rows) against a dense
reference that runs every expert on every token and masks; eager and compiled."""

import pytest
import torch
import torch.nn.functional as F

from simplesharded.models.expert_mm import uses_grouped_mm
from simplesharded.models.moe import MoE, MoEArgs, MoETransformer

E, K, DIM, HID = 8, 2, 16, 8


def make_moe(dtype=torch.float64, seed=0, **overrides):
    torch.manual_seed(seed)
    args = MoEArgs(dim=DIM, n_heads=2, n_kv_heads=2, moe_hidden_dim=HID, n_routed_experts=E,
                   top_k=K, n_shared_experts=1, **overrides)
    moe = MoE(args)
    moe.init_weights(out_std=0.02)
    for p in moe.experts.parameters():  # larger than init so errors are not hidden by scale
        p.data.normal_(0, 0.5)
    return moe.to(dtype)


def force(moe, routing: str):
    """Steer the routing through the gate and the balancing bias (choice = score + bias)."""
    with torch.no_grad():
        if routing == "all_to_one":  # a flat gate: the top-k by bias take every token
            moe.gate.weight.zero_()
            moe.expert_bias.copy_(torch.arange(E, dtype=torch.float32))
        elif routing == "some_empty":  # random routing; experts 0, 3 and 5 never chosen
            moe.expert_bias.zero_()
            moe.expert_bias[[0, 3, 5]] = -10.0


def dense_reference(moe, x):
    """Every expert on every token, then each token keeps its routed experts' outputs."""
    B, S, D = x.shape
    xt = x.reshape(-1, D)
    weights, experts, _ = moe.route(xt)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    h = F.silu(torch.einsum("td,edh->eth", xt, w1)) * torch.einsum("td,edh->eth", xt, w3)
    out = torch.einsum("eth,ehd->etd", h, w2)  # [E, T, D]
    mask = torch.zeros(xt.shape[0], E, dtype=out.dtype).scatter_add(1, experts, weights.to(out.dtype))
    y = torch.einsum("te,etd->td", mask, out) + moe.shared_experts(xt)
    return y.view(B, S, D)


def grads(fn, moe, x, cot):
    params = [moe.gate.weight, moe.experts.w1, moe.experts.w2, moe.experts.w3]
    y = fn(x)
    return [y, *torch.autograd.grad(y, [x, *params], cot)]


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_matches(got, ref, tol):
    names = ["y", "x.grad", "gate.grad", "w1.grad", "w2.grad", "w3.grad"]
    for n, g, r in zip(names, got, ref):
        assert g.shape == r.shape, n
        assert rel_err(g, r) <= tol, (n, rel_err(g, r))


def inputs(dtype=torch.float64, B=2, S=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, DIM, generator=g, dtype=dtype).requires_grad_()
    return x, torch.randn(B, S, DIM, generator=g, dtype=dtype)


@pytest.mark.parametrize("routing", ["random", "some_empty", "all_to_one"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_sorted_matches_dense_reference(routing, compiled):
    moe = make_moe()
    force(moe, routing)
    x, cot = inputs()
    counts = torch.bincount(moe.route(x.detach().view(-1, DIM))[1].flatten(), minlength=E)
    if routing == "all_to_one":
        assert counts.max() == x.shape[0] * x.shape[1] and (counts == 0).sum() == E - K
    if routing == "some_empty":
        assert counts[[0, 3, 5]].eq(0).all()
    ref = grads(lambda t: dense_reference(moe, t), moe, x, cot)
    fn = moe
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(moe, backend="aot_eager", fullgraph=True)
    assert_matches(grads(fn, moe, x, cot), ref, 1e-6)
    if compiled:
        torch._dynamo.reset()


def test_aligned_groups_match(monkeypatch):
    """Groups at multiples of 16 rows (CUDA's grouped GEMM), padding included, give the same."""
    moe = make_moe()
    force(moe, "some_empty")
    x, cot = inputs()
    ref = grads(lambda t: dense_reference(moe, t), moe, x, cot)
    monkeypatch.setattr(moe.experts, "row_align", lambda x: 16)
    assert_matches(grads(moe, moe, x, cot), ref, 1e-6)


def test_deterministic():
    moe = make_moe(dtype=torch.float32)
    x, cot = inputs(torch.float32)
    a, b = grads(moe, moe, x, cot), grads(moe, moe, x, cot)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("cf", [None, 0.5])
def test_sorted_equals_bmm(cf):
    """Both paths drop the same (token, choice) rows past capacity, in token order."""
    sorted_moe = make_moe(capacity_factor=cf)
    bmm_moe = make_moe(capacity_factor=cf, experts_impl="bmm")
    bmm_moe.load_state_dict(sorted_moe.state_dict())
    x, cot = inputs()
    sorted_moe.train(), bmm_moe.train()
    assert_matches(grads(sorted_moe, sorted_moe, x, cot), grads(bmm_moe, bmm_moe, x, cot), 1e-6)
    torch.testing.assert_close(sorted_moe.tokens_per_expert, bmm_moe.tokens_per_expert)
    assert sorted_moe.tokens_per_expert.sum() == x.shape[0] * x.shape[1] * K
    if cf is not None:  # some rows were dropped: not the dropless result
        dropless = make_moe()
        assert rel_err(sorted_moe(x), dropless(x)) > 1e-3


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_bf16_grouped_mm(compiled):
    """bf16 runs torch._grouped_mm (eager and compiled); compare at bf16's precision."""
    moe = make_moe(dtype=torch.bfloat16)
    x, cot = inputs(torch.bfloat16)
    assert uses_grouped_mm(x, moe.experts.w1)
    ref = [t.float() for t in grads(lambda t: dense_reference(moe, t), moe, x, cot)]
    fn = moe
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(moe, backend="aot_eager", fullgraph=True)
    got = [t.float() for t in grads(fn, moe, x, cot)]
    assert_matches(got, ref, 2e-2)
    if compiled:
        torch._dynamo.reset()


def test_flops_follow_the_path():
    """MFU counts what the path runs: top_k experts a token "sorted", all of them "bmm"."""
    kw = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, moe_hidden_dim=32,
              n_routed_experts=8, top_k=2, n_dense_layers=1)
    sorted_model = MoETransformer(MoEArgs(**kw))
    bmm_model = MoETransformer(MoEArgs(**kw, experts_impl="bmm"))
    routed = 3 * 8 * 64 * 32  # one MoE layer's routed expert weights
    assert (bmm_model.num_flops_per_token(16) - sorted_model.num_flops_per_token(16)
            == 6 * routed * (8 - 2) // 8)
    assert MoE(MoEArgs(**kw, experts_impl="bmm", capacity_factor=1.5)).expert_passes_per_token() == 3.0
    with pytest.raises(ValueError, match="experts_impl"):
        MoEArgs(**kw, experts_impl="loop")


def test_compiled_dynamic_token_count():
    """With a symbolic token count the buffer's size stays an expression of it: no recompile
    per batch shape, same results."""
    moe = make_moe()
    torch._dynamo.reset()
    fn = torch.compile(moe, backend="aot_eager", fullgraph=True, dynamic=True)
    for S in (12, 7):
        x, cot = inputs(S=S)
        assert_matches(grads(fn, moe, x, cot), grads(lambda t: dense_reference(moe, t), moe, x, cot), 1e-6)
    torch._dynamo.reset()
