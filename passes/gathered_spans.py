"""The bytes of gathered parameters alive while prefetch moves all-gathers: the accounting
the memory cap (``memory_cap_bytes``, docs/memory_cap.md) reads.

Every gathered byte is a span (first node, last node, bytes):

* each gathered buffer from its issue (the all-gather's start) to its last use: its last copy
  when its chain copies out, else its last compute use (a parameter saved for backward: to
  the end of the forward graph, whose output reads it);
* its copy-outs (the per-parameter copies a bucket makes): each from the copy to its last
  reader, so while they are made the bucket's bytes are there twice over;
* in backward, the gathered parameters forward saved (placeholders annotated with their
  FQN): from the start to their last use;
* under host offload, the copy of the bucket's shard on the compute device that the gather
  reads (annotated ``ss_offload="to_compute"``, simplesharded/storage/offload.py): counted with
  its gather's span (prefetch hoists it with the start), an upper bound of the copy's own
  life, which ends once the gather has read it; offload_copies.py, which then issues copies
  earlier, counts the part before the start. On one rank a float32 copy is twice a bfloat16
  gather.

``GatheredSpans.peak`` is the most of those bytes alive at once over a range of positions
(``peak_of``'s sweep, which offload_copies.py runs over these spans and its copies').
Only the all-gather starts (and what they read) move while prefetching; once ``freeze`` is
told which nodes can move, the last uses and the spans' fixed ends are read once, and the
spans overlapping a range come from a segment tree (``SpanIndex``) instead of a look at
every span, so a fit test costs what is alive around it.

Invariant: nothing here edits the graph, and what ``freeze`` reads once stays true: after
``freeze(moving)`` the caller moves only nodes in ``moving`` and tells ``moved`` of every start
it hoists. The spans count the bytes ``memory.py``'s ``gathered_timeline`` counts (the same
kinds, the offload copy over a longer span); tests/test_memory_cap.py checks the reordered
graphs with that sweep. It is not
that sweep, nor in memory.py: it follows positions while nodes move, where memory.py sweeps
one fixed order, and keeping the two apart keeps the check independent of what it checks.
"""
from __future__ import annotations

import bisect
import math

from torch import fx

from .annotations import gathered_param
from .collectives import Collective
from .graph_utils import NodeOrder
from .node_meta import alias_kind, node_bytes
from .wait_chains import chain_uses, offload_copy


class GatheredSpans:
    """The gathered-byte spans of a graph's all-gathers ``ags`` (module doc). The chains,
    their users, copy-outs and the saved gathered parameters are found once: moving starts
    changes none."""

    def __init__(self, graph: fx.Graph, ags: list[Collective], order: NodeOrder,
                 chains: dict[fx.Node, list[fx.Node]]):
        self.ags, self.order = ags, order
        self.chain = chains  # {start: gather_chain}: what the reorderer placed
        # The output node is a use: a gathered parameter saved for backward stays alive.
        self.uses = {s: chain_uses(chain) for s, chain in self.chain.items()}
        self.last: dict[fx.Node, fx.Node] | None = None  # see _fixed_last_uses
        self.static: tuple[dict, list] | None = None  # see _static_positions
        self.index: SpanIndex | None = None  # the spans of static, by end
        # Bytes alive over fixed spans (first node, last node, bytes): copy-outs and saved
        # gathered parameters; their nodes never move while prefetching.
        self.fixed = [span for c in self.ags for span in self._copy_outs(c)]
        self.fixed += saved_gathered(graph, order)
        # bytes issued with each start: its gathered buffer and the offload copy it reads
        self._bytes = {c.start: c.nbytes + offload_copy_bytes(c.start) for c in ags}

    def nbytes(self, c: Collective) -> int:
        """The bytes ``c``'s span counts: its gathered buffer and its offload copy."""
        return self._bytes[c.start]

    def _copy_outs(self, c: Collective) -> list[tuple[fx.Node, fx.Node, int]]:
        """The copies ``c``'s chain makes (a bucket's per-parameter copy-outs): each from the
        copy to its last reader, with its bytes. While they are made, the bucket's bytes are
        there twice: the gathered buffer lives until its last copy (see last_use)."""
        return [(n, held_until(n, self.order), node_bytes(n)) for n in self.chain[c.start][1:]
                if alias_kind(n) is None]

    def last_use(self, c: Collective) -> fx.Node:
        """The last node reading ``c``'s gathered buffer through its views: its last copy
        when the chain copies out, else its last compute use (its chain's last node if
        none)."""
        if self.last is not None:
            return self.last[c.start]
        return max([held_until(c.wait, self.order)] + self.chain[c.start],
                   key=self.order.__getitem__)

    def freeze(self, moving: set[fx.Node]) -> None:
        """From now on only the nodes in ``moving`` move (the all-gather starts and what they
        read): fix what that leaves unchanged (_fixed_last_uses, _static_positions) and index
        the spans."""
        order = self.order
        self.last = self._fixed_last_uses(moving)
        self.static = self._static_positions(moving)
        if self.static is not None:
            last_pos, fixed = self.static
            self.index = SpanIndex([(order[c.start], last_pos[c.start], self.nbytes(c), c.start)
                                    for c in self.ags] + [(*span, None) for span in fixed])

    def _fixed_last_uses(self, cone: set[fx.Node]) -> dict[fx.Node, fx.Node] | None:
        """Every buffer's last use, found once, if no chain node or use can move while
        prefetching: prefetch moves only all-gather starts and what they read (the sinking and
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

    def moved(self, start: fx.Node) -> None:
        """The all-gather ``start`` was hoisted: its span now begins where it stands."""
        if self.index is not None:
            self.index.move(start, self.order[start])

    def spans(self, skip: Collective | None = None):
        """(first position, last position, bytes) of every gathered byte alive, ``skip``'s
        own gathered buffer left out."""
        order = self.order
        if self.static is not None:
            last_pos, fixed = self.static
            for c in self.ags:
                if c is not skip:
                    yield order[c.start], last_pos[c.start], self.nbytes(c)
            yield from fixed
            return
        for c in self.ags:
            if c is not skip:
                yield order[c.start], order[self.last_use(c)], self.nbytes(c)
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
        return peak_of(spans, lo, hi)


def peak_of(spans, lo=None, hi=None) -> int:
    """Most bytes alive at once over ``spans`` (first position, last position, bytes: alive
    through both), between positions ``lo`` and ``hi`` (None: unbounded)."""
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


class SpanIndex:
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


def saved_gathered(graph: fx.Graph, order: NodeOrder) -> list[tuple[fx.Node, fx.Node, int]]:
    """Gathered parameters a backward graph receives from forward (placeholders annotated
    with their FQN): (placeholder, its last use through its views, bytes)."""
    return [(node, held_until(node, order, output=False), node_bytes(node))
            for node in graph.find_nodes(op="placeholder")
            if gathered_param(node) and node_bytes(node)]


def held_until(node: fx.Node, order: NodeOrder, output: bool = True) -> fx.Node:
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


def offload_copy_bytes(start: fx.Node) -> int:
    """Bytes of the host offload copy (``ss_offload="to_compute"``) an all-gather ``start``'s
    input is built from (wait_chains.offload_copy); 0 without one."""
    found = offload_copy(start)
    return node_bytes(found[0]) if found else 0
