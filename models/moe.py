"""DeepSeek-V3-style mixture-of-experts decoder.

Attention, norms and the dense SwiGLU are Llama 3's (models/llama3.py); DeepSeek's MLA
attention is not modelled. The first n_dense_layers blocks use a dense SwiGLU, the rest a
MoE: top-k routed experts + always-on shared experts.

Routing is compile-friendly: no data-dependent shapes or Python branches. Each (token,
choice) gets a slot in a fixed [experts, capacity] buffer via a cumsum over a one-hot; the
experts run as one batched matmul over that buffer; results are gathered back. With
capacity_factor=None the capacity is the token count, so no token is ever dropped and the
result does not depend on how the batch is split across ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

from .llama3 import FeedForward, Llama3, Llama3Args, ffn_tp_plan, trunc_normal_init_

SCORE_FUNCS = ("softmax", "sigmoid")
LOAD_BALANCE = ("bias", "aux_loss", "none")


@dataclass
class MoEArgs(Llama3Args):
    # multiple_of / ffn_dim_multiplier are unused: dense layers use dense_hidden_dim.
    n_dense_layers: int = 1
    dense_hidden_dim: int = 768
    moe_hidden_dim: int = 256  # per expert
    n_routed_experts: int = 8
    n_shared_experts: int = 1  # fused into one SwiGLU of width n_shared * moe_hidden_dim
    top_k: int = 2
    score_func: str = "sigmoid"  # V3: sigmoid; V2: softmax
    route_norm: bool = True  # renormalise the top-k weights to sum to 1
    route_scale: float = 1.0
    capacity_factor: float | None = None  # None: dropless (capacity = tokens)
    load_balance: str = "bias"  # "bias": aux-loss-free (V3); "aux_loss"; "none"
    bias_update_rate: float = 1e-3
    aux_loss_coeff: float = 1e-3

    def __post_init__(self):
        super().__post_init__()
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func={self.score_func!r} is not one of {sorted(SCORE_FUNCS)}")
        if self.load_balance not in LOAD_BALANCE:
            raise ValueError(f"load_balance={self.load_balance!r} is not one of {sorted(LOAD_BALANCE)}")
        if not 1 <= self.top_k <= self.n_routed_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, n_routed_experts={self.n_routed_experts}]")

    def tp_sizes(self) -> dict[str, int]:
        """TP splits attention heads, the dense layers' SwiGLU and the vocabulary (the MoE
        layers are replicated over tp until expert parallelism)."""
        return {"n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads,
                "dense_hidden_dim": self.dense_hidden_dim, "vocab_size": self.vocab_size}


FLAVORS: dict[str, MoEArgs] = {
    "debug": MoEArgs(dim=256, n_layers=4, n_heads=16, n_kv_heads=4, vocab_size=512),
    # DeepSeek-V2-Lite / Moonlight-16B-A3B shape (~15.8B total, ~2.7B active per token) with
    # V3 routing; full multi-head attention stands in for MLA. Meta device only.
    "16B": MoEArgs(dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, vocab_size=102400,
                   norm_eps=1e-6, rope_theta=10000.0, max_seq_len=4096,
                   n_dense_layers=1, dense_hidden_dim=10944, moe_hidden_dim=1408,
                   n_routed_experts=64, n_shared_experts=2, top_k=6),
}


class GroupedExperts(nn.Module):
    """n_experts SwiGLUs; weights are [n_experts, ...] so FSDP's Shard(0) splits by expert."""

    def __init__(self, n_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))

    def init_weights(self, out_std: float) -> None:
        trunc_normal_init_(self.w1, 0.02)
        trunc_normal_init_(self.w3, 0.02)
        trunc_normal_init_(self.w2, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n_experts, capacity, dim] -> [n_experts, capacity, dim]."""
        return torch.bmm(F.silu(torch.bmm(x, self.w1)) * torch.bmm(x, self.w3), self.w2)


class _AddAuxLoss(torch.autograd.Function):
    """Identity on x whose backward also feeds gradient 1 into aux.

    This trains the load-balancing loss without changing what forward returns.
    """

    @staticmethod
    def forward(ctx, x, aux):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)


class MoE(nn.Module):
    def __init__(self, args: MoEArgs):
        super().__init__()
        self.n_experts, self.top_k = args.n_routed_experts, args.top_k
        self.args = args
        self.gate = nn.Linear(args.dim, args.n_routed_experts, bias=False)
        self.experts = GroupedExperts(args.n_routed_experts, args.dim, args.moe_hidden_dim)
        self.shared_experts = (FeedForward(args.dim, args.n_shared_experts * args.moe_hidden_dim)
                               if args.n_shared_experts else None)
        if args.load_balance == "bias":
            # expert_bias is state (checkpointed); tokens_per_expert is a per-step tally.
            self.register_buffer("expert_bias", torch.zeros(args.n_routed_experts))
            self.register_buffer("tokens_per_expert", torch.zeros(args.n_routed_experts), persistent=False)

    def init_weights(self, out_std: float) -> None:
        trunc_normal_init_(self.gate.weight, 0.02)
        self.experts.init_weights(out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(out_std)
        if self.args.load_balance == "bias":
            self.expert_bias.zero_()
            self.tokens_per_expert.zero_()

    def route(self, x: torch.Tensor):
        """x [T, dim] -> (weights [T, k] fp32, experts [T, k] int64, scores [T, E] fp32)."""
        scores = self.gate(x).float()
        scores = scores.softmax(-1) if self.args.score_func == "softmax" else scores.sigmoid()
        # The balancing bias steers which experts are chosen, never how much they weigh.
        choice = scores + self.expert_bias if self.args.load_balance == "bias" else scores
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.args.route_norm:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.args.route_scale, experts, scores

    def capacity(self, n_tokens: int) -> int:
        cf = self.args.capacity_factor
        if cf is None:
            return n_tokens
        return min(n_tokens, math.ceil(cf * n_tokens * self.top_k / self.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        E, k = self.n_experts, self.top_k
        x = x.reshape(B * S, D)
        T = B * S
        weights, experts, scores = self.route(x)

        # Slot of each (token, choice) in its expert's queue, in token order; past capacity it
        # goes to a scratch row (index E*C) that is never read back.
        flat = experts.flatten()  # [T*k], token-major
        onehot = torch.zeros(T * k, E, dtype=torch.int64, device=x.device).scatter_(1, flat[:, None], 1)
        pos = onehot.cumsum(0).gather(1, flat[:, None]).squeeze(1) - 1
        C = self.capacity(T)
        keep = pos < C
        slot = torch.where(keep, flat * C + pos, E * C)

        src = x[:, None, :].expand(T, k, D).reshape(T * k, D)
        buf = x.new_zeros(E * C + 1, D).index_add(0, slot, src)
        out = self.experts(buf[: E * C].view(E, C, D)).reshape(E * C, D)
        out = torch.cat([out, out.new_zeros(1, D)])[slot]  # [T*k, D]
        w = (weights.flatten() * keep).unsqueeze(1)
        y = (out.float() * w).view(T, k, D).sum(1).type_as(x)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)

        if self.training and self.args.load_balance == "bias":
            with torch.no_grad():
                self.tokens_per_expert.add_(onehot.sum(0).float())
        if self.training and self.args.load_balance == "aux_loss":
            # Switch/DeepSeek balance loss: E * sum_i (fraction routed to i) * (mean prob of i).
            frac = onehot.sum(0).float() / (T * k)
            probs = scores / scores.sum(-1, keepdim=True)
            aux = self.args.aux_loss_coeff * E * (frac * probs.mean(0)).sum()
            y = _AddAuxLoss.apply(y, aux)
        return y.view(B, S, D)

    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor) -> None:
        """Aux-loss-free balancing: push under-loaded experts' bias up, over-loaded down."""
        self.expert_bias.add_(self.args.bias_update_rate * torch.sign(counts.mean() - counts))
        self.tokens_per_expert.zero_()


