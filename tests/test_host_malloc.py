"""CPU ranks' caching malloc settings (simplesharded/shims/host_malloc.py): what they change, and that
a tunable the user set wins (tests/test_launch_env.py: that the launcher sets them)."""
import os
import subprocess
import sys

from simplesharded.shims.host_malloc import CACHING, TUNABLES, caching_env

# Allocates, writes and frees the same 64 MiB tensor every "step"; prints the minor page
# faults of the last 5 steps (after 2 warm-up steps).
_STEPS = """
import resource, torch
def step():
    torch.empty(16 * 2**20).fill_(1.0)
for _ in range(2):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(extra_env: dict[str, str]) -> int:
    env = {k: v for k, v in os.environ.items() if k != TUNABLES}
    out = subprocess.run([sys.executable, "-c", _STEPS], env={**env, **extra_env},
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_caching_reuses_freed_memory_where_glibc_faults_it_in_again():
    pages = 5 * 64 * 2**20 // 4096  # every page of every step, if each one is fresh
    assert _faults({}) > pages // 2  # glibc's default: mmap'd per step, zeroed on touch
    assert _faults(caching_env({})) < pages // 100  # reused: (almost) no fresh page after warm-up


def test_a_tunable_the_user_set_wins():
    ours = caching_env({})[TUNABLES].split(":")
    assert sorted(ours) == sorted(f"{k}={v}" for k, v in CACHING.items())
    key = next(iter(CACHING))
    theirs = caching_env({TUNABLES: f"{key}=7:glibc.malloc.arena_max=2"})[TUNABLES].split(":")
    assert theirs[:2] == [f"{key}=7", "glibc.malloc.arena_max=2"]
    assert sorted(theirs[2:]) == sorted(o for o in ours if not o.startswith(key + "="))

