"""Fast single-process tests of the reordering pass (passes/reordering.py) on real traced graphs
(support/traced_graphs.py: the toy model's forward and backward graphs at world sizes 2 and 8):

1. same outputs, bitwise, of reordering alone (with bucketing: tests/test_bucketing.py);
2. order: waits before first use, one-bucket-ahead prefetch with the default cap, gathered bytes
   in flight ≤ cap (hypothesis over caps), a one-bucket cap disables prefetch, at most one
   reduction in flight;
3. idempotence.
Plus hand-built 2-4 layer chains (pass_utils.chain_graph: minimal reproductions).
"""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from simplesharded.passes.plans import BlockPlan
from simplesharded.passes.reordering import PREFETCH_AHEAD, reorder_for_overlap

import pass_utils as pu
from traced_graphs import (FP32, HYPO, N_LAYERS, assert_bitwise_same, block_bucketed, graph,
                           my_block, sizes)

# autouse, as in every pass test file: no test may leave a process group behind
from traced_graphs import _no_leaked_process_group  # noqa: F401


# -------------------------------------------------------------------------------- helpers


def bucket_first_uses(gm) -> list[tuple[str, list[object], int]]:
    """Block buckets in order of first use: (bucket, its all-gather starts, first use)."""
    use = pu.first_uses(gm)
    by_bucket: dict[str, list] = defaultdict(list)
    for s in use:
        keys = {my_block(p) for p in pu.node_params(s)}
        assert len(keys) == 1, f"{s} serves several blocks: {keys}"
        by_bucket[keys.pop()].append(s)
    rows = [(b, ss_, min(use[s] for s in ss_)) for b, ss_ in by_bucket.items()]
    return sorted(rows, key=lambda r: r[2])


def assert_one_reduction_in_flight(gm):
    iv = sorted(pu.reduction_intervals(gm))
    for (s0, w0, a), (s1, w1, b) in zip(iv, iv[1:]):
        assert w0 < s1, f"{a} still in flight when {b} starts"


def assert_reductions_overlap_compute(gm):
    """Every reduction but the last has computation (not a view or copy, not a collective)
    between its start and its wait: the wait is not pinned next to its start (by the 1/N
    averaging that reads its result, for one)."""
    work = [i for i, n in enumerate(gm.graph.nodes)
            if n.op == "call_function" and n.target not in (pu.AG, pu.RS, pu.AR, pu.WAIT)
            and not pu._is_chain_op(n)]
    for s, w, node in sorted(pu.reduction_intervals(gm))[:-1]:
        assert any(s < i < w for i in work), f"{node}: nothing computed while it is in flight"


@pytest.mark.parametrize("config,which", [("w2", "fw"), ("w8", "bw")])
def test_reorder_alone_preserves_outputs_bitwise(config, which):
    """Reordering the unbucketed (per-parameter) graph is also only a permutation."""
    world, g = graph(config, which)
    reordered = reorder_for_overlap(pu.fresh(g), BlockPlan())
    pu.check_waits_before_use(reordered)
    # only moves nodes: same nodes (by name), same targets
    assert sorted((n.name, str(n.target)) for n in reordered.graph.nodes) == \
        sorted((n.name, str(n.target)) for n in g.graph.nodes)
    assert_bitwise_same(g, reordered, world)


# ----------------------------------------------------------------------------- 3. order


@pytest.mark.parametrize("config", ["w2", "w8", "w8-bf16"])
@pytest.mark.parametrize("which", ["fw", "bw"])
def test_order_default_cap(config, which):
    """Default cap (the floor without prefetch plus the largest bucket): every wait before its
    use, every bucket's all-gather issued before the compute of the previous bucket, gathered
    bytes alive ≤ cap, at most one reduction in flight; with fp32 blocks the current bucket
    and up to PREFETCH_AHEAD prefetched ones are alive at once."""
    floor = pu.gathered_bytes_in_flight(
        reorder_for_overlap(block_bucketed(config, which), BlockPlan(memory_cap_bytes=1)))
    gm = reorder_for_overlap(block_bucketed(config, which), BlockPlan())
    pu.check_waits_before_use(gm)
    assert floor < pu.gathered_bytes_in_flight(gm) <= floor + max(sizes(gm))
    pos = pu._pos(gm)
    rows = bucket_first_uses(gm)
    assert len(rows) == (N_LAYERS + 2 if which == "fw" else N_LAYERS + 1)
    for (prev, _, prev_use), (cur, starts, _) in zip(rows, rows[1:]):
        for s in starts:
            assert pos[s] < prev_use, f"{cur} issued after {prev}'s compute began"
    assert pu.prefetch_depth(gm) >= 1
    if config in FP32:
        assert 2 <= pu.max_gathers_alive(gm) <= 1 + PREFETCH_AHEAD
    assert_one_reduction_in_flight(gm)
    assert_reductions_overlap_compute(gm)


