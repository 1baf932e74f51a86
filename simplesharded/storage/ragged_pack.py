"""Packing a model's shards into ragged buckets (``storage="ragged"``, ragged_shards.py): which
shards are taken, and one bucket per block (the parameters before the first block and after
the last in buckets of the root), per dtype, dp gather and model-parallel split.

Invariant: the buckets, their members and their order depend only on the module tree, the
records and the parameters' global shapes, so they are the same on every rank.
"""
from __future__ import annotations

import dataclasses

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from simplesharded.mesh import flat_dp_mesh
from simplesharded.storage.ragged import Precision
from simplesharded.storage.ragged_shards import (RaggedShards, RaggedSlot,
                                                 attach_state_dict_hooks, keep_buckets_whole)
from simplesharded.storage.sharded_state import GatherScopeProtocol, ShardedParam


def _bucket_groups(shards: dict[int, tuple[nn.Parameter, ShardedParam]], eligible, more
                   ) -> dict[tuple, list[int]]:
    """The keys of the ``eligible(shard, record)`` shards by (bucket, dtype,
    *``more(shard, record)``), in ``shards``' module order. A bucket is a block's parameters,
    or those before the first block ("pre") or after it ("post")."""
    groups: dict[tuple, list[int]] = {}
    seen_block = False
    for key, (shard, record) in shards.items():
        seen_block = seen_block or record.block is not None
        if not eligible(shard, record):
            continue
        bucket = record.block if record.block is not None else ("post" if seen_block else "pre")
        groups.setdefault((bucket, shard.dtype, *more(shard, record)), []).append(key)
    return groups


def pack_ragged(model: nn.Module, shards: dict[int, tuple[nn.Parameter, ShardedParam]],
                 scope: GatherScopeProtocol, views: tuple,
                 offload: tuple[str, bool] = ("none", True)) -> None:
    """Move the eligible shards of each bucket (_bucket_groups) into one ragged bucket
    registered on the bucket's owner (its block; the root for "pre" and "post"); their slots
    in ``shards`` become None and their records gain the bucket. ``views``: the model's sets
    of dp dims (layout.py's ``_DPView``); ``offload``: (kind, pin_memory), every bucket's
    (offload.py)."""
    from simplesharded.storage import full_state_dict  # only where ragged buckets are made

    full_state_dict.install()  # torch's full-state-dict loads cut a member's run
    for view in views:
        # A bucket cut over two dp dims gathers over one group of both (mesh.flat_dp_mesh),
        # whose creation is collective over the world: made here for every set of dp dims,
        # in one order, whatever buckets this rank's model (a pipeline stage) holds.
        if sum(p.is_shard() for p in view.placements) > 1:
            flat_dp_mesh(view.dp)

    def gather_and_split(shard, record):
        # One bucket per dp gather (EP's expert weights gather over dims of their own) and
        # per split over the dims after dp (tp, ep): a bucket's placements must say whether
        # each rank of such a dim holds other elements (TP shards, experts) or copies (the
        # norms), for its norm and its checkpoint.
        dp_dims = len(record.spec.dp_groups)
        names = shard.device_mesh.mesh_dim_names or ()
        return (record.spec.dp_groups, tuple(names[dp_dims + i] for i, p in enumerate(
            shard.placements[dp_dims:]) if not p.is_replicate()))

    groups = _bucket_groups(shards, lambda s, r: _ragged_eligible(s, r, scope),
                            gather_and_split)
    # owner FQN → (owner, its buckets)
    owned: dict[str, tuple[nn.Module, list[RaggedShards]]] = {}
    for (bucket, dtype, _, split), keys in groups.items():
        owner_fqn = bucket if bucket not in ("pre", "post") else ""
        owner = model.get_submodule(owner_fqn)
        kind = "_".join((str(dtype).removeprefix('torch.'), *split))
        first = shards[keys[0]]
        spec = first[1].spec
        prefix = f"{owner_fqn}." if owner_fqn else ""
        members = [(shards[k][1].fqn, shards[k][1].fqn.removeprefix(prefix), shards[k][0],
                    shards[k][1]) for k in keys]
        owned.setdefault(owner_fqn, (owner, []))
        precision = Precision(spec.param_dtype, spec.reduce_dtype,
                              spec.scales_before_reduction(dtype))
        ragged = RaggedShards(f"{bucket}/{kind}", owner, members,
                              first[1].dp_view(first[0]).mesh, scope, spec.grad_scale,
                              spec.reshard_after_forward, spec.dp_groups, first[1].block,
                              precision, spec.grad_sync, *offload)
        owned[owner_fqn][1].append(ragged)
        for i, k in enumerate(keys):
            shards[k] = (ragged.members[i],
                         dataclasses.replace(shards[k][1], ragged=RaggedSlot(ragged, i)))
    for owner, buckets in owned.values():
        attach_state_dict_hooks(owner, buckets)
    if owned:
        keep_buckets_whole(model)


def _ragged_eligible(shard: DTensor, record: ShardedParam, scope: GatherScopeProtocol) -> bool:
    """Trained, at least 1-D, sharded on dim 0 of what its dp gather rebuilds (the parameter,
    or its TP shard) as FSDP's ``(Shard(0),)`` or ``(Shard(0), Shard(0))`` or HSDP's
    ``(Replicate(), Shard(0))`` on the dp dims; read by one module."""
    return (shard.requires_grad and shard.ndim >= 1
            and record.dp_view(shard).placements in ((Shard(0),), (Shard(0), Shard(0)),
                                                     (Replicate(), Shard(0)))
            and record.fqn not in scope.tied)
