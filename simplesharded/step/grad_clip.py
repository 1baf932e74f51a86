"""Global-norm gradient clipping inside a compiled step, on the local shards.

``torch.nn.utils.clip_grad_norm_`` on sharded gradients reduces one norm per gradient (a
collective each). Here the same arithmetic runs with one collective per (mesh, sharded dim):
each gradient's local 2-norm, all of a mesh's squared into one vector that one all-reduce
sums (a functional collective, so it is a node of the traced graph), its square root each
gradient's norm as DTensor's reduction gives it, then the 2-norm of those norms in the
gradients' order and the coefficient ``min(1, max_norm / (norm + 1e-6))`` — torch's own steps
in torch's order, so on 2 ranks the result is bitwise torch's (tests/test_step.py).

Each local norm is annotated with its parameter (``ss_update`` = ``<name>/norm``), so
passes/update_placement.py computes it as soon as that gradient's reduce-scatter lands, under
the next one; only the small all-reduce and the square roots wait for the last gradient.
"""
from __future__ import annotations

import torch
import torch.fx.traceback as fx_traceback
from torch.distributed.tensor import DTensor
import torch.distributed._functional_collectives as funcol

from simplesharded.passes.annotations import UPDATE_KEY

# The suffix of a local norm's ss_update annotation: its own group, apart from the update.
NORM_SUFFIX = "/norm"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _sharded_dims(g: torch.Tensor) -> tuple:
    """(mesh, the mesh dims ``g`` is sharded over): the ranks whose shards make up ``g``.
    Replicated dims hold copies, which must be counted once."""
    if not isinstance(g, DTensor):
        return None, ()
    mesh = g.device_mesh
    if any(p.is_partial() for p in g.placements):
        raise ValueError("compile_step's clipping needs reduced gradients, got a Partial one")
    # Every placement that is neither Replicate nor Partial splits the tensor: Shard, and
    # _StridedShard (FSDP's dim over TP's or EP's), which is not a Shard to is_shard().
    dims = tuple(i for i, p in enumerate(g.placements) if not p.is_replicate())
    return mesh, dims


def global_norm(grads: list[torch.Tensor], names: list[str] | None = None) -> torch.Tensor:
    """The 2-norm of all of ``grads`` together (float32, on every rank the same).
    ``names``: each gradient's parameter, for the annotation (see the module's docstring)."""
    if names is None:
        names = [str(i) for i in range(len(grads))]
    groups: dict[tuple, list[int]] = {}  # (mesh, dims) -> indices into grads
    local_norms = []
    for i, (g, name) in enumerate(zip(grads, names)):
        with fx_traceback.annotate({UPDATE_KEY: name + NORM_SUFFIX}):
            local_norms.append(torch.linalg.vector_norm(_local(g)))
        groups.setdefault(_sharded_dims(g), []).append(i)
    norms: list = [None] * len(grads)
    for (mesh, dims), idx in groups.items():
        v = torch.stack([local_norms[i] for i in idx])
        for d in dims:  # as DTensor reduces a norm: one mesh dim at a time
            v = funcol.all_reduce(v ** 2, "sum", (mesh, d)) ** 0.5
        for j, i in enumerate(idx):
            norms[i] = v[j]
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What clip_grad_norm_ scales every gradient by: ``min(1, max_norm / (norm + 1e-6))``."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def scaled(grad: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """``grad`` times ``coef``, a new tensor (a DTensor with ``grad``'s placements for a
    DTensor)."""
    local = _local(grad) * coef.to(grad.dtype)
    if not isinstance(grad, DTensor):
        return local
    return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False,
                              shape=grad.shape, stride=grad.stride())
