"""Ragged bucket storage (``data_parallel(..., storage="ragged")``): each bucket's
parameters live in the ragged layout (simplesharded/storage/ragged.py), so every gathered parameter is
a view of its bucket's gathered buffer: no copy-in, no copy-out.

A bucket is one DTensor, ``Shard(0)`` of the flattened bucket over the dp shard dim, or over two
(``[w·L]``, this rank holding ``[L]``): what forward gathers and backward differentiates. It is
no module's parameter. The parameters users see are its members, each in its own module's slot
under its own name (FSDP2's contract, as FSDP1's ``use_orig_params`` kept it over flat
parameters): a DTensor of the member's global shape whose local tensor is this rank's run of it,
a view of the bucket's ``[L]`` (``RaggedMember``, simplesharded/storage/ragged_member.py).
Optimizers step the members, so parameter groups by name, per-parameter learning rates and
freezing a member after wrapping (``requires_grad_(False)``: it gets no gradient; a bucket
whose members are all frozen is read without autograd, so its gradient is neither computed nor
reduced) work as on per-parameter shards; torch's ``clip_grad_norm_`` reduces their norms
over the ranks. After backward the bucket's gradient is handed to the members as views of it
(:meth:`RaggedShards.add_grad`), so ``zero_grad`` on the members is all a loop does.

``state_dict()`` is what it is without: the members by FQN, each the ``Shard(0)`` DTensor it
would be, converted from the bucket by one all-to-all per bucket (every rank calls
``state_dict()``, as DCP requires anyway); ``load_state_dict`` converts them back (DTensors on
the same mesh, or full tensors). The hooks sit on the bucket's owner (its block; the root for
the parameters before the first block and after the last), so a block's own ``state_dict()``
converts too. The optimizer's state of a member is laid out as the member (a ragged run);
:func:`optim_state_by_member` and :func:`optim_state_by_bucket` convert a flattened optimizer
state dict to per-parameter ``Shard(0)`` and back (the trainer's checkpoints do), so a
checkpoint is keyed and laid out as without ragged buckets.

A module's first read of a member in a forward gathers the whole bucket (one annotated
all-gather, which passes/bucketing.py finds already bucketed) and caches the views in the
gather scope for the forward's other reads; outside the forward (and a backward's recompute)
a read is the member itself.

Taken: trained parameters of at least one dim, read by one module, under ``fully_shard`` on a
mesh of one data-parallel dim or of two, or ``hybrid_shard`` on two (the bucket
``(Replicate(), Shard(0))`` on them; the layout cuts it over the shard dim, and the gradient's
reduce-scatter is followed by one all-reduce over the replicas), with or without tp, ep and cp
dims. On two dims under ``fully_shard`` the bucket is ``(Shard(0), Shard(0))``, as its members
are, and cut over the dp ranks flattened row-major (DTensor's nested order: rank (i, j) holds
the range i·d1 + j); its gather and reduce-scatter are one collective each over a group of
all of them (simplesharded/mesh.py: ``flat_dp_mesh``), and a member's ``Shard(0)`` rows, in
``state_dict()`` and the conversions, nest over the two dims as DTensor's do
(ragged.py: ``shard0_rows``). Under
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
(simplesharded/storage/deferred_reduce.py); ``gather_once`` holds the gathered buffer itself;
``compile_step`` differentiates and updates a member through its bucket
(simplesharded/step/__init__.py). Eager, a bucket reshards after forward as a
parameter does (simplesharded/storage/eager_reshard.py): backward gathers it again, once.

Invariant: a bucket's members, order and layout depend only on the module tree and the
parameters' global shapes, so they are the same on every rank.
"""
from __future__ import annotations

import contextlib
import copy
import math
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from simplesharded.ac_wrappers import unwrapped_key
from simplesharded.mesh import flat_dp_mesh
from simplesharded.storage.layout import _contiguous_stride
from simplesharded.passes.annotations import (BLOCK_KEY, BUCKET_PARAMS_KEY, DP_GROUPS_KEY,
                                             PARAM_KEY, RAGGED_KEY, RESHARD_KEY)
