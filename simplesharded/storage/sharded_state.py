"""What ``data_parallel`` leaves on a module: one frozen record per sharded parameter, held in
one state object per module, stored under one attribute and read only through
:func:`sharded_state`.

Invariant: a module has a state iff ``data_parallel`` wrapped it (a module owning parameters,
or the root); the per-parameter records never change after wrapping, and the only mutable
per-module setting is ``gather_enabled`` (``disable_gather``). Everything else that changes
(the gathers of one forward, gradient sync) lives in objects shared by the whole model, which
the state points to.

It is the bottom of the storage modules (layout, gather, ragged_shards, eager_reshard,
grad_sync all read it) and imports none of them, not even for type checking: the frozen
parts of a record (:class:`_GatherSpec`, :class:`_MPLayout`) are defined here, and the
model-wide objects a record points to, defined in the modules above, are typed by the
``Protocol``s below, which say what is used of them through a record or from a module below
theirs.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

_ATTR = "_simplesharded_state"


# ---------------------------------------------------- the model-wide objects, as used here


class GradSyncProtocol(Protocol):
    """The model's ``set_requires_gradient_sync`` state (grad_sync.py's ``_GradSync``), as
    a read of a parameter or a ragged bucket uses it."""

    sync: bool

    def route(self, local: torch.Tensor, fqn: str) -> torch.Tensor: ...

    def held_for(self, key: str) -> torch.Tensor | None: ...

    def discard(self) -> None: ...


class RaggedBucketProtocol(Protocol):
    """A ragged bucket (ragged_shards.py's ``RaggedShards``), as eager resharding re-gathers
    it and prefetch.py issues its gather ahead."""

    name: str
    block: str | None

    def gather_whole(self) -> torch.Tensor: ...

    def issue_whole(self) -> torch.Tensor: ...

    def prefetch_gather(self) -> torch.Tensor | None: ...


class RaggedMemberProtocol(Protocol):
    """A parameter's place in its ragged bucket (ragged_shards.py's ``RaggedSlot``)."""

    @property
    def bucket(self) -> RaggedBucketProtocol: ...

    @property
    def index(self) -> int: ...

    def read(self) -> torch.Tensor: ...


class PrefetchProtocol(Protocol):
    """An uncompiled step's gathers issued ahead (prefetch.py's ``EagerPrefetch``), as a
    ragged bucket's read uses them (in forward, and in a backward's recompute)."""

    def take(self, name: str) -> torch.Tensor | None: ...

    def gathered(self, bucket: RaggedBucketProtocol) -> None: ...

    def recomputed(self, bucket: RaggedBucketProtocol) -> None: ...


class EagerReshardProtocol(Protocol):
    """One uncompiled forward's record of its gathers (eager_reshard.py's ``_EagerReshard``),
    as the reads report to it."""

    def note(self, module: nn.Module, name: str, full: torch.Tensor) -> None: ...

    def note_bucket(self, bucket: RaggedBucketProtocol, member: torch.Tensor) -> None: ...

    def abandon(self) -> None: ...


class GatherScopeProtocol(Protocol):
    """The model's gathers of one forward (gather.py's ``_GatherScope``), as the reads of
    parameters and of ragged buckets use it."""

    active: bool
    traced: bool  # opened inside a traced frame
    gathered: dict  # FQN → its gather in this forward
    tied: set[str]
    bucket_views: dict  # ragged bucket name → its gathered members' views
    eager_bucket: str | None
    backward_views: tuple | None
    eager: EagerReshardProtocol | None
    prefetch: PrefetchProtocol  # prefetch.py: the gathers an uncompiled forward issues ahead

    def drop_backward_views(self) -> None: ...


# ------------------------------------------------------------------- the record's parts


def reduction_dtype(reduce_dtype: torch.dtype | None, compute_dtype: torch.dtype | None,
                    dtype: torch.dtype) -> torch.dtype:
    """The dtype a gradient is reduced in: ``reduce_dtype``, else the compute dtype the
    parameter was gathered in (its gradient's), else the parameter's own. FSDP2's rule, and
    also the dtype a no-sync backward keeps its sums in until the reduction."""
    return reduce_dtype or compute_dtype or dtype


@dataclass(frozen=True)
class _GatherSpec:
    """What one parameter needs to turn its shard into a full parameter: one per set of dp
    dims (the dense parameters', and the expert weights' when the mesh has an ep dim;
    layout.py)."""

    replicate: tuple  # target placements: Replicate() on every dp dim
    grad_placements: tuple  # Partial() on every dp dim
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    grad_scale: float  # 1/dp for grad_reduction="avg", else 1.0
    reshard_after_forward: bool | str  # True, False or "auto" (the compile plan decides)
    hybrid: bool = False  # (Replicate, Shard(0)) on a 2-D mesh
    dp_mesh: DeviceMesh | None = None  # set when the mesh has other dims than dp (tp, ep)
    dp_groups: tuple[str, ...] = ()  # process-group names of the dp dims (see DP_GROUPS_KEY)
    grad_sync: GradSyncProtocol | None = None  # the model's set_requires_gradient_sync state

    def reduction_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a ``dtype`` parameter's gradient is reduced in (:func:`reduction_dtype`),
        which a no-sync backward also sums it in (grad_sync.py)."""
        return reduction_dtype(self.reduce_dtype, self.param_dtype, dtype)

    def scales_before_reduction(self, dtype: torch.dtype) -> bool:
        """Whether "avg" scales a gradient of a ``dtype`` parameter before its reduction:
        only when it is reduced in float16, whose sum over ranks could overflow first;
        otherwise once it is reduced, on the shard (1/dp of the elements)."""
        return self.reduction_dtype(dtype) == torch.float16


@dataclass(frozen=True)
class _MPLayout:
    """A parameter that is a model-parallel DTensor to its module (TP's on mesh["tp"], or an
    expert weight on mesh["ep"]): how the gather rebuilds it (layout.py)."""

    mesh: DeviceMesh  # mesh["tp"] or mesh["ep"]
    placement: object  # e.g. TP's Shard(0) colwise, Shard(1) rowwise, Replicate; EP's Shard(0)
    dp_placements: tuple  # this parameter's placements on its dp dims (for the dp view)
    local_shape: torch.Size  # this rank's model-parallel shard (what dp gathers back)
    local_stride: tuple  # its contiguous stride
    shape: torch.Size  # the global parameter
    stride: tuple


class DPView(NamedTuple):
    """A parameter's shard seen on its dp dims only: the mesh its gather and its gradient's
    reduction run over, its placements there, and the global shape and stride there (its
    model-parallel shard, or the whole parameter when it is replicated over tp)."""

    mesh: DeviceMesh
    placements: tuple
    shape: torch.Size
    stride: tuple

    def wrap(self, local: torch.Tensor) -> DTensor:
        """``local`` (the shard's local tensor, or one like it) as a DTensor of this view."""
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                  shape=self.shape, stride=self.stride)


