"""Fast single-process tests of the bucket plans (passes/plans.py) on real traced graphs
(support/traced_graphs.py) and hand-built chains: BlockPlan with user patterns; AutoPlan
(merging, memory cap, its candidates, its trials on the graph itself); graph_utils.NodeOrder,
which the trials' edits keep up to date.
"""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from simplesharded.passes.bucketing import bucket_collectives
from simplesharded.passes.plans import AutoPlan, BlockPlan
from simplesharded.passes.reordering import reorder_for_overlap

import pass_utils as pu
from traced_graphs import (HYPO, N_LAYERS, assert_bitwise_same, auto_bucketed, block_bucketed,
                           graph, graphs, served, sizes)

# autouse, as in every pass test file: no test may leave a process group behind
from traced_graphs import _no_leaked_process_group  # noqa: F401


# ------------------------------------------------------------------------------ BlockPlan


def test_block_plan_user_patterns():
    """A pattern's match names the bucket: every block's attention weights get their own
    bucket, the rest of the block (its norms, feed-forward) stays in the default one."""
    plan = BlockPlan(patterns=(r"layers\.\d+\.attention\b",))
    for config in ("w2", "w8"):
        world, fw, bw = graphs(config)
        for which, g in (("fw", fw), ("bw", bw)):
            gm = bucket_collectives(pu.fresh(g), plan)
            for target in (pu.AG, pu.RS):
                rows = served(gm, target)
                if not rows:
                    continue
                buckets = sorted(sorted(ps) for ps, *_ in rows)
                for i in range(N_LAYERS):
                    attn = sorted(f"layers.{i}.attention.{w}.weight" for w in ("wq", "wk", "wv",
                                                                           "wo"))
                    rest = sorted([f"layers.{i}.attention_norm.weight",
                                   f"layers.{i}.ffn_norm.weight"]
                                  + [f"layers.{i}.feed_forward.{w}.weight"
                                     for w in ("w1", "w2", "w3")])
                    assert attn in buckets and rest in buckets, (config, which, target, i)
                n_outside = 1 if (which == "bw" and target is pu.AG) else 2
                assert len(rows) == 2 * N_LAYERS + n_outside, (config, which, target)


@pytest.mark.parametrize("plan", ["block", "auto"])
def test_plans_leave_ragged_buckets_alone(plan):
    """A collective marked as a ragged bucket's (RAGGED_KEY) keeps its own collective, since
    merged, its gathered buffer would be copied out. Under the block plan the rest of its
    block still merges into one bucket; under either, the graph computes bitwise what it
    did."""
    from simplesharded.passes.annotations import PARAM_KEY, RAGGED_KEY

    world, fw, bw = graphs("w2")
    for which, g in (("fw", fw), ("bw", bw)):
        gm = pu.fresh(g)
        for target in (pu.AG, pu.RS):
            for start in pu.starts(gm, target):
                param = start.meta.get("custom", {}).get(PARAM_KEY, "")
                if ".attention.wq." in param or ".feed_forward.w2." in param:
                    start.meta["custom"] = {**start.meta["custom"], RAGGED_KEY: param}
        gm = bucket_collectives(gm, BlockPlan() if plan == "block" else AutoPlan())
        for target in (pu.AG, pu.RS):
            rows = served(gm, target)
            if not rows:
                continue
            buckets = [sorted(ps) for ps, *_ in rows]
            assert len(buckets) < len(pu.starts(g, target)), (which, target)  # others merged
            for i in range(N_LAYERS):
                alone = [f"layers.{i}.attention.wq.weight", f"layers.{i}.feed_forward.w2.weight"]
                for fqn in alone:
                    assert [fqn] in buckets, (which, target, fqn, buckets)
                rest = [b for b in buckets if any(p.startswith(f"layers.{i}.") for p in b)
                        and b not in ([fqn] for fqn in alone)]
                if plan == "block":
                    assert len(rest) == 1 and len(rest[0]) == 7, (which, target, i, rest)
        assert_bitwise_same(g, gm, world)


# ------------------------------------------------------------------------------- AutoPlan


def _anchor_order(g, target) -> list[str]:
    """Per-parameter collectives in the order AutoPlan documents (first use of the gathered
    value for all-gathers, issue order for reductions)."""
    pos = pu._pos(g)
    rows = []
    for s in pu.starts(g, target):
        w = pu.the_wait(s)
        key = min(pos[u] for u in w.users) if target is pu.AG and w.users else pos[s]
        rows.append((key, pu.node_params(s)[0]))
    return [p for _, p in sorted(rows)]


def _auto_buckets(gm, target) -> dict[str, list[str]]:
    """AutoPlan bucket key → parameters, over its collectives of every dtype."""
    out: dict[str, list[str]] = defaultdict(list)
    for s in pu.starts(gm, target):
        custom = s.meta.get("custom") or {}
        key = custom.get("ss_bucket", "single:" + pu.node_params(s)[0])
        out[key] += pu.node_params(s)
    return out


