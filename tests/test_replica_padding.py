"""passes/replica_padding.py: HSDP's replica all-reduce runs at the padded shard size, so the
auto plan's inputs are the same on every rank.

* Hand-built backward graphs of two ranks of one dp_shard group (3-row weights over 2 shards:
  rank 0 holds 2 rows, rank 1 one), on a fake process group of 4 (2 replicas x 2 shards) so
  that the groups resolve and the all-reduces have a cost. Before the pass their all-reduces,
  AutoPlan's candidates and simulated times differ; after it, all of them are equal. The
  values stay bitwise the same; a cast moves before the all-reduce, an op that cannot move
  is padded back instead; graphs without an unpadded all-reduce are left alone.
* Traced: the toy model's HSDP backward traced as rank 0 and as rank 1 (fake process group)
  ends with the same collective sequence under aot_eager's auto and block plans and
  inductor's auto plan, on an unnamed mesh and on one from init_mesh.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import fx
from torch._subclasses import FakeTensorMode

import pass_utils as pu
from pass_utils import AR, RS, WAIT, aten

from simplesharded.passes.annotations import DP_GROUPS_KEY, PARAM_KEY
from simplesharded.passes.bucketing import bucketable
from simplesharded.passes.collectives import find_collectives
from simplesharded.passes.plans import AutoPlan, _collection_paused, _Trials
from simplesharded.passes.replica_padding import pad_replica_all_reduces

WORLD, SHARDS = 4, 2
COLS = 50  # a row of 200 bytes: one row more or less moves a bucket boundary (below)


@pytest.fixture
def groups():
    """(replicate group name, shard group name) of a 2 x 2 mesh on a fake process group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "another test left a process group initialised"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (2, SHARDS))
        yield mesh.get_group(0).group_name, mesh.get_group(1).group_name
    finally:
        dist.destroy_process_group()


def _graph(groups, rows: list[int], chain=("view",), dtype=torch.float32):
    """One rank's HSDP backward as DTensor traces it, per parameter ``m{i}.weight`` of
    ``rows[i]`` rows on this rank (padded: 2 rows): gradient [4, COLS] → reduce-scatter over
    the shards → unpad (a short chunk only) → ``chain`` → all-reduce over the replicas →
    1/4 → output. ``chain``: "view", "cast" (to float32, from ``dtype``), "mul" (an op that
    does not commute with the reduction's position)."""
    rep, shard = groups
    mode, g = FakeTensorMode(), fx.Graph()

    def op(target, *args, custom=None, **kwargs):
        n = g.call_function(target, args, kwargs)
        with mode:
            n.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a
                                     for a in args], **kwargs)
        if custom:
            n.meta["custom"] = custom
        return n

    outs = []
    for i, mine in enumerate(rows):
        ours = {PARAM_KEY: f"m{i}.weight", DP_GROUPS_KEY: (rep, shard)}
        grad = g.placeholder(f"tangents_{i}")
        grad.meta["val"] = mode.from_tensor(torch.empty(2 * SHARDS, COLS, dtype=dtype))
        x = op(WAIT, op(RS, grad, "sum", SHARDS, shard, custom=ours), custom=ours)
        if mine < 2:
            x = op(aten.slice.Tensor, x, 0, 0, mine, custom=ours)
        for step in chain:
            if step == "view":
                x = op(aten.view.default, x, [mine, COLS], custom=ours)
            elif step == "cast":
                x = op(aten._to_copy.default, x, dtype=torch.float32, custom=ours)
            else:
                x = op(aten.mul.Tensor, x, 2.0, custom=ours)
        x = op(WAIT, op(AR, x, "sum", rep))  # DTensor's all-reduce carries no annotation
        outs.append(op(aten.mul.Tensor, x, 0.25, custom=ours))
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g)


def _all_reduces(gm):
    return [(c.nbytes, c.group_size, c.dtype) for c in find_collectives(gm.graph)
            if c.kind == "all_reduce"]


def _plan_inputs(gm, plan):
    """What AutoPlan decides from: its candidates, each one's simulated makespan, its pick."""
    hw = plan.hw()
    collectives = bucketable(gm.graph)
    candidates = plan.candidates(gm, collectives, hw)
    with _collection_paused(), _Trials(gm.graph, hw, plan.memory_cap_bytes) as trials:
        times = [trials.makespan(tuple(keys)) for keys in candidates]
    return candidates, times, plan.assign(gm, collectives)


# Rank 0 holds 2 rows of each 3-row weight, rank 1 one: rank 0's all-reduces no longer fit the
# smallest bucket rung (the largest reduce-scatter, 800 bytes) together, rank 1's do.
RANK_ROWS = {0: [2, 2, 2], 1: [1, 1, 1]}


def test_plan_inputs_are_the_same_for_both_ranks(groups):
    plan = AutoPlan("local")
    gms = {r: _graph(groups, rows) for r, rows in RANK_ROWS.items()}
    before = {r: _plan_inputs(gm, plan) for r, gm in gms.items()}
    # the premise: unpadded, the ranks' all-reduces, candidates and times differ
    assert _all_reduces(gms[0]) != _all_reduces(gms[1])
    assert before[0][0] != before[1][0] and before[0][1] != before[1][1]
    for gm in gms.values():
        pad_replica_all_reduces(gm)
    assert _all_reduces(gms[0]) == _all_reduces(gms[1]) == [(2 * COLS * 4, 2, torch.float32)] * 3
    assert _plan_inputs(gms[0], plan) == _plan_inputs(gms[1], plan)


