"""Simulate an FX graph's schedule on two streams: compute and communication.

Nodes run in graph order on the compute stream (cost: cost_model.node_time). A collective
start enqueues its transfer on the communication stream, which runs transfers one at a time
in issue order (as a NCCL/gloo process group does); the transfer begins when both the start
node has been reached and the previous transfer is done. A ``wait_tensor`` blocks the compute
stream until its transfer ends: that blocked time is the *exposed* communication. Hardware
whose transfers use the compute cores (``comm_overlap`` < 1) or that pays a per-collective
overhead also charges those to the compute stream at the start node.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx

from .collectives import find_collectives, is_wait, started_by


@dataclass
class Interval:
    stream: str  # "compute" or "comm"
    start: float
    end: float
    label: str


@dataclass
class Schedule:
    makespan: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    comm_bytes: int = 0  # bytes each rank sends (ring algorithms)
    intervals: list[Interval] = field(default_factory=list)

    def shifted(self, offset: float) -> "Schedule":
        return Schedule(self.makespan, self.compute_s, self.comm_s, self.exposed_comm_s,
                        self.comm_bytes,
                        [Interval(i.stream, i.start + offset, i.end + offset, i.label)
                         for i in self.intervals])


_SEND_FACTOR = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}


def simulate(graph: fx.Graph | fx.GraphModule, hw, node_cost=None, comm_cost=None) -> Schedule:
    """Two-stream timeline of ``graph`` on hardware ``hw`` (see module doc).

    ``node_cost(node)`` / ``comm_cost(collective)`` override the cost model (tests use them
    to build hand-computed schedules).
    """
    from .cost_model import collective_time, node_time

    graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
    node_cost = node_cost or (lambda n: node_time(n, hw))
    comm_cost = comm_cost or (lambda c: collective_time(c, hw))
    by_start = {c.start: c for c in find_collectives(graph)}
    done: dict[fx.Node, float] = {}  # collective start node -> transfer end time
    sched = Schedule()
    now = comm_free = 0.0
    for node in graph.nodes:
        if node in by_start:
            c = by_start[node]
            t = comm_cost(c)
            begin = max(now, comm_free)
            comm_free = done[node] = begin + t
            sched.comm_s += t
            # What the compute thread pays for this collective: issuing it, and the part of
            # the transfer that cannot run beside compute (CPU ranks moving bytes themselves).
            busy = getattr(hw, "collective_overhead_s", 0.0) + (
                1.0 - getattr(hw, "comm_overlap", 1.0)) * t
            if busy > 0:
                sched.intervals.append(Interval("compute", now, now + busy, "comm_cpu"))
                sched.compute_s += busy
                now += busy
            n = max(c.group_size, 1)
            full = c.nbytes * n if c.kind == "reduce_scatter" else c.nbytes
            sched.comm_bytes += int(_SEND_FACTOR[c.kind] * full * (n - 1) / n)
            sched.intervals.append(Interval("comm", begin, comm_free, c.kind))
        elif is_wait(node) and started_by(node) in done:
            end = done[started_by(node)]
            if end > now:
                sched.exposed_comm_s += end - now
                now = end
        else:
            t = node_cost(node)
            if t > 0:
                sched.intervals.append(Interval("compute", now, now + t, _label(node)))
                sched.compute_s += t
                now += t
    sched.makespan = max(now, comm_free)
    sched.exposed_comm_s += max(0.0, comm_free - now)  # transfers still running at the end
    return sched


def _label(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]