@pytest.mark.parametrize("config", ["w2", "w8-bf16"])
def test_auto_plan_merges(config):
    """With the default cap on the local profile (0.5 ms per collective: latency-bound for this
    toy), AutoPlan merges the 39 per-parameter collectives of each kind into far fewer."""
    world, fw, bw = graphs(config)
    for which, g in (("fw", fw), ("bw", bw)):
        before = pu.collective_counts(g)
        after = pu.collective_counts(auto_bucketed(config, which, None))
        for kind in ("all_gather", "reduce_scatter"):
            if before[kind]:
                assert after[kind] * 3 <= before[kind], (kind, before, after)


def check_auto_plan_contract(config, which, cap):
    """AutoPlan(memory_cap_bytes=cap): every bucket (over all its dtypes) holds ≤ cap/6
    full-size bytes (a reduce-scatter's input is world × its output) and is a run of
    consecutive collectives; fewer collectives than parameters; reordering with the same cap
    (as the backend does) keeps gathered bytes in flight ≤ cap."""
    world, g = graph(config, which)
    full = {pu.AG: 1, pu.RS: world}
    gm = auto_bucketed(config, which, cap)
    for target in (pu.AG, pu.RS):
        before = served(g, target)
        if not before:
            continue
        order = _anchor_order(g, target)
        nbytes = {ps[0]: n * full[target] for ps, _, n, _ in before}
        assert len(pu.starts(gm, target)) < len(before)
        for key, params in _auto_buckets(gm, target).items():
            assert sum(nbytes[p] for p in params) <= cap // 6, (key, params)
            idx = sorted(order.index(p) for p in params)
            assert idx == list(range(idx[0], idx[0] + len(idx))), f"{key} not consecutive"
    reordered = reorder_for_overlap(gm, BlockPlan(memory_cap_bytes=cap))
    pu.check_waits_before_use(reordered)
    assert pu.gathered_bytes_in_flight(reordered) <= cap


@pytest.mark.parametrize("config,which", [("w2", "fw"), ("w8-bf16", "bw")])
@settings(HYPO, max_examples=4)
@given(frac=st.floats(0.0, 1.0))
def test_auto_plan_respects_large_caps(config, which, frac):
    """Caps from two transformer blocks up to everything (see check_auto_plan_contract)."""
    world, g = graph(config, which)
    block = max(sizes(block_bucketed(config, "fw")))
    total = sum(n for _, _, n, _ in served(graph(config, "fw")[1], pu.AG))
    check_auto_plan_contract(config, which, int(2 * block + frac * total))


@pytest.mark.parametrize("which", ["fw", "bw"])
def test_auto_plan_respects_small_cap(which):
    check_auto_plan_contract("w2", which, 8000)  # a sixth: the largest weight (1280 B)


def test_auto_plan_offers_a_small_first_gather_bucket():
    """Besides uniform buckets per size rung, AutoPlan offers each rung with the first forward
    all-gather bucket held to the lowest rung (all of the first gather is exposed), and the
    simulator picks between them."""
    from simplesharded.passes.collectives import find_collectives
    from simplesharded.passes.hardware import get_hardware

    gm = pu.chain_graph(12, rows=256)
    colls = [c for c in find_collectives(gm.graph) if c.ours]
    plan = AutoPlan()
    cands = plan.candidates(gm, colls, get_hardware("local"))

    def bucket_sizes(keys):
        sizes: dict = {}
        for k in keys:
            sizes[k] = sizes.get(k, 0) + 1
        return [sizes[k] for k in dict.fromkeys(keys)]

    shapes = [bucket_sizes(k) for k in cands]
    ramped = [b for b in shapes if len(b) > 1 and b[0] < b[1]]
    assert ramped, shapes
    assert all(b[0] == 1 for b in ramped), shapes  # lowest rung here: one layer's weight


@pytest.mark.parametrize("config", ["w8-bf16", "w2-auto"])
def test_auto_plan_trials_score_what_the_passes_build(config):
    """AutoPlan scores a candidate on a copy whose values are meta tensors, reusing the compute
    time of the nodes the edits left alone: the same makespan as simulating the real passes'
    result (fake values, every node costed afresh)."""
    import copy

    from simplesharded.passes.bucketing import bucketable, merge_buckets
    from simplesharded.passes.hardware import get_hardware
    from simplesharded.passes.plans import _rank_invariant_time, _Trials
    from simplesharded.passes.reordering import reorder_graph
    from simplesharded.passes.simulate import simulate

    hw = get_hardware("local")
    for which in ("fw", "bw"):
        gm = pu.fresh(graph(config, which)[1])
        cands = AutoPlan().candidates(gm, bucketable(gm.graph), hw)
        want = []
        for keys in cands:
            ref = copy.deepcopy(gm.graph)
            merge_buckets(ref, bucketable(ref), keys)
            reorder_graph(ref, None)
            want.append(simulate(ref, hw, node_cost=_rank_invariant_time(ref, hw)).makespan)
        with _Trials(gm.graph, hw, None) as trials:
            assert [trials.makespan(tuple(keys)) for keys in cands] == want


