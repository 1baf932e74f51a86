"""``python -m simplesharded.bench_collectives``: one bucket's collectives, side by side.

Times, on --world-size gloo ranks, the forms a bucketed reduce-scatter can take on this
transport: gloo's own ``reduce_scatter_tensor`` (an all-reduce of the whole buffer in
disguise), the all-to-all + local sum that passes/lowering.py emits, and an in-place
all-reduce; plus the bucket's all-gather for scale. The bucket is one llama3-small block's
parameters (3.1M fp32 elements). Prints median wall ms and process CPU ms (all threads) per
call, and checks every form gives the same values as gloo's reduce-scatter.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BUCKET_NUMEL = 3_145_728  # ~ one llama3-small block (3.15M parameters)


def _worker(rank: int, world: int, port: int, reps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    c10d, name = torch.ops._c10d_functional, dist.group.WORLD.group_name
    n = BUCKET_NUMEL // world * world
    grads = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    chunk = [n // world] * world

    def reduce_scatter():
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(grads, "sum", world, name))

    def all_to_all_sum():
        out = c10d.wait_tensor(c10d.all_to_all_single(grads, chunk, chunk, name))
        return out.view(world, -1).sum(0)

    def all_reduce_inplace():
        out = c10d.wait_tensor(c10d.all_reduce_(grads.clone(), "sum", name))
        return out.view(world, -1)[rank]

    def all_gather():
        return c10d.wait_tensor(c10d.all_gather_into_tensor(grads[: n // world], world, name))

    ref = reduce_scatter()
    for form in (all_to_all_sum, all_reduce_inplace):
        got = form()
        if not torch.allclose(got, ref, rtol=1e-6, atol=1e-6):
            raise AssertionError(f"{form.__name__} differs from reduce_scatter_tensor")
    rows = []
    for form in (reduce_scatter, all_to_all_sum, all_reduce_inplace, all_gather):
        form()
        dist.barrier()
        wall, cpu = [], []
        for _ in range(reps):
            t0, c0 = time.perf_counter(), time.process_time()
            form()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        rows.append((form.__name__, statistics.median(wall), statistics.median(cpu)))
    if rank == 0:
        print(f"one bucket of {n * 4 / 2**20:.0f} MiB fp32 on {world} gloo ranks, median of {reps}")
        print(f"| form | wall ms | CPU ms (process) | × reduce_scatter CPU |\n|---|---:|---:|---:|")
        for form, w, c in rows:
            print(f"| {form} | {1e3 * w:.1f} | {1e3 * c:.1f} | {c / rows[0][2]:.2f} |")
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ns = ap.parse_args(argv)
    if ns.world_size < 2:
        ap.error(f"--world-size {ns.world_size} must be at least 2")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(ns.world_size, port, ns.reps), nprocs=ns.world_size, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
