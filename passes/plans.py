"""The built-in plans (plan_protocol.Plan): which collectives share one buffer, the memory cap
of reordering, and what reshard_after_forward="auto" keeps gathered.

* ``BlockPlan``: one bucket per block: the block data_parallel found in the module tree
  (simplesharded/blocks.py; names need no digits), or the text the first user pattern
  matches in the parameter FQN. No block at all in a large model is a warning.
  Parameters outside blocks go to ``pre`` (before the first block in the graph: embeddings)
  or ``post`` (after it: final norm + output).
* ``AutoPlan``: tries bucket sizes on a ladder (and the block plan), runs the real passes'
  edits on the graph for each (undone after) and keeps the one whose simulation
  (simulate.py) is fastest (cost model in compute_cost.py / comm_cost.py, simulator in
  simulate.py).

Neither merges a ragged bucket's collectives (RAGGED_KEY): a ragged bucket already is one
bucket, and merged with another its gather would be copied out of the merge's buffer again,
the copy that layout exists to remove.
"""
from __future__ import annotations

import contextlib
import gc
import re
import warnings
from dataclasses import dataclass

from torch import fx

from .annotations import BUCKET_KEY, annotations
from .collectives import Collective


# A model whose parameters fill one bucket of at least this size because no block was found
# gets a warning: the whole model gathered at once is an out-of-memory at scale, not a slowdown.
NO_BLOCKS_WARN_BYTES = 64 << 20


def block_key(c: Collective, patterns: tuple[str, ...] = ()) -> str | None:
    """The block a collective's (first) parameter belongs to: the text the first matching
    user pattern matches in its FQN, else the block data_parallel found in the module tree
    (simplesharded/blocks.py, carried by the BLOCK_KEY annotation); None outside blocks."""
    for pat in patterns:
        m = re.search(pat, c.params[0])
        if m:
            return m.group(0)
    return c.block


@dataclass(frozen=True)
class BlockPlan:
    """One bucket per block (see module doc). ``patterns``: regexes tried before the blocks
    data_parallel found. ``keep_gathered_bytes`` None keeps the last block and what follows
    it gathered (reshard_after_forward="auto", passes/recompute.py)."""

    patterns: tuple[str, ...] = ()
    memory_cap_bytes: int | None = None
    keep_gathered_bytes: int | None = None
    reshard_after_forward: bool | None = None

    def assign(self, gm: fx.GraphModule, collectives: list[Collective]) -> list[str | None]:
        keys: list[str | None] = []
        seen_block: set[str] = set()  # kinds for which a block collective has been seen
        for c in collectives:
            if not c.params:
                keys.append(None)
                continue
            key = block_key(c, self.patterns)
            if key is None:
                key = "post" if c.kind in seen_block else "pre"
            else:
                seen_block.add(c.kind)
            keys.append(None if c.prebucketed else key)
        if not seen_block:
            _warn_no_blocks(collectives)
        return keys


def _warn_no_blocks(collectives: list[Collective]) -> None:
    by_kind: dict[str, int] = {}
    for c in collectives:
        if c.params:
            by_kind[c.kind] = by_kind.get(c.kind, 0) + _full_bytes(c)
    largest = max(by_kind.values(), default=0)
    if largest >= NO_BLOCKS_WARN_BYTES:
        warnings.warn(
            f"block bucketing found no blocks: every parameter lands in one bucket of "
            f"{largest / 2**20:.0f} MiB, gathered at once; name them with "
            f"data_parallel(..., blocks=[BlockClass]) or the bucket_patterns option",
            stacklevel=2)


