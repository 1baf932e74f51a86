"""Float8 linear layers: :class:`Float8Linear` and :func:`convert_to_float8`.

A ``Float8Linear`` is an ``nn.Linear`` (same parameters, names and state_dict) whose matmuls
run in float8 with tensorwise dynamic scaling, through ``torch._scaled_mm``:

  forward   y  = x @ W.t()      x and W cast to float8_e4m3fn
  backward  dx = dy @ W         dy cast to float8_e5m2, W's forward cast reused
            dW = dy.t() @ x     dy in e5m2, x's forward cast reused

Each cast is one formula (:func:`to_float8`): ``amax = max|t|`` (in fp32), ``scale =
max(amax, AMAX_EPS) / FMAX[dtype]``, ``t8 = clamp(t / scale, -FMAX, FMAX)`` cast to the float8
dtype; ``_scaled_mm`` multiplies the two scales back in, accumulating in fp32, and returns the
input's dtype. The bias (if any) is added in full precision. Master weights, gradients and the
optimizer stay in their dtype.

*Invariant:* the weight's cast is the only place a Float8Linear reads its weight, and its ops
carry the ``FLOAT8_KEY`` annotation (passes/annotations.py) with their role: ``"amax"`` (the
tensor-wide max, in fp32), ``"scale"``, ``"values"`` (the e4m3fn weight) and ``"op"`` (the
rest). passes/float8_gather.py finds a gathered weight's cast by it and sends the cast shard
instead of the full-precision one.

:func:`convert_to_float8` swaps the ``nn.Linear`` modules inside the model's blocks
(simplesharded/blocks.py) for Float8Linear in place, keeping the parameter objects: call it
before tensor parallelism and ``data_parallel`` (trainer/recipe.py does). Layers whose
in/out features are not multiples of 16 (what ``_scaled_mm`` takes on accelerators) are
skipped, and so is anything outside the blocks (the embedding and the output head).

The torch internal touched: ``torch._scaled_mm`` (docs/torch_internals.md). On CPU (torch 2.13)
it accepts e4m3fn and e5m2 in either operand and either memory layout, so the gradient stays
in e5m2 (no e4m3 fallback is needed); the operands are laid out as CUDA wants them anyway (the
first row-major, the second column-major). On CUDA the weight gradient's matmul reduces over
the tokens, so their count per micro-batch must be a multiple of 16 as well.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.fx.traceback as fx_traceback
from torch import nn

from simplesharded.passes.annotations import FLOAT8_KEY

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# the largest finite magnitude of each float8 dtype
FMAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
# a tensor of zeros gets this amax, so nothing divides by zero
AMAX_EPS = 1e-12
# _scaled_mm's dims must be multiples of 16 on accelerators
DIM_MULTIPLE = 16


def _role(annotate: bool, role: str):
    return fx_traceback.annotate({FLOAT8_KEY: role}) if annotate else contextlib.nullcontext()


def to_float8(t: torch.Tensor, dtype: torch.dtype = E4M3, annotate: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` → (its float8 values, the fp32 0-d scale that multiplies them back), tensorwise
    (module doc). ``annotate``: the ops carry FLOAT8_KEY with their role (the weight's cast)."""
    fmax = FMAX[dtype]
    with _role(annotate, "op"):
        with _role(annotate, "amax"):
            amax = torch.amax(torch.abs(t)).to(torch.float32)
        with _role(annotate, "scale"):
            scale = torch.clamp_min(amax, AMAX_EPS) / fmax
        scaled = torch.clamp(t.to(torch.float32) / scale, -fmax, fmax)
        with _role(annotate, "values"):
            values = scaled.to(dtype)
    return values, scale


def _mm(a8, sa, b8, sb, out_dtype):
    """``a @ b`` of two float8 tensors and their scales, laid out as CUDA takes them: ``a``
    row-major, ``b`` column-major."""
    return torch._scaled_mm(a8.contiguous(), b8.t().contiguous().t(), scale_a=sa, scale_b=sb,
                            out_dtype=out_dtype)


class _Float8Matmul(torch.autograd.Function):
    """``x2d @ w.t()`` in float8 (module doc); ``x2d`` is 2-D."""

    @staticmethod
    def forward(ctx, x, w):
        w8, sw = to_float8(w, E4M3, annotate=True)
        x8, sx = to_float8(x, E4M3)
        ctx.save_for_backward(x8, sx, w8, sw)
        ctx.dtypes = (x.dtype, w.dtype)
        return _mm(x8, sx, w8.t(), sw, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x8, sx, w8, sw = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g8, sg = to_float8(grad, E5M2)
        grad_x = _mm(g8, sg, w8, sw, x_dtype)  # [M, N] @ [N, K]
        grad_w = _mm(g8.t(), sg, x8, sx, w_dtype)  # [N, M] @ [M, K]
        return grad_x, grad_w


def float8_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its matmuls in float8 (module doc)."""
    out = _Float8Matmul.apply(x.reshape(-1, x.shape[-1]), weight)
    out = out.view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run in float8 (module doc); its parameters and state_dict
    are nn.Linear's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float8_linear(x, self.weight, self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Float8Linear":
        """``linear`` itself, its class changed: the same parameter objects, hooks and
        attributes (an optimizer or a param group built on them is untouched)."""
        if type(linear) is not nn.Linear:
            raise TypeError(f"Float8Linear.from_linear takes an nn.Linear, not "
                            f"{type(linear).__name__}")
        linear.__class__ = cls
        return linear


def convertible(linear: nn.Module) -> bool:
    """A plain nn.Linear whose dims ``_scaled_mm`` takes (multiples of 16)."""
    return (type(linear) is nn.Linear and linear.in_features % DIM_MULTIPLE == 0
            and linear.out_features % DIM_MULTIPLE == 0)


def convert_to_float8(model: nn.Module,
                      module_filter: Callable[[str, nn.Module], bool] | None = None
                      ) -> list[str]:
    """Swap, in place, each ``nn.Linear`` inside ``model``'s blocks (simplesharded/blocks.py)
    that :func:`convertible` takes and ``module_filter(fqn, module)`` (when given) accepts
    for a :class:`Float8Linear`, keeping its parameters; return the FQNs swapped. Modules
    outside the blocks (the output head) stay as they are. Before ``data_parallel``: a
    wrapped model is refused in one line."""
    from simplesharded.blocks import find_blocks
    from simplesharded.storage.sharded_state import sharded_state

    if any(sharded_state(m) is not None for m in model.modules()):
        raise ValueError("convert_to_float8: the model is already data_parallel-wrapped; "
                         "convert it before tensor parallelism and data_parallel")
    swapped = []
    for block_fqn, block in find_blocks(model):
        for name, module in block.named_modules():
            fqn = f"{block_fqn}.{name}" if name else block_fqn
            if convertible(module) and (module_filter is None or module_filter(fqn, module)):
                Float8Linear.from_linear(module)
                swapped.append(fqn)
    return swapped
