"""Where the step graph (simplesharded/step/__init__.py: ``compile_step``) differentiates and
updates each parameter the optimizer holds, whatever its storage: a per-parameter shard is
its own input and target; a ragged bucket's member is differentiated and updated through its
bucket (ragged_shards.py), whose storage its local tensor is a view of.

Invariant: the routes depend only on the optimizer's parameters and the model's records, so
every rank traces the same graph.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from simplesharded.storage.ragged_member import RaggedMember
from simplesharded.storage.sharded_state import sharded_params


def graph_input(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the step graph takes it: a ragged member's tensor (its optimizer state) as the
    plain DTensor it is a view of, so the graph updates its local run in place."""
    return t.as_dtensor() if isinstance(t, RaggedMember) else t


class StepRoutes:
    """Where the step graph differentiates and updates a member of a ragged bucket
    (simplesharded/storage/ragged_shards.py): forward reads the bucket, not the member, so the
    gradient is taken with respect to the bucket and each member's is its run of it (a
    DTensor on the member's mesh dims, for the norm); the update writes the same run of the
    bucket, the storage the member's local tensor is a view of. The members themselves never
    enter the graph: only the bucket holds their storage there, so the graph has no two
    inputs that alias each other."""

    def __init__(self, model: nn.Module, params: list):
        slots = {id(shard): r.ragged for r, shard in sharded_params(model)
                 if r.ragged is not None}
        self.params = params
        self.slots = [slots.get(id(p)) for p in params]
        self.buckets = list(dict.fromkeys(s.bucket for s in self.slots if s is not None))
        # each member's DTensor face for the norm, read as constants while tracing (a
        # member's placements are its per-parameter ones: the norm reads which dims shard it)
        self.faces = [None if s is None else (p.device_mesh, p.placements, p.shape, p.stride())
                      for p, s in zip(params, self.slots)]

    def inputs(self) -> list[torch.Tensor]:
        """What autograd.grad differentiates: the plain parameters, then the buckets."""
        return ([p for p, s in zip(self.params, self.slots) if s is None]
                + [b.param for b in self.buckets])

    def grads(self, got: tuple) -> list:
        """autograd.grad's results as one gradient per parameter, in ``params``' order."""
        plain = iter(got[:len(got) - len(self.buckets)])
        by_bucket = dict(zip(map(id, self.buckets), got[len(got) - len(self.buckets):]))
        out = []
        for slot, face in zip(self.slots, self.faces):
            if slot is None:
                out.append(next(plain))
                continue
            g = by_bucket[id(slot.bucket)]
            out.append(None if g is None else self._dtensor(
                slot.bucket.run_of(g.to_local(), slot.index), face))
        return out

    def update_targets(self, groups: list[list]) -> list[list]:
        """``groups`` with each member replaced by its run of the bucket."""
        targets = [p if slot is None else slot.bucket.run_of(slot.bucket.param.to_local(),
                                                              slot.index)
                   for p, slot in zip(self.params, self.slots)]
        it = iter(targets)
        return [[next(it) for _ in g] for g in groups]

    @staticmethod
    def _dtensor(local: torch.Tensor, face) -> torch.Tensor:
        mesh, placements, shape, stride = face
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                                  stride=stride)
