"""Step-graph pass: say why the next step's first all-gather is not issued in this graph.

Under the whole step in one graph (``compile_step``), the next step's first gather could in
principle start under this step's optimizer tail. This graph does not issue it, and
:func:`explain_cross_step_prefetch` writes the reason, measured on the graph, into its notes
(``ss_notes``, printed at the top of a graph dump): the first gather reads the shards of the
parameters that this graph's last reduce-scatter and their updates produce (the embedding's
gradient is the backward's last), so it could start only after those updates, with only
the ops that follow them left to hide it; and a graph waits on every collective it issued
before it returns (a functional collective is not handed to the next graph in flight), so
its wait would land in this graph's tail instead of overlapping the next forward. What it
would take: the next forward reading a buffer this graph fills, and the transfer left in
flight across the graph boundary.

Invariant: the graph itself is unchanged; only its notes gain one line (a second run adds
nothing).
"""
from __future__ import annotations

from torch import fx

from .annotations import UPDATE_KEY, add_note, annotations
from .collectives import find_collectives


def explain_cross_step_prefetch(gm: fx.GraphModule) -> fx.GraphModule:
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    gathers = [c for c in find_collectives(gm.graph) if c.kind == "all_gather" and c.ours]
    updates = [n for n in nodes if UPDATE_KEY in annotations(n)]
    if not gathers or not updates:
        return gm
    first = min(gathers, key=lambda c: pos[c.start])
    params = set(first.params)
    writes = [n for n in updates if annotations(n)[UPDATE_KEY] in params]
    if not writes:
        return gm
    last_write = max(writes, key=pos.__getitem__)
    after = [n for n in nodes[pos[last_write] + 1:]
             if n.op == "call_function" and UPDATE_KEY in annotations(n)]
    add_note(gm, f"next step's first all-gather ({len(params)} parameter(s): "
                 f"{', '.join(sorted(params)[:3])}{', ...' if len(params) > 3 else ''}) is "
                 f"not issued here: its shards are written by this graph's update at "
                 f"{last_write.name}, after which {len(after)} update op(s) are left to hide "
                 f"it, and a graph waits on its collectives before it returns "
                 f"(passes/cross_step.py)")
    return gm
