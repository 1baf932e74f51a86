"""Memory of an FX graph: liveness of its buffers in graph order (``memory_timeline``,
``peak_memory``), where views, in-place ops and ``wait_tensor`` alias their base instead of
allocating (node_meta.py decides which); ``gathered_timeline``: the part of it that is gathered
parameters, which ``memory_cap_bytes`` caps (docs/memory_cap.md).
"""
from __future__ import annotations

import operator

from torch import fx

from .annotations import OFFLOAD_KEY, annotations, gathered_param
from .collectives import find_collectives, is_collective, is_wait
from .node_meta import alias_kind, aliased_inputs, node_value, value_bytes


def _graph(g) -> fx.Graph:
    return g.graph if isinstance(g, fx.GraphModule) else g


def _liveness(graph: fx.Graph):
    """Buffers of a graph: returns (nodes, alloc, frees, size, is_input, refs), where alloc[i]
    lists the buffer keys node i allocates, frees[i] those whose last use is node i, refs[n]
    the keys node n's value lives in."""
    nodes = list(graph.nodes)
    size: dict[tuple, int] = {}              # buffer key (node name, output index) -> bytes
    is_input: dict[tuple, bool] = {}
    alloc: list[list[tuple]] = [[] for _ in nodes]
    refs: dict[fx.Node, set] = {}            # buffers a node's value lives in
    elems: dict[fx.Node, list[set]] = {}     # per-output buffers of a multi-output producer
    last: dict[tuple, int] = {}              # buffer key -> index of its last use
    for i, n in enumerate(nodes):
        src, idx = (n.args + (None, None))[:2] if n.op == "call_function" else (None, None)
        item = n.target is operator.getitem and src in elems and isinstance(idx, int) and \
            -len(elems[src]) <= idx < len(elems[src])
        if item:  # one output of a multi-output op: keeps only that output alive
            refs[n] = elems[src][idx]
        elif alias_kind(n) is not None:
            refs[n] = set().union(*(refs[a] for a in aliased_inputs(n) if a in refs))
        else:
            out = node_value(n) if n.op != "output" else None
            parts = []
            for j, t in enumerate(out if isinstance(out, list) else [out]):
                key, b = (n.name, j), value_bytes(t)
                if b:
                    size[key], last[key] = b, i
                    is_input[key] = n.op in ("placeholder", "get_attr")
                    alloc[i].append(key)
                parts.append({key} if b else set())
            refs[n] = set().union(*parts)
            if isinstance(out, list):
                elems[n] = parts
        used = [refs[n]] if item else [refs.get(a, set()) for a in n.all_input_nodes]
        if is_wait(n) and isinstance(src, fx.Node) and is_collective(src):
            used += [refs.get(a, set()) for a in src.all_input_nodes]  # read until complete
        for k in set().union(*used):
            last[k] = i

    frees: list[list[tuple]] = [[] for _ in nodes]
    for k, i in last.items():
        frees[i].append(k)
    return nodes, alloc, frees, size, is_input, refs


def memory_timeline(graph, include_inputs: bool = True) -> list[int]:
    """Bytes live while each node runs (its inputs and its fresh outputs), in graph order.

    A node's output is allocated at the node and freed after the last user of it or of any
    alias of it (views, in-place results, getitem, wait_tensor). A collective's buffer is live
    from its start until after the last user of its wait; its input is held until the wait.
    Placeholders (and get_attr constants) are inputs: live from the start until their last use,
    counted only with ``include_inputs``."""
    nodes, alloc, frees, size, is_input, _ = _liveness(_graph(graph))
    live = sum(b for k, b in size.items() if is_input[k]) if include_inputs else 0
    timeline = []
    for i in range(len(nodes)):
        live += sum(size[k] for k in alloc[i] if not is_input[k])
        timeline.append(live)
        live -= sum(size[k] for k in frees[i] if include_inputs or not is_input[k])
    return timeline


def gathered_timeline(graph) -> list[int]:
    """Bytes of gathered parameters alive while each node runs, in graph order: the buffers
    data-parallel all-gathers write, every copy made from them (a bucket's copy-outs), the
    gathered parameters a backward graph receives from forward (placeholders annotated with
    their FQN, passes/recompute.py), and under host offload the shards' copies on the compute
    device that the gathers read. Liveness as in :func:`memory_timeline`."""
    g = _graph(graph)
    nodes, alloc, frees, size, _, _ = _liveness(g)
    gathered = _gathered_nodes(g)
    keys = {k for i, n in enumerate(nodes) if n in gathered for k in alloc[i]}
    live, timeline = 0, []
    for i in range(len(nodes)):
        live += sum(size[k] for k in alloc[i] if k in keys)
        timeline.append(live)
        live -= sum(size[k] for k in frees[i] if k in keys)
    return timeline


def _gathered_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Our all-gathers, the annotated nodes computed from them, saved gathered inputs, and
    host offload's copies that gathers read."""
    out = {n for n in graph.nodes if annotations(n).get(OFFLOAD_KEY) == "to_compute"}
    for c in find_collectives(graph):
        if c.kind == "all_gather" and c.ours:
            out.update(n for n in (c.start, c.wait) if n is not None)
    for node in graph.nodes:
        if gathered_param(node) and (node.op == "placeholder" or any(
                a in out for a in node.all_input_nodes)):
            out.add(node)
    return out


def peak_memory(graph, include_inputs: bool = True) -> tuple[int, fx.Node | None]:
    """(peak bytes of memory_timeline, first node where it occurs); (0, None) for no nodes."""
    g = _graph(graph)
    timeline = memory_timeline(g, include_inputs)
    if not timeline:
        return 0, None
    i = max(range(len(timeline)), key=timeline.__getitem__)
    return timeline[i], list(g.nodes)[i]


def distinct_bytes(graph, nodes, include_inputs: bool = True) -> int:
    """Bytes of the distinct buffers the values of ``nodes`` (nodes of ``graph``) live in: a
    value and its aliases count once. What a forward graph hands to backward is such a set:
    the partitioner may save a collective's result and its ``wait_tensor`` both, one buffer.
    Without ``include_inputs``, the graph's inputs (placeholders, and views of them) are left
    out: their owner holds them whether or not backward reads them."""
    *_, size, is_input, refs = _liveness(_graph(graph))
    keys = set().union(*(refs.get(n, set()) for n in nodes))
    return sum(size[k] for k in keys if include_inputs or not is_input[k])
