"""Device / backend choice and device-mesh construction.

cuda → nccl, anything else → cpu + gloo. One rule for the mesh's dims, outermost first:
``dp_replicate`` (only when > 1), ``dp_shard`` (always), ``tp`` (only when > 1). So a pure FSDP
mesh is 1-D ``("dp_shard",)``, HSDP is ``("dp_replicate", "dp_shard")`` and FSDP + TP is
``("dp_shard", "tp")``; tp is innermost so a tp group is ranks on one node (fast links).

Expert parallelism borrows its ranks from dp_shard: with ``ep`` > 1 the mesh's ``dp_shard`` dim
is split into ``("efsdp", "ep")``, ep inner (an ep group is consecutive ranks, within a node when
ep * tp divides the node), so the mesh is ``(dp_replicate?, efsdp, ep, tp?)``. Expert weights are
split over ``ep`` and sharded over ``efsdp`` (and replicated/sharded over dp_replicate); every
other parameter is sharded over all of dp_shard as without EP. That dense layout
``(dp_replicate?, dp_shard, tp?)`` is the mesh :func:`build_mesh` makes first; the ep mesh is
its ``_unflatten`` (torch's DeviceMesh API for exactly this), so the dense mesh is the ep mesh's
root (:func:`dense_mesh`) and needs no flattened-dim slicing, and both share one rank layout.

Context parallelism (``cp`` > 1) sits between the dp dims and tp: ``(dp_replicate?, dp_shard,
cp, tp?)``, so a cp group is ranks of one node next to tp. The cp ranks of one dp rank read the
same sequences and each holds different tokens of them (models/context_parallel.py); for the
parameters they are data parallel like dp_shard's, so the dense mesh shards every parameter over
dp_shard x cp as one dim, ``dp_shard_cp`` (torchtitan's name): ``build_mesh`` makes
``(dp_replicate?, dp_shard_cp, tp?)`` first and the cp mesh is its ``_unflatten``, the same
root-and-unflatten relation as EP's. EP together with CP is not supported yet (an error).
Nothing downstream may assume a number of dims: it asks :func:`dp_dims` / :func:`tp_dim` /
:func:`dense_mesh` / :func:`expert_dp_mesh`, which all read :func:`mesh_roles`, the one rule
for which dims are data-parallel. It also reads meshes built elsewhere: an unnamed or
user-named mesh (``init_device_mesh("cpu", (2,))``, FSDP2's examples) is data-parallel in
every dim, 1-D the shard dim, 2-D (replicate, shard) as FSDP2's HSDP; tp and ep need the names
above.

Pipeline parallelism adds ``pp`` as the outermost dim: ``(pp, dp_replicate?, dp_shard | efsdp x
ep, tp?)``. A pp group is ranks ``world / pp`` apart, so each stage's dp, ep and tp groups are
the same consecutive ranks as without pp. ``pp`` is neither data- nor model-parallel to a
parameter: a stage's parameters live on :func:`stage_mesh`, the mesh without it, and
``data_parallel`` given a mesh with a pp dim works on that sub-mesh (so a checkpoint's DTensors
name no pp dim and load at another pp degree). With cp the root is ``(pp, dp_replicate?,
dp_shard_cp, tp?)`` and the cp mesh ``(pp, dp_replicate?, dp_shard, cp, tp?)``: a pp group
holds one rank of each stage at the same dp, cp and tp coordinates, so a stage sends its
activations (this rank's head-tail chunks) to the same cp index of the next stage, and each
stage gathers its K/V over its own cp group.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

SHARD_DIM = "dp_shard"
REPLICATE_DIM = "dp_replicate"
TP_DIM = "tp"
EP_DIM = "ep"
EFSDP_DIM = "efsdp"  # the dp_shard ranks left to an expert weight: dp_shard / ep
PP_DIM = "pp"  # pipeline stages: outermost, never a parameter's dim (stage_mesh)
CP_DIM = "cp"
SHARD_CP_DIM = "dp_shard_cp"  # dp_shard x cp flattened: what the parameters are sharded over
# the names a data-parallel dim goes by
DP_DIMS = (REPLICATE_DIM, SHARD_DIM, EFSDP_DIM, SHARD_CP_DIM)
OUR_DIMS = (PP_DIM, *DP_DIMS, EP_DIM, CP_DIM, TP_DIM)


def device_type() -> str:
    """The accelerator this process should use: "cuda" when present, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(device: str, host: bool = False) -> str:
    """The process-group backend for a device type (nccl for cuda, gloo for cpu). ``host``:
    an accelerator's group takes host tensors too (gloo beside it, as ``"cuda:nccl,cpu:gloo"``):
    under host offload the gradients' norm and a member's gather run on the host."""
    backend = {"cuda": "nccl"}.get(device, "gloo")
    if host and backend != "gloo":
        return f"{device}:{backend},cpu:gloo"
    return backend