@dataclass(frozen=True)
class AutoPlan:
    """Cost-model buckets. ``hardware``: profile name or a hardware.Hardware.
    ``memory_cap_bytes``: bytes of gathered parameters alive at once (docs/memory_cap.md);
    default 8% of the hardware's memory. A quarter of it is the keep-gathered budget and a
    sixth the largest bucket, so what stays gathered for backward, one bucket being copied out
    (twice its bytes) and two prefetched (reordering.PREFETCH_AHEAD) fit in it (a module larger
    than a sixth is a bucket of its own, and may leave no room to prefetch).

    Candidates: per-module units (a module is never split) merged in execution order up to a
    byte size, for a ladder of sizes, plus the block plan when the model has blocks; a ragged
    bucket's collectives are in none (module doc). Each
    candidate is applied to the graph by the real bucketing and reordering edits, simulated
    (simulate.py: compute + a comm lane per link) and undone; the shortest makespan wins
    (ties: fewer collectives). So the plan accounts for latency per collective, the copy-in/copy-out the
    bucket costs on the compute stream, and the overlap that prefetch under the cap achieves.
    Every rank must reach the same plan from its own graph (docs/rank_agreement.md): under
    HSDP run replica_padding.py first (the backends do), or uneven shards give the ranks'
    replica all-reduces different sizes.
    """

    hardware: object = "local"
    memory_cap_bytes: int | None = None  # None: resolved to the default at construction
    sizes: int = 8  # rungs on the bucket-size ladder
    reshard_after_forward: bool | None = None

    def __post_init__(self):
        # Resolved here so that every pass reads the same cap, reordering included.
        if self.memory_cap_bytes is None:
            object.__setattr__(self, "memory_cap_bytes", int(0.08 * self.hw().memory_bytes))

    def hw(self):
        """The cost-model Hardware (``hardware`` may name a profile)."""
        from .hardware import get_hardware

        return get_hardware(self.hardware) if isinstance(self.hardware, str) else self.hardware

    @property
    def keep_gathered_bytes(self) -> int:
        """Budget for parameters kept gathered from forward to backward (``reshard="auto"``,
        passes/recompute.py): a quarter of the cap (class doc)."""
        return self.memory_cap_bytes // 4

    def assign(self, gm: fx.GraphModule, collectives: list[Collective]) -> list[str | None]:
        hw = self.hw()
        # An already bucketed graph keeps its buckets (idempotence): re-planning from merged
        # collectives could merge further, e.g. the two dtype halves of one bucket.
        existing = [annotations(c.start).get(BUCKET_KEY) for c in collectives]
        if any(existing):
            return existing
        candidates = self.candidates(gm, collectives, hw)
        # Rungs often coincide (a small model fits one bucket at every size): simulate each
        # distinct candidate once, and none when there is only one.
        distinct = list(dict.fromkeys(map(tuple, candidates)))
        if len(distinct) == 1:
            return candidates[0]
        with _collection_paused(), _Trials(gm.graph, hw, self.memory_cap_bytes) as trials:
            scores = {keys: trials.makespan(keys) for keys in distinct}
        best = min(range(len(candidates)),
                   key=lambda i: (scores[tuple(candidates[i])], len(set(candidates[i]))))
        return candidates[best]

    def candidates(self, gm, collectives, hw) -> list[list[str | None]]:
        pos = {n: i for i, n in enumerate(gm.graph.nodes)}

        def anchor(c: Collective) -> int:
            if c.kind == "all_gather" and c.wait is not None and c.wait.users:
                return min(pos[u] for u in c.wait.users)
            return pos[c.start]

        per_kind = {}
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            idx = sorted((i for i, c in enumerate(collectives) if c.kind == kind and c.params
                          and not c.prebucketed),
                         key=lambda i: anchor(collectives[i]))
            units = _units(idx, collectives)
            sizes = [sum(_full_bytes(collectives[i]) for i in u) for u in units]
            per_kind[kind] = (units, sizes)
        largest = max((max(sz, default=0) for _, sz in per_kind.values()), default=0)
        total = max((sum(sz) for _, sz in per_kind.values()), default=0)
        top = min(self.memory_cap_bytes // 6, max(total // 2, largest))
        ladder, limit = [], max(largest, 1)
        while limit < top and len(ladder) < self.sizes - 1:
            ladder.append(limit)
            limit *= 4
        ladder.append(max(top, largest))
        out = []
        # Each rung twice: uniform buckets, and with the first forward all-gather bucket held to
        # the lowest rung. Nothing runs before the first gather, so all of it is exposed; a
        # small first bucket lets the second one stream under the first block's compute.
        for limit, first in [(r, r) for r in ladder] + [(r, ladder[0]) for r in ladder[1:]]:
            keys: list[str | None] = [None] * len(collectives)
            for kind, (units, sizes) in per_kind.items():
                b, acc = 0, 0
                for unit, size in zip(units, sizes):
                    cap = first if kind == "all_gather" and b == 0 else limit
                    if acc and acc + size > cap:
                        b, acc = b + 1, 0
                    acc += size
                    for i in unit:
                        keys[i] = f"auto{b}"
            out.append(keys)
        block = BlockPlan().assign(gm, collectives)
        block_bytes: dict = {}
        for c, key in zip(collectives, block):
            block_bytes[(key, c.kind)] = block_bytes.get((key, c.kind), 0) + _full_bytes(c)
        # The cap binds the block plan too: a block larger than a bucket may be does not fit.
        within = max(block_bytes.values(), default=0) <= max(top, largest)
        if any(k not in (None, "pre", "post") for k in block) and within:
            out.append(block)
        return out


@contextlib.contextmanager
def _collection_paused():
    """No cyclic garbage collection while the trials run: they allocate the nodes of every
    candidate's buckets (and a graph copy, see _Trials), and each full collection would scan
    every object the compile holds (traced graphs, fake tensors) for nothing; a third of the
    trials' time on llama3 8B. What they drop is collected once this ends."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _Trials:
    """Simulated makespans of candidates, each bucketed and reordered by the real passes' graph
    edits (merge_buckets, reorder_graph) on the graph itself, which every trial puts back as
    it found it: undoing a trial touches only the collectives it merged, their users and the
    nodes it added. A copy of the graph per candidate cost more than the edits and the
    simulation together, and even one copy for all of them a fifth of the trials' time at
    Llama 3 405B's scale. The merges keep the collectives they
    replace in the graph, detached (merge_buckets' ``detach``), so undoing one re-attaches
    them instead of creating them again. Use it as a context manager: leaving it puts back
    what the trials change for as long as they run (below).

    The collectives' inputs, which the merges compute new values from, hold meta values while
    the trials run: ops on meta tensors are ~30x cheaper than on fake ones, and the cost model
    reads only shapes, strides and dtypes, which fake and meta values share. The compute time
    of an original node is computed once for all candidates (a merge gives the readers of a
    wait a copy-out of the same shape, strides and dtype instead). The graph's names come back
    too (graph_utils.names_kept): the nodes the real passes create afterwards are named as
    without the trials. A graph whose module observes its edits (hooks, e.g. inductor's
    provenance tracking) is copied instead, so the observer sees only the real edits; the
    copy is a copy of the graph only (no GraphModule, no code generated)."""

    def __init__(self, graph: fx.Graph, hw, cap: int | None):
        import copy

        from .bucketing import bucketable
        from .compute_cost import node_time
        from .graph_utils import edits_observed

        self.hw, self.cap = hw, cap
        self.work = copy.deepcopy(graph) if edits_observed(graph) else graph
        self.order = list(self.work.nodes)  # what every trial restores
        self.costs = {node: node_time(node, hw) for node in self.order}  # the original nodes'
        self.collectives = bucketable(self.work)
        # The nodes whose readers a trial changes (rewiring a node moves it to the end of the
        # readers of each of its inputs), with their readers' order, which _restore restores.
        self.readers = {n: list(n.users) for c in self.collectives
                        for reader in (c.start, *c.wait.users) for n in reader.all_input_nodes}
        self.fake_mode = contextlib.nullcontext()  # values computed on meta tensors as they are

    def __enter__(self) -> "_Trials":
        from .graph_utils import names_kept
        from .node_meta import to_meta

        self.names = names_kept(self.work)
        self.names.__enter__()
        self.vals = {c.start.args[0]: c.start.args[0].meta["val"] for c in self.collectives}
        for node, val in self.vals.items():
            node.meta["val"] = to_meta(val)
        return self

    def __exit__(self, *exc) -> None:
        for node, val in self.vals.items():
            node.meta["val"] = val
        self.names.__exit__(*exc)
        # Dropped here, inside the caller's paused collection: a copy goes at once.
        self.work = self.costs = self.order = self.collectives = self.readers = None

    def makespan(self, keys) -> float:
        from .bucketing import merge_buckets
        from .collectives import find_collectives
        from .compute_cost import node_time
        from .reordering import reorder_graph
        from .simulate import simulate

        work, costs, hw = self.work, self.costs, self.hw
        # What merging changes: a merged collective's start no longer reads its input, and
        # its wait's users read the bucket's copy-out instead.
        saved = [(c, c.start.args, c.start.kwargs, [(u, u.args, u.kwargs) for u in c.wait.users])
                 for c, key in zip(self.collectives, keys) if key is not None]
        ids = {id(c) for c in merge_buckets(work, self.collectives, list(keys),
                                            self.fake_mode, detach=True)}
        merged = [entry for entry in saved if id(entry[0]) in ids]
        collectives = find_collectives(work)  # moving nodes keeps them valid
        reorder_graph(work, self.cap, collectives)

        def time_of(node: fx.Node) -> float:
            cost = costs.get(node)
            return node_time(node, hw) if cost is None else cost  # None: added by the trial

        cost = _rank_invariant_time(work, hw, time_of, collectives)
        makespan = simulate(work, hw, node_cost=cost, collectives=collectives).makespan
        self._restore(merged)
        return makespan

    def _restore(self, merged) -> None:
        """Undo a trial: the merged collectives' starts read their inputs again and their
        waits' users read the waits (each node's readers in their old order), the nodes the
        trial added are erased, the original order comes back."""
        from .graph_utils import forget_erased

        work, costs = self.work, self.costs
        readers = {}  # each reader once (the output reads every gradient)
        for c, start_args, start_kwargs, users in merged:
            c.start.args, c.start.kwargs = start_args, start_kwargs
            for user, args, kwargs in users:
                readers.setdefault(user, (args, kwargs))
        for user, (args, kwargs) in readers.items():
            user.args, user.kwargs = args, kwargs
        added = [node for node in reversed(list(work.nodes)) if node not in costs]
        for node in added:  # users before what they read
            work.erase_node(node)
        forget_erased(work, added)
        for node, users in self.readers.items():
            if list(node.users) != users:  # re-attached readers come last: their old order
                for user in users:
                    node.users[user] = node.users.pop(user)
        first = next(iter(work.nodes))
        if first is not self.order[0]:
            first.prepend(self.order[0])
        for prev, node in zip(self.order, self.order[1:]):
            if prev.next is not node:
                prev.append(node)


def _rank_invariant_time(graph: fx.Graph, hw, time_of=None, collectives=None):
    """``time_of`` (default node_time), except for the nodes that work on this rank's own
    chunk (rank_local.py): their size differs between ranks with uneven shards, and every
    rank must pick the same buckets (or the collectives no longer match) without talking to
    the others at compile time (caches may skip a rank's compile). Everything else is the
    same on every rank. ``collectives``: the graph's, when the caller has them."""
    from .compute_cost import node_time
    from .rank_local import rank_local_nodes

    local = rank_local_nodes(graph, collectives)
    time_of = time_of or (lambda node: node_time(node, hw))
    return lambda node: 0.0 if node in local else time_of(node)


def _full_bytes(c: Collective) -> int:
    """Bytes of the full-size buffer a bucket keeps alive (a reduce-scatter's input)."""
    return c.nbytes * (c.group_size if c.kind == "reduce_scatter" else 1)


def _units(idx: list[int], collectives: list[Collective]) -> list[list[int]]:
    """Consecutive collectives of one module stay together: a module is never split."""
    units: list[list[int]] = []
    for i in idx:
        if units and collectives[units[-1][-1]].module == collectives[i].module:
            units[-1].append(i)
        else:
            units.append([i])
    return units
