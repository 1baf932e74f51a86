"""Skip the data-parallel gradient reduction for some backwards (gradient accumulation):
``set_requires_gradient_sync(model, False)`` / ``no_gradient_sync(model)``, FSDP2's knob.

Normally the gradient of a gathered parameter is reduced (reduce-scatter, or all-reduce over
replicated dims) onto its shard in the backward that produced it, so gradient accumulation
over N micro-batches reduces N times. With sync off, a forward routes each gathered
parameter's gradient elsewhere:

- **sync off**: the gathered tensor is detached from its gather (so autograd runs no
  reduction, traced or eager, and the shard's ``.grad`` is left alone) and passed through
  :class:`_DeferGrad`, whose backward hands the gradient to a second input instead: a
  per-parameter *accumulator leaf* (an expanded zero scalar of the gathered shape, so it costs
  no memory itself). Autograd's own AccumulateGrad then sums every micro-batch into that
  leaf's ``.grad`` outside any graph: a full-size, unreduced, rank-local gradient.
- **sync back on** (the call, not the forward): each leaf's ``.grad`` becomes *pending* and the
  leaf is cleared. The next forward with gradients enabled passes each pending gradient as
  an input to :class:`_AddGrad` on that parameter's gathered tensor (compiled: a graph input),
  whose backward adds it to the current gradient before the usual reduction: one reduction
  per parameter (per bucket, compiled) for all micro-batches, landing on the shard's
  ``.grad`` as without accumulation. A pending gradient is taken by the first gather of its
  parameter (a parameter gathered twice in one eager forward gets it once) and is freed when
  that backward has used it.

Memory: between the first no-sync backward and the sync backward every rank holds one
full-size (unsharded) gradient per parameter (per ragged bucket: its gathered buffer's) in the
accumulation dtype below: the whole model's gradients, unsharded, as DDP's and FSDP2's
``no_sync`` do; under bf16 reductions half the bytes of fp32 sums. That is the price of
reducing once; with sync on every backward the gradients stay sharded.

Dtype: the sums are kept in the dtype the gradient is reduced in, as FSDP2 keeps them:
``reduce_dtype``, else ``param_dtype`` (the gathered tensor's, its gradient's), else the
parameter's own (``_GatherSpec.reduction_dtype``; a ragged bucket's
``Precision.reduction_dtype``). :class:`_DeferGrad` casts each micro-batch's gradient to it
(a no-op unless ``reduce_dtype`` differs from the gathered dtype) and autograd sums it there.
The sync backward adds the sum to the current gradient and hands the total to the reduction in
the gathered tensor's dtype (autograd casts a gradient to its tensor's dtype), which then casts
it to ``reduce_dtype`` as usual: under bf16 ``param_dtype`` and fp32 ``reduce_dtype`` the fp32
sum is rounded to bf16 once, as each micro-batch's own gradient is; under bf16 ``reduce_dtype``
the sum is bf16 throughout, each micro-batch rounded to bf16 as it is added. With bf16
``param_dtype`` and no ``reduce_dtype`` the sum is bf16 too (FSDP2's), though a ragged bucket,
and DTensor in the torch versions that reduce a gradient in its shard's dtype (2.13 does), then
reduce it in fp32, as they reduce a synced bf16 gradient. A pipeline stage's deferred reduction
(simplesharded/storage/deferred_reduce.py) reduces a parameter's sum in its own dtype, without a
cast, and a bucket's as the bucket's sync backward would.

Compiled: the mode is read while tracing (``sync``, and the keys of the accumulator and pending
dicts), so dynamo guards on it: sync, no-sync and sync-with-pending are separate graphs,
compiled once each and then selected by their guards, not recompiled per step.

Every rank must toggle identically (same sequence of settings around the same forwards): the
setting decides whether a backward reduces at all (docs/rank_agreement.md).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from simplesharded.storage.ragged_shards import model_buckets
from simplesharded.storage.sharded_state import root_state, sharded_params


class _DeferGrad(torch.autograd.Function):
    """Identity on ``x`` (a detached gathered tensor); its gradient goes to ``acc`` (the
    accumulator leaf), in the leaf's dtype (the accumulation dtype: module doc)."""

    @staticmethod
    def forward(ctx, x, acc):
        ctx.acc_dtype = acc.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return None, grad.to(ctx.acc_dtype)


class _AddGrad(torch.autograd.Function):
    """Identity on ``x``; its backward adds ``pending`` (earlier micro-batches' gradients) to the
    gradient. ``pending`` is kept on ctx, not saved with ``save_for_backward``: saved-tensor
    hooks (activation checkpointing, eager resharding) must not see it, since a recomputation
    of the forward finds nothing pending and would save one tensor fewer."""

    @staticmethod
    def forward(ctx, x, pending):
        ctx.pending = pending
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        total = (ctx.pending + grad).to(grad.dtype)
        ctx.pending = None
        return total, None


