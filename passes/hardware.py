"""Hardware profiles for the cost model: per-rank compute, memory and link numbers
(``Hardware``, ``HARDWARE``, ``get_hardware``). Hand-written profiles for the planner, and
calibration files that ``python -m simplesharded.tools.calibrate`` measures (simplesharded/calibration.py,
which the default backends use).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path



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
    # Host offload (simplesharded/tools/offload_cost.py): the link between host memory and the
    # device (PCIe for a discrete GPU), per direction, as pinned-memory copies reach it; and
    # the host memory bandwidth one rank's optimizer step streams at on the host. 0: not
    # stated, and the planner refuses to forecast offload on this profile.
    host_link_Bps: float = 0.0
    host_mem_bw_Bps: float = 0.0

    def __post_init__(self):
        for f in ("flops_per_s", "alpha_s", "bandwidth_Bps", "mem_bw_Bps", "memory_bytes",
                  "gpus_per_node"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Hardware.{f}={getattr(self, f)!r} must be > 0")
        for f in ("intra_node_alpha_s", "intra_node_bandwidth_Bps", "host_link_Bps",
                  "host_mem_bw_Bps"):
            if getattr(self, f) < 0:
                raise ValueError(f"Hardware.{f}={getattr(self, f)!r} must be >= 0")


GPU_EFFICIENCY = 0.5  # sustained / peak dense matmul throughput assumed for large-model training

# Host side of an H100 SXM node (DGX H100: two Xeon Platinum 8480C, 2 TB of DDR5-4800, each GPU
# on PCIe Gen5 x16). Link: 32 GT/s x 16 lanes with 128b/130b encoding = 63 GB/s per direction
# nominal; we assume 50 GB/s for pinned-memory copies, about 80 % of it, the achieved figure
# commonly reported for H100 hosts. Host memory: 8 DDR5-4800 channels per socket = 307 GB/s
# peak per socket, 614 GB/s for the node; we assume one rank's host AdamW streams 50 GB/s
# (an assumption, not a measurement: an even eighth of the node's peak is 77 GB/s, and a CPU
# optimizer reaches a fraction of peak). Measured on one H200 host (same link), one rank, torch
# 2.11: calibrate's pinned copies 55 GB/s, its host elementwise 84 GB/s; Llama 3 1B's offloaded
# step (1.49 s at 5,500 tokens/s, less the plain step and the copies) puts the fused host AdamW
# at about 38 GB/s, so the 50 here is optimistic by about a third for that host.
H100_HOST = {"host_link_Bps": 50e9, "host_mem_bw_Bps": 50e9}
# DGX A100: two AMD EPYC 7742, 8 DDR4-3200 channels each (205 GB/s peak per socket), each GPU
# on PCIe Gen4 x16: 16 GT/s x 16 x 128/130 = 31.5 GB/s per direction nominal; assumed 25 GB/s
# achieved, and 40 GB/s of host memory for one rank's AdamW (as above, assumptions).
A100_HOST = {"host_link_Bps": 25e9, "host_mem_bw_Bps": 40e9}

HARDWARE: dict[str, Hardware] = {
    # This CPU machine, gloo over loopback. Matmul: measured once with torch 2.13, 1 thread,
    # fp32 mm: 1024^3 -> 2.05e11 FLOP/s, 512^3 -> 2.0e11, 256^3 -> 1.2e11; we take 1.5e11 as the
    # sustained rate of the mixed sizes of a small model. out-of-place add (read+write): 28 GB/s
    # for 8-32 MiB tensors, 14 GB/s at 256 MiB; we take 2e10.
    # Collectives: ~0.5 ms per gloo collective and loopback <= ~1 GB/s measured early on;
    # A 2-rank gloo calibration gave alpha 0.25-0.4 ms and 0.6-1.2 GB/s.
    # Fitted to python -m simplesharded.tools.bench (llama3 small, 2 ranks on 2 cores): gloo's
    # transfer threads share the cores with compute (about half a transfer overlaps), each
    # collective costs
    # ~1 ms of dispatch/wake-up on the compute thread, and large copies run at ~5 GB/s while
    # the other rank and gloo also stream memory.
    "local": Hardware("local", flops_per_s=1.5e11, alpha_s=5e-4, bandwidth_Bps=3e8,
                      mem_bw_Bps=5e9, comm_overlap=0.85, collective_overhead_s=1e-3,
                      transport="gloo", memory_bytes=24 * 2**30,
                      # host and device are one memory: a copy or an optimizer step streams
                      # it as an elementwise op does
                      host_link_Bps=5e9, host_mem_bw_Bps=5e9),
    # H100 SXM: 989 TFLOP/s bf16 dense peak, 3.35 TB/s HBM3, 80 GB; one 400 Gb/s IB NIC per GPU
    # (= 50 GB/s) for a group spanning nodes; NCCL inter-node latency ~30 us. 8 GPUs per node
    # on NVLink 4 + NVSwitch: 18 links x 25 GB/s = 450 GB/s per direction per GPU; we assume
    # NCCL's ring all-gather / reduce-scatter reach 80% of it as bus bandwidth (360 GB/s),
    # about what nccl-tests report for large messages on 8 x H100 SXM, latency ~10 us.
    "h100-ib400": Hardware("h100-ib400", flops_per_s=989e12 * GPU_EFFICIENCY, alpha_s=30e-6,
                           bandwidth_Bps=50e9, mem_bw_Bps=3.35e12, memory_bytes=80 * 2**30,
                           gpus_per_node=8, intra_node_alpha_s=10e-6,
                           intra_node_bandwidth_Bps=360e9, **H100_HOST),
    # A100 SXM 80GB: 312 TFLOP/s bf16 dense peak, 2.0 TB/s HBM2e; 200 Gb/s IB per GPU (25 GB/s).
    # 8 GPUs per node on NVLink 3: 12 links x 25 GB/s = 300 GB/s per direction; 80% = 240 GB/s.
    "a100-ib200": Hardware("a100-ib200", flops_per_s=312e12 * GPU_EFFICIENCY, alpha_s=30e-6,
                           bandwidth_Bps=25e9, mem_bw_Bps=2.0e12, memory_bytes=80 * 2**30,
                           gpus_per_node=8, intra_node_alpha_s=10e-6,
                           intra_node_bandwidth_Bps=240e9, **A100_HOST),
    # A low-bandwidth cluster: H100 nodes as above joined by one 100 Gb/s Ethernet NIC per
    # node (12.5 GB/s shared by its 8 GPUs: ~1.56 GB/s each for a group spanning nodes),
    # latency ~50 us; inside a node NVLink as h100-ib400. The setting quantized collectives
    # are made for.
    "h100-eth100": Hardware("h100-eth100", flops_per_s=989e12 * GPU_EFFICIENCY, alpha_s=50e-6,
                            bandwidth_Bps=100e9 / 8 / 8, mem_bw_Bps=3.35e12,
                            memory_bytes=80 * 2**30, gpus_per_node=8,
                            intra_node_alpha_s=10e-6, intra_node_bandwidth_Bps=360e9,
                            **H100_HOST),
}


def get_hardware(name: str) -> Hardware:
    """A profile by name, or the profile a calibration file holds (``*.json``, written by
    ``python -m simplesharded.tools.calibrate``: its ``"hardware"`` entry has Hardware's fields)."""
    if name.endswith(".json"):
        try:
            return Hardware(**json.loads(Path(name).read_text())["hardware"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"hardware={name!r}: not a readable calibration file ({e})") from None
    if name not in HARDWARE:
        raise ValueError(f"hardware={name!r} is not one of {sorted(HARDWARE)} or a calibration "
                         ".json file")
    return HARDWARE[name]
