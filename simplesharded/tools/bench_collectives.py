"""``python -m simplesharded.tools.bench_collectives``: one bucket's collectives, side by side.

Times, on --world-size gloo ranks, the forms a bucketed collective can take on this transport.
Reduce-scatter: gloo's own ``reduce_scatter_tensor`` (an all-reduce of the whole buffer in
disguise), the all-to-all + local adds that passes/lowering.py emits, and an in-place
all-reduce. All-gather: one flat buffer plus a copy-out per parameter (passes/bucketing.py;
torch's own kernel, gloo's coalesced gather of one tensor), the same into a buffer the caller
allocates (gloo's plain all-gather: what simplesharded/shims/gloo_gather.py makes the first form
run), the coalesced gather straight into per-parameter outputs (which no pass emits:
gloo's coalesced gather can corrupt the heap, docs/torch_internals.md), and the gather of a
bucket in the ragged layout (simplesharded/storage/ragged.py): without copy-in or copy-out, every
parameter a view of the gathered buffer.
The bucket is one llama3-small block's parameters (3.1M fp32 elements). Prints median wall ms
and process CPU ms (all threads) per call; checks the forms of each kind agree.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from simplesharded.mesh import spawn_local
from simplesharded.storage.ragged import RaggedLayout



def block_numels(world: int) -> list[int]:
    """Element counts of one llama3-small block's parameters, each rounded to ``world`` rows
    (a Shard(0) gather's padded size)."""
    from simplesharded.models import build_model
    block = next(iter(build_model("llama3", "small", device="meta").layers.values()))
    return [-(-p.numel() // world) * world for p in block.parameters()]


def _worker(rank: int, world: int, reps: int, numels: list[int]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    c10d, name = torch.ops._c10d_functional, dist.group.WORLD.group_name
    n = sum(numels)
    gen = torch.Generator().manual_seed(rank)
    grads = torch.randn(n, generator=gen)
    shards = [torch.randn(k // world, generator=gen) for k in numels]
    chunk = [n // world] * world

    def reduce_scatter():
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(grads, "sum", world, name))

    def all_to_all_add():
        parts = c10d.wait_tensor(c10d.all_to_all_single(grads, chunk, chunk, name)).view(world, -1)
        total = parts[0]
        for r in range(1, world):
            total = total + parts[r]
        return total

    def all_reduce_inplace():
        out = c10d.wait_tensor(c10d.all_reduce_(grads.clone(), "sum", name))
        return out.view(world, -1)[rank]

    def copy_out(rows):
        outs, offset = [], 0
        for s in shards:
            outs.append(rows[:, offset:offset + s.numel()].clone())
            offset += s.numel()
        return outs

    def all_gather_flat():
        buf = torch.cat(shards)
        return copy_out(c10d.wait_tensor(c10d.all_gather_into_tensor(buf, world, name))
                        .view(world, -1))

    def all_gather_out():
        buf = torch.cat(shards)
        out = torch.empty(world * buf.numel())
        return copy_out(c10d.wait_tensor(c10d.all_gather_into_tensor_out(buf, world, name,
                                                                         out=out))
                        .view(world, -1))

    def all_gather_coalesced():
        outs = c10d.all_gather_into_tensor_coalesced(shards, world, name)
        return [c10d.wait_tensor(o) for o in outs]

    layout = RaggedLayout(tuple((k,) for k in numels), world)
    bucket = torch.randn(layout.total, generator=torch.Generator().manual_seed(world))
    ragged = bucket[rank * layout.shard_numel:(rank + 1) * layout.shard_numel].clone()
    sizes, index = layout.split_sizes()

    def all_gather_ragged():
        pieces = c10d.wait_tensor(c10d.all_gather_into_tensor(ragged, world, name)).split(sizes)
        return [pieces[j] for j in index]

    ref = reduce_scatter()
    for form in (all_to_all_add, all_reduce_inplace):
        got = form()
        if not torch.allclose(got, ref, rtol=1e-6, atol=1e-6):
            raise AssertionError(f"{form.__name__} differs from reduce_scatter_tensor")
    for a, b, c in zip(all_gather_flat(), all_gather_coalesced(), all_gather_out()):
        if not (torch.equal(a.flatten(), b) and torch.equal(a, c)):
            raise AssertionError("all_gather_coalesced or all_gather_out differs from "
                                 "all_gather_flat")
    if not all(torch.equal(v, bucket[o:o + v.numel()])
               for v, o in zip(all_gather_ragged(), layout.offsets)):
        raise AssertionError("all_gather_ragged's views differ from the bucket")
    rows = []
    for form in (reduce_scatter, all_to_all_add, all_reduce_inplace, all_gather_flat,
                 all_gather_out, all_gather_coalesced, all_gather_ragged):
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
        print("| form | wall ms | CPU ms (process) | × reduce_scatter CPU |\n|---|---:|---:|---:|")
        for form, w, c in rows:
            print(f"| {form} | {1e3 * w:.1f} | {1e3 * c:.1f} | {c / rows[0][2]:.2f} |")
        flat, out, coalesced = rows[3][2], rows[4][2], rows[5][2]
        print(f"all_gather_out / all_gather_flat CPU: {out / flat:.2f}")
        print(f"all_gather_coalesced / all_gather_flat CPU: {coalesced / flat:.2f}")
        (_, fl_wall, _), (_, rg_wall, rg_cpu) = rows[3], rows[6]
        print(f"all_gather_ragged / all_gather_flat CPU: {rg_cpu / flat:.2f} "
              f"(wall {rg_wall / fl_wall:.2f})")
    dist.barrier()  # no rank tears its connections down while a peer still sends
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ns = ap.parse_args(argv)
    if ns.world_size < 2:
        ap.error(f"--world-size {ns.world_size} must be at least 2")
    # sizes from the parent: the workers import nothing but torch
    numels = block_numels(ns.world_size)
    spawn_local(_worker, ns.world_size, (ns.world_size, ns.reps, numels), fork=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
