"""The GPU check (``scripts/gpu_check.sh``): what a first run on one accelerator executes, check by
check, within a time budget (480 s by default: a lent GPU's session is short), and one results
file. ``--cpu`` (or a machine without an accelerator) runs the same checks on CPU with gloo
and a fake process group, at CPU sizes; what only an accelerator can answer says SKIP and why.

Each check runs in a process of its own with a timeout (a crash or a hang is that check's FAIL,
the others still run); a check the budget has no room left for is a SKIP. The checks (their
code: scripts/gpu_checks.py) and what they mean: ``CHECKS`` below, README "Measuring", and
benchmarks/gpu/README.md.

The results file (markdown: ``--out``; default ``$OUT/<date>_<commit>.md`` when $OUT is set,
else ``benchmarks/gpu/<date>_<commit>.md`` on an accelerator and the temp directory on CPU)
holds the versions, one table row per result (PASS / FAIL / SKIP, the figure or why it was
skipped), each check's time, and the checks' output. Exit status 1 if any row failed.

Nothing is installed: the checkout is imported from its root (simplesharded/__init__.py puts
passes/ and models/ in place), so the machine's own python with torch runs it.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (ROOT, os.path.join(ROOT, "scripts")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

STATUSES = ("PASS", "FAIL", "SKIP")
ROW = "@@row "  # a child's result line: ROW + json [status, name, detail]

# name: (what it checks, seconds it may take on an accelerator, on CPU). In the order the
# results file lists them, and started in it (the timed ones after the rest: TIMED): the budget
# cuts the last ones first.
CHECKS = {
    "parity": ("every backend against the uncompiled run at one rank on the device's own "
               "process-group backend, with ragged buckets (the trainer's default storage) and "
               "with one shard per parameter (the library's)", 180, 420),
    "fake8": ("the trainer's step on a fake process group of 8 ranks: collectives in inductor's "
              "code in our passes' order, fused attention in bf16, peak memory against the "
              "planner with the cuBLAS workspaces measured apart", 300, 360),
    "train": ("bf16 + full activation checkpointing + compile through the trainer at one rank "
              "in deterministic mode: a checkpoint at step 10, a resume to step 15 with the "
              "uninterrupted run's losses bit for bit, and a second run equal bit for bit",
              240, 300),
    "moe": ("the MoE layer's sorted path in bf16 through torch._grouped_mm (against the dense "
            "bmm path), and the deepseek_v3 model compiled through the trainer at one rank",
            150, 240),
    "cp_attention": ("context parallelism's attention ([s, S] boolean mask, GQA) at a long "
                     "sequence: the fused kernel torch chooses (the math kernel is a FAIL), "
                     "and the 128k config's shape on fused kernels only", 120, 120),
    "bench": ("a Llama 3 1B-shaped model through the trainer at one rank, bf16 with TF32 on, "
              "inductor: tokens/s, MFU against the peak of the dtype that runs, memory",
              240, 120),
    "calibrate": ("matmul FLOP/s in each compute dtype (bf16, TF32, fp32) against the "
                  "published peaks, and python -m simplesharded.tools.calibrate", 120, 180),
    "init": ("init_sharded on device shards: 2 gloo ranks equal 1 rank bit for bit (llama3, "
             "tp 2, deepseek_v3 at ep 2), 1 rank equals the plain model", 120, 240),
    "parity_gloo2": ("the parity check on 2 gloo processes with device tensors: real "
                     "collectives through our passes (SKIP where gloo cannot run DTensor's "
                     "collectives on the device)", 90, 300),
    "copy_stream": ("host offload's copies (params: shards to the device, gradients to the "
                    "host; optimizer: the resident copies' refresh, gradients to the host): "
                    "the same numbers as without offload, compiled, and in a profiled step "
                    "the copies each way on streams of their own, under params part of their "
                    "time beside kernels", 120, 120),
    # not in the default run (DEFAULT_CHECKS): `--checks float8 offload` runs them
    "float8": ("the bench's 1B in bf16 beside its blocks' Linears in float8 (float8 "
               "matmuls, weights gathered in float8): tokens/s side by side", 360, 120),
    "offload": ("the bench's 1B without offload beside parallelism.offload params: peak "
                "device memory and tokens/s side by side, the same losses", 360, 120),
}
# Checks whose figures are timings: each runs alone, after the others (which may run side by
# side, --jobs: their figures are per process, and their time is mostly the compiler's on the
# host's cores)
TIMED = ("bench", "calibrate", "float8", "offload")
# What a run without --checks runs: all but the side-by-side feature runs, which would start
# late in the budget, where a timeout is a FAIL. `--checks all` adds them after the bench,
# whose plain run they reuse within one driver run
DEFAULT_CHECKS = [name for name in CHECKS if name not in ("float8", "offload")]
BUDGET_S = {"accelerator": 480, "cpu": 1200}
MIN_START_S = 20  # a check is not started with less of the budget left than this


def _mode(device: str) -> str:
    return "cpu" if device == "cpu" else "accelerator"


# ------------------------------------------------------------------------------ versions
def git_commit() -> str:
    """$GPU_CHECK_COMMIT when set (a copy of the checkout on another machine: its .git, if it
    travelled, may be another commit's), else the checkout's short commit (+ "-dirty" with
    local changes), else "nogit"."""
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                capture_output=True, timeout=10).stdout.strip()
        if commit:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                   cwd=ROOT, text=True, capture_output=True,
                                   timeout=10).stdout.strip()
            return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "nogit"


def versions(device: str) -> list[str]:
    lines = [f"python {sys.version.split()[0]}, torch {torch.__version__}"]
    if device == "cpu":
        lines.append("device: cpu (gloo; fake process groups)")
    else:
        props = torch.cuda.get_device_properties(0) if device == "cuda" else None
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if device == "cuda" else "-"
        lines.append(f"device: {device} x{torch.accelerator.device_count()}"
                     + (f" ({props.name}, sm_{props.major}{props.minor}, "
                        f"{props.total_memory / 2**30:.0f} GiB)" if props else "")
                     + f", CUDA {torch.version.cuda}, NCCL {nccl}")
    try:
        import triton
        lines.append(f"triton {triton.__version__}")
    except ImportError:
        lines.append("triton: not installed")
    return lines


# ------------------------------------------------------------------------- running checks
def _kill(p: subprocess.Popen) -> None:
    """The check's process and everything it started (ranks, trainer runs, compile workers)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def run_check(name: str, device: str, opts: dict, timeout_s: float,
              env: dict[str, str]) -> tuple[list, str]:
    """Run check ``name`` in a process of its own: (its rows, its output). A crash, a hang
    past ``timeout_s`` or no row at all is a FAIL row of the check."""
    opts = {**opts, "deadline": time.time() + timeout_s}  # for the check's own sub-runs
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--device", device,
           "--opts", json.dumps(opts)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=ROOT, env=env, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        _kill(p)
        out, err = p.communicate()
        timed_out = True
    out, err = _text(out), _text(err)
    rows = [json.loads(ln[len(ROW):]) for ln in out.splitlines() if ln.startswith(ROW)]
    log = "\n".join(ln for ln in out.splitlines() if not ln.startswith(ROW))
    if timed_out:
        rows.append(["FAIL", name, f"timed out after {timeout_s:.0f}s (its last output: "
                     f"{_last_line(out + err)})"])
    elif p.returncode != 0 or not rows:
        rows.append(["FAIL", name, f"exit {p.returncode}: {_last_line(err)}"])
    if err.strip() and (timed_out or p.returncode != 0 or any(r[0] == "FAIL" for r in rows)):
        log += "\n--- stderr (last lines)\n" + "\n".join(err.splitlines()[-40:])
    return rows, log


