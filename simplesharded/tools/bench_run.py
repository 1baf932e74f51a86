"""Running one variant of ``python -m simplesharded.tools.bench`` and timing it: its ranks
started in their own process group (``run_variant``), each training warmup and timed steps on
the same synthetic batch, and what a rank measures (``RunResult``): step times, collectives per
step from the process groups' sequence numbers, CPU time per thread, page faults, peak tensor
memory, rank 0's first losses, or the error that stopped it."""
from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import resource
import tempfile
import time
from dataclasses import asdict, dataclass, field
from unittest import mock

import torch
import torch.distributed as dist

from simplesharded.mesh import spawn_local
from simplesharded.shims.host_malloc import TUNABLES
from simplesharded.tools.bench_variants import BenchArgs, loss_parallel_on, prepare, world_of

# Rank 0's losses of the first PARITY_STEPS steps are recorded for the parity check
# (bench_table.py): step 1 checks model, init and batch; step 2 also the gradient path (dp
# reduction, optimizer). The floors train on one dp rank's batch, so they take part in step 1
# only.
PARITY_STEPS = 2


@dataclass
class RunResult:
    variant: str
    step_s: list[float] = field(default_factory=list)
    first_step_s: float = 0.0
    collectives_per_step: int = 0
    peak_mem_mb: float = 0.0  # tensors alive at once in a step (see _step_peak_bytes)
    # ... less what the rank holds between steps (shards, optimizer state): what the step
    # itself allocates, gathered parameters, activations and gradients (CP divides the
    # activations)
    step_mem_mb: float = 0.0
    # Bytes one step copies in the ops that only move data (cat, clone, copy_, split copies,
    # casts: COPY_OPS), all threads, from the profiled step (CPU only, 0 elsewhere); of it,
    # the casts (_to_copy), which a zero-copy layout still pays under mixed precision, and
    # what threads other than the compute thread copy (gloo's all-gather copies each rank's
    # chunk out of its own flat buffer on its worker thread).
    copied_mb: float = 0.0
    cast_mb: float = 0.0
    copied_other_mb: float = 0.0
    # Bytes of the inputs of the collectives gloo ran in one step (a gather's shard, a
    # reduction's or an all-to-all's whole input): what this rank puts on the wire before
    # the algorithm's own factor, read from the profiled step (CPU only, 0 elsewhere).
    # Quantized collectives show here as fewer bytes.
    wire_mb: float = 0.0
    main_cpu_s: float = 0.0  # CPU time per timed step: the main (compute) thread
    other_cpu_s: float = 0.0  # ... every other thread (gloo's workers, autograd, ...)
    page_faults: float = 0.0  # minor page faults per timed step, all threads (fresh pages)
    losses: list[float] = field(default_factory=list)  # rank 0's, first PARITY_STEPS steps
    error: str = ""


def _collectives_issued(meshes) -> int:
    """Collectives issued so far on every process group a variant can use (the world group and
    each dim of ``meshes``), from the groups' own sequence numbers: each collective, coalesced
    or not, advances its group's by one. No profiler is involved, so counting adds no thread
    callbacks and no imports to the timed process."""
    groups = {id(g): g for g in [dist.group.WORLD]
              + [m.get_group(d) for m in meshes for d in range(m.ndim)]}
    return sum(g._get_sequence_number_for_group() for g in groups.values())


