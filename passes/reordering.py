"""Move collectives so communication overlaps compute, under a memory cap.

* all-gather: the wait and its copy-out chain go right before the first real use; the start
  (with the pure ops that build its input) first goes right before its wait, then is issued
  before the compute of earlier buckets (prefetch) as far back as the cap allows, up to
  PREFETCH_AHEAD buckets (the graph's start for the first ones); if not even one bucket ahead
  fits, right after the earliest release of an earlier bucket that makes it fit.
* The cap (``memory_cap_bytes``, docs/memory_cap.md) bounds the bytes of gathered parameters
  alive at every point: each gathered buffer from its issue to its last use (a parameter saved
  for backward: to the end of the forward graph), its copy-outs (the per-parameter copies a
  bucket makes: the bucket's bytes twice over while they are made), and in backward the
  gathered parameters forward saved (from the start to their last use). Prefetch never raises
  that total above the cap; what the graph needs without any prefetch is its floor, which
  prefetch leaves as it is. Default cap: that floor plus the largest gathered buffer; a cap at
  or below the floor disables prefetch.
* reduce-scatter / all-reduce: the start right after its input is ready; the wait sinks towards
  its first use (with the ops computed from the result alone for the output, such as the 1/N
  averaging, which would otherwise pin it next to its start) but no further than the next
  reduction's start, so at most one reduction is in flight and full-size gradient buffers
  are freed a block later at most. On a process group collectives run in issue order, so a
  prefetch issued after the previous reduce-scatter hides both under the same compute
  (SimpleFSDP's backward schedule).
* Collectives that are not ours (expert parallelism's all-to-alls, TP's) never move and are
  never delayed: nothing that came after one's start in the graph this pass gets is moved
  ahead of it (a prefetch, an early reduction or a copy-out that would be is placed right
  after that start instead, where it overlaps the transfer), so the compute and waits before
  it stay exactly those of the traced graph.
* The one exception, moved first: context parallelism's K/V all-gather and the reduce-scatter
  of its gradient (annotated ``ss_cp``, models/context_parallel.py). Tracing waits on a
  functional collective at once, and the model projects and rotates the queries before the
  keys, so as traced nothing hides the transfer. Each is issued before the compute of its layer
  that does not need it (from the previous one's wait on: compute is never moved across that)
  and waited right before its first use: the query projection and rotation and the causal
  mask run while the keys travel, and in backward the queries' gradients while the keys'
  gradients are reduced. Only pure compute moves, and only later (collectives, waits, impure
  and random ops and what they read stay), so no other collective is issued later than
  traced.
"""
from __future__ import annotations

import bisect
import math

from torch import fx

from .annotations import BUCKET_KEY, CP_KEY, annotations, gathered_param
from .collectives import Collective, find_collectives, is_collective, is_wait
from .graph_utils import NodeOrder, hoist_before
from .node_meta import alias_kind, node_bytes
from .plan_protocol import Plan

# A gather is issued at most this many buckets ahead of its use. Simulated on Llama 3 8B at
# 64 ranks (h100-ib400), one bucket ahead left forward 8 % slower where blocks are small next
# to the largest buffer, and no limit made backward 4 % slower: gathers issued that early
# queue reduce-scatters behind them (and hold full-size gradients longer, which the cap does
# not count).
PREFETCH_AHEAD = 2

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


def reduction_epilogue(chain: list[fx.Node], order: NodeOrder) -> list[fx.Node]:
    """``chain`` plus the pure ops computed from it alone whose results only the graph's
    output or compute outside them reads (the 1/N averaging of a reduced gradient, read by
    the output, or by the optimizer's update in a step graph): they sink with the wait, or
    the first of them would pin the wait right after its start. One that feeds a collective
    (HSDP's replica all-reduce) stays where it is. Graph order."""
    members, candidates, frontier = set(chain), [], list(chain)  # computed from the chain alone
    while frontier:
        for user in frontier.pop().users:
            if (user.op == "call_function" and user not in members
                    and not is_collective_or_wait(user) and not user.is_impure()
                    and all(a in members for a in user.all_input_nodes)):
                members.add(user)
                candidates.append(user)
                frontier.append(user)
    kept, pending = set(chain), set(candidates)
    for node in sorted(candidates, key=order.__getitem__, reverse=True):
        if all(u in kept or u.op == "output"
               or (u not in pending and not is_collective_or_wait(u)) for u in node.users):
            kept.add(node)
    return sorted(kept, key=order.__getitem__)


