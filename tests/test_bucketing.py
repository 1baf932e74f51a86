"""Fast single-process tests of the bucketing pass (passes/bucketing.py) on real traced graphs
(support/traced_graphs.py: the toy model's forward and backward graphs at world sizes 2 and 8):

1. same outputs, bitwise: graphs are executed by a simulating interpreter (pass_utils) before
   and after bucketing (then reordering) on the same random inputs;
2. counts after block bucketing (one collective per bucket and dtype);
3. idempotence, with BlockPlan and AutoPlan.
"""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from simplesharded.passes.bucketing import bucket_collectives
from simplesharded.passes.plans import AutoPlan, BlockPlan
from simplesharded.passes.reordering import reorder_for_overlap

import pass_utils as pu
from traced_graphs import (CONFIGS, N_LAYERS, assert_bitwise_same, auto_bucketed, block_bucketed,
                           graph, graphs, my_block, served, sizes)

# autouse, as in every pass test file: no test may leave a process group behind
from traced_graphs import _no_leaked_process_group  # noqa: F401


# ---------------------------------------------------------------------- 1. bitwise outputs

PLANS = {  # AutoPlan ("auto": default cap, "auto-6k": 6000 bytes) goes through auto_bucketed
    "block": lambda: BlockPlan(),
    "block-patterns": lambda: BlockPlan(patterns=(r"layers\.\d+\.attention\b",)),
}
BITWISE_CASES = ([(c, w, "block") for c in CONFIGS for w in ("fw", "bw")]
                 + [(c, w, "block-patterns") for c in ("w2", "w8-bf16") for w in ("fw", "bw")]
                 + [("w2", "fw", "auto"), ("w8-bf16", "bw", "auto"), ("w2", "bw", "auto"),
                    ("w8-bf16", "fw", "auto"), ("w2", "fw", "auto-6k"),
                    ("w8-bf16", "bw", "auto-6k")])


@pytest.mark.parametrize("config,which,plan", BITWISE_CASES,
                         ids=["-".join(c) for c in BITWISE_CASES])
def test_bucket_and_reorder_preserve_outputs_bitwise(config, which, plan):
    world, g = graph(config, which)
    if plan.startswith("auto"):
        bucketed = auto_bucketed(config, which, 6000 if plan == "auto-6k" else None)
    else:
        bucketed = bucket_collectives(pu.fresh(g), PLANS[plan]())
    n_ref, n_bucketed = assert_bitwise_same(g, bucketed, world)
    if n_ref > 1:
        assert n_bucketed < n_ref, "bucketing merged nothing"
    for cap in (None, max(sizes(bucketed), default=0), sum(sizes(bucketed))):
        reordered = reorder_for_overlap(pu.fresh(bucketed), BlockPlan(memory_cap_bytes=cap))
        pu.check_waits_before_use(reordered)
        assert_bitwise_same(g, reordered, world, seed=1)


def test_simulation_detects_a_wrong_layout():
    """Sanity check of the oracle: swapping two rows of a bucketed all-gather's [ws, L] view
    (rank 1's data read as rank 0's) must change the outputs."""
    world, g = graph("w2", "fw")
    bucketed = bucket_collectives(pu.fresh(g), BlockPlan())
    broken = pu.fresh(bucketed)
    ag = max(pu.starts(broken, pu.AG), key=pu._nbytes)
    rows = next(u for u in pu.the_wait(ag).users if u.target == torch.ops.aten.view.default)
    with broken.graph.inserting_after(rows):
        flipped = broken.graph.call_function(torch.ops.aten.flip.default, (rows, [0]))
    rows.replace_all_uses_with(flipped, delete_user_cb=lambda u: u is not flipped)
    broken.recompile()
    inputs = pu.make_inputs(g)
    ref, _ = pu.run_simulated(bucketed, inputs, world)
    out, _ = pu.run_simulated(broken, inputs, world)
    assert not pu.bitwise_equal(ref, out)


# ---------------------------------------------------------------------------- 2. counts