@dataclass(frozen=True)
class MeshDegrees:
    """Resolved degrees; ``pp * replicate * shard * cp * tp == world``; ``ep`` divides
    ``shard * cp`` (the ranks it borrows, module doc)."""

    replicate: int
    shard: int
    tp: int = 1
    ep: int = 1
    cp: int = 1
    pp: int = 1

    @property
    def efsdp(self) -> int:
        """The dp_shard x cp ranks an expert weight is sharded over (EP takes the rest)."""
        return self.shard * self.cp // self.ep

    @property
    def dp(self) -> int:
        """Data-parallel ranks that read different sequences (cp and tp ranks share them)."""
        return self.replicate * self.shard

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def dims(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of each dim of the mesh :func:`build_mesh` returns, outermost first, by
        the module doc's rule (with ep and cp both > 1: the ep mesh, cp's being its sibling)."""
        dims = [(PP_DIM, self.pp)] if self.pp > 1 else []
        dims += [(REPLICATE_DIM, self.replicate)] if self.replicate > 1 else []
        if self.ep > 1:
            dims += [(EFSDP_DIM, self.efsdp), (EP_DIM, self.ep)]
        else:
            dims.append((SHARD_DIM, self.shard))
        if self.cp > 1 and self.ep == 1:
            dims.append((CP_DIM, self.cp))
        if self.tp > 1:
            dims.append((TP_DIM, self.tp))
        return tuple(dims)


def resolve_degrees(world_size: int, dp_replicate: int = 1, dp_shard: int = -1,
                    tp: int = 1, ep: int = 1, cp: int = 1,
                    names: tuple[str, ...] = ("dp_replicate", "dp_shard", "tp", "ep", "cp"),
                    pp: int = 1, pp_name: str = "pp") -> MeshDegrees:
    """Fill a ``-1`` degree from the world size and check the product (and that ``ep``
    divides dp_shard x cp: expert parallelism borrows those ranks). ``pp`` stages split the
    world first: the other degrees fill ``world_size / pp`` ranks.

    The one place degrees are resolved. Raises ValueError naming the degrees (as ``names``
    spells them, ``pp_name`` for pp: the API's or the config's keys) and the world size when
    they do not multiply to it.
    """
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise ValueError(f"{pp_name}={pp!r} must be a positive int")
    if world_size % pp:
        raise ValueError(f"{pp_name}={pp} does not divide the world size {world_size}")
    world = f"{world_size // pp} (world size {world_size} / {pp_name}={pp})" if pp > 1 else \
        str(world_size)
    world_size //= pp
    values = (dp_replicate, dp_shard, tp, ep, cp)
    for name, val in zip(names, values):
        fill = name in names[:2]
        if not isinstance(val, int) or isinstance(val, bool) or (val < 1 and not
                                                                 (fill and val == -1)):
            raise ValueError(f"{name}={val!r} must be a positive int"
                             + (" or -1 (fill the world)" if fill else ""))
    if dp_replicate == -1 and dp_shard == -1:
        raise ValueError(f"{names[0]} and {names[1]} cannot both be -1; set at most one to -1")
    factors = [(names[i], values[i]) for i in (0, 1, 4, 2)]  # mesh order; ep is no factor
    given = " x ".join(f"{n}={v}" for n, v in factors if v != -1 and (v > 1 or n == names[1]))
    if -1 in (dp_replicate, dp_shard):
        known = (dp_replicate if dp_shard == -1 else dp_shard) * cp * tp
        if world_size % known:
            raise ValueError(f"{given}{_product(given, known)} does not divide the world size "
                             f"{world}")
        if dp_shard == -1:
            dp_shard = world_size // known
        else:
            dp_replicate = world_size // known
    elif dp_replicate * dp_shard * cp * tp != world_size:
        raise ValueError(f"{given}{_product(given, dp_replicate * dp_shard * cp * tp)} does "
                         f"not equal the world size {world}")
    if dp_shard * cp % ep:
        borrowed = f"{names[1]}={dp_shard} x {names[4]}={cp}" if cp > 1 else \
            f"{names[1]}={dp_shard}"
        raise ValueError(f"{names[3]}={ep} does not divide {borrowed} (expert parallelism "
                         f"borrows its ranks from the data-parallel shards"
                         f"{' and the cp ranks' if cp > 1 else ''})")
    return MeshDegrees(dp_replicate, dp_shard, tp, ep, cp, pp=pp)


def _product(given: str, value: int) -> str:
    return f" = {value}" if " x " in given else ""


@dataclass(frozen=True)
class MeshRoles:
    """What each dim of a mesh is for, as indices into its dims (:func:`mesh_roles`)."""

    names: tuple[str | None, ...]  # the mesh's dim names as given (None where unnamed)
    dp: tuple[int, ...]  # the data-parallel dims, outermost first: (shard,) or (replicate, shard)
    tp: int | None = None
    ep: int | None = None
    cp: int | None = None
    pp: int | None = None  # the pipeline dim (0 when present): neither dp nor model-parallel

    @property
    def replicate(self) -> int | None:
        """The dp dim ``hybrid_shard`` replicates over: the outer of two dp dims."""
        return self.dp[0] if len(self.dp) == 2 else None

    @property
    def shard(self) -> int:
        """The dp dim every mode but ``replicate`` shards over: the innermost dp dim."""
        return self.dp[-1]

    @property
    def rest(self) -> tuple[str | None, ...]:
        """Names of the dims after the dp dims (cp, tp, ep), in mesh order."""
        return self.names[self.dp[-1] + 1:]


# The layouts read by name, for error messages ("?": only when its degree is > 1).
NAMED_LAYOUTS = (f"({REPLICATE_DIM!r}?, {SHARD_DIM!r}, {TP_DIM!r}?) or "
                 f"({REPLICATE_DIM!r}?, {EFSDP_DIM!r}, {EP_DIM!r}, {TP_DIM!r}?) or "
                 f"({REPLICATE_DIM!r}?, {SHARD_DIM!r}, {CP_DIM!r}, {TP_DIM!r}?)")
_EXPECTED = (f"1 or 2 data-parallel dims (any names or none, as init_device_mesh makes them) "
             f"or dims named {NAMED_LAYOUTS}, after an optional {PP_DIM!r} (init_mesh)")


def mesh_roles(mesh: DeviceMesh) -> MeshRoles:
    """The one rule for which dims of a mesh are data-parallel, and in which role.

    A mesh whose names are all ours (module doc) is read by name: its dp dims are those named
    dp_replicate, dp_shard, efsdp or dp_shard_cp, and it may have cp, tp and ep dims after
    them. Any other mesh
    (unnamed, as FSDP2 examples build it, or named by the user) is read by position: all its
    dims are data-parallel, 1-D being the shard dim and 2-D (replicate, shard) as FSDP2's HSDP.
    TP, EP and CP need our names: an unnamed tp dim cannot be told from a dp dim. Raises
    ValueError for a mesh it cannot read.
    """
    names = tuple(getattr(mesh, "mesh_dim_names", None) or (None,) * mesh.ndim)
    ours = all(n in OUR_DIMS for n in names)
    if not ours or mesh.ndim == 1:
        if mesh.ndim > 2 or (mesh.ndim == 2 and {TP_DIM, EP_DIM, CP_DIM} & set(names)):
            raise ValueError(f"data_parallel cannot tell the data-parallel dims of a "
                             f"{mesh.ndim}-D mesh with dims {names}; expected {_EXPECTED}")
        return MeshRoles(names, tuple(range(mesh.ndim)))
    dp = tuple(i for i, n in enumerate(names) if n in DP_DIMS)
    tp, ep, cp, pp = (names.index(n) if n in names else None
                      for n in (TP_DIM, EP_DIM, CP_DIM, PP_DIM))
    lead = 1 if pp == 0 else 0  # pp, when present, comes first
    if (pp not in (None, 0) or not 1 <= len(dp) <= 2
            or dp != tuple(range(lead, lead + len(dp)))):
        # dp dims lead (after pp): a parameter's placements are its dp placements, then the
        # rest's
        raise ValueError(f"data_parallel needs one or two data-parallel dims outermost (after "
                         f"{PP_DIM!r}); the mesh's dims are {names}; expected {_EXPECTED}")
    return MeshRoles(names, dp, tp, ep, cp, pp)


def dp_dims(mesh: DeviceMesh) -> tuple[str | None, ...]:
    """Names of the mesh's data-parallel dims, outermost first (None for an unnamed dim)."""
    roles = mesh_roles(mesh)
    return tuple(roles.names[i] for i in roles.dp)