def _profile_step(step, variant: str, rank: int, profile_dir: str) -> None:
    """One step under torch.profiler: a chrome trace and the top ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    os.makedirs(profile_dir, exist_ok=True)
    stem = os.path.join(profile_dir, f"{variant}_rank{rank}")
    prof.export_chrome_trace(stem + ".json")
    with open(stem + ".txt", "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def _resident_bytes(model, opt) -> int:
    """Bytes of the tensors a rank holds between steps: its parameter shards (local parts of
    DTensors), buffers and optimizer state, each storage once."""
    from torch.distributed.tensor import DTensor
    tensors = [*model.parameters(), *model.buffers(),
               *(v for state in opt.state.values() for v in state.values()
                 if isinstance(v, torch.Tensor))]
    storages = {}
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


# The ops whose only work is moving bytes, as the profiler names them.
COPY_OPS = frozenset({"aten::cat", "aten::stack", "aten::clone", "aten::copy_",
                      "aten::split_with_sizes_copy", "aten::narrow_copy", "aten::_to_copy"})
_ELEMENT_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8,
                  "int": 4, "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1}


def _input_bytes(e) -> int | None:
    """Bytes of a profiled op's tensor inputs by their recorded shapes and dtypes; None where
    the profiler records no size (a tensor list: ``cat``'s and ``stack``'s inputs)."""
    dtypes = getattr(e, "input_dtypes", None) or []  # not recorded before torch 2.13
    if len(dtypes) != len(e.input_shapes) or "TensorList" in dtypes:
        return None
    return sum(_ELEMENT_BYTES[d] * math.prod(shape)
               for shape, d in zip(e.input_shapes, dtypes) if d in _ELEMENT_BYTES)


def copied_bytes(events) -> tuple[int, int, int]:
    """(copied, cast, other): bytes written by the outermost COPY_OPS of a profile recorded
    with ``profile_memory`` and ``record_shapes`` (an op's own inner copies are not counted
    again): what an op allocates for its output, or for ``copy_`` into an existing tensor its
    source's bytes; ``cast``: of it, ``_to_copy``'s; ``other``: of it, what threads other
    than the compute thread (the one that ran the most ops) copied.

    An op's allocations are capped by what it can write where its inputs' sizes are recorded
    (their bytes, twice that for a cast, which may widen): a collective's worker thread runs
    under the caller's profiler state, so its buffer (gloo's flat all-gather output) can be
    charged to whichever op the compute thread has open, a 16-byte cast say."""
    events = list(events)
    threads = collections.Counter(e.thread for e in events)
    compute = threads.most_common(1)[0][0] if threads else None
    copied = cast = other = 0
    for e in events:
        if e.name not in COPY_OPS:
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name not in COPY_OPS:
            parent = parent.cpu_parent
        if parent is not None:
            continue
        if e.name == "aten::copy_":
            shape = e.input_shapes[1] if len(e.input_shapes) > 1 else []
            dtypes = getattr(e, "input_dtypes", None) or []
            dtype = dtypes[1] if len(dtypes) > 1 else "float"
            n = _ELEMENT_BYTES.get(dtype, 4) * math.prod(shape)
        else:
            n = max(0, e.cpu_memory_usage)
            bound = _input_bytes(e)
            if bound is not None:
                n = min(n, bound * (2 if e.name == "aten::_to_copy" else 1))
        copied += n
        cast += n if e.name == "aten::_to_copy" else 0
        other += n if e.thread != compute else 0
    return copied, cast, other


def _step_peak_bytes(step, model, opt, device: str) -> tuple[int, int, int, int, int, int]:
    """(peak, held, copied, cast, other, wire): peak bytes of live tensors on this rank during one step
    (gradients zeroed before it, parameter shards and optimizer state included; allocator
    caches and compile-time memory not). On an accelerator its allocator's peak. On CPU,
    which keeps no such count: what the rank holds between steps plus the highest running
    total of bytes allocated and not yet freed during the step (the higher of two profiled
    steps), from torch.profiler's memory events (every allocation and free of a tensor made
    while it records); held: the bytes
    alive before the step; copied, cast and other: :func:`copied_bytes` of the same step or of
    one more (see below; CPU only, 0 on an accelerator); wire: :func:`wire_bytes` of the
    second step (CPU only)."""
    opt.zero_grad(set_to_none=True)
    if device != "cpu":
        held = torch.accelerator.memory_allocated()
        torch.accelerator.reset_peak_memory_stats()
        step()
        _sync(device)
        return torch.accelerator.max_memory_allocated(), held, 0, 0, 0, 0
    resident = _resident_bytes(model, opt)
    profs = [_profiled(step), _profiled(step)]
    # A charge of a collective's buffer to an op whose input sizes the profiler does not
    # record (cat, stack: copied_bytes caps the others) depends on timing, the step's own
    # copies do not: the copies of whichever of two steps copied less. When the comm threads
    # allocate and free relative to the compute thread depends on timing too, so the peak is
    # the higher of the two steps'.
    copied, cast, other = min((copied_bytes(p.events()) for p in profs), key=lambda c: c[0])
    traces = [_trace_events(p) for p in profs]
    peak = max(_allocated_peak(t) for t in traces)
    return resident + peak, resident, copied, cast, other, wire_bytes(traces[-1])


def _trace_events(prof) -> list[dict]:
    """A profile's chrome-trace events (the memory events and gloo's own records are there)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