def expected_counts(config: str) -> dict[str, dict[str, int]]:
    """One collective per (bucket, dtype): buckets embed, layers.0-3, head."""
    extra = 1 if config == "w8-bf16" else 0  # layers.1 holds fp32 and bf16 params
    reshard = "noreshard" not in config
    # backward re-gathers every bucket except the embedding (its backward needs only the token
    # ids), and only when resharding after forward; "auto" keeps the last block and the head
    regathered = {"w2-noreshard": 0, "w2-auto": N_LAYERS - 1}.get(config, N_LAYERS + 1 + extra)
    return {"fw": {"all_gather": N_LAYERS + 2 + extra, "reduce_scatter": 0, "all_reduce": 0},
            "bw": {"all_gather": regathered,
                   "reduce_scatter": N_LAYERS + 2 + extra, "all_reduce": 0}}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_block_counts(config):
    world, fw, bw = graphs(config)
    want = expected_counts(config)
    for which, g in (("fw", fw), ("bw", bw)):
        before = {k: served(g, t) for k, t in (("all_gather", pu.AG), ("reduce_scatter", pu.RS))}
        assert all(len(p) == 1 for rows in before.values() for p, *_ in rows)
        after_gm = block_bucketed(config, which)
        assert pu.collective_counts(after_gm) == want[which], which
        for kind, target in (("all_gather", pu.AG), ("reduce_scatter", pu.RS)):
            after = served(after_gm, target)
            # every parameter is still served exactly once, by a collective of its own dtype
            assert sorted(p for ps, *_ in after for p in ps) == \
                sorted(p for ps, *_ in before[kind] for p in ps), (which, kind)
            dtype_of = {ps[0]: dt for ps, dt, *_ in before[kind]}
            per_bucket_dtype = defaultdict(int)
            for ps, dt, _, _ in after:
                assert {my_block(p) for p in ps} == {my_block(ps[0])}, ps
                assert {dtype_of[p] for p in ps} == {dt}, ps
                per_bucket_dtype[(my_block(ps[0]), dt)] += 1
            assert set(per_bucket_dtype.values()) <= {1}, (which, kind, per_bucket_dtype)
    if not want["bw"]["all_gather"]:
        assert pu.collective_counts(bw)["all_gather"] == 0


def test_bf16_bucket_dtypes():
    """A block with fp32 attention and bf16 feed-forward gets one all-gather and one
    reduce-scatter per dtype; an all-bf16 block gets one bf16 collective of each kind."""
    for config, block, want in (("w8-bf16", "layers.1", {torch.float32, torch.bfloat16}),
                                ("w8-bf16", "layers.2", {torch.bfloat16})):
        for which in ("fw", "bw"):
            gm = block_bucketed(config, which)
            for target in (pu.AG, pu.RS):
                rows = [r for r in served(gm, target) if my_block(r[0][0]) == block]
                if not rows:
                    continue
                assert sorted(str(dt) for _, dt, *_ in rows) == sorted(map(str, want)), \
                    (config, which, target)
    fw = block_bucketed("w8-bf16", "fw")
    bf16 = [sorted(ps) for ps, dt, *_ in served(fw, pu.AG)
            if dt == torch.bfloat16 and ps[0].startswith("layers.1.")]
    assert bf16 == [sorted(["layers.1.ffn_norm.weight", "layers.1.feed_forward.w1.weight",
                            "layers.1.feed_forward.w2.weight", "layers.1.feed_forward.w3.weight"])]



# ----------------------------------------------------------------------- 4. idempotence


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("which", ["fw", "bw"])
def test_block_bucketing_idempotent(config, which):
    once = block_bucketed(config, which)
    twice = bucket_collectives(pu.fresh(once), BlockPlan())
    assert pu.graph_signature(twice) == pu.graph_signature(once)


@pytest.mark.parametrize("config,which,cap", [
    ("w2", "fw", 6000), ("w2", "bw", None),
    ("w8-bf16", "fw", None), ("w8-bf16", "bw", 6000)])
def test_auto_bucketing_idempotent(config, which, cap):
    once = auto_bucketed(config, which, cap)
    twice = bucket_collectives(pu.fresh(once), AutoPlan(memory_cap_bytes=cap))
    assert pu.graph_signature(twice) == pu.graph_signature(once)
