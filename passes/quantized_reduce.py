"""Quantize the gradient reduce-scatters: each rank sends the chunk meant for rank r as int8
values with one fp32 scale per block, through an all-to-all, and every rank dequantizes the
``ws`` chunks it receives and sums them in fp32 (the gradient reduction of ZeRO++, "qgZ");
or, ``bf16``, the reduce-scatter itself runs on bf16 (the baseline it is measured against).

int8:
    rs(x, sum|avg) -> wait -> use
  ⇒ x -> [ws, c] (row r: what rank r owns) -> pad each row to k·B -> [ws·k, B] blocks
      -> scale = max(amax|block| / 127, tiny) -> q = int8(clamp(round(x / scale), ±127))
      -> a2a(q), a2a(scale) -> wait, wait
      -> q[ws, k, B] in fp32 · scale[ws, k, 1] -> [ws, k·B] -> row 0 + row 1 + ... (rank
         order, fp32) [-> / ws for avg] -> first c elements -> the old wait's dtype and shape
bf16 (fp32 gradients only):
    rs(x) -> wait  ⇒  rs(bf16(x)) -> wait -> the old wait's dtype

*Invariant:* int8: every reduced element differs from the exact fp32 sum (average) of the
ranks' inputs by at most the sum over ranks of half a quantization step of the block that
element sat in on that rank (``Σ_r scale_r / 2``; divided by ``ws`` for avg), plus the fp32
rounding of the ``ws - 1`` adds and of the old wait's dtype when that is narrower than fp32.
A block never spans two destination chunks (each chunk is padded alone, with zeros, which
raise no block's amax), and a chunk shorter than the block knob is one block of its own size.
A block may span two parameters of a bucket (blocks follow the chunk, not its members): a
gradient much smaller than its neighbours in a block is sent with their scale, and may come
out as zeros; the bound above still holds, element by element.
bf16: the reduction is the one of bf16-rounded inputs in bf16. Either way the shape and dtype
the old wait produced are unchanged, so every reader of the gradient is untouched. Only
data-parallel reduce-scatters (``Collective.ours``) of a floating dtype wider than the target,
over more than one rank, whose reduce op is ``sum`` or ``avg`` are rewritten; anything else
(a ``premul_sum``, TP's reductions, HSDP's replica all-reduces) is left as it is.

Where it runs (simplesharded/backends.py): after bucketing and reordering, before lowering.
Bucketing merges only all-gathers, reduce-scatters and all-reduces; run before it, this pass
would leave one all-to-all pair per parameter. After it, a bucket's one reduce-scatter becomes
one quantize and one payload and one scale all-to-all (a ragged bucket's reduce-scatter,
already one per bucket, likewise). After reordering, the all-to-alls are issued where
reordering issued the reduce-scatter, and the dequantize and sum run where it was waited
(reordering would otherwise treat the two all-to-alls as two reductions and wait for the
payload before issuing the scales). Before lowering: a bf16 reduce-scatter on gloo is then
lowered as any other, and an int8 one leaves no reduce-scatter to lower. The new collectives
carry the old one's annotations (so they stay ours, in their block and bucket) and
``QUANT_KEY``: "payload" and "scales" on the all-to-alls and their waits, "bf16" on the bf16
reduce-scatter. Idempotent: no reduce-scatter of ours is left wider than the target.
"""
from __future__ import annotations

import math

import torch
from torch import fx

from .annotations import QUANT_KEY, annotations
from .blockwise import QMAX as _QMAX
from .blockwise import convert, dequantize, quantize, send, wait_both
from .collectives import ALL_TO_ALL, REDUCE_SCATTER, WAIT, find_collectives
from .graph_utils import aten, call, fake_mode_of, flat

# choice -> the dtype that goes on the wire
FORMATS = {"int8": torch.int8, "bf16": torch.bfloat16}
QMAX = _QMAX[torch.int8]  # int8's, blockwise.py
DEFAULT_BLOCK = 256  # the same knob, and default, as quantized_gather.py's
# Reduce ops whose result this pass can rebuild from the received chunks.
REDUCE_OPS = ("sum", "avg")


def check_choice(choice: str | None, block: int = DEFAULT_BLOCK) -> None:
    """A one-line ValueError for a choice or block size the pass does not take."""
    if choice is not None and choice not in FORMATS:
        raise ValueError(f"quantize_grads={choice!r} is not one of {[None, *FORMATS]}")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"quantize_block={block!r} is not a positive int")