# The element types gloo's records name (C++ type names) → bytes per element.
_GLOO_ITEMSIZE = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2,
                  "signed char": 1, "unsigned char": 1, "bool": 1, "short int": 2, "int": 4,
                  "long int": 8, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1}


def wire_bytes(events: list[dict]) -> int:
    """Bytes of the inputs of the collectives gloo ran (its ``gloo:<collective>`` records, each
    with its input's type and dims) among chrome-trace ``events``; a ValueError naming an
    element type this table does not know."""
    total = 0
    for e in events:
        if not e.get("name", "").startswith("gloo:"):
            continue
        args = e.get("args", {})
        for kind, dims in zip(args.get("Input type", ()), args.get("Input Dims", ())):
            if kind not in _GLOO_ITEMSIZE:
                raise ValueError(f"{e['name']}: element type {kind!r} not in _GLOO_ITEMSIZE")
            total += _GLOO_ITEMSIZE[kind] * math.prod(dims)
    return total


def _allocated_peak(events: list[dict]) -> int:
    """The highest running total of bytes allocated and not yet freed during a profiled step
    (0 without memory events), from its chrome-trace ``events``."""
    events = [e["args"] for e in events if e.get("name") == "[memory]"]
    if not events:
        return 0
    # "Total Allocated": the allocator's running total, kept while memory is profiled; a free
    # of a tensor made before the step is not in it (nor was its allocation)
    start = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(0, max(e["Total Allocated"] for e in events) - start)


def _profiled(step):
    """A CPU profile of one ``step``, with memory and input shapes (copied_bytes reads them)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                 record_shapes=True) as prof:
        step()
    return prof


def _thread_cpu_s() -> tuple[float, float]:
    """CPU seconds so far of this process's main thread and of all its other threads
    (Linux /proc; (0, 0) elsewhere). On 2 cores, comm threads' CPU is time compute loses."""
    main = other = 0.0
    try:
        tick = os.sysconf("SC_CLK_TCK")
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            cpu = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
            if int(tid) == os.getpid():
                main += cpu
            else:
                other += cpu
    except OSError:
        return 0.0, 0.0
    return main, other