def _chain_uses(chain: list[fx.Node]) -> list[fx.Node]:
    """Nodes outside the chain that read it."""
    members = set(chain)
    return [u for n in chain for u in n.users if u not in members]


def _first_use(chain: list[fx.Node], order: NodeOrder) -> fx.Node | None:
    return min(_chain_uses(chain), key=order.__getitem__, default=None)


def is_collective_or_wait(node: fx.Node) -> bool:
    return is_collective(node) or is_wait(node)


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
    # critical path (TP's) is never pushed behind a prefetch.
    if collectives is None:
        collectives = find_collectives(graph)
    order = NodeOrder(graph)
    _overlap_cp_collectives(collectives, order)
    behind = _Behind(graph, collectives, order)
    collectives = [c for c in collectives if c.wait is not None and c.ours]
    chains = _place_gather_waits(collectives, order, behind)
    _Prefetch(graph, collectives, memory_cap_bytes, order, chains, behind).run()
    _place_reductions(collectives, order, behind)


class _Behind:
    """The starts of collectives that are not ours, and which of them each node came after in
    the graph the pass got: moves keep every node behind that one (module doc)."""

    def __init__(self, graph: fx.Graph, collectives: list[Collective], order: NodeOrder):
        foreign = {c.start for c in collectives if not c.ours}
        self.order, self.floor, last = order, {}, None
        self.hoisted: dict[fx.Node, fx.Node] = {}  # foreign start → last start issued after it
        for node in graph.nodes if foreign else ():  # none: no node has one to stay behind
            if last is not None:
                self.floor[node] = last
            if node in foreign:
                last = node

    def anchor(self, start: fx.Node, target: fx.Node) -> fx.Node:
        """``target`` (to hoist ``start`` right before it), or, when ``target`` is ahead of
        the foreign start ``start`` must stay behind, the node right after that start and the
        starts already issued there (issue order = the order of these calls)."""
        f = self.floor.get(start)
        if f is None or self.order[target] > self.order[f]:
            return target
        anchor = self.hoisted.get(f, f).next
        self.hoisted[f] = start
        return anchor

    def move_before(self, nodes: list[fx.Node], target: fx.Node) -> None:
        """Move ``nodes`` (in their order) right before ``target``; those that would so pass
        their foreign start go right after it instead, in their order."""
        after: dict[fx.Node, fx.Node] = {}  # foreign start → last node put right after it
        for node in nodes:
            f = self.floor.get(node)
            if f is not None and self.order[target] <= self.order[f]:
                self.order.move_after(node, after.get(f, f))
                after[f] = node
            else:
                self.order.move_before(node, target)


def _overlap_cp_collectives(collectives: list[Collective], order: NodeOrder) -> None:
    """Context parallelism's collectives (``ss_cp``): each issued before the compute that does
    not need it, and waited right before its first use (module doc)."""
    cp = [c for c in collectives if c.wait is not None and CP_KEY in annotations(c.start)]
    if not cp:
        return
    # What the other steps place with their collective: each wait's copy-outs and views, and
    # the pure ops only its result feeds (a reduction's averaging). They stay, so those steps
    # find them where they left them (idempotence) and no gathered buffer lives longer.
    held = {n for c in collectives if c.wait is not None
            for n in reduction_epilogue(gather_chain(c.wait, order), order)}
    floor = None  # the previous one's wait: compute is never moved across it
    for c in sorted(cp, key=lambda c: order[c.start]):
        _issue_before_independent_compute(c.start, floor, order, held)
        chain = _views_of_result(c.wait, order)
        use = _first_use(chain, order)
        if use is not None:
            for node in chain:  # in graph order, so the chain keeps its own
                order.move_before(node, use)
        floor = c.wait


