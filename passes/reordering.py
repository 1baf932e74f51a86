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
from .graph_utils import hoist_before, positions
from .plan_protocol import Plan

# Ops that only reshape/copy a gathered buffer into parameter form: they travel with the wait.
_CHAIN_OPS = {"view", "_unsafe_view", "slice", "clone", "alias", "reshape", "t", "permute",
              "transpose", "expand", "as_strided", "contiguous", "getitem"}


def _op_name(node: fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def gather_chain(wait: fx.Node) -> list[fx.Node]:
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
    pos = positions(wait.graph)
    return sorted(chain, key=pos.__getitem__)


def _first_use(chain: list[fx.Node], pos) -> fx.Node | None:
    members = set(chain)
    users = [u for n in chain for u in n.users if u not in members]
    return min(users, key=pos.__getitem__) if users else None


def _last_use(chain: list[fx.Node], pos) -> int:
    """Last compute use of a gathered buffer. The output node does not count: a gathered
    parameter saved for backward (reshard_after_forward=False) is saved state from then on,
    not a prefetch buffer in flight."""
    members = set(chain)
    users = [pos[u] for n in chain for u in n.users if u not in members and u.op != "output"]
    return max(users) if users else pos[chain[-1]]


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


def reorder_graph(graph: fx.Graph, memory_cap_bytes: int | None) -> None:
    """The graph edit of reorder_for_overlap; AutoPlan runs it on copies of a graph."""
    # Only data-parallel collectives move: anything else (TP) keeps its place in the graph,
    # so every process group sees the same issue order on every rank, and a collective on the
    # critical path (TP's) is never pushed behind a prefetch.
    collectives = [c for c in find_collectives(graph) if c.wait is not None and c.ours]
    cap = memory_cap_bytes or default_cap(collectives)
    _place_gather_waits(graph, collectives)
    _prefetch_gathers(graph, collectives, cap)
    _place_reductions(graph, collectives)


def _place_gather_waits(graph: fx.Graph, collectives: list[Collective]) -> None:
    for c in collectives:
        if c.kind != "all_gather":
            continue
        pos = positions(graph)
        chain = gather_chain(c.wait)
        use = _first_use(chain, pos)
        if use is None:
            continue
        for node in chain:  # keeps the chain's own order
            use.prepend(node)


def _sink_to_wait(c: Collective) -> None:
    """Start right before its wait (no prefetch), with the pure ops that only build its input:
    the baseline prefetch starts from, whatever order bucketing or tracing left."""
    moved = [c.start]
    frontier = list(c.start.all_input_nodes)
    while frontier:
        node = frontier.pop()
        if (node.op == "call_function" and len(node.users) == 1
                and next(iter(node.users)) in moved and not is_collective_or_wait(node)):
            moved.append(node)
            frontier.extend(node.all_input_nodes)
    pos = positions(c.start.graph)
    for node in sorted(moved, key=pos.__getitem__):
        c.wait.prepend(node)


def _prefetch_gathers(graph: fx.Graph, collectives: list[Collective], cap: int) -> None:
    ags = [c for c in collectives if c.kind == "all_gather"]
    for c in ags:
        _sink_to_wait(c)
    pos = positions(graph)
    use_of = {c.start: _first_use(gather_chain(c.wait), pos) for c in ags}
    ags = [c for c in ags if use_of[c.start] is not None]
    ags.sort(key=lambda c: pos[use_of[c.start]])
    for j, c in enumerate(ags):
        target = None
        # Before the earlier bucket's wait (its chain sits right before its first use), so a
        # second run finds every start already in place; then the start of the graph, so the
        # first gather of a graph that begins with compute (a backward whose first blocks stay
        # gathered) is issued at once, ahead of that compute's reduce-scatters.
        candidates = [ags[k].wait for k in range(j - 1, -1, -1)] + [
            _graph_start(graph, c, ags[j - 1].start if j else None)]
        for candidate in candidates:  # one bucket earlier at a time
            if candidate is None or not _fits(graph, ags, c, candidate, cap):
                break
            target = candidate
        if target is None:  # not even one bucket ahead: as early as memory frees up
            target = _after_release(graph, ags, j, c, cap)
        if target is not None and positions(graph)[c.start] > positions(graph)[target]:
            hoist_before(c.start, target, positions(graph))


def _graph_start(graph, c, previous) -> fx.Node | None:
    """The first node that is neither a placeholder nor something ``c``'s start depends on,
    and comes after ``previous`` (the gather used before ``c``: issue order = use order)."""
    cone, stack = set(), [c.start]
    while stack:
        node = stack.pop()
        if node not in cone:
            cone.add(node)
            stack.extend(node.all_input_nodes)
    after = previous is None
    for n in graph.nodes:
        if after and n.op != "placeholder" and n not in cone:
            return n
        after = after or n is previous
    return None


def _after_release(graph, ags, j, c, cap) -> fx.Node | None:
    """The earliest node right after an earlier bucket's last use (where gathered bytes in
    flight drop) at which issuing ``c`` fits the cap, if it is before ``c``'s start."""
    pos = positions(graph)
    nodes = list(graph.nodes)
    for p in sorted({_last_use(gather_chain(a.wait), pos) for a in ags[:j]}):
        if p + 1 >= pos[c.start]:
            break
        if _fits(graph, ags, c, nodes[p + 1], cap):
            return nodes[p + 1]
    return None


def _fits(graph, ags, c, candidate, cap) -> bool:
    """Would issuing ``c`` right before ``candidate`` keep gathered bytes in flight ≤ cap?"""
    pos = positions(graph)
    lo = pos[candidate]
    hi = _last_use(gather_chain(c.wait), pos)
    events = []
    for other in ags:
        if other is c:
            continue
        start = pos[other.start]
        end = _last_use(gather_chain(other.wait), pos)
        if start <= hi and end >= lo:
            events.append((max(start, lo), other.nbytes))
            events.append((min(end, hi) + 0.5, -other.nbytes))
    alive, peak = c.nbytes, c.nbytes
    for _, delta in sorted(events):
        alive += delta
        peak = max(peak, alive)
    return peak <= cap


def _place_reductions(graph: fx.Graph, collectives: list[Collective]) -> None:
    reds = [c for c in collectives if c.kind != "all_gather"]
    for c in reds:  # issue as soon as the input exists
        pos = positions(graph)
        last_input = max(c.start.all_input_nodes, key=pos.__getitem__)
        if pos[c.start] > pos[last_input] + 1:
            last_input.append(c.start)
    pos = positions(graph)
    reds.sort(key=lambda c: pos[c.start])
    for i, c in enumerate(reds):
        pos = positions(graph)
        chain = gather_chain(c.wait)
        use = _first_use(chain, pos)
        if use is None:
            continue
        dest = use
        if i + 1 < len(reds) and pos[reds[i + 1].start] < pos[dest]:
            dest = reds[i + 1].start
        for node in chain:
            dest.prepend(node)
