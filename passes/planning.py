"""Bucket plans: which collectives share one buffer.

A plan has ``assign(gm, collectives) -> list[key | None]`` (one key per collective, None =
leave alone) and a ``memory_cap_bytes`` the reordering pass honours.

* ``BlockPlan``: one bucket per transformer block, from parameter FQNs: the FQN prefix up to
  the first numeric component (``layers.3``), or the text matched by the first user pattern.
  Parameters outside blocks go to ``pre`` (before the first block in the graph: embeddings)
  or ``post`` (after it: final norm + output).
* ``AutoPlan``: merges consecutive per-module collectives while the merged transfer still hides
  under the compute that a one-ahead prefetch puts next to it, and two buckets stay under the
  memory cap (cost model in cost_model.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from torch import fx

from .collectives import Collective


def block_key(fqn: str, patterns: tuple[str, ...] = ()) -> str | None:
    """The block an FQN belongs to, or None for parameters outside any block."""
    for pat in patterns:
        m = re.search(pat, fqn)
        if m:
            return m.group(0)
    parts = fqn.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


@dataclass(frozen=True)
class BlockPlan:
    """One bucket per block (see module doc). ``patterns``: regexes tried before the default."""

    patterns: tuple[str, ...] = ()
    memory_cap_bytes: int | None = None

    def assign(self, gm: fx.GraphModule, collectives: list[Collective]) -> list[str | None]:
        keys: list[str | None] = []
        seen_block: set[str] = set()  # kinds for which a block collective has been seen
        for c in collectives:
            if not c.params:
                keys.append(None)
                continue
            key = block_key(c.params[0], self.patterns)
            if key is None:
                key = "post" if c.kind in seen_block else "pre"
            else:
                seen_block.add(c.kind)
            keys.append(key)
        return keys


@dataclass(frozen=True)
class AutoPlan:
    """Cost-model buckets. ``hardware``: profile name or a cost_model.Hardware.
    ``memory_cap_bytes``: bytes of gathered buffers alive at once (a bucket gets half);
    default 4% of the hardware's memory.

    Greedy over per-module units in execution order: a unit joins the open bucket when the
    simulated two-stream makespan of the prefix is no worse than starting a new bucket (one
    latency saved vs. overlap lost), and the bucket stays within half the cap and within a
    quarter of the graph's bytes of that kind (so there are at least four buckets).
    """

    hardware: object = "local"
    memory_cap_bytes: int | None = None

    def cap(self, hw) -> int:
        return self.memory_cap_bytes or int(0.04 * hw.memory_bytes)

    def assign(self, gm: fx.GraphModule, collectives: list[Collective]) -> list[str | None]:
        from .cost_model import collective_time, get_hardware, node_time

        hw = get_hardware(self.hardware) if isinstance(self.hardware, str) else self.hardware
        nodes = list(gm.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        elapsed = [0.0]  # elapsed[i] = compute time of nodes[:i]
        for n in nodes:
            elapsed.append(elapsed[-1] + node_time(n, hw))

        def anchor(c: Collective) -> int:
            # An all-gather matters where its result is first used; a reduction where it starts.
            if c.kind == "all_gather" and c.wait is not None and c.wait.users:
                return min(pos[u] for u in c.wait.users)
            return pos[c.start]

        keys: list[str | None] = [None] * len(collectives)
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            idx = sorted((i for i, c in enumerate(collectives) if c.kind == kind and c.params),
                         key=lambda i: anchor(collectives[i]))
            units = _units(idx, collectives)
            marks = [anchor(collectives[u[0]]) for u in units] + [len(nodes)]
            if kind == "all_gather":  # compute that runs after the unit's params arrive
                work = [elapsed[marks[k + 1]] - elapsed[marks[k]] for k in range(len(units))]
            else:  # compute that produces the unit's gradients
                work = [elapsed[marks[k]] - elapsed[marks[k - 1] if k else 0]
                        for k in range(len(units))]
            comm = [sum(collective_time(collectives[i], hw) for i in u) for u in units]
            # Full-size bytes a bucket keeps alive (a reduce-scatter's input is group × shard).
            nbytes = [sum(collectives[i].nbytes * (collectives[i].group_size
                                                   if kind == "reduce_scatter" else 1)
                          for i in u) for u in units]
            # Half the cap, and at least four buckets so transfers can pipeline with compute.
            limit = min(self.cap(hw) // 2, max(max(nbytes, default=0), sum(nbytes) // 4))
            buckets: list[list[int]] = []  # lists of unit indices
            for k in range(len(units)):
                if buckets and sum(nbytes[u] for u in buckets[-1]) + nbytes[k] <= limit:
                    merged = buckets[:-1] + [buckets[-1] + [k]]
                    split = buckets + [[k]]
                    sim = _simulate_prefetch if kind == "all_gather" else _simulate_reduce
                    if sim(merged, comm, work, hw.alpha_s) <= sim(split, comm, work, hw.alpha_s):
                        buckets = merged
                        continue
                buckets.append([k])
            for b, members in enumerate(buckets):
                for k in members:
                    for i in units[k]:
                        keys[i] = f"auto{b}"
        return keys


def _bucket_times(buckets, comm, work, alpha):
    for b in buckets:  # one latency per merged collective instead of one per unit
        yield sum(comm[k] for k in b) - alpha * (len(b) - 1), sum(work[k] for k in b)


def _simulate_prefetch(buckets, comm, work, alpha) -> float:
    """Two streams, one-ahead prefetch: bucket b's gather is issued when compute of b-1
    starts, runs after the previous gather, and compute of b waits for it."""
    comm_end = compute_start = compute_end = 0.0
    for c, w in _bucket_times(buckets, comm, work, alpha):
        comm_end = max(comm_end, compute_start) + c
        compute_start = max(compute_end, comm_end)
        compute_end = compute_start + w
    return compute_end


def _simulate_reduce(buckets, comm, work, alpha) -> float:
    """Reductions start once their gradients are computed and run one after another."""
    comm_end = compute_end = 0.0
    for c, w in _bucket_times(buckets, comm, work, alpha):
        compute_end += w
        comm_end = max(comm_end, compute_end) + c
    return max(comm_end, compute_end)


def _units(idx: list[int], collectives: list[Collective]) -> list[list[int]]:
    """Consecutive collectives of one module stay together (a module is never split)."""
    units: list[list[int]] = []
    for i in idx:
        if units and collectives[units[-1][-1]].module == collectives[i].module:
            units[-1].append(i)
        else:
            units.append([i])
    return units
