"""Move collectives so communication overlaps compute, under a memory cap.

* all-gather: the wait and its copy-out chain go right before the first real use; the start
  (with the pure ops that build its input) first goes right before its wait, then is issued
  before the compute of earlier buckets (prefetch) as far back as the cap allows (the graph's
  start included; if not even one bucket ahead fits, right after the earliest release of an
  earlier bucket that makes it fit): at every point, the bytes of gathered buffers that
  are issued and not yet released (last use) stay ≤ ``memory_cap_bytes``. Default cap: two of
  the largest gathered buffers (current + prefetched, as YaFSDP); a cap of one buffer disables
  prefetch.
* reduce-scatter / all-reduce: the start right after its input is ready; the wait sinks towards
  its first use but no further than the next reduction's start, so at most one reduction is in
  flight and full-size gradient buffers are freed a block later at most. On a process group
  collectives run in issue order, so a prefetch issued after the previous reduce-scatter hides
  both under the same compute (SimpleFSDP's backward schedule).
"""
from __future__ import annotations

from torch import fx

from .collectives import Collective, find_collectives, is_collective, is_wait
from .graph_utils import NodeOrder, hoist_before
from .plan_protocol import Plan

# Ops that only reshape/copy a gathered buffer into parameter form: they travel with the wait.
_CHAIN_OPS = {"view", "_unsafe_view", "slice", "clone", "alias", "reshape", "t", "permute",
              "transpose", "expand", "as_strided", "contiguous", "getitem"}