# ------------------------------------------------------------------------- the record


@dataclass(frozen=True)
class ShardedParam:
    """One sharded parameter: what a read of it needs to gather it. Tied parameters share
    one record (the FQN and block of the first owner, as ``named_parameters()`` reports)."""

    fqn: str
    spec: _GatherSpec  # its dp dims, dtypes, gradient scaling and reshard choice
    mp_layout: _MPLayout | None  # set when it is a TP or EP DTensor to its module
    block: str | None  # its first owner's block (blocks.py), for the graph annotation
    ragged: RaggedMemberProtocol | None = None  # its ragged bucket (storage="ragged")

    def __post_init__(self):
        _RECORDS[self.read_key] = self

    def __setstate__(self, state: dict) -> None:  # a copied or unpickled record registers too
        for k, v in state.items():
            object.__setattr__(self, k, v)
        _RECORDS[self.read_key] = self

    def dp_view(self, shard: DTensor) -> DPView:
        """``shard`` (this parameter's) on its dp dims only: what its dp gather rebuilds."""
        mesh = self.spec.dp_mesh or shard.device_mesh
        mp = self.mp_layout
        if mp is not None:
            return DPView(mesh, mp.dp_placements, mp.local_shape, mp.local_stride)
        # a plain parameter: its dp dims lead, replicated over tp after them
        return DPView(mesh, tuple(shard.placements[:mesh.ndim]), shard.shape, shard.stride())

    @property
    def read_key(self) -> str:
        """The name a traced read passes its op (gather.py) to find this record by."""
        return f"{self.fqn}@{id(self):x}"


# Every live record by read_key: a traced read's op takes a string, not the record. Registered
# when a record is made (a registration during a trace would apply only after it).
_RECORDS: weakref.WeakValueDictionary[str, ShardedParam] = weakref.WeakValueDictionary()


def read_record(key: str) -> ShardedParam:
    return _RECORDS[key]


@dataclass(eq=False)
class ShardedModuleState:
    """One wrapped module's sharding: its parameters' records and the model-wide objects."""

    params: dict[str, ShardedParam]  # this module's own parameters by attribute name
    scope: GatherScopeProtocol  # the model's gathers of one forward, shared by all its modules
    grad_sync: GradSyncProtocol  # the model's set_requires_gradient_sync state, shared
    original_class: type  # the class before data_parallel subclassed it (blocks.py)
    read_block: str | None  # the block this module is in (eager "auto": _EagerReshard)
    root: bool = False  # the model data_parallel was called on
    gather_enabled: bool = True  # False inside disable_gather: reads return the shard


def sharded_state(module: nn.Module) -> ShardedModuleState | None:
    """``module``'s sharding state, or None for a module ``data_parallel`` did not wrap."""
    return getattr(module, _ATTR, None)


def root_state(model: nn.Module) -> tuple[nn.Module, ShardedModuleState]:
    """``model`` (a root ``data_parallel`` returned, or its ``torch.compile`` wrapper) as the
    wrapped module, with its state; a ValueError for any other module."""
    model = getattr(model, "_orig_mod", model)  # a torch.compile'd model: its module
    state = sharded_state(model)
    if state is None or not state.root:
        raise ValueError(f"{type(model).__name__} is not a model returned by data_parallel "
                         f"(pass the root model you wrapped)")
    return model, state


def attach_sharded_state(module: nn.Module, state: ShardedModuleState) -> None:
    setattr(module, _ATTR, state)


def swap_class(module: nn.Module, name: str, attrs: dict) -> None:
    """Make ``module`` an instance of a new subclass of its class, named ``name``, with
    ``attrs``, in its class's module: code that reads a class's module (transformers tells
    its own models from custom code by it, and picks their checkpoint conversions by it)
    sees the model's."""
    cls = module.__class__
    module.__class__ = type(name, (cls,), {"__module__": cls.__module__, **attrs})


def sharded_params(model: nn.Module) -> Iterator[tuple[ShardedParam, nn.Parameter]]:
    """(record, shard) of every sharded parameter of ``model``, in module order (a tied
    parameter once per module that holds it; a slot set to None skipped)."""
    for module in model.modules():
        state = sharded_state(module)
        if state is None:
            continue
        for name, record in state.params.items():
            shard = module._parameters[name]
            if shard is not None:
                yield record, shard
