"""Hammer the gloo collectives our compiled graphs issue, looking for heap corruption.

Issue 13 item 7 (benchmarks/history/journal.md): a bench rank aborted with "malloc():
unaligned tcache chunk detected" inside a gloo worker running the coalesced all-gather that
``passes/coalesce_gathers.py`` emits. This script issues, from 2 gloo ranks, what such a graph
issues, far faster than the bench: per iteration one collective over ``--tensors`` fresh 1-D
inputs (the graph drops its references right after issuing), the next one issued before the
previous is waited (``--depth`` in flight, as reordering prefetches), every output waited with
``wait_tensor`` and checked against the value each rank sent, and the main thread allocating
and freeing small tensors and views meanwhile (the compute the graph does between issue and
wait). Forms (``--mode``):

  coalesced  _c10d_functional.all_gather_into_tensor_coalesced (coalesce_gathers' form)
  plain      _c10d_functional.all_gather_into_tensor on one flat buffer (bucketing's form;
             torch runs it as a coalesced gather of one tensor)
  out        _c10d_functional.all_gather_into_tensor_out on one flat buffer (gloo's plain
             allgather underneath)
  a2a        _c10d_functional.all_to_all_single (lower_reduce_scatters' form)
  rs         _c10d_functional.reduce_scatter_tensor (gloo's own reduce-scatter, as FSDP2 uses)
  direct     the coalesced gather called on a gloo backend made here with ``--gloo-threads``
             worker threads (torch's groups always get 2): the same C++ work, thread count varied

Ranks are separate processes started here (not ``mp.spawn``) so ``--wrap`` can put a tool in
front of each, e.g. ``--wrap "valgrind --error-exitcode=99"``. Prints collectives per second
and how each rank ended; exit status 0 only if every rank finished its iterations.

    python benchmarks/gloo_heap_stress.py --mode coalesced --iters 20000
"""
from __future__ import annotations

import argparse
import collections
import os
import shlex
import socket
import subprocess
import sys
import time


