"""FSDP × tensor parallelism on one mesh: parity, bitwise bucketing and graph counts.

A small llama3 (2 blocks) is tensor-parallelised with its own plan (``model.tp_styles``,
sequence parallel) by torch's ``parallelize_module`` on ``mesh["tp"]`` and then sharded over
the dp dims by ``data_parallel``; every case trains a few SGD steps on the same global
batch as a 1-process reference (the dp ranks split the batch; the tp ranks of one dp rank
read the same rows). Losses, the first step's gradients and the final parameters (gathered
to full tensors) must agree to 1e-5 relative: the only difference from the reference is the
order of the additions in the gradient reductions (dp) and in the row-parallel matmuls (tp),
a few fp32 ulps (observed ≤ 2e-6); a wrong element order of the strided shards, a missing or
doubled reduction, or a reduction over the wrong mesh dim is an O(1) error.

With TP, bucketing must change nothing but the dp collectives: bucketed runs are bitwise
equal to the unbucketed aot_eager run, the dp collectives drop to one per block bucket (as
without TP), and the TP collectives are the same in number before and after our passes.
So is a run with storage="ragged", where every gathered parameter is a view of its bucket's
gather (eager and compiled, FSDP and HSDP, uneven strided shards).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_utils import by_member, max_rel_diff, memo, ragged_buckets, spawn, storage_and_backend

pytestmark = pytest.mark.slow

ARGS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32)
GLOBAL_BATCH, SEQ, STEPS = 4, 16, 3
# SGD: the update is linear in the gradient, so parameter parity stays as tight as gradient
# parity. AdamW's first steps move every parameter by ~lr·sign(grad), which turns rounding
# noise in a near-zero gradient into an lr-sized difference (observed 9e-4 here): a test of
# Adam, not of sharding. The optimizer itself is tested on sharded parameters elsewhere.
SGD = dict(lr=0.5)
TOL = 1e-5


def make_model():
    from simplesharded.models import build_model

    torch.manual_seed(0)
    return build_model("llama3", "debug", device="cpu", **ARGS)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, ARGS["vocab_size"], (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits, labels):
    # A sum over the rows a rank sees, normalised by the global token count: summing the
    # per-dp-rank losses gives the reference's mean.
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                           reduction="sum") / (GLOBAL_BATCH * SEQ)


def train(model, step_fn, dp_rank: int, dp_size: int, loss_group_scale: int):
    opt = torch.optim.SGD(model.parameters(), **SGD)
    rows = GLOBAL_BATCH // dp_size
    losses, grads0 = [], None
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows]
        loss = loss_fn(step_fn(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            grads0 = by_member(model, grads=True)
        opt.step()
        total = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(total)  # every tp rank of a dp rank holds the same loss
        losses.append(total.item() / loss_group_scale)
    return losses, grads0, by_member(model)


@memo
def reference():
    model = make_model()
    return train(model, model, 0, 1, 1)


# (dp_replicate, dp_shard, tp, mode) → cases (backend, sequence_parallel). All layouts of one
# world size run in one spawn (4 ranks: with the uneven cases below), one after the other.
# TP under inductor is compiled once, on one process: the GPU check's fake-group TP case
# (tests/test_gpu_check.py) reads our collective order in inductor's code.
LAYOUTS = {
    (1, 2, 2, "fully_shard"): (("eager", True), ("eager", False), ("aot_eager", True),
                               ("aot_eager_blockbucketing", True),
                               ("aot_eager_autobucketing", True),
                               # storage="ragged": every parameter a view of its
                               # bucket's gather
                               ("ragged:eager", True), ("ragged:aot_eager_blockbucketing", True)),
    (2, 1, 2, "hybrid_shard"): (("eager", True), ("aot_eager_blockbucketing", True),
                                ("ragged:eager", True)),
    # 8 processes on this machine's 2 cores: eager only (2x1x2 covers compiled HSDP x TP)
    (2, 2, 2, "hybrid_shard"): (("eager", True),),
}


def _world(key) -> int:
    rep, shard, tp, _ = key
    return rep * shard * tp


def _layout(rank, world, rep, shard, tp, mode, cases):
    from torch.distributed.tensor.parallel import parallelize_module

    import simplesharded as ss
    from simplesharded.passes.collectives import count_by_group, find_collectives, group_label

    out = {}
    for case, sp in cases:
        storage, backend = storage_and_backend(case)
        torch._dynamo.reset()
        counts: dict = {}

        def observe(kind, stage, gm, counts=counts):
            if kind in ("fw", "bw"):
                counts.setdefault((kind, "before"), count_by_group(gm))
                counts[(kind, "after")] = count_by_group(gm)
                # issue order per process group of the graph that runs (the last stage)
                counts[(kind, "order")] = [(group_label(c.group_name), c.kind, c.nbytes)
                                           for c in find_collectives(gm)]

        mesh = ss.build_mesh(rep, shard, "cpu", tp)
        model = make_model()
        parallelize_module(model, mesh["tp"], model.tp_styles(sequence_parallel=sp))
        ss.data_parallel(model, mesh, mode, grad_reduction="sum",  # loss_fn: global count
                         storage=storage)
        counts["ragged"] = ragged_buckets(model)
        step_fn = model if backend == "eager" else torch.compile(
            model, backend=ss.make_backend(backend, observer=observe), fullgraph=True)
        dp_rank, dp_size = rank // tp, world // tp
        losses, grads0, params = train(model, step_fn, dp_rank, dp_size, tp)
        out[(case, sp)] = (losses, grads0 if rank == 0 else None,
                              params if rank == 0 else None, counts)
    return out


def _float8_job(rank, world):
    """float8 Linears (training.float8's recipe: converted first) under TP on dp 2 x tp 2,
    compiled with aot_eager_blockbucketing: losses, and the forward graph's collectives by
    (group, kind, dtype) after the float8 gather pass."""
    from torch.distributed.tensor.parallel import parallelize_module

    import simplesharded as ss
    from simplesharded.float8 import convert_to_float8
    from simplesharded.passes.collectives import find_collectives, group_label

    torch._dynamo.reset()
    counts = {}

    def observe(kind, stage, gm):
        if kind == "fw" and stage == "float8":
            counts.clear()
            for c in find_collectives(gm):
                key = (group_label(c.group_name), c.kind, str(c.dtype))
                counts[key] = counts.get(key, 0) + 1

    mesh = ss.build_mesh(1, 2, "cpu", 2)
    model = make_model()
    convert_to_float8(model)
    parallelize_module(model, mesh["tp"], model.tp_styles(sequence_parallel=True))
    ss.data_parallel(model, mesh, "fully_shard", grad_reduction="sum", storage="param")
    step_fn = torch.compile(model, backend=ss.make_backend("aot_eager_blockbucketing",
                                                           observer=observe), fullgraph=True)
    losses, _, _ = train(model, step_fn, rank // 2, 2, 2)
    torch._dynamo.reset()
    return losses, counts


def float8_reference(dp: int) -> list[float]:
    """float8 Linears in one process, uncompiled: each dp rank's rows through the model on
    their own (its activations and gradients cast with their own scales, as on that rank),
    the losses and gradients summed."""
    from simplesharded.float8 import convert_to_float8

    model = make_model()
    convert_to_float8(model)
    opt = torch.optim.SGD(model.parameters(), **SGD)
    rows, losses = GLOBAL_BATCH // dp, []
    for step in range(STEPS):
        x, y = batch(step)
        loss = sum(loss_fn(model(x[r * rows:(r + 1) * rows]), y[r * rows:(r + 1) * rows])
                   for r in range(dp))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _job(rank, world):
    out = {key: _layout(rank, world, *key, cases) for key, cases in LAYOUTS.items()
           if _world(key) == world}
    if world == 4:
        out["uneven"] = _uneven_job(rank, world)
        out["float8"] = _float8_job(rank, world)
    return out


@memo
def _run(world):
    return spawn(world, _job, timeout_s=1200)


def run_layout(key):
    return [r[key] for r in _run(_world(key))]


CASES = [(key, case) for key, cases in LAYOUTS.items() for case in cases]


@pytest.mark.parametrize("key,case", CASES, ids=[f"{k[0]}x{k[1]}x{k[2]}-{k[3]}-{c[0]}"
                                                 f"{'' if c[1] else '-nosp'}"
                                                 for k, c in CASES])
def test_parity_with_single_process(key, case):
    ref_losses, ref_grads, ref_params = reference()
    results = run_layout(key)
    losses, grads0, params, _ = results[0][case]
    for r in results[1:]:  # every rank reports the same global loss
        assert r[case][0] == losses
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= TOL, \
        (losses, ref_losses)
    assert set(grads0) == set(ref_grads) and set(params) == set(ref_params)
    bad = {n: max_rel_diff(g, ref_grads[n]) for n, g in grads0.items()
           if not max_rel_diff(g, ref_grads[n]) <= TOL}
    assert not bad, f"step-0 gradients beyond {TOL}: {bad}"
    bad = {n: max_rel_diff(p, ref_params[n]) for n, p in params.items()
           if not max_rel_diff(p, ref_params[n]) <= TOL}
    assert not bad, f"final parameters beyond {TOL}: {bad}"


@pytest.mark.parametrize("backend", ["aot_eager_blockbucketing", "aot_eager_autobucketing",
                                     "ragged:eager",
                                     "ragged:aot_eager_blockbucketing"])
def test_bucketed_tp_is_bitwise_unbucketed(backend):
    results = run_layout((1, 2, 2, "fully_shard"))[0]
    if backend.startswith("ragged:"):
        # every parameter in a ragged bucket: a block's TP shards (7 weights) apart from its
        # two norms, replicated over tp, so each bucket's norm counts an element once
        assert results[(backend, True)][3]["ragged"] == {
            "pre/float32_tp": 1, "layers.0/float32_tp": 7, "layers.0/float32": 2,
            "layers.1/float32_tp": 7, "layers.1/float32": 2, "post/float32": 1,
            "post/float32_tp": 1}
    reference = "eager" if backend == "ragged:eager" else "aot_eager"
    plain, bucketed = results[(reference, True)], results[(backend, True)]
    assert plain[0] == bucketed[0]
    for i in (1, 2):  # step-0 gradients, final parameters
        diff = [n for n in plain[i] if not torch.equal(plain[i][n], bucketed[i][n])]
        assert not diff, f"{backend}: not bitwise equal to {reference}: {diff}"


def test_every_rank_issues_the_same_collectives_in_the_same_order():
    """What keeps a 3-D mesh from hanging: on every process group, every rank issues the same
    collectives in the same order (ranks differ only in which TP shard they hold)."""
    results = run_layout((1, 2, 2, "fully_shard"))
    for case in (("aot_eager_blockbucketing", True), ("aot_eager_autobucketing", True)):
        orders = [r[case][3] for r in results]
        for kind in ("fw", "bw"):
            first = orders[0][(kind, "order")]
            assert {g for g, _, _ in first} == {"dp_shard", "tp"}
            for rank, o in enumerate(orders[1:], 1):
                assert o[(kind, "order")] == first, (case, kind, rank)


def _by(counts, kind, stage, group):
    return {k: n for (g, k), n in counts[(kind, stage)].items() if g == group}


def test_tp_collectives_untouched_and_dp_one_per_block_bucket():
    results = run_layout((1, 2, 2, "fully_shard"))[0]
    n_blocks = ARGS["n_layers"]
    for backend in ("aot_eager_blockbucketing", "aot_eager_autobucketing"):
        counts = results[(backend, True)][3]
        for kind in ("fw", "bw"):
            tp_before = _by(counts, kind, "before", "tp")
            assert sum(tp_before.values()) > 0, (backend, kind, counts)  # SP collectives exist
            assert _by(counts, kind, "after", "tp") == tp_before, (backend, kind, counts)
    block = results[("aot_eager_blockbucketing", True)][3]
    # one bucket per block + embeddings (pre) + final norm/output (post), as without TP
    assert _by(block, "fw", "after", "dp_shard") == {"all_gather": n_blocks + 2}
    assert _by(block, "bw", "after", "dp_shard")["reduce_scatter"] == n_blocks + 2
    # before bucketing: one all-gather per parameter (9 per block + 3 outside blocks)
    assert _by(block, "fw", "before", "dp_shard") == {"all_gather": 9 * n_blocks + 3}
    plain = results[("aot_eager", True)][3]
    assert _by(plain, "fw", "after", "dp_shard") == {"all_gather": 9 * n_blocks + 3}
    # ragged buckets: one all-gather and one reduce-scatter per bucket (a block's TP shards
    # and its norms, the embedding, the final norm, the output projection), which block
    # bucketing leaves apart: merged, a bucket's gather would be copied out of the merge's
    ragged = results[("ragged:aot_eager_blockbucketing", True)][3]
    assert _by(ragged, "fw", "before", "dp_shard") == {"all_gather": 2 * n_blocks + 3}
    assert _by(ragged, "fw", "after", "dp_shard") == {"all_gather": 2 * n_blocks + 3}
    assert _by(ragged, "bw", "after", "dp_shard")["reduce_scatter"] == 2 * n_blocks + 3
    for kind in ("fw", "bw"):  # TP's collectives as with per-parameter shards
        assert _by(ragged, kind, "after", "tp") == _by(block, kind, "after", "tp"), kind


class UnevenMLP(torch.nn.Module):
    """Sizes that split unevenly: 10 hidden units over tp 2 → 5 rows per TP shard, which dp 2
    splits 3 + 2 (the strided shard's uneven case); 7 outputs over dp 2 → 4 + 3."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(6, 10)
        self.down = torch.nn.Linear(10, 7, bias=False)
        self.norm = torch.nn.LayerNorm(7)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


UNEVEN_BACKENDS = ("eager", "aot_eager_blockbucketing", "eager-bf16", "ragged:eager")


def _uneven_job(rank, world):
    return {b: _uneven_case(rank, b) for b in UNEVEN_BACKENDS}


def _uneven_case(rank, backend):
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    import simplesharded as ss

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = UnevenMLP()
    mesh = ss.build_mesh(1, 2, "cpu", tp=2)
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    param_dtype = torch.bfloat16 if backend.endswith("bf16") else torch.float32
    storage, backend = storage_and_backend(backend.removesuffix("-bf16"))
    # each dp rank's loss is a sum over its rows: the reference's loss is their sum
    ss.data_parallel(model, mesh, mp_policy=ss.MixedPrecisionPolicy(param_dtype, torch.float32),
                     grad_reduction="sum", storage=storage)
    seen = []
    model.up.register_forward_hook(lambda m, i, o: seen.append(m.weight.dtype))
    step_fn = model if backend == "eager" else torch.compile(
        model, backend=ss.make_backend(backend), fullgraph=True)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    dp = rank // 2
    loss = (step_fn(x[2 * dp:2 * dp + 2]) * _target()[2 * dp:2 * dp + 2]).sum()
    loss.backward()
    shapes = {n: tuple(v.to_local().shape) for n, v in model.state_dict().items()}
    if backend == "eager":  # mixed precision: gathered in param_dtype, reduced onto fp32
        assert seen == [param_dtype], seen
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    return by_member(model, grads=True), shapes


def _target():
    # a fixed random projection (the sum of a LayerNorm's squares would be ~constant, its
    # gradient ~0 and pure rounding noise)
    return torch.randn(4, 7, generator=torch.Generator().manual_seed(2))


def run_uneven():
    return [r["uneven"] for r in _run(4)]


@pytest.mark.parametrize("backend", UNEVEN_BACKENDS)
def test_uneven_strided_shards(backend):
    """Uneven strided shards give the reference gradients; with bf16 parameters (mixed
    precision) within bf16 rounding."""
    torch.manual_seed(0)
    ref = UnevenMLP()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    (ref(x) * _target()).sum().backward()
    results = [r[backend] for r in run_uneven()]
    grads, _ = results[0]
    tol = 2e-2 if backend.endswith("bf16") else TOL  # bf16 has an 8-bit mantissa
    for n, p in ref.named_parameters():
        assert max_rel_diff(grads[n], p.grad) <= tol, n
    # the layout really is uneven: dp ranks 0 and 1 of TP shard 0 hold 3 and 2 rows of up
    assert results[0][1]["up.weight"] == (3, 6) and results[2][1]["up.weight"] == (2, 6)


def test_float8_under_tp_trains_as_one_process_and_gathers_in_float8():
    """training.float8 with TP (dp 2 x tp 2, sequence parallel, compiled): the losses of the
    one-process float8 model (fp32 rounding apart, which a float8 cast can turn into one
    float8 step: 1e-3), and the weights gathered over dp as float8 bytes, their scale's amax
    all-reduced over dp and then over tp (TP's own reduction of the sharded weight's amax)."""
    results = _run(4)
    want = float8_reference(2)
    for rank, (losses, counts) in enumerate(r["float8"] for r in results):
        assert all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(losses, want)), (losses, want)
        assert counts == results[0]["float8"][1], rank  # every rank the same collectives
    counts = results[0]["float8"][1]
    # 7 Linears per block (wq, wk, wv, wo, w1, w2, w3), 2 blocks: one float8 gather each
    assert counts[("dp_shard", "all_gather", "torch.uint8")] == 7 * 2, counts
    assert counts[("dp_shard", "all_reduce", "torch.float32")] >= 7 * 2, counts
    assert counts[("tp", "all_reduce", "torch.float32")] >= 7 * 2, counts