from simplesharded.storage.ragged import (Precision, RaggedLayout, from_ragged, issue_gather,
                                  reduce_gathered, to_ragged)
from simplesharded.storage.offload import Offload, kept_dtensor
from simplesharded.storage.ragged_member import Cut, RaggedMember
from simplesharded.storage.sharded_state import (GatherScopeProtocol, GradSyncProtocol, ShardedParam,
                                         sharded_state, swap_class)

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

    def __init__(self, name: str, owner: nn.Module,
                 members: list[tuple[str, str, DTensor, ShardedParam]],
                 dp_mesh: DeviceMesh, scope: GatherScopeProtocol, grad_scale: float, reshard,
                 dp_groups: tuple, block: str | None, precision: Precision,
                 grad_sync: GradSyncProtocol | None = None, offload: str = "none",
                 pin_memory: bool = True):
        """``members``: (FQN, FQN relative to ``owner``, shard, its record) in module order,
        all on one mesh whose leading dims are ``dp_mesh``'s, with the same
        placement kind (sharded or replicated) on each dim after them. ``offload``: where
        the bucket lives between uses (simplesharded/storage/offload.py)."""
        self.precision, self.grad_sync = precision, grad_sync
        self.name, self.owner, self.scope = name, owner, scope
        self.fqns = [fqn for fqn, _, _, _ in members]
        self.keys = [key for _, key, _, _ in members]
        shards = [s for _, _, s, _ in members]
        # Each member as without ragged storage: its placements and global shape, and what
        # its dp gather rebuilds (its TP shard, re-wrapped for its module by ``mp``).
        self.mp = [record.mp_layout for _, _, _, record in members]
        self.member_placements = [tuple(s.placements) for s in shards]
        self.member_shapes = [tuple(s.shape) for s in shards]
        # The bucket is placed on the dp dims as its members are: FSDP's Shard(0) on one dim
        # or on two, or HSDP's (Replicate(), Shard(0)). It is cut over the dims that shard
        # it (the dims of dp_mesh and of the mesh alike), over two as one: their ranks
        # flattened row-major, the order DTensor's nested Shard(0) gives each its chunk, with
        # one group of all of them (mesh.flat_dp_mesh). Group names, not groups: a model is
        # deep-copied with its buckets.
        self.mesh, self.dp_mesh, dp_dims = shards[0].device_mesh, dp_mesh, dp_mesh.ndim
        dp_placements = tuple(members[0][3].dp_view(shards[0]).placements)
        cut = tuple(d for d, p in enumerate(dp_placements) if p.is_shard())
        self.flat = flat_dp_mesh(dp_mesh) if len(cut) > 1 else None
        self.group_name = self._cut_group(cut).group_name
        self.cut = Cut(cut, self.group_name if self.flat is not None else None)
        self.replicas = (dp_mesh.get_group(0).group_name if dp_placements[0].is_replicate()
                         and dp_dims == 2 else None)
        # The dims after dp (tp, ep): the bucket is sharded over those its members are split
        # over (TP shards, experts: each rank's bucket holds other elements), replicated over
        # the others, so its norm counts each element once.
        rest = tuple(Replicate() if p.is_replicate() else Shard(0)
                     for p in shards[0].placements[dp_dims:])
        self.placements = dp_placements + rest
        self.grad_scale = grad_scale
        element = shards[0].element_size()
        self.layout = RaggedLayout(
            tuple(tuple(record.dp_view(s).shape) for _, _, s, record in members),
            math.prod(dp_mesh.size(d) for d in cut), align=max(1, ALIGN_BYTES // element),
            cut_shape=tuple(dp_mesh.size(d) for d in cut) if len(cut) > 1 else None)
        copies = math.prod(self.mesh.size(dp_dims + i) for i, p in enumerate(rest)
                           if p.is_shard())
        self.shape = (self.layout.total * copies,)  # the bucket's global shape
        local = to_ragged([s.to_local() for s in shards], self.layout, self.shard_group())
        # the host copy under offload: what the members view and the optimizer steps
        self.offload, local = Offload.place(offload, local, pin_memory)
        # The bucket: what forward gathers and backward differentiates. Not registered on
        # any module: the members below are the parameters users and optimizers see.
        self.param = nn.Parameter(self._dtensor(local))
        self.hook_grads()
        me = self.cut.rank(dp_mesh)
        # member i's run of this rank's [L]: [start, stop)
        self.runs = [self._run(i, me) for i in range(len(shards))]
        self.member_runs = [tuple(self._run(i, r)[1] - self._run(i, r)[0]
                                  for r in range(self.layout.world)) for i in range(len(shards))]
        self.member_specs = [self._member_spec(i) for i in range(len(shards))]
        self.members = [nn.Parameter(self.member(self.run_of(self.param.detach().to_local(), i), i))
                        for i in range(len(shards))]
        self.block = block
        # the flattened group is a dp group too: the passes take its collectives for ours
        dp_groups = tuple(dict.fromkeys((*dp_groups, self.group_name)))
        self.annotation = {PARAM_KEY: self.fqns[0], BUCKET_PARAMS_KEY: list(self.fqns),
                           DP_GROUPS_KEY: dp_groups, RESHARD_KEY: reshard, RAGGED_KEY: name}
        if block is not None:
            self.annotation[BLOCK_KEY] = block

    def _run(self, i: int, rank: int) -> tuple[int, int]:
        """Member ``i``'s run of ``rank``'s ``[L]``, as [start, stop) there."""
        start, stop = self.layout.piece(i, rank)
        at = self.layout.offsets[i] - self.layout.rank_range(rank)[0]
        return at + start, at + stop

    def run_of(self, local: torch.Tensor, i: int) -> torch.Tensor:
        """Member ``i``'s run of ``local`` (a tensor laid out as this rank's ``[L]``): a
        view."""
        start, stop = self.runs[i]
        return local[start:stop]

    def _member_spec(self, i: int):
        """Member ``i``'s DTensor spec: its global shape and placements as on per-parameter
        storage; its runs are on the tensor (:meth:`member`)."""
        shape = self.member_shapes[i]
        meta = TensorMeta(torch.Size(shape), _contiguous_stride(shape), self.param.dtype)
        return DTensorSpec(self.mesh, self.member_placements[i], tensor_meta=meta)

    def member(self, run: torch.Tensor, i: int) -> RaggedMember:
        """``run``, laid out as member ``i``'s run on this rank, as its DTensor
        (simplesharded/storage/ragged_member.py)."""
        return RaggedMember.make(run, self.member_specs[i], self.member_runs[i], self.cut)

    def _hand_out_grad(self, bucket: torch.Tensor) -> None:
        """The bucket's gradient as its members' ``.grad`` (views: no copy), added to a
        gradient already there; a frozen member (``requires_grad_(False)``) gets none. The
        bucket's own is dropped, so ``zero_grad`` on the members is all a loop does."""
        grad, bucket.grad = bucket.grad, None
        if grad is not None:  # None: a no-sync backward, whose gradient went to its accumulator
            self.add_grad(self.offload.home(grad.to_local()))

    @property
    def trains(self) -> bool:
        """Whether any member takes a gradient (``requires_grad``)."""
        return any(m.requires_grad for m in self.members)

    def hook_grads(self) -> None:
        """Hand the bucket's gradient to the members after each backward (its
        post-accumulate-grad hook), once: a deep copy of the bucket has no hooks (torch does
        not copy them), so a copied model registers its own."""
        hooks = getattr(self.param, "_post_accumulate_grad_hooks", None) or {}
        if not any(isinstance(h, _HandOut) and h.bucket() is self for h in hooks.values()):
            self.param.register_post_accumulate_grad_hook(_HandOut(self))

    def add_grad(self, local: torch.Tensor) -> None:
        """Add ``local``, a gradient laid out as this rank's ``[L]``, to the members', then
        run each member's post-accumulate-grad hooks, as autograd runs a parameter's once its
        ``.grad`` is accumulated (the optimizer-in-backward habit; FSDP2 runs them after its
        reduce-scatter too)."""
        for i, p in enumerate(self.members):
            if not p.requires_grad:
                continue
            run = self.run_of(local, i)
            if p.grad is None:
                # DTensor's own constructor with the member's spec: from_local costs a new
                # spec and an autograd function per call, per member per step
                p.grad = self.member(run, i)
            else:
                p.grad.to_local().add_(run)
            for hook in list((getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()):
                hook(p)

    def copy_into(self, memo: dict) -> None:
        """For ``copy.deepcopy`` of the model: the bucket copied, and each member's copy a
        view of it with the member's spec, entered in ``memo`` before the modules holding
        the members are copied. (A member's own deep copy would copy its run alone.)"""
        param = copy.deepcopy(self.param, memo)
        local = param.to_local()
        for i, member in enumerate(self.members):
            memo[id(member)] = nn.Parameter(self.member(self.run_of(local, i), i),
                                            requires_grad=member.requires_grad)

    def rebind(self) -> None:
        """After ``nn.Module._apply`` (``to_empty``, ``to``) gave the members storage of
        their own (it swaps each parameter's contents, keeping the object): one bucket holding
        their values again, and the members views of it, so that forward reads what the
        optimizer, ``init_sharded`` and checkpoints write. The parameter objects stay, so an
        optimizer built on them keeps working."""
        locals_ = [m.to_local() for m in self.members]
        bucket = self.param.to_local()
        if all(t.dtype == bucket.dtype and t.device == bucket.device
               and (t.numel() == 0 or t.data_ptr() == self.run_of(bucket, i).data_ptr())
               for i, t in enumerate(locals_)):
            return
        first = locals_[0]
        local = torch.zeros(self.layout.shard_numel, dtype=first.dtype, device=first.device)
        for i, t in enumerate(locals_):
            start, stop = self.runs[i]
            local[start:stop] = t.detach().reshape(-1)
        # an offloaded bucket stays on the host, whatever device the move named (FSDP2's
        # to_empty(device=...) after wrapping a meta model)
        local = self.offload.home(local)
        self.param = nn.Parameter(self._dtensor(local))
        self.hook_grads()
        for i, (member, spec) in enumerate(zip(self.members, self.member_specs)):
            spec = self.member_specs[i] = DTensorSpec(
                spec.mesh, spec.placements, tensor_meta=TensorMeta(
                    spec.tensor_meta.shape, spec.tensor_meta.stride, first.dtype))
            new = self.member(self.run_of(local, i), i)
            if (new.dtype, new.device) == (member.dtype, member.device):
                # the same object on new storage, its autograd node and hooks kept
                member._local_tensor, member._spec = new._local_tensor, new._spec
            else:  # another dtype or device: a new wrapper's
                torch.utils.swap_tensors(member, nn.Parameter(
                    new, requires_grad=member.requires_grad))

    def shard_group(self):
        """The process group the bucket is cut over."""
        return self._cut_group(self.cut.dims)

    def _cut_group(self, dims: tuple[int, ...]):
        """The process group of the dp ``dims``: the one dim's, or the two's flattened."""
        if self.flat is not None:
            return self.flat.get_group(0)
        return self.dp_mesh.get_group(dims[0])

    def _dtensor(self, local: torch.Tensor) -> DTensor:
        """The bucket's DTensor from this rank's ``[L]``."""
        return kept_dtensor(local, self.mesh, self.placements, self.shape, (1,))

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
        # every member frozen: read without autograd, as a frozen per-parameter shard is (no
        # gradient computed for it, no reduction, no accumulator)
        trains = self.trains
        route = self._route if self.grad_sync is not None and trains else None
        if held is not None:  # gathered once for several forwards
            views = self.layout.views(held if route is None else route(held))
        else:
            param = self.param if trains else self.param.detach()
            local = self.offload.read(param.to_local(), self.annotation)
            ahead = scope.active and eager  # an uncompiled forward's: prefetch.py
            views = self.layout.gather(local, self.group_name,
                                       self.grad_scale, self.annotation, self.precision,
                                       self.replicas, route,
                                       scope.prefetch.take(self.name)
                                       if ahead or recompute else None)
            if scope.eager is not None and ahead:
                scope.eager.note_bucket(self, views[0])  # freed after forward
            if ahead:
                scope.prefetch.gathered(self)  # and the next bucket's gather issued
            elif recompute:
                # one bucket at a time, dropped at the end of this backward: every rank
                # drops it at the same point of its program
                if scope.backward_views is None:
                    Variable._execution_engine.queue_callback(scope.drop_backward_views)
                scope.backward_views = (self.name, self.param.to_local()._version, views)
                scope.prefetch.recomputed(self)  # and the bucket forward read before it
        if scope.active:
            scope.bucket_views[self.name] = views
        return views

    def gather_whole(self) -> torch.Tensor:
        """The bucket's gathered ``[w·L]`` in its gather dtype, without autograd: what
        ``gather_once`` holds (simplesharded/storage/gather_once.py) and eager resharding re-gathers
        in backward (simplesharded/storage/eager_reshard.py). One all-gather over the shard dim
        (replicas hold the same range)."""
        return torch.ops._c10d_functional.wait_tensor(self.issue_whole())

    def issue_whole(self) -> torch.Tensor:
        """:meth:`gather_whole`'s gather issued and not waited (``wait_tensor`` gives it):
        backward's prefetch (simplesharded/storage/eager_reshard.py)."""
        with torch.no_grad():
            return issue_gather(self.offload.copy_in(self.param.to_local()),
                                self.layout.world, self.group_name, self.precision)

    def prefetch_gather(self) -> torch.Tensor | None:
        """This bucket's forward gather issued ahead of its read, not waited
        (simplesharded/storage/prefetch.py), or None where its read gathers nothing here:
        held for several forwards (gather_once.py), or its shard on the host (offload
        ``params``: the read copies it in, with autograd)."""
        if self.grad_sync is not None and self.grad_sync.held_for(self.name) is not None:
            return None
        if self.offload.on_host and self.offload.resident is None:
            return None
        return self.issue_whole()

    def _route(self, full: torch.Tensor) -> torch.Tensor:
        # gradient-sync control for the whole bucket, keyed by its name (not an FQN)
        return self.grad_sync.route(full, self.name)

    def accumulator(self) -> torch.Tensor:
        """A no-sync accumulator leaf for the gathered buffer: an expanded zero scalar in the
        dtype its reduction runs in (simplesharded/storage/grad_sync.py)."""
        dtype = self.precision.reduction_dtype(self.param.dtype)
        zero = torch.zeros((), dtype=dtype, device=self.offload.compute)
        return zero.expand(self.layout.total).requires_grad_()

    def reduce_accumulated(self, full: torch.Tensor) -> int:
        """Reduce ``full`` (a no-sync accumulator's gradient of the gathered buffer) as a sync
        backward would and add it to the bucket's ``.grad``; returns the collectives issued."""
        out = reduce_gathered(full, self.layout.world, self.group_name, self.param.dtype,
                              self.grad_scale, self.precision, self.replicas)
        self.add_grad(self.offload.home(out))
        return 1 + (self.replicas is not None)

    def shards_of_runs(self, runs: list[torch.Tensor | None]) -> list[DTensor]:
        """Each member's ``Shard(0)`` DTensor (as :meth:`member_shards`) of a tensor given
        as the members' runs (a member's gradient or optimizer state; None: zeros). A
        collective."""
        local = torch.zeros(self.layout.shard_numel, dtype=self.param.dtype,
                            device=self.offload.compute)
        for i, run in enumerate(runs):
            if run is not None:
                start, stop = self.runs[i]
                local[start:stop] = (run.to_local() if isinstance(run, DTensor) else run
                                     ).reshape(-1)
        return self.member_shards(self._dtensor(local))

    def member_shards(self, value: DTensor | None = None, home: bool = True
                      ) -> list[DTensor]:
        """Each member's DTensor as without ragged storage (its placements and shape),
        converted from the bucket, or from ``value`` laid out as the bucket (an optimizer
        state of it): a collective. ``home``: on the device the bucket lives on (the host
        under offload), else on the compute device."""
        value = self.param.detach() if value is None else value
        # the all-to-all on the compute device (its backend's)
        locals_ = from_ragged(self.offload.on_compute(value.to_local()), self.layout,
                              self.shard_group())
        if home:
            locals_ = [self.offload.home(t) for t in locals_]
        return [kept_dtensor(t, self.mesh, placements, shape, _contiguous_stride(shape))
                for t, placements, shape in zip(locals_, self.member_placements,
                                                self.member_shapes)]

    def bucket_from(self, values: list[torch.Tensor]) -> DTensor:
        """The bucket's DTensor from its members' values: DTensors on this mesh (any
        placements: redistributed to the members') or full tensors (this rank's part
        taken)."""
        me = self.cut.rank(self.dp_mesh)
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
                start, stop = self.layout.shard0_rows(v.shape[0], me)
                v = v[start:stop]
            locals_.append(v.to(device=self.offload.compute, dtype=self.param.dtype))
        return self._dtensor(self.offload.home(to_ragged(locals_, self.layout,
                                                         self.shard_group())))


class _HandOut:
    """A bucket's post-accumulate-grad hook, :meth:`RaggedShards._hand_out_grad`, holding the
    bucket weakly. torch keeps a tensor's hooks alive from C++, where Python's garbage
    collector cannot see them: a hook holding its bucket (hence the model) strongly kept a
    deleted model, and its memory, alive for good."""

    __slots__ = ("bucket",)

    def __init__(self, bucket: "RaggedShards"):
        self.bucket = weakref.ref(bucket)

    def __call__(self, param: torch.Tensor) -> None:
        bucket = self.bucket()
        if bucket is not None:
            bucket._hand_out_grad(param)


def _in_backward() -> bool:
    """Whether this thread runs an autograd backward (a torch internal: the engine's
    current graph task, -1 outside one)."""
    return torch._C._current_graph_task_id() != -1


_ATTR = "_simplesharded_ragged"  # on a bucket's owner: the buckets its state_dict converts


@dataclass
class _OwnedBuckets:
    buckets: list[RaggedShards]


def attach_state_dict_hooks(owner: nn.Module, buckets: list[RaggedShards]) -> None:
    """``owner.state_dict()`` gives its buckets' members as ``Shard(0)`` DTensors (their
    parameters hold ragged runs); its ``load_state_dict`` takes them back into the buckets.
    The hooks read the buckets from the module they run on, so a deep copy of the model
    converts its own."""
    setattr(owner, _ATTR, _OwnedBuckets(buckets))
    owner.register_state_dict_post_hook(_save_members)
    owner.register_load_state_dict_pre_hook(_load_members)


def share_owned_buckets(dst: nn.Module, src: nn.Module) -> None:
    """Make ``dst``, a module holding ``src``'s parameters under the same names (a pipeline
    rank's merged view of its stages, simplesharded/pipeline/stage_split.py), convert the buckets
    ``src`` owns in its own ``state_dict`` and ``load_state_dict`` too."""
    owned = getattr(src, _ATTR, None)
    if owned is None:
        return
    mine = getattr(dst, _ATTR, None)
    if mine is None:
        attach_state_dict_hooks(dst, list(owned.buckets))
        return
    mine.buckets += [b for b in owned.buckets if b not in mine.buckets]


def _key_in(state_dict: dict, prefix: str, key: str) -> str:
    """Member ``key``'s entry: as registered, or without a checkpoint wrapper's name (its
    own hooks take it out on save and put it back on load, before or after ours:
    ac_wrappers.py)."""
    return prefix + (key if prefix + key in state_dict else unwrapped_key(key))


def _save_members(module, state_dict, prefix, local_metadata) -> None:
    for b in getattr(module, _ATTR).buckets:
        keys = [_key_in(state_dict, prefix, k) for k in b.keys]
        if not all(k in state_dict for k in keys):
            continue  # the members are not this state_dict's (a submodule's own call)
        for key, shard in zip(keys, b.member_shards()):
            state_dict[key] = shard


def _load_members(module, state_dict, prefix, local_metadata, strict, missing, unexpected,
                  errors) -> None:
    for b in getattr(module, _ATTR).buckets:
        keys = [_key_in(state_dict, prefix, k) for k in b.keys]
        if not any(k in state_dict for k in keys):
            continue  # missing keys are reported by the load itself
        absent = [k for k in keys if k not in state_dict]
        if absent:
            errors.append(f"ragged bucket {b.name}: missing {absent}")
            continue
        values = [state_dict[k] for k in keys]
        with torch.no_grad():
            if all(isinstance(v, RaggedMember) and v.runs == b.member_runs[i] and v.cut == b.cut
                   for i, v in enumerate(values)):
                # laid out as the members already (a full state dict torch distributed into
                # them, full_state_dict.py): each run copied into place, no collective
                local = b.param.to_local()
                for i, v in enumerate(values):
                    b.run_of(local, i).copy_(v.to_local())
            else:
                b.param.to_local().copy_(b.bucket_from(values).to_local())
        # the load then copies each member into itself: its values are in the bucket already;
        # with assign=True it sets the member itself, which stays the parameter the bucket's
        # gradients are handed to (a new one, a view of the bucket, would get none)
        assign = local_metadata.get("assign_to_params_buffers", False)
        for k, member in zip(keys, b.members):
            state_dict[k] = member if assign else member.detach()


def keep_buckets_whole(model: nn.Module) -> None:
    """``model`` (the root ``data_parallel`` wrapped) keeps its ragged buckets whole where
    ``nn.Module`` would take their members apart: ``model.to_empty(...)``, ``model.to(...)``
    (``_apply``) rebuild each bucket around its members' new storage
    (:meth:`RaggedShards.rebind`), and ``copy.deepcopy(model)`` copies each bucket once with
    its members views of the copy (:meth:`RaggedShards.copy_into`)."""
    cls = model.__class__

    def _apply(self, fn, recurse=True):
        out = cls._apply(self, fn, recurse)
        for bucket in model_buckets(self):
            bucket.rebind()
        return out

    def __deepcopy__(self, memo):
        for bucket in model_buckets(self):
            bucket.copy_into(memo)
        twin = cls.__new__(type(self))
        memo[id(self)] = twin
        for key, value in self.__dict__.items():
            object.__setattr__(twin, key, copy.deepcopy(value, memo))
        for bucket in model_buckets(twin):
            bucket.hook_grads()
        return twin

    swap_class(model, cls.__name__, {"_apply": _apply, "__deepcopy__": __deepcopy__})


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
    slot (converted from its bucket), so code written for per-parameter shards
    (``init_sharded``, a Hugging Face load) runs as without; after: the members' values go
    back into their buckets and the members' own parameters into their slots. Collective:
    every rank enters it. Nested, the inner one finds the members out already and does
    nothing."""
    members = {bucket: slots for bucket, slots in _members(model).items()
               if slots[0][0]._parameters[slots[0][1]] is bucket.members[0]}
    for bucket, slots in members.items():
        # on the compute device, as without offload: an init draws its values there
        for (module, name), shard in zip(slots, bucket.member_shards(home=False)):
            module._parameters[name] = nn.Parameter(shard, requires_grad=False)
    try:
        yield
    finally:
        for bucket, slots in members.items():
            values = [module._parameters[name] for module, name in slots]
            with torch.no_grad():
                bucket.param.to_local().copy_(bucket.bucket_from(values).to_local())
            for (module, name), member in zip(slots, bucket.members):
                module._parameters[name] = member


def optim_state_by_member(model: nn.Module, state: dict) -> dict:
    """``state``, a flattened optimizer state dict of ``model`` (``get_state_dict`` with
    ``flatten_optimizer_state_dict=True``), with each ragged member's state laid out as its
    parameter (a ragged run) made the member's ``Shard(0)`` DTensor, as without ragged
    buckets: it loads at another world size or layout. Scalars (``step``) and options stay.
    Collective (one all-to-all per bucket and state): every rank calls it;
    :func:`optim_state_by_bucket` is its inverse."""
    out = dict(state)
    for bucket in model_buckets(model):
        for name in _state_names(out, bucket):
            keys = [f"state.{fqn}.{name}" for fqn in bucket.fqns]
            # a frozen member has no state
            shards = bucket.shards_of_runs([out.get(k) for k in keys])
            for k, shard in zip(keys, shards):
                if k in out:
                    out[k] = shard
    return out


def optim_state_by_bucket(model: nn.Module, state: dict) -> dict:
    """The inverse of :func:`optim_state_by_member`: each member's ``Shard(0)`` DTensor (or
    full tensor) of a state laid out as its parameter becomes its ragged run, as the
    optimizer holds it (``set_state_dict`` takes it). A member's other tensors (``step``)
    are copies: an optimizer steps them in place. Collective."""
    out = dict(state)
    for bucket in model_buckets(model):
        for fqn in bucket.fqns:
            head = f"state.{fqn}."
            for k, v in out.items():
                if k.startswith(head) and isinstance(v, torch.Tensor):
                    out[k] = v.clone()
        for name in _state_names(out, bucket):
            keys = [f"state.{fqn}.{name}" for fqn in bucket.fqns]
            present = [k in out for k in keys]
            values = [out[k] if k in out else torch.zeros(shape) for k, shape
                      in zip(keys, bucket.member_shapes)]
            local = bucket.bucket_from(values).to_local()
            for i, k in enumerate(keys):
                if present[i]:
                    out[k] = bucket.member(bucket.run_of(local, i).clone(), i)
    return out


def offload_of(model: nn.Module) -> str:
    """The offload ``model``'s ragged buckets were wrapped with (offload.py): one for all."""
    return next((b.offload.kind for b in model_buckets(model)), "none")


@torch.compiler.disable  # eager, before the compiled forward: what the optimizer wrote is data
def refresh_resident(model: nn.Module, args=None) -> None:
    """Every ragged bucket's resident copy on the compute device made its host shard's values
    again where an optimizer step (or a load) wrote it since (offload "optimizer",
    simplesharded/storage/offload.py); ``model``'s forward pre-hook."""
    for bucket in model_buckets(model):
        bucket.offload.refresh(bucket.param.to_local())


def model_buckets(model: nn.Module) -> Iterator[RaggedShards]:
    """Every ragged bucket of ``model`` (or its compiled wrapper), in module order (the same
    on every rank)."""
    for module in getattr(model, "_orig_mod", model).modules():
        yield from getattr(getattr(module, _ATTR, None), "buckets", ())


def _state_names(state: dict, bucket: RaggedShards) -> list[str]:
    """The names of the states laid out as parameters that ``bucket``'s members hold in
    ``state`` (``exp_avg``, ``exp_avg_sq``, ...), sorted so every rank converts in one order:
    a state whose shape is its member's."""
    names = set()
    for fqn, shape in zip(bucket.fqns, bucket.member_shapes):
        head = f"state.{fqn}."
        names |= {k[len(head):] for k, v in state.items()
                  if k.startswith(head) and "." not in k[len(head):]
                  and isinstance(v, torch.Tensor) and tuple(v.shape) == shape and v.dim() > 0}
    return sorted(names)
