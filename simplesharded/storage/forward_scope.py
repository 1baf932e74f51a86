"""Which forwards gather: the root's, and a wrapped module's called on its own.

``data_parallel`` gives the root, and every module below it that holds sharded parameters
(itself or in its children), a forward that opens the model's gather scope (gather.py's
``_GatherScope``) for the call when no call has it open: the root's every forward, a
submodule's only when it is called outside the root's forward (``model.model(ids)``,
``model.layers[0](h, ...)``, ``model.get_input_embeddings()(ids)``), as FSDP2 gathers a
``fully_shard`` unit in that unit's own forward. Such a call reads gathered parameters,
reduces their gradients, reshards after forward and casts its inputs and outputs as the
root's does; a read outside every call is the shard (gather.py). Like any FSDP2 unit's
forward, it is a collective: every rank of the dp groups makes it. A module compiled on its
own inside an uncompiled forward (blocks compiled one by one) caches its gathers for its own
graph only.

Inside forward, not in hooks: torch.compile runs a compiled module's hooks outside the traced
frame, where the scope's dicts would become graph outputs and a cast a graph of its own. Not
in a backward: torch.utils.checkpoint's recompute of a module reads gathered parameters
without the scope (gather.py's ``_reads_gathered``).

Invariant: the scope is open for the outermost wrapped call only, and emptied at both ends of
it, so no gathered tensor outlives the call; a traced frame ends with the scope's dicts as it
found them, so none escapes its graph as an output (docs/torch_internals.md).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from simplesharded.storage.eager_reshard import _EagerReshard
from simplesharded.storage.ragged_shards import _in_backward
from simplesharded.storage.sharded_state import sharded_state


def cast_floats(dtype: torch.dtype | None, tree):
    """``tree`` with its floating-point tensors in ``dtype`` (None: as they are)."""
    if dtype is None:
        return tree
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor)
                    and t.is_floating_point() else t, tree)


def _gathering_call(module: nn.Module, inner: Callable, args, kwargs, root: bool):
    """``inner(module, *args, **kwargs)`` with the model's gather scope open (``root``: by
    the root's forward, whose uncompiled order of gathers prefetch.py records)."""
    scope = sharded_state(module).scope
    scope.gathered.clear()
    scope.bucket_views.clear()
    scope.drop_backward_views()  # left by a backward that raised before its end
    scope.active = True
    scope.traced = torch.compiler.is_compiling()
    hooks = contextlib.nullcontext()
    eager = not torch.compiler.is_compiling()
    if eager:
        scope.prefetch.begin(root)
    # Uncompiled with grad: free gathered parameters after forward (_EagerReshard).
    # Compiled, the partitioner decides (passes/recompute.py) and no hook is traced; no
    # grad, autograd saves nothing and each gather dies after its use.
    if eager and scope.reshard_after_forward is not False and torch.is_grad_enabled():
        scope.eager = _EagerReshard(scope)
        hooks = torch.autograd.graph.saved_tensors_hooks(scope.eager.pack, scope.eager.unpack)
    try:
        with hooks:
            return inner(module, *args, **kwargs)
    finally:
        if eager:
            scope.prefetch.end()
        scope.gathered.clear()
        scope.bucket_views.clear()
        scope.active = False
        scope.traced = False
        # kept until the next forward: what its backward holds, if an exception aborts it
        scope.last_eager, scope.eager = scope.eager, None


def abandon_iteration(scope) -> None:
    """After an exception aborted a forward or its backward (FSDP2's ``reset_iter_state``):
    gathers issued ahead waited for and dropped, buffers held for the backward dropped, the
    prefetch order forgotten, the scope closed."""
    scope.prefetch.reset()
    if scope.last_eager is not None:
        scope.last_eager.abandon()
    scope.last_eager = scope.eager = None
    scope.gathered.clear()
    scope.bucket_views.clear()
    scope.drop_backward_views()
    scope.active = scope.traced = False


def root_forward(inner: Callable, output_dtype: torch.dtype | None,
                 init_check: Callable[[nn.Module], None] | None) -> Callable:
    """The root's forward: ``inner`` with the scope open and its floating-point outputs cast
    to ``output_dtype`` (if set); uncompiled, ``init_check`` first (a meta-built model's shards
    are initialised, uninitialised.py)."""

    def forward(self, *args, **kwargs):
        if init_check is not None and not torch.compiler.is_compiling():
            init_check(self)
        return cast_floats(output_dtype, _gathering_call(self, inner, args, kwargs, True))

    return forward


def call_forward(inner: Callable, input_dtype: torch.dtype | None,
                 output_dtype: torch.dtype | None,
                 init_check: Callable[..., None] | None) -> Callable:
    """A submodule's forward: ``inner`` as it is inside a call that has the scope open (the
    root's, or an enclosing submodule's) and in a backward; otherwise ``inner`` with the scope
    open, its floating-point inputs cast to ``input_dtype`` and its outputs to
    ``output_dtype`` (each if set), as the root's are (``MixedPrecisionPolicy``'s
    ``cast_forward_inputs`` and ``output_dtype``); uncompiled, ``init_check`` first, on this
    module's own parameters."""

    def forward(self, *args, **kwargs):
        scope = sharded_state(self).scope
        if scope.active and torch.compiler.is_compiling() and not scope.traced:
            return _compiled_inside_uncompiled(scope, self, inner, args, kwargs)
        if scope.active or (not torch.compiler.is_compiling() and _in_backward()):
            return inner(self, *args, **kwargs)
        if init_check is not None and not torch.compiler.is_compiling():
            init_check(self, root=False)
        return cast_floats(output_dtype, _gathering_call(
            self, inner, cast_floats(input_dtype, args), cast_floats(input_dtype, kwargs),
            False))

    # A code object of its own: dynamo keeps its compiled graphs, and counts recompiles
    # against its limit, per code object, and a block's graph names the block's parameters,
    # so blocks compiled one by one (torchtitan's habit) each compile once without sharing
    # one limit (8) that a deeper model would exceed.
    forward.__code__ = forward.__code__.replace()
    return forward


def _compiled_inside_uncompiled(scope, module: nn.Module, inner: Callable, args, kwargs):
    """``inner`` traced inside a forward that opened the scope uncompiled (a block compiled on
    its own, the root not): its gathers are cached in dicts of its own, dropped when it ends,
    so none becomes an output of its graph and outlives the module (the uncompiled forward's
    dicts would keep every compiled module's gathers until that forward ends)."""
    outer = scope.gathered, scope.bucket_views
    scope.gathered, scope.bucket_views, scope.traced = {}, {}, True
    try:
        return inner(module, *args, **kwargs)
    finally:
        scope.gathered, scope.bucket_views = outer
        scope.traced = False