def _views_of_result(wait: fx.Node, order: NodeOrder) -> list[fx.Node]:
    """The wait and the views computed from it alone (the split of K/V into keys and values,
    whatever view ops the model used), in graph order."""
    chain, frontier = {wait}, [wait]
    while frontier:
        for user in frontier.pop().users:
            if (user not in chain and alias_kind(user) == "view"
                    and all(a in chain for a in user.all_input_nodes)):
                chain.add(user)
                frontier.append(user)
    return sorted(chain, key=order.__getitem__)


def _issue_before_independent_compute(start: fx.Node, floor: fx.Node | None,
                                      order: NodeOrder, held: set[fx.Node]) -> None:
    """Move the pure compute between ``floor`` (exclusive; None: the graph's start) and
    ``start`` that ``start`` does not read, directly or not, to right after ``start``, in its
    order. What stays: ``start``'s inputs, collectives and waits, ``held``, impure and random
    ops, and all they read. A moved node feeds no node that stays (that one would then read
    it), so every use still follows its definition."""
    window, node = [], (floor.next if floor is not None else next(iter(start.graph.nodes)))
    while node is not start:
        window.append(node)
        node = node.next
    stays = {start}
    for node in reversed(window):  # a reader comes after what it reads
        if (node.op != "call_function" or is_collective_or_wait(node) or node in held
                or node.is_impure() or _random(node) or any(u in stays for u in node.users)):
            stays.add(node)
    anchor = start
    for node in window:
        if node not in stays:
            order.move_after(node, anchor)
            anchor = node