def _sizes(n: int, cap: int) -> list[int]:
    # Even sizes (a2a splits them in 2), from a handful of elements to ~64 K per tensor (at
    # most ``cap``): norms' and projections' shards of a small model, deterministic so both
    # ranks agree.
    return [2 * (1 + (i * 7919) % min(cap // 2, 1 << (4 + i % 11))) for i in range(n)]


def _rank(ns: argparse.Namespace) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.enable()
    torch.set_num_threads(1)
    rank = ns.rank
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=__import__("datetime").timedelta(seconds=ns.timeout))
    ws, gname = 2, dist.group.WORLD.group_name
    ops = torch.ops._c10d_functional
    sizes = _sizes(ns.tensors, ns.max_numel)
    dtype = getattr(torch, ns.dtype)
    if ns.mode == "direct":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        opts._threads = ns.gloo_threads
        opts._timeout = __import__("datetime").timedelta(seconds=ns.timeout)
        store = dist.PrefixStore("direct", dist.distributed_c10d._get_default_store())
        pg = dist.ProcessGroupGloo(store, rank, ws, opts)
    inflight: collections.deque = collections.deque()
    keep: list = []  # main-thread churn that outlives an iteration, freed later

    def issue(it: int):
        # Value rank*1000 + it % 500 in every element: exact in bf16 up to 256 only, so use a
        # small range for bf16.
        val = float(rank * 3 + it % 7) if dtype == torch.bfloat16 else float(rank * 1000 + it % 500)
        inputs = [torch.full((s,), val, dtype=dtype) for s in sizes]
        if ns.mode == "coalesced":
            outs = ops.all_gather_into_tensor_coalesced(inputs, ws, gname)
        elif ns.mode == "direct":  # outputs and their per-rank chunks, as torch builds them
            outs = [torch.empty(ws * s, dtype=dtype) for s in sizes]
            work = pg.allgather_coalesced([[o.chunk(ws)[r] for o in outs] for r in range(ws)],
                                          inputs)
            return work, outs
        elif ns.mode == "plain":
            outs = [ops.all_gather_into_tensor(torch.cat(inputs), ws, gname)]
        elif ns.mode == "out":
            flat = torch.cat(inputs)
            outs = [ops.all_gather_into_tensor_out(flat, ws, gname,
                                                   out=torch.empty(ws * flat.numel(), dtype=dtype))]
        elif ns.mode == "rs":  # each rank gets one chunk of the sum
            flat = torch.cat(inputs)
            outs = [ops.reduce_scatter_tensor(torch.cat([flat, flat]), "sum", ws, gname)]
        else:
            flat = torch.cat(inputs)
            outs = [ops.all_to_all_single(flat, [flat.numel() // 2] * 2,
                                          [flat.numel() // 2] * 2, gname)]
        return outs

    def expect(it: int, r: int) -> float:
        return float(r * 3 + it % 7) if dtype == torch.bfloat16 else float(r * 1000 + it % 500)

    def finish(it: int, outs) -> None:
        if ns.mode == "direct":
            work, outs = outs
            work.wait()
        else:
            outs = [ops.wait_tensor(o) for o in outs]
        if ns.mode == "rs":
            if not bool((outs[0] == sum(expect(it, r) for r in range(ws))).all()):
                raise AssertionError(f"rank {rank} iter {it}: wrong reduce-scatter sum")
            return
        for o in outs:
            rows = o.view(ws, -1)
            for r in range(ws):
                got = rows[r]
                if not bool((got == expect(it, r)).all()):
                    raise AssertionError(f"rank {rank} iter {it}: wrong data from rank {r}")

    grad = torch.enable_grad() if ns.grad else torch.no_grad()
    t0 = time.perf_counter()
    with grad:
        for it in range(ns.iters):
            inflight.append((it, issue(it)))
            # Compute between issue and wait: small allocations, views (version counters,
            # autograd meta), frees in a different order than allocation.
            w = torch.randn(64, 64, requires_grad=ns.grad)
            y = (w @ w).relu().chunk(4)
            keep.append([t.view(-1)[:8].clone() for t in y])
            if len(keep) > 5:
                keep.pop(0)
            del w, y
            if len(inflight) > ns.depth:
                finish(*inflight.popleft())
        while inflight:
            finish(*inflight.popleft())
    dt = time.perf_counter() - t0
    dist.barrier()
    print(f"rank {rank}: {ns.iters} {ns.mode} collectives of {ns.tensors} tensors in {dt:.1f} s "
          f"({ns.iters / dt:.0f}/s)", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # no interpreter shutdown under gloo's threads (history/journal.md, Session 6)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("coalesced", "plain", "out", "a2a", "rs", "direct"), default="coalesced")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--tensors", type=int, default=20, help="tensors per collective")
    ap.add_argument("--max-numel", type=int, default=1 << 16, help="largest tensor, elements")
    ap.add_argument("--depth", type=int, default=2, help="collectives in flight before a wait")
    ap.add_argument("--gloo-threads", type=int, default=2, help="--mode direct: worker threads")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--grad", action="store_true", help="run under enable_grad (default no_grad)")
    ap.add_argument("--timeout", type=float, default=600, help="collective timeout, seconds")
    ap.add_argument("--wrap", default="", help="command put in front of each rank's python")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.rank is not None:
        _rank(ns)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    argv = [a for a in sys.argv[1:]]
    procs = [subprocess.Popen(shlex.split(ns.wrap) + [sys.executable, __file__, *argv,
                                                      "--rank", str(r)], env=env)
             for r in range(2)]
    # A rank that dies leaves its peer blocked in a collective: stop the peer then.
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    codes = [p.returncode for p in procs]
    print(f"exit codes: {codes}", flush=True)
    return 0 if codes == [0, 0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
