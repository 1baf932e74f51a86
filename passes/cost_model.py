"""Cost model for the bucket planner and the schedule simulator: compute time, comm time, memory.

Three independent estimates, all from an FX graph's ``meta["val"]`` (FakeTensors or tensors) or
``meta["tensor_meta"]`` (ShapeProp), so they work on CPU and on fake-process-group dry runs:

* compute: ``node_flops`` (torch.utils.flop_counter formulas) and ``node_time`` =
  max(FLOPs / flops_per_s, bytes touched / mem_bw) -- a roofline with one sustained rate each;
* communication: ``comm_time`` = alpha + ring-algorithm bytes / bus bandwidth (alpha-beta), on
  the link the group's ranks use (``group_link``: intra-node NVLink-class or inter-node NIC);
* memory: ``memory_timeline`` / ``peak_memory`` -- liveness of buffers in graph order, where
  views, in-place ops and ``wait_tensor`` alias their base instead of allocating.

Collectives and waits cost 0 in ``node_time``; the caller costs them with ``comm_time`` (see
``collective_time``) because they run on a different stream than compute.
"""
from __future__ import annotations

import functools
import math
import operator
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.fx.passes.shape_prop import TensorMetadata
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from .collectives import WAIT, Collective, group_ranks, is_collective, is_wait

aten = torch.ops.aten


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


# ---------------------------------------------------------------------------------------------
# Communication

# Bytes each rank sends (= receives) in a ring algorithm, as a multiple of `nbytes`, where nbytes
# is the gathered output of an all-gather, the full input of a reduce-scatter, the tensor of an
# all-reduce.
_RING_FACTOR = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
                "all_reduce": lambda n: 2 * (n - 1) / n}


INTRA_NODE, INTER_NODE = "intra-node", "inter-node"  # the links of a Hardware