def _last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1].strip()[:300] if lines else "no output"


def check_env(device: str, tmp: str) -> dict[str, str]:
    """The checks' environment: the launcher's expandable segments on an accelerator (a user's
    allocator setting wins); no compile cache (a cached graph skips our passes, and a check is
    of what this machine compiles now: the train check uses one of its own); calibration's
    cache in the run's temp directory."""
    from simplesharded.shims.launch_env import allocator_env

    env = {**os.environ, **allocator_env(device), "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
           "TORCHINDUCTOR_AUTOGRAD_CACHE": "0", "SIMPLESHARDED_CACHE_DIR": tmp,
           "GPU_CHECK_TMP": tmp, "PYTHONPATH": os.pathsep.join(
               [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    return env


# ---------------------------------------------------------------------------- results file
def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def write_results(path: str, head: list[str], rows: list, runs: list[dict], logs: dict,
                  exit_status: int) -> None:
    counts = {s: sum(r[0] == s for r in rows) for s in STATUSES}
    lines = [f"# GPU check: {head[0]}", ""] + [f"- {h}" for h in head[1:]] + [
        "", f"**{counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP** "
        f"(exit status {exit_status})", "",
        "| status | check | row | figure, or why skipped |", "|---|---|---|---|"]
    lines += [f"| {r[0]} | {_cell(r[3])} | {_cell(r[1])} | {_cell(r[2])} |" for r in rows]
    lines += ["", "## Checks", "", "| check | rows | seconds | timeout s | what it checks |",
              "|---|---|---:|---:|---|"]
    for run in runs:
        got = " ".join(f"{n} {s}" for s in STATUSES
                       if (n := sum(r[0] == s and r[3] == run["name"] for r in rows)))
        lines.append(f"| {run['name']} | {got} | {run['seconds']:.0f} | "
                     f"{run['timeout']:.0f} | {_cell(CHECKS[run['name']][0])} |")
    lines += ["", "## Output of the checks", ""]
    for name, log in logs.items():
        tail = log.strip().splitlines()[-80:]
        if tail:
            lines += [f"### {name}", "", "```text", *tail, "```", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")


def read_results(path: str) -> list[tuple[str, str, str, str]]:
    """The results table of a results file: (status, check, row, figure or reason) per row."""
    out = []
    for line in open(path).read().splitlines():
        if line.startswith("## "):
            break
        if not line.startswith("| ") or line.startswith(("| status", "|---")):
            continue
        body = line.strip()[1:-1]  # the cells, without the outer pipes
        out.append(tuple(c.strip().replace("\0", "|")
                         for c in body.replace("\\|", "\0").split("|")))
    return out


def default_out(device: str, commit: str, now: datetime.datetime) -> str:
    name = f"{now:%Y-%m-%d}_{commit}" + ("_cpu" if device == "cpu" else "") + ".md"
    if os.environ.get("OUT"):
        return os.path.join(os.environ["OUT"], name)
    if device == "cpu":
        return os.path.join(tempfile.gettempdir(), f"gpu_check_{name}")
    return os.path.join(ROOT, "benchmarks", "gpu", name)


# -------------------------------------------------------------------------------- driver
def options(ns, device: str) -> dict:
    """What the checks run, per device: an accelerator gets every backend and case; a CPU
    the ones that compile in seconds there (inductor's C++ compile of a model takes minutes on
    a few cores; the accelerator run covers it)."""
    import gpu_checks

    cpu = device == "cpu"
    return {"backends": ns.backends or list(gpu_checks.CPU_BACKENDS if cpu
                                            else gpu_checks.BACKENDS),
            "storages": ns.storages,
            "cases": ns.cases or list(gpu_checks.CPU_CASES if cpu
                                      else [c[0] for c in gpu_checks.FAKE_CASES]),
            "compiler": "aot_eager" if cpu else "inductor"}


def main(argv=None) -> int:
    import gpu_checks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="CPU run even if an accelerator is present")
    ap.add_argument("--checks", nargs="+", default=DEFAULT_CHECKS, choices=[*CHECKS, "all"],
                    help="the checks to run, in this order; 'all': every check, the default "
                         "run's then float8 and offload (default: " + " ".join(DEFAULT_CHECKS)
                         + ")")
    ap.add_argument("--backends", nargs="+", default=None, choices=gpu_checks.BACKENDS,
                    help="parity's backends (default: all on an accelerator, the aot_eager "
                         "ones and eager on CPU)")
    ap.add_argument("--storages", nargs="+", default=["ragged", "param"],
                    choices=["ragged", "param"], help="parity's data_parallel storages")
    ap.add_argument("--cases", nargs="+", default=None,
                    choices=[c[0] for c in gpu_checks.FAKE_CASES],
                    help="fake8's cases (default: all on an accelerator, fp32_block on CPU)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole run (default: 480 on an accelerator, 1200 on "
                         "CPU); a check is not started with less than 20 s of it left")
    ap.add_argument("--jobs", type=int, default=None,
                    help="checks run side by side, all but the timed ones ("
                         + ", ".join(TIMED) + "), which run alone after them (default: on an "
                         "accelerator a quarter of the host's cores, at most 4; on CPU 1)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per check (default: each check's own, within the budget)")
    ap.add_argument("--out", default=None, help="the results file (markdown)")
    ap.add_argument("--child", choices=list(CHECKS), help=argparse.SUPPRESS)
    ap.add_argument("--device", help=argparse.SUPPRESS)
    ap.add_argument("--opts", default="{}", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if "all" in ns.checks:
        ns.checks = list(CHECKS)
    if ns.child:
        return gpu_checks.child(ns.child, ns.device, json.loads(ns.opts))
    accelerator = torch.accelerator.current_accelerator()
    device = "cpu" if ns.cpu or accelerator is None else accelerator.type
    now = datetime.datetime.now(datetime.timezone.utc)
    commit = git_commit()
    out_path = ns.out or default_out(device, commit, now)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    budget = ns.budget or BUDGET_S[_mode(device)]
    opts = options(ns, device)
    head = [f"{now:%Y-%m-%d %H:%M} UTC, commit {commit}",
            "command: `scripts/gpu_check.sh " + " ".join(argv if argv is not None
                                                         else sys.argv[1:]) + "`",
            *versions(device)]
    if device == "cpu" and not ns.cpu:
        head.append("no accelerator found: the CPU run of the same checks")
    for line in head:
        print(line, flush=True)
    t_start = time.perf_counter()
    rows, runs, logs = [], [], {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        env = check_env(device, tmp)
        alloc = next((f"{k}={env[k]}" for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
                      if k in env), "allocator: torch's defaults")
        head.append(alloc + ("" if device == "cpu" else " in the checks' processes"))
        jobs = ns.jobs or (1 if device == "cpu" else max(1, min(4, (os.cpu_count() or 1) // 4)))
        done = {}  # name -> (its rows, its run)

        def one(name: str) -> None:
            left = budget - (time.perf_counter() - t_start)
            own = ns.timeout or CHECKS[name][1 if device != "cpu" else 2]
            if left < MIN_START_S:
                got = [["SKIP", name, f"not started: {left:.0f}s of the run's {budget:.0f}s "
                        f"budget left (--budget, or --checks {name} alone)"]]
                run = {"name": name, "seconds": 0.0, "timeout": 0.0}
            else:
                timeout = min(own, left)
                t0 = time.perf_counter()
                got, logs[name] = run_check(name, device, opts, timeout, env)
                run = {"name": name, "seconds": time.perf_counter() - t0, "timeout": timeout}
            done[name] = got, run
            print(f"--- {name}\n" + "".join(f"{row[0]} {row[1]}: {row[2]}\n" for row in got)
                  + f"({name}: {run['seconds']:.0f}s)", flush=True)

        side_by_side = [n for n in ns.checks if n not in TIMED]
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(one, side_by_side))  # in order, as workers free up
        for name in ns.checks:
            if name in TIMED:
                one(name)
        for name in ns.checks:  # the results file in the order asked for
            got, run = done[name]
            runs.append(run)
            rows += [[*row[:3], name] for row in got]
        head.append(f"checks side by side: {jobs} (the timed ones, {', '.join(TIMED)}, alone "
                    f"after them)")
    wall = time.perf_counter() - t_start
    head.append(f"wall time {int(wall // 60)} min {int(wall % 60)} s (budget {budget:.0f} s)")
    failed = [r for r in rows if r[0] == "FAIL"]
    status = 1 if failed else 0
    write_results(out_path, head, rows, runs, logs, status)
    n_skip = sum(r[0] == "SKIP" for r in rows)
    print(f"\n{len(rows) - len(failed) - n_skip} passed, {len(failed)} failed, {n_skip} skipped "
          f"of {len(rows)} in {wall:.0f}s" + (f"; FAILED: {', '.join(r[1] for r in failed)}"
                                               if failed else ""), flush=True)
    print(f"results: {out_path}", flush=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
