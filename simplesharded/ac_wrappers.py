"""torch's activation checkpointing wrapper (``checkpoint_wrapper``, as torchtitan and FSDP2
users apply it before sharding): compiled as our own recompute regions, and its modules'
state-dict keys as without it.

Uncompiled, a ``CheckpointWrapper`` runs ``torch.utils.checkpoint`` as it always does. Traced,
it cannot: the checkpoint's higher-order op forbids the gather cache's writes (a parameter
read twice in one forward is gathered once) and would save a DeviceMesh for backward, which
aot_autograd rejects. So when compiling, each wrapper runs its module with its ops annotated
as one region (``passes/annotations.py`` AC_KEY), and passes/recompute.py has the partitioner
recompute inside it, the parameter gathers included, as the trainer's own activation
checkpointing does. A wrapper's ``context_fn`` (selective checkpointing policy) then does not
apply: the region is recomputed except its collectives and routing decisions.

The wrapper holds its module as ``_checkpoint_wrapped_module`` and its state-dict hooks drop
that name from the keys; a ragged bucket's members (simplesharded/storage/ragged_shards.py) are listed
by their owner's hook, which drops it too (:func:`unwrapped_key`).

Invariant: the region ids are the wrappers' positions in module order, the same on every rank.
"""
from __future__ import annotations

import functools

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX, CheckpointWrapper)

from simplesharded.passes.annotations import AC_KEY


def compile_checkpoint_wrappers(model: nn.Module) -> None:
    """Give each ``CheckpointWrapper`` in ``model`` the compiled form above."""
    wrappers = [m for m in model.modules() if isinstance(m, CheckpointWrapper)]
    for region, wrapper in enumerate(wrappers):
        wrapper.forward = functools.partial(_forward, wrapper, wrapper.forward, region)


def _forward(wrapper: CheckpointWrapper, checkpointed, region: int, *args, **kwargs):
    if not torch.compiler.is_compiling():
        return checkpointed(*args, **kwargs)
    with fx_traceback.annotate({AC_KEY: region}):
        return wrapper._checkpoint_wrapped_module(*args, **kwargs)


def unwrapped_key(key: str) -> str:
    """A state-dict key as without checkpoint wrappers."""
    return key.replace(_CHECKPOINT_PREFIX, "")
