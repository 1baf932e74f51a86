"""Processes forked from the fork server (simplesharded/shims/forkserver.py) through
``mesh.spawn_local(..., fork=True)``: they run in the caller's environment, fork only when the
server started with the variables a process reads at its start, and are spawned otherwise. A
process's start-up environment is read from /proc/self/environ: a forked process shows the
server's, a spawned one its own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from simplesharded.mesh import spawn_local
from simplesharded.shims import forkserver

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/environ"),
                                reason="reads a process's start-up environment from /proc")


def _report(rank: int, path: str) -> None:
    with open("/proc/self/environ", "rb") as f:
        at_start = dict(item.decode().partition("=")[::2] for item in f.read().split(b"\0")
                        if item)
    with open(f"{path}.{rank}", "w") as f:
        json.dump({"ppid": os.getppid(), "at_start": at_start, "environ": dict(os.environ)}, f)


def _start(**kwargs) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        spawn_local(_report, 2, (os.path.join(d, "r"),), **kwargs)
        return [json.load(open(os.path.join(d, f"r.{rank}"))) for rank in range(2)]


def test_forked_in_the_callers_environment_when_the_server_started_with_what_it_needs():
    # this worker's server started with the ranks' one thread (tests/conftest.py)
    assert forkserver.started_with({"OMP_NUM_THREADS": "1"})
    for r in _start(fork=True, read_at_start=("OMP_NUM_THREADS",),
                    env={"OMP_NUM_THREADS": "1", "SS_CALLERS": "yes", "SS_UNSET": None}):
        assert r["ppid"] != os.getpid()  # the server's child, not this process's
        assert r["environ"]["SS_CALLERS"] == "yes" and "MASTER_PORT" in r["environ"]
        assert "SS_CALLERS" not in r["at_start"] and "SS_UNSET" not in r["environ"]


def test_spawned_when_the_server_lacks_a_variable_read_at_start():
    assert not forkserver.started_with({"SS_AT_START": "1"})
    for r in _start(fork=True, read_at_start=("SS_AT_START",), env={"SS_AT_START": "1"}):
        assert r["ppid"] == os.getpid() and r["at_start"]["SS_AT_START"] == "1"


_FRESH = """
import json, os, sys, tempfile
sys.path.insert(0, {tests!r})
from test_forkserver import _start
print(json.dumps(_start(fork=True, read_at_start=("SS_AT_START",),
                        env={{"SS_AT_START": "tuned"}})))
"""


def test_a_fresh_process_starts_its_server_with_what_the_ranks_read_at_start():
    """As the bench's CLI starts its ranks (glibc's tunables): no server runs yet, so the
    first fork starts it with the variables, and its children see them at their start."""
    code = _FRESH.format(tests=os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "SS_AT_START": "untuned"})
    assert p.returncode == 0, p.stderr
    ranks = json.loads(p.stdout.strip().splitlines()[-1])
    for r in ranks:
        assert r["at_start"]["SS_AT_START"] == "tuned", r["at_start"]
    assert len({r["ppid"] for r in ranks}) == 1  # both children of the one server


def _say(rank: int) -> None:
    print(f"rank {rank} on stdout", flush=True)
    print(f"rank {rank} on stderr", file=sys.stderr, flush=True)


def test_forked_processes_write_to_the_callers_stdout_and_stderr(capfd):
    """As spawned ones do: the fork server's own are the ones it started with."""
    spawn_local(_say, 2, fork=True)
    out, err = capfd.readouterr()
    for rank in range(2):
        assert f"rank {rank} on stdout" in out and f"rank {rank} on stderr" in err, (out, err)