@pytest.mark.parametrize("config", FP32)
@pytest.mark.parametrize("which", ["fw", "bw"])
def test_one_bucket_cap_disables_prefetch(config, which):
    """A cap of the largest bucket (below the floor: its copy-outs double it): no gathered
    buffer is alive while another one is, i.e. every all-gather is issued after the previous
    bucket's compute began; the bytes alive are the floor, the largest bucket copied out."""
    bucketed = block_bucketed(config, which)
    largest = max(sizes(bucketed))
    gm = reorder_for_overlap(bucketed, BlockPlan(memory_cap_bytes=largest))
    pu.check_waits_before_use(gm)
    assert pu.gathered_bytes_in_flight(gm) == 2 * largest
    assert pu.max_gathers_alive(gm) == 1
    assert pu.prefetch_depth(gm) == 0


@pytest.mark.parametrize("config,which", [("w2", "fw"), ("w8", "bw"), ("w8-bf16", "fw"),
                                          ("w8-bf16", "bw")])
@HYPO
@given(frac=st.floats(0.0, 1.0))
def test_bytes_in_flight_within_cap(config, which, frac):
    """Any cap from the floor (the largest bucket and its copy-outs) to all buckets plus the
    largest one's copy-outs: gathered bytes alive never exceed it; prefetch goes two buckets
    ahead at most (PREFETCH_AHEAD), and that far once the cap has room for two buckets above
    the floor."""
    bucketed = block_bucketed(config, which)
    szs = sizes(bucketed)
    floor = pu.gathered_bytes_in_flight(
        reorder_for_overlap(pu.fresh(bucketed), BlockPlan(memory_cap_bytes=1)))
    cap = int(2 * max(szs) + frac * (sum(szs) - max(szs)))
    gm = reorder_for_overlap(bucketed, BlockPlan(memory_cap_bytes=cap))
    pu.check_waits_before_use(gm)
    assert pu.gathered_bytes_in_flight(gm) <= cap
    assert_one_reduction_in_flight(gm)
    depths = [d for _, d in pu.prefetch_depths(gm)]  # counted in gathers: one per bucket in fp32
    if config in FP32:
        assert max(depths) <= PREFETCH_AHEAD
    if config in FP32 and cap >= floor + 2 * max(szs):
        assert depths == [min(i, PREFETCH_AHEAD) for i in range(len(depths))]


def test_first_backward_gather_issued_at_graph_start():
    """With the last block kept gathered, backward begins with that block's compute and its
    reduce-scatter; the first re-gather must not queue behind them: it is issued before any
    matmul and before the first reduce-scatter (prefetch from the graph's start)."""
    out = reorder_for_overlap(block_bucketed("w2-auto", "bw"), BlockPlan())
    nodes = list(out.graph.nodes)

    def first(pred):
        return next(i for i, n in enumerate(nodes) if pred(n))

    ag = first(lambda n: n.target is pu.AG)
    assert ag < first(lambda n: n.target is pu.RS)
    assert ag < first(lambda n: n.target is torch.ops.aten.mm.default)


def test_prefetch_without_reshard_after_forward():
    gm = reorder_for_overlap(block_bucketed("w2-noreshard", "fw"), BlockPlan())
    pos = pu._pos(gm)
    rows = bucket_first_uses(gm)
    for (prev, _, prev_use), (cur, starts, _) in zip(rows, rows[1:]):
        for s in starts:
            assert pos[s] < prev_use, f"{cur} issued after {prev}'s compute began"


# Hand-built chains (pass_utils.chain_graph): the same properties on a 4-line graph, and minimal
# reproductions of the two reordering problems found on the traced graphs.


