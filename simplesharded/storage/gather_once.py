"""Gather a model's parameters once for several forwards: ``gather_held(model)`` before the
first, ``release_held(model)`` after the last (the pipeline's ``gather_once`` policy,
simplesharded/pipeline/pipelining.py).

``gather_held`` all-gathers every sharded parameter of a ``data_parallel`` root in its
``param_dtype`` and keeps the full tensors, detached, in the root's gradient-sync state
(``held``, by FQN). While a parameter is held, reading it (simplesharded/storage/gather.py) returns the
held tensor instead of gathering: no collective in the forwards, eager or compiled (a compiled
forward takes the held tensors as graph inputs). The held tensors carry no autograd link to the
shards, so the forwards must run with gradient sync off (simplesharded/storage/grad_sync.py): each
backward sums the full-size gradients into the rank-local accumulators, and
simplesharded/storage/deferred_reduce.py reduces them once. ``release_held`` drops the full tensors.

One collective per bucket, a bucket being the parameters sharded the same way (the same dp
mesh, a plain shard on its innermost dim, replicated on the others; the same dtype): each
rank's chunks, padded to the largest chunk as DTensor pads an uneven shard, are laid out in one
flat buffer and all-gathered over the shard dim; a replicated dim needs no communication (every
replica holds the same chunk). Placements the flat layout does not cover (a parameter sharded
over two dp dims) are gathered one by one through DTensor. A ragged bucket
(simplesharded/storage/ragged_shards.py) is its own collective: its ``[L]`` gathered into the ``[w·L]``
its members are views of, held under the bucket's name.

Memory: the held parameters (in ``param_dtype``), unsharded, from the first forward to the
release, on top of the unsharded gradients that reducing once costs (in the reduction's dtype:
simplesharded/storage/grad_sync.py). Every rank of the dp groups must call both at the
same points (the gathers are collectives).
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate

from simplesharded.storage.deferred_reduce import _kind
from simplesharded.storage.ragged import collective_on_concat
from simplesharded.storage.sharded_state import root_state

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_held(model: nn.Module) -> int:
    """Gather every sharded parameter of ``model`` (a ``data_parallel`` root or its compiled
    wrapper) into its held tensors (module doc). Returns how many collectives it issued."""
    model, state = root_state(model)
    sync = state.grad_sync
    issued = 0
    for bucket in sync.ragged_buckets(model):  # its gathered buffer, held whole
        if bucket.name not in sync.held:
            # before the root's forward pre-hook runs: a resident copy ("optimizer" offload)
            # must hold what the last step wrote to the host shard
            bucket.offload.refresh(bucket.param.to_local())
            sync.held[bucket.name] = bucket.gather_whole()
            issued += 1
    buckets: dict[tuple, list] = defaultdict(list)
    for param, shard in sync.sharded_params(model):
        if param.fqn in sync.held:
            continue
        sync.held[param.fqn] = None  # claimed: a tied parameter is gathered once
        mesh, placements = param.dp_view(shard)[:2]
        dtype = param.spec.param_dtype or shard.dtype
        buckets[(id(mesh), _kind(placements), dtype)].append((mesh, placements, shard, param))
    with torch.no_grad():
        for (_, kind, dtype), members in buckets.items():
            if kind is not None and kind[0] == "shard":
                issued += _gather_flat(members, kind[1], dtype, sync.held)
                continue
            for mesh, placements, shard, param in members:
                full = param.dp_view(shard).wrap(shard.to_local()).to(dtype)
                if kind is None:
                    issued += sum(not isinstance(p, Replicate) for p in placements)
                    full = full.redistribute(mesh, (Replicate(),) * mesh.ndim)
                sync.held[param.fqn] = full.to_local().contiguous()
    return issued


def release_held(model: nn.Module) -> None:
    """Drop ``model``'s held tensors: its forwards gather again."""
    root_state(model)[1].grad_sync.held.clear()


def _gather_flat(members: list, dim: int, dtype: torch.dtype, held: dict) -> int:
    mesh = members[0][0]
    group = mesh.get_group(mesh.ndim - 1)
    width = mesh.size(mesh.ndim - 1)
    pieces, layout = [], []
    for _, _, shard, param in members:
        shape = tuple(param.dp_view(shard).shape)
        n = shape[dim]
        chunk = -(-n // width)  # DTensor's Shard: torch.chunk's sizes, padded to the largest
        local = shard.to_local().to(dtype)
        keep = local.shape[dim]
        if keep != chunk:
            pad = [0, 0] * (local.ndim - 1 - dim) + [0, chunk - keep]
            local = torch.nn.functional.pad(local, pad)
        pieces.append(local.reshape(-1))
        layout.append((param.fqn, local.shape, n))

    def gather(flat):
        out = flat.new_empty(width * flat.numel())
        _all_gather(out, flat, group=group)
        return out.view(width, -1)  # row r: rank r's chunks, as this rank laid its own out

    parts = collective_on_concat(pieces, gather, [p.numel() for p in pieces])
    for (fqn, piece_shape, n), part in zip(layout, parts):
        full = part.reshape(width, *piece_shape)
        held[fqn] = full.movedim(0, dim).flatten(dim, dim + 1).narrow(dim, 0, n).contiguous()
    return 1
