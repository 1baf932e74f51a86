"""``python -m simplesharded.tools.calibrate [--dtype D] [--force]``: measure this machine's
numbers for the cost model (simplesharded/calibration.py) with one rank per accelerator (2 gloo
ranks on CPU), write them to the cache the ``calibrated`` backends read, and print them.

``--dtype`` is the run's compute dtype (training.mixed_precision_param), the dtype the matmuls
are timed in: float32 (the trainer's default), bfloat16, float16, or tf32 (float32 with TF32
matmuls allowed in the ranks, as a process that sets ``torch.backends.cuda.matmul.allow_tf32 =
True`` runs them). Each has a cache entry of its own. Accelerator ranks start with expandable
segments (simplesharded/shims/launch_env.py; a setting of the user's wins)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from simplesharded.calibration import cache_path, calibrated
from simplesharded.mesh import device_type, exit_rank, spawn_local
from simplesharded.shims.launch_env import allocator_env


def format_report(result: dict, path: Path | None = None) -> str:
    hw, m = result["hardware"], result["measured"]
    lines = [f"calibration {result['key']}" + (f"  ({path})" if path else ""),
             f"  matmul        {hw['flops_per_s'] / 1e12:8.3f} TFLOP/s "
             f"({m['compute'].get('matmul_kind', m['compute']['matmul_dtype'])})",
             f"  elementwise   {hw['mem_bw_Bps'] / 1e9:8.2f} GB/s",
             f"  memory        {hw['memory_bytes'] / 2**30:8.1f} GiB"]
    if hw.get("host_link_Bps"):  # caches written before the host was measured lack it
        lines.append(f"  host link     {hw['host_link_Bps'] / 1e9:8.2f} GB/s   host memory "
                     f"{hw['host_mem_bw_Bps'] / 1e9:.2f} GB/s")
    for kind, c in m.get("collectives", {}).items():
        lines.append(f"  {kind:<15}latency {c['alpha_s'] * 1e3:7.3f} ms   bus bandwidth "
                     f"{c['bandwidth_Bps'] / 1e9:7.3f} GB/s")
    if "overlap" in m:
        o = m["overlap"]
        lines.append(f"  beside compute: {o['comm_overlap'] * 100:.0f} % of a transfer hidden, "
                     f"{o['collective_overhead_s'] * 1e3:.3f} ms per collective on the compute stream")
    lines.append(f"  profile: alpha {hw['alpha_s'] * 1e3:.3f} ms, bandwidth "
                 f"{hw['bandwidth_Bps'] / 1e9:.3f} GB/s, transport {hw['transport']}")
    return "\n".join(lines)


DTYPES = ("float32", "bfloat16", "float16", "tf32")


def _rank_main(rank: int, nproc: int, force: bool, queue, dtype: str = "float32") -> None:
    from simplesharded.mesh import backend_for, device_type

    if dtype == "tf32":  # float32 matmuls on TF32 tensor cores, as the run will allow them
        torch.backends.cuda.matmul.allow_tf32 = True
        dtype = "float32"
    device, kwargs = device_type(), {}
    if device != "cpu":  # one device per rank, bound to the group (no device guessing)
        index = rank % torch.accelerator.device_count()
        torch.accelerator.set_device_index(index)
        kwargs["device_id"] = torch.device(device, index)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    dist.init_process_group(backend_for(device), rank=rank, world_size=nproc, **kwargs)
    result = calibrated(force=force, dtype=dtype)
    if rank == 0:
        queue.put((result, str(cache_path(result["key"]))))
    dist.barrier()
    dist.destroy_process_group()
    exit_rank(0)  # gloo's threads outlive the group: no interpreter shutdown under them


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simplesharded.tools.calibrate",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=None,
                    help="ranks on this host (default: the GPU count, or 2 on CPU)")
    ap.add_argument("--force", action="store_true", help="measure even if a cache entry exists")
    ap.add_argument("--dtype", default="float32", choices=DTYPES,
                    help="the run's compute dtype, which the matmuls are timed in (default "
                         "float32, the trainer's training.mixed_precision_param default; tf32: "
                         "float32 with TF32 matmuls allowed)")
    ns = ap.parse_args(argv)
    import torch.multiprocessing as mp

    nproc = ns.nproc or (torch.accelerator.device_count() if torch.accelerator.is_available()
                         else 2)
    if nproc < 1:
        print(f"--nproc={nproc}: must be >= 1", file=sys.stderr)
        return 2
    queue = mp.get_context("spawn").SimpleQueue()
    spawn_local(_rank_main, nproc, (nproc, ns.force, queue, ns.dtype), env=allocator_env(device_type()))
    result, path = queue.get()
    print(format_report(result, Path(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
