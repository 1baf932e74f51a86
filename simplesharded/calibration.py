"""Measure this machine and its process groups once, agree on the numbers, cache them.

``python -m simplesharded.tools.calibrate [--nproc N]`` prints the figures and writes the cache;
``make_backend(..., hardware="calibrated")`` (the default) reads it, measuring first when
there is none. What is measured, on the real device and the real process group:

* compute: matmul FLOP/s in the run's compute dtype (``dtype``: the dtype the gathered
  parameters compute in, default float32; a float32 matmul on an accelerator runs as TF32 when
  this process allows it, :func:`matmul_kind`, and is timed so) and the bandwidth an
  elementwise op sees (on a buffer past the caches: 32 MiB on CPU, at least 1 GiB and 8 times
  the L2 cache on an accelerator); device memory from the device (host RAM on CPU);
* per collective kind (all-gather, reduce-scatter, all-reduce, all-to-all): latency (one
  element per rank) and bus bandwidth (4 MiB per rank on CPU; on an accelerator a 256 MiB
  buffer, the gathered or reduced one, so NVLink and InfiniBand run bandwidth-bound); on gloo
  the reduce-scatter is timed in the form our passes issue (all-to-all + adds,
  passes/lowering.py);
* with concurrent compute: the compute-stream time a transfer costs (``comm_overlap``) and
  the cost per collective of issuing and waiting (``collective_overhead_s``), the two numbers
  the simulator charges to the compute stream;
* the host, for the planner's model of host offload (simplesharded/tools/offload_cost.py): on
  an accelerator, a copy between pinned host memory and the device each way (256 MiB; the
  harmonic mean of the two directions is ``host_link_Bps``) and the bandwidth an elementwise
  op sees in host memory (``host_mem_bw_Bps``); on a CPU device host and device are one
  memory, and both are the elementwise bandwidth measured above. A cache written before
  these were measured has neither (0: the planner refuses to forecast offload on it).

Timing: on CPU the median of single calls (wall clock); on an accelerator device events around
windows of back-to-back calls, one synchronisation per window (a synchronisation per call would
add the host's launch and wake-up latency to every kernel), the median window's mean.

Every rank must end with the same numbers (each rank compiles its own plan, and the plans must
match, docs/rank_agreement.md). So the numbers are reduced over the group (times: the slowest
rank's; memory: the smallest), every collective loop has a fixed repetition count, and the
cache is used only when every rank holds the same cache entry (one tiny all-gather decides,
always issued by every rank). All of it runs at start-up, outside compilation: a collective at
compile time deadlocks when one rank's compile is served from a cache.

The cache is one JSON file per (hosts, device, transport, world size, matmul kind) under
``$SIMPLESHARDED_CACHE_DIR`` (default ``~/.cache/simplesharded``); a second compute dtype on
the same machine and group measures only its matmul and takes the collectives from the first
one's file. Pin a profile by passing its
file as ``hardware="path.json"`` (``--compile.hardware`` in the trainer): it is then loaded
as is, never re-measured.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from simplesharded.passes.comm_cost import RING_FACTOR
from simplesharded.passes.hardware import Hardware, get_hardware

CALIBRATED = "calibrated"  # the hardware name that means "measure (or read the cache)"
# In the cache key: a cache written by an earlier way of measuring is measured again.
_METHOD = 3
CACHE_ENV = "SIMPLESHARDED_CACHE_DIR"
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
_LARGE = 2**20  # CPU: elements per rank (4 MiB fp32) for the bandwidth point
_CPU_STREAM_ELEMENTS = 8 * 2**20  # 32 MiB: past a CPU's caches, like an activation
# Accelerators: an elementwise buffer this many times the L2 (and at least _STREAM_MIN_BYTES)
# reads from device memory, not from the L2 (an H100's 50 MiB L2 served the old 32 MiB).
_STREAM_MIN_BYTES, _STREAM_L2_MULTIPLE = 2**30, 8
_COLLECTIVE_BYTES = 256 * 2**20  # the gathered / reduced buffer of the bandwidth point
_WINDOWS, _WINDOW_REPS = 3, 20  # accelerator timing: windows of back-to-back calls
# Accelerator: the pinned host buffer of the host figures, past a server socket's last-level
# cache (about 100 MiB on current ones) so that host memory, not the cache, is timed
_HOST_BYTES = 256 * 2**20


MATMUL_KINDS = ("bfloat16", "float16", "tf32", "float32")
_TF32_OVERRIDE = "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"  # cuBLAS takes TF32 whatever the flags say


def resolve_hardware(spec: str | Hardware, group=None, dtype=None) -> Hardware:
    """The one place a hardware option becomes numbers: a Hardware as is, ``"calibrated"``
    (measured here in compute dtype ``dtype``, or read from the cache, see module doc), else
    ``get_hardware`` (a profile name or a calibration .json file, taken as they are)."""
    if isinstance(spec, Hardware):
        return spec
    if spec == CALIBRATED:
        return calibrated_hardware(group, dtype=dtype)
    return get_hardware(spec)


def compute_dtype(dtype=None) -> torch.dtype:
    """``dtype`` (a torch.dtype or its name, e.g. "bfloat16") as a floating torch.dtype;
    None: torch's default dtype (float32 unless changed)."""
    if dtype is None:
        return torch.get_default_dtype()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"compute dtype {dtype!r} is not a floating-point torch dtype")
    return dtype


