"""Run each parameter's optimizer update as soon as its gradient is ready, in a step graph.

``compile_step`` (simplesharded/step/__init__.py) traces the update after the whole backward, so every
update waits for the last reduce-scatter. The update ops carry ``ss_update`` (the parameter
they update, written at trace time by simplesharded/step/optim_update.py), and
:func:`place_updates` moves each parameter's update up to right after the last node it reads
from outside it: its gradient's reduce-scatter wait and the averaging/copy-out ops that sink
with that wait (passes/reordering.py). That is where the next reduce-scatter is already in
flight, so the update overlaps it and the remaining backward.

With clipping nothing moves: every update reads the clipped gradient, which needs the
global norm, whose all-reduce waits on every gradient; such an update would cross no
collective, and an update moves only when it crosses one (elsewhere the traced order is as
good, and stays).
"""
from __future__ import annotations

from torch import fx

from .annotations import UPDATE_KEY, annotations
from .collectives import is_collective, is_wait


def _movable(node: fx.Node) -> bool:
    # In-place writes (the copy-back into an input a functionalized graph ends with) stay:
    # moving one earlier could change what a later read of that input sees.
    if node.op != "call_function" or node.is_impure():
        return False
    schema = getattr(node.target, "_schema", None)
    return not (schema is not None and schema.is_mutable)


def has_updates(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` holds an optimizer update (a step graph)."""
    return any(UPDATE_KEY in annotations(n) for n in gm.graph.nodes)


def place_updates(gm: fx.GraphModule) -> fx.GraphModule:
    """Invariant: every node annotated ``ss_update`` that a move would carry across a
    collective start or wait runs right after the last node outside its parameter's update
    that it depends on (its anchor), in its traced order; everything else keeps its order.
    Only nodes move, and only earlier, so the graph stays topologically ordered and computes
    the same values; collectives keep their order. A graph without ``ss_update`` is unchanged,
    and a second run changes nothing."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    groups: dict[object, list[fx.Node]] = {}
    for n in nodes:
        key = annotations(n).get(UPDATE_KEY)
        if key is not None and _movable(n):
            groups.setdefault(key, []).append(n)
    if not groups:
        return gm
    comm = [i for i, n in enumerate(nodes) if is_collective(n) or is_wait(n)]

    # anchor -> the nodes to emit right after it, in their current order.
    after: dict[fx.Node, list[fx.Node]] = {}
    moved: set[fx.Node] = set()
    update_of = {m: key for key, members in groups.items() for m in members}
    for key, members in groups.items():
        inside = set(members)
        # A member that only other updates read is not part of this one: tracing can make a
        # view of another parameter's gradient under this annotation (functionalization
        # regenerates a view where it is next used), and it must not hold this one back.
        core = [m for m in members
                if not m.users or any(update_of.get(u) in (None, key) for u in m.users)]
        outer = [i for m in core or members for i in m.all_input_nodes if i not in inside]
        if not outer:
            continue
        anchor = max(outer, key=pos.__getitem__)
        # A member moves only once all it reads is there; one that reads later stays, and
        # so do the members that read it.
        going: dict[fx.Node, None] = {}  # in order
        for m in members:
            if pos[m] > pos[anchor] and all(pos[i] <= pos[anchor] or i in going
                                            for i in m.all_input_nodes):
                going[m] = None
        if not going or not any(pos[anchor] < c < pos[list(going)[-1]] for c in comm):
            continue
        after.setdefault(anchor, []).extend(going)
        moved.update(going)
    if not moved:
        return gm
    for block in after.values():
        block.sort(key=pos.__getitem__)

    order: list[fx.Node] = []

    def emit(n: fx.Node) -> None:
        order.append(n)
        for m in after.pop(n, ()):
            emit(m)

    for n in nodes:
        if n not in moved:
            emit(n)
    prev = order[0]
    for n in order[1:]:
        if n.prev is not prev:
            prev.append(n)
        prev = n
    gm.recompile()
    return gm
