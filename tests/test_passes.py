"""Fast single-process tests of the bucketing and reordering passes on real traced graphs.

The forward and backward graphs of ``toy_blocks.ToyBlocks`` (embeddings → 4 blocks → norm +
output; 7-row uneven parameters) are captured once per configuration from a real
``torch.compile`` under a fake process group at world sizes 2 and 8 (rank 0's graphs), after
our joint recompute tagging and torch's partitioner, before any bucketing/reordering: exactly
what the backends' graph passes receive. Then the passes' invariants (passes/README.md) are
checked on them:

1. same outputs, bitwise: graphs are executed by a simulating interpreter (pass_utils) before
   and after each pass on the same random inputs;
2. counts after block bucketing (one collective per bucket and dtype);
3. order: waits before first use, one-bucket-ahead prefetch with the default cap, gathered bytes
   in flight ≤ cap (hypothesis over caps), a one-bucket cap disables prefetch, at most one
   reduction in flight;
4. idempotence of both passes.
Plus BlockPlan with user patterns, AutoPlan (merging, memory cap), hand-built 2-4 layer chains
(pass_utils.chain_graph: minimal reproductions), and a check that the manual passes equal what
the aot_eager_blockbucketing pipeline produced in the capturing compile.

"""
from __future__ import annotations

import re
from collections import defaultdict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simplesharded.passes.bucketing import bucket_collectives
from simplesharded.passes.plans import AutoPlan, BlockPlan
from simplesharded.passes.reordering import PREFETCH_AHEAD, reorder_for_overlap

import pass_utils as pu
import toy_blocks