def tp_dim(mesh: DeviceMesh) -> str | None:
    """``"tp"`` when the mesh has a tensor-parallel dim, else None."""
    return TP_DIM if mesh_roles(mesh).tp is not None else None


def ep_dim(mesh: DeviceMesh) -> str | None:
    """``"ep"`` when the mesh has an expert-parallel dim, else None."""
    return EP_DIM if mesh_roles(mesh).ep is not None else None


def cp_dim(mesh: DeviceMesh) -> str | None:
    """``"cp"`` when the mesh has a context-parallel dim, else None (an ep mesh whose cp
    mesh is its sibling has none: :func:`cp_mesh`)."""
    return CP_DIM if mesh_roles(mesh).cp is not None else None


_CP_SIBLING_ATTR = "_simplesharded_cp_sibling"  # on a root mesh: its cp mesh, beside ep's


def _cp_sibling(mesh: DeviceMesh) -> DeviceMesh | None:
    """The cp mesh :func:`build_mesh` kept on ``mesh``'s root when it returned an ep mesh
    beside it (module doc), without its pp dim; None otherwise."""
    if not getattr(mesh, "mesh_dim_names", None) or not ep_dim(mesh):
        return None
    sibling = mesh._get_root_mesh().__dict__.get(_CP_SIBLING_ATTR)
    return None if sibling is None else stage_mesh(sibling)


