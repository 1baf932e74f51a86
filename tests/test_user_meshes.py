"""``data_parallel`` on meshes built outside simplesharded (simplesharded/mesh.py ``mesh_roles``).

FSDP2's examples build ``init_device_mesh("cpu", (2,))``: no dim names. Such a mesh, or one
with names of the user's own, is read by position (1-D: the shard dim; 2-D: replicate, shard
as FSDP2's HSDP); a mesh from ``init_mesh`` is read by its names. The fast tests check the rule
on a fake process group; the slow ones train the toy on each kind of mesh under each backend
and compare losses and final shards with a one-process reference. One spawn per world size
runs its whole matrix (compiles dominate: ~tens of seconds per spawn).
"""
from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import simplesharded as ss
from simplesharded.mesh import (dense_mesh, dp_dims, dp_mesh, ep_dim, expert_dp_mesh,
                                group_labels, mesh_roles, tp_dim)

import toy
from dist_utils import max_rel_diff, memo, spawn



# ---------------------------------------------------------------- the rule, single process

# (mesh shape, dim names) → (dp dims, replicate dim, shard dim, tp dim, ep dim), as indices
ROLES = {
    ((4,), None): ((0,), None, 0, None, None),
    ((4,), ("data",)): ((0,), None, 0, None, None),
    ((4,), ("dp_shard",)): ((0,), None, 0, None, None),
    ((4,), ("tp",)): ((0,), None, 0, None, None),  # 1-D: the shard dim, whatever its name
    ((2, 2), None): ((0, 1), 0, 1, None, None),
    ((2, 2), ("data", "model")): ((0, 1), 0, 1, None, None),
    ((2, 2), ("dp_shard", "data")): ((0, 1), 0, 1, None, None),  # not all ours: by position
    ((2, 2), ("dp_replicate", "dp_shard")): ((0, 1), 0, 1, None, None),
    ((2, 2), ("dp_shard", "tp")): ((0,), None, 0, 1, None),
    ((1, 2, 2), ("dp_replicate", "dp_shard", "tp")): ((0, 1), 0, 1, 2, None),
}


@pytest.mark.parametrize("shape,names", list(ROLES), ids=[f"{s}-{n}" for s, n in ROLES])
def test_roles(fake_world, shape, names):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    roles = mesh_roles(mesh)
    assert (roles.dp, roles.replicate, roles.shard, roles.tp, roles.ep) == ROLES[(shape, names)]
    assert roles.names == (names or (None,) * len(shape))
    # every reader agrees with the rule and none trips on an unnamed mesh
    assert dp_dims(mesh) == tuple(roles.names[i] for i in roles.dp)
    assert dp_mesh(mesh).ndim == len(roles.dp)
    assert (dp_mesh(mesh) is mesh) == (len(roles.dp) == len(shape))
    assert tp_dim(mesh) == ("tp" if roles.tp is not None else None)
    assert ep_dim(mesh) is None and dense_mesh(mesh) is mesh
    group_labels(mesh)


def test_roles_of_init_mesh_meshes(fake_world):
    """Our meshes are read by name, EP's included: its dense root and its expert dp dims."""
    hsdp = ss.build_mesh(dp_replicate=2, dp_shard=2, device="cpu")
    assert mesh_roles(hsdp).dp == (0, 1) and dp_mesh(hsdp) is hsdp
    ep = ss.build_mesh(dp_replicate=1, dp_shard=4, device="cpu", ep=2)
    roles = mesh_roles(ep)
    assert roles.names == ("efsdp", "ep") and (roles.dp, roles.ep, roles.tp) == ((0,), 1, None)
    assert roles.rest == ("ep",)
    assert expert_dp_mesh(ep).mesh_dim_names == ("efsdp",)
    assert dense_mesh(ep).mesh_dim_names == ("dp_shard",)
    assert mesh_roles(dense_mesh(ep)).dp == (0,)


