"""Small FX helpers shared by the passes: create nodes with fake-tensor metadata, move nodes
while keeping def-before-use."""
from __future__ import annotations

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_map

aten = torch.ops.aten


def fake_mode_of(graph: fx.Graph):
    vals = [n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    return detect_fake_mode(vals)


def call(graph: fx.Graph, target, args, kwargs=None, *, fake_mode=None, custom=None) -> fx.Node:
    """Insert ``target(*args)`` at the graph's current insertion point and fill meta["val"]
    by running it on the inputs' fake values (passes after us and inductor read it)."""
    kwargs = kwargs or {}
    node = graph.call_function(target, tuple(args), kwargs)

    def val(a):
        return a.meta["val"] if isinstance(a, fx.Node) else a

    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = target(*tree_map(val, tuple(args)), **tree_map(val, kwargs))
    if custom is not None:
        node.meta["custom"] = dict(custom)
    return node


def positions(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def hoist_before(node: fx.Node, anchor: fx.Node, pos: dict[fx.Node, int]) -> None:
    """Move ``node`` and any of its inputs that come after ``anchor`` to just before it.

    Only for pure nodes whose inputs can move (shard casts/pads feeding an all-gather);
    ``pos`` is the order before any move and is updated for moved nodes.
    """
    if node.op == "placeholder" or pos[node] < pos[anchor]:
        return
    for inp in node.all_input_nodes:
        hoist_before(inp, anchor, pos)
    anchor.prepend(node)
    pos[node] = pos[anchor] - 0.5  # still before anchor, after everything already before it


def is_contiguous(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return not isinstance(val, torch.Tensor) or val.is_contiguous()


def flat(graph: fx.Graph, node: fx.Node, fake_mode) -> fx.Node:
    """A 1-D view of ``node`` (cloned first if it is not contiguous)."""
    if not is_contiguous(node):
        node = call(graph, aten.clone.default, (node,), {"memory_format": torch.contiguous_format},
                    fake_mode=fake_mode)
    return call(graph, aten.view.default, (node, [-1]), fake_mode=fake_mode)


def stable_topological_sort(graph: fx.Graph) -> None:
    """Reorder so every node follows its inputs, moving as little as possible: a node that is
    not ready yet is emitted right after its last missing input."""
    emitted: set[fx.Node] = set()
    waiting: dict[fx.Node, list[fx.Node]] = {}
    order: list[fx.Node] = []

    def ready(node):
        return all(a in emitted for a in node.all_input_nodes)

    def emit(node):
        stack = [node]
        while stack:
            n = stack.pop()
            emitted.add(n)
            order.append(n)
            for dep in waiting.pop(n, []):
                if dep not in emitted and ready(dep):
                    stack.append(dep)

    for node in list(graph.nodes):
        if node in emitted:
            continue
        missing = [a for a in node.all_input_nodes if a not in emitted]
        if missing:
            for a in missing:
                waiting.setdefault(a, []).append(node)
        else:
            emit(node)
    assert len(order) == len(graph.nodes), "graph has a cycle"
    cursor = order[0]
    for node in order[1:]:
        if cursor.next is not node:
            cursor.append(node)
        cursor = node