class MoETransformer(Llama3):
    """Llama3 with MoE feed-forwards after the first n_dense_layers blocks."""

    args: MoEArgs

    def build_feed_forward(self, layer_id: int) -> nn.Module:
        a = self.args
        return FeedForward(a.dim, a.dense_hidden_dim) if layer_id < a.n_dense_layers else MoE(a)

    def feed_forward_tp_plan(self, prefix: str, sequence_parallel: bool) -> dict:
        """Dense layers as Llama's; a MoE layer runs whole on every tp rank (its experts are
        not split yet): with sequence parallelism its input is all-gathered and its output
        cut back to this rank's sequence shard (a local slice)."""
        if not isinstance(self.get_submodule(prefix), MoE):
            return ffn_tp_plan(prefix, sequence_parallel)
        if not sequence_parallel:
            return {}
        return {prefix: PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),))}

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    @torch.no_grad()
    def update_expert_bias(self, group: dist.ProcessGroup | None = None) -> None:
        """Call after optimizer.step() when load_balance="bias".

        Token counts are summed over all ranks of `group` (default: world) in one all-reduce so
        every replica applies the same bias update.
        """
        layers = self.moe_layers()
        if self.args.load_balance != "bias" or not layers:
            return
        counts = torch.stack([m.tokens_per_expert for m in layers])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts, group=group)
        for m, c in zip(layers, counts):
            m.update_expert_bias(c)

    def num_flops_per_token(self, seq_len: int) -> int:
        """As Llama3's, but routed experts count only the top_k of n_routed_experts a token uses."""
        a = self.args
        routed = sum(m.experts.w1.numel() + m.experts.w2.numel() + m.experts.w3.numel()
                     for m in self.moe_layers())
        active = self.num_params(exclude_embedding=True) - routed * (1 - a.top_k / a.n_routed_experts)
        return int(6 * active) + 12 * a.n_layers * a.dim * seq_len
