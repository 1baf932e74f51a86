"""Ragged bucket storage (``data_parallel(..., storage="ragged")``): each bucket's
parameters live in the ragged layout (simplesharded/ragged.py), so every gathered parameter is
a view of its bucket's gathered buffer: no copy-in, no copy-out.

A bucket is one DTensor parameter, ``Shard(0)`` of the flattened bucket over the dp shard
dim (``[w·L]``, this rank holding ``[L]``), registered on the module that owns the bucket (the
block; the root for the parameters before the first block and after the last) under
``_ragged_<dtype>`` (``_ragged_<dtype>_tp`` for TP shards, ``_ep`` for experts). Optimizers
step it as they step any shard; gradient clipping reads it as any DTensor. Its members' own
slots hold None, so ``named_parameters()`` lists the buckets instead of the members (as
FSDP1's flat parameters do): an optimizer that needs a member's matrix shape, or per-member
parameter groups, does not take this storage.

``state_dict()`` is what it is without: the members by FQN, each the DTensor it would be,
converted from the bucket by one all-to-all per bucket (every rank calls ``state_dict()``, as
DCP requires anyway); ``load_state_dict`` converts them back (DTensors on the same mesh, or
full tensors). The hooks sit on the owning module, so a block's own ``state_dict()`` converts
too. The optimizer's state is the bucket's; :func:`optim_state_by_member` and
:func:`optim_state_by_bucket` convert a flattened optimizer state dict at the same boundary
(the trainer's checkpoints do), so a checkpoint is keyed as without ragged buckets.

A module's first read of a member in a forward gathers the whole bucket (one annotated
all-gather, which passes/bucketing.py finds already bucketed) and caches the views in the
gather scope for the forward's other reads; outside the forward each read gathers.

Taken: trained parameters of at least one dim, read by one module, under ``fully_shard`` on a
mesh of one data-parallel dim or ``hybrid_shard`` on two (the bucket ``(Replicate(),
Shard(0))`` on them; the layout cuts it over the shard dim, and the gradient's reduce-scatter
is followed by one all-reduce over the replicas), with or without tp, ep and cp dims. Under
TP or EP a bucket lays out what each member's dp gather rebuilds, the rank's model-parallel
shard, and a read re-wraps it as the module's DTensor. One bucket per dp gather (experts
gather over efsdp) and per split: it holds members split over a dim after dp (``Shard(0)``
there: each rank's bucket is different) or replicated over it (``Replicate()``), never both,
so its norm counts every element once. data_parallel refuses another mode; tied and frozen
parameters, and experts sharded on dim 1, keep today's path. ``init_sharded`` runs on the members as
per-parameter shards (:func:`members_as_shards`), so a model built on the meta device takes
ragged buckets too. Mixed precision: the cast of a bucket's ``[L]`` to the gather's dtype is
its only copy-in. Gradient-sync control (``no_gradient_sync``) runs per bucket: its gathered
buffer's gradient is what is deferred and added back, or reduced once by a pipeline stage
(simplesharded/deferred_reduce.py); ``gather_once`` holds the gathered buffer itself;
``compile_step`` steps a bucket as any parameter. Eager, a bucket reshards after forward as a
parameter does (simplesharded/eager_reshard.py): backward gathers it again, once.

Invariant: a bucket's members, order and layout depend only on the module tree and the
parameters' global shapes, so they are the same on every rank.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from simplesharded.ac_wrappers import unwrapped_key
from simplesharded.layout import _contiguous_stride
from simplesharded.passes.annotations import (BLOCK_KEY, BUCKET_PARAMS_KEY, DP_GROUPS_KEY,
                                             PARAM_KEY, RAGGED_KEY, RESHARD_KEY)
from simplesharded.ragged import (Precision, RaggedLayout, from_ragged, gather_buffer,
                                  reduce_gathered, shard0_rows, to_ragged)
from simplesharded.sharded_state import (GatherScopeProtocol, GradSyncProtocol, _MPLayout,
                                         sharded_state)

ALIGN_BYTES = 128  # every member starts 128-byte aligned in the gathered buffer


@dataclass(frozen=True)
class RaggedSlot:
    """A member's place: its bucket and its index there."""

    bucket: "RaggedShards"
    index: int

    def read(self) -> torch.Tensor:
        return self.bucket.read(self.index)