def cp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The 1-D cp mesh of ``mesh``: ``mesh["cp"]``, or under EP its sibling's (module doc);
    None without context parallelism."""
    if cp_dim(mesh):
        return mesh[CP_DIM]
    sibling = _cp_sibling(mesh)
    return None if sibling is None else sibling[CP_DIM]


def dim_size(mesh: DeviceMesh, name: str) -> int:
    """Size of the mesh dim called ``name``."""
    names = mesh.mesh_dim_names or ()
    if name not in names:
        raise ValueError(f"the mesh has no dim {name!r}; its dims are {names or None}")
    return mesh.size(names.index(name))


def stage_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh a pipeline stage's parameters live on: ``mesh`` without its pp dim (``mesh``
    itself when it has none)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if PP_DIM not in names:
        return mesh
    rest = tuple(n for n in names if n != PP_DIM)
    return mesh[rest if len(rest) > 1 else rest[0]]


def dense_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh of every parameter that is not an expert weight: ``(dp_replicate?, dp_shard,
    tp?)``, or ``(dp_replicate?, dp_shard_cp, tp?)`` under context parallelism (with or
    without EP). ``mesh`` itself
    without an ep or cp dim; with one, the mesh it was unflattened from (module doc)."""
    split = ((SHARD_DIM, (EFSDP_DIM, EP_DIM)) if ep_dim(mesh) else
             (SHARD_CP_DIM, (SHARD_DIM, CP_DIM)) if cp_dim(mesh) else None)
    if split is None:
        return mesh
    whole, parts = split
    root = stage_mesh(mesh._get_root_mesh())
    if whole == SHARD_DIM and SHARD_CP_DIM in (root.mesh_dim_names or ()):
        whole = SHARD_CP_DIM  # EP with CP: efsdp x ep is dp_shard x cp (module doc)
    if (whole not in (root.mesh_dim_names or ())
            or dim_size(root, whole) != dim_size(mesh, parts[0]) * dim_size(mesh, parts[1])):
        raise ValueError(f"a mesh with an {parts[1]!r} dim must come from build_mesh/init_mesh "
                         f"(its dense layout is its root); got {mesh}")
    return root