@pytest.mark.parametrize("shape,names,found", [
    ((2, 2, 1), None, "(None, None, None)"),  # 3+ unnamed dims: which are dp cannot be told
    ((2, 2), ("data", "tp"), "('data', 'tp')"),  # tp needs its dp dims named ours
    ((2, 2), ("tp", "dp_shard"), "('tp', 'dp_shard')"),  # dp dims must lead
])
def test_unreadable_mesh_is_one_line_naming_the_dims(fake_world, shape, names, found):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = toy.make_model()
    with pytest.raises(ValueError) as e:
        ss.data_parallel(model, mesh, storage="param")
    msg = str(e.value)
    assert "\n" not in msg and found in msg and "'dp_shard'" in msg and "'tp'" in msg, msg
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # nothing touched


def test_tp_dtensor_on_unnamed_mesh_is_one_line(fake_world):
    mesh = init_device_mesh("cpu", (2, 2))
    model = toy.make_model()
    model.head.weight = torch.nn.Parameter(
        distribute_tensor(model.head.weight.detach(), mesh, [Replicate(), Shard(0)]))
    with pytest.raises(ValueError) as e:
        ss.data_parallel(model, mesh, storage="param")
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert msg.startswith("parameter 'head.weight' is a DTensor") and "(None, None)" in msg, msg
    assert "('dp_replicate'?, 'dp_shard', 'tp'?)" in msg and "init_mesh" in msg, msg


@pytest.mark.parametrize("shape,names,mode,placements", [
    ((4,), None, "fully_shard", (Shard(0),)),
    ((4,), None, "replicate", (Replicate(),)),
    ((4,), ("data",), "fully_shard", (Shard(0),)),
    ((2, 2), None, "hybrid_shard", (Replicate(), Shard(0))),
    ((2, 2), None, "fully_shard", (Shard(0), Shard(0))),  # a 2-D dp mesh: sharded over both
    ((2, 2), ("data", "model"), "hybrid_shard", (Replicate(), Shard(0))),
])
def test_placements_on_user_meshes(fake_world, shape, names, mode, placements):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = ss.data_parallel(toy.make_model(), mesh, mode, storage="param")
    for n, p in model.named_parameters():
        assert p.device_mesh == mesh and p.placements == placements, n


def test_hybrid_shard_on_unnamed_1d_mesh_says_how_to_build_one(fake_world):
    with pytest.raises(ValueError, match=r"2-D mesh.*init_device_mesh\(device, \(R, S\)\)"):
        ss.data_parallel(toy.make_model(), init_device_mesh("cpu", (4,)), "hybrid_shard", storage="param")


# ---------------------------------------------------------------- parity, multi-process

STEPS = 4
SGD = dict(lr=0.1)  # parameter update linear in the gradient: parameter parity stays tight
TOL = 1e-5
BACKENDS = ("eager", "aot_eager", "aot_eager_blockbucketing", "aot_eager_autobucketing")
# world size → (mesh kind, mode, backends); one spawn per world size runs all of its cases
MATRIX = {
    2: [(kind, "fully_shard", BACKENDS) for kind in ("unnamed", "named", "init_mesh")],
    4: [("unnamed_2d", "hybrid_shard", BACKENDS), ("unnamed_2d", "fully_shard", ("eager",))],
}
CASES = [(world, kind, mode, be) for world, rows in MATRIX.items()
         for kind, mode, bes in rows for be in bes]