def test_handbuilt_chain_prefetch_and_cap():
    gm = pu.chain_graph(4)
    ref = pu.run_simulated(gm, pu.make_inputs(gm), 2)[0]
    one = pu._nbytes(pu.starts(gm, pu.AG)[0])
    out = reorder_for_overlap(pu.fresh(gm), BlockPlan())  # default cap: 2 buffers
    pu.check_waits_before_use(out)
    assert [d for _, d in pu.prefetch_depths(out)] == [0, 1, 1, 1]
    assert pu.gathered_bytes_in_flight(out) == 2 * one
    assert pu.bitwise_equal(pu.run_simulated(out, pu.make_inputs(gm), 2)[0], ref)
    out = reorder_for_overlap(pu.fresh(gm), BlockPlan(memory_cap_bytes=one))
    assert pu.prefetch_depth(out) == 0 and pu.max_gathers_alive(out) == 1
    out = reorder_for_overlap(pu.fresh(gm), BlockPlan(memory_cap_bytes=4 * one))
    assert [d for _, d in pu.prefetch_depths(out)] == [0, 1, 2, 2]  # PREFETCH_AHEAD at most


def test_handbuilt_chain_reordering_idempotent():
    """Minimal regression for the bug fixed in e27df76: x@AG(s0)@AG(s1) used to give
    [ag0, wait0, ag1, mm0, ...] once and [ag0, ag1, wait0, mm0, ...] twice."""
    once = reorder_for_overlap(pu.chain_graph(2), BlockPlan())
    order = [n.name for n in once.graph.nodes]
    twice = reorder_for_overlap(once, BlockPlan())
    assert [n.name for n in twice.graph.nodes] == order


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_span_index_finds_what_a_scan_finds(data):
    """Prefetch's fit tests ask gathered_spans.SpanIndex for the spans overlapping a range; it
    must answer what a scan of every span does, also after spans' first positions move
    (hoisted gathers), with repeated positions and empty answers."""
    from simplesharded.passes.gathered_spans import SpanIndex

    pos = st.integers(0, 40)
    n = data.draw(st.integers(0, 12))
    spans = []
    for key in range(n):
        first, length = data.draw(pos), data.draw(st.integers(0, 15))
        spans.append((first, first + length, data.draw(st.integers(1, 9)), key))
    index = SpanIndex(spans + [(3, 5, 7, None)])  # a fixed span: no key, never moves
    live = {key: span for *span, key in spans}
    for _ in range(data.draw(st.integers(1, 6))):
        if live and data.draw(st.booleans()):  # a hoist: the span begins earlier
            key = data.draw(st.sampled_from(sorted(live)))
            first = data.draw(st.integers(0, live[key][0]))
            live[key] = [first, *live[key][1:]]
            index.move(key, first)
        lo = data.draw(pos)
        hi = data.draw(st.integers(lo, 45))
        expected = sorted((first, last, nbytes) for first, last, nbytes in
                          [*live.values(), (3, 5, 7)] if first <= hi and last >= lo)
        assert sorted(span[:3] for span in index.overlapping(lo, hi)) == expected


def test_handbuilt_chain_prefetch_with_saved_gathers():
    out = reorder_for_overlap(pu.chain_graph(3, save_gathered=True), BlockPlan())
    assert pu.prefetch_depth(out) >= 1


def test_handbuilt_foreign_all_to_all_is_never_delayed():
    """An all-to-all that is not ours (expert parallelism's token exchange) keeps its place:
    every node after its start in the input stays after it. Layer 2's gather, which the
    default cap prefetches one bucket ahead (before layer 1's matmul, as in the plain chain),
    is issued right after the all-to-all's start instead, overlapping the exchange."""
    plain = reorder_for_overlap(pu.chain_graph(4), BlockPlan())
    assert [d for _, d in pu.prefetch_depths(plain)] == [0, 1, 1, 1]
    gm = pu.chain_graph(4, all_to_all_after=1)
    ref = [n.name for n in gm.graph.nodes]
    a2a = pu.starts(gm, pu.A2A)[0].name
    behind = set(ref[ref.index(a2a) + 1:])
    out = reorder_for_overlap(pu.fresh(gm), BlockPlan())
    pu.check_waits_before_use(out)
    names = [n.name for n in out.graph.nodes]
    assert behind <= set(names[names.index(a2a) + 1:])
    gather2 = next(n.name for n in pu.starts(out, pu.AG)
                   if pu.node_params(n) == ["layers.2.weight"])
    assert names.index(gather2) == names.index(a2a) + 1
    assert [n.name for n in reorder_for_overlap(out, BlockPlan()).graph.nodes] == names


def _gather_of(gm, layer: int):
    return next(n for n in pu.starts(gm, pu.AG)
                if pu.node_params(n) == [f"layers.{layer}.weight"])


def _foreign_and_compute(gm) -> list[str]:
    """The all-to-all, its wait and the compute around them (matmuls, relu), in graph order."""
    a2a = pu.starts(gm, pu.A2A)[0]
    return [n.name for n in gm.graph.nodes
            if n is a2a or n is pu.the_wait(a2a)
            or n.target in (torch.ops.aten.mm.default, torch.ops.aten.relu.default)]


