"""A concatenation of adjacent views of one tensor is a view of that tensor: no copy.

    cat([x[a:b], x[b:c], ..., x[y:z]])              ⇒  x[a:z]        (x itself for [0, numel))
    cat([cast(x[a:b]), ..., cast(x[y:z])])          ⇒  cast(x[a:z])  (one cast, no copy-in)

Each piece is reached from ``x`` through view ops only (view, reshape, split, slice, alias),
is contiguous, and the pieces follow each other in ``x``'s elements in cat order. Bucketing
makes such cats: HSDP's all-reduce over the replicas of a bucket that follows its
reduce-scatter concatenates the views it cut from that reduce-scatter's output, so the
all-reduce reads the output itself.

Invariant: values bitwise unchanged: the replacement holds the elements the cat would have
copied, in the same order (a cast commutes with moving elements). A cat is left alone when
anything in the graph writes to ``x`` or a view of it (the view would see the write), or when
its pieces are 1-D on dim 0 of anything else.
"""
from __future__ import annotations

import math
import operator

import torch
from torch import fx

from .graph_utils import aten, call, fake_mode_of

VIEW_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
            aten.alias.default, aten.slice.Tensor, aten.split_with_sizes.default,
            aten.split.Tensor, operator.getitem}
SPLITS = {aten.split_with_sizes.default, aten.split.Tensor}
RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
            aten.alias.default}
CASTS = {torch.ops.prims.convert_element_type.default, aten._to_copy.default}


def elide_view_cats(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every such cat in ``gm`` (edited in place) by a view, or a cast of one; return
    ``gm``."""
    graph = gm.graph
    changed = False
    for node in list(graph.find_nodes(op="call_function", target=aten.cat.default)):
        run = adjacent_run(node)
        if run is None:
            continue
        root, start, end, cast = run
        fake_mode = fake_mode_of(graph, [root])
        with graph.inserting_before(node):
            out = root
            val = root.meta["val"]
            if val.dim() != 1:
                out = call(graph, aten.view.default, (out, [-1]), fake_mode=fake_mode)
            if (start, end) != (0, val.numel()):
                out = call(graph, aten.slice.Tensor, (out, 0, start, end), fake_mode=fake_mode)
            if cast is not None:
                out = call(graph, cast.target, (out, *cast.args[1:]), cast.kwargs,
                           fake_mode=fake_mode, custom=cast.meta.get("custom"))
        if "custom" in node.meta:
            out.meta.setdefault("custom", dict(node.meta["custom"]))
        node.replace_all_uses_with(out)
        _erase_dead(graph, node)
        changed = True
    if changed:
        gm.recompile()
    return gm


def adjacent_run(cat: fx.Node):
    """(x, first element, end, the cast or None) when ``cat`` concatenates adjacent views of
    x (each under the same cast, or none), else None."""
    pieces = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if dim != 0 or not pieces or not all(isinstance(p, fx.Node) for p in pieces):
        return None
    found = [_view_of(p) for p in pieces]
    if any(f is None for f in found):
        return None
    roots = {f[0] for f in found}
    casts = {None if f[3] is None else (f[3].target, f[3].args[1:], tuple(f[3].kwargs.items()))
             for f in found}
    if len(roots) != 1 or len(casts) != 1:
        return None
    root = found[0][0]
    for (_, _, end, _), (_, start, _, _) in zip(found, found[1:]):
        if end != start:
            return None
    if _written(root):
        return None
    return root, found[0][1], found[-1][2], found[0][3]


def _view_of(piece: fx.Node):
    """(x, first element, end, cast) for a 1-D ``piece`` reached from a contiguous x through
    view ops that keep it contiguous (reshapes, and slices and splits along dim 0), under at
    most one cast followed by reshapes only. Offsets come from the ops and shapes, never from
    the values' strides: a value computed before a pass rewired its inputs has stale ones."""
    val = piece.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 1:
        return None
    chain, node, cast = [], piece, None
    while True:
        if _is_cast(node) and cast is None:
            if any(n.target not in RESHAPES for n in chain):
                return None  # a slice after the cast: its offset is not the input's
            cast = node
        elif not _is_view(node):
            break
        chain.append(node)
        node = node.args[0]
    root_val = node.meta.get("val")
    if not (isinstance(root_val, torch.Tensor) and root_val.is_contiguous()):
        return None
    offset = 0
    for n in reversed(chain):
        if n is cast or n.target in RESHAPES:
            continue
        if n.target in SPLITS:
            continue  # its offset is its getitem's
        if n.target is operator.getitem:
            split = n.args[0]
            shape = split.args[0].meta["val"].shape
            step = math.prod(shape[1:])
            dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
            if dim % len(shape) != 0:
                return None
            size = split.args[1]
            sizes = size if split.target is aten.split_with_sizes.default else \
                [size] * math.ceil(shape[0] / size)
            offset += sum(sizes[:n.args[1]]) * step
        else:  # slice
            shape = n.args[0].meta["val"].shape
            step = math.prod(shape[1:])
            args = list(n.args[1:])
            dim, begin, stop, stride = args + [0, None, None, 1][len(args):]
            if dim % len(shape) != 0 or stride != 1:
                return None
            offset += slice(begin, stop).indices(shape[0])[0] * step
    return node, offset, offset + val.numel(), cast


def _is_cast(node: fx.Node) -> bool:
    """A dtype cast and nothing else (``_to_copy`` with a dtype only)."""
    if node.op != "call_function" or node.target not in CASTS:
        return False
    return node.target is not aten._to_copy.default or (
        len(node.args) == 1 and set(node.kwargs) <= {"dtype"})


def _is_view(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in VIEW_OPS:
        return False
    # getitem only of a split's outputs (other multi-output ops return fresh tensors)
    return node.target is not operator.getitem or (
        isinstance(node.args[0], fx.Node) and node.args[0].target in SPLITS)


def _written(root: fx.Node) -> bool:
    """Whether any op writes to ``root`` or to a view of it."""
    seen, todo = set(), [root]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            schema = getattr(user.target, "_schema", None)
            if schema is not None and schema.is_mutable:
                return True
            if _is_view(user):
                todo.append(user)
    return False


def _erase_dead(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and the view and cast ops that fed only it."""
    todo = [node]
    while todo:
        n = todo.pop()
        if n.users or n.op != "call_function":
            continue
        if n is not node and not _is_view(n) and n.target not in CASTS:
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        todo.extend(inputs)
