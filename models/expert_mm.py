"""The grouped expert matmul of a MoE layer's "sorted" path (models/moe.py, and a Hugging
Face MoE's experts under expert parallelism, models/hf_expert_parallel.py): our op
``simplesharded::expert_mm`` (x's rows grouped by expert, each group times its expert's
matrix), its gradient for the weights, the FLOP formulas that count both (and torch's
``_grouped_mm``) for FlopCounterMode and the cost model, ``grouped_mm``: torch's own grouped
GEMM where it runs (``uses_grouped_mm``), else ours, and ``by_expert``: rows laid out by
expert for it and back.

The op is a loop of one matmul per expert over its rows, opaque to the compiler (static output
shape, data-dependent offsets read only inside), which is what lets a loop over data-dependent
row ranges live in a fullgraph compile on CPU and in float32/float64; the alternatives are
worse: per-block gathered expert weights cost more memory traffic than the matmuls save, and
unbacked sizes (capture_scalar_outputs) need a global dynamo setting and put data-dependent
shapes in the graph the FSDP passes read.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import flop_registry, register_flop_formula


@torch.library.custom_op("simplesharded::expert_mm", mutates_args=())
def expert_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [N, d_in] sorted by expert, w [E, d_in, d_out], offs [E] cumulative row ends ->
    [N, d_out]: rows offs[e-1]:offs[e] times w[e]; rows past offs[-1] are 0. One matmul per
    expert, so the work is the rows, not E * N. Any device and float dtype (on CUDA reading
    offs waits for the GPU: bf16 there goes to torch._grouped_mm instead)."""
    out = x.new_zeros(x.shape[0], w.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(x[start:end], w[e], out=out[start:end])
        start = end
    return out


@expert_mm.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("simplesharded::expert_mm_wgrad", mutates_args=())
def expert_mm_wgrad(x: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """expert_mm's gradient for w: [E, d_in, d_out], expert e's rows of x^T @ grad (0 if none)."""
    gw = x.new_empty(offs.shape[0], x.shape[1], grad.shape[1])  # as big as w: write it once
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(x[start:end].t(), grad[start:end], out=gw[e])
        else:
            gw[e].zero_()
        start = end
    return gw


@expert_mm_wgrad.register_fake
def _(x, grad, offs):
    return x.new_empty(offs.shape[0], x.shape[1], grad.shape[1])


def _expert_mm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _expert_mm_backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    gx = expert_mm(grad, w.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
    gw = expert_mm_wgrad(x, grad, offs) if ctx.needs_input_grad[1] else None
    return gx, gw, None


expert_mm.register_autograd(_expert_mm_backward, setup_context=_expert_mm_setup)


# FLOP formulas, so FlopCounterMode and our cost model (passes/compute_cost.py) count the
# grouped matmuls: every row of x meets one expert's [d_in, d_out] matrix.
@register_flop_formula(torch.ops.simplesharded.expert_mm)
def _expert_mm_flops(x_shape, w_shape, offs_shape, *args, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * w_shape[-1]


@register_flop_formula(torch.ops.simplesharded.expert_mm_wgrad)
def _expert_mm_wgrad_flops(x_shape, grad_shape, offs_shape, *args, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * grad_shape[-1]


if hasattr(torch.ops.aten, "_grouped_mm") and torch.ops.aten._grouped_mm not in flop_registry:
    @register_flop_formula(torch.ops.aten._grouped_mm)
    def _grouped_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
        """[M, K] x [G, K, N] (and its backward's layouts): the groups split M, N or K, so
        each (m, k, n) is multiplied once; [G, M, K] x [G, K, N] is a bmm."""
        flops = 2 * a_shape[-2] * a_shape[-1] * b_shape[-1]
        return flops * a_shape[0] if len(a_shape) == 3 and len(b_shape) == 3 else flops


def uses_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs x @ w[e] here, eager and compiled: torch's compile-time
    checks accept only bf16, with rows 16-byte aligned (dims multiple of 8)."""
    return (hasattr(torch, "_grouped_mm") and x.dtype == w.dtype == torch.bfloat16
            and x.shape[-1] % 8 == 0 and w.shape[-1] % 8 == 0)


def local_experts(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts of weight ``w`` [E, ...]: under expert parallelism a DTensor split
    by expert (its local tensor), else ``w`` itself."""
    return w.to_local() if isinstance(w, DTensor) else w


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [N, d_in] grouped by expert times w [E, d_in, d_out] per group (``offs``: int32
    group ends): torch._grouped_mm where it runs (:func:`uses_grouped_mm`), else expert_mm."""
    if uses_grouped_mm(x, w):
        return torch._grouped_mm(x, w, offs=offs)
    return expert_mm(x, w, offs)


def row_align(x: torch.Tensor, w: torch.Tensor) -> int:
    """Row multiple each expert's group must start at: CUDA's grouped GEMM wants 16."""
    return 16 if x.is_cuda and uses_grouped_mm(x, w) else 1


def by_expert(src: torch.Tensor, flat: torch.Tensor, pos: torch.Tensor, kept: torch.Tensor,
              align: int, fn, keep: torch.Tensor | None = None) -> torch.Tensor:
    """``fn(buf, offs)`` on ``src``'s rows laid out by expert, and its rows back in src order.

    ``flat``: each src row's expert (one of ``kept.shape[0]``), ``pos`` its rank among that
    expert's rows, ``kept`` the rows kept per expert, ``keep`` (None: all) whether a row is
    kept. Expert e's group starts at a multiple of ``align``; T*k + E*(align-1) bounds the rows
    used, so the buffer's size is static (no data-dependent shape). Its last row is never a
    destination: dropped rows all land there, and the last group runs to the end so every
    output row is defined. ``fn``: [N, dim], int32 group ends [E] -> [N, d_out]. Returns
    [T*k, d_out], row i = fn's row for src row i."""
    E, (Tk, D) = kept.shape[0], src.shape
    N = Tk + E * (align - 1) + 1
    size = (kept + align - 1) // align * align
    ends = size.cumsum(0)
    offs = torch.cat([ends[:-1], ends.new_full((1,), N)]).to(torch.int32)
    dest = (ends - size)[flat] + pos
    if keep is not None:
        dest = torch.where(keep, dest, N - 1)
    buf = src.new_zeros(N, D).index_add(0, dest, src)
    return fn(buf, offs)[dest]
