"""Place host offload's copies so they run beside compute, on the device's copy streams.

Under host offload (simplesharded/storage/offload.py) both copies are asynchronous, as
collectives are, and each has a ``wait_tensor`` in the graph:

* to the device (``params``): each bucket's shard is read through a ``to_compute`` copy, and
  its wait, after which the compute stream reads the copy (the all-gather's input ops, or on
  one rank the compute itself). Traced, and after prefetch (reordering.py hoists both with
  their gather's start), the copy stands right before its wait, and the compute stream would
  wait there for the whole copy. Here each wait goes right before the first op that reads
  it, and, in the order of those waits, each copy right before the previous copy's wait: the
  host link carries copy k while the compute stream runs what lies between waits k-1 and k
  (bucket k-1's compute, or the compute prefetch put between two gathers); the first copy
  stays where it is.
* to the host (both offloads): each reduced gradient's ``to_host`` copy, and the wait of the
  gradient it copies, which blocks the host until the copy has landed and, reading the
  gradient, keeps its memory from being freed or reused before. Traced, the wait follows the
  copy at once (the host would wait for each copy in turn, the compute stream idle). Here each
  wait goes right before the next ``to_host`` copy, the last right before the graph's output:
  a copy runs beside the compute of the next bucket's gradients, and one reduced gradient
  more stays alive on the device meanwhile (the reordering pass leaves these waits out of
  what pins a reduction's wait: wait_chains.reduction_epilogue).

Memory of the copies to the device: a copy moved so is alive from its new place instead of
from its wait. It moves only where the bytes alive over the longer span stay within the cap:
the gathered bytes (gathered_spans.py, which counts a gather's copy with the gather, from the
gather's start), the copies no gather reads (on one rank) over their own spans, and the copies
already moved, over the part gathered_spans does not count. The cap is the plan's
(docs/memory_cap.md); without one, prefetch's default plus the largest copy: one copy issued
ahead beside the gathers prefetch issued within its own (on one rank, with no gather, the
copies' floor plus the largest copy).

Invariant: only offload copies and their waits move; a copy to the device only earlier, after
everything it reads (``hoist_before`` brings the view of the host shard it reads along), a
wait only later than its copy and before every op that reads it. Idempotent. The copies are
no collectives: moving them changes no process group's issue order.
"""
from __future__ import annotations

from torch import fx

from .annotations import OFFLOAD_KEY, annotations
from .collectives import Collective, is_wait, started_by
from .gathered_spans import GatheredSpans, held_until, peak_of
from .graph_utils import NodeOrder, hoist_before
from .node_meta import node_bytes
from .wait_chains import offload_copy


def place_host_waits(graph: fx.Graph, order: NodeOrder) -> None:
    """Each wait of a copy to the host right before the next such copy, the last right
    before the output (or before a reader of the wait's result, if one comes first): after
    the reductions are placed (module doc)."""
    waits = {w.args[0]: w for w in graph.nodes
             if is_wait(w) and annotations(w).get(OFFLOAD_KEY) == "to_host"}
    # the copies: what else reads a waited gradient under the copy's annotation
    copies = sorted((u for x, w in waits.items() for u in x.users
                     if u is not w and annotations(u).get(OFFLOAD_KEY) == "to_host"),
                    key=order.__getitem__)
    output = next(iter(graph.find_nodes(op="output")))
    for copy, after in zip(copies, [*copies[1:], output]):
        wait = waits[copy.args[0]]
        dest = min([after, *wait.users], key=order.__getitem__)
        if wait.next is not dest:
            order.move_before(wait, dest)


def lead_device_copies(graph: fx.Graph, ags: list[Collective], order: NodeOrder,
                       spans: GatheredSpans, cap: int | None, gathers_cap: int) -> None:
    """Each copy to the device waited right before its first reader and issued right before
    the previous one's wait, within the cap: after prefetch (module doc). ``ags``: the graph's
    all-gathers, whose bytes ``spans`` counts as prefetch left them; ``cap``: the plan's, or
    None; ``gathers_cap``: the cap prefetch kept to."""
    pairs = [(started_by(n), n) for n in graph.nodes
             if is_wait(n) and annotations(started_by(n)).get(OFFLOAD_KEY) == "to_compute"]
    if not pairs:
        return
    for _, wait in pairs:
        use = min(wait.users, key=order.__getitem__)
        if wait.next is not use:
            order.move_before(wait, use)
    read_by = {}  # copy -> the gather start it feeds
    for c in ags:
        found = offload_copy(c.start)
        if found is not None:
            read_by[found[0]] = c.start
    # a copy no gather reads is alive to its last reader, which nothing here moves
    last_read = {c: held_until(w, order) for c, w in pairs if c not in read_by}

    def extra(skip=None):
        """(first, last, bytes) of the copies' bytes gathered_spans does not count."""
        for copy, _ in pairs:
            end = read_by.get(copy)
            if copy is skip:
                continue
            if end is None:
                yield order[copy], order[last_read[copy]], node_bytes(copy)
            elif order[copy] < order[end.prev]:  # gathered_spans counts it from the gather on
                yield order[copy], order[end.prev], node_bytes(copy)

    if cap is None:  # prefetch's, the floor of the copies no gather reads, one copy more
        alone = [(order[c], order[end], node_bytes(c)) for c, end in last_read.items()]
        cap = gathers_cap + peak_of(alone) + max(node_bytes(c) for c, _ in pairs)
    pairs.sort(key=lambda pair: order[pair[1]])
    for (_, ahead), (copy, wait) in zip(pairs, pairs[1:]):
        if order[copy] < order[ahead]:
            continue
        alive = peak_of((*spans.spans(), *extra(skip=copy)), order[ahead], order[wait])
        if alive + node_bytes(copy) <= cap:
            hoist_before(copy, ahead, order)

