"""The sharding frontend: ``data_parallel(model, mesh, mode=...)``.

Each parameter is replaced, under the same name, by a DTensor shard on the whole mesh. The
owning module's class is swapped for a subclass with one property per parameter name, so
``module.weight`` inside ``forward`` returns the parameter gathered over the data-parallel
dims: under ``torch.compile`` that is a traced all-gather, and autograd turns its gradient (a
``Partial`` placement) into a traced reduce-scatter (all-reduce for replicated mesh dims).
``_parameters`` still holds the shards, so ``named_parameters()`` and ``state_dict()`` keep
their keys and never gather.

Model parallelism composes: a parameter that is already a DTensor on a model-parallel dim of
the mesh (``mesh["tp"]``, made by ``parallelize_module``; or ``mesh["ep"]``, an expert weight
split by expert parallelism, models/moe.py) keeps that placement and is sharded further over
the dp dims that remain for it (the model-parallel shard first, then dp splits each shard:
when both split dim 0 torch calls this a strided shard, ``_StridedShard``). Reading it gathers
over those dp dims only and hands the module the DTensor it expects; its gradient is reduced
over them only (TP's and EP's own collectives are their modules' business). The dp dims left
to a parameter: all of them (``dp_replicate``, ``dp_shard``: simplesharded/mesh.py
``dense_mesh``) for a plain or a TP parameter; for an expert weight on ``ep``, which borrows
its ranks from dp_shard, ``dp_replicate`` and ``efsdp`` (``expert_dp_mesh``). A plain
parameter on a mesh with a tp dim is replicated over tp; a parameter that is not an expert weight
never sees the ep dim: ep is part of its dp_shard.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.utils._pytree import tree_map
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.multiprocessing.reductions import StorageWeakRef

from simplesharded.mesh import (EFSDP_DIM, EP_DIM, NAMED_LAYOUTS, dense_mesh, dim_size,
                                ep_dim, expert_dp_mesh, mesh_roles)
from simplesharded.mesh import dp_mesh as _dp_mesh
from simplesharded.shims import gloo_gather
from simplesharded.blocks import BlockSpec, block_of
from simplesharded.grad_sync import _GradSync
from simplesharded.passes.annotations import BLOCK_KEY, DP_GROUPS_KEY, PARAM_KEY, RESHARD_KEY
from simplesharded.mesh import tp_dim

MODES = ("replicate", "fully_shard", "hybrid_shard")
GRAD_REDUCTIONS = ("sum", "avg")
RESHARD_CHOICES = (True, False, "auto")
# Config/CLI spelling of reshard_after_forward (config.py, simplesharded/tools/report.py) → data_parallel's.
RESHARD_BY_NAME = {"always": True, "never": False, "auto": "auto"}


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``param_dtype``: dtype of the gathered parameter (the all-gather runs in it).
    ``reduce_dtype``: dtype the gradient is reduced in before it lands on the fp32 shard.
    ``output_dtype``: dtype the root's floating-point outputs are cast to (FSDP2's knob: e.g.
    fp32 logits for the loss from a bf16 model). ``None`` keeps what the model produced (for
    the first two: the parameter's own dtype)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True  # cast floating-point inputs of the root to param_dtype


@dataclass(frozen=True)
class _GatherSpec:
    """What one parameter needs to turn its shard into a full parameter: one per set of dp
    dims (the dense parameters', and the expert weights' when the mesh has an ep dim)."""

    replicate: tuple  # target placements: Replicate() on every dp dim
    grad_placements: tuple  # Partial() on every dp dim
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    grad_scale: float  # 1/dp for grad_reduction="avg", else 1.0
    reshard_after_forward: bool | str  # True, False or "auto" (the compile plan decides)
    hybrid: bool = False  # (Replicate, Shard(0)) on a 2-D mesh
    dp_mesh: DeviceMesh | None = None  # set when the mesh has other dims than dp (tp, ep)
    dp_groups: tuple[str, ...] = ()  # process-group names of the dp dims (see DP_GROUPS_KEY)
    grad_sync: "_GradSync | None" = None  # the model's set_requires_gradient_sync state


@dataclass(frozen=True)
class _MPLayout:
    """A parameter that is a model-parallel DTensor to its module (TP's on mesh["tp"], or an
    expert weight on mesh["ep"]): how the gather rebuilds it."""

    mesh: DeviceMesh  # mesh["tp"] or mesh["ep"]
    placement: object  # e.g. TP's Shard(0) colwise, Shard(1) rowwise, Replicate; EP's Shard(0)
    dp_placements: tuple  # this parameter's placements on its dp dims (for the dp view)
    local_shape: torch.Size  # this rank's model-parallel shard (what dp gathers back)
    local_stride: tuple  # its contiguous stride
    shape: torch.Size  # the global parameter
    stride: tuple


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient (gloo has no AVG op: "avg" is sum × 1/dp)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def gather_param(shard: DTensor, spec: _GatherSpec, fqn: str,
                 tp: _MPLayout | None = None, block: str | None = None) -> torch.Tensor:
    """Shard → full local tensor in param_dtype (the model-parallel DTensor when ``tp`` is
    set); its gradient is reduced back onto the shard over the parameter's dp dims only.

    All dp ops are annotated with the parameter FQN so graph passes can find them in the
    forward, joint and backward graphs without guessing from graph shape. The model-parallel
    re-wrap is outside the annotation: TP collectives (e.g. the all-reduce of a replicated
    norm weight's gradient under sequence parallelism) belong to TP, not to the dp passes.
    """
    annotation = {PARAM_KEY: fqn, DP_GROUPS_KEY: spec.dp_groups,
                  RESHARD_KEY: spec.reshard_after_forward}
    if block is not None:
        annotation[BLOCK_KEY] = block
    with fx_traceback.annotate(annotation):
        if spec.dp_mesh is not None:
            # The dp part of the shard as a DTensor on the dp dims only: its global tensor is
            # this rank's model-parallel shard (or the whole parameter when it is replicated
            # over tp).
            if tp is not None:
                shape, stride, placements = tp.local_shape, tp.local_stride, tp.dp_placements
            else:  # a plain parameter: its dp dims lead, replicated over tp after them
                shape, stride = shard.shape, shard.stride()
                placements = shard.placements[:spec.dp_mesh.ndim]
            shard = DTensor.from_local(shard.to_local(), spec.dp_mesh, placements,
                                       run_check=False, shape=shape, stride=stride)
        # "avg" scales the gradient once it is reduced, on the shard (1/dp of the elements),
        # except when it is reduced in float16, whose sum over ranks could overflow first.
        pre_scale = (spec.reduce_dtype or spec.param_dtype or shard.dtype) == torch.float16
        if spec.grad_scale != 1.0 and not pre_scale:
            shard = DTensor.from_local(_ScaleGrad.apply(shard.to_local(), spec.grad_scale),
                                       shard.device_mesh, shard.placements, run_check=False,
                                       shape=shard.shape, stride=shard.stride())
        hybrid = spec.hybrid and _is_hybrid(shard.placements)
        if hybrid:
            shard = _reduce_replicas_after_scatter(shard)
        full = shard.redistribute(placements=spec.replicate, forward_dtype=spec.param_dtype,
                                  backward_dtype=spec.reduce_dtype)
        # Hybrid: the gradient is still partial over replicas here; the all-reduce over them
        # happens on the shard (see _reduce_replicas_after_scatter), not on the full tensor.
        grad_placements = (Replicate(), Partial()) if hybrid else spec.grad_placements
        local = full.to_local(grad_placements=grad_placements)
        if spec.grad_scale != 1.0 and pre_scale:
            local = _ScaleGrad.apply(local, spec.grad_scale)
        if spec.grad_sync is not None:
            local = spec.grad_sync.route(local, fqn)
    if tp is not None:
        local = DTensor.from_local(local, tp.mesh, (tp.placement,), run_check=False,
                                   shape=tp.shape, stride=tp.stride)
    return local


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(int(size), 1)
    return tuple(reversed(stride))


def _is_hybrid(placements: tuple) -> bool:
    """(Replicate, Shard(d)) on (dp_replicate, dp_shard or efsdp): HSDP's layout."""
    return (len(placements) == 2 and placements[0] == Replicate()
            and type(placements[1]) is Shard)


def _reduce_replicas_after_scatter(shard: DTensor) -> DTensor:
    """Identity in forward. In backward the gradient arrives reduce-scattered over dp_shard but
    still partial over dp_replicate; re-labelling it (Partial, Shard(0)) makes autograd
    all-reduce it over the replicas at shard size: HSDP's reduce-scatter-then-all-reduce, which
    moves 1/dp_shard of the bytes of DTensor's default all-reduce-then-reduce-scatter."""
    # The no-op redistribute is where the all-reduce lands: its backward brings the gradient
    # (labelled Partial over replicas by to_local below) back to (Replicate, Shard(0)).
    same = shard.redistribute(placements=shard.placements)
    local = same.to_local(grad_placements=(Partial(), shard.placements[1]))
    return DTensor.from_local(local, shard.device_mesh, shard.placements, run_check=False,
                              shape=shard.shape, stride=shard.stride())


class _GatherScope:
    """Parameters gathered during one forward of the wrapped root, by FQN: a parameter read
    twice (tied weights, a module called twice) is gathered once, and autograd sums its
    gradients at full size before the one reduction. Inactive outside the root's forward (a
    submodule called on its own, activation-checkpoint recomputation in backward): each read
    then gathers.

    One dict for the model's life, emptied at both ends of the forward: under torch.compile
    the traced forward then ends with the dict as it began (empty), so no gathered tensor
    escapes the graph as an output (a fresh dict per forward would be rebuilt after the graph
    from its outputs: every gathered parameter alive at once)."""

    def __init__(self, reshard_after_forward: bool | str = "auto",
                 last_block: str | None = None):
        self.active = False
        self.gathered: dict = {}
        self.tied: set[str] = set()  # FQNs of parameters held by more than one module
        self.reshard_after_forward = reshard_after_forward
        self.last_block = last_block  # the last block in module order (blocks.py), if any
        self.eager: _EagerReshard | None = None  # set during an uncompiled forward with grad


class _Gathered:
    """One eager gather whose full tensor autograd may save: how to gather it again."""

    __slots__ = ("module", "name", "storage", "nbytes", "dtype", "keep")

    def __init__(self, module: nn.Module, name: str, local: torch.Tensor, keep: bool):
        self.module, self.name, self.keep = module, name, keep
        self.storage = StorageWeakRef(local.untyped_storage())
        self.nbytes = local.untyped_storage().nbytes()
        self.dtype = local.dtype

    def gather(self) -> torch.Tensor:
        m = self.module
        with torch.no_grad():
            return gather_param(m._parameters[self.name], m._ss_specs[self.name],
                                m._ss_fqns[self.name], m._ss_tp.get(self.name),
                                m._ss_blocks[self.name])


class _Packed:
    """A saved tensor that aliased a gathered parameter: its view of the gathered storage."""

    __slots__ = ("source", "size", "stride", "offset", "dtensor")

    def __init__(self, source: _Gathered, local: torch.Tensor, dtensor: tuple | None):
        self.source = source
        self.size, self.stride = local.size(), local.stride()
        self.offset = local.storage_offset()
        self.dtensor = dtensor  # (mesh, placements, shape, stride) of a saved DTensor


def _local(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor holding ``t``'s data (a DTensor's local tensor), or None for other
    tensor subclasses (e.g. a collective's pending result), which are saved as they are."""
    if type(t) is DTensor:
        t = t.to_local()  # pack hooks run without grad: this is the local tensor itself
    return t if type(t) in (torch.Tensor, nn.Parameter) else None


class _EagerReshard:
    """Reshard after forward without torch.compile (FSDP2's memory behaviour).

    Autograd saves what backward needs, and for ``linear(x, w)`` that is ``w`` (a view of it):
    left alone, every gathered parameter would live until backward. During one uncompiled
    root forward with grad, every gather is registered here by the storage of its full tensor,
    and saved-tensor hooks pack a saved tensor that aliases such a storage as a small record
    (which parameter, which view of it); its unpack gathers the parameter again from the
    shard and rebuilds the same view. A gathered parameter then dies when its modules are done
    with it, and backward holds one re-gathered parameter per running autograd node.

    Every rank issues its re-gathers in the same order: an unpack hook runs when the autograd
    engine runs the node that saved the tensor, and the engine orders nodes by the graph alone
    (dependencies, then creation order); every rank built the same graph by running the same
    forward, and the reduce-scatters of the gradients are issued from those same nodes.

    ``keep`` (``reshard_after_forward="auto"``) saves the tensor itself: the compiled plans'
    rule (passes/recompute.py), read per module: a parameter read in the last block, or
    outside every block after a block has run, stays gathered for backward, which needs it
    first. A tied parameter is decided by its latest read (the compiled plan's "last use").
    """

    def __init__(self, scope: _GatherScope):
        self.scope = scope
        self.by_storage: dict[int, _Gathered] = {}  # data_ptr → live gathered storage
        self.seen_block = False

    def note(self, module: nn.Module, name: str, full: torch.Tensor) -> None:
        """A parameter of ``module`` was read and is ``full`` (new or a cached tied gather)."""
        local = _local(full)
        if local is None or local.numel() == 0:
            return  # nothing to free (or a layout we do not rebuild): autograd keeps it
        block = module._ss_read_block
        self.seen_block = self.seen_block or block is not None
        keep = False
        if self.scope.reshard_after_forward == "auto" and self.scope.last_block is not None:
            keep = block == self.scope.last_block or (block is None and self.seen_block)
        ptr = local.untyped_storage().data_ptr()
        known = self.by_storage.get(ptr)
        if known is not None and not known.storage.expired():
            known.keep = keep  # the same gathered tensor read again: its latest read decides
        else:
            self.by_storage[ptr] = _Gathered(module, name, local, keep)

    def pack(self, t: torch.Tensor):
        source, local = None, _local(t)
        if local is not None:
            try:
                ptr = local.untyped_storage().data_ptr()
            except RuntimeError:  # no storage to look at (fake, functional): not ours
                ptr = 0
            source = self.by_storage.get(ptr) if ptr else None
        # A live weak reference to that storage means it is the gathered one (two live
        # storages never share a data pointer); a dtype view of it is saved as it is.
        if (source is None or source.keep or source.storage.expired()
                or local.dtype != source.dtype):
            # Saved as it is. Detached: the tensor itself would hold its grad_fn, which holds
            # this saved value (a cycle that leaks a graph dropped without backward). With
            # hooks autograd no longer checks in-place changes to it: unpack does.
            return t.detach(), t._version
        dtensor = (t.device_mesh, t.placements, t.shape, t.stride()) if type(t) is DTensor \
            else None
        return _Packed(source, local, dtensor)

    @staticmethod
    def unpack(packed):
        if not isinstance(packed, _Packed):
            t, version = packed
            if t._version != version:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified "
                    f"by an inplace operation: {type(t).__name__} {tuple(t.shape)} saved at "
                    f"version {version}, now at version {t._version} (simplesharded)")
            return t
        full = packed.source.gather()
        local = _local(full)
        if local is None or local.untyped_storage().nbytes() != packed.source.nbytes:
            raise RuntimeError(
                f"re-gathering {packed.source.module._ss_fqns[packed.source.name]} for backward "
                f"gave a different layout than in forward")
        with torch.no_grad():
            view = local.as_strided(packed.size, packed.stride, packed.offset)
            if packed.dtensor is None:
                return view
            mesh, placements, shape, stride = packed.dtensor
            return DTensor.from_local(view, mesh, placements, run_check=False, shape=shape,
                                      stride=stride)


def _scope_root_forward(model: nn.Module, scope: _GatherScope,
                        output_dtype: torch.dtype | None = None) -> None:
    """Open ``scope`` for the duration of ``model.forward`` and cast its floating-point
    outputs to ``output_dtype`` (if set). Inside forward, not in hooks: torch.compile runs a
    compiled module's hooks outside the traced frame, where the dict's contents would become
    graph outputs and a cast would be a graph of its own."""
    cls = model.__class__
    inner = cls.forward

    def forward(self, *args, **kwargs):
        scope.gathered.clear()
        scope.active = True
        hooks = contextlib.nullcontext()
        # Uncompiled with grad: free gathered parameters after forward (_EagerReshard).
        # Compiled, the partitioner decides (passes/recompute.py) and no hook is traced; no
        # grad, autograd saves nothing and each gather dies after its use.
        if (not torch.compiler.is_compiling() and scope.reshard_after_forward is not False
                and torch.is_grad_enabled()):
            scope.eager = _EagerReshard(scope)
            hooks = torch.autograd.graph.saved_tensors_hooks(scope.eager.pack,
                                                             _EagerReshard.unpack)
        try:
            with hooks:
                out = inner(self, *args, **kwargs)
        finally:
            scope.gathered.clear()
            scope.active = False
            scope.eager = None
        if output_dtype is None:
            return out
        return tree_map(lambda t: t.to(output_dtype) if isinstance(t, torch.Tensor)
                        and t.is_floating_point() else t, out)

    model.__class__ = type(cls.__name__, (cls,), {
        "forward": forward, "_ss_original_class": getattr(cls, "_ss_original_class", cls)})


def _sharded_property(name: str) -> property:
    def get(self):
        shard = self._parameters[name]
        if shard is None or not self._ss_gather_enabled:
            return shard
        fqn = self._ss_fqns[name]
        scope = self._ss_scope
        # Compiled, the graph decides what stays alive, so every read is cached. Eager, a
        # cached gather would outlive its block (and defeat torch.utils.checkpoint there):
        # only tied parameters, whose full tensor two modules need anyway, are cached.
        cache = scope.active and (fqn in scope.tied or torch.compiler.is_compiling())
        if cache and fqn in scope.gathered:
            full = scope.gathered[fqn]
        else:
            full = gather_param(shard, self._ss_specs[name], fqn, self._ss_tp.get(name),
                                self._ss_blocks[name])
        if cache:
            scope.gathered[fqn] = full
        if scope.eager is not None and not torch.compiler.is_compiling():
            scope.eager.note(self, name, full)
        return full

    return property(get, doc=f"{name}: gathered on read (simplesharded)")


def _placements(mode: str, mesh: DeviceMesh) -> tuple:
    """Placements of a parameter on the data-parallel mesh ``mesh``."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {sorted(MODES)}")
    # Explicit three-way branch: one case per mode.
    if mode == "replicate":
        return (Replicate(),) * mesh.ndim
    if mode == "fully_shard":
        return (Shard(0),) * mesh.ndim
    if mesh.ndim != 2:
        raise ValueError(
            f"mode='hybrid_shard' needs a 2-D mesh of dp dims (dp_replicate, dp_shard); got "
            f"{mesh.ndim}-D {tuple(mesh.mesh.shape)}; build it with "
            f"init_mesh(dp_replicate=R, dp_shard=S) or init_device_mesh(device, (R, S))")
    return (Replicate(), Shard(0))


def _full_placements(dp_placements: tuple, mp_placement, mp_size: int,
                     rest: tuple[str, ...] = (), mp_dim: str | None = None) -> tuple:
    """Placements on a parameter's whole mesh (its dp dims, then the dims ``rest`` after them)
    of a parameter whose model-parallel placement on dim ``mp_dim`` is ``mp_placement``: the
    model-parallel shard first, dp then splits each shard, which on the same tensor dim is a
    strided shard in DTensor's left-to-right convention. Replicate on every other dim."""
    out = []
    for p in dp_placements:
        if (isinstance(p, Shard) and isinstance(mp_placement, Shard)
                and p.dim == mp_placement.dim):
            p = _StridedShard(p.dim, split_factor=mp_size)
        out.append(p)
    return (*out, *(mp_placement if d == mp_dim else Replicate() for d in rest))


def _check_device(model: nn.Module, mesh: DeviceMesh) -> None:
    for fqn, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.device.type not in ("meta", mesh.device_type):
            raise ValueError(
                f"{fqn} is on device {t.device.type!r} but the mesh is on {mesh.device_type!r}; "
                f"move the model to {mesh.device_type!r} or build it on 'meta'")


def _to_shard(t: torch.Tensor, mesh: DeviceMesh, placements: tuple) -> DTensor:
    """Each rank keeps only its own chunk (no communication: every rank holds the same full
    tensor by construction, or the tensor is on meta and is materialised empty here)."""
    if t.is_meta:
        meta_dt = distribute_tensor(t, mesh, placements, src_data_rank=None)
        local = torch.empty_like(meta_dt.to_local(), device=mesh.device_type)
        return DTensor.from_local(local, mesh, placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return distribute_tensor(t.detach(), mesh, placements, src_data_rank=None)


@dataclass(frozen=True)
class _DPView:
    """One set of dp dims a parameter is sharded over, and the mesh it lives on: the dense
    parameters' (all dp dims) or, on a mesh with an ep dim, the expert weights' (module doc)."""

    home: DeviceMesh  # the parameter's whole mesh: its dp dims first, then the others
    dp: DeviceMesh
    placements: tuple  # on dp, by mode
    spec: _GatherSpec

    @property
    def rest(self) -> tuple[str | None, ...]:
        """The home mesh's dims after the dp dims (tp, ep): none on a mesh read by position."""
        return mesh_roles(self.home).rest

    def placements_of(self, param: torch.Tensor) -> tuple:
        """``param``'s placements on dp: by mode, except a scalar's (no dim 0 to shard), which
        is replicated (all-reduced)."""
        return self.placements if param.dim() else (Replicate(),) * self.dp.ndim


def _expert_dp_placements(placements: tuple, local_shape: torch.Size, efsdp: int) -> tuple:
    """An expert weight's dp placements: its local experts [E/ep, ...] are sharded on dim 0
    when efsdp divides their number, else on dim 1, so no rank's gather pads a whole expert
    (with fewer local experts than efsdp ranks, or a remainder, dim 0 would)."""
    if local_shape[0] % efsdp == 0 or len(local_shape) < 2:
        return placements
    return tuple(Shard(1) if p == Shard(0) else p for p in placements)


def _shard_param(param: torch.Tensor, mesh: DeviceMesh, views: dict[str | None, _DPView],
                 fqn: str) -> tuple[DTensor, _MPLayout | None, _GatherSpec]:
    """The whole-mesh shard of one parameter, its model-parallel layout if it is a TP or EP
    DTensor, and its gather spec."""
    if not isinstance(param, DTensor):
        view = views[None]
        placements = view.placements_of(param)
        return (_to_shard(param, view.home, _full_placements(placements, None, 1, view.rest)),
                None, view.spec)
    names = [n for n in (tp_dim(mesh), ep_dim(mesh)) if n]
    if not names:
        raise ValueError(
            f"parameter {fqn!r} is a DTensor (tensor or expert parallel) but the mesh given to "
            f"data_parallel has dims {mesh_roles(mesh).names}; TP/EP need dims named "
            f"{NAMED_LAYOUTS}: build the mesh with simplesharded.init_mesh(..., tp=T, ep=E)")
    name = param.device_mesh.mesh_dim_names[0] if param.device_mesh.mesh_dim_names else None
    if (param.device_mesh.ndim != 1 or name not in names
            or not torch.equal(param.device_mesh.mesh, mesh[name].mesh)):
        raise ValueError(
            f"parameter {fqn!r} is a DTensor on mesh {param.device_mesh} but data_parallel can "
            f"only shard plain parameters or TP/EP DTensors on mesh['tp'] / mesh['ep'] of the "
            f"mesh it is given ({mesh}); apply parallelize_module(model, mesh['tp'], plan) "
            f"with that mesh")
    placement = param.placements[0]
    if not isinstance(placement, (Shard, Replicate)) or isinstance(placement, _StridedShard):
        raise ValueError(f"parameter {fqn!r} has placement {placement} on {name}; "
                         f"data_parallel supports Shard(d) and Replicate() there")
    view = views[EP_DIM if name == EP_DIM else None]
    local = param.detach().to_local()
    dp_placements = view.placements_of(param)
    if name == EP_DIM:
        dp_placements = _expert_dp_placements(dp_placements, local.shape, dim_size(mesh, EFSDP_DIM))
    placements = _full_placements(dp_placements, placement, param.device_mesh.size(),
                                  view.rest, name)
    dp_local = distribute_tensor(local, view.dp, dp_placements, src_data_rank=None).to_local()
    if local.is_meta:
        dp_local = torch.empty_like(dp_local, device=mesh.device_type)
    shard = DTensor.from_local(dp_local, view.home, placements, run_check=False,
                               shape=param.shape, stride=param.stride())
    return shard, _MPLayout(param.device_mesh, placement, dp_placements, local.shape,
                            _contiguous_stride(local.shape), param.shape,
                            param.stride()), view.spec


def data_parallel(model: nn.Module, mesh: DeviceMesh, mode: str = "fully_shard",
                  mp_policy: MixedPrecisionPolicy | None = None,
                  reshard_after_forward: bool | str = "auto",
                  grad_reduction: str = "avg",
                  blocks: Sequence[BlockSpec] | None = None) -> nn.Module:
    """Shard ``model`` in place over ``mesh`` and return it.

    mode: ``replicate`` (DDP-like), ``fully_shard`` (FSDP/ZeRO-3) or ``hybrid_shard``
    (replicate over mesh dim 0, shard over dim 1; needs a 2-D mesh of dp dims).
    mesh: from :func:`simplesharded.mesh.build_mesh`; its tp and ep dims are for parameters
    that are DTensors there already (module doc): apply TP / expert parallelism first. Or a
    mesh built elsewhere (``init_device_mesh``, unnamed or not) of data-parallel dims only:
    1-D shards over it, 2-D is (replicate, shard) for ``hybrid_shard`` (mesh.mesh_roles).
    reshard_after_forward: ``True`` frees every gathered parameter after forward and
    re-gathers it in backward (ZeRO-3); ``False`` keeps them all until backward (ZeRO-2 memory
    for parameters); ``"auto"`` lets the compiled plan decide per block: the plain and
    block-bucketing backends keep the last block and what follows it (backward needs them
    first, as torchtitan's and FSDP2's defaults do), the autobucketing backends keep trailing
    blocks while their bytes fit the plan's memory budget (passes/recompute.py).
    Uncompiled, the same choice holds for what autograd saves for backward: ``True`` re-gathers
    each saved parameter in backward, ``False`` keeps them, ``"auto"`` keeps those read in
    the last block (in module order) and after it (``_EagerReshard``).
    grad_reduction: ``avg`` (default; the mean over the data-parallel ranks, as DDP and FSDP2:
    gradients are pre-divided by the data-parallel size, then summed) or ``sum`` (normalise
    the loss by the global token count yourself, as the trainer does).
    blocks: which modules are the model's blocks (one bucket each under
    ``*_blockbucketing``, the units of ``"auto"``): None finds them in the module tree
    (simplesharded/blocks.py); or module classes, class names or module-FQN regexes.
    A parameter read more than once in one forward of ``model`` (tied weights, a module called
    twice) is gathered once; its gradient is summed locally and reduced once (eager: tied
    weights only, so an uncompiled gather never outlives its block).
    A model on the meta device gets uninitialised shards on the mesh's device: run its
    init under :func:`disable_gather` (``with disable_gather(model): model.init_weights()``).
    The first call gives torch's functional all-gather a CPU kernel that runs gloo's plain
    all-gather (simplesharded/shims/gloo_gather.py: torch's own runs a coalesced one that can
    corrupt the heap), for every CPU gather in the process, compiled or not.
    """
    dense = dense_mesh(mesh)
    dp = _dp_mesh(dense)
    placements = _placements(mode, dp)
    if not (isinstance(reshard_after_forward, bool) or reshard_after_forward == "auto"):
        raise ValueError(f"reshard_after_forward={reshard_after_forward!r} is not one of "
                         f"{list(RESHARD_CHOICES)}")
    if grad_reduction not in GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduction={grad_reduction!r} is not one of {sorted(GRAD_REDUCTIONS)}")
    if any(getattr(m, "_ss_specs", None) is not None for m in model.modules()):
        raise ValueError("model is already wrapped by data_parallel; wrap it once")
    _check_device(model, mesh)
    gloo_gather.install()  # CPU gathers: gloo's plain all-gather, not its racy coalesced one
    mp_policy = mp_policy or MixedPrecisionPolicy()
    spec = _GatherSpec(
        replicate=(Replicate(),) * dp.ndim, grad_placements=(Partial(),) * dp.ndim,
        param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype,
        grad_scale=1.0 / dp.size() if grad_reduction == "avg" else 1.0,
        reshard_after_forward=reshard_after_forward, hybrid=mode == "hybrid_shard",
        dp_mesh=dp if dp is not dense else None,
        dp_groups=tuple(dp.get_group(i).group_name for i in range(dp.ndim)),
        grad_sync=_GradSync())
    views = {None: _DPView(dense, dp, placements, spec)}
    if ep_dim(mesh):
        # Expert weights: the dp dims EP left them. Their gradient is still the sum over all
        # dp ranks' tokens (EP's all-to-all brings them), so "avg" scales by 1/dp as above.
        edp = expert_dp_mesh(mesh)
        views[EP_DIM] = _DPView(mesh, edp, _placements(mode, edp), dataclasses.replace(
            spec, replicate=(Replicate(),) * edp.ndim, grad_placements=(Partial(),) * edp.ndim,
            dp_mesh=edp, dp_groups=tuple(edp.get_group(i).group_name for i in range(edp.ndim))))

    block_of_module = block_of(model, blocks)  # module → its block, blocks in module order
    scope = _GatherScope(reshard_after_forward,
                         last_block=next(reversed(block_of_module.values()), None))
    # id(original param) → its one shard, model-parallel layout, gather spec, FQN and block:
    # tied parameters share all five (the FQN and block of the first owner, as
    # named_parameters() reports it)
    shards: dict[int, tuple[nn.Parameter, _MPLayout | None, _GatherSpec, str, str | None]] = {}
    for mod_name, module in list(model.named_modules()):
        names = [n for n, p in module._parameters.items() if p is not None]
        if not names:
            continue
        fqns, tp, specs, in_block = {}, {}, {}, {}
        for name in names:
            param = module._parameters[name]
            if id(param) not in shards:
                fqn = f"{mod_name}.{name}" if mod_name else name
                shard, layout, param_spec = _shard_param(param, mesh, views, fqn)
                shards[id(param)] = (nn.Parameter(shard, requires_grad=param.requires_grad),
                                     layout, param_spec, fqn, block_of_module.get(mod_name))
            else:
                scope.tied.add(shards[id(param)][3])
            (module._parameters[name], layout, specs[name], fqns[name],
             in_block[name]) = shards[id(param)]
            if layout is not None:
                tp[name] = layout
        _swap_class(module, names)
        module._ss_specs = specs
        module._ss_fqns = fqns
        module._ss_blocks = in_block
        module._ss_read_block = block_of_module.get(mod_name)  # eager "auto" (_EagerReshard)
        module._ss_tp = tp
        module._ss_scope = scope
        module._ss_gather_enabled = True
    _scope_root_forward(model, scope, mp_policy.output_dtype)
    for module in model.modules():  # buffers are replicated plain tensors on the mesh device
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device.type != mesh.device_type:
                module._buffers[name] = torch.empty_like(buf, device=mesh.device_type)
    if mp_policy.param_dtype is not None and mp_policy.cast_forward_inputs:
        model.register_forward_pre_hook(_input_caster(mp_policy.param_dtype), with_kwargs=True)
    model._ss_mesh = mesh
    model._ss_grad_sync = spec.grad_sync
    return model


def _input_caster(dtype: torch.dtype):
    def cast(module, args, kwargs):
        def one(t):
            return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        return tree_map(one, args), tree_map(one, kwargs)

    return cast


def _swap_class(module: nn.Module, names: list[str]) -> None:
    cls = module.__class__
    props = {n: _sharded_property(n) for n in names}
    module.__class__ = type(f"Sharded{cls.__name__}", (cls,), {"_ss_original_class": cls, **props})


def is_wrapped(model: nn.Module) -> bool:
    return getattr(model, "_ss_mesh", None) is not None


@contextlib.contextmanager
def disable_gather(model: nn.Module) -> Iterator[nn.Module]:
    """Within this context, reading a parameter of ``model`` returns its local DTensor shard
    (for init, in-place updates, inspection) instead of gathering it."""
    wrapped = [m for m in model.modules() if getattr(m, "_ss_specs", None) is not None]
    previous = [m._ss_gather_enabled for m in wrapped]
    for m in wrapped:
        m._ss_gather_enabled = False
    try:
        yield model
    finally:
        for m, prev in zip(wrapped, previous):
            m._ss_gather_enabled = prev
