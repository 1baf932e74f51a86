"""What host offload (simplesharded/storage/offload.py, ``parallelism.offload``) changes in the
planner's numbers, read off the graphs of the same step traced *without* offload.

Why not trace the offloaded model: the planner's model lives on the meta device, but an
offloaded bucket's host shard is a real host tensor (``to_host`` allocates it), so a trace of
Llama 3 70B would reserve the whole model's fp32 shards in this machine's memory. The copies
offload adds are fixed by the ragged buckets' collectives, which the plain trace has: one
host-to-device copy of a bucket's shard right before each of its all-gathers (``params``), one
device-to-host copy of its reduced gradient right after each of its reduce-scatters (both
offloads), and under ``optimizer`` one copy of the whole shard to its resident copy per
forward.

Memory (device bytes per rank): the static state is cluster_trace.static_memory's (it takes
the offload); the graphs' transient peak counts backward's reduced gradients once
(cluster_trace.without_gradients: they leave at their reduction, as in a step of one
micro-batch without offload, whose gradients become the static ones); added to it, as
bytes in flight (an upper bound: added to the peak wherever the peak is), under both offloads
the reduced gradient a copy to the host still reads until the next copy's wait, and under
``params`` two of the copies to the device: the one a gather (or on one rank the compute)
reads while it is cast and gathered, and the next, issued one copy ahead
(passes/offload_copies.py); each the largest bucket's fp32 shard.

Time: serialised with compute, an upper bound. The copies run on the device's copy streams
(passes/offload_copies.py: a copy to the device issued one copy ahead of its wait, a copy to
the host waited at the next one), so compute may hide them, but how much is for a GPU run to
measure (``optimizer``'s refresh of the resident copies is issued at the forward's start,
each bucket's waited at its first read). Each copy
is charged its bytes / ``Hardware.host_link_Bps``. The host's optimizer step (AdamW reads
parameter, gradient and two moments and writes three of them: 7 fp32 streams per element)
runs between backward and the next forward at ``Hardware.host_mem_bw_Bps``; without offload
the device's runs at ``mem_bw_Bps``. Not modelled: the CPU cores the host optimizer shares with
the input pipeline, parameters outside ragged buckets (tied or frozen before wrapping: they
stay on the device, here counted as offloaded), and several ranks of a node sharing one
host's memory bandwidth beyond what the profile's per-rank figure says.
"""
from __future__ import annotations

from torch import fx

from simplesharded.passes.collectives import find_collectives
from simplesharded.passes.node_meta import node_value

MASTER_BYTES = 4  # a bucket's shard, gradient and optimizer state are fp32 (static_memory's)
ADAMW_STREAMS = 7  # fp32 arrays an AdamW step reads or writes per parameter element


def bucket_shards(fw: fx.GraphModule | fx.Graph, bw: fx.GraphModule | fx.Graph
                  ) -> dict[str, int]:
    """Shard elements moved by offload copies in one forward and backward: ``gathered``, the
    sum over every ragged bucket all-gather (forward's and backward's regathers) of its
    rank's shard ``[L]``; ``reduced``, the same over backward's ragged reduce-scatters;
    ``largest``, the largest ``[L]`` gathered; ``forward``, forward's gathers alone (each
    bucket once: the rank's bucketed parameter elements)."""
    out = {"gathered": 0, "reduced": 0, "largest": 0, "forward": 0}
    for which, gm in (("fw", fw), ("bw", bw)):
        for c in find_collectives(gm.graph if isinstance(gm, fx.GraphModule) else gm):
            if not c.prebucketed or c.kind not in ("all_gather", "reduce_scatter"):
                continue
            produced = node_value(c.start).numel()
            if c.kind == "all_gather":  # produced: every rank's [L]
                shard = produced // max(c.group_size, 1)
                out["gathered"] += shard
                out["largest"] = max(out["largest"], shard)
                out["forward"] += shard if which == "fw" else 0
            else:  # produced: this rank's [L]
                out["reduced"] += produced
    return out


def copy_bytes(m: dict, offload: str) -> tuple[float, float]:
    """(host-to-device, device-to-host) bytes of offload's copies in one step of numbers
    ``m`` (forecast's: ``local_numel``, ``offload:gathered``, ``offload:reduced``)."""
    if offload == "none":
        return 0.0, 0.0
    # params: each gather's shard; optimizer: the whole shard to its resident copy, once
    to_device = m["offload:gathered"] if offload == "params" else m["local_numel"]
    return MASTER_BYTES * to_device, MASTER_BYTES * m["offload:reduced"]


def copy_seconds(m: dict, offload: str, hw) -> float:
    """Seconds offload's copies add to one step (module doc: serialised with compute, an upper
    bound)."""
    if offload == "none":
        return 0.0
    return sum(copy_bytes(m, offload)) / host_link(hw)


def optimizer_seconds(local_numel: float, offload: str, hw) -> float:
    """Seconds of one AdamW step over ``local_numel`` elements, memory bound: on the device
    without offload, on the host with it."""
    rate = hw.mem_bw_Bps if offload == "none" else host_memory_bandwidth(hw)
    return ADAMW_STREAMS * MASTER_BYTES * local_numel / rate


def check_hardware(hw, offload: str) -> None:
    """A ValueError naming what ``hw`` does not state that forecasting ``offload`` reads."""
    if offload != "none":
        host_link(hw)
        host_memory_bandwidth(hw)


def host_link(hw) -> float:
    if not hw.host_link_Bps > 0:
        raise ValueError(f"hardware {hw.name!r} states no host link (host_link_Bps), which "
                         f"forecasting offload needs")
    return hw.host_link_Bps


def host_memory_bandwidth(hw) -> float:
    if not hw.host_mem_bw_Bps > 0:
        raise ValueError(f"hardware {hw.name!r} states no host memory bandwidth "
                         f"(host_mem_bw_Bps), which forecasting offload needs")
    return hw.host_mem_bw_Bps


def in_flight_copy_bytes(m: dict, offload: str) -> float:
    """Device bytes offload's copies hold beside the graphs' peak (module doc): the reduced
    gradient a copy to the host reads, and under ``params`` two copies to the device; each
    the largest bucket's fp32 shard."""
    copies = {"none": 0, "optimizer": 1, "params": 3}[offload]
    return copies * MASTER_BYTES * m["offload:largest"]

