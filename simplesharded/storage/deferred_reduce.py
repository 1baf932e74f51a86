"""Reduce the gradients that no-sync backwards summed on the rank, once, outside any forward:
``reduce_accumulated(model)``.

``set_requires_gradient_sync(model, True)`` reduces the accumulated sums in the backward of the
next forward (simplesharded/storage/grad_sync.py). A pipeline schedule has no such forward: the last
micro-batch's forward runs before the backwards of earlier micro-batches (1F1B), so at that
forward the sums are not complete. Its reduction point is after a stage's last backward (torch's
schedules call the stage's ``perform_reduce_grad`` there), and this is what runs then.

One collective per set of groups, not per parameter: the accumulated full-size gradients of
every parameter sharded the same way (the same dp mesh and the same kind of placement on it)
are laid out in one flat buffer, rank by rank (each rank's chunk of each parameter, padded to
the largest chunk as DTensor pads an uneven shard), reduce-scattered over the shard dim and
all-reduced over a replicate dim (HSDP), or all-reduced over every dp dim when replicated; then
each rank cuts its chunks back out onto its shards' ``.grad``. On gloo, whose reduce-scatter
all-reduces the whole buffer, the reduce-scatter is an all-to-all of the rows and a sum of what
arrives, in rank order (half the bytes; passes/lowering.py lowers the compiled ones alike).
Per parameter the result is the reduction the sync backward would run: the same dtype
(``reduce_dtype``, else the gathered dtype: the dtype the accumulators already sum in,
grad_sync.py, so no cast), the same scaling (``grad_reduction="avg"``), added to a ``.grad``
already there.
Placements the flat layout does not cover (a parameter sharded over two dp dims) are reduced
one by one through DTensor. A ragged bucket (simplesharded/storage/ragged_shards.py) accumulates its
gathered buffer's gradient in one leaf, reduced as its sync backward would reduce it: one
reduce-scatter per bucket (and one all-reduce over the replicas under HSDP).

Every rank of a stage must call it at the same point (it runs collectives on the dp groups).
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from simplesharded.passes.lowering import LOWERED_BACKENDS, reduce_scatter_as_all_to_all
from simplesharded.storage.ragged import collective_on_concat
from simplesharded.storage.sharded_state import ShardedParam, root_state

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_accumulated(model: nn.Module) -> int:
    """Reduce every accumulated gradient of ``model`` (a root returned by ``data_parallel``, or
    its ``torch.compile`` wrapper) onto its shard's ``.grad`` and clear the accumulators.
    Returns how many collectives it issued (for tests and logs)."""
    model, state = root_state(model)
    sync = state.grad_sync
    groups: dict[tuple, list] = defaultdict(list)
    seen: set[str] = set()
    for param, shard in sync.sharded_params(model):
        leaf = sync.acc.get(param.fqn)
        if param.fqn in seen or leaf is None or leaf.grad is None:
            continue
        seen.add(param.fqn)
        mesh, placements = param.dp_view(shard)[:2]
        rdt = param.spec.reduction_dtype(shard.dtype)  # the sum's own: no cast
        kind = _kind(placements)
        groups[(id(mesh), kind, rdt)].append((mesh, placements, shard, param, leaf))
    issued = 0
    for bucket in sync.ragged_buckets(model):  # one leaf for its gathered buffer
        leaf = sync.acc.get(bucket.name)
        if leaf is not None and leaf.grad is not None:
            issued += bucket.reduce_accumulated(leaf.grad)
            leaf.grad = None
    for (_, kind, rdt), members in groups.items():
        if kind is None:
            for mesh, placements, shard, param, leaf in members:
                issued += _reduce_one(mesh, placements, shard, param, leaf.grad, rdt)
        else:
            issued += _reduce_flat(members, kind, rdt)
        for *_, leaf in members:
            leaf.grad = None
    return issued


def _kind(placements: tuple) -> tuple | None:
    """("shard", tensor dim) for a plain shard on the innermost dp dim (replicated on the
    others), ("replicate",) when replicated everywhere, None otherwise (reduced one by one)."""
    if all(p == Replicate() for p in placements):
        return ("replicate",)
    last = placements[-1]
    if (type(last) is Shard and not isinstance(last, _StridedShard)
            and all(p == Replicate() for p in placements[:-1])):
        return ("shard", last.dim)
    return None


def _land(shard: DTensor, param: ShardedParam, local: torch.Tensor) -> None:
    """Add ``local`` (this rank's reduced chunk) to the shard's ``.grad``."""
    spec = param.spec
    if spec.grad_scale != 1.0 and not spec.scales_before_reduction(shard.dtype):
        local = local * spec.grad_scale
    local = local.to(shard.dtype).contiguous()
    grad = DTensor.from_local(local, shard.device_mesh, shard.placements, run_check=False,
                              shape=shard.shape, stride=shard.stride())
    shard.grad = grad if shard.grad is None else shard.grad + grad


def _prepared(param: ShardedParam, grad: torch.Tensor, rdt: torch.dtype) -> torch.Tensor:
    spec = param.spec
    pre_scale = spec.scales_before_reduction(grad.dtype)
    grad = grad.to(rdt)
    return grad * spec.grad_scale if spec.grad_scale != 1.0 and pre_scale else grad


def _reduce_one(mesh, placements, shard, param, grad, rdt) -> int:
    partial = DTensor.from_local(_prepared(param, grad, rdt), mesh, (Partial(),) * mesh.ndim,
                                 run_check=False)
    _land(shard, param, partial.redistribute(mesh, placements).to_local())
    return mesh.ndim


def _reduce_flat(members: list, kind: tuple, rdt: torch.dtype) -> int:
    mesh = members[0][0]
    if kind[0] == "replicate":
        def all_reduce(flat):
            for i in range(mesh.ndim):
                dist.all_reduce(flat, group=mesh.get_group(i))
            return flat

        reduced = collective_on_concat((_prepared(p, leaf.grad, rdt).reshape(-1)
                                        for _, _, _, p, leaf in members),
                                       all_reduce, [leaf.grad.numel() for *_, leaf in members])
        for (_, _, shard, param, leaf), part in zip(members, reduced):
            _land(shard, param, part.view(leaf.grad.shape))
        return mesh.ndim
    dim, width = kind[1], mesh.size(mesh.ndim - 1)
    group = mesh.get_group(mesh.ndim - 1)
    rows, pieces = [], []
    for _, _, _, param, leaf in members:
        g = _prepared(param, leaf.grad, rdt)
        n = g.shape[dim]
        chunk = -(-n // width)  # DTensor's Shard: torch.chunk's sizes, padded to the largest
        if chunk * width != n:
            pad = [0, 0] * (g.ndim - 1 - dim) + [0, chunk * width - n]
            g = torch.nn.functional.pad(g, pad)
        # [width, chunk-shaped piece]: row r is rank r's chunk, flattened
        piece = g.unflatten(dim, (width, chunk)).movedim(dim, 0)
        pieces.append((piece.shape[1:], n, chunk))
        rows.append(piece.reshape(width, -1))

    def reduce_scatter(flat):  # [width, K] → this rank's row of the sum over ranks, [K]
        if dist.get_backend(group) in LOWERED_BACKENDS:  # as the compiled ones are lowered
            out = reduce_scatter_as_all_to_all(flat.reshape(-1), flat.numel(), width,
                                               group.group_name, [flat.shape[1]])
        else:
            out = flat.new_empty(flat.shape[1])
            _reduce_scatter(out, flat.reshape(-1), group=group)
        for i in range(mesh.ndim - 1):  # HSDP: the replicas' all-reduce at shard size
            dist.all_reduce(out, group=mesh.get_group(i))
        return out

    reduced = collective_on_concat(rows, reduce_scatter, [r.shape[1] for r in rows])
    rank = mesh.get_local_rank(mesh.ndim - 1)
    for (_, _, shard, param, _), (shape, n, chunk), part in zip(members, pieces, reduced):
        local = part.view(shape)  # rank's chunk, on tensor dim ``dim``
        keep = max(0, min(chunk, n - rank * chunk))
        _land(shard, param, local.narrow(dim, 0, keep))
    return mesh.ndim  # the reduce-scatter, and an all-reduce per replicate dim
