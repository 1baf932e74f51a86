"""Llama 3 decoder: RoPE, grouped-query attention, RMSNorm, SwiGLU.

Two rules keep this model shardable by simplesharded.data_parallel:
- forward reads every parameter by attribute access on its own module at use time
  (the frontend intercepts that read and all-gathers the shard);
- init_weights writes parameters in place with torch.nn.init; a sharded model runs it
  through simplesharded.storage.init.init_sharded, on full-size temporaries one block at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               PrepareModuleInputOutput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel)

from simplesharded.models.context_parallel import ContextParallel
from simplesharded.models.loss import lm_loss


@dataclass
class Llama3Args:
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    n_kv_heads: int = 4
    vocab_size: int = 512
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 2048

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head_dim={self.dim // self.n_heads} must be even for RoPE")

    def tp_sizes(self) -> dict[str, int]:
        """Sizes a tensor-parallel degree must divide: TP splits heads, FFN and vocabulary."""
        return {"n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads,
                "ffn_hidden_dim": ffn_hidden_dim(self.dim, self.multiple_of,
                                                 self.ffn_dim_multiplier),
                "vocab_size": self.vocab_size}

    def check_tp(self, tp: int) -> None:
        """ValueError naming the degree and the sizes it does not divide."""
        bad = {k: v for k, v in self.tp_sizes().items() if v % tp}
        if bad:
            sizes = ", ".join(f"{k}={v}" for k, v in bad.items())
            raise ValueError(f"tensor_parallel_degree={tp} does not divide {sizes}")


FLAVORS: dict[str, Llama3Args] = {
    "debug": Llama3Args(dim=256, n_layers=6, n_heads=16, n_kv_heads=4, vocab_size=512),
    # 19.4M params: fwd+bwd of 4 x 256 tokens (one rank's half of batch 8) is ~0.9 s on one
    # core; dim 512 x 8 layers measured ~1.2 s, which left too little room for communication.
    "small": Llama3Args(dim=512, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=512),
    # Published shapes. Llama 3.2 1B ties embedding and output; here they are untied (~1.5B).
    # Llama 3.1's 128k-context RoPE scaling is not implemented, so max_seq_len stays at 8192.
    "1B": Llama3Args(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                     multiple_of=256, ffn_dim_multiplier=1.5, max_seq_len=8192),
    "8B": Llama3Args(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                     multiple_of=1024, ffn_dim_multiplier=1.3, max_seq_len=8192),
    # 8B's shapes at Llama 3.1's context length, for context parallelism
    # (configs/llama3_8b_128k.toml). Positions past 8192 rotate at plain rope_theta: Llama
    # 3.1's RoPE scaling is not implemented, so this trains from scratch, it does not load 3.1.
    "8B_128k": Llama3Args(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                          multiple_of=1024, ffn_dim_multiplier=1.3, max_seq_len=131072),
    "70B": Llama3Args(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                      multiple_of=4096, ffn_dim_multiplier=1.3, max_seq_len=8192),
    "405B": Llama3Args(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                       multiple_of=4096, ffn_dim_multiplier=1.2, max_seq_len=8192),
}


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Llama's SwiGLU width: 2/3 of 4*dim (keeps params equal to a 4x GELU MLP), scaled, rounded up."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


def precompute_freqs_cis(head_dim: int, max_seq_len: int, theta: float, device=None) -> torch.Tensor:
    """RoPE rotations as real [max_seq_len, head_dim // 2, 2] = (cos, sin).

    Same numbers as Meta's complex freqs_cis (its view_as_real); complex tensors are avoided
    because DTensor and inductor on CPU do not handle them well.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, head_dim] by freqs_cis [S, head_dim // 2, 2].

    Adjacent pairs (x[2i], x[2i+1]) are rotated together, matching Meta's checkpoint layout.
    Done in fp32 and cast back so bf16 q/k keep their dtype.
    """
    cos = freqs_cis[None, :, None, :, 0]
    sin = freqs_cis[None, :, None, :, 1]
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.flatten(-2).type_as(x)


def trunc_normal_init_(weight: torch.Tensor, std: float) -> None:
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Attention(nn.Module):
    # Set by models/context_parallel.py's apply_context_parallel: x is then this rank's
    # head-tail chunks of sequences split over the cp ranks.
    context_parallel: ContextParallel | None = None

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def init_weights(self, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_init_(linear.weight, 0.02)
        trunc_normal_init_(self.wo.weight, out_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = self.wq(x).view(B, S, -1, self.head_dim)
        k = self.wk(x).view(B, S, -1, self.head_dim)
        v = self.wv(x).view(B, S, -1, self.head_dim)
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        if self.context_parallel is not None:  # keys of the whole sequence: gathered
            y = self.context_parallel.attention(q, k, v)
            return self.wo(y.transpose(1, 2).reshape(B, S, -1))
        # GQA: each kv head serves n_heads // n_kv_heads consecutive query heads; SDPA reads
        # them in place (enable_gqa) instead of materialising repeated K and V.
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=q.shape[2] != k.shape[2])
        return self.wo(y.transpose(1, 2).reshape(B, S, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, out_std: float) -> None:
        trunc_normal_init_(self.w1.weight, 0.02)
        trunc_normal_init_(self.w3.weight, 0.02)
        trunc_normal_init_(self.w2.weight, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block; feed_forward is any module with forward(x) and init_weights(out_std)."""

    def __init__(self, args: Llama3Args, feed_forward: nn.Module):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = feed_forward

    def init_weights(self, out_std: float) -> None:
        nn.init.ones_(self.attention_norm.weight)
        nn.init.ones_(self.ffn_norm.weight)
        self.attention.init_weights(out_std)
        self.feed_forward.init_weights(out_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


def attention_tp_styles(prefix: str, sequence_parallel: bool) -> dict:
    """One block's attention and norms: q/k/v column-wise (heads split), o row-wise; with
    sequence parallelism the norms run on a sequence shard and the block's input is
    all-gathered before q/k/v (its output reduce-scattered after o)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    styles = {
        f"{prefix}.attention": PrepareModuleInput(input_layouts=(seq, None),
                                                  desired_input_layouts=(Replicate(), None)),
        f"{prefix}.attention.wq": ColwiseParallel(),
        f"{prefix}.attention.wk": ColwiseParallel(),
        f"{prefix}.attention.wv": ColwiseParallel(),
        f"{prefix}.attention.wo": RowwiseParallel(output_layouts=seq),
    }
    if sequence_parallel:
        styles[f"{prefix}.attention_norm"] = SequenceParallel()
        styles[f"{prefix}.ffn_norm"] = SequenceParallel()
    return styles


def ffn_tp_styles(prefix: str, sequence_parallel: bool) -> dict:
    """A SwiGLU: w1/w3 column-wise, w2 row-wise (the hidden dim is split)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    return {
        prefix: PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        f"{prefix}.w1": ColwiseParallel(),
        f"{prefix}.w2": RowwiseParallel(output_layouts=seq),
        f"{prefix}.w3": ColwiseParallel(),
    }


class Llama3(nn.Module):
    # Context parallelism (models/context_parallel.py): tokens are this rank's head-tail chunks.
    context_parallel: ContextParallel | None = None

    def __init__(self, args: Llama3Args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # ModuleDict with string keys keeps FQNs stable (layers.3....) if layers are dropped.
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(args, self.build_feed_forward(i)) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Non-persistent: derived from args, not trained, so it stays out of checkpoints.
        self.register_buffer("freqs_cis", self._freqs_cis(), persistent=False)

    def build_feed_forward(self, layer_id: int) -> nn.Module:
        a = self.args
        return FeedForward(a.dim, ffn_hidden_dim(a.dim, a.multiple_of, a.ffn_dim_multiplier))

    def _freqs_cis(self, device=None) -> torch.Tensor:
        a = self.args
        return precompute_freqs_cis(a.dim // a.n_heads, a.max_seq_len, a.rope_theta, device)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Re-initialise every parameter in place and recompute freqs_cis.

        freqs_cis goes to buffer_device, else stays on the device of the current buffer.
        Output projections (wo, w2) get std shrunk by sqrt(2 * n_layers) so the residual
        stream's variance does not grow with depth.
        """
        self.freqs_cis = self._freqs_cis(buffer_device or self.freqs_cis.device)
        # A pipeline stage (simplesharded/pipeline/stage_split.py) lacks the modules of other stages.
        if self.tok_embeddings is not None:
            trunc_normal_init_(self.tok_embeddings.weight, 0.02)
        out_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for layer in self.layers.values():
            layer.init_weights(out_std)
        if self.norm is not None:
            nn.init.ones_(self.norm.weight)
        if self.output is not None:
            trunc_normal_init_(self.output.weight, self.args.dim ** -0.5)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None,
                loss_chunks: int = 0) -> torch.Tensor:
        """tokens [B, S] (int64) -> logits [B, S, vocab_size] in the parameters' dtype; with
        ``labels`` [B, S]: their summed cross-entropy instead (fp32 scalar), computed in
        ``loss_chunks`` chunks of tokens so the full logits never exist at once (0 = auto,
        1 = unchunked; models/loss.py). A pipeline stage without the embedding takes hidden
        states [B, S, dim] as ``tokens``; one without the output head returns hidden states."""
        S = tokens.shape[1]
        if S > self.args.max_seq_len:
            raise ValueError(f"sequence length {S} exceeds max_seq_len={self.args.max_seq_len}")
        cp = self.context_parallel  # RoPE at the global positions of this rank's chunks
        freqs_cis = self.freqs_cis[:S] if cp is None else cp.rope(self.freqs_cis, S)
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        if self.output is None:
            return h
        h = self.norm(h)
        if labels is not None:
            return lm_loss(h, self.output, labels, loss_chunks)
        return self.output(h)

    def tp_styles(self, sequence_parallel: bool = True, loss_parallel: bool = False) -> dict:
        """Tensor parallelism as ``parallelize_module(model, mesh["tp"], styles)`` takes it:
        module FQN → torch ParallelStyle. Embedding row-wise (vocabulary split), every block's
        attention and SwiGLU split by heads / hidden units, output column-wise. With
        ``sequence_parallel`` the activations between blocks are sharded on the sequence dim
        (norms and residual adds run on 1/tp of the tokens). The logits are gathered over tp
        (plain tensors), or with ``loss_parallel`` stay a DTensor sharded on the vocabulary
        for a cross-entropy under ``torch.distributed.tensor.parallel.loss_parallel()``."""
        seq = Shard(1) if sequence_parallel else Replicate()
        output = (ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                  use_local_output=False) if loss_parallel else
                  ColwiseParallel(input_layouts=seq, output_layouts=Replicate()))
        styles = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "output": output,
        }
        if sequence_parallel:
            styles["norm"] = SequenceParallel()
        for name in self.layers:
            styles.update(attention_tp_styles(f"layers.{name}", sequence_parallel))
            styles.update(self.feed_forward_tp_styles(f"layers.{name}.feed_forward",
                                                      sequence_parallel))
        if sequence_parallel:
            styles.update(self._stage_edge_styles())
        return styles

    def _stage_edge_styles(self) -> dict:
        """A pipeline stage (simplesharded/pipeline/stage_split.py) under sequence parallelism: stages
        hand each other whole sequences (forward reads their length for RoPE), so a stage
        without the embedding cuts its input to this rank's sequence shard before its first
        block (no communication), and one without the head gathers its last block's output."""
        names = list(self.layers)
        takes, gives = self.tok_embeddings is None, self.output is None
        if not names or not (takes or gives):
            return {}
        cut = dict(input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None))
        gather = dict(output_layouts=Shard(1), desired_output_layouts=Replicate())
        first, last = f"layers.{names[0]}", f"layers.{names[-1]}"
        if takes and gives and first == last:
            return {first: PrepareModuleInputOutput(**cut, use_local_input=True, **gather)}
        styles = {first: PrepareModuleInput(**cut, use_local_output=True)} if takes else {}
        if gives:
            styles[last] = PrepareModuleOutput(**gather)
        return styles

    def feed_forward_tp_styles(self, prefix: str, sequence_parallel: bool) -> dict:
        return ffn_tp_styles(prefix, sequence_parallel)

    def num_params(self, exclude_embedding: bool = False) -> int:
        return sum(p.numel() for name, p in self.named_parameters()
                   if not (exclude_embedding and name.startswith("tok_embeddings.")))

    def num_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 per weight (fwd+bwd matmuls) + attention scores.

        Attention is counted as 12 * L * H * Q * T (QK^T and AV, fwd+bwd, no causal discount).
        """
        a = self.args
        return 6 * self.num_params(exclude_embedding=True) + 12 * a.n_layers * a.dim * seq_len
