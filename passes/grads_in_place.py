"""Backward pass (aot_eager): a ragged bucket's gradients are computed straight into the
reduce-scatter's input.

A ragged bucket's gathered buffer is cut into its members by one split
(simplesharded/storage/ragged.py), whose backward is one ``cat`` of the members' gradients, flattened,
with zeros in the alignment gaps: the reduce-scatter's input. aot_eager runs the graph op by
op, so each gradient is computed into a tensor of its own and then copied into the cat's.
Here the buffer comes first (``empty``), each gradient's producer writes into its slice
through its ``out=`` form (``mm.out``, ``sum.IntList_out``: any aten op that has one), the
gaps are zeroed in place, and only a piece no producer can write is copied (``copy_``):

    g = mm(a, b); cat([view(t(t(g)), [-1]), zeros, ...])
      ⇒  buf = empty([N]); g = mm.out(a, b, out=buf[o:o + n].view(g's shape));
         buf[gap].zero_(); ... and the cat's readers read buf

Invariant: where the cat stood, the buffer holds bit for bit what the cat would have (an
``out=`` kernel computes what its functional form does), and every other value the graph
computes is unchanged. A producer is rewritten only when its result is contiguous, fills its
piece exactly in the same element order, and reaches the cat through view ops each read by
nothing else. The writes reach the buffer's readers by graph order, not by a data edge, so
this runs after every pass that moves a gradient's producer or the collective that reads the
buffer (simplesharded/backends.py: after view_cat.py).
Only a ragged bucket's cats (RAGGED_KEY on the cat or on its reduction) are touched;
inductor does not get this pass (it plans its own buffers).
"""
from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch import fx

from .annotations import RAGGED_KEY, annotations
from .graph_utils import aten, call, fake_mode_of
from .node_meta import alias_kind, aliased_inputs

ZEROS = {aten.zeros.default, aten.new_zeros.default}
# How far the reduce-scatter may stand from the cat: the backward's scaling and casts
# (simplesharded/storage/ragged.py, _Gather.backward).
REDUCTION_HOPS = 3


