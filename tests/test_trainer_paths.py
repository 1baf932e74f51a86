"""Trainer paths that no other test runs: compiled activation checkpointing (loss
parity with AC off and its lower peak memory), a bf16-params / fp32-reduce compiled run that
trains, and ``training.grad_reduction="avg"`` against the default ``"sum"``.

One spawned job (2 gloo ranks, llama3 debug) builds the trainer's own :class:`Trainer` from
the debug config plus command-line style overrides (``load_config`` + ``check_static``, as
``python -m simplesharded.trainer`` does) once per variant and runs its ``train_step``; the tests
below read its results. One spawn instead of one torchrun launch per variant: the suite has
a time budget.

Why the comparisons must hold:
- Compiled AC (passes/recompute.py tags the annotated blocks' forward ops for recompute)
  recomputes the same ops on the same inputs in backward: the same floating-point program
  as AC off, so the losses agree to 1e-6 relative (bitwise in practice).
- "avg": every rank divides its loss by its local token count and data_parallel pre-divides
  gradients by the dp size; "sum": every rank divides by the global token count and
  gradients are summed. Both give the global mean gradient; here the scales are powers of
  two, so the two programs differ only in where an exact scaling happens (≤ 1e-5 rel).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dist_utils import memo, spawn

LLAMA = str(Path(__file__).resolve().parents[1] / "configs" / "llama3_debug.toml")
# As tests/test_train_e2e.py's COMMON: seq 32, global batch 4, constant lr after 15 warmup
# steps, no validation, no progress bar, 2 of the debug model's 6 blocks (what compiles and
# runs scales with the blocks; no test here depends on their number).
SHALLOW = ["--model.n_layers", "2"]
COMMON = ["--training.seq_len", "32", "--training.global_batch_size", "4",
          "--training.val_every", "0", "--no-metrics.progress_bar",
          "--lr_scheduler.warmup_steps", "15", "--lr_scheduler.decay_type", "constant"]
# Plain aot_eager (the recompute pass that implements compiled AC, no bucketing): the four
# compiles are most of this job's time, and aot_eager compiles ~25 % faster here than
# aot_eager_blockbucketing (which test_train_e2e.py's 30-step run compiles already).
COMPILED = ["--compile.enable", "--compile.backend", "aot_eager"]
AC_STEPS, AVG_STEPS, BF16_STEPS = 5, 3, 30


def _trainer(args: list[str], world: int):
    from simplesharded.trainer.config import load_config
    from simplesharded.trainer import Trainer, check_static
    cfg = check_static(load_config(None, ["--job.config_file", LLAMA, *args]), world)
    return Trainer(cfg, "cpu")


def _losses(trainer, steps: int) -> list[float]:
    return [trainer.train_step()["loss"] for _ in range(steps)]


def _fwd_bwd_peak(trainer) -> int:
    """Peak live tensor bytes of one forward+backward of the trainer's compiled step (shards
    and optimizer state included, see bench_run._step_peak_bytes): the lower of two
    measurements, as the profiler's running total also counts allocations of other threads
    (gloo's), which only add (a few MB between runs here)."""
    from simplesharded.tools.bench_run import _step_peak_bytes
    inputs, labels = next(trainer.data.train)

    def step():
        trainer.forward_loss(trainer.step_fn, inputs, labels).backward()

    return min(_step_peak_bytes(step, trainer.model, trainer.optimizer, "cpu")[0]
               for _ in range(2))


def job(rank: int, world: int, parts=("ac", "reduction", "bf16")) -> dict:
    out: dict = {}
    for mode in ("none", "full", "selective") if "ac" in parts else ():
        # seq_len 128 (the debug config's): activations large enough next to the gathered
        # parameters that what AC saves decides the step's peak; all 6 blocks: at 4, selective
        # AC's saving (2-5 MB) was within the profiler's noise from gloo's threads
        t = _trainer([*COMMON, *COMPILED, "--training.seq_len", "128",
                      "--activation_checkpoint.mode", mode], world)
        out[("ac", mode)] = {"losses": _losses(t, AC_STEPS), "peak": _fwd_bwd_peak(t)}
    for red in ("sum", "avg") if "reduction" in parts else ():
        t = _trainer([*COMMON, *SHALLOW, "--training.grad_reduction", red], world)
        out[("reduction", red)] = _losses(t, AVG_STEPS)
    if "bf16" not in parts:
        return out
    # bf16 parameters in compute, fp32 gradient reduction; the debug config's own schedule
    # (lr 1e-3, warmup 5, cosine to 30 steps). Sequences of 16: a CPU without bf16 units
    # multiplies bf16 slowly (a backward matmul here ~8x an fp32 one, in proportion to the
    # tokens), and this run was half the job's time at 32.
    t = _trainer(["--training.seq_len", "16", "--training.global_batch_size", "4",
                  "--training.val_every", "0", "--no-metrics.progress_bar", *COMPILED, *SHALLOW,
                  "--training.steps", str(BF16_STEPS),
                  "--training.mixed_precision_param", "bfloat16",
                  "--training.mixed_precision_reduce", "float32"], world)
    out["bf16"] = _losses(t, BF16_STEPS)
    return out


@memo
def _run():
    return spawn(2, job, timeout_s=400)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.slow
def test_compiled_activation_checkpointing_matches_and_saves_memory():
    """activation_checkpoint.mode full and selective (every 2nd block), compiled with
    aot_eager: 5 steps with the same losses as mode none (≤ 1e-6 rel, every
    rank), and a lower peak of live tensor bytes in one forward+backward of the trainer's
    compiled step on every rank (torch.profiler's memory events, bench_run._step_peak_bytes)."""
    for rank, r in enumerate(_run()):
        ref = r[("ac", "none")]
        assert len(ref["losses"]) == AC_STEPS and all(map(math.isfinite, ref["losses"])), ref
        for mode in ("full", "selective"):
            got = r[("ac", mode)]
            bad = [(i + 1, a, b) for i, (a, b) in enumerate(zip(got["losses"], ref["losses"]))
                   if not _rel(a, b) <= 1e-6]
            assert not bad and len(got["losses"]) == AC_STEPS, (rank, mode, bad)
            assert got["peak"] < ref["peak"], (rank, mode, got["peak"], ref["peak"])


@pytest.mark.slow
def test_grad_reduction_avg_matches_sum():
    """training.grad_reduction avg (local-mean loss, gradients pre-divided by dp) gives the
    same per-step losses as the default sum (global-token-count loss, summed gradients):
    3 eager steps on 2 ranks, ≤ 1e-5 rel."""
    for rank, r in enumerate(_run()):
        ref, got = r[("reduction", "sum")], r[("reduction", "avg")]
        assert len(ref) == len(got) == AVG_STEPS, (ref, got)
        bad = [(i + 1, a, b) for i, (a, b) in enumerate(zip(got, ref)) if not _rel(a, b) <= 1e-5]
        assert not bad, (rank, bad)


@pytest.mark.slow
def test_bf16_params_fp32_reduce_compiled_trains():
    """training.mixed_precision_param bfloat16, mixed_precision_reduce float32, compiled:
    30 steps of the debug config's schedule (lr 1e-3, no raise needed); the mean of the last
    5 losses is at least 20 % below the first."""
    losses = _run()[0]["bf16"]
    assert len(losses) == BF16_STEPS and all(map(math.isfinite, losses)), losses
    last5 = sum(losses[-5:]) / 5
    assert last5 <= 0.8 * losses[0], f"loss fell < 20 %: first {losses[0]}, last 5 {losses[-5:]}"
