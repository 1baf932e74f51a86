"""Global-norm gradient clipping inside a compiled step, on the local shards.

``torch.nn.utils.clip_grad_norm_`` on sharded gradients reduces one norm per gradient (a
collective each). Here each rank sums the squares of its local shards, one all-reduce per
(mesh, sharded dims) adds the ranks' sums (a functional collective, so it is a node of the
traced graph), and every local shard is scaled by the same coefficient as torch's:
``min(1, max_norm / (norm + 1e-6))``. The sums run in another order than torch's norms, so the
result agrees to rounding (≤ 1e-6 relative), not bitwise.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
import torch.distributed._functional_collectives as funcol


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _sharded_dims(g: torch.Tensor) -> tuple:
    """(mesh, the mesh dims ``g`` is sharded over): the ranks whose shards make up ``g``.
    Replicated dims hold copies, which must be counted once."""
    if not isinstance(g, DTensor):
        return None, ()
    mesh = g.device_mesh
    dims = tuple(i for i, p in enumerate(g.placements) if p.is_shard())
    if any(p.is_partial() for p in g.placements):
        raise ValueError("compile_step's clipping needs reduced gradients, got a Partial one")
    return mesh, dims


def global_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all of ``grads`` together (float32, on every rank the same)."""
    groups: list[tuple] = []  # (mesh, dims, [local sums of squares])
    for g in grads:
        mesh, dims = _sharded_dims(g)
        sq = torch.linalg.vector_norm(_local(g), dtype=torch.float32) ** 2
        for m, d, parts in groups:
            if m == mesh and d == dims:
                parts.append(sq)
                break
        else:
            groups.append((mesh, dims, [sq]))
    total = None
    for mesh, dims, parts in groups:
        s = torch.stack(parts).sum()
        for d in dims:  # sums over one mesh dim at a time: the dims' groups compose
            s = funcol.all_reduce(s, "sum", (mesh, d))
        total = s if total is None else total + s
    return total.sqrt()


def clip_(grads: list, max_norm: float) -> torch.Tensor:
    """Scale ``grads`` (None entries skipped) in place, on their local shards, so their
    global norm is at most ``max_norm``; returns the norm before clipping."""
    present = [g for g in grads if g is not None]
    norm = global_norm(present)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in present:
        _local(g).mul_(coef.to(g.dtype))
    return norm
