"""Hardware profiles for the cost model: per-rank compute, memory and link numbers
(``Hardware``, ``HARDWARE``, ``get_hardware``), and ``calibrate_local``, which measures this
process and its process group instead.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm_cost import RING_FACTOR


@dataclass(frozen=True)
class Hardware:
    """Per-rank machine numbers. Times are seconds, rates are per second, sizes are bytes."""

    name: str
    flops_per_s: float    # sustained matmul FLOP/s of one rank in the compute dtype
    alpha_s: float        # fixed latency of one collective across nodes
    bandwidth_Bps: float  # per-rank bus bandwidth of a collective whose group spans nodes
    mem_bw_Bps: float     # memory bandwidth seen by non-matmul (elementwise, reduction) ops
    memory_bytes: int     # device memory of one rank
    # Fraction of a transfer that runs beside compute. GPUs: 1 (copy engines / NICs). A CPU
    # rank whose collectives are moved by threads on the same cores as its compute: ~0.
    comm_overlap: float = 1.0
    collective_overhead_s: float = 0.0  # compute-stream cost of issuing + waiting, per collective
    transport: str = "nccl"  # the process-group backend: "gloo" graphs get our gloo lowerings
    # A node holds gpus_per_node consecutive global ranks (torchrun's numbering). A group
    # whose ranks stay within nodes (see group_link) uses the intra-node link instead;
    # intra_node_bandwidth_Bps = 0: there is none, every group uses alpha_s / bandwidth_Bps.
    gpus_per_node: int = 1
    intra_node_alpha_s: float = 0.0
    intra_node_bandwidth_Bps: float = 0.0

    def __post_init__(self):
        for f in ("flops_per_s", "alpha_s", "bandwidth_Bps", "mem_bw_Bps", "memory_bytes",
                  "gpus_per_node"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Hardware.{f}={getattr(self, f)!r} must be > 0")
        for f in ("intra_node_alpha_s", "intra_node_bandwidth_Bps"):
            if getattr(self, f) < 0:
                raise ValueError(f"Hardware.{f}={getattr(self, f)!r} must be >= 0")


GPU_EFFICIENCY = 0.5  # sustained / peak dense matmul throughput assumed for large-model training

HARDWARE: dict[str, Hardware] = {
    # This CPU machine, gloo over loopback. Matmul: measured once with torch 2.13, 1 thread,
    # fp32 mm: 1024^3 -> 2.05e11 FLOP/s, 512^3 -> 2.0e11, 256^3 -> 1.2e11; we take 1.5e11 as the
    # sustained rate of the mixed sizes of a small model. out-of-place add (read+write): 28 GB/s
    # for 8-32 MiB tensors, 14 GB/s at 256 MiB; we take 2e10.
    # Collectives: DESIGN.md section 6 measured ~0.5 ms per gloo collective, loopback <= ~1 GB/s;
    # calibrate_local at 2 gloo ranks gave alpha 0.25-0.4 ms and 0.6-1.2 GB/s.
    # Fitted to python -m simplesharded.bench (llama3 small, 2 ranks on 2 cores): gloo's
    # transfer threads share the cores with compute (about half a transfer overlaps), each
    # collective costs
    # ~1 ms of dispatch/wake-up on the compute thread, and large copies run at ~5 GB/s while
    # the other rank and gloo also stream memory.
    "local": Hardware("local", flops_per_s=1.5e11, alpha_s=5e-4, bandwidth_Bps=3e8,
                      mem_bw_Bps=5e9, comm_overlap=0.85, collective_overhead_s=1e-3,
                      transport="gloo",
                      memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
    # H100 SXM: 989 TFLOP/s bf16 dense peak, 3.35 TB/s HBM3, 80 GB; one 400 Gb/s IB NIC per GPU
    # (= 50 GB/s) for a group spanning nodes; NCCL inter-node latency ~30 us. 8 GPUs per node
    # on NVLink 4 + NVSwitch: 18 links x 25 GB/s = 450 GB/s per direction per GPU; we assume
    # NCCL's ring all-gather / reduce-scatter reach 80% of it as bus bandwidth (360 GB/s),
    # about what nccl-tests report for large messages on 8 x H100 SXM, latency ~10 us.
    "h100-ib400": Hardware("h100-ib400", flops_per_s=989e12 * GPU_EFFICIENCY, alpha_s=30e-6,
                           bandwidth_Bps=50e9, mem_bw_Bps=3.35e12, memory_bytes=80 * 2**30,
                           gpus_per_node=8, intra_node_alpha_s=10e-6,
                           intra_node_bandwidth_Bps=360e9),
    # A100 SXM 80GB: 312 TFLOP/s bf16 dense peak, 2.0 TB/s HBM2e; 200 Gb/s IB per GPU (25 GB/s).
    # 8 GPUs per node on NVLink 3: 12 links x 25 GB/s = 300 GB/s per direction; 80% = 240 GB/s.
    "a100-ib200": Hardware("a100-ib200", flops_per_s=312e12 * GPU_EFFICIENCY, alpha_s=30e-6,
                           bandwidth_Bps=25e9, mem_bw_Bps=2.0e12, memory_bytes=80 * 2**30,
                           gpus_per_node=8, intra_node_alpha_s=10e-6,
                           intra_node_bandwidth_Bps=240e9),
}


def get_hardware(name: str) -> Hardware:
    if name not in HARDWARE:
        raise ValueError(f"hardware={name!r} is not one of {sorted(HARDWARE)}")
    return HARDWARE[name]


def _median_time(fn, reps: int, budget_s: float, sync=lambda: None) -> float:
    fn()
    sync()  # warm-up
    times, deadline = [], time.perf_counter() + budget_s
    while len(times) < reps and (len(times) < 3 or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate_local(seconds_budget: float = 5.0, group=None, device: str | torch.device = "cpu"
                    ) -> Hardware:
    """Measure this process: fp32 matmul FLOP/s and elementwise memory bandwidth on `device`
    (with the current torch thread count), and, if torch.distributed is initialised and the
    group has > 1 rank, alpha (median all-gather of 1 element per rank) and bus bandwidth
    (median all-gather of 4 MiB per rank). Collective timings use fixed repetition counts (every
    rank must issue the same collectives) and are max-reduced so all ranks return the same
    Hardware. Unmeasured fields come from HARDWARE["local"]."""
    base = HARDWARE["local"]
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n = 1024
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    flops = 2 * n**3 / _median_time(lambda: torch.mm(a, b), 9, 0.35 * seconds_budget, sync)
    del a, b
    x = torch.randn(8 * 2**20, device=device)  # 32 MiB: past L2, a large activation
    y = torch.empty_like(x)
    mem_bw = 2 * x.numel() * x.element_size() / _median_time(
        lambda: torch.add(x, 1.0, out=y), 9, 0.2 * seconds_budget, sync)
    del x, y
    alpha, bw = base.alpha_s, base.bandwidth_Bps
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        alpha, bw = _calibrate_comm(group)
    return Hardware("local-calibrated", flops_per_s=flops, alpha_s=alpha, bandwidth_Bps=bw,
                    mem_bw_Bps=mem_bw, memory_bytes=base.memory_bytes)


def _calibrate_comm(group) -> tuple[float, float]:
    ws = dist.get_world_size(group)
    backend = str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else \
        torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def gather_time(per_rank: int, reps: int) -> float:
        inp = torch.ones(per_rank, device=device)
        out = torch.empty(per_rank * ws, device=device)
        dist.barrier(group)
        times = []
        for _ in range(reps + 1):  # first is warm-up
            t0 = time.perf_counter()
            gather(out, inp, group=group)
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    small = gather_time(1, 11)
    per_rank = 2**20  # 4 MiB fp32 per rank
    large = gather_time(per_rank, 5)
    t = torch.tensor([small, large], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    small, large = t.tolist()
    moved = RING_FACTOR["all_gather"](ws) * per_rank * 4 * ws
    return small, moved / max(large - small, 1e-9)
