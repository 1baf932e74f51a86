"""The DTensor placement of a ragged bucket member's local piece: :class:`RaggedShard`.

A parameter in a ragged bucket (simplesharded/ragged.py) is, on each rank of the dim the bucket
is cut over, a contiguous run of its flattened elements, of any length (possibly none). The
parameter users see (``named_parameters()``, the optimizer) is a DTensor with the parameter's
global shape whose local tensor is that run: a 1-D view of the bucket's local range. Its
placement on the cut dim is ``RaggedShard(sizes)``, a ``Shard(0)`` that records each rank's
run length, so that:

- elementwise ops (every torch optimizer's update, ``zeros_like`` for its state) run on the
  local runs as on any shard;
- reductions (``torch.nn.utils.clip_grad_norm_``, ``vector_norm``, ``sum``) are reduced over
  the dim as for ``Shard(0)``: a sum of the runs' partial results, whatever their lengths;
- ``full_tensor()`` and a redistribution to ``Replicate()`` gather the runs in rank order
  (:meth:`RaggedShard._to_replicate_tensor`);
- any other redistribution raises one line on every rank (the same placement everywhere, so
  no rank enters a collective alone). The checkpoint boundary is ``state_dict()``, which
  converts to per-parameter ``Shard(0)``, and for the optimizer's state
  ``optim_state_by_member`` (ragged_shards.py): DCP given a member or its optimizer state
  directly would describe a ragged run as a ``Shard(0)`` chunk.

It compares equal to ``Shard(0)`` because DTensor's sharding rules build ``Shard(0)`` for
their outputs and check them against the inputs' (an in-place update must keep its
placement). Its hash differs, so DTensor's caches never hand a ``RaggedShard`` input a
result computed for a true ``Shard(0)`` one. A tensor computed out of place from a member
(``p * 2``, ``p.clone()``) is labelled ``Shard(0)`` by those rules while holding a ragged run:
gather such a tensor through its member (docs/zero_copy.md).

Invariant: a ``RaggedShard``'s sizes are the layout's, a function of global shapes and the
world size, so every rank holds the same placement.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor.placement_types import Shard


class _ShardAlike(Shard):
    """A ``Shard(dim)`` for DTensor's rules (equal to it), with a hash of its own (DTensor's
    caches keep it apart) and the redistributions that would move its ragged data refused on
    every rank alike. Subclasses name their constructor arguments (``_args``)."""

    refusal = ""

    def _args(self) -> tuple:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Shard) and other.dim == self.dim

    def __hash__(self) -> int:
        return hash((type(self), self._args()))

    def __reduce__(self):
        return type(self), self._args()

    def __deepcopy__(self, memo):
        return self

    def _refuse(self, *args, **kwargs):
        raise ValueError(self.refusal)

    # Not refused: _local_shard_size_and_offset. DTensor's sharding rules ask for a shard's
    # size under TP (a dim split over dp and tp) and take Shard's answer as metadata only. So
    # DCP, which reads it too, must not see a member directly: state_dict() and
    # optim_state_by_member convert.
    _split_tensor = _refuse
    _shard_tensor = _refuse
    _reduce_shard_tensor = _refuse
    _replicate_to_shard = _refuse
    _to_new_shard_dim = _refuse


class RaggedShard(_ShardAlike):
    """``Shard(0)`` with this rank's run of the flattened tensor as its local tensor; rank r
    of the mesh dim holds ``sizes[r]`` elements, in rank order."""

    refusal = ("a parameter in a ragged bucket holds a ragged run of its elements "
               "(RaggedShard): it gathers with full_tensor() or "
               "redistribute(placements=[Replicate()]) only; state_dict() gives it as a "
               "per-parameter Shard(0) DTensor")

    def __init__(self, sizes: Sequence[int]):
        super().__init__(0)
        self.sizes = tuple(int(s) for s in sizes)

    def _args(self) -> tuple:
        return (self.sizes,)

    def __repr__(self) -> str:
        return f"RaggedShard(sizes={self.sizes})"

    def __str__(self) -> str:
        return f"R{list(self.sizes)}"

    def _to_replicate_tensor(self, local_tensor: torch.Tensor, mesh, mesh_dim: int,
                             current_logical_shape) -> torch.Tensor:
        """Every rank's run, padded to the longest (one all-gather of equal sizes on every
        rank), cut back and laid end to end as the tensor's flattened elements."""
        longest = max(self.sizes)
        run = local_tensor.reshape(-1)
        # pad (or, for a mislabelled input, cut) to one length on every rank: no rank waits
        # on a gather of another size
        run = torch.nn.functional.pad(run, (0, longest - run.numel()))
        gathered = funcol.all_gather_single(run, gather_dim=0, group=(mesh, mesh_dim))
        pieces = [gathered[r * longest:r * longest + s] for r, s in enumerate(self.sizes)]
        return torch.cat(pieces).view(tuple(current_logical_shape))


class ShardBesideRagged(_ShardAlike):
    """``Shard(dim)`` of a ragged member on a dim after the one its bucket is cut over (TP's or
    EP's split): reductions and elementwise ops as ``Shard(dim)``; a gather refused on every
    rank alike (each rank holds a ragged run of its model-parallel shard, which no gather over
    this dim alone can rebuild): ``state_dict()`` converts."""

    refusal = ("a tensor- or expert-parallel parameter in a ragged bucket holds a ragged run "
               "of its shard: full_tensor() cannot rebuild it; state_dict() gives it as a "
               "per-parameter DTensor")

    def _args(self) -> tuple:
        return (self.dim,)

    def __repr__(self) -> str:
        return f"ShardBesideRagged(dim={self.dim})"

    _to_replicate_tensor = _ShardAlike._refuse