def test_values_are_unchanged_and_the_short_rank_unpads_after_the_wait(groups):
    for chain in [("view",), ("cast", "view"), ("mul",)]:
        dtype = torch.bfloat16 if "cast" in chain else torch.float32
        gm = _graph(groups, RANK_ROWS[1], chain, dtype)
        inputs = pu.make_inputs(gm)
        want, _ = pu.run_simulated(gm, inputs, SHARDS)
        pad_replica_all_reduces(gm)
        got, calls = pu.run_simulated(gm, inputs, SHARDS)
        assert calls == 6 and pu.bitwise_equal(want, got), chain
        for start in pu.starts(gm, AR):
            val = start.args[0].meta["val"]
            assert (list(val.shape), val.dtype) == ([2, COLS], torch.float32), chain
            padded = start.args[0].target is aten.constant_pad_nd.default
            assert padded == (chain == ("mul",)), chain  # the fallback only where it must
            assert [u.target for u in pu.the_wait(start).users] == [aten.slice.Tensor]


def test_idempotent_and_leaves_other_graphs_alone(groups):
    gm = _graph(groups, RANK_ROWS[1], ("cast", "view"))
    pad_replica_all_reduces(gm)
    once = pu.graph_signature(gm)
    pad_replica_all_reduces(gm)
    assert pu.graph_signature(gm) == once
    even = _graph(groups, RANK_ROWS[0])  # a full chunk: nothing to pad
    before = pu.graph_signature(even)
    pad_replica_all_reduces(even)
    assert pu.graph_signature(even) == before


# ------------------------------------------------------------------ traced, rank 0 and rank 1

def _traced_sequences(rank: int, backend: str, mesh_kind: str, reduce_dtype=None) -> dict:
    """{"fw"|"bw": the final graph's collectives (op, shapes, mesh dim)} of the toy model
    under HSDP on a 2 x 2 fake process group, traced as ``rank``. ``mesh_kind``: "unnamed"
    (``init_device_mesh``, as FSDP2's examples) or "init_mesh" (ours, dims named)."""
    import simplesharded as ss
    import toy
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from simplesharded.passes.agreement import fingerprint
    from simplesharded.passes.pipeline import LAST_STAGE

    seen = {}

    def observe(kind, stage, gm):
        if stage == LAST_STAGE:
            seen[kind] = [line for _, line, _ in fingerprint(gm.graph)]

    _forget_sharding_decisions()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        torch._dynamo.reset()
        mesh = (init_device_mesh("cpu", (2, SHARDS)) if mesh_kind == "unnamed"
                else ss.init_mesh(dp_replicate=2, dp_shard=SHARDS, device="cpu"))
        policy = ss.MixedPrecisionPolicy(reduce_dtype=reduce_dtype) if reduce_dtype else None
        model = ss.data_parallel(toy.make_model(), mesh, "hybrid_shard", mp_policy=policy)
        compiled = torch.compile(model, fullgraph=True, backend=ss.make_backend(
            backend, observer=observe, hardware="local"))
        x, y = toy.rank_batch(rank, 0)
        # inductor's FX graph cache can hit for our post-grad pass (torch 2.11 does, for the
        # second rank's graphs or a rerun): a hit runs no pass, so the observer sees nothing
        with torch._inductor.config.patch(fx_graph_cache=False):
            torch.nn.functional.mse_loss(compiled(x), y).backward()
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()
        _forget_sharding_decisions()
    return seen


def _forget_sharding_decisions() -> None:
    """DTensor caches sharding decisions under a key that holds the mesh but not this rank's
    process groups: one left by a trace as another rank would reduce over that rank's groups
    (here, or in a later test)."""
    from torch.distributed.tensor import DTensor

    torch._C._clear_DTensor_sharding_propagator_cache()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()


@pytest.mark.parametrize("backend,mesh_kind,reduce_dtype", [
    ("aot_eager_autobucketing", "unnamed", None),
    ("aot_eager_autobucketing", "init_mesh", None),
    # reduce-scattered in bf16, cast back to fp32 for the all-reduce: the cast moves before it
    ("aot_eager_autobucketing", "unnamed", torch.bfloat16),
    ("aot_eager_blockbucketing", "unnamed", None),  # its plan reads no size; its all-reduces did
    ("inductor_autobucketing", "unnamed", None),  # 10-25 s: inductor builds kernels
], ids=str)
def test_traced_ranks_of_one_shard_group_compile_one_sequence(backend, mesh_kind, reduce_dtype):
    rank0, rank1 = (_traced_sequences(r, backend, mesh_kind, reduce_dtype) for r in (0, 1))
    assert set(rank0) == {"fw", "bw"}
    assert any(line.startswith("all_reduce(") for line in rank0["bw"])
    assert rank0 == rank1
