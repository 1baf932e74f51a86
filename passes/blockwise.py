"""Blockwise quantization as graph nodes, for the quantized collectives (quantized_gather.py,
quantized_reduce.py): fp32 blocks to low-precision values with one fp32 scale per block, the
payload and the scales sent by two collectives of one kind, and back to fp32.

*Invariant:* ``dequantize(quantize(b))`` differs from every element of a block ``b`` by at most
half a quantization step of its block (int8: ``scale / 2`` with ``scale = amax / 127``;
float8 e4m3fn: its own rounding of ``x / scale``, ``scale = amax / 448``); a block of zeros gets
the smallest positive scale, so nothing divides by zero. The nodes are the ops inductor's
post-grad graph lowers (prims' cast, clamp_min/clamp_max), in one fixed order.
"""
from __future__ import annotations

import torch
from torch import fx

from .annotations import QUANT_KEY, annotations
from .collectives import WAIT
from .graph_utils import aten, call

# payload dtype -> the largest magnitude a scaled element may take
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# The smallest scale: a block of zeros (or of values below it) gets a finite one.
MIN_SCALE = torch.finfo(torch.float32).tiny
# Casts as inductor's post-grad graph has them (it decomposes aten._to_copy before our passes
# run there and has no lowering for it); aot_eager runs the prim as it is.
convert = torch.ops.prims.convert_element_type.default


def quantize(op, blocks: fx.Node, qdtype: torch.dtype) -> tuple[fx.Node, fx.Node]:
    """``blocks`` (fp32, [k, B]) → (values [k, B] of ``qdtype``, fp32 scales [k, 1]); ``op``
    adds one node (target, *args)."""
    qmax = QMAX[qdtype]
    amax = op(aten.amax.default, op(aten.abs.default, blocks), [1], True)
    scale = op(aten.clamp_min.default, op(aten.div.Tensor, amax, qmax), MIN_SCALE)
    scaled = op(aten.div.Tensor, blocks, scale)
    if qdtype is torch.int8:  # the cast truncates: round first
        scaled = op(aten.round.default, scaled)
    # clamp_min/max, not clamp: inductor's post-grad graph has clamp decomposed already and
    # no lowering for it
    scaled = op(aten.clamp_max.default, op(aten.clamp_min.default, scaled, -qmax), qmax)
    return op(convert, scaled, qdtype), scale


def dequantize(op, values: fx.Node, scales: fx.Node, rows: int, nblocks: int,
               block: int) -> fx.Node:
    """``rows`` × ``nblocks`` blocks of ``block`` values and their scales (as received, flat)
    → fp32 [rows, nblocks · block]."""
    deq = op(aten.mul.Tensor,
             op(convert, op(aten.view.default, values, [rows, nblocks, block]), torch.float32),
             op(aten.view.default, scales, [rows, nblocks, 1]))
    return op(aten.view.default, deq, [rows, nblocks * block])


def send(graph: fx.Graph, target, payload_args: tuple, scale_args: tuple, custom: dict,
         fake_mode) -> tuple[fx.Node, fx.Node]:
    """The payload's and the scales' collectives (``target``), at the graph's insertion point,
    each with ``custom`` and its QUANT_KEY role."""
    return tuple(call(graph, target, args, fake_mode=fake_mode, custom={**custom, QUANT_KEY: role})
                 for role, args in (("payload", payload_args), ("scales", scale_args)))


def wait_both(graph: fx.Graph, starts: tuple[fx.Node, fx.Node], wait: fx.Node,
              fake_mode) -> tuple[fx.Node, fx.Node]:
    """Waits for :func:`send`'s two collectives, at the graph's insertion point, with the old
    ``wait``'s annotations and their roles."""
    custom = dict(annotations(wait))
    return tuple(call(graph, WAIT, (start,), fake_mode=fake_mode,
                      custom={**custom, QUANT_KEY: role})
                 for role, start in zip(("payload", "scales"), starts))
