"""DeepSeek-V3-style mixture-of-experts decoder.

Attention, norms and the dense SwiGLU are Llama 3's (models/llama3.py); DeepSeek's MLA
attention is not modelled. The first n_dense_layers blocks use a dense SwiGLU, the rest a
MoE: top-k routed experts + always-on shared experts.

Routing is compile-friendly: every shape is static, no Python branch reads data. Two ways
to run the routed experts (MoEArgs.experts_impl):

"sorted" (default): the T*k (token, choice) rows are sorted by expert (stable argsort, so
each expert's rows keep token order) into a [T*k + E*(align-1) + 1, dim] buffer in which
expert e's rows start at an offset aligned to `align`; the upper bound on the padding keeps
the buffer's size static. Each expert then multiplies only its own rows: ~top_k expert
SwiGLUs per token, the FLOPs routing asks for. The grouped matmul is torch._grouped_mm where
torch lowers it under compile (bf16, dims multiple of 8; CUDA wants group offsets aligned to
16 rows); otherwise our own op simplesharded::expert_mm (models/expert_mm.py), a loop of one
matmul per expert over its rows, opaque to the compiler.

"bmm": the older dense form: each expert gets a fixed [capacity, dim] slot buffer and all
experts run as one batched matmul; dropless (capacity = T) each expert multiplies all T rows,
E/top_k times the routed FLOPs. Kept as the before-picture for benchmarks.

With capacity_factor=None no token is ever dropped and the result does not depend on how the
batch is split across ranks. With a capacity C, a (token, choice) past the first C of its
expert in token order is dropped, the same in both forms; "sorted" still computes T*k rows.

Expert parallelism (``ExpertParallel``, applied with torch's ``parallelize_module`` on
``mesh["ep"]``): the routed experts' weights are split by expert over the ep ranks (Shard(0),
E/ep consecutive experts each; data_parallel then shards them further over the dp ranks EP
left, simplesharded/storage/layout.py), and each layer sends its routed rows to their experts' ranks
and the results back (models/ep_dispatch.py: the token dispatch, and the dynamo setting a
compiled expert-parallel model runs under)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx.traceback as fx_traceback
import torch.nn as nn
import torch.nn.functional as F

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInputOutput

from simplesharded.passes.annotations import ROUTING_KEY

from .context_parallel import ContextParallel
from .ep_dispatch import dispatch
from .expert_mm import by_expert, grouped_mm, local_experts, row_align
from .llama3 import FeedForward, Llama3, Llama3Args, ffn_tp_styles, trunc_normal_init_

SCORE_FUNCS = ("softmax", "sigmoid")
LOAD_BALANCE = ("bias", "aux_loss", "none")
EXPERTS_IMPLS = ("sorted", "bmm")


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
    experts_impl: str = "sorted"  # "sorted": each expert runs its routed rows; "bmm": all T rows

    def __post_init__(self):
        super().__post_init__()
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func={self.score_func!r} is not one of {sorted(SCORE_FUNCS)}")
        if self.load_balance not in LOAD_BALANCE:
            raise ValueError(f"load_balance={self.load_balance!r} is not one of {sorted(LOAD_BALANCE)}")
        if self.experts_impl not in EXPERTS_IMPLS:
            raise ValueError(f"experts_impl={self.experts_impl!r} is not one of {sorted(EXPERTS_IMPLS)}")
        if not 1 <= self.top_k <= self.n_routed_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, n_routed_experts={self.n_routed_experts}]")

    def check_ep(self, ep: int) -> None:
        """ValueError naming the degree when it does not split the routed experts evenly."""
        if self.n_routed_experts % ep:
            raise ValueError(f"expert_parallel_degree={ep} does not divide n_routed_experts="
                             f"{self.n_routed_experts}")
        if ep > 1 and self.experts_impl != "sorted":
            raise ValueError(f"expert_parallel_degree={ep} needs experts_impl='sorted' (got "
                             f"{self.experts_impl!r})")

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

    def row_align(self, x: torch.Tensor) -> int:
        """Row multiple each expert's group must start at (models/expert_mm.py)."""
        return row_align(x, self.w1)

    def forward_grouped(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """x [N, dim], rows grouped by expert; offs [n_experts] int32 group ends -> [N, dim].
        Under expert parallelism the weights are DTensors split by expert: the local ones."""
        w1, w2, w3 = (local_experts(w) for w in (self.w1, self.w2, self.w3))  # read once
        return grouped_mm(F.silu(grouped_mm(x, w1, offs)) * grouped_mm(x, w3, offs), w2, offs)


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
    # Set by models/context_parallel.py's apply_context_parallel: x is then this rank's
    # head-tail chunks of each sequence, and the aux loss's fractions are the whole
    # sequences' (the cp ranks' counts summed), so it is the unsplit run's. Routing and its
    # counts are per token, so they are too; a capacity (capacity_factor) drops past the
    # first C rows of an expert among the rank's own tokens, as under dp, so with one the
    # drops are not the unsplit run's.
    context_parallel: ContextParallel | None = None

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
        # Expert parallelism (ExpertParallel): the ep process group's name and size.
        self.ep_group: str | None = None
        self.ep_size = 1

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
        with fx_traceback.annotate({ROUTING_KEY: True}):  # saved, never recomputed
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

    def expert_passes_per_token(self) -> float:
        """Expert SwiGLUs the routed path really runs per token, for FLOP counts. "sorted":
        top_k (its alignment padding, under n_experts * 15 rows a step on CUDA, is left out);
        "bmm": every expert runs its whole capacity, so n_experts dropless, about
        capacity_factor * top_k with a capacity."""
        a = self.args
        if a.experts_impl == "sorted":
            return float(self.top_k)
        if a.capacity_factor is None:
            return float(self.n_experts)
        return min(float(self.n_experts), a.capacity_factor * self.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        E, k = self.n_experts, self.top_k
        x = x.reshape(B * S, D)
        T = B * S
        weights, experts, scores = self.route(x)

        # Rank of each (token, choice) among its expert's rows in token order: a stable sort by
        # expert keeps token order inside each expert's run; rank = place in run - run start.
        flat = experts.flatten()  # [T*k], token-major
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        order = torch.argsort(flat, stable=True)
        place = torch.empty_like(order).scatter_(0, order, torch.arange(T * k, device=x.device))
        pos = place - (counts.cumsum(0) - counts)[flat]
        C = self.capacity(T)
        keep = pos < C
        src = x[:, None, :].expand(T, k, D).reshape(T * k, D)
        if self.ep_size > 1:
            out = dispatch(src, flat, keep, counts.clamp(max=C), self.ep_group, self.ep_size,
                           self.args.capacity_factor is None, self._run_sorted)
        elif self.args.experts_impl == "sorted":
            out = self._run_sorted(src, flat, pos, keep, counts.clamp(max=C))
        else:
            out = self._run_bmm(src, flat, pos, keep, C)
        w = (weights.flatten() * keep).unsqueeze(1)
        y = (out * w).view(T, k, D).sum(1).type_as(x)  # w is fp32: bf16 sums in fp32
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)

        if self.training and self.args.load_balance == "bias":
            with torch.no_grad():
                self.tokens_per_expert.add_(counts.float())
        if self.training and self.args.load_balance == "aux_loss":
            # Switch/DeepSeek balance loss: E * sum_i (fraction routed to i) * (mean prob of i).
            routed, probs = counts.float(), scores / scores.sum(-1, keepdim=True)
            mean_probs = probs.mean(0)
            cp = self.context_parallel
            if cp is not None:
                # Over the whole sequences, of which this rank holds 1/cp of the tokens: the
                # counts summed over the cp group (integers: no gradient), and this rank's
                # share of the mean probability, so the cp ranks' aux losses (each fed
                # gradient 1) sum to the unsplit run's, gradient included.
                with fx_traceback.annotate({ROUTING_KEY: True}):  # saved, never recomputed
                    routed = funcol.all_reduce(routed, "sum", cp.group_name)
                mean_probs = mean_probs / cp.size
            frac = routed / (T * k * (cp.size if cp is not None else 1))
            aux = self.args.aux_loss_coeff * E * (frac * mean_probs).sum()
            y = _AddAuxLoss.apply(y, aux)
        return y.view(B, S, D)

    def _run_sorted(self, src, flat, pos, keep, kept):
        """Each expert's kept rows, contiguous and in token order, through a grouped matmul
        (models/expert_mm.py ``by_expert``). ``flat``: each src row's expert (one of
        ``kept.shape[0]``: all of them, or this rank's under expert parallelism), ``pos`` its
        rank among that expert's rows, ``keep`` (None: all) whether it is within capacity,
        ``kept`` the rows kept per expert. Returns [T*k, dim], row i = expert output for src
        row i (a dropped row's is never used: its weight is 0)."""
        keep = keep if self.args.capacity_factor is not None else None
        return by_expert(src, flat, pos, kept, self.experts.row_align(src),
                         self.experts.forward_grouped, keep)

    def _run_bmm(self, src, flat, pos, keep, C):
        """Every expert on a [capacity, dim] slot buffer in one bmm (dropless: capacity = T).
        Past capacity a row goes to a scratch slot (index E*C) that is never computed."""
        E, D = self.n_experts, src.shape[1]
        slot = torch.where(keep, flat * C + pos, E * C)
        buf = src.new_zeros(E * C + 1, D).index_add(0, slot, src)
        out = self.experts(buf[: E * C].view(E, C, D)).reshape(E * C, D)
        return torch.cat([out, out.new_zeros(1, D)])[slot]

    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor) -> None:
        """Aux-loss-free balancing: push under-loaded experts' bias up, over-loaded down."""
        self.expert_bias.add_(self.args.bias_update_rate * torch.sign(counts.mean() - counts))
        self.tokens_per_expert.zero_()


