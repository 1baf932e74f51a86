"""Quantize the parameter all-gathers: each rank sends its shard as int8 (or float8 e4m3fn)
values with one fp32 scale per block of elements, and every rank dequantizes right after the
wait (the weight all-gather of ZeRO++, "qwZ").

    ag(x) -> wait -> use
  ⇒ x -> flat, pad to k·B -> [k, B] blocks -> scale = max(amax|block| / QMAX, tiny)
      -> q = cast(x / scale, rounded (int8) and clamped to ±QMAX)  (float8: sent as uint8)
      -> ag(q), ag(scale) -> wait, wait
      -> q[ws, k, B] in fp32 · scale[ws, k, 1] -> [ws, k·B] -> each rank's first n elements
      -> the dtype and shape the old wait had -> use

*Invariant:* every gathered element differs from the exact gather by at most half a
quantization step of its block (int8: ``scale / 2``; e4m3fn: a relative 2**-4 of the element,
or ``scale * 2**-10`` below e4m3's normal range), plus the rounding of the old wait's dtype
when that is narrower than fp32; the shape, dtype and rank-major layout of what the old wait
produced are unchanged, so every reader of it is untouched. Only data-parallel gathers of a
parameter (``Collective.ours``) of a floating dtype are rewritten; the master weights, the
optimizer and the reduce-scatter of the gradient do not change: the pass runs on graphs
already differentiated (aot_autograd's forward and backward, compile_step's traced backward),
so the gather's backward stays the reduction of the full-precision gradient (a
straight-through estimator). A gather made again for backward is quantized as well.

B is the block knob, or the shard's length when that is smaller (padding a small shard to a
block would send more bytes than the shard itself). Each rank quantizes its own shard, padded
alone, so the gathered payload is the rank-major concatenation of padded shards: the
dequantize unpads each rank's chunk before the chunks form the gathered tensor again. Both new collectives carry the old one's annotations (so
plans bucket them with the rest of the block; bucketing keys on dtype, so a bucket sends one
quantized payload and one scale tensor) and ``QUANT_KEY``. A ragged bucket's gather
(``prebucketed``) is one collective already and is rewritten the same way, one quantize per
bucket. Idempotent: gathers of a quantized payload or of scales are left alone.
"""
from __future__ import annotations

import math

import torch
from torch import fx

from .annotations import QUANT_KEY, annotations
from .blockwise import QMAX, convert, dequantize, quantize, send, wait_both
from .collectives import ALL_GATHER, find_collectives
from .graph_utils import aten, call, fake_mode_of, flat

# choice -> (payload dtype, largest magnitude a scaled element may take)
FORMATS = {"int8": (torch.int8, QMAX[torch.int8]),
           "fp8": (torch.float8_e4m3fn, QMAX[torch.float8_e4m3fn])}
# gloo has no float8 type: float8 payloads travel as their bytes (a view, no copy), on
# every transport, so that every rank's graph is the same whatever its group's backend.
WIRE_DTYPE = {torch.float8_e4m3fn: torch.uint8}
DEFAULT_BLOCK = 256


def check_choice(choice: str | None, block: int = DEFAULT_BLOCK) -> None:
    """A one-line ValueError for a choice or block size the pass does not take."""
    if choice is not None and choice not in FORMATS:
        raise ValueError(f"quantize_gathers={choice!r} is not one of "
                         f"{[None, *FORMATS]}")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"quantize_block={block!r} is not a positive int")


def quantize_gathers(gm: fx.GraphModule, choice: str = "int8",
                     block: int = DEFAULT_BLOCK) -> fx.GraphModule:
    """Rewrite every parameter all-gather of ``gm`` into a quantized one (module doc); return
    ``gm``, edited in place."""
    check_choice(choice, block)
    targets = [c for c in find_collectives(gm.graph)
               if c.start.target is ALL_GATHER and c.wait is not None and c.ours
               and QUANT_KEY not in annotations(c.start)
               and c.dtype is not None and c.dtype.is_floating_point
               and c.dtype.itemsize > FORMATS[choice][0].itemsize]
    if not targets:
        return gm
    fake_mode = fake_mode_of(gm.graph, [c.start.args[0] for c in targets])
    for c in targets:
        _rewrite(gm.graph, c.start, c.wait, choice, block, fake_mode)
    gm.recompile()
    return gm


def _rewrite(graph: fx.Graph, start: fx.Node, wait: fx.Node, choice: str, block: int,
             fake_mode) -> None:
    qdtype = FORMATS[choice][0]
    wire = WIRE_DTYPE.get(qdtype, qdtype)
    x, ws, group = start.args[0], start.args[1], start.args[2]
    n = math.prod(x.meta["val"].shape)  # this rank's elements
    # A shard smaller than a block is one block of its own size: padding it would send more
    # bytes than the full-precision shard (a norm's weight over many ranks).
    block = max(1, min(block, n))
    nblocks = -(-n // block)
    padded = nblocks * block
    out = wait.meta["val"]  # what the readers expect: its dtype and shape
    custom = dict(annotations(start))

    def op(target, *args, **kwargs):
        return call(graph, target, args, kwargs, fake_mode=fake_mode, custom=custom)

    with graph.inserting_before(start):
        v = flat(graph, x, fake_mode)
        if v.meta["val"].dtype != torch.float32:  # amax and division in fp32 (bf16 shards)
            v = op(convert, v, torch.float32)
        if padded != n:  # zeros: they raise no block's amax
            v = op(aten.constant_pad_nd.default, v, [0, padded - n], 0.0)
        q, scale = quantize(op, op(aten.view.default, v, [nblocks, block]), qdtype)
        q = op(aten.view.default, q, [padded])
        if wire is not qdtype:  # the same bytes, as a type every transport has
            q = op(aten.view.dtype, q, wire)
        starts = send(graph, ALL_GATHER, (q, ws, group),
                      (op(aten.view.default, scale, [nblocks]), ws, group), custom, fake_mode)
    with graph.inserting_before(wait):
        q_all, s_all = wait_both(graph, starts, wait, fake_mode)
        custom = dict(annotations(wait))
        if wire is not qdtype:
            q_all = op(aten.view.dtype, q_all, qdtype)
        deq = dequantize(op, q_all, s_all, ws, nblocks, block)
        if padded != n:  # rank r's elements are row r's first n
            deq = op(aten.slice.Tensor, deq, 1, 0, n)
            deq = op(aten.clone.default, deq, memory_format=torch.contiguous_format)
        if out.dtype != torch.float32:
            deq = op(convert, deq, out.dtype)
        deq = op(aten.view.default, deq, list(out.shape))
    wait.replace_all_uses_with(deq)
    graph.erase_node(wait)
    graph.erase_node(start)