def _rewritable(c, choice: str) -> bool:
    x = c.start.args[0]
    return (c.start.target is REDUCE_SCATTER and c.wait is not None and c.ours
            and QUANT_KEY not in annotations(c.start)
            and c.dtype is not None and c.dtype.is_floating_point
            and (c.dtype == torch.float32 if choice == "bf16"
                 else c.dtype.itemsize > FORMATS[choice].itemsize)
            and str(c.start.args[1]) in REDUCE_OPS and c.group_size > 1
            and isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)
            and x.meta["val"].numel() % c.group_size == 0)


def quantize_reductions(gm: fx.GraphModule, choice: str = "int8",
                        block: int = DEFAULT_BLOCK) -> fx.GraphModule:
    """Rewrite every gradient reduce-scatter of ``gm`` into a quantized one (module doc);
    return ``gm``, edited in place."""
    check_choice(choice, block)
    targets = [c for c in find_collectives(gm.graph) if _rewritable(c, choice)]
    if not targets:
        return gm
    fake_mode = fake_mode_of(gm.graph, [c.start.args[0] for c in targets])
    rewrite = _rewrite_int8 if choice == "int8" else _rewrite_bf16
    for c in targets:
        rewrite(gm.graph, c.start, c.wait, block, fake_mode)
    gm.recompile()
    return gm


def _rewrite_bf16(graph: fx.Graph, start: fx.Node, wait: fx.Node, block: int,
                  fake_mode) -> None:
    x, op, ws, group = start.args[:4]
    custom = {**annotations(start), QUANT_KEY: "bf16"}
    with graph.inserting_before(start):
        low = call(graph, convert, (x, torch.bfloat16), fake_mode=fake_mode, custom=custom)
        new_start = call(graph, REDUCE_SCATTER, (low, op, ws, group), fake_mode=fake_mode,
                         custom=custom)
    with graph.inserting_before(wait):
        new_wait = call(graph, WAIT, (new_start,), fake_mode=fake_mode,
                        custom={**annotations(wait), QUANT_KEY: "bf16"})
        back = call(graph, convert, (new_wait, wait.meta["val"].dtype), fake_mode=fake_mode,
                    custom=annotations(wait))
    wait.replace_all_uses_with(back)
    graph.erase_node(wait)
    graph.erase_node(start)


def _rewrite_int8(graph: fx.Graph, start: fx.Node, wait: fx.Node, block: int,
                  fake_mode) -> None:
    x, op, ws, group = start.args[:4]
    chunk = math.prod(x.meta["val"].shape) // ws  # the elements each rank owns
    # A chunk smaller than a block is one block of its own size: padding it would send more
    # bytes than the full-precision chunk.
    block = max(1, min(block, chunk))
    nblocks = -(-chunk // block)
    padded = nblocks * block
    out = wait.meta["val"]
    custom = dict(annotations(start))

    def op_(target, *args, **kwargs):
        return call(graph, target, args, kwargs, fake_mode=fake_mode, custom=custom)

    with graph.inserting_before(start):
        v = flat(graph, x, fake_mode)
        if v.meta["val"].dtype != torch.float32:  # amax and division in fp32
            v = op_(convert, v, torch.float32)
        rows = op_(aten.view.default, v, [ws, chunk])
        if padded != chunk:  # each destination's chunk padded alone: no block spans two
            rows = op_(aten.constant_pad_nd.default, rows, [0, padded - chunk], 0.0)
        q, scale = quantize(op_, op_(aten.view.default, rows, [ws * nblocks, block]),
                            torch.int8)
        starts = send(graph, ALL_TO_ALL,
                      (op_(aten.view.default, q, [ws * padded]), [padded] * ws, [padded] * ws,
                       group),
                      (op_(aten.view.default, scale, [ws * nblocks]), [nblocks] * ws,
                       [nblocks] * ws, group), custom, fake_mode)
    with graph.inserting_before(wait):
        q_all, s_all = wait_both(graph, starts, wait, fake_mode)
        custom = dict(annotations(wait))
        # row r: rank r's contribution to this rank's chunk
        parts = dequantize(op_, q_all, s_all, ws, nblocks, block)
        # ws - 1 adds in rank order, as lowering.py sums: faster on CPU than sum(dim=0)
        total = op_(aten.select.int, parts, 0, 0)
        for r in range(1, ws):
            total = op_(aten.add.Tensor, total, op_(aten.select.int, parts, 0, r))
        if str(op) == "avg":
            total = op_(aten.div.Tensor, total, ws)
        if padded != chunk:  # a prefix of a 1-D tensor: still contiguous
            total = op_(aten.slice.Tensor, total, 0, 0, chunk)
        if out.dtype != torch.float32:
            total = op_(convert, total, out.dtype)
        total = op_(aten.view.default, total, list(out.shape))
    wait.replace_all_uses_with(total)
    graph.erase_node(wait)
    graph.erase_node(start)
