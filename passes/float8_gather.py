"""Gather float8 weights in float8: where a parameter's all-gather feeds only the float8 cast
of that weight (a Float8Linear's, its ops annotated ``FLOAT8_KEY``: simplesharded/float8.py),
the shard is cast instead and the all-gather carries the float8 bytes.

    shard -> ag -> wait -> views -> W -> cast(W): amax|W| -> scale -> W/scale -> clamp -> e4m3
  ⇒ shard -> amax|shard| -> all_reduce(max) -> wait -> scale -> shard/scale -> clamp -> e4m3
          -> as uint8 -> ag -> wait -> as e4m3 -> the same views -> the cast's readers

The cast's own ops are copied onto the shard (so the formula is the one the layer traced,
whatever it is), and the all-reduce goes right after the copy of the tensor-wide amax (the
last node of role ``"amax"``). In a backward graph the partitioner has usually kept the scale
from forward and recomputes only ``W/scale -> clamp -> e4m3`` from the weight gathered again:
the copy then has no amax and no all-reduce, and the regather sends float8 too.

*Invariant:* the float8 weight and the scale the graph computes are bitwise the ones the
unrewritten graph computes: the amax of the whole is the max over the shards' amax (padding
is zeros: a max is unchanged by them, and their cast is zero), the scale is the same formula
on the same fp32 value, and an elementwise cast commutes with the gather's concatenation and
with the views after it. Rewritten only when (checked, else the gather is left alone with a
note in the graph, ``NOTES_KEY``): the gather is ours (``Collective.ours``), of a floating
dtype; between its wait and the cast only single-input data-movement ops, each read by the
next alone; the cast's ops that read the weight's elements are elementwise (abs, div, mul,
clamps, dtype casts) or one full ``amax`` / ``max``; every reader outside the cast reads its
float8 values or a 0-d value; the cast's other inputs are 0-d and defined before the gather.
A ragged bucket's gather serves all its members (views of one buffer) and is never rewritten.

The new all-reduce and all-gather (and their waits) carry the old gather's annotations, so
they are ours: block bucketing (which keys on kind, dtype and reduce op) merges a block's
float8 gathers into one uint8 gather and their amax all-reduces into one. They also carry
``FLOAT8_KEY`` ("amax_reduce", "payload"). gloo has no float8 type: the payload travels as its
bytes (a uint8 view, no copy), on every transport, so every rank's graph is the same. Runs
before bucketing, on forward and backward graphs; idempotent (a gather of bytes is not a
floating one). Run by the backends only on graphs that hold an annotated cast
(annotations.py: ``has_float8_casts``).
"""
from __future__ import annotations

import torch
from torch import fx

from .annotations import FLOAT8_KEY, PARAM_KEY, RAGGED_KEY, add_note, annotations
from .collectives import ALL_GATHER, ALL_REDUCE, WAIT, find_collectives
from .graph_utils import aten, call, fake_mode_of

prims = torch.ops.prims
# the bytes of a float8 payload on the wire (gloo has no float8 type)
WIRE_DTYPE = torch.uint8
# Data movement between a gather's wait and the weight: the same elements, moved.
MOVES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
         aten.slice.Tensor, aten.t.default, aten.permute.default, aten.transpose.int,
         aten.alias.default, aten.clone.default, aten.squeeze.dim, aten.unsqueeze.default,
         aten.narrow.default}
# Longest chain of single-input ops looked up from a cast's weight for its gather.
_MAX_CHAIN = 16
# Ops of the cast that may read the weight's elements: elementwise, so they commute with the
# gather (scalars only as their other operands).
ELEMENTWISE = {aten.abs.default, aten.div.Tensor, aten.mul.Tensor, aten.clamp.default,
               aten.clamp_min.default, aten.clamp_max.default, aten._to_copy.default,
               prims.convert_element_type.default, aten.reciprocal.default,
               aten.neg.default}
