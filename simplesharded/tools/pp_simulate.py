"""Simulate one pipeline-parallel step: each pp rank runs its actions (simplesharded/tools/
pp_orders.py) on one compute stream; a forward waits for the previous stage's output and a
backward for the next stage's gradient, each sent point-to-point after the producer finishes
(``p2p_s[k]``: the transfer between stage ``k`` and ``k + 1``, either direction).

A rank's idle time before an action is a *bubble* while the producer is still computing and an
*exposed p2p wait* once it has finished and the transfer is in flight. Each stage has one of
the pipeline's FSDP policies (simplesharded/pipeline/pipelining.py: ``policy``, one for all stages or
one per stage). A stage's FSDP work is inside its costs (the traced graphs of one micro-batch,
with their own exposed waits), except that under ``reduce_once`` and ``gather_once`` its
gradients are reduced once, after its last backward, on the rank's data-parallel link: beside
the rank's later compute, exposed at the end of the step; and under ``gather_once`` its first
forward of the step first gathers its parameters (``gather_s``, on the rank's compute lane:
the forward needs them), its costs then free of the traced gathers.

Memory per stage over time: static state + the stage's working peak + the saved activations of
the micro-batches in flight (from a forward's start to its backward's end), plus under the
deferred policies the unsharded gradient sums (first backward to the reduction's end) and under
``gather_once`` the unsharded parameters (the gather's start to the reduction's end, where the
pipeline releases them). Transfers do not contend with one another (activations are small next
to a link).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

from simplesharded.pipeline.pipelining import DEFERRED, POLICIES
from simplesharded.tools.pp_orders import Action


@dataclass(frozen=True)
class StageCost:
    """One stage, one micro-batch: seconds and bytes (per rank)."""

    fw_s: float
    bw_s: float
    reduce_s: float = 0.0  # the stage's one gradient reduction per step (deferred policies)
    fsdp_exposed_s: float = 0.0  # FSDP waits inside fw_s + bw_s (from the traced graphs)
    act_bytes: int = 0  # saved for backward per micro-batch in flight
    working_bytes: int = 0  # transient peak while one of its actions runs
    static_bytes: int = 0  # parameter shards, gradients, optimizer state
    grad_sum_bytes: int = 0  # unsharded gradient sums held (deferred policies)
    gathered_bytes: int = 0  # unsharded parameters held under gather_once
    gather_s: float = 0.0  # gather_once's gather of the stage's parameters, once per step
    gathers: int = 0  # all-gathers of one micro-batch's forward + backward
    step_gathers: int = 0  # all-gathers once per step (gather_once: one per bucket)
    reductions: int = 0  # reduce-scatters (or all-reduces) of one micro-batch's backward


@dataclass
class Box:
    rank: int
    # "F", "B", "R" (reduction, on the dp link), "G" (gather_once's gather, before the first
    # forward), "wait" (exposed p2p), "bubble"
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float


@dataclass
class PipelineStep:
    step_s: float
    bubble_fraction: float  # idle compute / (pp x step)
    boxes: list[Box]
    exposed_p2p_s: list[float]  # per rank
    exposed_reduce_s: list[float]  # per rank: the reduction beyond its last compute
    exposed_fsdp_s: list[float]  # per rank: FSDP waits inside its actions
    memory: dict[int, list[tuple[float, int]]]  # stage -> (time, bytes) steps
    peak_stage_bytes: dict[int, int]
    peak_rank_bytes: list[int]
    max_in_flight: dict[int, int]  # stage -> most micro-batches saved at once
    gathers: dict[int, int]  # stage -> all-gathers per step
    reductions: dict[int, int]  # stage -> reductions per step
    p2p_sends: int = 0
    by_rank_stages: list[list[int]] = field(default_factory=list)

    @property
    def exposed_comm_s(self) -> list[float]:
        return [a + b + c for a, b, c in zip(self.exposed_p2p_s, self.exposed_reduce_s,
                                             self.exposed_fsdp_s)]


def simulate_pipeline(orders: list[list[Action]], stage_rank: list[int], costs: list[StageCost],
                      p2p_s: list[float], n_microbatches: int,
                      policy: str | Sequence[str] = "every_microbatch") -> PipelineStep:
    """One step of ``orders`` (module doc). ``costs[s]``: stage ``s``'s; ``p2p_s``: one per
    stage boundary (len = stages - 1); ``policy``: every stage's, or one per stage."""
    n_stages, pp, m = len(costs), len(orders), n_microbatches
    policies = [policy] * n_stages if isinstance(policy, str) else list(policy)
    for q in policies:
        if q not in POLICIES:
            raise ValueError(f"pipeline FSDP policy={q!r} is not one of {list(POLICIES)}")
    if len(p2p_s) != n_stages - 1 or len(stage_rank) != n_stages or len(policies) != n_stages:
        raise ValueError("p2p_s needs one entry per stage boundary, stage_rank and a list of "
                         "policies one per stage")
    done: dict[tuple[str, int, int], float] = {}  # action -> compute end
    boxes: list[Box] = []
    free = [0.0] * pp
    gathered: dict[int, float] = {}  # gather_once stage -> its gather's start
    ptr = [0] * pp
    exposed_p2p, exposed_gather = [0.0] * pp, [0.0] * pp
    sends = 0
    while any(ptr[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while ptr[r] < len(orders[r]):
                a = orders[r][ptr[r]]
                dep = _dependency(a, n_stages)
                if dep is not None and dep not in done:
                    break
                if dep is None:
                    produced = arrival = 0.0
                else:
                    produced = done[dep]
                    remote = stage_rank[dep[1]] != r
                    arrival = produced + (p2p_s[min(a.stage, dep[1])] if remote else 0.0)
                    sends += remote
                start = max(free[r], arrival)
                # idle before it: a bubble while the producer computes, then an exposed p2p
                # wait while its output travels
                t = free[r]
                for until, kind in ((produced, "bubble"), (arrival, "wait")):
                    end = min(start, max(t, until))
                    if end > t:
                        boxes.append(Box(r, kind, a.stage, a.microbatch, t, end))
                        exposed_p2p[r] += (end - t) * (kind == "wait")
                        t = end
                c = costs[a.stage]
                if (a.kind == "F" and policies[a.stage] == "gather_once"
                        and a.stage not in gathered):  # the step's first forward gathers
                    gathered[a.stage] = start
                    boxes.append(Box(r, "G", a.stage, -1, start, start + c.gather_s))
                    exposed_gather[r] += c.gather_s
                    start += c.gather_s
                end = start + (c.fw_s if a.kind == "F" else c.bw_s)
                boxes.append(Box(r, a.kind, a.stage, a.microbatch, start, end))
                done[(a.kind, a.stage, a.microbatch)] = end
                free[r] = end
                ptr[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the pipeline orders deadlock: every rank waits on another")

    # deferred policies: one reduction per stage after its last backward, on the rank's dp link
    lane = [0.0] * pp
    reduce_end: dict[int, float] = {}
    for s in sorted(range(n_stages), key=lambda s: done[("B", s, m - 1)]):
        if policies[s] in DEFERRED:
            r = stage_rank[s]
            begin = max(lane[r], max(done[("B", s, i)] for i in range(m)))
            lane[r] = reduce_end[s] = begin + costs[s].reduce_s
            boxes.append(Box(r, "R", s, -1, begin, reduce_end[s]))
    step = max(max(free), max(lane))
    exposed_reduce = [max(0.0, lane[r] - free[r]) for r in range(pp)]
    busy = sum(b.end - b.start for b in boxes if b.kind in ("F", "B"))

    by_rank = [[s for s in range(n_stages) if stage_rank[s] == r] for r in range(pp)]
    exposed_fsdp = [m * sum(costs[s].fsdp_exposed_s for s in by_rank[r]) + exposed_gather[r]
                    for r in range(pp)]
    memory, in_flight = _memory(boxes, costs, policies, gathered, reduce_end)
    peaks = {s: max(b for _, b in curve) for s, curve in memory.items()}
    rank_peaks = [_rank_peak([memory[s] for s in by_rank[r]],
                             [costs[s].working_bytes for s in by_rank[r]]) for r in range(pp)]
    gathers = {s: costs[s].gathers * m + costs[s].step_gathers for s in range(n_stages)}
    reductions = {s: costs[s].reductions * m if policies[s] not in DEFERRED
                  else int(costs[s].reduce_s > 0 or costs[s].reductions > 0)
                  for s in range(n_stages)}
    return PipelineStep(step, 1.0 - busy / (pp * step) if step else 0.0, boxes, exposed_p2p,
                        exposed_reduce, exposed_fsdp, memory, peaks, rank_peaks, in_flight,
                        gathers, reductions, sends, by_rank)


def _dependency(a: Action, n_stages: int) -> tuple[str, int, int] | None:
    """The action whose result ``a`` needs from another stage (or its own forward)."""
    if a.kind == "F":
        return ("F", a.stage - 1, a.microbatch) if a.stage > 0 else None
    if a.stage < n_stages - 1:
        return ("B", a.stage + 1, a.microbatch)
    return ("F", a.stage, a.microbatch)


def _memory(boxes, costs, policies, gathered, reduce_end):
    """{stage: [(time, bytes)] after each change} and {stage: most micro-batches in flight}."""
    events: dict[int, list[tuple[float, int, int]]] = defaultdict(list)  # (t, d bytes, d count)
    first_b = {}
    for b in boxes:
        c = costs[b.stage] if b.kind in ("F", "B") else None
        if b.kind == "F":  # the forward's saved activations, until its backward is done
            events[b.stage].append((b.start, c.act_bytes, 1))
        elif b.kind == "B":
            events[b.stage].append((b.end, -c.act_bytes, -1))
            first_b[b.stage] = min(first_b.get(b.stage, b.start), b.start)
    for s, c in enumerate(costs):
        if policies[s] in DEFERRED and s in first_b:
            events[s] += [(first_b[s], c.grad_sum_bytes, 0), (reduce_end[s], -c.grad_sum_bytes, 0)]
        if s in gathered:
            events[s] += [(gathered[s], c.gathered_bytes, 0), (reduce_end[s], -c.gathered_bytes, 0)]
    memory, in_flight = {}, {}
    for s, c in enumerate(costs):
        level, count, most = c.static_bytes + c.working_bytes, 0, 0
        curve = [(0.0, level)]
        # frees before allocations at the same instant: a backward's end and the next forward
        for t, d, k in sorted(events[s], key=lambda e: (e[0], e[1] > 0)):
            level, count = level + d, count + k
            most = max(most, count)
            curve.append((t, level))
        memory[s], in_flight[s] = curve, most
    return memory, in_flight


def _rank_peak(curves, workings) -> int:
    """Peak of a rank's stages together: their curves summed, with one working peak (the
    largest) instead of each stage's, as a rank runs one action at a time."""
    times = sorted({t for curve in curves for t, _ in curve})
    overlap = sum(workings) - max(workings, default=0)
    return int(max((sum(_at(curve, t) for curve in curves) for t in times), default=0)
               - overlap)


def _at(curve, t) -> int:
    level = curve[0][1]
    for when, b in curve:
        if when > t:
            break
        level = b
    return level
