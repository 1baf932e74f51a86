"""Flat shard storage: a bucket's local shards in one contiguous buffer
(``data_parallel(..., flat_buckets=True)``).

Each parameter keeps its DTensor shard (same FQN, placements, shape) whose local tensor is a
view of its bucket's buffer, so ``state_dict()``, DCP, optimizers and ``init_sharded`` read
and write the buffer through the views and nothing changes for them. ``forward`` reads a
bucket's shards through one autograd leaf over the same buffer, split once per forward
(:meth:`FlatShards.pieces`). Two copies of a bucketed step then go away:

  * the all-gather's copy-in: the bucket's input is adjacent views of the leaf, which
    passes/view_cat.py turns into one view of the buffer (under mixed precision the cast of
    the buffer is the only copy);
  * the gradient's copy-out: the split's backward concatenates the gradient pieces in buffer
    order, which is the bucketed reduce-scatter's output as it is (view_cat again), so the
    leaf's gradient is that output; after backward each parameter's ``.grad`` is set to its
    view (:meth:`FlatShards.hand_out_grad`), or added to what is there (accumulation).

The all-gather's copy-out stays: a parameter sharded on dim 0 is interleaved across the
ranks' chunks of the gathered buffer (docs/zero_copy.md says why its placement stays).

Invariant: a buffer's members, order and offsets depend only on the module tree and the
parameters' shapes, so they are the same on every rank; a buffer holds one dtype and
parameters gathered over one dp mesh with the same placements there, sharded evenly on dim 0
only (replicated over HSDP's other dim). Under TP and EP that is dim 0 of the rank's
model-parallel shard, which is what the dp gather rebuilds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from simplesharded.gather import _ScaleGrad
from simplesharded.passes.annotations import FLAT_KEY

if TYPE_CHECKING:
    from simplesharded.gather import _GatherScope


@dataclass(frozen=True)
class FlatSlot:
    """Where one parameter's local shard lives: ``flat``'s elements [offset, offset + numel)."""

    flat: "FlatShards"
    index: int
    offset: int
    numel: int

    def view_of(self, t: torch.Tensor) -> torch.Tensor:
        """This parameter's local shard in ``t``, a tensor laid out as the buffer (the
        buffer, its leaf, or the leaf's gradient): a view."""
        return t.narrow(0, self.offset, self.numel).view(self.flat.shapes[self.index])