class ExpertParallel(ParallelStyle):
    """Split a MoE layer's routed experts over a 1-D mesh (``mesh["ep"]``) for
    ``parallelize_module``: each weight [E, ...] becomes a DTensor Shard(0) (E/ep consecutive
    experts per rank; data_parallel keeps that placement and shards it further over the dp
    dims EP left), and the layer dispatches its tokens over the mesh's group
    (models/ep_dispatch.py).
    No communication: each rank keeps its own experts of the full weights it holds (the same
    on every rank by construction, or on meta)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, MoE):
            raise ValueError(f"ExpertParallel applies to MoE layers, not {type(module).__name__}")
        module.args.check_ep(device_mesh.size())
        experts = module.experts
        for name, p in list(experts.named_parameters(recurse=False)):
            shard = distribute_tensor(p.detach(), device_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(shard, requires_grad=p.requires_grad))
        module.ep_group = device_mesh.get_group().group_name
        module.ep_size = device_mesh.size()
        return module


class MoETransformer(Llama3):
    """Llama3 with MoE feed-forwards after the first n_dense_layers blocks."""

    args: MoEArgs

    def build_feed_forward(self, layer_id: int) -> nn.Module:
        a = self.args
        return FeedForward(a.dim, a.dense_hidden_dim) if layer_id < a.n_dense_layers else MoE(a)

    def feed_forward_tp_styles(self, prefix: str, sequence_parallel: bool) -> dict:
        """Dense layers as Llama's; a MoE layer runs whole on every tp rank (its experts are
        not split yet): with sequence parallelism its input is all-gathered and its output
        cut back to this rank's sequence shard (a local slice)."""
        if not isinstance(self.get_submodule(prefix), MoE):
            return ffn_tp_styles(prefix, sequence_parallel)
        if not sequence_parallel:
            return {}
        return {prefix: PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),))}

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def ep_styles(self) -> dict:
        """Expert parallelism as ``parallelize_module(model, mesh["ep"], styles)`` takes it:
        every MoE layer's routed experts split over ep (ExpertParallel)."""
        return {name: ExpertParallel() for name, m in self.named_modules() if isinstance(m, MoE)}

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
        """As Llama3's, but routed experts count the expert passes per token the active path
        really runs (MoE.expert_passes_per_token): top_k "sorted", all of them "bmm" dropless."""
        a = self.args
        active = self.num_params(exclude_embedding=True)
        for m in self.moe_layers():
            routed = m.experts.w1.numel() + m.experts.w2.numel() + m.experts.w3.numel()
            active -= routed * (1 - m.expert_passes_per_token() / a.n_routed_experts)
        return int(6 * active) + 12 * a.n_layers * a.dim * seq_len