class _GradSync:
    """One per wrapped model (in every wrapped module's state, and in every gather spec)."""

    def __init__(self):
        self.sync = True
        # fqn (a ragged bucket: its name) → accumulator leaf (made when sync goes off)
        self.acc: dict[str, torch.Tensor] = {}
        self.pending: dict[str, torch.Tensor] = {}  # the same keys → gradient to add once
        # fqn → the full tensor gathered once for several forwards (simplesharded/storage/gather_once.py)
        self.held: dict[str, torch.Tensor | None] = {}

    def route(self, local: torch.Tensor, fqn: str) -> torch.Tensor:
        """The gathered tensor as the module sees it (called in gather_param)."""
        if not torch.is_grad_enabled():
            return local
        if not self.sync:
            acc = self.acc.get(fqn)
            return local if acc is None else _DeferGrad.apply(local.detach(), acc)
        pending = self.pending.pop(fqn, None)
        return local if pending is None else _AddGrad.apply(local, pending)

    def held_for(self, key: str) -> torch.Tensor | None:
        """The full tensor gathered once for several forwards under ``key`` (an FQN, or a
        ragged bucket's name; simplesharded/storage/gather_once.py), if any: its gradient reaches the
        accumulators only, so sync must be off."""
        held = self.held.get(key)
        if held is not None and self.sync and torch.is_grad_enabled():
            raise RuntimeError(f"{key} is held gathered (model.unshard(), or the pipeline's "
                               f"gather_once) while gradient sync is on: its gradient would "
                               f"never be reduced; call model.reshard() first, or turn "
                               f"gradient sync off")
        return held

    def sharded_params(self, model: nn.Module) -> Iterator[tuple]:
        """(param, shard) of every sharded parameter of ``model`` under this sync, in module
        order (a tied parameter once per module that holds it), ragged buckets' members
        aside: their bucket is what is gathered and reduced (:meth:`ragged_buckets`)."""
        for param, shard in sharded_params(model):
            if param.spec.grad_sync is self and param.ragged is None:
                yield param, shard

    def ragged_buckets(self, model: nn.Module) -> Iterator:
        """Every ragged bucket of ``model`` under this sync (simplesharded/storage/ragged_shards.py),
        in module order."""
        for bucket in model_buckets(model):
            if bucket.grad_sync is self:
                yield bucket

    def make_accumulators(self, model: nn.Module) -> None:
        for param, shard in self.sharded_params(model):
            if param.fqn in self.acc or not shard.requires_grad:
                continue
            shape = param.dp_view(shard).shape
            dtype = param.spec.reduction_dtype(shard.dtype)
            zero = torch.zeros((), dtype=dtype, device=shard.device)
            self.acc[param.fqn] = zero.expand(shape).requires_grad_()
        for bucket in self.ragged_buckets(model):  # one leaf per gathered buffer
            if bucket.name not in self.acc and bucket.trains:
                self.acc[bucket.name] = bucket.accumulator()

    def take_accumulated(self) -> None:
        """Move each leaf's summed gradient to ``pending`` (added to an older pending one, if a
        sync forward has not taken that yet)."""
        for fqn, leaf in self.acc.items():
            if leaf.grad is None:
                continue
            old = self.pending.get(fqn)
            self.pending[fqn] = leaf.grad if old is None else old + leaf.grad
            leaf.grad = None

    def discard(self) -> None:
        """The gradients summed with sync off and not reduced yet, dropped (an aborted
        iteration, FSDP2's ``reset_iter_state``); the setting stays."""
        for leaf in self.acc.values():
            leaf.grad = None
        self.pending.clear()


def set_requires_gradient_sync(model: nn.Module, requires_sync: bool) -> None:
    """Whether the backwards of the next forwards of ``model`` (the root returned by
    :func:`data_parallel`, or its ``torch.compile`` wrapper) reduce gradients over the
    data-parallel dims. Off: each backward sums each parameter's full-size local gradient on
    the rank (no communication, the shards' ``.grad`` untouched). Back on: the next forward's
    backward adds those sums to its own gradients and reduces once.

    The setting in effect when a *forward* runs decides what its backward does; set it before
    the forward (as FSDP2's ``set_requires_gradient_sync`` is used) and turn it back on after
    the last no-sync backward. Memory: while off, every rank holds the whole model's
    gradients unsharded (see simplesharded/storage/grad_sync.py). All ranks must make the same calls.
    """
    model, root = root_state(model)
    state = root.grad_sync
    if not requires_sync:
        state.make_accumulators(model)
    elif not state.sync:
        state.take_accumulated()
    state.sync = bool(requires_sync)


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[nn.Module]:
    """``set_requires_gradient_sync(model, False)`` for the forwards (and their backwards)
    inside; the previous setting afterwards. Like DDP's ``no_sync``: run the micro-batches
    before the last one inside, the last one outside."""
    previous = root_state(model)[1].grad_sync.sync
    set_requires_gradient_sync(model, False)
    try:
        yield model
    finally:
        set_requires_gradient_sync(model, previous)