def expert_dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel dims left to an expert weight, ``(dp_replicate?, efsdp)``, of a mesh
    with an ep dim."""
    assert ep_dim(mesh), f"{mesh} has no {EP_DIM!r} dim"
    return dp_mesh(mesh)


def group_labels(mesh: DeviceMesh) -> dict[str, str]:
    """{process-group name: mesh dim name} for each dim of ``mesh`` (and of its dense mesh,
    whose dp_shard spans efsdp x ep, and of an ep mesh's cp sibling: :func:`cp_mesh`). What passes/collectives.group_label reads from a
    group's description, except that a 1-D mesh over the whole world reuses the default
    group, whose description names no dim. A group that serves two dims (ep = dp_shard: both
    the default group) is labelled with both, "ep/dp_shard" (or "cp/dp_shard_cp")."""
    labels: dict[str, str] = {}
    sibling = _cp_sibling(mesh)
    for m in ([mesh] + ([dense_mesh(mesh)] if dense_mesh(mesh) is not mesh else [])
              + ([sibling] if sibling is not None else [])):
        for d in m.mesh_dim_names or ():
            name = m.get_group(d).group_name
            labels[name] = d if labels.get(name, d) == d else f"{labels[name]}/{d}"
    return labels


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel part of ``mesh`` (the mesh itself when it has no other dim). On a
    mesh with an ep dim: the dp dims left to expert weights, ``(dp_replicate?, efsdp)``."""
    roles = mesh_roles(mesh)
    if len(roles.dp) == mesh.ndim:
        return mesh
    names = dp_dims(mesh)  # named: a mesh read by position has no other dim
    return mesh[names if len(names) > 1 else names[0]]


_FLAT_ATTR = "_simplesharded_flat"  # on a root mesh: {dp dim names: flattened mesh}


def flat_dp_mesh(dp: DeviceMesh) -> DeviceMesh:
    """``dp``, a mesh of data-parallel dims, as one dim whose ranks are in the row-major order
    of their coordinates: the order in which DTensor's ``Shard(0)`` on every dim (nested)
    cuts a tensor, so one collective over its group serves a tensor sharded over them all.

    The groups are made with ``new_group`` (the world's own where one group spans it), not
    with torch's ``DeviceMesh._flatten``: DTensor runs its redistributions over a flattened
    mesh it finds registered on the root, and the per-parameter shards' collectives would
    leave the dp groups their reads are annotated with. Kept on the root mesh by ``dp``'s dim
    names, so later calls return the same mesh. Collective over the world the first time
    (every rank's row-major ranks are gathered, then each group is made): every rank calls
    this at the same point. ``new_group`` orders a group by global rank, the row-major order
    when the mesh's ranks ascend (``init_device_mesh``, :func:`init_mesh`); another mesh is
    refused on every rank alike."""
    if dp.ndim == 1:
        return dp
    kept = dp._get_root_mesh().__dict__.setdefault(_FLAT_ATTR, {})
    key = dp.mesh_dim_names
    if key not in kept:
        mine = tuple(dp.mesh.flatten().tolist())
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        groups = sorted(set(every))
        if any(list(g) != sorted(g) for g in groups):
            raise ValueError(f"sharding over {dp.ndim} data-parallel dims as one needs their "
                             f"ranks ascending in row-major order (init_device_mesh, "
                             f"init_mesh); got groups {groups}: use storage='param'")
        if groups == [tuple(range(dist.get_world_size()))]:
            group = dist.group.WORLD
        else:
            for ranks in groups:  # every rank makes every group, in one order
                made = dist.new_group(list(ranks))
                if ranks == mine:
                    group = made
        if dist.get_process_group_ranks(group) != list(mine):  # torch's order, checked
            raise RuntimeError(f"the group made for {mine} holds ranks "
                               f"{dist.get_process_group_ranks(group)} in another order")
        kept[key] = DeviceMesh.from_group(group, dp.device_type)
    return kept[key]


def init_distributed(device: str | None = None, timeout_s: float | None = None,
                     host: bool = False) -> str:
    """Initialise the default process group from torchrun's environment if needed.

    Returns the device type in use. Without torchrun variables a 1-process group is made on a
    free local port, so single-process scripts and notebooks work too. On an accelerator the
    rank's device (``LOCAL_RANK``) is selected first and given to the process group as its
    ``device_id``: NCCL then creates its communicator at once (and can split it for sub-meshes)
    instead of guessing the device at the first collective. ``host``: the group takes host
    tensors too (:func:`backend_for`), for ``data_parallel(offload=...)``.
    """
    device = device or device_type()
    local = _local_device(device)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        kwargs = {}
        if timeout_s is not None:
            from datetime import timedelta
            kwargs["timeout"] = timedelta(seconds=timeout_s)
        if local is not None:
            kwargs["device_id"] = local
        dist.init_process_group(backend=backend_for(device, host), **kwargs)
    return device


def _local_device(device: str) -> torch.device | None:
    """Select and return this rank's accelerator (``LOCAL_RANK`` of the visible ones); None on
    CPU. More ranks on a node than visible devices is a one-line error, not a crash inside the
    first collective."""
    if device == "cpu":
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    count = torch.accelerator.device_count()
    if local_rank >= count:
        raise ValueError(f"LOCAL_RANK={local_rank} but this node has {count} visible {device} "
                         f"device(s); start at most {count} processes per node (NGPU / "
                         f"--nproc_per_node) or make more devices visible")
    torch.accelerator.set_device_index(local_rank)
    return torch.device(device, local_rank)


def exit_rank(code: int = 0) -> NoReturn:
    """End a spawned rank's process without interpreter shutdown: call it last, after
    ``destroy_process_group`` and once everything the rank reports is written.

    ``destroy_process_group`` does not stop gloo while anything holds the group, and DTensor's
    meshes, dynamo's caches and ``torch.distributed.nn.functional``'s defaults (bound when it is
    imported, after init) do: gloo's threads, and rank 0's store server, outlive it. Interpreter
    shutdown under them aborted ranks (SIGABRT;
    benchmarks/history/journal.md#session-6-issue-13-item-7-the-flaky-bench-test).
    ``os._exit`` runs no finalizer or destructor they could race.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def build_mesh(dp_replicate: int = 1, dp_shard: int = -1, device: str | None = None,
               tp: int = 1, ep: int = 1, cp: int = 1, pp: int = 1) -> DeviceMesh:
    """The named mesh of the module doc: ``dp_shard`` always (split into ``efsdp`` x ``ep``
    when ``ep`` > 1), ``pp``, ``dp_replicate``, ``cp`` and ``tp`` when their degree is > 1;
    with ep and cp both > 1 the ep mesh, whose cp mesh :func:`cp_mesh` finds.
    The process group must already exist (see :func:`init_distributed`).
    """
    degrees = resolve_degrees(dist.get_world_size(), dp_replicate, dp_shard, tp, ep, cp, pp=pp)
    dense = MeshDegrees(degrees.replicate, degrees.shard * degrees.cp, degrees.tp,
                        pp=degrees.pp)
    names, sizes = zip(*dense.dims())
    if degrees.cp > 1:
        names = tuple(SHARD_CP_DIM if n == SHARD_DIM else n for n in names)
    mesh = init_device_mesh(device or device_type(), sizes, mesh_dim_names=names)
    cp = (_unflatten(mesh, SHARD_CP_DIM, (degrees.shard, degrees.cp), (SHARD_DIM, CP_DIM))
          if degrees.cp > 1 else None)
    if degrees.ep == 1:
        return cp if cp is not None else mesh
    ep = _unflatten(mesh, SHARD_CP_DIM if cp is not None else SHARD_DIM,
                    (degrees.efsdp, degrees.ep), (EFSDP_DIM, EP_DIM))
    if cp is not None:  # both: the ep mesh, its cp sibling kept on the root (module doc)
        mesh.__dict__[_CP_SIBLING_ATTR] = cp
    return ep


def _unflatten(mesh: DeviceMesh, dim: str, sizes: tuple[int, int],
               names: tuple[str, str]) -> DeviceMesh:
    """``mesh._unflatten`` of the dim named ``dim``, passed by its index: torch 2.11 refuses
    every dim given by name (its check is inverted: ``dim ... is not in (dim, ...)``), and
    the index means the same on every release (docs/torch_internals.md)."""
    return mesh._unflatten(mesh.mesh_dim_names.index(dim), sizes, names)


def init_mesh(dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1,
              device: str | None = None, ep: int = 1, cp: int = 1, pp: int = 1,
              host: bool = False) -> DeviceMesh:
    """Initialise the process group (if needed) and build the mesh (see :func:`build_mesh`).
    ``host``: the group takes host tensors too (:func:`backend_for`), which
    ``data_parallel(offload=...)`` on an accelerator needs."""
    if dist.is_initialized():
        # Validate before any collective work so a bad degree fails fast and clearly.
        resolve_degrees(dist.get_world_size(), dp_replicate, dp_shard, tp, ep, cp, pp=pp)
    device = init_distributed(device, host=host)
    return build_mesh(dp_replicate, dp_shard, device, tp, ep, cp, pp)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (another process may take it before use)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_local(fn: Callable, nprocs: int, args: tuple = (), *, join: bool = True,
                env: dict[str, str | None] | None = None, fork: bool = False,
                read_at_start: tuple[str, ...] = ()):
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes (torch.multiprocessing) that meet on
    a free local port: MASTER_ADDR and MASTER_PORT and ``env`` (a ``None`` value unsets a
    variable) are in their environment, so ``init_process_group(backend, rank=rank,
    world_size=nprocs)`` in each finds the others. This process's environment is as it was on
    return. ``join``: wait for them (a rank's exception is raised here); else return their
    ProcessContext.

    The processes are fresh interpreters (spawn), or with ``fork`` forked from this process's
    fork server (``shims/forkserver.py``), which imported ``fn``'s module once: a fresh
    interpreter spends ~2.5 s of CPU importing torch and this library. ``read_at_start`` names
    the variables a process reads only when it starts (glibc's malloc tunables): the server is
    started with their values here, and when it already runs without them the processes are
    spawned."""
    import torch.multiprocessing as mp
    from unittest import mock

    from simplesharded.shims import forkserver

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **(env or {})}
    environ = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    at_start = {k: environ.get(k) for k in read_at_start}
    if fork and forkserver.start(at_start, [fn.__module__]) and forkserver.started_with(at_start):
        context = mp.start_processes(forkserver.entry, nprocs=nprocs, join=False,
                                     args=forkserver.entry_args(environ, fn, args),
                                     start_method="forkserver")
    else:
        with mock.patch.dict(os.environ, environ, clear=True):  # spawned: copied at start
            context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False,
                                         start_method="spawn")
    if not join:
        return context
    while not context.join():
        pass
    return None
