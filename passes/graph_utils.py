"""Small FX helpers shared by the passes: create nodes with fake-tensor (or meta) metadata,
move nodes while keeping def-before-use, and node positions that stay exact while nodes move
(``NodeOrder``)."""
from __future__ import annotations

import contextlib
import copy
from fractions import Fraction

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch._subclasses import FakeTensor

aten = torch.ops.aten


def fake_mode_of(graph: fx.Graph, nodes=None):
    """The mode :func:`call` computes new nodes' values in: the graph's FakeTensorMode; a null
    context when its values are meta tensors (computed on them directly); else None.
    ``nodes``: the nodes a pass computes its new values from, when it knows them (looking at
    these few instead of the whole graph)."""
    nodes = graph.nodes if nodes is None else nodes
    vals = [n.meta["val"] for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    # Before detect_fake_mode, which inside a compile answers the compile's mode whatever the
    # values are.
    if vals and all(v.device.type == "meta" and not isinstance(v, FakeTensor) for v in vals):
        return contextlib.nullcontext()
    return detect_fake_mode(vals)


def call(graph: fx.Graph, target, args, kwargs=None, *, fake_mode=None, custom=None) -> fx.Node:
    """Insert ``target(*args)`` at the graph's current insertion point and fill meta["val"]
    by running it on the inputs' fake values (passes after us and inductor read it)."""
    node = graph.call_function(target, tuple(args), kwargs or {})
    if fake_mode is not None:
        # fx's own map_arg, not pytree: this runs for every node a pass creates
        vals, kwvals = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        with fake_mode:
            node.meta["val"] = target(*vals, **kwvals)
    if custom is not None:
        node.meta["custom"] = dict(custom)
    return node


class NodeOrder:
    """Where each node of a graph stands, kept exact while nodes move or are inserted, so a
    pass compares positions in O(1) without renumbering the graph after every edit (which made
    reordering quadratic in graph size).

    Nodes start ``_GAP`` apart. A moved or inserted node is numbered when first looked up,
    with the run of unnumbered nodes around it spread evenly between its numbered neighbours;
    a gap with no integer left takes fractions. A number once given never changes, so
    positions read before an edit stay comparable after it. Move nodes with
    :meth:`move_before` / :meth:`move_after`."""

    _GAP = 1 << 32

    def __init__(self, graph: fx.Graph):
        self._pos: dict[fx.Node, int | Fraction] = {
            n: (i + 1) * self._GAP for i, n in enumerate(graph.nodes)}

    def __getitem__(self, node: fx.Node) -> int | Fraction:
        if node not in self._pos:
            self._place(node)
        return self._pos[node]

    def move_before(self, node: fx.Node, anchor: fx.Node) -> None:
        anchor.prepend(node)
        self._pos.pop(node, None)

    def move_after(self, node: fx.Node, anchor: fx.Node) -> None:
        anchor.append(node)
        self._pos.pop(node, None)

    def _place(self, node: fx.Node) -> None:
        first, last = node, node
        while first.prev.op != "root" and first.prev not in self._pos:
            first = first.prev
        while last.next.op != "root" and last.next not in self._pos:
            last = last.next
        run = [first]
        while run[-1] is not last:
            run.append(run[-1].next)
        lo = self._pos[first.prev] if first.prev.op != "root" else 0
        hi = self._pos[last.next] if last.next.op != "root" else lo + (len(run) + 1) * self._GAP
        if hi - lo >= len(run) + 1:  # room for a step of at least 1
            for k, n in enumerate(run, 1):
                self._pos[n] = lo + (hi - lo) * k // (len(run) + 1)
        else:
            step = Fraction(hi - lo, len(run) + 1)
            for k, n in enumerate(run, 1):
                self._pos[n] = lo + k * step


def hoist_before(node: fx.Node, anchor: fx.Node, order: NodeOrder) -> None:
    """Move ``node`` and those of its inputs, direct or not, that stand at or after ``anchor``
    to just before it, in their order; when ``anchor`` is one of them, it stays and they go
    right after it (a node cannot be hoisted above what it reads).

    Only for pure nodes whose inputs can move (shard casts/pads feeding an all-gather)."""
    cone, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in cone and n.op != "placeholder" and order[n] >= order[anchor]:
            cone.add(n)
            stack.extend(n.all_input_nodes)
    moved = sorted(cone, key=order.__getitem__)
    if moved and moved[0] is anchor:
        for prev, n in zip(moved, moved[1:]):
            order.move_after(n, prev)
    else:
        for n in moved:
            order.move_before(n, anchor)


def forget_erased(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Let ``graph`` drop ``nodes``, erased from it. An fx graph keeps every node it ever named (its
    namespace maps node -> name) until the graph itself goes, so the nodes a pass creates and
    erases again stay alive, as cyclic garbage; AutoPlan's trials create and erase thousands
    per candidate on their working copy. Forgotten, an erased node is freed at once. The
    one place that reads fx's namespace (docs/torch_internals.md); without one (another
    torch) nothing is dropped."""
    names = getattr(getattr(graph, "_graph_namespace", None), "_obj_to_name", None)
    if isinstance(names, dict):
        for node in nodes:
            names.pop(node, None)


@contextlib.contextmanager
def names_kept(graph: fx.Graph):
    """The names ``graph`` gives new nodes after this are those it would have given before:
    nodes created inside and erased again (and dropped with :func:`forget_erased`) leave no
    trace in its namespace. Reads fx's namespace (docs/torch_internals.md), like
    forget_erased; without one (another torch), names may differ, values never."""
    ns = getattr(graph, "_graph_namespace", None)
    used, counts = getattr(ns, "_used_names", None), getattr(ns, "_base_count", None)
    if not (isinstance(used, set) and isinstance(counts, dict)):
        yield
        return
    used, counts = set(used), copy.copy(counts)
    try:
        yield
    finally:
        ns._used_names, ns._base_count = used, counts


def edits_observed(graph: fx.Graph) -> bool:
    """Whether ``graph``'s module has hooks told of every node created, erased or replaced
    (inductor's provenance tracking installs some), or a namespace :func:`names_kept` cannot
    restore: then temporary edits must go to a copy of the graph."""
    module = graph.owning_module
    ns = getattr(graph, "_graph_namespace", None)
    return (any(getattr(module, hooks, None) for hooks in
                ("_create_node_hooks", "_erase_node_hooks", "_replace_hooks"))
            or not isinstance(getattr(ns, "_used_names", None), set)
            or not isinstance(getattr(ns, "_base_count", None), dict))


def ancestors(nodes) -> set[fx.Node]:
    """What ``nodes`` read, directly or not (not themselves, unless one reads another)."""
    seen, stack = set(), list(nodes)
    while stack:
        for n in stack.pop().all_input_nodes:
            if n not in seen:
                seen.add(n)
                stack.append(n)
    return seen


def draws_random(node: fx.Node) -> bool:
    """An op that may draw random numbers (dropout, CPU attention's dropout path): running it
    again, or elsewhere, would draw other numbers."""
    return (isinstance(node.target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in node.target.tags)


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