def fp32_matmul_uses_tf32() -> bool:
    """Whether this process lets cuBLAS run float32 matmuls on TF32 tensor cores:
    ``torch.backends.cuda.matmul.fp32_precision`` when set ("tf32" / "ieee"; every TF32 setter
    sets it since torch 2.9), else ``torch.get_float32_matmul_precision() != "highest"``
    (``allow_tf32``'s old form), or $TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1."""
    if os.environ.get(_TF32_OVERRIDE) == "1":
        return True
    setting = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")
    if setting in ("tf32", "ieee"):
        return setting == "tf32"
    try:
        return torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:  # the old getter refuses once the new API was used: that said "none"
        return False


def matmul_kind(dtype=None, device: torch.device | str = "cpu") -> str:
    """What a matmul in ``dtype`` runs as on ``device``, one of MATMUL_KINDS (the dtypes of the
    published peaks, simplesharded/trainer/device_peaks.py): bfloat16 and float16 as
    themselves; float32 on an accelerator "tf32" when :func:`fp32_matmul_uses_tf32`, else (and
    on CPU) "float32"."""
    dtype = compute_dtype(dtype)
    if dtype in (torch.bfloat16, torch.float16):
        return str(dtype).removeprefix("torch.")
    if dtype != torch.float32:
        raise ValueError(f"compute dtype {dtype} is not one of {list(MATMUL_KINDS)}")
    accelerator = torch.device(device).type != "cpu"
    return "tf32" if accelerator and fp32_matmul_uses_tf32() else "float32"


# ---------------------------------------------------------------------------------------------
# Measurements (every collective loop: fixed repetitions, same on every rank)

def _accelerator(device: torch.device) -> bool:
    return device.type != "cpu"


