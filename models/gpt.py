"""A GPT-2-shaped model: a shape the llama zoo does not have, for benchmarks and block detection.

What differs from llama3 where FSDP cares: blocks sit in a ``ModuleDict`` under non-numeric
keys (``block_a``, ``block_b``, ...), the output projection is tied to the token embedding (one
parameter read twice per forward, and the largest one), positions are learned embeddings, and
LayerNorm and Linear carry biases (many small parameters); a fused qkv projection and a 4x
GELU MLP complete the GPT-2 block.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from simplesharded.models.loss import lm_loss


@dataclass
class GPTArgs:
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 8
    vocab_size: int = 512
    max_seq_len: int = 1024
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")

    def tp_sizes(self) -> dict[str, int]:
        return {}

    def check_tp(self, tp: int) -> None:
        if tp > 1:
            raise ValueError(f"tensor_parallel_degree={tp}: model gpt has no tensor-parallel "
                             f"styles")


FLAVORS: dict[str, GPTArgs] = {
    "debug": GPTArgs(dim=128, n_layers=4, n_heads=4),
    # ~19M parameters, llama3/small's size: the two benchmark models cost about the same.
    "small": GPTArgs(dim=512, n_layers=6, n_heads=8),
}


def block_name(i: int) -> str:
    """block_a ... block_z, block_ba, ...: keys without digits."""
    letters = ""
    while True:
        i, r = divmod(i, 26)
        letters = chr(ord("a") + r) + letters
        if i == 0:
            return f"block_{letters}"


class Block(nn.Module):
    def __init__(self, a: GPTArgs):
        super().__init__()
        self.n_heads = a.n_heads
        self.ln_1 = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.qkv = nn.Linear(a.dim, 3 * a.dim)
        self.proj = nn.Linear(a.dim, a.dim)
        self.ln_2 = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.fc = nn.Linear(a.dim, 4 * a.dim)
        self.fc_out = nn.Linear(4 * a.dim, a.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = (t.view(B, S, self.n_heads, -1).transpose(1, 2)
                   for t in self.qkv(self.ln_1(x)).split(D, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, S, D))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, args: GPTArgs):
        super().__init__()
        self.args = args
        self.wte = nn.Embedding(args.vocab_size, args.dim)
        self.wpe = nn.Embedding(args.max_seq_len, args.dim)
        self.blocks = nn.ModuleDict({block_name(i): Block(args) for i in range(args.n_layers)})
        self.ln_f = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied: one parameter, read twice per forward

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """GPT-2's init: N(0, 0.02), residual projections shrunk by sqrt(2 * n_layers)."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln_" in name or name.startswith("ln_"):
                nn.init.ones_(p)
            else:
                std = 0.02
                if name.endswith(("proj.weight", "fc_out.weight")):
                    std /= math.sqrt(2 * self.args.n_layers)
                nn.init.normal_(p, std=std)

    def num_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 per matrix weight (the tied head counts: it is a matmul;
        position embeddings do not) + attention scores, 12 * L * D * T as llama3 counts them."""
        a = self.args
        n = sum(p.numel() for name, p in self.named_parameters() if not name.startswith("wpe."))
        return 6 * n + 12 * a.n_layers * a.dim * seq_len

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None,
                loss_chunks: int = 0) -> torch.Tensor:
        """tokens [B, S] (int64) -> logits [B, S, vocab_size]; with ``labels``: their summed
        cross-entropy in ``loss_chunks`` chunks of tokens, as Llama3.forward; a pipeline stage
        takes and returns hidden states as Llama3.forward's does."""
        S = tokens.shape[1]
        if S > self.args.max_seq_len:
            raise ValueError(f"sequence length {S} exceeds max_seq_len={self.args.max_seq_len}")
        h = tokens
        if self.wte is not None:
            h = self.wte(tokens) + self.wpe(torch.arange(S, device=tokens.device))
        for block in self.blocks.values():
            h = block(h)
        if self.head is None:
            return h
        h = self.ln_f(h)
        if labels is not None:
            return lm_loss(h, self.head, labels, loss_chunks)
        return self.head(h)
