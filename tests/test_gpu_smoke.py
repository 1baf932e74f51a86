"""scripts/gpu_smoke.sh without a GPU: its CPU dry run of the parity check on 2 gloo ranks,
through the shell wrapper (whose link tree makes this working tree importable, as on a fresh
machine), and its exit status when a check fails."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_smoke.sh")


@pytest.mark.slow
def test_cpu_dry_run_parity_on_two_gloo_ranks():
    # one bucketing backend: real collectives through our passes, one aot_eager compile
    argv = ["bash", SCRIPT, "--cpu", "--checks", "parity_gloo2",
            "--backends", "aot_eager_blockbucketing"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHON": sys.executable})
    assert p.returncode == 0, p.stdout + p.stderr
    for rank in (0, 1):
        assert (f"PASS parity[2 ranks, gloo on cpu] aot_eager_blockbucketing: rank {rank}: "
                "loss rel diff") in p.stdout, p.stdout
    assert "2 of 2 checks passed or skipped" in p.stdout


def test_a_failed_check_fails_the_run(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("gpu_smoke", os.path.join(ROOT, "scripts",
                                                                            "gpu_smoke.py"))
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    monkeypatch.setattr(smoke, "check_bench", lambda device: [("FAIL", "bench", "exit 1")])
    monkeypatch.setattr(smoke, "check_calibrate", lambda device: [("SKIP", "calibrate", "-")])
    assert smoke.main(["--cpu", "--checks", "bench", "calibrate"]) == 1
    assert "1 of 2 checks passed or skipped; FAILED: bench" in capsys.readouterr().out