def _random(node: fx.Node) -> bool:
    """An op that draws random numbers: moving it would change what it draws."""
    import torch

    return (isinstance(node.target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in node.target.tags)


def _place_gather_waits(collectives: list[Collective], order: NodeOrder, behind: _Behind
                        ) -> dict[fx.Node, list[fx.Node]]:
    """Each all-gather's chain right before its first use; returns {start: chain}, still in
    graph order (moving a chain keeps its own order)."""
    chains = {}
    for c in collectives:
        if c.kind != "all_gather":
            continue
        chain = chains[c.start] = gather_chain(c.wait, order)
        use = _first_use(chain, order)
        if use is None:
            continue
        behind.move_before(chain, use)  # keeps the chain's own order
    return chains


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
    """Issue each all-gather as early as the cap allows (module doc). The chains, their users,
    copy-outs and the saved gathered parameters are found once: moving starts changes none."""

    def __init__(self, graph: fx.Graph, collectives: list[Collective], cap: int | None,
                 order: NodeOrder, chains: dict[fx.Node, list[fx.Node]], behind: _Behind):
        self.graph, self.cap, self.order, self.behind = graph, cap, order, behind
        self.ags = [c for c in collectives if c.kind == "all_gather"]
        self.chain = chains  # {start: gather_chain}: what _place_gather_waits found
        # The output node is a use: a gathered parameter saved for backward stays alive.
        self.uses = {s: _chain_uses(chain) for s, chain in self.chain.items()}
        self.last: dict[fx.Node, fx.Node] | None = None  # see _fixed_last_uses
        self.static: tuple[dict, list] | None = None  # see _static_positions
        self.index: _SpanIndex | None = None  # the spans of static, by end
        # Bytes alive over fixed spans (first node, last node, bytes): copy-outs and saved
        # gathered parameters; their nodes never move while prefetching.
        self.fixed = [span for c in self.ags for span in self._copy_outs(c)]
        self.fixed += _saved_gathered(graph, order)

    def _copy_outs(self, c: Collective) -> list[tuple[fx.Node, fx.Node, int]]:
        """The copies ``c``'s chain makes (a bucket's per-parameter copy-outs): each from the
        copy to its last reader, with its bytes. While they are made, the bucket's bytes are
        there twice: the gathered buffer lives until its last copy (see last_use)."""
        return [(n, _held_until(n, self.order), node_bytes(n)) for n in self.chain[c.start][1:]
                if alias_kind(n) is None]

    def last_use(self, c: Collective) -> fx.Node:
        """The last node reading ``c``'s gathered buffer through its views: its last copy
        when the chain copies out, else its last compute use (its chain's last node if
        none)."""
        if self.last is not None:
            return self.last[c.start]
        return max([_held_until(c.wait, self.order)] + self.chain[c.start],
                   key=self.order.__getitem__)

    def _cone(self) -> set[fx.Node]:
        """What the all-gather starts read, directly or not: all that hoisting moves."""
        cone, stack = set(), [c.start for c in self.ags]
        while stack:
            for node in stack.pop().all_input_nodes:
                if node not in cone:
                    cone.add(node)
                    stack.append(node)
        return cone

    def _fixed_last_uses(self, cone: set[fx.Node]) -> dict[fx.Node, fx.Node] | None:
        """Every buffer's last use, found once, if no chain node or use can move while
        prefetching: run() moves only all-gather starts and what they read (the sinking and
        the hoisting), so unless a use feeds a gather, the last uses stay where they are.
        (Finding them afresh at every fit test made prefetch quadratic in the gathers.)"""
        if any(n in cone for c in self.ags for n in self.uses[c.start] or self.chain[c.start]):
            return None
        return {c.start: self.last_use(c) for c in self.ags}

    def _static_positions(self, cone: set[fx.Node]) -> tuple[dict, list] | None:
        """({gather start: position of its last use}, [(first, last position, bytes) of the
        fixed spans]) when none of these nodes is in the starts' cone: then hoisting never
        moves them, their positions never change (NodeOrder), and every fit test reads them
        from here instead of looking each up again."""
        if self.last is None or any(n in cone for span in self.fixed for n in span[:2]):
            return None
        order = self.order
        return ({c.start: order[self.last[c.start]] for c in self.ags},
                [(order[first], order[last], nbytes) for first, last, nbytes in self.fixed])

    def run(self) -> None:
        order = self.order
        for c in self.ags:
            _sink_to_wait(c, order)
        cone = self._cone()
        self.last = self._fixed_last_uses(cone)
        self.static = self._static_positions(cone)
        if self.static is not None:
            last_pos, fixed = self.static
            self.index = _SpanIndex([(order[c.start], last_pos[c.start], c.nbytes, c.start)
                                     for c in self.ags] + [(*span, None) for span in fixed])
        if self.cap is None:
            self.cap = self.peak() + max((c.nbytes for c in self.ags), default=0)
        use_of = {c.start: _first_use(self.chain[c.start], order) for c in self.ags}
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
                target = self.behind.anchor(c.start, target)
            if target is not None and order[c.start] > order[target]:
                hoist_before(c.start, target, order)
                if self.index is not None:
                    self.index.move(c.start, order[c.start])

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
            if self.fits(c, after):
                return after
        return None

    def spans(self, skip: Collective | None = None):
        """(first position, last position, bytes) of every gathered byte alive, ``skip``'s
        own gathered buffer left out."""
        order = self.order
        if self.static is not None:
            last_pos, fixed = self.static
            for c in self.ags:
                if c is not skip:
                    yield order[c.start], last_pos[c.start], c.nbytes
            yield from fixed
            return
        for c in self.ags:
            if c is not skip:
                yield order[c.start], order[self.last_use(c)], c.nbytes
        for first, last, nbytes in self.fixed:
            yield order[first], order[last], nbytes

    def peak(self, lo=None, hi=None, skip: Collective | None = None) -> int:
        """Most gathered bytes alive at once between positions ``lo`` and ``hi``."""
        if self.index is not None and lo is not None and hi is not None:
            # The spans overlapping [lo, hi] straight from the index: a fit test then costs
            # what is alive around it, not a look at every span (quadratic in the gathers).
            spans = [span[:3] for span in self.index.overlapping(lo, hi)
                     if skip is None or span[3] is not skip.start]
        else:
            spans = self.spans(skip)
        events = []
        for start, end, nbytes in spans:
            if (hi is None or start <= hi) and (lo is None or end >= lo):
                # (position, released after the node at that position, bytes)
                events.append((start if lo is None else max(start, lo), 0, nbytes))
                events.append((end if hi is None else min(end, hi), 1, -nbytes))
        alive = peak = 0
        for *_, delta in sorted(events):
            alive += delta
            peak = max(peak, alive)
        return peak

    def fits(self, c, candidate) -> bool:
        """Would issuing ``c`` right before ``candidate`` keep gathered bytes alive ≤ cap?"""
        lo, hi = self.order[candidate], self.order[self.last_use(c)]
        return c.nbytes + self.peak(lo, hi, skip=c) <= self.cap


class _SpanIndex:
    """Spans (first position, last position, bytes, key) sorted by their last position, which
    never changes, in a segment tree of their first positions, which change as the gathers
    they start with are hoisted (``move``): ``overlapping(lo, hi)`` finds the spans that
    overlap [lo, hi] in time proportional to their number (times log n), not to n."""

    def __init__(self, spans: list[tuple]):
        self.spans = sorted(spans, key=lambda span: span[1])
        self.ends = [span[1] for span in self.spans]
        self.slot = {span[3]: i for i, span in enumerate(self.spans) if span[3] is not None}
        self.size = size = 1 << max(len(self.spans) - 1, 0).bit_length()
        self.first = [math.inf] * (2 * size)  # each subtree's earliest first position
        for i, span in enumerate(self.spans):
            self.first[size + i] = span[0]
        for i in range(size - 1, 0, -1):
            self.first[i] = min(self.first[2 * i], self.first[2 * i + 1])

    def move(self, key, first) -> None:
        """The span ``key`` now begins at ``first``."""
        i = self.slot[key]
        span = self.spans[i]
        self.spans[i] = (first, *span[1:])
        i += self.size
        self.first[i] = first
        while i > 1:
            i //= 2
            self.first[i] = min(self.first[2 * i], self.first[2 * i + 1])

    def overlapping(self, lo, hi) -> list[tuple]:
        """The spans with first ≤ ``hi`` and last ≥ ``lo``, by last position."""
        begin = bisect.bisect_left(self.ends, lo)  # the spans from here on end at lo or later
        out, stack = [], [(1, 0, self.size)]  # (tree node, [a, b) of spans below it)
        while stack:
            node, a, b = stack.pop()
            if b <= begin or self.first[node] > hi:
                continue
            if node >= self.size:
                out.append(self.spans[a])
                continue
            mid = (a + b) // 2
            stack.append((2 * node + 1, mid, b))
            stack.append((2 * node, a, mid))
        return out


def _bucket(c: Collective):
    """What a gather is one part of: its bucket (a bucket of two dtypes is two gathers)."""
    return annotations(c.start).get(BUCKET_KEY) or c.start


def _saved_gathered(graph: fx.Graph, order: NodeOrder) -> list[tuple[fx.Node, fx.Node, int]]:
    """Gathered parameters a backward graph receives from forward (placeholders annotated
    with their FQN): (placeholder, its last use through its views, bytes)."""
    return [(node, _held_until(node, order, output=False), node_bytes(node))
            for node in graph.find_nodes(op="placeholder")
            if gathered_param(node) and node_bytes(node)]


def _held_until(node: fx.Node, order: NodeOrder, output: bool = True) -> fx.Node:
    """The last node reading ``node``'s buffer directly or through its aliases (views,
    in-place results): where that buffer is freed. ``output``: the graph's output counts as
    a reader (a forward output is kept for backward)."""
    held, frontier, last = {node}, [node], node
    while frontier:
        for user in frontier.pop().users:
            if user.op == "output" and not output:
                continue
            if order[user] > order[last]:
                last = user
            if alias_kind(user) is not None and user not in held:
                held.add(user)
                frontier.append(user)
    return last


def _place_reductions(collectives: list[Collective], order: NodeOrder, behind: _Behind) -> None:
    reds = [c for c in collectives if c.kind != "all_gather"]
    for c in reds:  # issue as soon as the input exists
        last_input = max(c.start.all_input_nodes, key=order.__getitem__)
        if last_input.next is not c.start:
            behind.move_before([c.start], last_input.next)
    reds.sort(key=lambda c: order[c.start])
    for i, c in enumerate(reds):
        chain = reduction_epilogue(gather_chain(c.wait, order), order)
        use = _first_use(chain, order)
        if use is None:
            continue
        dest = use
        if i + 1 < len(reds) and order[reds[i + 1].start] < order[dest]:
            dest = reds[i + 1].start
        behind.move_before(chain, dest)
