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
    default 4% of the hardware's memory."""

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
        bucket_limit = self.cap(hw) // 2
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            idx = sorted((i for i, c in enumerate(collectives) if c.kind == kind and c.params),
                         key=lambda i: anchor(collectives[i]))
            units = _units(idx, collectives)
            buckets: list[list[int]] = []
            prev_window = 0.0  # compute a one-ahead prefetch hides the current bucket under
            for unit in units:
                if buckets:
                    cur = buckets[-1]
                    merged = cur + unit
                    nbytes = sum(collectives[i].nbytes for i in merged)
                    t = sum(collective_time(collectives[i], hw) for i in merged) - (
                        len(merged) - 1) * hw.alpha_s  # one latency for the merged transfer
                    latency_bound = t <= 2 * hw.alpha_s
                    if nbytes <= bucket_limit and (latency_bound or t <= prev_window):
                        buckets[-1] = merged
                        continue
                    prev_window = elapsed[anchor(collectives[unit[0]])] - elapsed[
                        anchor(collectives[cur[0]])]
                buckets.append(list(unit))
            for b, members in enumerate(buckets):
                for i in members:
                    keys[i] = f"auto{b}"
        return keys


def _units(idx: list[int], collectives: list[Collective]) -> list[list[int]]:
    """Consecutive collectives of one module stay together (a module is never split)."""
    units: list[list[int]] = []
    for i in idx:
        if units and collectives[units[-1][-1]].module == collectives[i].module:
            units[-1].append(i)
        else:
            units.append([i])
    return units
