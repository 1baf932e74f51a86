"""scripts/gpu_smoke.sh without a GPU, as a fresh machine runs it: the project is not installed
there, so these runs hide this environment's install and the checkout must import through the
script's own means. Its CPU dry run of the parity check on 2 gloo ranks, of calibration (a
`python -m simplesharded.<tool>` started from the checkout's root), of the trainer on a fake
group of 8 ranks compiled by inductor, and its exit status when a check fails."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_smoke.sh")

# Imported at start-up (PYTHONPATH): removes the editable install's import hooks, in this
# process and every process it starts, so only the checkout itself can provide simplesharded.
_HIDE_INSTALL = """
import sys
def _ours(hook):  # setuptools' editable finder is a class (in meta_path) or its method
    return "__editable__" in (getattr(hook, "__module__", None) or type(hook).__module__)
sys.meta_path[:] = [f for f in sys.meta_path if not _ours(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if not _ours(h)]
"""


def _smoke(tmp_path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "sitecustomize.py").write_text(_HIDE_INSTALL)
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(tmp_path)}
    return subprocess.run(["bash", SCRIPT, "--cpu", *args], capture_output=True, text=True,
                          timeout=900, env=env, cwd=tmp_path)


def test_hidden_install_is_hidden(tmp_path):
    """The hook removal works: outside the checkout, simplesharded cannot be imported."""
    (tmp_path / "sitecustomize.py").write_text(_HIDE_INSTALL)
    p = subprocess.run([sys.executable, "-c", "import simplesharded"], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    assert p.returncode != 0 and "No module named 'simplesharded'" in p.stderr, p.stderr


@pytest.mark.slow
def test_cpu_dry_run_uninstalled(tmp_path):
    # one bucketing backend: real collectives through our passes, one aot_eager compile, with
    # each storage;
    # calibrate: a tool started with -m from the checkout's root; fake8: the trainer's step
    # lowered by inductor with our collective order checked in its code
    p = _smoke(tmp_path, "--checks", "parity_gloo2", "calibrate", "fake8",
               "--backends", "aot_eager_blockbucketing", "--cases", "fp32_block")
    assert p.returncode == 0, p.stdout + p.stderr
    for rank in (0, 1):  # one shard per parameter, then ragged buckets (the trainer's default)
        for row in ("aot_eager_blockbucketing", "ragged:uncompiled",
                    "ragged:aot_eager_blockbucketing"):
            assert (f"PASS parity[2 ranks, gloo on cpu] {row}: rank {rank}: "
                    "loss rel diff") in p.stdout, p.stdout
    assert "PASS calibrate" in p.stdout, p.stdout
    for kind in ("fw", "bw"):
        assert (f"PASS fake8[fp32_block, inductor_blockbucketing] {kind} collective order"
                in p.stdout), p.stdout
    assert "10 of 10 checks passed or skipped" in p.stdout, p.stdout


def _load_smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", os.path.join(ROOT, "scripts",
                                                                            "gpu_smoke.py"))
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    return smoke


def test_gloo_on_a_device_that_crashes_it_is_a_skip(monkeypatch):
    """Gloo with CUDA tensors can kill the process (torch 2.11 segfaults): the smoke probes it
    in throwaway ranks, and a dead probe is a SKIP with the reason, not a failed run."""
    import dist_utils

    smoke = _load_smoke()
    calls = []

    def spawn(world, fn, *args, **kwargs):
        calls.append(fn.__name__)
        raise dist_utils.RankError("_gloo2_probe: process 1 terminated with signal SIGSEGV")

    monkeypatch.setattr(dist_utils, "spawn", spawn)
    rows = smoke.check_parity_gloo2("cuda", ["aot_eager"])
    assert calls == ["_gloo2_probe"]  # the parity job itself never started
    assert rows == [("SKIP", "parity[2 ranks, gloo on cuda]",
                     "gloo on cuda crashed running DTensor's collectives: RankError: "
                     "_gloo2_probe: process 1 terminated with signal SIGSEGV")]


def test_a_failed_check_fails_the_run(monkeypatch, capsys):
    smoke = _load_smoke()
    rows = {"bench": [["FAIL", "bench", "exit 1"]], "calibrate": [["SKIP", "calibrate", "-"]]}
    monkeypatch.setattr(smoke, "_run_check", lambda name, *a: rows[name])
    assert smoke.main(["--cpu", "--checks", "bench", "calibrate"]) == 1
    assert "1 of 2 checks passed or skipped; FAILED: bench" in capsys.readouterr().out
