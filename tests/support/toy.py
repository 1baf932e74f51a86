"""A tiny multi-block model and deterministic per-rank data for the distributed tests.

Shapes are chosen so that every parameter shape is distinct from every activation shape (the
saved-tensor tests tell gathered parameters from activations by shape), and so that sharding is
uneven: ``fc1`` has 7 rows (4+3 over 2 ranks, 2+2+2+1 over 4 ranks) and the head has 3 rows
(2+1 over 2 ranks; 1+1+1+0 over 4 ranks, i.e. one rank holds an empty shard).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D_IN, DIM, HIDDEN, D_OUT = 6, 8, 7, 3
N_BLOCKS = 4
BATCH_PER_RANK = 5  # rows of data per rank; the global batch is BATCH_PER_RANK * world


class Block(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = HIDDEN):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)  # weight (7, 8): uneven dim 0
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Toy(nn.Module):
    """inp (no bias) → N_BLOCKS residual MLP blocks → head (with bias).

    ``tied=True`` makes the last block's ``fc2.weight`` the same ``nn.Parameter`` as the first
    block's (one parameter read by two modules).
    """

    def __init__(self, n_blocks: int = N_BLOCKS, tied: bool = False):
        super().__init__()
        self.inp = nn.Linear(D_IN, DIM, bias=False)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.head = nn.Linear(DIM, D_OUT)
        if tied:
            self.blocks[-1].fc2.weight = self.blocks[0].fc2.weight

    def forward(self, x):
        h = self.inp(x)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)

    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init that works on plain tensors and, under ``disable_gather``, on
        DTensor shards: every full parameter is generated on every rank from the same seed and
        each rank keeps its own chunk (so a sharded model and a reference model match).
        A sharded model must call it under ``disable_gather`` (else each read is a gathered
        temporary and the writes are lost)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        g = torch.Generator().manual_seed(seed)
        seen = set()
        with torch.no_grad():
            for _, mod in sorted(self.named_modules()):
                for pname in sorted(n for n, p in mod._parameters.items() if p is not None):
                    p = getattr(mod, pname)
                    if id(p) in seen:
                        continue
                    seen.add(id(p))
                    full = torch.randn(tuple(p.shape), generator=g) * 0.3
                    if isinstance(p, DTensor):
                        p.to_local().copy_(
                            distribute_tensor(full, p.device_mesh, p.placements).to_local())
                    else:
                        p.copy_(full)


def make_model(seed: int = 0, tied: bool = False, device: str = "cpu") -> Toy:
    """A Toy model with deterministic weights (the same for every rank and the reference).
    ``device="meta"`` returns an uninitialised meta model (init it after sharding)."""
    with torch.device(device):
        model = Toy(tied=tied)
    if device != "meta":
        model.init_weights(seed)
    return model


def rank_batch(rank: int, step: int = 0, seed: int = 0, n: int = BATCH_PER_RANK):
    """Deterministic (x, y) for one rank and step; different ranks get disjoint data."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    return torch.randn(n, D_IN, generator=g), torch.randn(n, D_OUT, generator=g)


def global_batch(world: int, step: int = 0, seed: int = 0):
    """The concatenation of every rank's batch (what the single-process reference consumes)."""
    xs, ys = zip(*(rank_batch(r, step, seed) for r in range(world)))
    return torch.cat(xs), torch.cat(ys)


def loss_fn(out: torch.Tensor, y: torch.Tensor, global_numel: int) -> torch.Tensor:
    """Sum of squared errors normalised by the *global* element count (grad_reduction="sum"):
    summing the per-rank losses (and gradients) gives the reference's mean loss (and grads)."""
    return F.mse_loss(out.float(), y, reduction="sum") / global_numel