@pytest.mark.parametrize("config", ["w8-bf16", "w2-auto"])
def test_auto_plan_trials_leave_the_graph_as_they_found_it(config):
    """AutoPlan's trials edit the graph itself and undo each edit: afterwards every node has
    its name, op, arguments, readers (in their order) and value back, and bucketing names
    its new nodes as it does on a copy the trials never touched."""
    from simplesharded.passes.bucketing import bucketable, merge_buckets
    from simplesharded.passes.graph_utils import edits_observed

    def state(g):
        return [(n.name, n.op, n.target, n.args, n.kwargs, list(n.users), n.meta.get("val"))
                for n in g.nodes]

    for which in ("fw", "bw"):
        gm = pu.fresh(graph(config, which)[1])
        untouched = pu.fresh(gm)
        plan, collectives = AutoPlan(), bucketable(gm.graph)
        assert not edits_observed(gm.graph)  # in place, no copy
        assert len({tuple(k) for k in plan.candidates(gm, collectives, plan.hw())}) > 1
        before = state(gm.graph)
        keys = plan.assign(gm, collectives)  # the trials run here
        assert state(gm.graph) == before
        merge_buckets(gm.graph, collectives, keys)
        merge_buckets(untouched.graph, bucketable(untouched.graph), keys)
        gm.recompile()
        untouched.recompile()
        assert gm.code == untouched.code
        # A module that observes its node creation gets the trials on a copy: its hook sees
        # none of their nodes, and the plan is the same.
        observed, created = pu.fresh(graph(config, which)[1]), []
        observed._register_create_node_hook(created.append)
        assert edits_observed(observed.graph)
        assert plan.assign(observed, bucketable(observed.graph)) == keys and not created


def test_hoist_before_never_puts_a_node_above_what_it_reads():
    """hoist_before moves a node and the inputs at or after the anchor to just before it; when
    the anchor is itself one of those inputs (prefetch anchored on the node right after an
    earlier start, which can be the next bucket's own shard view: seen in an inductor step
    graph), they go right after it instead. Random DAGs and anchors: the graph stays
    topologically ordered and the node ends up no later than it would right after its
    inputs."""
    import random

    from torch import fx

    from simplesharded.passes.graph_utils import NodeOrder, hoist_before

    g = fx.Graph()
    x = g.placeholder("x")
    u, v1, v2 = (g.call_function(torch.neg, (x,)) for _ in range(3))
    cat = g.call_function(torch.add, (v1, v2))
    start = g.call_function(torch.neg, (cat,))
    g.output((u, start))
    hoist_before(start, u, NodeOrder(g))
    assert list(g.nodes)[1:6] == [v1, v2, cat, start, u]
    hoist_before(start, v1, NodeOrder(g))  # the anchor feeds the node: nothing passes it
    g.lint()
    assert list(g.nodes)[1:5] == [v1, v2, cat, start]

    rng = random.Random(0)
    for _ in range(200):
        g = fx.Graph()
        nodes = [g.placeholder("x")]
        for _ in range(15):
            nodes.append(g.call_function(torch.add, tuple(rng.sample(nodes, min(2, len(nodes))))))
        g.output(tuple(nodes))
        node, anchor = rng.choice(nodes[1:]), rng.choice(nodes[1:])
        order = NodeOrder(g)
        before = order[anchor] > order[node]
        hoist_before(node, anchor, order)
        g.lint()
        pos = {n: i for i, n in enumerate(g.nodes)}
        if before:  # already ahead: nothing moved
            assert pos[node] < pos[anchor]
        else:
            assert pos[node] <= pos[anchor] or anchor in _inputs_of(node)


def _inputs_of(node):
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def test_node_order_follows_moves_and_inserts():
    """NodeOrder answers like a fresh enumeration of the graph after any moves and inserts,
    also once a gap between two positions has no integer left."""
    import random

    from torch import fx

    from simplesharded.passes.graph_utils import NodeOrder

    class Dense(NodeOrder):
        _GAP = 2  # gaps run out at once

    rng = random.Random(0)
    g = fx.Graph()
    x = g.placeholder("x")
    nodes = [g.call_function(torch.neg, (x,)) for _ in range(12)]
    g.output(nodes[-1])
    order = Dense(g)
    for _ in range(400):
        a, b = rng.sample(nodes, 2)
        (order.move_before if rng.random() < 0.5 else order.move_after)(a, b)
        if rng.random() < 0.3:
            with g.inserting_before(b):
                nodes.append(g.call_function(torch.neg, (x,)))
        truth = {n: i for i, n in enumerate(g.nodes)}
        p, q = rng.sample(list(g.nodes), 2)
        assert (order[p] < order[q]) == (truth[p] < truth[q])
