"""The order in which each pipeline rank runs its stages' forwards and backwards, per schedule.

``rank_orders(schedule, pp, n_stages, n_microbatches)``: for each pp rank, its list of
:class:`Action` (``"F"`` or ``"B"``, stage, micro-batch) in the order the schedule runs them.
Derived here from the published algorithms, not from torch's schedule objects (building those
needs stages on a process group):

- ``1F1B``: one stage per rank. Rank ``r`` runs ``min(pp - 1 - r, m)`` warm-up forwards, then
  alternates one forward and one backward, then the remaining backwards; at most ``pp - r``
  micro-batches are in flight on it.
- ``Interleaved1F1B``: ``v = n_stages / pp`` stages per rank, stage ``s`` on rank ``s % pp``.
  Forwards go through the rank's stages in rounds of ``pp`` micro-batches (stage order),
  backwards likewise in reverse stage order; warm-up is ``(v - 1) pp + 2 (pp - 1 - r)``
  forwards (the Megatron-LM interleaved schedule, which torch's Interleaved1F1B follows),
  so more micro-batches are in flight than under 1F1B but the bubble shrinks by ``v``.

The zero-bubble schedules are not modelled: compiled stages run the whole backward in the
input-gradient step (simplesharded/pipeline/pipelining.py), so their weight steps would be empty.
"""
from __future__ import annotations

from dataclasses import dataclass

MODELLED = ("1F1B", "Interleaved1F1B")


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    stage: int
    microbatch: int


def stage_rank(schedule: str, n_stages: int, pp: int) -> list[int]:
    """The pp rank of each stage: stage ``s`` on rank ``s % pp`` (both schedules modelled)."""
    _check(schedule, pp, n_stages, None)
    return [s % pp for s in range(n_stages)]


def rank_orders(schedule: str, pp: int, n_stages: int, n_microbatches: int) -> list[list[Action]]:
    """Each pp rank's actions in run order (module doc)."""
    _check(schedule, pp, n_stages, n_microbatches)
    m = n_microbatches
    if schedule == "1F1B":
        return [_one_f_one_b(r, pp, m) for r in range(pp)]
    return [_interleaved(r, pp, n_stages // pp, m) for r in range(pp)]


def _check(schedule: str, pp: int, n_stages: int, m: int | None) -> None:
    if schedule not in MODELLED:
        raise ValueError(f"pipeline schedule {schedule!r} is not modelled by the planner; it "
                         f"models {list(MODELLED)}")
    if schedule == "1F1B" and n_stages != pp:
        raise ValueError(f"1F1B runs one stage per rank: {n_stages} stages on {pp} ranks")
    if n_stages % pp:
        raise ValueError(f"{n_stages} stages do not split evenly over {pp} pipeline ranks")
    if m is not None and schedule == "Interleaved1F1B" and m % pp:
        raise ValueError(f"Interleaved1F1B runs micro-batches in rounds of {pp}: {m} is not a "
                         f"multiple")


def _one_f_one_b(r: int, pp: int, m: int) -> list[Action]:
    warm = min(pp - 1 - r, m)
    out = [Action("F", r, i) for i in range(warm)]
    for i in range(m - warm):
        out += [Action("F", r, warm + i), Action("B", r, i)]
    out += [Action("B", r, i) for i in range(m - warm, m)]
    return out


def _interleaved(r: int, pp: int, v: int, m: int) -> list[Action]:
    total = m * v  # each rank runs every micro-batch once per local stage

    def fwd(i: int) -> Action:  # the i-th forward of rank r: rounds of pp micro-batches
        chunk = (i // pp) % v
        return Action("F", chunk * pp + r, (i // (pp * v)) * pp + i % pp)

    def bwd(i: int) -> Action:  # backwards visit the rank's stages last to first
        chunk = v - 1 - (i // pp) % v
        return Action("B", chunk * pp + r, (i // (pp * v)) * pp + i % pp)

    warm = min((v - 1) * pp + 2 * (pp - 1 - r), total)
    out = [fwd(i) for i in range(warm)]
    for i in range(total - warm):
        out += [fwd(warm + i), bwd(i)]
    out += [bwd(i) for i in range(total - warm, total)]
    return out