# The cast's one reduction over the weight: a max, which an all-reduce (max) completes.
REDUCTIONS = {aten.amax.default, aten.max.default}
_CASTS = {aten._to_copy.default, prims.convert_element_type.default}


def float8_gathers(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite each parameter gather of ``gm`` that feeds only a float8 cast (module doc);
    return ``gm``, edited in place."""
    graph = gm.graph
    waits = {c.wait: c for c in find_collectives(graph)
             if c.start.target is ALL_GATHER and c.wait is not None}
    plans = []
    for values in [n for n in graph.nodes if annotations(n).get(FLOAT8_KEY) == "values"]:
        plan = _plan(values, waits)
        if isinstance(plan, str):
            add_note(gm, f"float8 gather: {plan}: gathered in full precision")
        elif plan is not None:
            plans.append(plan)
    if not plans:
        return gm
    fake_mode = fake_mode_of(graph, [p.collective.start.args[0] for p in plans])
    for plan in plans:
        _rewrite(graph, plan, fake_mode)
    gm.recompile()
    return gm


class _Plan:
    def __init__(self, collective, chain, weight, region, reduction):
        self.collective = collective  # the gather
        self.chain = chain  # movement ops from its wait to the weight, in order
        self.weight = weight  # what the cast reads (the chain's end, or the wait itself)
        self.region = region  # the cast's nodes, in graph order
        self.reduction = reduction  # the node the all-reduce goes after (None: no amax here)


def _plan(values: fx.Node, waits: dict) -> "_Plan | str | None":
    """The rewrite of the gather feeding the cast that ends in ``values``; None when no
    parameter gather feeds it (an unsharded weight); a reason (str) when one does but the
    rewrite does not apply."""
    region, frontier = set(), []
    stack = [values]
    while stack:
        n = stack.pop()
        if n in region:
            continue
        region.add(n)
        for a in n.all_input_nodes:
            ours = a.op == "call_function" and FLOAT8_KEY in annotations(a)
            (stack if ours else frontier).append(a)
    tensors = [a for a in dict.fromkeys(frontier) if _numel(a) != 1]
    if len(tensors) != 1:
        return None
    weight = tensors[0]
    chain, node = [], weight
    while node not in waits:  # up the single-input ops that lead to a gather, if any
        if (node.op != "call_function" or len(node.all_input_nodes) != 1
                or len(chain) == _MAX_CHAIN):
            return None
        chain.append(node)
        node = node.all_input_nodes[0]
    c = waits[node]
    name = annotations(c.start).get(PARAM_KEY, "?")
    if not c.ours:
        return None
    if RAGGED_KEY in annotations(c.start):
        return (f"ragged bucket {annotations(c.start)[RAGGED_KEY]!r} is gathered as one "
                f"buffer, its float8 weights views of it")
    if c.dtype is None or not c.dtype.is_floating_point:
        return None  # bytes already (idempotence)
    moved = [n.target for n in chain if n.target not in MOVES]
    if moved:
        return f"{name}'s gathered weight goes through {moved[0]} before its float8 cast"
    chain.reverse()
    for a, b in zip([node, *chain], [*chain, weight]):
        if set(a.users) != {b} and a is not weight:
            return f"{name}'s gathered tensor is read by more than its float8 cast"
    if any(u not in region for u in weight.users):
        return f"{name}'s gathered weight is read by more than its float8 cast"
    order = {n: i for i, n in enumerate(values.graph.nodes)}
    region = sorted(region, key=order.__getitem__)
    reads = _reads_weight(region, weight)
    reduction = None
    for n in region:
        if n not in reads:
            continue
        if n.target in REDUCTIONS:
            if reduction is not None or not _full_reduction(n):
                return f"{name}'s cast reduces the weight other than by one full max"
            reduction = n
        elif n.target not in ELEMENTWISE:
            return f"{name}'s cast has {n.target} on the weight's elements"
        if any(u not in region for u in n.users) and n is not values and _numel(n) != 1:
            return f"{name}'s cast has {n} read outside it"
    # The all-reduce goes after the amax's casts of role "amax" (to fp32: an exact upcast, so
    # the max over ranks is the same), so it runs in fp32 whatever the weight's dtype.
    while reduction is not None:
        up = [u for u in reduction.users if u.target in _CASTS
              and annotations(u).get(FLOAT8_KEY) == "amax"]
        if len(up) != 1 or up[0].meta["val"].dtype.itemsize < reduction.meta["val"].dtype.itemsize:
            break
        reduction = up[0]
    for a in dict.fromkeys(frontier):
        if a is not weight and order[a] >= order[c.start]:
            return f"{name}'s cast reads {a}, defined after its gather"
    return _Plan(c, chain, weight, region, reduction)


def _reads_weight(region: list[fx.Node], weight: fx.Node) -> set[fx.Node]:
    """The region's nodes that read the weight's elements without a reduction in between."""
    out: set[fx.Node] = set()
    for n in region:
        if any(a is weight or (a in out and a.target not in REDUCTIONS)
               for a in n.all_input_nodes):
            out.add(n)
    return out


def _full_reduction(n: fx.Node) -> bool:
    if n.target is aten.max.default:
        return True
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", [])
    rank = n.args[0].meta["val"].dim()
    return not dims or sorted(d % rank for d in dims) == list(range(rank))


def _numel(n: fx.Node) -> int | None:
    val = n.meta.get("val")
    return val.numel() if isinstance(val, torch.Tensor) else None


def _rewrite(graph: fx.Graph, plan: _Plan, fake_mode) -> None:
    start, wait = plan.collective.start, plan.collective.wait
    shard, ws, group = start.args[0], start.args[1], start.args[2]
    gather_custom, wait_custom = dict(annotations(start)), dict(annotations(wait))
    copies: dict[fx.Node, fx.Node] = {plan.weight: shard}
    values = plan.region[-1]  # the cast ends in its float8 values

    def op(target, args, kwargs=None, custom=gather_custom):
        return call(graph, target, args, kwargs, fake_mode=fake_mode, custom=custom)

    with graph.inserting_before(start):
        for n in plan.region:
            role = annotations(n).get(FLOAT8_KEY)
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: copies.get(a, a))
            copies[n] = op(n.target, args, kwargs, {**gather_custom, FLOAT8_KEY: role})
            if n is plan.reduction:  # one all-reduce (max) of the shards' amax
                red = {**gather_custom, FLOAT8_KEY: "amax_reduce"}
                flat = op(aten.view.default, (copies[n], [1]))
                total = op(WAIT, (op(ALL_REDUCE, (flat, "max", group), custom=red),),
                           custom=red)
                copies[n] = op(aten.view.default, (total, list(n.meta["val"].shape)))
        payload = {**gather_custom, FLOAT8_KEY: "payload"}
        q = copies[values]
        fp8 = q.meta["val"].dtype
        q = op(aten.view.dtype, (q, WIRE_DTYPE))
        gathered = op(ALL_GATHER, (q, ws, group), custom=payload)
    with graph.inserting_before(wait):
        out = op(WAIT, (gathered,), custom={**wait_custom, FLOAT8_KEY: "payload"})
        out = op(aten.view.dtype, (out, fp8), custom=wait_custom)
        prev = wait
        for n in plan.chain:  # the same views, now of the float8 bytes
            args, kwargs = fx.node.map_arg((n.args, n.kwargs),
                                           lambda a, p=prev, o=out: o if a is p else a)
            out, prev = op(n.target, args, kwargs, custom=annotations(n)), n
    values.replace_all_uses_with(out)
    for n in plan.region:
        if n is not values and _numel(n) == 1:  # the scale (and the amax) from the shards
            n.replace_all_uses_with(copies[n])
    # what read the full-precision weight, newest first: nothing reads it any more
    for n in [*reversed(plan.region), *reversed(plan.chain), wait, start]:
        if not n.users:
            graph.erase_node(n)