def _median(fn, reps: int) -> float:
    """CPU: the median wall time of ``reps`` single calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _device_time(fn, device: torch.device) -> float:
    """Accelerator: seconds per call from device events around _WINDOWS windows of
    _WINDOW_REPS back-to-back calls, the median window's mean. One un-timed call before each
    window: a collective there lines the ranks up, so no window waits for a late rank."""
    fn()
    torch.accelerator.synchronize(device)
    times = []
    for _ in range(_WINDOWS):
        start = torch.Event(device=device, enable_timing=True)
        end = torch.Event(device=device, enable_timing=True)
        fn()
        start.record()
        for _ in range(_WINDOW_REPS):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / _WINDOW_REPS)
    return statistics.median(times)


def _time(fn, device: torch.device, cpu_reps: int) -> float:
    """Seconds per call of ``fn`` on ``device`` (see the module doc's timing)."""
    return _device_time(fn, device) if _accelerator(device) else _median(fn, cpu_reps)


def _device_module(device: torch.device):
    return getattr(torch, device.type)  # torch.cuda, torch.xpu, ...


def stream_elements(device: torch.device) -> int:
    """fp32 elements of the elementwise-bandwidth buffer: CPU as ever; an accelerator at
    least _STREAM_MIN_BYTES and _STREAM_L2_MULTIPLE times its L2 where the device reports it,
    at most 1/8 of its free memory (the op holds two such buffers)."""
    if not _accelerator(device):
        return _CPU_STREAM_ELEMENTS
    props = _device_module(device).get_device_properties(device)
    l2 = getattr(props, "L2_cache_size", 0)
    free = torch.accelerator.get_memory_info(device)[0]
    want = max(_STREAM_MIN_BYTES, _STREAM_L2_MULTIPLE * l2)
    return max(4 * _CPU_STREAM_ELEMENTS, min(want, free // 8)) // 4


def collective_elements(kind: str, world_size: int, device: torch.device) -> int:
    """fp32 elements per rank of ``kind``'s bandwidth point (_collective's ``per_rank``): 4 MiB
    per rank on CPU as ever; on an accelerator the collective's buffer (gathered output,
    reduced input, all-reduce buffer, all-to-all buffer) is _COLLECTIVE_BYTES at every world
    size, large enough for NVLink and InfiniBand to run at bandwidth, not latency."""
    if not _accelerator(device):
        return _LARGE
    share = 1 if kind == "all_reduce" else world_size
    return max(1, _COLLECTIVE_BYTES // 4 // share)


def measure_compute(device: torch.device, dtype=None) -> dict:
    """Matmul FLOP/s in ``dtype`` (:func:`compute_dtype`) as this process runs it (float32 on
    an accelerator: TF32 or not, :func:`matmul_kind`), and the elementwise bandwidth."""
    dtype = compute_dtype(dtype)
    n = 4096 if _accelerator(device) else 1024
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    flops = 2 * n**3 / _time(lambda: torch.mm(a, b), device, 9)
    del a, b
    x = torch.randn(stream_elements(device), device=device)
    y = torch.empty_like(x)
    mem_bw = 2 * x.nbytes / _time(lambda: torch.add(x, 1.0, out=y), device, 9)
    del x, y
    return {"flops_per_s": flops, "mem_bw_Bps": mem_bw, "matmul_dtype": str(dtype),
            "matmul_kind": matmul_kind(dtype, device)}


def measure_host(device: torch.device, compute: dict) -> dict:
    """The host's figures (see the module doc) next to ``compute`` (:func:`measure_compute`'s
    figures on ``device``)."""
    if not _accelerator(device):  # one memory: a copy streams it as an elementwise op does
        return {"host_link_Bps": compute["mem_bw_Bps"], "host_mem_bw_Bps": compute["mem_bw_Bps"]}
    host = torch.empty(_HOST_BYTES // 4, pin_memory=True)
    on_device = torch.empty_like(host, device=device)
    to_device = host.nbytes / _device_time(
        lambda: on_device.copy_(host, non_blocking=True), device)
    to_host = host.nbytes / _device_time(
        lambda: host.copy_(on_device, non_blocking=True), device)
    del on_device
    out = torch.empty_like(host)
    host.fill_(1.0)
    host_bw = 2 * host.nbytes / _median(lambda: torch.add(host, 1.0, out=out), 9)
    return {"host_link_Bps": 2 / (1 / to_device + 1 / to_host), "host_mem_bw_Bps": host_bw}


def device_memory(device: torch.device) -> int:
    if _accelerator(device):
        return torch.accelerator.get_memory_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _collective(kind: str, per_rank: int, group, device, transport: str):
    """A zero-argument function issuing one ``kind`` collective of ``per_rank`` fp32 elements
    per rank, and the bytes that kind's ring moves per rank (for the bandwidth fit)."""
    ws = dist.get_world_size(group)
    inp = torch.ones(per_rank * (1 if kind == "all_gather" else ws), device=device)
    out = torch.empty(per_rank * (ws if kind in ("all_gather", "all_to_all") else 1)
                      if kind != "all_reduce" else 0, device=device)
    if kind == "all_gather":
        fn = lambda: _gather(out, inp, group=group)  # noqa: E731
    elif kind == "all_reduce":
        fn = lambda: dist.all_reduce(inp, group=group)  # noqa: E731
    elif kind == "all_to_all" or transport == "gloo":  # gloo's RS as our passes issue it
        buf = torch.empty_like(inp)

        def fn():
            dist.all_to_all_single(buf, inp, group=group)
            if kind == "reduce_scatter":
                torch.sum(buf.view(ws, -1), 0, out=out)
    else:
        fn = lambda: _scatter(out, inp, group=group)  # noqa: E731
    factor = RING_FACTOR[kind](ws)
    moved = factor * inp.nbytes * (ws if kind == "all_gather" else 1)
    return fn, moved


def measure_collectives(group, device, transport: str) -> dict:
    ws = dist.get_world_size(group)
    out = {}
    for kind in KINDS:
        small, _ = _collective(kind, 1, group, device, transport)
        large, moved = _collective(kind, collective_elements(kind, ws, device), group, device,
                                   transport)
        t_small, t_large = _time(small, device, 11), _time(large, device, 5)
        del large  # its buffers: the next kind's are as large
        out[kind] = {"alpha_s": t_small, "bandwidth_Bps": moved / max(t_large - t_small, 1e-9),
                     "large_s": t_large}
    return out


def measure_overlap(group, device, transport: str, dtype=None) -> dict:
    """The simulator charges each collective ``collective_overhead_s + (1 - comm_overlap) *
    transfer`` on the compute stream. Measure both the way they arise: compute alone, then the
    same compute (matmuls in ``dtype``) with collectives in flight beside it."""
    n = 4096 if _accelerator(device) else 512
    a = torch.randn(n, n, device=device, dtype=compute_dtype(dtype))
    ws = dist.get_world_size(group)
    per_rank = collective_elements("all_gather", ws, device)
    large, _ = _collective("all_gather", per_rank, group, device, transport)
    t_comm = _time(large, device, 5)
    t_mm = _time(lambda: torch.mm(a, a), device, 5)
    # compute ≈ 2 transfers; the count sets how many collectives run below: agree on it
    chunks = torch.tensor([max(4, min(400, int(2 * t_comm / max(t_mm, 1e-9))))], device=device)
    dist.all_reduce(chunks, op=dist.ReduceOp.MAX, group=group)
    chunks = int(chunks.item())

    def compute():
        for _ in range(chunks):
            torch.mm(a, a)

    inp = torch.ones(per_rank, device=device)
    out = torch.empty(per_rank * ws, device=device)
    tiny_in, tiny_out = inp[:1], out[:ws]

    def with_transfer():
        work = _gather(out, inp, group=group, async_op=True)
        compute()
        work.wait()

    def with_small_collectives():  # one tiny collective in flight per compute chunk
        for _ in range(chunks):
            work = _gather(tiny_out, tiny_in, group=group, async_op=True)
            torch.mm(a, a)
            work.wait()

    t_compute = _time(compute, device, 5)
    t_both = _time(with_transfer, device, 5)
    t_small = _time(with_small_collectives, device, 5)
    overhead = max(0.0, (t_small - t_compute) / chunks)
    exposed = min(1.0, max(0.0, (t_both - t_compute - overhead) / max(t_comm, 1e-9)))
    return {"comm_overlap": 1.0 - exposed, "collective_overhead_s": overhead,
            "compute_s": t_compute, "compute_with_transfer_s": t_both,
            "compute_with_small_collectives_s": t_small, "transfer_s": t_comm}


# ---------------------------------------------------------------------------------------------
# Agreement and the profile

_MAX = ("alpha_s", "large_s", "collective_overhead_s", "compute_s", "compute_with_transfer_s",
        "compute_with_small_collectives_s", "transfer_s")  # times: the slowest rank's


def _agree(values: dict, group, device) -> dict:
    """Reduce every number over the group: times to the max, rates and memory to the min."""
    flat = sorted(_leaves(values))
    t = torch.tensor([v for _, v in flat], dtype=torch.float64, device=device)
    is_time = torch.tensor([k[-1] in _MAX for k, _ in flat], device=device)
    hi, lo = t.clone(), t.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    agreed = torch.where(is_time, hi, lo).tolist()
    out: dict = json.loads(json.dumps(values))
    for (path, _), v in zip(flat, agreed):
        node = out
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = v
    return out


def _leaves(d: dict, prefix=()):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, prefix + (k,))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            yield prefix + (k,), float(v)


def _profile(measured: dict, transport: str) -> Hardware:
    """The cost model's numbers from the measurements: the whole group's figures for groups
    that span hosts (or for every group, on one host), the within-host figures for groups
    inside a host. Latency and bandwidth: the FSDP pair, all-gather and reduce-scatter,
    averaged."""
    comm = measured.get("collectives")
    if comm:
        pair = [comm["all_gather"], comm["reduce_scatter"]]
        alpha = statistics.fmean(p["alpha_s"] for p in pair)
        bandwidth = 2 / sum(1 / p["bandwidth_Bps"] for p in pair)
    else:  # one rank: no collective ever runs; any positive numbers do
        alpha, bandwidth = 1e-5, 1e11
    intra = {}
    if "collectives_intra_node" in measured:
        pair = [measured["collectives_intra_node"][k] for k in ("all_gather", "reduce_scatter")]
        intra = {"gpus_per_node": int(measured["ranks_per_host"]),
                 "intra_node_alpha_s": statistics.fmean(p["alpha_s"] for p in pair),
                 "intra_node_bandwidth_Bps": 2 / sum(1 / p["bandwidth_Bps"] for p in pair)}
    overlap = measured.get("overlap", {"comm_overlap": 1.0, "collective_overhead_s": 0.0})
    host = measured.get("host", {})  # absent from caches written before it was measured
    return Hardware(CALIBRATED, flops_per_s=measured["compute"]["flops_per_s"],
                    alpha_s=alpha, bandwidth_Bps=bandwidth,
                    mem_bw_Bps=measured["compute"]["mem_bw_Bps"],
                    memory_bytes=int(measured["memory_bytes"]),
                    comm_overlap=overlap["comm_overlap"],
                    collective_overhead_s=overlap["collective_overhead_s"],
                    transport=transport,
                    host_link_Bps=host.get("host_link_Bps", 0.0),
                    host_mem_bw_Bps=host.get("host_mem_bw_Bps", 0.0), **intra)


def calibrate(group=None, device: torch.device | str | None = None, dtype=None,
              reuse: dict | None = None) -> dict:
    """Measure (see module doc; matmuls in compute dtype ``dtype``, :func:`compute_dtype`) and
    agree over ``group``; every rank returns the same dict
    ``{"hardware": Hardware fields, "measured": raw figures, "key": cache key}``. Without an
    initialised process group: this process's compute only. Ranks on several hosts, several
    per host (consecutive, as torchrun numbers them): the collectives are measured twice, on
    the whole group (the link between hosts bounds it) and within each host (the intra-node
    link that tensor-parallel groups use). ``reuse``: the measured figures of another compute
    dtype's calibration of the same machine and group, the same on every rank: its
    collectives and their overlap with compute are taken as they are (the dtype the matmuls
    run in does not change them), only the compute is measured."""
    distributed = dist.is_available() and dist.is_initialized()
    device = torch.device(device) if device is not None else _default_device(group)
    transport = str(dist.get_backend(group)) if distributed else \
        dist.get_default_backend_for_device(device)
    measured = {"compute": measure_compute(device, dtype), "memory_bytes": device_memory(device)}
    measured["host"] = measure_host(device, measured["compute"])
    hosts = _hosts(group)
    if distributed and dist.get_world_size(group) > 1:
        if reuse is not None:
            measured.update({k: v for k, v in reuse.items() if k not in measured})
        else:
            measured["collectives"] = measure_collectives(group, device, transport)
            measured["overlap"] = measure_overlap(group, device, transport, dtype)
            per_host = _ranks_per_host(hosts)
            if per_host and group in (None, dist.group.WORLD):
                intra, _ = dist.new_subgroups(group_size=per_host)
                measured["collectives_intra_node"] = measure_collectives(intra, device,
                                                                         transport)
                measured["ranks_per_host"] = per_host
        measured = _agree(measured, group, device)
    hw = _profile(measured, transport)
    return {"hardware": dataclasses.asdict(hw), "measured": measured,
            "key": cache_key(group, device, hosts, dtype)}


def _hosts(group=None) -> list[str]:
    """Every rank's host name, by rank (one all-gather, issued by every rank)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [socket.gethostname()]
    # Fixed-size byte tensors, not all_gather_object: that one needs numpy, which a machine
    # with only torch lacks.
    device = "cpu" if dist.get_backend(group) == "gloo" else torch.accelerator.current_accelerator()
    name = torch.zeros(256, dtype=torch.uint8)
    raw = socket.gethostname().encode()[:256]
    name[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    out = torch.empty(dist.get_world_size(group) * 256, dtype=torch.uint8, device=device)
    _gather(out, name.to(device), group=group)
    return [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace")
            for row in out.cpu().view(-1, 256)]


def _ranks_per_host(hosts: list[str]) -> int:
    """n when the ranks fill several hosts n consecutive ranks at a time (n > 1), else 0."""
    n = hosts.count(hosts[0])
    if len(set(hosts)) < 2 or n < 2 or len(hosts) % n:
        return 0
    blocks = [hosts[i:i + n] for i in range(0, len(hosts), n)]
    if all(len(set(b)) == 1 for b in blocks) and len({b[0] for b in blocks}) == len(blocks):
        return n
    return 0


def _default_device(group) -> torch.device:
    """The current accelerator when the group's backend is that accelerator's (nccl on CUDA),
    else the CPU (gloo)."""
    if dist.is_available() and dist.is_initialized() and torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        if dist.get_default_backend_for_device(acc) in str(dist.get_backend(group)):
            return torch.device(acc.type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def cache_key(group=None, device: torch.device | None = None,
              hosts: list[str] | None = None, dtype=None, kind: str | None = None) -> str:
    """Names what the numbers hold for: the hosts (by rank), the device, the transport, the
    ranks, what a matmul in ``dtype`` runs as (:func:`matmul_kind`; or ``kind``, one of
    MATMUL_KINDS)."""
    device = device or _default_device(group)
    kind = kind or matmul_kind(dtype, device)
    distributed = dist.is_available() and dist.is_initialized()
    ws = dist.get_world_size(group) if distributed else 1
    hosts = hosts if hosts is not None else _hosts(group)
    dev = _device_module(device).get_device_name(device) if _accelerator(device) else "cpu"
    transport = str(dist.get_backend(group)) if distributed else "none"
    raw = json.dumps([hosts, dev, transport, ws, torch.__version__, _METHOD, kind])
    digest = hashlib.sha256(raw.encode()).hexdigest()[:12]
    return f"{dev.replace(' ', '_')}-{transport}-ws{ws}-{kind}-{digest}"


def cache_path(key: str) -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(Path.home(), ".cache", "simplesharded")
    return Path(root) / f"calibration-{key}.json"


def calibrated_hardware(group=None, force: bool = False, dtype=None) -> Hardware:
    """The calibrated Hardware for compute dtype ``dtype`` (:func:`compute_dtype`), the same
    on every rank: from the cache when every rank holds the same entry, else measured now by
    all ranks together and cached."""
    return Hardware(**calibrated(group, force, dtype)["hardware"])


def calibrated(group=None, force: bool = False, dtype=None) -> dict:
    if dist.is_available() and dist.is_initialized() and str(dist.get_backend(group)) == "fake":
        raise ValueError("hardware='calibrated' needs a real process group (this one is fake: "
                         "nothing to measure); pass a profile name or a calibration .json file")
    hosts = _hosts(group)
    key = cache_key(group, hosts=hosts, dtype=dtype)
    path = cache_path(key)
    cached = None if force else _read(path)
    if _everyone_has(cached, group):
        return cached
    # Another compute dtype's entry of this machine and group: its collectives are reused
    # when every rank holds the same one (one more all-gather, issued by every rank).
    sibling = None if force else _sibling(group, hosts, dtype)
    reuse = sibling["measured"] if not force and _everyone_has(sibling, group) else None
    result = calibrate(group, dtype=dtype, reuse=reuse)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=True))
    os.replace(tmp, path)  # ranks sharing a host write the same numbers; last one wins
    return result


def _read(path: Path) -> dict | None:
    """A cache entry, or None where there is none that loads."""
    if not path.exists():
        return None
    try:
        cached = json.loads(path.read_text())
        Hardware(**cached["hardware"])
        return cached
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _sibling(group, hosts: list[str], dtype) -> dict | None:
    """The cache entry of another matmul kind (MATMUL_KINDS' order) for the same hosts,
    device, transport and ranks, or None."""
    device = _default_device(group)
    own = matmul_kind(dtype, device)
    for kind in MATMUL_KINDS:
        entry = None if kind == own else _read(cache_path(cache_key(group, device, hosts,
                                                                    kind=kind)))
        if entry is not None:
            return entry
    return None


def _everyone_has(cached: dict | None, group) -> bool:
    """True on every rank or on none: all ranks hold one identical cache entry. Always one
    all-gather (every rank issues it, cache or not), so the ranks never diverge here."""
    digest = -1 if cached is None else int.from_bytes(
        hashlib.sha256(json.dumps(cached["hardware"], sort_keys=True).encode()).digest()[:7],
        "big")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return digest >= 0
    device = _default_device(group)
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    every = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
    _gather(every, mine, group=group)
    return digest >= 0 and bool((every == digest).all())


# ---------------------------------------------------------------------------------------------
# CLI