@functools.lru_cache(maxsize=256)
def intra_node(ranks: tuple[int, ...], world_size: int, gpus_per_node: int) -> bool:
    """Whether a process group with these global ranks, and every group of its family, has
    all its ranks within one node (nodes: ``gpus_per_node`` consecutive ranks).

    Decided for the family, not for the group alone, so that every rank decides the same:
    each rank sees only its own group, and all ranks must pick the same buckets without
    talking to each other. A DeviceMesh dim's groups are arithmetic progressions of one size
    n and stride s that tile the world (the mesh is ``arange(world)`` in row-major order);
    the family is every such progression. A group that is not one (a user-made group) is
    taken to span nodes, which no rank can contradict.
    """
    n = len(ranks)
    if n <= 1:
        return True
    stride = ranks[1] - ranks[0]
    if stride <= 0 or any(b - a != stride for a, b in zip(ranks, ranks[1:])) or \
            world_size % (n * stride) or ranks[0] >= world_size:
        return False
    bases = (b for b in range(world_size) if (b // stride) % n == 0)
    return all(b // gpus_per_node == (b + (n - 1) * stride) // gpus_per_node for b in bases)


def group_link(group_name: str, hw: Hardware) -> str:
    """INTRA_NODE when ``hw`` has an intra-node link and the group's family lies within nodes
    (:func:`intra_node`; with tp innermost, tp groups do when tp divides gpus_per_node), else
    INTER_NODE, also for a group that cannot be resolved (no live process group)."""
    if not hw.intra_node_bandwidth_Bps:
        return INTER_NODE
    found = group_ranks(group_name)
    if found is None:
        return INTER_NODE
    ranks, world = found
    return INTRA_NODE if intra_node(ranks, world, hw.gpus_per_node) else INTER_NODE


def comm_time(kind: str, nbytes: int, group_size: int, hw: Hardware,
              link: str = INTER_NODE) -> float:
    """Seconds for one collective on ``link``: alpha + ring bytes / bandwidth; 0 for a group
    of one."""
    if kind not in _RING_FACTOR:
        raise ValueError(f"kind={kind!r} is not one of {sorted(_RING_FACTOR)}")
    if link not in (INTRA_NODE, INTER_NODE):
        raise ValueError(f"link={link!r} is not one of {[INTRA_NODE, INTER_NODE]}")
    if group_size <= 1:
        return 0.0
    alpha, bandwidth = ((hw.intra_node_alpha_s, hw.intra_node_bandwidth_Bps)
                        if link == INTRA_NODE and hw.intra_node_bandwidth_Bps
                        else (hw.alpha_s, hw.bandwidth_Bps))
    return alpha + _RING_FACTOR[kind](group_size) * nbytes / bandwidth


def collective_time(c: Collective, hw: Hardware, group_size: int | None = None,
                    link: str | None = None) -> float:
    """comm_time of a found Collective (its nbytes is the produced buffer: the shard for a
    reduce-scatter, so the full input is nbytes * group size) on its group's link (``link``
    overrides :func:`group_link`). all_reduce nodes do not carry their group size; pass it."""
    n = group_size if group_size is not None else c.group_size
    nbytes = c.nbytes * n if c.kind == "reduce_scatter" else c.nbytes
    return comm_time(c.kind, nbytes, n, hw, link or group_link(c.group_name, hw))


# ---------------------------------------------------------------------------------------------
# Shapes from node metadata

UNBACKED_FALLBACK = 4096  # size assumed for a data-dependent (unbacked) symbolic dimension


def _int(x) -> int:
    if isinstance(x, torch.SymInt):
        try:
            return int(optimization_hint(x, fallback=UNBACKED_FALLBACK))
        except Exception:
            return UNBACKED_FALLBACK
    return int(x)


def _node_meta(node: fx.Node):
    """A node's output as meta tensor(s) with concrete sizes: Tensor, list for tuple/list
    outputs (recursively), or None. Reads meta["val"] (aot/inductor) or meta["tensor_meta"]."""
    return _as_meta(node.meta["val"] if "val" in node.meta else node.meta.get("tensor_meta"))


def _as_meta(v):
    if isinstance(v, (torch.Tensor, TensorMetadata)):
        stride = v.stride() if isinstance(v, torch.Tensor) else v.stride
        return torch.empty_strided([_int(x) for x in v.shape], [_int(x) for x in stride],
                                   dtype=v.dtype, device="meta")
    if isinstance(v, (tuple, list)):
        return [_as_meta(x) for x in v]
    return None


def _bytes(t) -> int:
    """Bytes of distinct elements (an expanded, stride-0 dim counts once); lists summed."""
    if isinstance(t, list):
        return sum(_bytes(x) for x in t)
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return 0
    return math.prod(n for n, st in zip(t.shape, t.stride()) if st != 0) * t.element_size()


def node_bytes(node: fx.Node) -> int:
    """Bytes of a node's output tensors (tuples summed); 0 when it has no tensor metadata."""
    return _bytes(_node_meta(node))


# ---------------------------------------------------------------------------------------------
# Compute

# CPU (and other) attention kernels torch's flop_registry does not list; same math as the
# flash variants, whose formulas read only (grad_out,) query, key, value shapes.
_EXTRA_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu:
        flop_registry[aten._scaled_dot_product_flash_attention],
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        flop_registry[aten._scaled_dot_product_flash_attention_backward],
}
_FLOPS = {**flop_registry, **_EXTRA_FLOPS}

# Views although their schema does not say so (wait_tensor returns the collective's buffer,
# _unsafe_view reuses its freshly computed input).
_VIEW_TARGETS = {operator.getitem, WAIT, aten._unsafe_view.default}
# Allocate without touching memory: cost no time.
_NO_TRAFFIC = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default}
# Schema says "may alias": a view only when the input is contiguous and the dtype unchanged.
_MAYBE_VIEW = {aten.reshape, aten.reshape_as, aten.flatten, aten.contiguous, aten.to,
               aten.type_as}


def _meta_arg(a):
    if not isinstance(a, fx.Node):
        return a
    v = a.meta.get("val")
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _int(v) if isinstance(v, torch.SymInt) else v.node.hint
    return _node_meta(a)


def _decomposes(op: torch._ops.OpOverload) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def node_flops(node: fx.Node) -> int:
    """FLOPs of one node (matmuls, convolutions, attention), from torch.utils.flop_counter's
    formulas on the node's metadata shapes. Ops torch has no formula for count 0, except
    CompositeImplicit ops (e.g. aten.linear, aten.matmul in pre-dispatch graphs), which are run
    on meta tensors under FlopCounterMode. Never raises."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or not (
            t.overloadpacket in _FLOPS or _decomposes(t)):
        return 0
    try:
        args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), _meta_arg)
        if t.overloadpacket in _FLOPS:
            return int(_FLOPS[t.overloadpacket](*args, **kwargs, out_val=_node_meta(node)))
        with FlopCounterMode(display=False) as counter:
            t(*args, **kwargs)
        return int(counter.get_total_flops())
    except Exception:
        return 0


def _alias_kind(node: fx.Node) -> str | None:
    """"view" (output shares an input's storage, no data moved), "inplace" (writes into an
    input, returns it) or None (fresh output)."""
    t = node.target
    if node.op != "call_function":
        return None
    if t in _VIEW_TARGETS:
        return "view"
    if not isinstance(t, torch._ops.OpOverload):
        return None
    infos = [r.alias_info for r in t._schema.returns if r.alias_info is not None]
    if not infos:
        return None
    if any(i.is_write for i in infos):
        return "inplace"
    if t.overloadpacket in _MAYBE_VIEW:
        src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        i, o = _node_meta(src) if src is not None else None, _node_meta(node)
        if not (isinstance(i, torch.Tensor) and isinstance(o, torch.Tensor)
                and i.is_contiguous() and i.dtype == o.dtype):
            return None
    return "view"


def _aliased_inputs(node: fx.Node) -> list[fx.Node]:
    """The input(s) whose storage the output of an aliasing node shares."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        for arg, val in zip(t._schema.arguments, node.args):
            if arg.alias_info is not None and isinstance(val, fx.Node):
                return [val]
    first = node.args[0] if node.args else None
    return [first] if isinstance(first, fx.Node) else []


def node_time(node: fx.Node, hw: Hardware) -> float:
    """Roofline seconds of a compute node: max(FLOPs / flops_per_s, bytes read+written / mem_bw).
    0 for placeholders, output, views/getitem, collectives and waits (see comm_time)."""
    if node.op != "call_function" or is_collective(node) or is_wait(node):
        return 0.0
    if node.target in _NO_TRAFFIC or _alias_kind(node) == "view":
        return 0.0
    if _node_meta(node) is None:
        return 0.0  # no tensor output (sym_size, scalar arithmetic, ...)
    moved = node_bytes(node) + sum(node_bytes(a) for a in node.all_input_nodes)
    return max(node_flops(node) / hw.flops_per_s, moved / hw.mem_bw_Bps)


# ---------------------------------------------------------------------------------------------
# Memory

def _graph(g) -> fx.Graph:
    return g.graph if isinstance(g, fx.GraphModule) else g


def _liveness(graph: fx.Graph):
    """Buffers of a graph: returns (nodes, alloc, frees, size, is_input), where alloc[i] lists
    the buffer keys node i allocates, frees[i] those whose last use is node i."""
    nodes = list(graph.nodes)
    size: dict[tuple, int] = {}              # buffer key (node name, output index) -> bytes
    is_input: dict[tuple, bool] = {}
    alloc: list[list[tuple]] = [[] for _ in nodes]
    refs: dict[fx.Node, set] = {}            # buffers a node's value lives in
    elems: dict[fx.Node, list[set]] = {}     # per-output buffers of a multi-output producer
    last: dict[tuple, int] = {}              # buffer key -> index of its last use
    for i, n in enumerate(nodes):
        src, idx = (n.args + (None, None))[:2] if n.op == "call_function" else (None, None)
        item = n.target is operator.getitem and src in elems and isinstance(idx, int) and \
            -len(elems[src]) <= idx < len(elems[src])
        if item:  # one output of a multi-output op: keeps only that output alive
            refs[n] = elems[src][idx]
        elif _alias_kind(n) is not None:
            refs[n] = set().union(*(refs[a] for a in _aliased_inputs(n) if a in refs))
        else:
            out = _node_meta(n) if n.op != "output" else None
            parts = []
            for j, t in enumerate(out if isinstance(out, list) else [out]):
                key, b = (n.name, j), _bytes(t)
                if b:
                    size[key], last[key] = b, i
                    is_input[key] = n.op in ("placeholder", "get_attr")
                    alloc[i].append(key)
                parts.append({key} if b else set())
            refs[n] = set().union(*parts)
            if isinstance(out, list):
                elems[n] = parts
        used = [refs[n]] if item else [refs.get(a, set()) for a in n.all_input_nodes]
        if is_wait(n) and isinstance(src, fx.Node) and is_collective(src):
            used += [refs.get(a, set()) for a in src.all_input_nodes]  # read until complete
        for k in set().union(*used):
            last[k] = i

    frees: list[list[tuple]] = [[] for _ in nodes]
    for k, i in last.items():
        frees[i].append(k)
    return nodes, alloc, frees, size, is_input


def memory_timeline(graph, include_inputs: bool = True) -> list[int]:
    """Bytes live while each node runs (its inputs and its fresh outputs), in graph order.

    A node's output is allocated at the node and freed after the last user of it or of any
    alias of it (views, in-place results, getitem, wait_tensor). A collective's buffer is live
    from its start until after the last user of its wait; its input is held until the wait.
    Placeholders (and get_attr constants) are inputs: live from the start until their last use,
    counted only with ``include_inputs``."""
    nodes, alloc, frees, size, is_input = _liveness(_graph(graph))
    live = sum(b for k, b in size.items() if is_input[k]) if include_inputs else 0
    timeline = []
    for i in range(len(nodes)):
        live += sum(size[k] for k in alloc[i] if not is_input[k])
        timeline.append(live)
        live -= sum(size[k] for k in frees[i] if include_inputs or not is_input[k])
    return timeline


def peak_memory(graph, include_inputs: bool = True) -> tuple[int, fx.Node | None]:
    """(peak bytes of memory_timeline, first node where it occurs); (0, None) for no nodes."""
    g = _graph(graph)
    timeline = memory_timeline(g, include_inputs)
    if not timeline:
        return 0, None
    i = max(range(len(timeline)), key=timeline.__getitem__)
    return timeline[i], list(g.nodes)[i]


def input_bytes(graph) -> int:
    """Bytes of the graph's placeholders and get_attr constants."""
    return sum(node_bytes(n) for n in _graph(graph).nodes if n.op in ("placeholder", "get_attr"))


# ---------------------------------------------------------------------------------------------
# Calibration

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
    moved = _RING_FACTOR["all_gather"](ws) * per_rank * 4 * ws
    return small, moved / max(large - small, 1e-9)
