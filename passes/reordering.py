"""Move collectives so communication overlaps compute, under a memory cap.

* all-gather: the wait and its copy-out chain (wait_chains.py) go right before the first real
  use; the start (with the pure ops that build its input) first goes right before its wait,
  then is issued before the compute of earlier buckets (prefetch) as far back as the cap
  allows, up to PREFETCH_AHEAD buckets (the graph's start for the first ones); if not even one
  bucket ahead fits, right after the earliest release of an earlier bucket that makes it fit.
* The cap (``memory_cap_bytes``, docs/memory_cap.md) bounds the bytes of gathered parameters
  alive at every point: gathered buffers, their copy-outs and, in backward, the gathered
  parameters forward saved, each over the nodes that read it (gathered_spans.py counts them).
  Prefetch never raises that total above the cap; what the graph needs without any prefetch
  is its floor, which prefetch leaves as it is. Default cap: that floor plus the largest
  gathered buffer; a cap at or below the floor disables prefetch.
* Host offload's copies (offload_copies.py): to the device, each waited right before its
  first reader and issued right before the previous copy's wait, where the cap allows; to the
  host, each waited right before the next one (after the reductions are placed). Each runs on
  a copy stream beside the compute in between.
* reduce-scatter / all-reduce: the start right after its input is ready; the wait sinks towards
  its first use (with the ops computed from the result alone for the output, such as the 1/N
  averaging, which would otherwise pin it next to its start) but no further than the next
  reduction's start, so at most one reduction is in flight and full-size gradient buffers
  are freed a block later at most. On a process group collectives run in issue order, so a
  prefetch issued after the previous reduce-scatter hides both under the same compute
  (SimpleFSDP's backward schedule).
* Collectives that are not ours (expert parallelism's all-to-alls, TP's) never move. No wait,
  copy-out, reduction or compute that came after one's start in the graph this pass gets is
  moved ahead of it, so the compute and waits before it stay those of the traced graph.
  Only a prefetched all-gather's start is, with what moves with it (the pure ops building
  its input, a host shard's copy ``ss_offload``): it passes the starts of foreign collectives
  on other process groups, but never one on its own group nor a foreign start or wait it
  reads; where it would, it is issued right after that one instead, overlapping the
  transfer. So a foreign collective is delayed at most by the input ops of the gathers
  issued ahead of it (a shard's cast). Safe: every rank compiles the same graph with the
  same deterministic passes, so each group still sees one issue order on all its ranks, and
  on its own group no start of ours passes a foreign one; another group runs on its own
  communicator and stream (its own link's lane in simulate.py), so issuing ours before its
  collective takes nothing from it.
* The one exception, moved first: context parallelism's K/V all-gather and the reduce-scatter
  of its gradient (annotated ``ss_cp``), each issued before the compute of its layer that does
  not need it and waited right before its first use (cp_overlap.py).
"""
from __future__ import annotations

from torch import fx

from .annotations import BUCKET_KEY, annotations
from .collectives import Collective, find_collectives, is_wait, started_by
from .offload_copies import lead_device_copies, place_host_waits
from .cp_overlap import overlap_cp_collectives
from .gathered_spans import GatheredSpans
from .graph_utils import NodeOrder, ancestors, hoist_before
from .plan_protocol import Plan
from .wait_chains import first_use, gather_chain, input_ops, reduction_epilogue

# A gather is issued at most this many buckets ahead of its use. Simulated on Llama 3 8B at
# 64 ranks (h100-ib400), one bucket ahead left forward 8 % slower where blocks are small next
# to the largest buffer, and no limit made backward 4 % slower: gathers issued that early
# queue reduce-scatters behind them (and hold full-size gradients longer, which the cap does
# not count).
PREFETCH_AHEAD = 2