N_LAYERS = toy_blocks.N_LAYERS
HYPO = settings(max_examples=6, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------ graph cache

# name → (world size, make_model kwargs, capture kwargs)
CONFIGS = {
    "w2": (2, {}, {}),
    "w8": (8, {}, {}),
    # layers.1: fp32 attention + bf16 feed-forward (two dtypes in one bucket); layers.2: bf16
    "w8-bf16": (8, dict(bf16_blocks={1: "ffn", 2: "block"}), {}),
    "w2-noreshard": (2, {}, dict(reshard_after_forward=False)),
    # the default policy: the last block and the head stay gathered from forward to backward
    "w2-auto": (2, {}, dict(reshard_after_forward="auto")),
}
FP32 = ("w2", "w8")
_captured: dict[str, tuple] = {}


def captured(name: str):
    """(world size, {"fw"|"bw": {stage: gm}}) of a configuration, traced once per session
    (compiled with aot_eager_blockbucketing under a fake process group that is destroyed right
    after tracing)."""
    if name not in _captured:
        world, model_kw, cap_kw = CONFIGS[name]
        tok, tgt = toy_blocks.batch(0)
        with pu.fake_world(world) as mesh:
            stages = pu.capture_graphs(
                toy_blocks.make_model(**model_kw), mesh, (tok,),
                loss=lambda out: toy_blocks.loss_fn(out, tgt, tgt.numel()), **cap_kw)
        _captured[name] = (world, stages)
    return _captured[name]


def graphs(name: str):
    """(world size, fw graph, bw graph) before any of our graph passes."""
    world, stages = captured(name)
    return world, stages["fw"]["input"], stages["bw"]["input"]


def graph(name: str, which: str):
    world, fw, bw = graphs(name)
    return world, (fw if which == "fw" else bw)


_bucketed: dict[tuple, object] = {}


def block_bucketed(name: str, which: str):
    """Block-bucketed copy of a captured graph (cached; callers get a fresh copy)."""
    key = (name, which)
    if key not in _bucketed:
        _bucketed[key] = bucket_collectives(pu.fresh(graph(name, which)[1]), BlockPlan())
    return pu.fresh(_bucketed[key])


_auto: dict[tuple, object] = {}


def auto_bucketed(name: str, which: str, cap: int | None):
    """AutoPlan-bucketed copy of a captured graph (cached: the plan simulates candidates)."""
    key = (name, which, cap)
    if key not in _auto:
        _auto[key] = bucket_collectives(pu.fresh(graph(name, which)[1]),
                                        AutoPlan(memory_cap_bytes=cap))
    return pu.fresh(_auto[key])


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    """Captures open and destroy their fake group themselves (pass_utils.fake_world); make sure
    no test leaves one behind (destroy it, then fail)."""
    yield
    leaked = torch.distributed.is_initialized()
    if leaked:
        torch.distributed.destroy_process_group()
    assert not leaked, "a test left a process group initialised"


# -------------------------------------------------------------------------------- helpers


def my_block(fqn: str) -> str:
    """Expected block-plan bucket of a parameter (independent of plans.block_key)."""
    m = re.match(r"layers\.(\d+)\.", fqn)
    if m:
        return f"layers.{m.group(1)}"
    return "embed" if fqn.startswith("tok_embeddings") else "head"


def served(gm, target) -> list[tuple[list[str], torch.dtype, int, object]]:
    """(params, dtype, nbytes, node) of every collective of one kind."""
    return [(pu.node_params(s), s.meta["val"].dtype, pu._nbytes(s), s)
            for s in pu.starts(gm, target)]


def sizes(gm) -> list[int]:
    return [pu._nbytes(s) for s in pu.starts(gm, pu.AG)]


def assert_bitwise_same(before, after, world, seed=0):
    inputs = pu.make_inputs(before, seed=seed)
    ref, n_ref = pu.run_simulated(before, inputs, world)
    out, n_out = pu.run_simulated(after, inputs, world)
    assert pu.bitwise_equal(ref, out), "outputs changed"
    return n_ref, n_out


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
    """Prefetch's fit tests ask reordering._SpanIndex for the spans overlapping a range; it
    must answer what a scan of every span does, also after spans' first positions move
    (hoisted gathers), with repeated positions and empty answers."""
    from simplesharded.passes.reordering import _SpanIndex

    pos = st.integers(0, 40)
    n = data.draw(st.integers(0, 12))
    spans = []
    for key in range(n):
        first, length = data.draw(pos), data.draw(st.integers(0, 15))
        spans.append((first, first + length, data.draw(st.integers(1, 9)), key))
    index = _SpanIndex(spans + [(3, 5, 7, None)])  # a fixed span: no key, never moves
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


def test_handbuilt_recompute_saves_routing_and_foreign_collectives():
    """In a checkpointed region, the joint pass tags compute for recompute but saves the
    routing decision (``ss_routing``) and an all-to-all that is not ours, with its wait."""
    from torch import fx
    from torch._subclasses import FakeTensorMode
    from torch.utils.checkpoint import CheckpointPolicy

    from simplesharded.passes.annotations import AC_KEY, ROUTING_KEY
    from simplesharded.passes.recompute import tag_gathers_for_recompute

    mode, g = FakeTensorMode(), fx.Graph()

    def node(target, *args, custom=None, name=None):
        n = g.placeholder(name) if target is None else g.call_function(target, args)
        with mode:
            n.meta["val"] = (mode.from_tensor(torch.empty(4, 4)) if target is None else
                             target(*[a.meta["val"] if isinstance(a, fx.Node) else a
                                      for a in args]))
        if custom is not None:
            n.meta["custom"] = custom
        return n

    x, tangent = node(None, name="primals_1"), node(None, name="tangents_1")
    region = {AC_KEY: 0}
    route = node(torch.ops.aten.argsort.default, x, custom={**region, ROUTING_KEY: True})
    a2a = node(pu.A2A, x, [2, 2], [2, 2], "0", custom=region)
    wait = node(pu.WAIT, a2a, custom=region)
    mm = node(torch.ops.aten.mm.default, wait, x, custom=region)
    grad = node(torch.ops.aten.mul.Tensor, tangent, mm)
    g.output((mm, route, grad))
    gm = tag_gathers_for_recompute(fx.GraphModule(torch.nn.Module(), g), BlockPlan())
    saved = CheckpointPolicy.MUST_SAVE
    assert [n.meta.get("recompute") for n in (route, a2a, wait)] == [saved] * 3
    assert mm.meta["recompute"] == CheckpointPolicy.PREFER_RECOMPUTE
    assert "recompute" not in grad.meta


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


# --------------------------------------------------------------------- capture sanity


@pytest.mark.parametrize("config", list(CONFIGS))
def test_manual_passes_equal_backend_pipeline(config):
    """What these tests do by hand (bucket_collectives(BlockPlan()) then reorder_for_overlap with
    the default cap, on the captured input graphs) is exactly what aot_eager_blockbucketing's
    pipeline produced in the same compile."""
    world, stages = captured(config)
    for which in ("fw", "bw"):
        bucketed = block_bucketed(config, which)
        assert pu.graph_signature(bucketed) == pu.graph_signature(stages[which]["bucketing"])
        reordered = reorder_for_overlap(bucketed, BlockPlan())
        assert pu.graph_signature(reordered) == pu.graph_signature(stages[which]["reordering"])
