"""From the runs of ``python -m simplesharded.tools.bench`` to what it prints: one row per
variant (medians over repetitions, ratios against the reference variants that ran, the
planner's predicted peak memory), the markdown table, the parity of the variants' first losses
and the issue's targets."""
from __future__ import annotations

import statistics

from simplesharded.tools.bench_run import PARITY_STEPS, RunResult
from simplesharded.tools.bench_variants import BenchArgs, is_quantized, ss_backend

# Rank 0's losses of the first PARITY_STEPS steps (bench_run.py) must agree within PARITY_RTOL.
PARITY_RTOL = 1e-4
# The × columns (variant → column label); a column appears when its variant ran.
RATIO_REFS = {"fsdp2_eager": "fsdp2_eager", "compute_floor": "compute_floor",
              "compute_floor_inductor": "floor inductor",
              "compute_floor_concurrent": "floor concurrent",
              "compute_floor_concurrent_compiled": "floor concurrent compiled"}
# The inductor floor's ratio only means something for variants that inductor compiles; the
# others show "–" in that column (an inductor floor under an eager or aot_eager variant would
# mix kernel fusion into the comparison of communication).
INDUCTOR_VARIANTS = ("fsdp2_compiled", "ddp_inductor", "compute_floor_inductor")  # and ss_inductor*


def ratio_applies(ref: str, variant: str) -> bool:
    """Whether ``variant``'s row gets a ratio against reference variant ``ref``."""
    if ref != "compute_floor_inductor":
        return True
    backend = ss_backend(variant)
    return variant in INDUCTOR_VARIANTS or (backend is not None
                                            and backend.compiler == "inductor")


def summarize(results: dict[str, list[RunResult]], args: BenchArgs) -> list[dict]:
    rows = []
    for variant, runs in results.items():
        ok = [r for r in runs if not r.error and r.step_s]
        if not ok:
            rows.append({"variant": variant, "error": runs[0].error if runs else "not run"})
            continue
        med = statistics.median(statistics.median(r.step_s) for r in ok)
        rows.append({"variant": variant, "step_ms": 1e3 * med,
                     "compile_s": max(0.0, ok[0].first_step_s - med),
                     "collectives_per_step": ok[0].collectives_per_step,
                     "peak_mem_mb": max(r.peak_mem_mb for r in ok),
                     "step_mem_mb": max(r.step_mem_mb for r in ok), "reps": len(ok),
                     "main_cpu_ms": 1e3 * statistics.median(r.main_cpu_s for r in ok),
                     "other_cpu_ms": 1e3 * statistics.median(r.other_cpu_s for r in ok),
                     "page_faults": statistics.median(r.page_faults for r in ok),
                     "copied_mb": max(r.copied_mb for r in ok),
                     "cast_mb": max(r.cast_mb for r in ok),
                     "copied_other_mb": max(r.copied_other_mb for r in ok),
                     "wire_mb": max(r.wire_mb for r in ok),
                     "losses": [r.losses for r in ok]})
    base = {r["variant"]: r.get("step_ms") for r in rows}
    for r in rows:
        if "step_ms" in r:
            for ref in RATIO_REFS:
                if base.get(ref) and ratio_applies(ref, r["variant"]):
                    r[f"x_{ref}"] = (_paired_ratio(results[r["variant"]], results[ref])
                                     or r["step_ms"] / base[ref])
    return rows


def _paired_ratio(runs: list[RunResult], ref_runs: list[RunResult]) -> float | None:
    """The median over repetitions of a variant's median step over the reference's in the same
    repetition; None unless both ran every repetition. A repetition runs every variant back
    to back, so pairing cancels what drifts between repetitions (the machine's speed moves the
    floor by up to 5 % between them), which a ratio of the two overall medians does not."""
    if len(runs) != len(ref_runs) or any(r.error or not r.step_s for r in runs + ref_runs):
        return None
    return statistics.median(statistics.median(a.step_s) / statistics.median(b.step_s)
                             for a, b in zip(runs, ref_runs))


def format_table(rows: list[dict], args: BenchArgs) -> str:
    refs = [ref for ref in RATIO_REFS if any(f"x_{ref}" in r for r in rows)]
    cols = (["variant", "step ms"] + [f"× {RATIO_REFS[ref]}" for ref in refs]
            + ["collectives/step", "collective MB/step", "compile s", "peak tensor MB/rank",
               "of it the step's MB/rank",
               "planned MB/rank",
               "CPU ms/step main + other threads", "page faults/step",
               "copied MB/step compute thread + others (of it casts)"]
            + [f"loss step {k + 1}" for k in range(PARITY_STEPS)])
    lines = ["| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error']} |" + " |" * (len(cols) - 2))
            continue
        ratios = "".join(f"{r[f'x_{ref}']:.2f} | " if f"x_{ref}" in r else "– | "
                         for ref in refs)
        first = (r.get("losses") or [[]])[0]  # the first repetition's
        losses = " | ".join(f"{first[k]:.6f}" if k < len(first) else "–"
                            for k in range(PARITY_STEPS))
        planned = f"{r['planned_mb']:.0f}" if "planned_mb" in r else "–"
        lines.append(f"| {r['variant']} | {r['step_ms']:.0f} | {ratios}"
                     f"{r['collectives_per_step']} | {r.get('wire_mb', 0):.1f} | "
                     f"{r['compile_s']:.1f} | {r['peak_mem_mb']:.0f} | "
                     f"{r.get('step_mem_mb', 0):.0f} | {planned} | "
                     f"{r.get('main_cpu_ms', 0):.0f} + {r.get('other_cpu_ms', 0):.0f} | "
                     f"{r.get('page_faults', 0):.0f} | "
                     f"{r.get('copied_mb', 0) - r.get('copied_other_mb', 0):.0f} + "
                     f"{r.get('copied_other_mb', 0):.0f} ({r.get('cast_mb', 0):.0f}) | {losses} |")
    return "\n".join(lines)