def _minor_faults() -> int:
    """Minor page faults of this process so far. On CPU a buffer the allocator takes fresh
    from the OS (malloc's mmap for large blocks) is zeroed page by page on first touch: a
    step cost that a caching allocator (every GPU's) does not pay."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _sync(device: str) -> None:
    """Wait for the accelerator's queued work, so a step's time includes it."""
    if device != "cpu":
        torch.accelerator.synchronize()


def _worker(rank: int, variant: str, args: BenchArgs, out_dir: str) -> None:
    from simplesharded.mesh import backend_for, build_mesh, exit_rank
    os.environ.update(OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    world = world_of(variant, args)
    kwargs = {}
    if args.device != "cpu":  # one device per rank, bound to the group (no device guessing)
        index = rank % torch.accelerator.device_count()
        torch.accelerator.set_device_index(index)
        kwargs["device_id"] = torch.device(args.device, index)
    dist.init_process_group(backend_for(args.device), rank=rank, world_size=world, **kwargs)
    result = RunResult(variant)
    try:
        mesh = build_mesh(1, world // (args.cp * args.tp), args.device, args.tp, cp=args.cp)
        from simplesharded.models import logits_of
        from simplesharded.trainer import local_loss
        from torch.distributed.tensor.parallel import loss_parallel

        def loss_of(model, x, y):
            logits = logits_of(model(x))  # a tensor, or transformers' output object
            return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())

        model, opt, compiled_step = prepare(variant, args, mesh, loss_of)
        # cp and tp are the innermost mesh dims: the cp x tp ranks of one dp rank read that dp
        # rank's batch
        g = torch.Generator().manual_seed(args.seed + rank // (args.cp * args.tp))
        tokens = torch.randint(0, 256, (args.global_batch // args.dp, args.seq_len + 1),
                               generator=g).to(args.device)
        x, y = tokens[:, :-1], tokens[:, 1:]
        if args.cp > 1:  # each cp rank keeps its head-tail chunks of every sequence
            from simplesharded.models.context_parallel import shard_sequence
            cp_rank = mesh["cp"].get_local_rank()
            x, y = shard_sequence(x, cp_rank, args.cp), shard_sequence(y, cp_rank, args.cp)
        # as the trainer: vocabulary-sharded logits, forward and backward of the loss parallel
        loss_context = loss_parallel if loss_parallel_on(args) else contextlib.nullcontext

        def step():
            if compiled_step is not None:  # forward to optimizer update: one graph
                loss = compiled_step(x, y)
            else:
                opt.zero_grad(set_to_none=True)
                with loss_context():
                    loss = loss_of(model, x, y)
                    loss.backward()
                opt.step()
            if len(result.losses) < PARITY_STEPS:
                result.losses.append(local_loss(loss.detach()).item())

        for i in range(args.warmup):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            _sync(args.device)
            if i == 0:
                result.first_step_s = time.perf_counter() - t0
        cpu0, faults0 = _thread_cpu_s(), _minor_faults()
        for _ in range(args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            _sync(args.device)
            dist.barrier()
            result.step_s.append(time.perf_counter() - t0)
        cpu1 = _thread_cpu_s()
        result.main_cpu_s, result.other_cpu_s = ((b - a) / args.steps for a, b in zip(cpu0, cpu1))
        result.page_faults = (_minor_faults() - faults0) / args.steps
        from simplesharded.mesh import dp_mesh
        meshes = (mesh, dp_mesh(mesh))
        issued = _collectives_issued(meshes)
        step()
        result.collectives_per_step = _collectives_issued(meshes) - issued
        if args.profile_dir:
            dist.barrier()
            _profile_step(step, variant, rank, args.profile_dir)
        peak, held, copied, cast, other, wire = _step_peak_bytes(step, model, opt, args.device)
        result.wire_mb = wire / 2**20
        result.peak_mem_mb, result.step_mem_mb = peak / 2**20, (peak - held) / 2**20
        result.copied_mb, result.cast_mb = copied / 2**20, cast / 2**20
        result.copied_other_mb = other / 2**20
        dist.barrier()  # no collective is in flight on any rank
    except Exception as e:  # reported in the table, the other variants still run
        # the first non-empty line: some of torch's messages start with a newline
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        result.error = f"{type(e).__name__}: {first}"[:200]
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(asdict(result), f)
        dist.destroy_process_group()
    exit_rank(0)  # gloo's threads outlive destroy_process_group: see exit_rank


@contextlib.contextmanager
def _rank_environment(args: BenchArgs):
    """The environment ranks start in: every variant's the same. CPU ranks get the launcher's
    caching malloc settings (host_malloc.py) unless --host-malloc system asks for glibc's
    defaults; accelerator ranks the launcher's expandable segments (launch_env.py), unless
    the user set the allocator's configuration."""
    from simplesharded.shims.host_malloc import caching_env
    from simplesharded.shims.launch_env import allocator_env
    if args.device != "cpu":
        with mock.patch.dict(os.environ, allocator_env(args.device)):
            yield
        return
    with mock.patch.dict(os.environ):  # restores the environment as it was
        if args.host_malloc == "caching":
            os.environ.update(caching_env())
        else:
            os.environ.pop(TUNABLES, None)  # glibc's defaults
        yield


def run_variant(variant: str, args: BenchArgs) -> RunResult:
    world = world_of(variant, args)
    with tempfile.TemporaryDirectory() as out_dir:
        with _rank_environment(args):
            # CPU ranks fork from the fork server (torch imported once, not per variant) when
            # it started with their malloc tunables, which glibc reads only at a start;
            # accelerator ranks start fresh, in a process that never touched the device
            spawn_local(_worker, world, (variant, args, out_dir), fork=args.device == "cpu",
                        read_at_start=(TUNABLES,))
        ranks = [RunResult(**json.load(open(os.path.join(out_dir, f"rank{r}.json"))))
                 for r in range(world)]
    res = ranks[0]
    res.peak_mem_mb = max(r.peak_mem_mb for r in ranks)
    res.step_mem_mb = max(r.step_mem_mb for r in ranks)
    res.copied_mb = max(r.copied_mb for r in ranks)
    res.cast_mb = max(r.cast_mb for r in ranks)
    res.copied_other_mb = max(r.copied_other_mb for r in ranks)
    res.error = next((r.error for r in ranks if r.error), "")
    return res
