"""The nodes of a graph whose tensors have this rank's own shard size.

With uneven shards (a 7-row weight over 2 ranks: 4 rows and 3), the few ops that touch a
rank's own chunk differ in size from rank to rank: the cast and padding before a data-parallel
all-gather, and the unpadding and cast after a data-parallel reduce-scatter. Everything else
works on padded or full-size tensors, identical on every rank. A planner that must reach the
same decision on every rank without talking to the others (docs/rank_agreement.md) leaves
these nodes out of its costs.
"""
from __future__ import annotations

from torch import fx

from .annotations import BUCKET_KEY
from .collectives import find_collectives, is_collective, is_wait


def rank_local_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes on the path from the graph's inputs to our all-gathers (the shard's cast and
    padding), and on the path from our reduce-scatters to the graph's outputs (unpadding,
    cast), that serve nothing else. Bucketing's own nodes (BUCKET_KEY: the copy into a
    bucket, its split) work on padded tensors and stay costed.

    The rule is structural and holds on every rank even though the graphs differ (only a rank
    whose chunk is short has a padding node): whatever a rank has on these paths is left out.
    Invariant: no node in the set feeds anything but these paths."""
    ours = [c for c in find_collectives(graph) if c.ours]
    starts = {c.start for c in ours if c.kind == "all_gather"}
    waits = {c.wait for c in ours if c.kind == "reduce_scatter" and c.wait is not None}
    nodes = list(graph.nodes)

    def bucketing(n: fx.Node) -> bool:
        return BUCKET_KEY in (n.meta.get("custom") or {})

    def plain(n: fx.Node) -> bool:
        return (n.op == "call_function" and not is_collective(n) and not is_wait(n)
                and not bucketing(n))

    feeds: set[fx.Node] = set()  # serves only gathers (directly or through a bucket's copy)
    for n in reversed(nodes):
        if plain(n) and n.users and all(u in feeds or u in starts or bucketing(u)
                                        for u in n.users):
            feeds.add(n)
    before: set[fx.Node] = set()  # ... and reads only the graph's inputs
    for n in nodes:
        if n in feeds and all(a.op in ("placeholder", "get_attr") or a in before
                              for a in n.all_input_nodes):
            before.add(n)
    reached: set[fx.Node] = set(waits)  # downstream of a reduction
    for n in nodes:
        if any(a in reached for a in n.all_input_nodes):
            reached.add(n)
    tail: set[fx.Node] = set()  # ... serving only the outputs
    for n in reversed(nodes):
        if n in reached and n.users and all(u.op == "output" or u in tail for u in n.users):
            tail.add(n)
    after = {n for n in tail if plain(n)}
    return before | after