def write_grads_in_place(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite every ragged bucket's gradient cat in ``gm`` (edited in place); return ``gm``."""
    changed = False
    for cat in list(gm.graph.find_nodes(op="call_function", target=aten.cat.default)):
        if _feeds_ragged_reduction(cat) and _is_flat_cat(cat):
            changed |= _rewrite(gm.graph, cat)
    if changed:
        gm.recompile()
    return gm


def _feeds_ragged_reduction(cat: fx.Node) -> bool:
    """The cat is a ragged bucket's: annotated as one, or read (through a cast, say) by its
    annotated reduction. A step graph's traced backward (simplesharded/step/__init__.py) annotates the
    reduction but not the split's backward."""
    node = cat
    for _ in range(REDUCTION_HOPS + 1):
        if annotations(node).get(RAGGED_KEY):
            return True
        if len(node.users) != 1:
            return False
        node = next(iter(node.users))
    return False


def _is_flat_cat(cat: fx.Node) -> bool:
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    val = cat.meta.get("val")
    return (dim == 0 and isinstance(val, torch.Tensor) and val.dim() == 1
            and all(isinstance(p, fx.Node) for p in cat.args[0]))


def _rewrite(graph: fx.Graph, cat: fx.Node) -> bool:
    val = cat.meta["val"]
    fake_mode = fake_mode_of(graph, [cat])
    plan, offset = [], 0
    for piece in cat.args[0]:
        n = piece.meta["val"].numel()
        producer = (None if _is_zeros(piece)
                    else _writable_producer(piece, cat, val.dtype, fake_mode))
        kind = "zero" if _is_zeros(piece) else ("out" if producer is not None else "copy")
        plan.append((piece, kind, producer, offset, n))
        offset += n
    writers = [producer for _, kind, producer, _, _ in plan if kind == "out"]
    if not writers or len(set(writers)) != len(writers):
        return False  # nothing saved, or one tensor read twice: leave the cat
    position = {node: i for i, node in enumerate(graph.nodes)}
    first = min(writers, key=position.__getitem__)
    custom = annotations(cat)

    def piece_of(o, n, shape=None):
        part = call(graph, aten.slice.Tensor, (buf, 0, o, o + n), fake_mode=fake_mode)
        if shape is None:
            return part
        return call(graph, aten.view.default, (part, list(shape)), fake_mode=fake_mode)

    with graph.inserting_before(first):
        buf = call(graph, aten.empty.memory_format, ([val.numel()],),
                   {"dtype": val.dtype, "device": val.device}, fake_mode=fake_mode,
                   custom=custom)
        for _, kind, _, o, n in plan:
            if kind == "zero":
                call(graph, aten.zero_.default, (piece_of(o, n),), fake_mode=fake_mode,
                     custom=custom)
    for _, kind, producer, o, n in plan:
        if kind == "out":
            with graph.inserting_before(producer):
                out = piece_of(o, n, producer.meta["val"].shape)
                written = call(graph, _out_variant(producer.target), producer.args,
                               {**producer.kwargs, "out": out}, fake_mode=fake_mode,
                               custom=producer.meta.get("custom"))
            producer.replace_all_uses_with(written)
            graph.erase_node(producer)
    with graph.inserting_before(cat):
        for piece, kind, _, o, n in plan:
            if kind == "copy":
                call(graph, aten.copy_.default, (piece_of(o, n), piece), fake_mode=fake_mode,
                     custom=custom)
    pieces = list(cat.args[0])
    cat.replace_all_uses_with(buf)
    graph.erase_node(cat)
    for piece in dict.fromkeys(pieces):  # the views of written pieces, the zeros
        _erase_dead(graph, piece)
    return True


def _is_zeros(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in ZEROS


def _writable_producer(piece: fx.Node, cat: fx.Node, dtype: torch.dtype,
                       fake_mode) -> fx.Node | None:
    """The node whose result is ``piece``'s elements in order, reached through views each
    read only by the next (``piece`` only by ``cat``), when it can write into the buffer."""
    if set(piece.users) != {cat}:
        return None
    node = piece
    while alias_kind(node) == "view":
        inputs = aliased_inputs(node)
        if len(inputs) != 1 or len(inputs[0].users) != 1:
            return None
        node = inputs[0]
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    base, flat = node.meta.get("val"), piece.meta.get("val")
    if not (isinstance(base, torch.Tensor) and isinstance(flat, torch.Tensor)):
        return None
    same_order = (base.is_contiguous() and flat.is_contiguous() and flat.numel() == base.numel()
                  and base.storage_offset() == 0 and flat.storage_offset() == 0)
    if not same_order or base.dtype != dtype or _out_variant(node.target) is None:
        return None
    return node if _out_form_traces(node, fake_mode) else None


def _out_form_traces(node: fx.Node, fake_mode) -> bool:
    """Whether ``node``'s ``out=`` form runs on its fake inputs. Some have a kernel but no
    fake one: the meta function registered for ``embedding_dense_backward`` (an embedding's
    gradient) takes no ``out``, so its ``out=`` form fails in every compile; such a piece
    is copied instead. Fake tensor mode logs the failure as an error before raising it, which
    would read as a failed compile: its logger is quiet for the trial."""
    if fake_mode is None:
        return True
    vals, kwvals = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    with fake_mode, _quiet(logging.getLogger("torch._subclasses.fake_tensor")):
        try:
            _out_variant(node.target)(*vals, **kwvals, out=torch.empty_like(node.meta["val"]))
        except Exception:  # any failure means: not this way
            return False
    return True


@contextlib.contextmanager
def _quiet(logger: logging.Logger):
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


@functools.cache
def _out_variant(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The overload of ``op`` taking the same arguments and one ``out`` tensor, if any."""
    schema = op._schema
    if len(schema.returns) != 1 or schema.is_mutable:
        return None
    args = [(a.name, str(a.type)) for a in schema.arguments]
    for name in op.overloadpacket.overloads():
        other = getattr(op.overloadpacket, name)
        outs = [a for a in other._schema.arguments if a.is_out]
        rest = [(a.name, str(a.type)) for a in other._schema.arguments if not a.is_out]
        if len(outs) == 1 and rest == args:
            return other
    return None


def _erase_dead(graph: fx.Graph, node: fx.Node) -> None:
    while node.op == "call_function" and not node.users and alias_kind(node) != "inplace":
        inputs = aliased_inputs(node) if alias_kind(node) == "view" else []
        graph.erase_node(node)
        if len(inputs) != 1:
            return
        node = inputs[0]