class RaggedShards:
    """One bucket in the ragged layout: its parameter, its members and their reads."""

    def __init__(self, name: str, owner: nn.Module, attr: str,
                 members: list[tuple[str, str, DTensor, _MPLayout | None]],
                 dp_mesh: DeviceMesh, scope: GatherScopeProtocol, grad_scale: float, reshard,
                 dp_groups: tuple, block: str | None, precision: Precision,
                 grad_sync: GradSyncProtocol | None = None):
        """``members``: (FQN, FQN relative to ``owner``, shard, model-parallel layout) in
        module order, all on one mesh whose leading dims are ``dp_mesh``'s, with the same
        placement kind (sharded or replicated) on each dim after them."""
        self.precision, self.grad_sync = precision, grad_sync
        self.name, self.owner, self.attr, self.scope = name, owner, attr, scope
        self.fqns = [fqn for fqn, _, _, _ in members]
        self.keys = [key for _, key, _, _ in members]
        shards = [s for _, _, s, _ in members]
        # Each member as without ragged storage: its placements and global shape, and what
        # its dp gather rebuilds (its TP shard, re-wrapped for its module by ``mp``).
        self.mp = [mp for _, _, _, mp in members]
        self.member_placements = [tuple(s.placements) for s in shards]
        self.member_shapes = [tuple(s.shape) for s in shards]
        # The last dp dim shards (FSDP); a first one of two replicates (HSDP: the members are
        # (Replicate(), Shard(0)) there, and so is the bucket). Group names, not groups: a
        # model is deep-copied with its buckets.
        self.mesh, self.dp_mesh, dp_dims = shards[0].device_mesh, dp_mesh, dp_mesh.ndim
        self.dim = dp_dims - 1  # the shard dim, of dp_mesh and of the mesh alike
        self.group_name = dp_mesh.get_group(self.dim).group_name
        self.replicas = dp_mesh.get_group(0).group_name if dp_dims == 2 else None
        # The dims after dp (tp, ep): the bucket is sharded over those its members are split
        # over (TP shards, experts: each rank's bucket holds other elements), replicated over
        # the others, so its norm counts each element once.
        rest = tuple(Replicate() if p.is_replicate() else Shard(0)
                     for p in shards[0].placements[dp_dims:])
        self.placements = ((Shard(0),) if dp_dims == 1 else (Replicate(), Shard(0))) + rest
        self.grad_scale = grad_scale
        element = shards[0].element_size()
        self.layout = RaggedLayout(
            tuple(tuple(mp.local_shape) if mp is not None else tuple(s.shape)
                  for s, mp in zip(shards, self.mp)),
            dp_mesh.size(self.dim), align=max(1, ALIGN_BYTES // element))
        copies = math.prod(self.mesh.size(dp_dims + i) for i, p in enumerate(rest)
                           if p.is_shard())
        self.shape = (self.layout.total * copies,)  # the bucket's global shape
        local = to_ragged([s.to_local() for s in shards], self.layout, self.shard_group())
        self.param = nn.Parameter(self._dtensor(local))
        self.block = block
        self.annotation = {PARAM_KEY: self.fqns[0], BUCKET_PARAMS_KEY: list(self.fqns),
                           DP_GROUPS_KEY: dp_groups, RESHARD_KEY: reshard, RAGGED_KEY: name}
        if block is not None:
            self.annotation[BLOCK_KEY] = block
        owner.register_parameter(attr, self.param)

    def shard_group(self):
        """The process group of the dp dim the bucket is cut over."""
        return self.dp_mesh.get_group(self.dim)

    def _dtensor(self, local: torch.Tensor) -> DTensor:
        """The bucket's DTensor from this rank's ``[L]``."""
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                  shape=self.shape, stride=(1,))

    def read(self, index: int) -> torch.Tensor:
        """Member ``index``, full: a view of the bucket's gather (one per forward; uncompiled,
        one per run of reads of the bucket, as only the last bucket's views are cached); a TP
        shard is re-wrapped as its module's DTensor, outside the bucket's annotation."""
        scope = self.scope
        views = scope.bucket_views.get(self.name) if scope.active else None
        if views is None:
            views = self._gather(scope)
        mp = self.mp[index]
        if mp is None:
            return views[index]
        return DTensor.from_local(views[index], mp.mesh, (mp.placement,), run_check=False,
                                  shape=mp.shape, stride=mp.stride)

    def _gather(self, scope: GatherScopeProtocol) -> list[torch.Tensor]:
        """The members' views of a new gather (or of the held buffer; or, uncompiled in a
        backward outside the forward, of the bucket's gather there), cached as ``read``
        needs them."""
        eager = not torch.compiler.is_compiling()
        # Outside the forward, inside a backward: torch.utils.checkpoint's recompute reads
        # each member in turn, so the bucket's last gather there serves them all
        recompute = eager and not scope.active and _in_backward()
        if scope.active and eager:
            # One bucket's views cached at a time, dropped before the next gather: a block's
            # gather dies when its modules are done with it, as a parameter's does (compiled,
            # the graph decides what stays alive)
            scope.bucket_views.pop(scope.eager_bucket, None)
            scope.eager_bucket = self.name
        elif recompute:
            cached = scope.backward_views
            if (cached is not None and cached[0] == self.name
                    and cached[1] == self.param.to_local()._version):
                return cached[2]
        held = self.grad_sync.held_for(self.name) if self.grad_sync is not None else None
        if held is not None:  # gathered once for several forwards
            views = self.layout.views(self._route(held))
        else:
            views = self.layout.gather(self.param.to_local(), self.group_name,
                                       self.grad_scale, self.annotation, self.precision,
                                       self.replicas,
                                       self._route if self.grad_sync is not None else None)
            if scope.eager is not None and scope.active and eager:
                scope.eager.note_bucket(self, views[0])  # freed after forward
            elif recompute:
                # one bucket at a time, dropped at the end of this backward: every rank
                # drops it at the same point of its program
                if scope.backward_views is None:
                    Variable._execution_engine.queue_callback(scope.drop_backward_views)
                scope.backward_views = (self.name, self.param.to_local()._version, views)
        if scope.active:
            scope.bucket_views[self.name] = views
        return views

    def gather_whole(self) -> torch.Tensor:
        """The bucket's gathered ``[w·L]`` in its gather dtype, without autograd: what
        ``gather_once`` holds (simplesharded/gather_once.py) and eager resharding re-gathers
        in backward (simplesharded/eager_reshard.py). One all-gather over the shard dim
        (replicas hold the same range)."""
        with torch.no_grad():
            return gather_buffer(self.param.to_local(), self.layout.world, self.group_name,
                                 self.precision)

    def _route(self, full: torch.Tensor) -> torch.Tensor:
        # gradient-sync control for the whole bucket, keyed by its name (not an FQN)
        return self.grad_sync.route(full, self.name)

    def accumulator(self) -> torch.Tensor:
        """A no-sync accumulator leaf for the gathered buffer: an expanded zero scalar in the
        bucket's dtype (simplesharded/grad_sync.py)."""
        zero = torch.zeros((), dtype=self.param.dtype, device=self.param.device)
        return zero.expand(self.layout.total).requires_grad_()

    def reduce_accumulated(self, full: torch.Tensor) -> int:
        """Reduce ``full`` (a no-sync accumulator's gradient of the gathered buffer) as a sync
        backward would and add it to the bucket's ``.grad``; returns the collectives issued."""
        out = reduce_gathered(full, self.layout.world, self.group_name, self.param.dtype,
                              self.grad_scale, self.precision, self.replicas)
        grad = self._dtensor(out)
        self.param.grad = grad if self.param.grad is None else self.param.grad + grad
        return 1 + (self.replicas is not None)

    def member_shards(self, value: DTensor | None = None) -> list[DTensor]:
        """Each member's DTensor as without ragged storage (its placements and shape),
        converted from the bucket, or from ``value`` laid out as the bucket (an optimizer
        state of it): a collective."""
        value = self.param.detach() if value is None else value
        locals_ = from_ragged(value.to_local(), self.layout, self.shard_group())
        return [DTensor.from_local(t, self.mesh, placements, run_check=False, shape=shape,
                                   stride=_contiguous_stride(shape))
                for t, placements, shape in zip(locals_, self.member_placements,
                                                self.member_shapes)]

    def bucket_from(self, values: list[torch.Tensor]) -> DTensor:
        """The bucket's DTensor from its members' values: DTensors on this mesh (any
        placements: redistributed to the members') or full tensors (this rank's part
        taken)."""
        me, world = self.dp_mesh.get_local_rank(self.dim), self.dp_mesh.size(self.dim)
        locals_ = []
        for i, (fqn, v) in enumerate(zip(self.fqns, values)):
            shape, mp = self.member_shapes[i], self.mp[i]
            if tuple(v.shape) != shape:
                raise ValueError(f"load_state_dict: {fqn} has shape {tuple(v.shape)}, the "
                                 f"model's is {shape}")
            if isinstance(v, DTensor):
                v = v.redistribute(self.mesh, self.member_placements[i]).to_local()
            else:
                if mp is not None:  # this rank's TP shard, then its dp rows
                    v = distribute_tensor(v, mp.mesh, (mp.placement,),
                                          src_data_rank=None).to_local()
                start, stop = shard0_rows(v.shape[0], world, me)
                v = v[start:stop]
            locals_.append(v.to(device=self.param.device, dtype=self.param.dtype))
        return self._dtensor(to_ragged(locals_, self.layout, self.shard_group()))


def _in_backward() -> bool:
    """Whether this thread runs an autograd backward (a torch internal: the engine's
    current graph task, -1 outside one)."""
    return torch._C._current_graph_task_id() != -1


_ATTR = "_simplesharded_ragged"  # on a bucket's owner: its buckets and its state_dict order


@dataclass
class _OwnedBuckets:
    buckets: list[RaggedShards]
    order: list[str]  # the owner's state_dict keys (relative) as without ragged storage


def attach_state_dict_hooks(owner: nn.Module, buckets: list[RaggedShards],
                            order: list[str]) -> None:
    """``owner.state_dict()`` lists its buckets' members as ``Shard(0)`` DTensors in
    ``order`` (the keys relative to ``owner`` as without ragged storage); its
    ``load_state_dict`` takes them back into the buckets. The hooks read the buckets from
    the module they run on, so a deep copy of the model converts its own."""
    setattr(owner, _ATTR, _OwnedBuckets(buckets, order))
    owner.register_state_dict_post_hook(_save_members)
    owner.register_load_state_dict_pre_hook(_load_members)


def share_owned_buckets(dst: nn.Module, src: nn.Module) -> None:
    """Make ``dst``, a module holding ``src``'s parameters under the same names (a pipeline
    rank's merged view of its stages, simplesharded/stage_split.py), convert the buckets
    ``src`` owns in its own ``state_dict`` and ``load_state_dict`` too."""
    owned = getattr(src, _ATTR, None)
    if owned is None:
        return
    mine = getattr(dst, _ATTR, None)
    if mine is None:
        attach_state_dict_hooks(dst, list(owned.buckets), list(owned.order))
        return
    mine.buckets += [b for b in owned.buckets if b not in mine.buckets]
    mine.order += [k for k in owned.order if k not in mine.order]


def _save_members(module, state_dict, prefix, local_metadata) -> None:
    owned = getattr(module, _ATTR)
    for b in owned.buckets:
        state_dict.pop(prefix + b.attr, None)
        for key, shard in zip(b.keys, b.member_shards()):
            state_dict[prefix + unwrapped_key(key)] = shard
    # the owner's entries are the last ones added: put them back in the order they have
    # without ragged storage
    order = [prefix + unwrapped_key(k) for k in owned.order]
    for key in [k for k in order if k in state_dict]:
        state_dict[key] = state_dict.pop(key)


def _load_members(module, state_dict, prefix, local_metadata, strict, missing, unexpected,
                  errors) -> None:
    for b in getattr(module, _ATTR).buckets:
        # A checkpoint wrapper's load hook puts its module's name back into the keys when it
        # is the owner (it runs first); an inner wrapper's runs after this one (ac_wrappers.py)
        keys = [prefix + (k if prefix + k in state_dict else unwrapped_key(k)) for k in b.keys]
        if not any(k in state_dict for k in keys):
            continue  # missing keys are reported by the load itself (the bucket's)
        absent = [k for k in keys if k not in state_dict]
        if absent:
            errors.append(f"ragged bucket {b.name}: missing {absent}")
            continue
        state_dict[prefix + b.attr] = b.bucket_from([state_dict.pop(k) for k in keys])


def _members(model: nn.Module) -> dict[RaggedShards, list[tuple[nn.Module, str]]]:
    """Every ragged bucket of ``model`` and its members' (module, attribute), in order."""
    out: dict[RaggedShards, list] = {}
    for module in getattr(model, "_orig_mod", model).modules():
        state = sharded_state(module)
        for name, record in (state.params.items() if state is not None else ()):
            if record.ragged is not None:
                slots = out.setdefault(record.ragged.bucket, [])
                slots.append((record.ragged.index, module, name))
    return {b: [(m, n) for _, m, n in sorted(s, key=lambda e: e[0])] for b, s in out.items()}


@contextlib.contextmanager
def members_as_shards(model: nn.Module) -> Iterator[None]:
    """Within: each ragged member is a ``Shard(0)`` DTensor parameter in its own module's
    slot (converted from its bucket) and the buckets are out of their owners' slots, so code
    written for per-parameter shards (``init_sharded``) runs as without; after: the members'
    values go back into their buckets. Collective: every rank enters it. Nested, the inner
    one finds the buckets out already and does nothing."""
    members = {bucket: slots for bucket, slots in _members(model).items()
               if bucket.attr in bucket.owner._parameters}
    owners = {}
    for bucket, slots in members.items():
        for (module, name), shard in zip(slots, bucket.member_shards()):
            module._parameters[name] = nn.Parameter(shard, requires_grad=False)
        owners[bucket] = bucket.owner._parameters.pop(bucket.attr)
    try:
        yield
    finally:
        for bucket, slots in members.items():
            values = [module._parameters[name] for module, name in slots]
            with torch.no_grad():
                bucket.param.to_local().copy_(bucket.bucket_from(values).to_local())
            for module, name in slots:
                module._parameters[name] = None
            bucket.owner._parameters[bucket.attr] = owners[bucket]


def optim_state_by_member(model: nn.Module, state: dict) -> dict:
    """``state``, a flattened optimizer state dict of ``model`` (``get_state_dict`` with
    ``flatten_optimizer_state_dict=True``), with each ragged bucket's entries replaced by its
    members': a state laid out as the bucket becomes each member's ``Shard(0)`` DTensor; a
    scalar (``step``) and the group's options are copied to every member. Keyed as without
    ragged buckets, it loads at another world size or layout. Collective: every rank calls
    it; :func:`optim_state_by_bucket` is its inverse."""
    out = dict(state)
    for bucket, fqn in bucket_fqns(model):
        for section, name in _entries(out, fqn):
            value = out.pop(f"{section}.{fqn}.{name}")
            if isinstance(value, DTensor) and tuple(value.shape) == bucket.shape:
                values = bucket.member_shards(value)
            else:
                values = [value.clone() if isinstance(value, torch.Tensor) else value
                          for _ in bucket.fqns]
            for member, v in zip(bucket.fqns, values):
                out[f"{section}.{member}.{name}"] = v
    return out


def optim_state_by_bucket(model: nn.Module, state: dict) -> dict:
    """The inverse of :func:`optim_state_by_member`: each bucket's members' entries (their
    ``Shard(0)`` DTensors, or full tensors) become the bucket's, as ``set_state_dict`` takes
    them. A member's scalar (a copy: an optimizer steps it in place) or option is the first
    member's. Collective."""
    out = dict(state)
    for bucket, fqn in bucket_fqns(model):
        for section, name in _entries(out, bucket.fqns[0]):
            keys = [f"{section}.{member}.{name}" for member in bucket.fqns]
            absent = [k for k in keys if k not in out]
            if absent:
                raise ValueError(f"optimizer state of ragged bucket {fqn}: missing {absent}")
            values = [out.pop(k) for k in keys]
            laid_out = (isinstance(values[0], torch.Tensor) and values[0].dim() > 0
                        and tuple(values[0].shape) == bucket.member_shapes[0])
            first = values[0].clone() if isinstance(values[0], torch.Tensor) else values[0]
            out[f"{section}.{fqn}.{name}"] = bucket.bucket_from(values) if laid_out else first
    return out


def bucket_fqns(model: nn.Module) -> Iterator[tuple[RaggedShards, str]]:
    """Every ragged bucket of ``model`` (or its compiled wrapper) with its parameter's FQN,
    in module order (the same on every rank)."""
    for prefix, module in getattr(model, "_orig_mod", model).named_modules():
        for bucket in getattr(getattr(module, _ATTR, None), "buckets", ()):
            yield bucket, f"{prefix}.{bucket.attr}" if prefix else bucket.attr


def _entries(state: dict, fqn: str) -> list[tuple[str, str]]:
    """(section, name) of each flattened optimizer-state key of parameter ``fqn``
    (``state.<fqn>.<name>``, ``param_groups.<fqn>.<name>``), sorted so every rank converts
    in one order."""
    found = []
    for section in ("state", "param_groups"):
        head = f"{section}.{fqn}."
        found += [(section, k[len(head):]) for k in state
                  if k.startswith(head) and "." not in k[len(head):]]
    return sorted(found)
