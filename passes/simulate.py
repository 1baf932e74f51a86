"""Simulate an FX graph's schedule on a compute stream and one communication lane per link.

Nodes run in graph order on the compute stream (cost: compute_cost.node_time). A collective
start enqueues its transfer on the lane of its group's link (comm_cost.group_link: the
intra-node link, e.g. NVLink, or the inter-node one, e.g. one IB NIC per GPU). A lane runs its
transfers one at a time in issue order; a transfer begins when both the start node has been
reached and the lane's previous transfer is done. A ``wait_tensor`` blocks the compute stream
until its transfer ends: that blocked time is the *exposed* communication. Hardware whose
transfers use the compute cores (``comm_overlap`` < 1) or that pays a per-collective overhead
also charges those to the compute stream at the start node.

Why a lane per link, not one per process group (NCCL gives each process group its own
stream, so collectives of different groups do run concurrently): what limits concurrent
transfers is the wire they share. With tp innermost, a tp group's collectives move over
NVLink and a dp group's over the NICs, so a tensor-parallel all-gather does not queue behind a
data-parallel prefetch: separate lanes. Two groups on the same link (HSDP's dp_shard and
dp_replicate both crossing nodes) split its bandwidth when they overlap, which finishes both
no earlier than running them back to back: one lane, in issue order. One lane per group
would count that bandwidth twice; one lane for everything (the previous model) would make
every tensor-parallel collective wait for the prefetches ahead of it. Not modelled: the SMs
and HBM bandwidth NCCL kernels take from compute (a few percent for large transfers).
Hardware without an intra-node link has one lane, as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx

from .collectives import find_collectives, group_label, is_wait, started_by


@dataclass
class Interval:
    stream: str  # "compute" or the link of a communication lane (comm_cost.INTRA_NODE, ...)
    start: float
    end: float
    label: str


@dataclass
class GroupComm:
    """Communication of one process group (by mesh dim label), or of one kind of collective,
    in a schedule."""

    link: str
    count: int = 0
    bytes: int = 0  # bytes each rank sends (ring algorithms)
    seconds: float = 0.0  # transfer time on its lane
    exposed_s: float = 0.0  # compute-stream time spent waiting for this group's transfers


@dataclass
class Schedule:
    makespan: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    comm_bytes: int = 0  # bytes each rank sends (ring algorithms)
    intervals: list[Interval] = field(default_factory=list)
    by_group: dict[str, GroupComm] = field(default_factory=dict)  # group label -> totals
    by_kind: dict[str, GroupComm] = field(default_factory=dict)  # "all_to_all", ... -> totals


_SEND_FACTOR = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0, "all_to_all": 1.0}


def simulate(graph: fx.Graph | fx.GraphModule, hw, node_cost=None, comm_cost=None,
             link_of=None, labels: dict[str, str] | None = None,
             collectives: list | None = None) -> Schedule:
    """Timeline of ``graph`` on hardware ``hw`` (see module doc).

    ``node_cost(node)`` / ``comm_cost(collective)`` / ``link_of(collective)`` override the
    cost model and the link rule (tests use them to build hand-computed schedules).
    ``labels``: {group name: label} for ``Schedule.by_group`` where known
    (simplesharded.mesh.group_labels); other groups get collectives.group_label.
    ``collectives``: the graph's (find_collectives), when the caller has them.
    """
    from .comm_cost import collective_time, group_link
    from .compute_cost import node_time

    graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
    node_cost = node_cost or (lambda n: node_time(n, hw))
    links: dict[str, str] = {}  # group name -> link; resolving a group is not free
    labels = dict(labels or {})
    if link_of is None:
        def link_of(c):
            if c.group_name not in links:
                links[c.group_name] = group_link(c.group_name, hw)
            return links[c.group_name]
    comm_cost = comm_cost or (lambda c: collective_time(c, hw, link=link_of(c)))
    by_start = {c.start: c for c in (find_collectives(graph) if collectives is None
                                     else collectives)}
    # start node -> (transfer end, its group's and its kind's totals)
    done: dict[fx.Node, tuple[float, GroupComm, GroupComm]] = {}
    sched = Schedule()
    now = 0.0
    lane_free: dict[str, tuple] = {}  # link -> its last transfer's (end, group, kind)
    for node in graph.nodes:
        if node in by_start:
            c = by_start[node]
            t, lane = comm_cost(c), link_of(c)
            if c.group_name not in labels:
                labels[c.group_name] = group_label(c.group_name)
            g = sched.by_group.setdefault(labels[c.group_name], GroupComm(lane))
            k = sched.by_kind.setdefault(c.kind, GroupComm(lane))
            begin = max(now, lane_free.get(lane, (0.0,))[0])
            lane_free[lane] = done[node] = (begin + t, g, k)
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
            sent = int(_SEND_FACTOR[c.kind] * full * (n - 1) / n)
            sched.comm_bytes += sent
            for tally in (g, k):
                tally.count, tally.bytes = tally.count + 1, tally.bytes + sent
                tally.seconds += t
            sched.intervals.append(Interval(lane, begin, begin + t, c.kind))
        elif is_wait(node) and started_by(node) in done:
            end, g, k = done[started_by(node)]
            if end > now:
                sched.exposed_comm_s += end - now
                g.exposed_s += end - now
                k.exposed_s += end - now
                now = end
        else:
            t = node_cost(node)
            if t > 0:
                sched.intervals.append(Interval("compute", now, now + t, _label(node)))
                sched.compute_s += t
                now += t
    comm_end, *last = max(lane_free.values(), key=lambda e: e[0], default=(0.0, None, None))
    sched.makespan = max(now, comm_end)
    if comm_end > now:  # transfers still running at the end: the last one's group waits
        sched.exposed_comm_s += comm_end - now
        for tally in last:
            tally.exposed_s += comm_end - now
    return sched


def _label(node: fx.Node) -> str:
    name = getattr(node.target, "__name__", None)  # str() only when needed: not free
    return (str(node.target) if name is None else name).split(".")[0]