def _op_name(node: fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", None)
    if name is None:
        name = str(target)
    return name.split(".")[0]


def gather_chain(wait: fx.Node, order: NodeOrder) -> list[fx.Node]:
    """The wait plus the copy-out/view nodes that only depend on it, in graph order."""
    chain, frontier = [wait], [wait]
    members = {wait}
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if (user.op == "call_function" and _op_name(user) in _CHAIN_OPS
                    and user not in members
                    and all(a in members for a in user.all_input_nodes)):
                members.add(user)
                chain.append(user)
                frontier.append(user)
    return sorted(chain, key=order.__getitem__)


def _chain_uses(chain: list[fx.Node]) -> list[fx.Node]:
    """Nodes outside the chain that read it."""
    members = set(chain)
    return [u for n in chain for u in n.users if u not in members]


def _first_use(chain: list[fx.Node], order: NodeOrder) -> fx.Node | None:
    return min(_chain_uses(chain), key=order.__getitem__, default=None)


def is_collective_or_wait(node: fx.Node) -> bool:
    return is_collective(node) or is_wait(node)


def default_cap(collectives: list[Collective]) -> int:
    sizes = [c.nbytes for c in collectives if c.kind == "all_gather"]
    return 2 * max(sizes) if sizes else 0


def reorder_for_overlap(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Reorder ``gm``'s data-parallel collectives in place (see module doc) and return it.

    ``plan.memory_cap_bytes`` caps gathered bytes in flight (None: two of the largest
    gathered buffers). Guarantees: same outputs (only the order of nodes changes);
    def-before-use; every wait before its first use; prefetch never raises the gathered bytes
    in flight above the cap (a graph whose buckets need more at once without any prefetch
    keeps that floor); idempotent.
    """
    reorder_graph(gm.graph, plan.memory_cap_bytes)
    gm.graph.lint()
    gm.recompile()
    return gm


def reorder_graph(graph: fx.Graph, memory_cap_bytes: int | None,
                  collectives: list[Collective] | None = None) -> None:
    """The graph edit of reorder_for_overlap; AutoPlan runs it on copies of a graph.
    ``collectives``: the graph's (find_collectives), when the caller has them."""
    # Only data-parallel collectives move: anything else (TP) keeps its place in the graph,
    # so every process group sees the same issue order on every rank, and a collective on the
    # critical path (TP's) is never pushed behind a prefetch.
    if collectives is None:
        collectives = find_collectives(graph)
    collectives = [c for c in collectives if c.wait is not None and c.ours]
    cap = memory_cap_bytes or default_cap(collectives)
    order = NodeOrder(graph)
    _place_gather_waits(collectives, order)
    _Prefetch(graph, collectives, cap, order).run()
    _place_reductions(collectives, order)


def _place_gather_waits(collectives: list[Collective], order: NodeOrder) -> None:
    for c in collectives:
        if c.kind != "all_gather":
            continue
        chain = gather_chain(c.wait, order)
        use = _first_use(chain, order)
        if use is None:
            continue
        for node in chain:  # keeps the chain's own order
            order.move_before(node, use)


def _sink_to_wait(c: Collective, order: NodeOrder) -> None:
    """Start right before its wait (no prefetch), with the pure ops that only build its input:
    the baseline prefetch starts from, whatever order bucketing or tracing left."""
    moved, members = [c.start], {c.start}
    frontier = list(c.start.all_input_nodes)
    while frontier:
        node = frontier.pop()
        if (node.op == "call_function" and len(node.users) == 1
                and next(iter(node.users)) in members and not is_collective_or_wait(node)):
            moved.append(node)
            members.add(node)
            frontier.extend(node.all_input_nodes)
    for node in sorted(moved, key=order.__getitem__):
        order.move_before(node, c.wait)


class _Prefetch:
    """Issue each all-gather as early as the cap allows (module doc). The chains and their
    users are found once: moving starts changes neither."""

    def __init__(self, graph: fx.Graph, collectives: list[Collective], cap: int,
                 order: NodeOrder):
        self.graph, self.cap, self.order = graph, cap, order
        self.ags = [c for c in collectives if c.kind == "all_gather"]
        self.chain = {c.start: gather_chain(c.wait, order) for c in self.ags}
        # The output node is not a use: a gathered parameter saved for backward
        # (reshard_after_forward=False) is saved state from then on, not a buffer in flight.
        self.uses = {s: [u for u in _chain_uses(chain) if u.op != "output"]
                     for s, chain in self.chain.items()}
        self.last: dict[fx.Node, fx.Node] | None = None  # see _fixed_last_uses

    def last_use(self, c: Collective) -> fx.Node:
        """Last compute use of a gathered buffer (its chain's last node if none)."""
        if self.last is not None:
            return self.last[c.start]
        return max(self.uses[c.start] or self.chain[c.start], key=self.order.__getitem__)

    def _fixed_last_uses(self) -> dict[fx.Node, fx.Node] | None:
        """Every buffer's last use, found once, if no chain node or use can move while
        prefetching: run() moves only all-gather starts and what they read (the sinking and
        the hoisting), so unless a use feeds a gather, the last uses stay where they are.
        (Finding them afresh at every fit test made prefetch quadratic in the gathers.)"""
        cone, stack = set(), [c.start for c in self.ags]
        while stack:
            for node in stack.pop().all_input_nodes:
                if node not in cone:
                    cone.add(node)
                    stack.append(node)
        if any(n in cone for c in self.ags for n in self.uses[c.start] or self.chain[c.start]):
            return None
        return {c.start: self.last_use(c) for c in self.ags}

    def run(self) -> None:
        order = self.order
        for c in self.ags:
            _sink_to_wait(c, order)
        self.last = self._fixed_last_uses()
        use_of = {c.start: _first_use(self.chain[c.start], order) for c in self.ags}
        ags = [c for c in self.ags if use_of[c.start] is not None]
        ags.sort(key=lambda c: order[use_of[c.start]])
        for j, c in enumerate(ags):
            target = None
            # Before the earlier bucket's wait (its chain sits right before its first use), so
            # a second run finds every start already in place; then the start of the graph, so
            # the first gather of a graph that begins with compute (a backward whose first
            # blocks stay gathered) is issued at once, ahead of that compute's reduce-scatters.
            candidates = [ags[k].wait for k in range(j - 1, -1, -1)] + [
                self.graph_start(c, ags[j - 1].start if j else None)]
            for candidate in candidates:  # one bucket earlier at a time
                if candidate is None or not self.fits(ags, c, candidate):
                    break
                target = candidate
            if target is None:  # not even one bucket ahead: as early as memory frees up
                target = self.after_release(ags, j, c)
            if target is not None and order[c.start] > order[target]:
                hoist_before(c.start, target, order)

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
        for last in sorted({self.last_use(a) for a in ags[:j]}, key=order.__getitem__):
            after = last.next
            if after.op == "root" or order[after] >= order[c.start]:
                break
            if self.fits(ags, c, after):
                return after
        return None

    def fits(self, ags, c, candidate) -> bool:
        """Would issuing ``c`` right before ``candidate`` keep gathered bytes in flight ≤ cap?"""
        order = self.order
        lo = order[candidate]
        hi = order[self.last_use(c)]
        events = []
        for other in ags:
            if other is c:
                continue
            start = order[other.start]
            end = order[self.last_use(other)]
            if start <= hi and end >= lo:
                # (position, released after the node at that position, bytes)
                events.append((max(start, lo), 0, other.nbytes))
                events.append((min(end, hi), 1, -other.nbytes))
        alive, peak = c.nbytes, c.nbytes
        for *_, delta in sorted(events):
            alive += delta
            peak = max(peak, alive)
        return peak <= self.cap


def _place_reductions(collectives: list[Collective], order: NodeOrder) -> None:
    reds = [c for c in collectives if c.kind != "all_gather"]
    for c in reds:  # issue as soon as the input exists
        last_input = max(c.start.all_input_nodes, key=order.__getitem__)
        if last_input.next is not c.start:
            order.move_after(c.start, last_input)
    reds.sort(key=lambda c: order[c.start])
    for i, c in enumerate(reds):
        chain = gather_chain(c.wait, order)
        use = _first_use(chain, order)
        if use is None:
            continue
        dest = use
        if i + 1 < len(reds) and order[reds[i + 1].start] < order[dest]:
            dest = reds[i + 1].start
        for node in chain:
            order.move_before(node, dest)
