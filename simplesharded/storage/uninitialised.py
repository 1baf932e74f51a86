"""A model built on the meta device: its shards hold NaN until initialised, and its first
uncompiled forward checks that they no longer do.

``data_parallel`` gives a meta-built model storage on the mesh's device; ``init_sharded``, a
checkpoint load or the user's own writes to the shards give it values. Filled with NaN rather
than left as whatever the allocator returned (often zeros, which train without a sound), a
tensor nobody initialised is told apart, and the first forward raises naming it (an init that
skipped a parameter, a forgotten ``init_sharded``). Compiled, the graph cannot branch on the
values: the first loss is NaN instead.

Invariant: every rank raises or none does. Each rank's finding is reduced over every dim of
the model's mesh before anyone raises, so a rank whose part of the tensor is empty raises with
the others instead of waiting in the forward's first gather.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor



def uninitialised_like(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Storage shaped as ``t`` on ``device``: NaN when floating point (see module doc)."""
    out = torch.empty_like(t, device=device)
    if out.is_floating_point() or out.is_complex():
        out.fill_(float("nan"))
    return out


def _first_nan(model: nn.Module) -> str | None:
    """The first parameter, then buffer, of which this rank holds a NaN, named (a ragged
    bucket's member is read in place: its local tensor is a view of the bucket)."""
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        local = t.to_local() if isinstance(t, DTensor) else t
        if (local.is_floating_point() or local.is_complex()) and bool(torch.isnan(local).any()):
            return repr(name)
    return None


class InitCheck:
    """Called by the root's forward (uncompiled) until one call finds nothing, and by a
    submodule's called on its own (forward_scope.py) until one finds nothing in it or the
    root's has passed: raises a ValueError on every rank of ``mesh`` when any rank holds a NaN
    parameter or buffer of the module called."""

    def __init__(self, mesh: DeviceMesh):
        self.groups = [mesh.get_group(i) for i in range(mesh.ndim)]
        self.device = torch.device(mesh.device_type)
        self.passed = False  # the whole model's
        self.passed_parts: set[int] = set()  # ids of submodules found initialised

    def __call__(self, module: nn.Module, root: bool = True) -> None:
        if self.passed or id(module) in self.passed_parts:
            return
        mine = _first_nan(module)
        found = torch.tensor([mine is not None], dtype=torch.int32, device=self.device)
        for group in self.groups:  # the max over each dim in turn: over the whole mesh
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        if not found.item():
            if root:
                self.passed = True
            else:
                self.passed_parts.add(id(module))
            return
        where = f"{mine} holds NaN" if mine is not None else "a tensor holds NaN on another rank"
        call = "the model's first forward" if root else f"a call of {type(module).__name__}"
        raise ValueError(
            f"{where} at {call}: the model was built on the meta device and "
            f"data_parallel gave it uninitialised shards (NaN). Initialise them first: "
            f"ss.init_sharded(model, seed=0) runs the model's init, or load a checkpoint, or "
            f"run an init of your own after data_parallel (outside forward module.weight is "
            f"the shard, as under FSDP2)")