def parity(rows: list[dict], rtol: float = PARITY_RTOL) -> tuple[bool, str]:
    """Whether every run's loss at each of the first PARITY_STEPS steps agrees with the first
    run's within ``rtol`` (see PARITY_STEPS for who takes part in which step): else the
    variants did not compute the same thing. Quantized variants compute another step (their
    gathered weights or reduced gradients are rounded): they take no part; their largest
    relative difference from that first run is said instead. Returns (agree, one line)."""
    bad, said, apart = [], [], []
    for k in range(PARITY_STEPS):
        losses = [(r["variant"], run[k] if k < len(run) else float("nan"))
                  for r in rows if k == 0 or not r["variant"].startswith("compute_floor")
                  for run in r.get("losses", ())]
        quantized = [(v, x) for v, x in losses if is_quantized(v)]
        losses = [(v, x) for v, x in losses if not is_quantized(v)]
        if not losses:
            continue
        ref_name, ref = losses[0]
        apart += [(abs(x - ref) / abs(ref), k, v) for v, x in quantized]
        off = [(v, x) for v, x in losses if not abs(x - ref) <= rtol * abs(ref)]  # NaN is off
        bad += [f"step {k + 1}: {v} {x:.6f} vs {ref_name} {ref:.6f}" for v, x in off]
        if not off:
            spread = max(abs(x - ref) for _, x in losses) / abs(ref)
            said.append(f"step {k + 1}{' (no floors)' if k else ''}: {len(losses)} runs agree "
                        f"with {ref_name} ({ref:.6f}) within {spread:.1e}")
    quantized = ""
    if apart:
        worst = {}
        for d, k, v in apart:  # NaN counts as the worst
            if v not in worst or not d <= worst[v][0]:
                worst[v] = (d, k)
        quantized = ("; quantized, not compared: " + ", ".join(
            f"{v} {d:.1e} (step {k + 1})" for v, (d, k) in worst.items()))
    if bad:
        return False, f"PARITY MISMATCH (rtol {rtol}): " + "; ".join(bad) + quantized
    return True, (f"parity (rtol {rtol}): " + "; ".join(said) + quantized if said
                  else "parity: no losses (no variant ran)")


def targets(rows: list[dict]) -> list[str]:
    """The issue's targets, each as measured: PASS/MISS with the ratio."""
    ms = {r["variant"]: r["step_ms"] for r in rows if "step_ms" in r}
    checks = [("ss_aot_eager_autobucketing", "fsdp2_eager", 0.70),
              ("ss_aot_eager_autobucketing", "compute_floor", 1.15),
              ("ss_aot_eager_autobucketing", "ss_aot_eager_upstreambucketing", 0.95),
              ("ss_inductor_autobucketing", "ss_inductor_upstreambucketing", 0.95)]
    out = []
    for a, b, limit in checks:
        if a in ms and b in ms:
            ratio = ms[a] / ms[b]
            out.append(f"{'PASS' if ratio <= limit else 'MISS'} {a} / {b} = {ratio:.2f} "
                       f"(target ≤ {limit})")
    return out


# The variants whose step the planner (simplesharded/tools/forecast.py) models without
# calibration, at either bucket storage. The autobucketing plan's buckets follow the ranks'
# calibrated cost model, which the bench's parent process does not hold, so it has no
# prediction here (`python -m simplesharded.tools.forecast --hardware <calibration file>`
# gives one).
FORECAST = ("ss_aot_eager", "ss_aot_eager_blockbucketing", "ss_ragged_aot_eager_blockbucketing")


def forecast_peaks(args: BenchArgs, variants: list[str]) -> dict[str, float]:
    """{variant: per-rank peak MB the planner predicts for it}, for the variants of FORECAST on
    a CPU mesh without tp, when the trainer knows the model (its config describes the step):
    one trace per storage (``--parallelism.storage``) the variants use."""
    from simplesharded.tools.bench_variants import storage_of

    wanted = [v for v in variants if v in FORECAST]
    if not wanted or args.tp > 1 or args.device != "cpu":
        return {}
    from simplesharded.trainer.config import load_config
    from simplesharded.tools.forecast import predicted_peak_bytes
    from simplesharded.trainer import check_static
    by_storage: dict[str, dict[str, str]] = {}  # storage → variants
    for v in wanted:
        by_storage.setdefault(storage_of(v), {})[v] = str(ss_backend(v))
    out = {}
    for storage, names in sorted(by_storage.items()):
        try:
            cfg = load_config(None, ["--model.name", args.model, "--model.flavor", args.flavor,
                                     "--training.global_batch_size", str(args.global_batch),
                                     "--training.seq_len", str(args.seq_len),
                                     "--training.dataset_path", "",
                                     "--activation_checkpoint.mode", "none",
                                     "--parallelism.context_parallel_degree", str(args.cp),
                                     "--parallelism.storage", storage])
            cfg = check_static(cfg, args.world_size)
        except ValueError:  # a model the trainer does not build (hf_llama)
            return {}
        peaks = predicted_peak_bytes(cfg, args.world_size, sorted(set(names.values())),
                                     "local", args.n_layers)
        out.update({v: peaks[name] / 2**20 for v, name in names.items()})
    return out
