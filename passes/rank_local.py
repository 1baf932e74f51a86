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
from .collectives import Collective, find_collectives, is_collective, is_wait


def rank_local_nodes(graph: fx.Graph, collectives: list[Collective] | None = None
                     ) -> set[fx.Node]:
    """Nodes on the path from the graph's inputs to our all-gathers (the shard's cast and
    padding), and on the path from our reduce-scatters to the graph's outputs (unpadding,
    cast), that serve nothing else. Bucketing's own nodes (BUCKET_KEY: the copy into a
    bucket, its split) work on padded tensors and stay costed. ``collectives``: the graph's
    (find_collectives), when the caller has them.

    The rule is structural and holds on every rank even though the graphs differ (only a rank
    whose chunk is short has a padding node): whatever a rank has on these paths is left out.
    Invariant: no node in the set feeds anything but these paths.

    Each set is grown from its seeds (the gathers' and bucket copies' inputs, the
    reductions' waits) rather than by sweeping the graph, so the cost follows these short
    paths, not the graph's size (AutoPlan runs this once per candidate)."""
    if collectives is None:
        collectives = find_collectives(graph)
    ours = [c for c in collectives if c.ours]
    starts = {c.start for c in ours if c.kind == "all_gather"}
    waits = [c.wait for c in ours if c.kind == "reduce_scatter" and c.wait is not None]

    def bucketing(n: fx.Node) -> bool:
        return BUCKET_KEY in (n.meta.get("custom") or {})

    def plain(n: fx.Node) -> bool:
        return (n.op == "call_function" and not is_collective(n) and not is_wait(n)
                and not bucketing(n))

    # feeds: plain, with users, each of them a gather, a bucket's copy or in feeds (serves
    # only gathers, directly or through a bucket's copy). A node is (re)examined whenever one
    # of its users joins, so the set is the same as a sweep from the outputs would find.
    feeds: set[fx.Node] = set()
    stack = [a for n in graph.nodes if n in starts or BUCKET_KEY in (n.meta.get("custom") or ())
             for a in n.all_input_nodes]
    while stack:
        n = stack.pop()
        if n not in feeds and plain(n) and n.users and all(
                u in feeds or u in starts or bucketing(u) for u in n.users):
            feeds.add(n)
            stack.extend(n.all_input_nodes)

    # before: in feeds, reading only the graph's inputs (or nodes of before)
    def from_inputs(n: fx.Node) -> bool:
        return all(a.op in ("placeholder", "get_attr") or a in before for a in n.all_input_nodes)

    before: set[fx.Node] = set()
    stack = [n for n in feeds if from_inputs(n)]
    while stack:
        n = stack.pop()
        if n not in before and from_inputs(n):
            before.add(n)
            stack.extend(u for u in n.users if u in feeds)

    reached: set[fx.Node] = set()  # downstream of a reduction
    stack = list(waits)
    while stack:
        n = stack.pop()
        if n not in reached:
            reached.add(n)
            stack.extend(n.users)

    # tail: reached, with users, each of them the output or in tail (serves only outputs)
    tail: set[fx.Node] = set()
    stack = [n for n in reached if any(u.op == "output" for u in n.users)]
    while stack:
        n = stack.pop()
        if n not in tail and n.users and all(u.op == "output" or u in tail for u in n.users):
            tail.add(n)
            stack.extend(a for a in n.all_input_nodes if a in reached)
    after = {n for n in tail if plain(n)}
    return before | after
