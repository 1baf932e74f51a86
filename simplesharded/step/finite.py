"""The step graph's finiteness flag: whether this step's update may be taken.

The split step skips a step after reading the loss and the gradient norm on the host
(simplesharded/trainer/loop.py: ``training.on_nonfinite skip``). In the step graph the update
runs before the host sees either, so the graph computes the decision itself, as a 0-d bool
tensor that the update's commits select on (simplesharded/step/optim_update.py): no
``.item()`` inside the graph, and no branch that would split it.

Every rank must reach the same decision, or the ranks' shards of one parameter would part
ways. The gradient norm already is the same on every rank (simplesharded/step/grad_clip.py
all-reduces it), and a non-finite gradient anywhere makes it non-finite everywhere, since the
reduce-scatter spreads it. A rank's loss is its own, so its non-finiteness is all-reduced:
one count, summed over the default group, the ranks that share the loss as the split step's
``dist.all_reduce`` of it does. The flag is therefore what the split step tests, with the
same ranks' values: the global loss and the global norm both finite.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor


def all_finite(loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor, the same on every rank: every rank's ``loss`` and the global gradient
    ``norm`` are finite. Traced; one all-reduce of one element when a process group is up."""
    if isinstance(loss, DTensor):  # under loss parallelism: replicated over tp
        loss = loss.to_local()
    bad = (~torch.isfinite(loss)).sum(dtype=torch.float32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        bad = funcol.all_reduce(bad, "sum", dist.group.WORLD)
    return (bad == 0) & torch.isfinite(norm)
