"""Context parallelism: causal attention over sequences split across the cp ranks.

Layout (head-tail load balancing): a sequence of S tokens is cut into 2·cp chunks of
c = S / (2·cp) tokens; cp rank r holds chunks r and 2·cp−1−r, in that order, as its local
sequence of 2c tokens. Under a causal mask a query's work grows with its position, so pairing an
early chunk with a late one gives every rank the same number of unmasked (query, key) pairs.
:func:`head_tail_positions` is the one definition of the layout: the trainer's loader keeps
those tokens of each sequence (simplesharded/trainer/data.py), and attention reads it for RoPE
and for the mask.

Attention (:meth:`ContextParallel.attention`): each rank projects its own tokens to q, k, v
and rotates q and k at their global positions (:meth:`ContextParallel.rope`); K and V are
all-gathered over the cp group as one traced functional collective, whose autograd backward is
a reduce-scatter (each rank gets back the gradient of its own keys and values from every rank's
queries); each query then attends to all S keys under the mask "key position <= query
position". The gathered keys stay in rank order (chunks 0, 2cp−1, 1, 2cp−2, ...): the mask is
built from positions, and attention does not depend on the order of its keys.

Every rank has the same shapes (only the mask's values and the rotation's rows differ), so the
ranks trace graphs of one structure and plan the same collectives (passes/plan_protocol.py).
Costs: a rank scores its 2c queries against all S keys and masks about half of them, twice the
causal work (no block of keys is skipped); the mask is [2c, S] booleans, which SDPA turns into
an additive bias in the queries' dtype that is saved for backward (one for all layers); and
the gathered K/V (S tokens) are saved per layer for backward. Ring attention, which streams blocks of keys and skips the masked ones,
avoids both but needs an attention kernel that returns its log-sum-exp (torch's ring attention
has no CPU sharding rule for the CPU flash kernel).

The K/V all-gather carries the ``ss_cp`` annotation (passes/annotations.py) and no parameter,
so the data-parallel passes never bucket or move it, and the recompute pass saves its result
for backward rather than gathering again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F
from torch import nn

from simplesharded.passes.annotations import CP_KEY
from simplesharded.passes.torch_compat import CONTEXT_PARALLEL, needs


def head_tail_positions(seq_len: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """Global positions [seq_len // cp] of the tokens cp rank ``rank`` holds of a sequence of
    ``seq_len`` tokens: chunk ``rank`` then chunk ``2 * cp - 1 - rank`` of ``2 * cp``."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} does not split into 2 * {cp} = {2 * cp} "
                         f"equal chunks (context parallel degree {cp})")
    c = seq_len // (2 * cp)
    head = torch.arange(rank * c, (rank + 1) * c, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([head, tail])


def gathered_positions(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """Global positions [seq_len] of the keys after the all-gather: every rank's own, in rank
    order."""
    return torch.cat([head_tail_positions(seq_len, r, cp, device) for r in range(cp)])


def causal_mask(seq_len: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """[seq_len // cp, seq_len] booleans: True where rank ``rank``'s query may see a gathered
    key, i.e. where the key's global position is at or before the query's."""
    queries = head_tail_positions(seq_len, rank, cp, device)
    return gathered_positions(seq_len, cp, device)[None, :] <= queries[:, None]


def shard_sequence(x: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """The tokens cp rank ``rank`` holds of ``x``, whose dim ``dim`` is the whole sequence."""
    return x.index_select(dim, head_tail_positions(x.shape[dim], rank, cp, x.device))


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in its cp group; set on a model's attention by
    :func:`apply_context_parallel`."""

    group_name: str  # the cp group, as functional collectives name it
    size: int
    rank: int

    def positions(self, local_len: int, device=None) -> torch.Tensor:
        """Global positions of this rank's ``local_len`` tokens of a sequence."""
        return head_tail_positions(local_len * self.size, self.rank, self.size, device)

    def rope(self, table: torch.Tensor, local_len: int) -> torch.Tensor:
        """The rows of the RoPE table ``table`` [max_seq_len, ...] at the global positions of
        this rank's ``local_len`` tokens."""
        seq_len = local_len * self.size
        if seq_len > table.shape[0]:
            raise ValueError(f"sequence length {seq_len} ({local_len} tokens on each of "
                             f"{self.size} cp ranks) exceeds max_seq_len={table.shape[0]}")
        return table[head_tail_positions(seq_len, self.rank, self.size, table.device)]

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every cp rank's ``t`` concatenated on dim 0 in rank order, differentiably: the
        backward sums the ranks' gradients of the whole and keeps this rank's rows."""
        with fx_traceback.annotate({CP_KEY: self.group_name}):
            return funcol.all_gather_single_autograd(t.contiguous(), 0, self.group_name)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float | None = None) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence's keys: q [B, s, H,
        D] and k, v [B, s, Hkv, D] (rotated) of this rank's s tokens → [B, H, s, D], as
        ``F.scaled_dot_product_attention`` of the unsplit sequence gives for these queries
        (``scale``: SDPA's, default 1 / sqrt(D))."""
        seq_len = q.shape[1] * self.size
        # K and V in one gather; tokens leading, so the gather's dim 0 concatenates the ranks'
        kv = self.gather(torch.stack((k, v), dim=2).transpose(0, 1))  # [S, B, 2, Hkv, D]
        keys, values = kv.permute(1, 2, 3, 0, 4).unbind(1)  # [B, Hkv, S, D] each
        mask = causal_mask(seq_len, self.rank, self.size, q.device)
        return F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                              scale=scale, enable_gqa=q.shape[2] != k.shape[2])


def supports_context_parallel(model_cls: type) -> bool:
    """Whether a model class runs its attention under context parallelism: it declares a
    ``context_parallel`` attribute (models/llama3.py), read by its forward."""
    return hasattr(model_cls, "context_parallel")


def apply_context_parallel(model: nn.Module, mesh) -> None:
    """Split ``model``'s sequences over the 1-D cp mesh ``mesh`` (``mesh["cp"]`` of
    simplesharded.mesh.build_mesh): every module that declares ``context_parallel`` (the model,
    its attention layers) gets this rank's :class:`ContextParallel`. Its inputs must then be
    each rank's head-tail chunks (:func:`shard_sequence`). A transformers model that runs its
    attention through transformers' attention interface (Llama and its family) is set up by
    models/hf_context_parallel.py. ValueError for a model whose attention cannot run so."""
    from .hf_context_parallel import apply_hf_context_parallel, is_hf_model

    needs(CONTEXT_PARALLEL)
    if is_hf_model(model):
        cp = ContextParallel(mesh.get_group().group_name, mesh.size(), mesh.get_local_rank())
        apply_hf_context_parallel(model, cp)
        return
    if not supports_context_parallel(type(model)):
        raise ValueError(f"{type(model).__name__} has no attention that runs under context "
                         f"parallelism (models/context_parallel.py)")
    cp = ContextParallel(mesh.get_group().group_name, mesh.size(), mesh.get_local_rank())
    for module in model.modules():
        if supports_context_parallel(type(module)):
            module.context_parallel = cp
