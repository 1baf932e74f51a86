"""A tiny transformer-ish model for the pass tests: embeddings → N blocks → norm → output.

Layout (the FQNs the block plan keys on):
  tok_embeddings.weight                                   (VOCAB=7, DIM)   uneven dim 0
  layers.{i}.attention_norm.weight, layers.{i}.attention.{wq,wk,wv,wo}.weight
  layers.{i}.ffn_norm.weight, layers.{i}.feed_forward.{w1,w2,w3}.weight     (w1, w3: HIDDEN=20 rows)
  norm.weight, output.weight                              (VOCAB=7, DIM)   uneven dim 0
7 and 20 rows shard unevenly over 2 (4+3, 10+10 even) and 8 ranks (1×7+0, 3×6+2+0).

``make_model(bf16_blocks={i: "ffn"})`` makes only block ``i``'s feed-forward weights bf16
(that block's bucket then holds two dtypes), ``{i: "block"}`` all of its weights. Activations are cast to the parameter dtype inside the block and back to fp32
after it, so the rest of the model stays fp32.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, N_HEADS = 7, 16, 20, 2
N_LAYERS = 4
SEQ, BATCH_PER_RANK = 6, 2


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int = DIM, n_heads: int = N_HEADS):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return self.wo((att @ v).transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = HIDDEN):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = RMSNorm(DIM)
        self.feed_forward = FeedForward()
        # Compute dtypes of the two halves (None: the incoming activation's). Plain attributes:
        # reading a parameter's dtype in forward would gather it.
        self.attn_dtype: torch.dtype | None = None
        self.ffn_dtype: torch.dtype | None = None

    def forward(self, x):
        a = x if self.attn_dtype is None else x.to(self.attn_dtype)
        h = x + self.attention(self.attention_norm(a)).to(x.dtype)
        f = h if self.ffn_dtype is None else h.to(self.ffn_dtype)
        return h + self.feed_forward(self.ffn_norm(f)).to(h.dtype)


class ToyBlocks(nn.Module):
    def __init__(self, n_layers: int = N_LAYERS):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(n_layers))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def make_model(seed: int = 0, n_layers: int = N_LAYERS,
               bf16_blocks: dict[int, str] | None = None) -> ToyBlocks:
    """Deterministic weights (same on every rank), on cpu. ``bf16_blocks``: block index →
    ``"ffn"`` (only its feed-forward half is bf16: the block's bucket holds two dtypes) or
    ``"block"`` (all its weights are bf16)."""
    torch.manual_seed(seed)
    model = ToyBlocks(n_layers)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    for i, scope in (bf16_blocks or {}).items():
        if scope not in ("ffn", "block"):
            raise ValueError(f"bf16 scope {scope!r} is not one of ['block', 'ffn']")
        block = model.layers[i]
        block.ffn_norm.to(torch.bfloat16)
        block.feed_forward.to(torch.bfloat16)
        block.ffn_dtype = torch.bfloat16
        if scope == "block":
            block.attention_norm.to(torch.bfloat16)
            block.attention.to(torch.bfloat16)
            block.attn_dtype = torch.bfloat16
    return model


def batch(rank: int, step: int = 0, seed: int = 0, n: int = BATCH_PER_RANK):
    """Deterministic (tokens, targets) for one rank and step; ranks get different data."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor, global_numel: int) -> torch.Tensor:
    """Summed cross-entropy / global token count (grad_reduction="sum" semantics)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                           reduction="sum") / global_numel


def train(run, opt, rank: int, world: int, steps: int, after_first_backward=None
          ) -> list[float]:
    """``steps`` steps of ``run`` (the model, compiled or not) on this rank's batches, the
    loss normalised by the global token count; ``after_first_backward()`` runs once, before
    the first update. The losses."""
    numel = world * BATCH_PER_RANK * SEQ
    losses = []
    for step in range(steps):
        tokens, targets = batch(rank, step)
        loss = loss_fn(run(tokens), targets, numel)
        loss.backward()
        losses.append(loss.item())
        if step == 0 and after_first_backward is not None:
            after_first_backward()
        opt.step()
        opt.zero_grad()
    return losses
