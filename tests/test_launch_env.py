"""run_train.sh's rank environment (simplesharded/shims/launch_env.py): what each device's ranks get,
that a variable the user set wins, and the launcher's own output on this (CPU) machine."""
import os
import subprocess
import sys

from simplesharded.shims.host_malloc import TUNABLES, caching_env
from simplesharded.shims.launch_env import ALLOC_CONF, SHARE_STORE, allocator_env, launch_env


def test_cpu_ranks_get_the_caching_malloc_a_core_share_and_their_own_restart_store():
    env = launch_env("cpu", 2, environ={}, cores=8)
    assert env == {"OMP_NUM_THREADS": "4", TUNABLES: caching_env({})[TUNABLES],
                   SHARE_STORE: "1"}


def test_gpu_ranks_get_expandable_segments_and_no_second_store():
    env = launch_env("cuda", 8, environ={}, cores=64)
    assert env == {"OMP_NUM_THREADS": "8", ALLOC_CONF[0]: "expandable_segments:True"}
    assert SHARE_STORE not in env and TUNABLES not in env


def test_what_the_user_set_wins():
    for name in ALLOC_CONF:  # either spelling of the allocator's settings
        assert ALLOC_CONF[0] not in launch_env("cuda", 1, environ={name: "x"}, cores=4)
    env = launch_env("cpu", 2, environ={"OMP_NUM_THREADS": "1", SHARE_STORE: "0"}, cores=8)
    assert "OMP_NUM_THREADS" not in env and SHARE_STORE not in env
    assert launch_env("cpu", 4, environ={}, cores=2)["OMP_NUM_THREADS"] == "1"


def test_every_launcher_of_accelerator_ranks_sets_expandable_segments(monkeypatch):
    """The bench's ranks start as run_train.sh's do: expandable segments on an accelerator,
    unless the user set the allocator's configuration (either name); nothing on CPU."""
    from simplesharded.tools.bench_run import _rank_environment
    from simplesharded.tools.bench_variants import BenchArgs

    assert allocator_env("cuda", environ={}) == {ALLOC_CONF[0]: "expandable_segments:True"}
    assert allocator_env("cuda", environ={ALLOC_CONF[1]: "x"}) == {}
    assert allocator_env("cpu", environ={}) == {}
    for name in ALLOC_CONF:
        monkeypatch.delenv(name, raising=False)
    with _rank_environment(BenchArgs(device="cuda")):
        assert os.environ[ALLOC_CONF[0]] == "expandable_segments:True"
    assert ALLOC_CONF[0] not in os.environ  # as it was
    monkeypatch.setenv(ALLOC_CONF[1], "expandable_segments:False")
    with _rank_environment(BenchArgs(device="cuda")):
        assert ALLOC_CONF[0] not in os.environ


def test_launcher_prints_exports_for_this_machine():
    env = {k: v for k, v in os.environ.items()
           if k not in (TUNABLES, "NGPU", "OMP_NUM_THREADS", SHARE_STORE)}
    out = subprocess.run([sys.executable, "-m", "simplesharded.shims.launch_env"], env=env,
                         capture_output=True, text=True, check=True).stdout
    lines = dict(line.removeprefix("export ").split("=", 1) for line in out.splitlines())
    assert lines["NGPU"] == "2" and lines["LAUNCH_DEVICE"] == "cpu"  # no accelerator here
    assert lines[SHARE_STORE] == "1"
    assert lines[TUNABLES] == caching_env({})[TUNABLES]
