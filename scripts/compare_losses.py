"""Per-step losses of two training runs side by side, and whether they agree.

    python scripts/compare_losses.py RUN_A RUN_B [--rtol 1e-4] [--steps N]

RUN_A and RUN_B are the runs' ``job.dump_folder`` (or their ``metrics.jsonl``). Prints one row
per step both logged (loss A, loss B, relative difference |A - B| / |B|) and the largest
difference; exits 1 when a step differs by more than ``--rtol`` or the runs share no step.
Each run's last record for a step counts (a resumed run logs a step again).
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def losses(path: str) -> dict[int, float]:
    """{step: loss} of a run's metrics.jsonl (records without a loss, e.g. validation only,
    are skipped)."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    out = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                if "loss" in record:
                    out[int(record["step"])] = float(record["loss"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_a")
    ap.add_argument("run_b")
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=0, help="only the first N steps (0: all)")
    ns = ap.parse_args(argv)
    try:
        a, b = losses(ns.run_a), losses(ns.run_b)
    except (OSError, ValueError, KeyError) as e:
        ap.error(str(e))
    steps = sorted(set(a) & set(b))
    if ns.steps:
        steps = steps[:ns.steps]
    if not steps:
        print(f"error: {ns.run_a} and {ns.run_b} logged no step in common", file=sys.stderr)
        return 1
    print(f"| step | {ns.run_a} | {ns.run_b} | rel diff |\n|---:|---:|---:|---:|")
    worst = 0.0
    for s in steps:
        rel = abs(a[s] - b[s]) / abs(b[s])
        worst = max(worst, rel)
        print(f"| {s} | {a[s]:.6f} | {b[s]:.6f} | {rel:.1e} |")
    ok = worst <= ns.rtol
    print(f"\n{len(steps)} steps, max rel diff {worst:.1e}: "
          + ("within" if ok else "ABOVE") + f" rtol {ns.rtol:g}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