def _mesh(kind: str, world: int):
    if kind == "unnamed":  # as FSDP2's examples build it
        return init_device_mesh("cpu", (world,))
    if kind == "named":
        return init_device_mesh("cpu", (world,), mesh_dim_names=("data",))
    if kind == "init_mesh":
        return ss.init_mesh(dp_shard=-1, device="cpu")
    assert kind == "unnamed_2d", kind
    return init_device_mesh("cpu", (2, world // 2))


def _case(rank, world, mesh, mode, backend):
    """STEPS of SGD on this rank's batches with the default grad_reduction="avg" and a
    per-rank mean loss (FSDP2's usual recipe); the losses, this rank's final shards (with
    their offsets in the full tensor) and the collectives our passes saw."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from simplesharded.passes.collectives import count_collectives

    model = ss.data_parallel(toy.make_model(), mesh, mode, storage="param")
    seen = {}

    def observe(kind, stage, gm):
        seen[f"{kind}_{stage}"] = count_collectives(gm)

    cm = model if backend == "eager" else torch.compile(
        model, backend=ss.make_backend(backend, observer=observe), fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), **SGD)
    losses = []
    for step in range(STEPS):
        x, y = toy.rank_batch(rank, step)
        loss = torch.nn.functional.mse_loss(cm(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    shards = {}
    for n, p in model.named_parameters():
        _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        shards[n] = (tuple(offset), p.to_local().detach().clone())
    return dict(losses=losses, shards=shards, seen=seen)


def _job(rank, world):
    # One mesh per kind for the whole job, as a training script has: a second mesh equal to
    # an earlier one gets DTensor's collectives on the earlier one's groups, which are not
    # the dp groups data_parallel annotates (the passes then leave them alone).
    meshes, out = {}, {}
    for w, kind, mode, backend in CASES:
        if w != world:
            continue
        torch._dynamo.reset()
        try:
            if kind not in meshes:
                meshes[kind] = _mesh(kind, world)
            out[(kind, mode, backend)] = ("ok", _case(rank, world, meshes[kind], mode, backend))
        except Exception:  # noqa: BLE001 - reported by the test of this case
            out[(kind, mode, backend)] = ("error", traceback.format_exc())
        dist.barrier()
    return out


@memo
def _run(world):
    return spawn(world, _job, timeout_s=300)


@memo
def _reference(world):
    model = toy.make_model()
    opt = torch.optim.SGD(model.parameters(), **SGD)
    losses = []
    for step in range(STEPS):
        x, y = toy.global_batch(world, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("world,kind,mode,backend", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_parity_on_user_meshes(world, kind, mode, backend):
    ranks = []
    for rank, per_rank in enumerate(_run(world)):
        status, value = per_rank[(kind, mode, backend)]
        if status == "error":
            pytest.fail(f"rank {rank} raised:\n{value}", pytrace=False)
        ranks.append(value)
    ref_losses, ref_params = _reference(world)
    # equal batches per rank: the mean of the ranks' mean losses is the global mean
    for s in range(STEPS):
        got = sum(r["losses"][s] for r in ranks) / world
        assert abs(got - ref_losses[s]) <= TOL * abs(ref_losses[s]), (s, got, ref_losses[s])
    assert ref_losses[-1] < ref_losses[0]
    for rank, r in enumerate(ranks):
        assert r["shards"].keys() == ref_params.keys()
        for n, (offset, local) in r["shards"].items():
            want = ref_params[n][tuple(slice(o, o + s) for o, s in zip(offset, local.shape))]
            assert local.shape == want.shape, (rank, n)
            assert max_rel_diff(local, want) <= TOL, (rank, n)
    if backend != "eager":  # our passes ran on this mesh's groups
        for r in ranks:
            bw = r["seen"]["bw_input"]
            assert bw["reduce_scatter"] == 19  # every parameter of the toy
            assert bw["all_reduce"] == (19 if mode == "hybrid_shard" else 0)
            if backend == "aot_eager_blockbucketing":  # inp, 4 blocks, head: 6 buckets
                got = r["seen"]["bw_bucketing"]
                assert (got["reduce_scatter"], got["all_reduce"]) == (
                    6, 6 if mode == "hybrid_shard" else 0), r["seen"]
            if backend == "aot_eager_autobucketing":  # its buckets depend on measured costs
                assert "bw_bucketing" in r["seen"], r["seen"]


def test_unnamed_mesh_blockbucketing_parity_is_in_the_matrix():
    """The FSDP2-style case the matrix exists for: 2 ranks, init_device_mesh("cpu", (2,))."""
    assert (2, "unnamed", "fully_shard", "aot_eager_blockbucketing") in CASES
