"""scripts/gpu_check.sh without a GPU, as a fresh machine runs it: the project is not installed
there, so these runs hide this environment's install and the checkout must import through the
script's own means. Its CPU run of the parity check on 2 gloo ranks, of calibration (a
`python -m simplesharded.<tool>` started from the checkout's root), of the trainer on a fake
group of 8 ranks compiled by inductor; the results file (one row per result, PASS / FAIL /
SKIP, a reason for every SKIP) and the exit status when a check fails; a check the time
budget has no room for; the context-parallel attention check's CPU run, which says SKIP and
why."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")

# Imported at start-up (PYTHONPATH): removes the editable install's import hooks, in this
# process and every process it starts, so only the checkout itself can provide simplesharded.
_HIDE_INSTALL = """
import sys
def _ours(hook):  # setuptools' editable finder is a class (in meta_path) or its method
    return "__editable__" in (getattr(hook, "__module__", None) or type(hook).__module__)
sys.meta_path[:] = [f for f in sys.meta_path if not _ours(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if not _ours(h)]
"""


def _check(tmp_path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "sitecustomize.py").write_text(_HIDE_INSTALL)
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(tmp_path)}
    env.pop("OUT", None)
    return subprocess.run(["bash", SCRIPT, "--cpu", *args], capture_output=True, text=True,
                          timeout=900, env=env, cwd=tmp_path)


def _load(name: str):
    scripts = os.path.join(ROOT, "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    spec = importlib.util.spec_from_file_location(name, os.path.join(scripts, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hidden_install_is_hidden(tmp_path):
    """The hook removal works: outside the checkout, simplesharded cannot be imported."""
    (tmp_path / "sitecustomize.py").write_text(_HIDE_INSTALL)
    p = subprocess.run([sys.executable, "-c", "import simplesharded"], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    assert p.returncode != 0 and "No module named 'simplesharded'" in p.stderr, p.stderr


@pytest.mark.slow
def test_cpu_run_uninstalled(tmp_path):
    # parity_gloo2: real collectives through our passes, ragged buckets uncompiled and under
    # one aot_eager compile; calibrate: a tool started with -m from the checkout's root; fake8: the
    # trainer's step with TP 2 (bf16) lowered by inductor with our collective order checked in
    # its code: the suite's one TP x inductor compile, on one process; float8 and offload:
    # their side-by-side trainer runs at CPU sizes (their answer is an accelerator's); init:
    # the model's init on ragged shards, 1 and 2 ranks; copy_stream: offload's copies against
    # no offload, compiled (their streams are an accelerator's)
    out = tmp_path / "results.md"
    p = _check(tmp_path, "--checks", "parity_gloo2", "calibrate", "fake8", "float8", "offload",
               "init", "copy_stream", "--cases", "bf16_tp2_block", "--storages", "ragged",
               "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    for rank in (0, 1):  # ragged buckets, the trainer's default (per parameter: --storages)
        for row in ("ragged:uncompiled", "ragged:aot_eager_blockbucketing"):
            assert (f"PASS parity[2 ranks, gloo on cpu] {row}: rank {rank}: "
                    "loss rel diff") in p.stdout, p.stdout
    assert "PASS calibrate[python -m simplesharded.tools.calibrate --dtype bfloat16]" in p.stdout
    for kind in ("fw", "bw"):
        assert (f"PASS fake8[bf16_tp2_block, inductor_blockbucketing] {kind} collective order"
                in p.stdout), p.stdout
    # init: ragged buckets (the default) on 1 and 2 ranks, their regions read through
    # state_dict(), bit for bit
    assert "PASS init[2 ranks on cpu] llama3 tp=2 ep=1: 58 of 58 tensors equal" in p.stdout
    # init's ep=2 case is one SKIP row where this torch lacks expert parallelism
    from simplesharded.passes.torch_compat import EXPERT_PARALLEL, has
    no_ep = 0 if has(EXPERT_PARALLEL) else 1
    assert f"16 passed, 0 failed, {5 + no_ep} skipped of {21 + no_ep}" in p.stdout, p.stdout
    rows = [r for r in _load("gpu_check").read_results(str(out)) if r[2] != "init ep=2"]
    assert len(rows) == 21 and {r[1] for r in rows} == {"parity_gloo2", "calibrate", "fake8",
                                                        "float8", "offload", "init",
                                                        "copy_stream"}
    copy_stream = next(r for r in rows if r[1] == "copy_stream")
    # params, then optimizer offload: each equal to no offload
    assert copy_stream[0] == "SKIP", copy_stream
    assert copy_stream[3].count("loss rel diff 0.0e+00") == 2, copy_stream
    rows.remove(copy_stream)
    skipped = [r for r in rows if r[0] == "SKIP"]
    assert [r[2].split("[")[0] + (r[2].rsplit("] ", 1)[1] if "] " in r[2] else "")
            for r in skipped] == ["fake8fused attention", "fake8memory", "float8", "offload"]
    assert all("accelerator" in r[3] for r in skipped[:3]), skipped
    # the runs side by side, each with its own figure; offload keeps the losses bit for bit
    for r in skipped[2:]:
        assert "tokens/s per device" in r[3] and "without: " in r[3] and "tokens/s x" in r[3]
    offload = skipped[3][3]
    losses = re.findall(r"loss (\S+ -> \S+) in", offload)
    assert len(losses) == 2 and losses[0] == losses[1], offload


def test_gloo_on_a_device_that_crashes_it_is_a_skip(monkeypatch):
    """Gloo with CUDA tensors can kill the process (torch 2.11 segfaults): the check probes it
    in throwaway ranks, and a dead probe is a SKIP with the reason, not a failed run."""
    import dist_utils

    checks = _load("gpu_checks")
    calls = []

    def spawn(world, fn, *args, **kwargs):
        calls.append(fn.__name__)
        raise dist_utils.RankError("_gloo2_probe: process 1 terminated with signal SIGSEGV")

    monkeypatch.setattr(dist_utils, "spawn", spawn)
    rows = checks.check_parity_gloo2("cuda", {"backends": ["aot_eager"], "storages": ["param"]})
    assert calls == ["_gloo2_probe"]  # the parity job itself never started
    assert rows == [("SKIP", "parity[2 ranks, gloo on cuda]",
                     "gloo on cuda crashed running DTensor's collectives: RankError: "
                     "_gloo2_probe: process 1 terminated with signal SIGSEGV")]


def test_results_file_and_exit_status(monkeypatch, tmp_path, capsys):
    """One results file: a table row per result (a '|' in a figure survives), every check's
    time, the checks' output; a failed row fails the run, a skipped one does not; a check the
    budget has no room left for is a SKIP saying so, without starting it."""
    check = _load("gpu_check")
    rows = {"bench": ([["FAIL", "bench[x]", "MFU 120% | above 100"]], "bench's table\n| a |"),
            "calibrate": ([["SKIP", "calibrate[y]", "no accelerator"],
                           ["PASS", "calibrate[z]", "1 TFLOP/s"]], "")}
    started = []

    def run_check(name, device, opts, timeout, env):
        started.append(name)
        return rows[name]

    monkeypatch.setattr(check, "run_check", run_check)
    out = tmp_path / "r.md"
    assert check.main(["--cpu", "--checks", "bench", "calibrate", "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "1 passed, 1 failed, 1 skipped of 3" in printed and "FAILED: bench[x]" in printed
    assert check.read_results(str(out)) == [
        ("FAIL", "bench", "bench[x]", "MFU 120% | above 100"),
        ("SKIP", "calibrate", "calibrate[y]", "no accelerator"),
        ("PASS", "calibrate", "calibrate[z]", "1 TFLOP/s")]
    text = out.read_text()
    assert "**1 PASS, 1 FAIL, 1 SKIP** (exit status 1)" in text
    assert "| bench | 1 FAIL |" in text and "### bench" in text and "bench's table" in text

    started.clear()
    assert check.main(["--cpu", "--checks", "bench", "calibrate", "--budget", "5",
                       "--out", str(out)]) == 0
    assert started == []
    got = check.read_results(str(out))
    assert [r[:3] for r in got] == [("SKIP", "bench", "bench"), ("SKIP", "calibrate", "calibrate")]
    assert all(r[3].startswith("not started: ") and "budget" in r[3] for r in got)


def test_checks_side_by_side_then_the_timed_ones_alone(monkeypatch, tmp_path):
    """--jobs 2: the untimed checks run two at a time, a timed one (bench) only once they have
    all ended; the results file lists them in the order asked for."""
    import threading

    check = _load("gpu_check")
    lock, events, running = threading.Lock(), [], []
    both = threading.Barrier(2, timeout=10)  # both untimed checks must be running at once

    def run_check(name, device, opts, timeout, env):
        with lock:
            events.append(("start", name, len(running)))
            running.append(name)
        if name != "bench":
            both.wait()
        with lock:
            running.remove(name)
            events.append(("end", name))
        return [["PASS", f"{name}[x]", "ok"]], ""

    monkeypatch.setattr(check, "run_check", run_check)
    out = tmp_path / "r.md"
    assert check.main(["--cpu", "--jobs", "2", "--checks", "bench", "parity", "moe",
                       "--out", str(out)]) == 0
    assert events[-2:] == [("start", "bench", 0), ("end", "bench")]
    assert [r[1] for r in check.read_results(str(out))] == ["bench", "parity", "moe"]
    assert "- checks side by side: 2 (the timed ones, bench," in out.read_text()


def test_inductor_memory_is_checked_through_its_aot_eager_twin(monkeypatch):
    """The planner models the aot_eager backends: an inductor case's memory row runs the
    aot_eager twin of its config and holds the twin's peak within the tolerance; the inductor
    peak itself need only stay under the planner's figure. Figures of the H200's bf16 + full AC
    case: inductor 85 MiB less 64 MiB of workspaces, planner 47 MiB."""
    checks = _load("gpu_checks")
    cfg = checks._fake_cfg("configs/llama3_debug.toml",
                           ["--compile.backend", "inductor_autobucketing"], "cpu")
    mib = 2**20
    ran = []

    def twin_steps(peak):
        def steps(twin_cfg, device, observe=None):
            ran.append(twin_cfg.compile.backend)
            return {"peak": peak * mib, "workspace": 64 * mib, "held": 0, "stepped": True}, {}, []
        return steps

    inductor = {"peak": 85 * mib, "workspace": 64 * mib, "held": 0, "stepped": True}
    for twin_peak, inductor_peak, want in ((100, 85, "PASS"), (85, 85, "FAIL"),
                                           (100, 64 + 70, "FAIL")):
        monkeypatch.setattr(checks, "_fake_steps", twin_steps(twin_peak))
        status, name, detail = checks._memory_row(
            "fake8[x]", cfg, "cuda", 47 * mib, {**inductor, "peak": inductor_peak * mib}, True)
        assert status == want, (twin_peak, inductor_peak, detail)
        assert "aot_eager_autobucketing's max_memory_allocated" in detail
    assert ran == ["aot_eager_autobucketing"] * 3
    assert cfg.compile.backend == "inductor_autobucketing"  # the case's config is left as it was
    # a case under aot_eager is its own twin
    status, _, detail = checks._memory_row("fake8[y]", cfg, "cuda", 47 * mib,
                                           {**inductor, "peak": 100 * mib}, False)
    assert status == "PASS" and "x0.77" in detail and len(ran) == 3


def test_cp_attention_on_cpu_says_skip_and_why():
    """On CPU the context-parallel attention check runs its code at CPU sizes (eager, and
    compiled by aot_eager) on a fake cp group, then says SKIP: the kernel choice that counts
    is an accelerator's; the reason names what CPU ran."""
    checks = _load("gpu_checks")
    rows = checks.check_cp_attention("cpu", {"compiler": "aot_eager"})
    assert [r[0] for r in rows] == ["SKIP"] * 3, rows
    assert [r[1].rsplit("] ", 1)[1] for r in rows] == [
        "S=1024 eager", "S=1024 aot_eager", "S=2048 fused kernels only"]
    for _, _, why in rows:
        assert "accelerator" in why and "flash_attention_for_cpu" in why, why


def test_copy_stream_reads_the_copies_beside_kernels_off_a_trace():
    """The copy_stream check's reading of a profiler trace: the copies one way on a stream no
    kernel runs on (not the inputs' copy on the compute stream, not a copy the other way),
    and the share of their time during which a kernel ran (kernels overlapping on the compute
    stream counted once)."""
    checks = _load("gpu_checks")

    def event(cat, name, stream, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
                "args": {"stream": stream}}
    htod = "Memcpy HtoD (Pinned -> Device)"
    events = [event("kernel", "gemm", 7, 0, 10), event("kernel", "gemm", 7, 5, 10),
              event("kernel", "add", 7, 30, 10),
              event("gpu_memcpy", htod, 21, 10, 10),  # beside the kernels from 10 to 15
              event("gpu_memcpy", htod, 21, 25, 10),  # beside the kernel from 30 to 35
              event("gpu_memcpy", htod, 7, 50, 3),  # the tokens, on the compute stream
              event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 21, 60, 5),
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 40}]
    seen = checks.copy_overlap(events)
    assert seen == {"copies": 2, "streams": [21], "kernel_streams": [7], "copy_us": 20,
                    "beside": 0.5}
    assert checks.copy_overlap(events, "DtoH") == {
        "copies": 1, "streams": [21], "kernel_streams": [7], "copy_us": 5, "beside": 0.0}
    assert checks.copy_overlap([])["beside"] == 0.0