def test_handbuilt_prefetch_crosses_foreign_collective_of_another_group():
    """The same all-to-all on another process group than the gathers' (as TP's collectives on
    the tp group): layer 2's gather is prefetched one bucket ahead as in the plain chain,
    which issues it ahead of the all-to-all's start; the all-to-all, its wait and the compute
    keep their order, and a second run changes nothing."""
    gm = pu.chain_graph(4, all_to_all_after=1, all_to_all_group="1")
    around = _foreign_and_compute(gm)
    out = reorder_for_overlap(pu.fresh(gm), BlockPlan())
    pu.check_waits_before_use(out)
    assert [d for _, d in pu.prefetch_depths(out)] == [0, 1, 1, 1]  # as without the all-to-all
    names = [n.name for n in out.graph.nodes]
    assert names.index(_gather_of(out, 2).name) < names.index(pu.starts(out, pu.A2A)[0].name)
    assert _foreign_and_compute(out) == around
    assert [n.name for n in reorder_for_overlap(out, BlockPlan()).graph.nodes] == names


def test_handbuilt_prefetch_stays_behind_foreign_collective_of_its_group():
    """On the gathers' own group the all-to-all stays a barrier, as before: layer 2's gather
    is issued right after its start (as in test_handbuilt_foreign_all_to_all_is_never_delayed),
    a bucket less ahead than on another group."""
    out = reorder_for_overlap(pu.chain_graph(4, all_to_all_after=1, all_to_all_group="0"),
                              BlockPlan())
    names = [n.name for n in out.graph.nodes]
    a2a = pu.starts(out, pu.A2A)[0].name
    assert names.index(_gather_of(out, 2).name) == names.index(a2a) + 1
    assert [d for _, d in pu.prefetch_depths(out)] == [0, 1, 0, 1]


def test_handbuilt_prefetch_never_drags_a_foreign_collective_it_reads():
    """A gather whose input reads the result of another group's all-to-all (through pure ops,
    which move with the start) is hoisted no further than right after that all-to-all's wait:
    hoisted ahead of layer 1's wait as in the plain chain, it would take them along."""
    aten = torch.ops.aten
    gm = pu.chain_graph(4)
    gather2 = _gather_of(gm, 2)
    x, shard = next(iter(gm.graph.nodes)), gather2.args[0]

    def op(target, *args, val):
        node = gm.graph.call_function(target, args)
        node.meta["val"] = val
        return node

    with gm.graph.inserting_before(gather2):  # reads x alone: layer 1's wait is no input
        a2a = op(pu.A2A, x, [1, 1], [1, 1], "1", val=x.meta["val"] + 0)
        wait = op(pu.WAIT, a2a, val=x.meta["val"] + 0)
        total = op(aten.sum.default, wait, val=x.meta["val"].sum())
        fed = op(aten.add.Tensor, shard, total, val=shard.meta["val"] + 0)
    gather2.args = (fed, *gather2.args[1:])
    gm.recompile()

    def kept(gm):  # what must keep its order: the all-to-all, its wait, the matmuls
        return [n.name for n in gm.graph.nodes
                if n is a2a or n is wait or n.target is aten.mm.default]

    around = kept(gm)
    out = reorder_for_overlap(gm, BlockPlan())
    pu.check_waits_before_use(out)
    assert kept(out) == around
    names = [n.name for n in out.graph.nodes]
    at = names.index(wait.name)
    assert names[at + 1:at + 4] == [total.name, fed.name, gather2.name]


# ----------------------------------------------------------------------- idempotence


@pytest.mark.parametrize("config,which", [("w2", "fw"), ("w2", "bw"), ("w8", "fw"),
                                          ("w8-bf16", "bw")])
@pytest.mark.parametrize("cap", ["one-bucket", "default", "all"])
def test_reordering_idempotent(config, which, cap):
    """No prefetch, one-ahead prefetch, everything ahead: a second run changes nothing.
    (Regression: before e27df76 a second run moved bucket j-1's wait after bucket j's
    prefetched start whenever the first run prefetched.)"""
    bucketed = block_bucketed(config, which)
    szs = sizes(bucketed)
    plan = BlockPlan(memory_cap_bytes={"one-bucket": max(szs), "default": None,
                                       "all": sum(szs)}[cap])
    once = reorder_for_overlap(bucketed, plan)
    twice = reorder_for_overlap(pu.fresh(once), plan)
    assert pu.graph_signature(twice) == pu.graph_signature(once)
