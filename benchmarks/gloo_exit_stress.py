"""Reproducer for the bench's flaky SIGABRT (benchmarks/history/journal.md, Session 6).

Each run: 2 gloo ranks all-reduce under torch.profiler (which imports dynamo, and with it
``torch.distributed.nn.functional``, pinning the default group), destroy the group, exit.
``--exit shutdown`` leaves through interpreter shutdown, as the bench's ranks did;
``--exit exit_rank`` through ``simplesharded.mesh.exit_rank``, as they do now. Prints how many
runs had a rank die (SIGABRT: std::terminate in a gloo thread).

    python benchmarks/gloo_exit_stress.py --runs 30 --exit shutdown
"""
import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile


def _rank(rank: int, port: int, how: str, switch_interval_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    sys.setswitchinterval(switch_interval_s)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    t = torch.ones(1 << 16)
    with profile(activities=[ProfilerActivity.CPU]):
        for _ in range(5):
            dist.all_reduce(t)
    dist.destroy_process_group()
    if how == "exit_rank":
        from simplesharded.mesh import exit_rank
        exit_rank(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--exit", choices=("shutdown", "exit_rank"), default="shutdown")
    # Widens the race without changing it: the main thread keeps the GIL up to this long
    # between blocking calls, so a gloo thread that needs it is more often still waiting at
    # exit. Python's default, 0.005, aborted 0 to 8 runs in 30 here depending on load.
    ap.add_argument("--switch-interval", type=float, default=1.0, metavar="S")
    ns = ap.parse_args()
    died = 0
    for i in range(ns.runs):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            mp.spawn(_rank, args=(port, ns.exit, ns.switch_interval), nprocs=2)
        except mp.ProcessExitedException as e:
            died += 1
            print(f"run {i + 1}: {e}", flush=True)
    print(f"--exit {ns.exit}: {died} of {ns.runs} runs had a rank die")


if __name__ == "__main__":
    main()