class FlatShards:
    """One bucket's local shards in one buffer, and the autograd leaf forward reads them by."""

    def __init__(self, name: str, params: list[tuple[str, nn.Parameter]], scope: _GatherScope,
                 grad_scale: float = 1.0):
        self.name = name
        self.scope = scope
        self.grad_scale = grad_scale
        self.fqns = [fqn for fqn, _ in params]
        locals_ = [p.to_local() for _, p in params]
        self.numels = [t.numel() for t in locals_]
        self.shapes = [tuple(t.shape) for t in locals_]
        self.slots: list[FlatSlot] = []
        offset = 0
        for i, numel in enumerate(self.numels):
            self.slots.append(FlatSlot(self, i, offset, numel))
            offset += numel
        buffer = self._buffer_of(locals_)
        self.params: list[nn.Parameter] = [
            nn.Parameter(self._shard_in(buffer, i, p), requires_grad=p.requires_grad)
            for i, (_, p) in enumerate(params)]
        self._lead(buffer)

    def _buffer_of(self, locals_: list[torch.Tensor]) -> torch.Tensor:
        """A new buffer holding ``locals_`` (one per member) at the members' offsets."""
        first = locals_[0]
        buffer = torch.empty(sum(self.numels), dtype=first.dtype, device=first.device)
        for slot, local in zip(self.slots, locals_):
            slot.view_of(buffer).copy_(local)
        return buffer

    def _shard_in(self, buffer: torch.Tensor, index: int, like: DTensor) -> DTensor:
        """Member ``index``'s shard (placements and shape of ``like``) as a view of ``buffer``."""
        return DTensor.from_local(self.slots[index].view_of(buffer), like.device_mesh,
                                  like.placements, run_check=False, shape=like.shape,
                                  stride=like.stride())

    def _lead(self, buffer: torch.Tensor) -> None:
        self.specs = [p._spec for p in self.params]  # the gradients' too (hand_out_grad)
        # The leaf shares the buffer's storage: what the optimizer writes through the shards
        # is what the next forward reads.
        self.leaf = buffer.detach().requires_grad_(True)
        self.leaf.register_post_accumulate_grad_hook(self.hand_out_grad)

    def rebind(self) -> None:
        """After ``nn.Module._apply`` (``to_empty``, ``to``) gave the members storage of their
        own (it swaps each parameter's contents, keeping the object): one buffer holding their
        values again, the members views of it, and a leaf over it. Otherwise forward would read
        the old buffer while the optimizer, ``init_sharded`` and checkpoints write the new
        storage. The parameter objects stay, so an optimizer built on them keeps working."""
        locals_ = [p.to_local() for p in self.params]
        leaf = self.leaf.detach()
        if all(t.dtype == leaf.dtype and t.device == leaf.device
               and (t.numel() == 0 or t.data_ptr() == slot.view_of(leaf).data_ptr())
               for t, slot in zip(locals_, self.slots)):
            return
        buffer = self._buffer_of(locals_)
        for i, p in enumerate(self.params):
            torch.utils.swap_tensors(p, nn.Parameter(self._shard_in(buffer, i, p),
                                                     requires_grad=p.requires_grad))
        self._lead(buffer)

    def piece(self, index: int) -> torch.Tensor:
        """Member ``index``'s local shard, a view of the leaf. Inside the model's forward the
        bucket is split once (cached in the gather scope, emptied at both ends of forward)."""
        scope = self.scope
        pieces = scope.flat_pieces.get(self.name) if scope.active else None
        if pieces is None:
            pieces = self.pieces()
            if scope.active:
                scope.flat_pieces[self.name] = pieces
        return pieces[index]

    def pieces(self) -> tuple[torch.Tensor, ...]:
        """The local shards as views of the leaf, in buffer order: one split, whose backward
        is one concatenation of their gradients; the gradient's "avg" scaling once, here."""
        # Annotated: the recompute pass recomputes these views in backward, so a re-gather
        # there reads the leaf, not one saved view per parameter (passes/recompute.py).
        with fx_traceback.annotate({FLAT_KEY: self.name}):
            leaf = self.leaf
            if self.grad_scale != 1.0:
                leaf = _ScaleGrad.apply(leaf, self.grad_scale, {FLAT_KEY: self.name})
            pieces = torch.split(leaf, self.numels)
            return tuple(t.view(s) for t, s in zip(pieces, self.shapes))

    def hand_out_grad(self, leaf: torch.Tensor) -> None:
        """The leaf's gradient as each parameter's ``.grad`` (views: no copy), added to a
        gradient already there; the leaf's own is dropped, so ``zero_grad`` on the
        parameters is all a training loop does."""
        grad, leaf.grad = leaf.grad, None
        for p, slot, spec in zip(self.params, self.slots, self.specs):
            local = slot.view_of(grad)
            if p.grad is None:
                # DTensor's own constructor with the parameter's spec: from_local costs ~8x
                # more (a new spec and an autograd function per call), per parameter per step
                p.grad = DTensor(local, spec, requires_grad=False)
            else:
                p.grad.to_local().add_(local)


def dp_view(shard: DTensor, mp_layout, spec) -> tuple:
    """What the dp all-gather of a parameter sees (gather.py): its mesh, its placements there
    and the shape it gathers back (the rank's model-parallel shard under TP or EP)."""
    if mp_layout is not None:
        return spec.dp_mesh, tuple(mp_layout.dp_placements), tuple(mp_layout.local_shape)
    if spec.dp_mesh is not None:  # a plain parameter on a mesh with tp/ep dims after the dp ones
        return spec.dp_mesh, tuple(shard.placements[:spec.dp_mesh.ndim]), tuple(shard.shape)
    return shard.device_mesh, tuple(shard.placements), tuple(shard.shape)


def flat_eligible(shard: DTensor, mp_layout, spec) -> bool:
    """Whether a parameter can live in a flat buffer: trained, and sharded evenly on dim 0 of
    what its dp all-gather sees (FSDP; HSDP's replicated dim aside; under TP and EP the rank's
    model-parallel shard, so its local shard is a dim-0 slice of that)."""
    if not shard.requires_grad:
        return False
    mesh, placements, shape = dp_view(shard, mp_layout, spec)
    if any(type(p) not in (Shard, Replicate) for p in placements):
        return False  # _StridedShard and the like
    if any(isinstance(p, Shard) and p.dim != 0 for p in placements):
        return False
    sharded = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    return bool(sharded) and shape[0] % math.prod(mesh.size(i) for i in sharded) == 0