def reorder_for_overlap(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Reorder ``gm``'s data-parallel collectives in place (see module doc) and return it.

    ``plan.memory_cap_bytes`` caps the gathered bytes alive (module doc; None: the floor plus
    the largest gathered buffer). Guarantees: same outputs (only the order of nodes changes);
    def-before-use; every wait before its first use; prefetch never raises the gathered bytes
    alive above the cap (a graph that needs more without any prefetch keeps that floor);
    idempotent.
    """
    reorder_graph(gm.graph, plan.memory_cap_bytes)
    gm.recompile()
    return gm


def reorder_graph(graph: fx.Graph, memory_cap_bytes: int | None,
                  collectives: list[Collective] | None = None) -> None:
    """The graph edit of reorder_for_overlap; AutoPlan runs it on copies of a graph.
    ``collectives``: the graph's (find_collectives), when the caller has them."""
    # Only data-parallel collectives move: anything else (TP) keeps its place in the graph,
    # so every process group sees the same issue order on every rank, and a collective on the
    # critical path (TP's) waits for a prefetch issued ahead of it (on another group) at most
    # while the ops building the gather's input run.
    if collectives is None:
        collectives = find_collectives(graph)
    order = NodeOrder(graph)
    overlap_cp_collectives(collectives, order)
    behind = _Behind(graph, collectives, order)
    collectives = [c for c in collectives if c.wait is not None and c.ours]
    chains = _place_gather_waits(collectives, order, behind)
    prefetch = _Prefetch(graph, collectives, memory_cap_bytes, order, chains, behind)
    prefetch.run()
    lead_device_copies(graph, prefetch.ags, order, prefetch.spans, memory_cap_bytes,
                       prefetch.cap)
    _place_reductions(collectives, order, behind)
    place_host_waits(graph, order)


class _Behind:
    """What each node must stay behind (module doc), as the graph the pass got had it: the
    last foreign start before it (``floor``: for all that moves but a prefetch), the last one
    on each group (``on_group``: a prefetch passes those of other groups), and the latest
    foreign start or wait a prefetch reads (``_reads``: hoisted past that one, the start would
    drag it along)."""

    def __init__(self, graph: fx.Graph, collectives: list[Collective], order: NodeOrder):
        foreign = {c.start: c.group_name for c in collectives if not c.ours}
        self.order, self.floor, last = order, {}, None
        self.on_group: dict[fx.Node, dict[str, fx.Node]] = {}  # shared snapshots
        self.hoisted: dict[fx.Node, fx.Node] = {}  # barrier → last start issued after it
        # {node: the latest foreign node it reads, or None}: seeded with the foreign starts
        # and each of their waits (a coalesced one's every wait), filled in by _reads
        self.read: dict[fx.Node, fx.Node | None] = {}
        on_group: dict[str, fx.Node] = {}
        for node in graph.nodes if foreign else ():  # none: no node has one to stay behind
            if last is not None:
                self.floor[node] = last
                self.on_group[node] = on_group
            if node in foreign:
                last = node
                on_group = {**on_group, foreign[node]: node}
                self.read[node] = node
            elif is_wait(node) and started_by(node) in foreign:
                self.read[node] = node

    def _reads(self, start: fx.Node) -> fx.Node | None:
        """The latest foreign start or wait ``start`` reads, directly or not: a walk up its
        inputs that stops at those (what they read is earlier) and at what an earlier walk
        answered."""
        read, order, stack = self.read, self.order, [start]
        while stack:
            node = stack[-1]
            todo = [a for a in node.all_input_nodes if a not in read]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            if node not in read:
                found = [read[a] for a in node.all_input_nodes if read[a] is not None]
                read[node] = max(found, key=order.__getitem__) if found else None
        return read[start]

    def _barrier(self, c: Collective) -> fx.Node | None:
        """What ``c``'s start must stay behind: the last foreign start on its own group or
        the foreign node it reads, whichever came later."""
        same = self.on_group.get(c.start, {}).get(c.group_name)
        read = self._reads(c.start) if self.read else None
        if same is None or read is None:
            return same if read is None else read
        return max(same, read, key=self.order.__getitem__)

    def anchor(self, c: Collective, target: fx.Node) -> fx.Node:
        """``target`` (to hoist ``c``'s start right before it), or, when ``target`` is ahead
        of what the start must stay behind, the node right after that one and the starts
        already issued there (issue order = the order of these calls)."""
        f = self._barrier(c)
        if f is None or self.order[target] > self.order[f]:
            return target
        anchor = self.hoisted.get(f, f).next
        self.hoisted[f] = c.start
        return anchor

    def move_before(self, nodes: list[fx.Node], target: fx.Node) -> None:
        """Move ``nodes`` (in their order) right before ``target``; those that would so pass
        their foreign start (``floor``: of any group) go right after it instead, in their
        order."""
        after: dict[fx.Node, fx.Node] = {}  # foreign start → last node put right after it
        for node in nodes:
            f = self.floor.get(node)
            if f is not None and self.order[target] <= self.order[f]:
                self.order.move_after(node, after.get(f, f))
                after[f] = node
            else:
                self.order.move_before(node, target)


def _place_gather_waits(collectives: list[Collective], order: NodeOrder, behind: _Behind
                        ) -> dict[fx.Node, list[fx.Node]]:
    """Each all-gather's chain right before its first use; returns {start: chain}, still in
    graph order (moving a chain keeps its own order)."""
    chains = {}
    for c in collectives:
        if c.kind != "all_gather":
            continue
        chain = chains[c.start] = gather_chain(c.wait, order)
        use = first_use(chain, order)
        if use is None:
            continue
        behind.move_before(chain, use)  # keeps the chain's own order
    return chains


def _sink_to_wait(c: Collective, order: NodeOrder) -> None:
    """Start right before its wait (no prefetch), with the pure ops that only build its input:
    the baseline prefetch starts from, whatever order bucketing or tracing left."""
    for node in sorted([c.start, *input_ops(c.start)], key=order.__getitem__):
        order.move_before(node, c.wait)


class _Prefetch:
    """Issue each all-gather as early as the cap allows (module doc), reading the gathered
    bytes alive from ``spans`` (gathered_spans.py)."""

    def __init__(self, graph: fx.Graph, collectives: list[Collective], cap: int | None,
                 order: NodeOrder, chains: dict[fx.Node, list[fx.Node]], behind: _Behind):
        self.graph, self.cap, self.order, self.behind = graph, cap, order, behind
        self.ags = [c for c in collectives if c.kind == "all_gather"]
        self.chain = chains  # {start: gather_chain}: what _place_gather_waits found
        self.spans = GatheredSpans(graph, self.ags, order, chains)

    def _cone(self) -> set[fx.Node]:
        """What the all-gather starts read, directly or not: all that hoisting moves."""
        return ancestors(c.start for c in self.ags)

    def run(self) -> None:
        order = self.order
        for c in self.ags:
            _sink_to_wait(c, order)
        self.spans.freeze(self._cone())
        if self.cap is None:
            self.cap = self.spans.peak() + max((self.spans.nbytes(c) for c in self.ags), default=0)
        use_of = {c.start: first_use(self.chain[c.start], order) for c in self.ags}
        ags = [c for c in self.ags if use_of[c.start] is not None]
        ags.sort(key=lambda c: order[use_of[c.start]])
        for j, c in enumerate(ags):
            target = None
            # Before the earlier bucket's wait (its chain sits right before its first use), so
            # a second run finds every start already in place; then the start of the graph, so
            # the first gather of a graph that begins with compute (a backward whose first
            # blocks stay gathered) is issued at once, ahead of that compute's reduce-scatters.
            # Before the waits of at most PREFETCH_AHEAD earlier buckets (a bucket of two
            # dtypes is two gathers), then the graph's start if none is left.
            candidates, own, passed = [], _bucket(c), []
            for k in range(j - 1, -1, -1):
                other = _bucket(ags[k])
                if other != own and other not in passed:
                    if len(passed) == PREFETCH_AHEAD:
                        break
                    passed.append(other)
                candidates.append(ags[k].wait)
            else:
                candidates.append(self.graph_start(c, ags[j - 1].start if j else None))
            for candidate in candidates:  # one bucket earlier at a time
                if candidate is None or not self.fits(c, candidate):
                    break
                target = candidate
            if target is None:  # not even one bucket ahead: as early as memory frees up
                target = self.after_release(ags, j, c)
            if target is not None:  # issued later than checked: still fits
                target = self.behind.anchor(c, target)
            if target is not None and order[c.start] > order[target]:
                hoist_before(c.start, target, order)
                self.spans.moved(c.start)

    def graph_start(self, c: Collective, previous: fx.Node | None) -> fx.Node | None:
        """The first node that is neither a placeholder nor something ``c``'s start depends
        on, and comes after ``previous`` (the gather used before ``c``: issue order = use
        order)."""
        cone, stack = set(), [c.start]
        while stack:
            node = stack.pop()
            if node not in cone:
                cone.add(node)
                stack.extend(node.all_input_nodes)
        node = previous.next if previous is not None else next(iter(self.graph.nodes), None)
        while node is not None and node.op != "root":
            if node.op != "placeholder" and node not in cone:
                return node
            node = node.next
        return None

    def after_release(self, ags, j, c) -> fx.Node | None:
        """The earliest node right after an earlier bucket's last use (where gathered bytes in
        flight drop) at which issuing ``c`` fits the cap, if it is before ``c``'s start."""
        order = self.order
        for last in sorted({self.spans.last_use(a) for a in ags[:j]}, key=order.__getitem__):
            after = last.next
            if after.op == "root" or order[after] >= order[c.start]:
                break
            if self.fits(c, after):
                return after
        return None

    def fits(self, c, candidate) -> bool:
        """Would issuing ``c`` right before ``candidate`` keep gathered bytes alive ≤ cap?"""
        lo, hi = self.order[candidate], self.order[self.spans.last_use(c)]
        return self.spans.nbytes(c) + self.spans.peak(lo, hi, skip=c) <= self.cap


def _bucket(c: Collective):
    """What a gather is one part of: its bucket (a bucket of two dtypes is two gathers)."""
    return annotations(c.start).get(BUCKET_KEY) or c.start


def _place_reductions(collectives: list[Collective], order: NodeOrder, behind: _Behind) -> None:
    reds = [c for c in collectives if c.kind != "all_gather"]
    # Issued as soon as the input exists, but behind every foreign start it came after, of
    # any group: the previous reduction's wait cannot pass that start, so a start issued
    # ahead of it would have two reductions in flight.
    for c in reds:
        last_input = max(c.start.all_input_nodes, key=order.__getitem__)
        if last_input.next is not c.start:
            behind.move_before([c.start], last_input.next)
    reds.sort(key=lambda c: order[c.start])
    for i, c in enumerate(reds):
        chain = reduction_epilogue(gather_chain(c.wait, order), order)
        use = first_use(chain, order)
        if use is None:
            continue
        dest = use
        if i + 1 < len(reds) and order[reds[i + 1].start] < order[dest]:
            dest = reds[i + 1].start
        behind.move_before(chain, dest)
