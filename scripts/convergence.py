"""Train the same model once per variant (same seed, same data, same steps) and compare their
final validation losses and loss curves: does a quantization (or float8) converge as the
unquantized run does?

    python scripts/convergence.py [--steps 300] [--variants unquantized int8_gathers ...]
        [--ngpu 2] [--out benchmarks/convergence] [-- extra trainer args]

Each variant is one ``./run_train.sh`` (the README's command, so the config, the launcher and
the compile are a user's) with ``--compile.enable`` and the variant's keys; its metrics land
in ``OUT/runs/NAME``. Prints one row per variant: final validation loss, its relative
difference from the first variant's, and whether that is within ``--rtol`` (1 %); writes
``OUT.png`` (training losses, smoothed, and validation losses of every variant in one figure)
and ``OUT.json`` (the curves); beside it, the mean training loss of the last ``--tail`` steps
against the reference's. Exits 1 when a variant's final validation loss is off by more
than ``--rtol`` or a run failed. ``--plot-only`` redraws from the runs already there.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> the trainer keys it adds to the compiled baseline
VARIANTS = {
    "unquantized": [],
    "int8_gathers": ["--compile.quantize_gathers", "int8"],
    "fp8_gathers": ["--compile.quantize_gathers", "fp8"],
    "int8_grads": ["--compile.quantize_grads", "int8"],
    "bf16_grads": ["--compile.quantize_grads", "bf16"],
    "int8_gathers_and_grads": ["--compile.quantize_gathers", "int8",
                               "--compile.quantize_grads", "int8"],
    "float8_training": ["--training.float8"],
}


def read_metrics(folder: str) -> tuple[dict[int, float], dict[int, float]]:
    """({step: training loss}, {step: validation loss}) of a run's metrics.jsonl; a step's
    last record counts."""
    train, val = {}, {}
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            if "loss" in r:
                train[int(r["step"])] = float(r["loss"])
            if "val_loss" in r:
                val[int(r["step"])] = float(r["val_loss"])
    return train, val


def run(name: str, folder: str, ns, extra: list[str]) -> bool:
    cmd = ["./run_train.sh", "--compile.enable", "--training.steps", str(ns.steps),
           "--training.val_every", str(ns.val_every), "--training.val_steps", str(ns.val_steps),
           "--job.dump_folder", folder, *VARIANTS[name], *extra]
    print(f"[{name}] NGPU={ns.ngpu} {' '.join(cmd)}", flush=True)
    with open(os.path.join(os.path.dirname(folder), f"{name}.log"), "w") as log:
        p = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "NGPU": str(ns.ngpu)},
                           stdout=log, stderr=subprocess.STDOUT)
    if p.returncode:
        print(f"[{name}] failed (exit {p.returncode}): see {log.name}", flush=True)
    return p.returncode == 0


def tail_mean(train: dict, n: int) -> float:
    """The mean training loss of the last ``n`` steps: less of one batch's noise than the
    final validation loss alone."""
    steps = sorted(train)[-n:]
    return sum(train[s] for s in steps) / len(steps)


def smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def plot(curves: dict, path: str, smoothing: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, c in curves.items():
        steps = sorted(int(s) for s in c["train"])
        line, = ax_t.plot(steps, smooth([c["train"][s] for s in steps], smoothing), lw=1.2,
                          label=name)
        vsteps = sorted(int(s) for s in c["val"])
        ax_v.plot(vsteps, [c["val"][s] for s in vsteps], marker="o", ms=3, lw=1.2,
                  color=line.get_color(), label=name)
    ax_t.set(title=f"training loss ({smoothing}-step mean)", xlabel="step", ylabel="loss")
    ax_v.set(title="validation loss", xlabel="step", ylabel="loss")
    for ax in (ax_t, ax_v):
        ax.grid(alpha=0.3)
    ax_v.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--val-every", type=int, default=50)
    ap.add_argument("--val-steps", type=int, default=8)
    ap.add_argument("--ngpu", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS)[:-1],
                    help=f"the first is the reference; choices: {list(VARIANTS)}")
    ap.add_argument("--rtol", type=float, default=0.01)
    ap.add_argument("--smoothing", type=int, default=10)
    ap.add_argument("--tail", type=int, default=50,
                    help="also compare the mean training loss of the last N steps")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "convergence"))
    ap.add_argument("--plot-only", action="store_true")
    ns = ap.parse_args(argv)
    bad = [v for v in ns.variants if v not in VARIANTS]
    if bad:
        ap.error(f"--variants: {bad} not in {list(VARIANTS)}")

    runs = os.path.join(os.path.abspath(ns.out), "runs")
    os.makedirs(runs, exist_ok=True)
    ok = True
    curves = {}
    for name in ns.variants:
        folder = os.path.join(runs, name)
        if not ns.plot_only:
            ok = run(name, folder, ns, extra) and ok
        if os.path.exists(os.path.join(folder, "metrics.jsonl")):
            train, val = read_metrics(folder)
            curves[name] = {"train": train, "val": val}
    if not curves:
        print("no run produced metrics")
        return 1

    ref_name = ns.variants[0]
    ref = curves.get(ref_name)
    print(f"\n{'variant':<24} {'final val loss':>14} {'vs ' + ref_name:>18}  "
          f"within {ns.rtol:.0%}   last {ns.tail} steps' training loss, vs {ref_name}")
    for name, c in curves.items():
        last = max(c["val"]) if c["val"] else None
        v = c["val"][last] if last is not None else float("nan")
        tail = tail_mean(c["train"], ns.tail)
        if ref and ref["val"] and last is not None:
            r = ref["val"][max(ref["val"])]
            rel = (v - r) / r
            good = abs(rel) <= ns.rtol
            ok = ok and good
            tail_rel = (tail - tail_mean(ref["train"], ns.tail)) / tail_mean(ref["train"], ns.tail)
            print(f"{name:<24} {v:>14.4f} {rel:>+17.2%}  {'yes' if good else 'NO':>9}   "
                  f"{tail:.4f} {tail_rel:+.2%}")
        else:
            ok = False
            print(f"{name:<24} {v:>14.4f} {'(no reference)':>18}")
    with open(os.path.abspath(ns.out) + ".json", "w") as f:
        json.dump({"steps": ns.steps, "ngpu": ns.ngpu, "extra": extra, "curves": curves}, f)
    plot(curves, os.path.abspath(ns.out) + ".png", ns.smoothing)
    print(f"\nwrote {os.path.abspath(ns.out)}.png and .json")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
