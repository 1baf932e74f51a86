"""``python -m simplesharded.tools.bench``: our backends vs FSDP2, DDP and a compute floor.

Every variant trains the same model on the same synthetic batch in its own spawned process
group; variants alternate within each repetition so drift hits all of them alike. Reported:
median step time, ratios, collectives per step counted at runtime from the process groups'
sequence numbers (the same way for eager and compiled variants), compile seconds (first step minus a steady step, first
repetition), peak tensor memory per rank (and the planner's prediction of it) and rank 0's losses of the first steps, which must agree across
variants (see PARITY_STEPS): they compute the same thing or the comparison is void.

``--device cuda`` (or this machine's other accelerator type) runs rank r on device r mod the
devices present, with the process-group backend mesh.backend_for picks (NCCL for cuda); the
default ``cpu`` uses gloo.

``--tp N`` runs every variant on a dp × tp mesh (tp innermost, as the trainer's): torch TP with
the model's tensor-parallel styles on ``mesh["tp"]`` first, then the variant's data parallelism
over the dp dims.
FSDP2 becomes the standard 2-D recipe (``fully_shard`` per block + root on ``mesh["dp_shard"]``)
and the floors keep their meaning with a tp group in place of a single rank.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from unittest import mock

import torch
import torch.distributed as dist

from simplesharded.mesh import spawn_local

BASELINES = ("fsdp2_eager", "fsdp2_compiled", "ddp", "compute_floor", "compute_floor_inductor",
             "compute_floor_concurrent", "compute_floor_concurrent_compiled")
# compute_floor: one process alone on the machine (the definition); with --tp, one tp
# group alone (tp ranks on one dp rank's batch): compute plus TP's own collectives, no dp.
# compute_floor_concurrent: every rank runs the floor's step at the same time, with no
# data-parallel communication at all: what the ranks' compute (and TP) costs while they share
# cores, caches and memory bandwidth, i.e. the floor any data-parallel variant on this machine
# can reach. With --tp on 2 cores this is the floor that matters: 2×tp ranks share the cores.
# compute_floor_concurrent_compiled: the same under torch's plain aot_eager. The floor of our
# compiled variants under TP: eager TP pays DTensor's per-op dispatch (sharding propagation in
# Python), which compiling traces away. Without TP the eager floor is the lower one (aot_eager
# runs a decomposed graph: ~20% more main-thread CPU on debug llama3), so it is not a default.
# compute_floor_inductor: compute_floor compiled by inductor (fullgraph). Inductor fuses
# kernels that eager runs one by one, so an inductor variant can beat the eager floor without
# communicating any faster: ss_inductor_* and fsdp2_compiled (inductor per block) are also
# measured against this floor (ratio_applies). In the default set without TP.
NO_TP_FORM = ("ddp",)  # DDP does not take TP DTensor parameters
# With --tp the default set is the 2-D recipe's peers only: 4 ranks on 2 cores compiling a
# TP graph take ~2 min per compiled variant (debug llama3), so the unbucketed ss_aot_eager,
# compiled FSDP2 and the inductor backends are left for --variants to name.
TP_DEFAULT = ("compute_floor", "compute_floor_concurrent", "compute_floor_concurrent_compiled",
              "fsdp2_eager", "ss_aot_eager_blockbucketing", "ss_aot_eager_autobucketing")
# Rank 0's losses of the first PARITY_STEPS steps must agree within PARITY_RTOL: step 1 checks
# model, init and batch; step 2 also the gradient path (dp reduction, optimizer). The floors
# train on one dp rank's batch, so they take part in step 1 only.
PARITY_STEPS, PARITY_RTOL = 2, 1e-4
# The × columns (variant → column label); a column appears when its variant ran.
RATIO_REFS = {"fsdp2_eager": "fsdp2_eager", "compute_floor": "compute_floor",
              "compute_floor_inductor": "floor inductor",
              "compute_floor_concurrent": "floor concurrent",
              "compute_floor_concurrent_compiled": "floor concurrent compiled"}
# The inductor floor's ratio only means something for variants that inductor compiles; the
# others show "–" in that column (an inductor floor under an eager or aot_eager variant would
# mix kernel fusion into the comparison of communication).
INDUCTOR_VARIANTS = ("fsdp2_compiled", "compute_floor_inductor")  # and ss_inductor*


def ss_backend(variant: str):
    """The backend (BackendName) of an ``ss_<backend>`` variant; None for a baseline."""
    from simplesharded.backends import BACKENDS, BackendName

    name = variant.removeprefix("ss_")
    return BackendName.parse(name) if variant != name and name in BACKENDS else None


def ratio_applies(ref: str, variant: str) -> bool:
    """Whether ``variant``'s row gets a ratio against reference variant ``ref``."""
    if ref != "compute_floor_inductor":
        return True
    backend = ss_backend(variant)
    return variant in INDUCTOR_VARIANTS or (backend is not None
                                            and backend.compiler == "inductor")


def all_variants() -> list[str]:
    from simplesharded.backends import BACKENDS
    return list(BASELINES) + [f"ss_{name}" for name in BACKENDS]


def default_variants(tp: int) -> list[str]:
    """Without TP every variant but the aot_eager floor (see BASELINES: it is not the floor;
    the inductor floor is in); with TP the 2-D recipe's peers (TP_DEFAULT)."""
    if tp > 1:
        return list(TP_DEFAULT)
    return [v for v in all_variants() if v != "compute_floor_concurrent_compiled"]


@dataclass
class BenchArgs:
    model: str = "llama3"
    flavor: str = "small"
    n_layers: int | None = None  # override the flavor's depth (tiny runs, tests)
    world_size: int = 2  # ranks in all (dp × tp)
    tp: int = 1
    sequence_parallel: bool = True  # with tp > 1, as the trainer's enable_sequence_parallel
    loss_parallel: bool = True  # with tp > 1, as the trainer's enable_loss_parallel
    global_batch: int = 8
    seq_len: int = 256
    warmup: int = 3
    steps: int = 20
    seed: int = 0
    optimizer_impl: str = "foreach"  # AdamW kernels for every variant (as the trainer's default)
    profile_dir: str = ""  # when set: torch.profiler trace + op table per rank of one more step
    device: str = "cpu"  # or an accelerator type ("cuda"): one device per rank
    host_malloc: str = "caching"  # CPU ranks' malloc: "caching" (host_malloc.py) or "system"

    @property
    def dp(self) -> int:
        return self.world_size // self.tp


@dataclass
class RunResult:
    variant: str
    step_s: list[float] = field(default_factory=list)
    first_step_s: float = 0.0
    collectives_per_step: int = 0
    peak_mem_mb: float = 0.0  # tensors alive at once in a step (see _step_peak_bytes)
    main_cpu_s: float = 0.0  # CPU time per timed step: the main (compute) thread
    other_cpu_s: float = 0.0  # ... every other thread (gloo's workers, autograd, ...)
    page_faults: float = 0.0  # minor page faults per timed step, all threads (fresh pages)
    losses: list[float] = field(default_factory=list)  # rank 0's, first PARITY_STEPS steps
    error: str = ""


def _build(args: BenchArgs, device: str):
    from simplesharded.models import build_model
    torch.manual_seed(args.seed)
    depth = {"n_layers": args.n_layers} if args.n_layers else {}
    return build_model(args.model, args.flavor, device=device, **depth)


def _world(variant: str, args: BenchArgs) -> int:
    """Ranks a variant runs on: the floors are one dp rank's worth (1 rank, or its tp group)."""
    return args.tp if variant in ("compute_floor", "compute_floor_inductor") else args.world_size


def _loss_parallel(args: BenchArgs) -> bool:
    return args.tp > 1 and args.loss_parallel


def _prepare(variant: str, args: BenchArgs, mesh):
    """The model (TP-parallelized when the mesh has a tp dim, then wrapped/compiled for the
    variant) and its optimizer."""
    from simplesharded.mesh import dp_mesh
    from simplesharded.trainer import OPTIMIZER_IMPL, apply_tensor_parallel
    model = _build(args, "cpu").to(args.device)  # initialised on CPU: the same weights anywhere
    apply_tensor_parallel(model, mesh, args.sequence_parallel, _loss_parallel(args))
    if variant.startswith("compute_floor"):
        # torch's own backends: no pass of ours in a floor
        if variant.endswith("_compiled"):
            model = torch.compile(model, backend="aot_eager", fullgraph=True)
        elif variant.endswith("_inductor"):
            model = torch.compile(model, backend="inductor", fullgraph=True)
    elif variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
    elif variant.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard
        from simplesharded.blocks import find_blocks
        for _, block in find_blocks(model):
            if variant == "fsdp2_compiled":
                block.compile()  # per-block compile, as torchtitan does for FSDP2
            fully_shard(block, mesh=dp_mesh(mesh))
        fully_shard(model, mesh=dp_mesh(mesh))
    else:
        from simplesharded import data_parallel, make_backend
        backend = ss_backend(variant)
        data_parallel(model, mesh, "fully_shard")
        if backend.compiler != "eager":
            model = torch.compile(model, backend=make_backend(str(backend)), fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **OPTIMIZER_IMPL[args.optimizer_impl])
    return model, opt


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


def _step_peak_bytes(step, model, opt, device: str) -> int:
    """Peak bytes of live tensors on this rank during one step (gradients zeroed before it,
    parameter shards and optimizer state included; allocator caches and compile-time memory
    not). On an accelerator its allocator's peak. On CPU, which keeps no such count: what the
    rank holds between steps plus the highest running total of bytes allocated and not yet
    freed during the step, from torch.profiler's memory events (every allocation and free of
    a tensor made while it records)."""
    opt.zero_grad(set_to_none=True)
    if device != "cpu":
        torch.accelerator.reset_peak_memory_stats()
        step()
        _sync(device)
        return torch.accelerator.max_memory_allocated()
    from torch.profiler import ProfilerActivity, profile
    resident = _resident_bytes(model, opt)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e["args"] for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    if not events:
        return resident
    # "Total Allocated": the allocator's running total, kept while memory is profiled; a free
    # of a tensor made before the step is not in it (nor was its allocation)
    start = events[0]["Total Allocated"] - events[0]["Bytes"]
    return resident + max(0, max(e["Total Allocated"] for e in events) - start)


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
    world = _world(variant, args)
    if args.device != "cpu":
        torch.accelerator.set_device_index(rank % torch.accelerator.device_count())
    dist.init_process_group(backend_for(args.device), rank=rank, world_size=world)
    result = RunResult(variant)
    try:
        mesh = build_mesh(1, world // args.tp, args.device, args.tp)
        model, opt = _prepare(variant, args, mesh)
        # tp is the innermost mesh dim: the tp ranks of one dp rank read that dp rank's batch
        g = torch.Generator().manual_seed(args.seed + rank // args.tp)
        tokens = torch.randint(0, 256, (args.global_batch // args.dp, args.seq_len + 1),
                               generator=g).to(args.device)
        x, y = tokens[:, :-1], tokens[:, 1:]
        from simplesharded.models import logits_of
        from simplesharded.trainer import local_loss
        from torch.distributed.tensor.parallel import loss_parallel
        # as the trainer: vocabulary-sharded logits, forward and backward of the loss parallel
        loss_context = loss_parallel if _loss_parallel(args) else contextlib.nullcontext

        def step():
            opt.zero_grad(set_to_none=True)
            with loss_context():
                logits = logits_of(model(x))  # a tensor, or transformers' output object
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                         y.flatten())
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
        result.peak_mem_mb = _step_peak_bytes(step, model, opt, args.device) / 2**20
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
    defaults."""
    from simplesharded.shims.host_malloc import TUNABLES, caching_env
    if args.device != "cpu":
        yield
        return
    with mock.patch.dict(os.environ):  # restores the environment as it was
        if args.host_malloc == "caching":
            os.environ.update(caching_env())
        else:
            os.environ.pop(TUNABLES, None)  # glibc's defaults
        yield


def run_variant(variant: str, args: BenchArgs) -> RunResult:
    world = _world(variant, args)
    with tempfile.TemporaryDirectory() as out_dir:
        with _rank_environment(args):
            spawn_local(_worker, world, (variant, args, out_dir))
        ranks = [RunResult(**json.load(open(os.path.join(out_dir, f"rank{r}.json"))))
                 for r in range(world)]
    res = ranks[0]
    res.peak_mem_mb = max(r.peak_mem_mb for r in ranks)
    res.error = next((r.error for r in ranks if r.error), "")
    return res


def summarize(results: dict[str, list[RunResult]], args: BenchArgs) -> list[dict]:
    rows = []
    for variant, runs in results.items():
        ok = [r for r in runs if not r.error and r.step_s]
        if not ok:
            rows.append({"variant": variant, "error": runs[0].error if runs else "not run"})
            continue
        med = statistics.median(statistics.median(r.step_s) for r in ok)
        rows.append({"variant": variant, "step_ms": 1e3 * med,
                     "compile_s": max(0.0, ok[0].first_step_s - med),
                     "collectives_per_step": ok[0].collectives_per_step,
                     "peak_mem_mb": max(r.peak_mem_mb for r in ok), "reps": len(ok),
                     "main_cpu_ms": 1e3 * statistics.median(r.main_cpu_s for r in ok),
                     "other_cpu_ms": 1e3 * statistics.median(r.other_cpu_s for r in ok),
                     "page_faults": statistics.median(r.page_faults for r in ok),
                     "losses": [r.losses for r in ok]})
    base = {r["variant"]: r.get("step_ms") for r in rows}
    for r in rows:
        if "step_ms" in r:
            for ref in RATIO_REFS:
                if base.get(ref) and ratio_applies(ref, r["variant"]):
                    r[f"x_{ref}"] = r["step_ms"] / base[ref]
    return rows


def format_table(rows: list[dict], args: BenchArgs) -> str:
    refs = [ref for ref in RATIO_REFS if any(f"x_{ref}" in r for r in rows)]
    cols = (["variant", "step ms"] + [f"× {RATIO_REFS[ref]}" for ref in refs]
            + ["collectives/step", "compile s", "peak tensor MB/rank", "planned MB/rank",
               "CPU ms/step main + other threads", "page faults/step"]
            + [f"loss step {k + 1}" for k in range(PARITY_STEPS)])
    lines = ["| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error']} |" + " |" * (len(cols) - 2))
            continue
        ratios = "".join(f"{r[f'x_{ref}']:.2f} | " if f"x_{ref}" in r else "– | "
                         for ref in refs)
        first = (r.get("losses") or [[]])[0]  # the first repetition's
        losses = " | ".join(f"{first[k]:.6f}" if k < len(first) else "–"
                            for k in range(PARITY_STEPS))
        planned = f"{r['planned_mb']:.0f}" if "planned_mb" in r else "–"
        lines.append(f"| {r['variant']} | {r['step_ms']:.0f} | {ratios}"
                     f"{r['collectives_per_step']} | "
                     f"{r['compile_s']:.1f} | {r['peak_mem_mb']:.0f} | {planned} | "
                     f"{r.get('main_cpu_ms', 0):.0f} + {r.get('other_cpu_ms', 0):.0f} | "
                     f"{r.get('page_faults', 0):.0f} | {losses} |")
    return "\n".join(lines)


def parity(rows: list[dict], rtol: float = PARITY_RTOL) -> tuple[bool, str]:
    """Whether every run's loss at each of the first PARITY_STEPS steps agrees with the first
    run's within ``rtol`` (see PARITY_STEPS for who takes part in which step): else the
    variants did not compute the same thing. Returns (agree, one line saying so)."""
    bad, said = [], []
    for k in range(PARITY_STEPS):
        losses = [(r["variant"], run[k] if k < len(run) else float("nan"))
                  for r in rows if k == 0 or not r["variant"].startswith("compute_floor")
                  for run in r.get("losses", ())]
        if not losses:
            continue
        ref_name, ref = losses[0]
        off = [(v, x) for v, x in losses if not abs(x - ref) <= rtol * abs(ref)]  # NaN is off
        bad += [f"step {k + 1}: {v} {x:.6f} vs {ref_name} {ref:.6f}" for v, x in off]
        if not off:
            spread = max(abs(x - ref) for _, x in losses) / abs(ref)
            said.append(f"step {k + 1}{' (no floors)' if k else ''}: {len(losses)} runs agree "
                        f"with {ref_name} ({ref:.6f}) within {spread:.1e}")
    if bad:
        return False, f"PARITY MISMATCH (rtol {rtol}): " + "; ".join(bad)
    return True, (f"parity (rtol {rtol}): " + "; ".join(said) if said
                  else "parity: no losses (no variant ran)")


def targets(rows: list[dict]) -> list[str]:
    """The issue's targets, each as measured: PASS/MISS with the ratio."""
    ms = {r["variant"]: r["step_ms"] for r in rows if "step_ms" in r}
    checks = [("ss_aot_eager_autobucketing", "fsdp2_eager", 0.70),
              ("ss_aot_eager_autobucketing", "compute_floor", 1.15),
              ("ss_aot_eager_autobucketing", "ss_aot_eager_upstreambucketing", 0.95),
              ("ss_inductor_autobucketing", "ss_inductor_upstreambucketing", 0.95)]
    out = []
    for a, b, limit in checks:
        if a in ms and b in ms:
            ratio = ms[a] / ms[b]
            out.append(f"{'PASS' if ratio <= limit else 'MISS'} {a} / {b} = {ratio:.2f} "
                       f"(target ≤ {limit})")
    return out


# The variants whose step the planner (simplesharded/tools/forecast.py) models without
# calibration. The autobucketing plan's buckets follow the ranks' calibrated cost model, which
# the bench's parent process does not hold, so it has no prediction here (`python -m
# simplesharded.tools.forecast --hardware <calibration file>` gives one).
FORECAST = ("ss_aot_eager", "ss_aot_eager_blockbucketing")


def forecast_peaks(args: BenchArgs, variants: list[str]) -> dict[str, float]:
    """{variant: per-rank peak MB the planner predicts for it}, for the variants of FORECAST on
    a CPU mesh without tp, when the trainer knows the model (its config describes the step)."""
    names = {v: str(ss_backend(v)) for v in variants if v in FORECAST}
    if not names or args.tp > 1 or args.device != "cpu":
        return {}
    from simplesharded.trainer.config import load_config
    from simplesharded.tools.forecast import predicted_peak_bytes
    from simplesharded.trainer import check_static
    try:
        cfg = load_config(None, ["--model.name", args.model, "--model.flavor", args.flavor,
                                 "--training.global_batch_size", str(args.global_batch),
                                 "--training.seq_len", str(args.seq_len),
                                 "--training.dataset_path", "",
                                 "--activation_checkpoint.mode", "none"])
        cfg = check_static(cfg, args.world_size)
    except ValueError:  # a model the trainer does not build (hf_llama)
        return {}
    peaks = predicted_peak_bytes(cfg, args.world_size, sorted(set(names.values())), "local",
                                 args.n_layers)
    return {v: peaks[name] / 2**20 for v, name in names.items()}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3")
    ap.add_argument("--flavor", default="small")
    ap.add_argument("--n-layers", type=_positive_int, default=None,
                    help="override the flavor's depth")
    ap.add_argument("--world-size", type=_positive_int, default=None,
                    help="ranks in all, dp × tp (default on cpu: 2 × --tp, i.e. dp 2; on an "
                         "accelerator: one rank per device)")
    ap.add_argument("--tp", type=_positive_int, default=1,
                    help="tensor-parallel degree: every variant runs on a dp × tp mesh, torch "
                         "TP with the model's tensor-parallel styles first (default: 1, no TP)")
    ap.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True,
                    help="with --tp > 1, shard activations between blocks on the sequence dim "
                         "(the trainer's default)")
    ap.add_argument("--loss-parallel", action=argparse.BooleanOptionalAction, default=True,
                    help="with --tp > 1, vocabulary-sharded logits and torch's loss_parallel "
                         "cross-entropy (the trainer's default)")
    ap.add_argument("--global-batch", type=_positive_int, default=8)
    ap.add_argument("--seq-len", type=_positive_int, default=256)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=_positive_int, default=20)
    ap.add_argument("--reps", type=_positive_int, default=3)
    ap.add_argument("--variants", nargs="+", default=None,
                    help="default: all of " + " ".join(BASELINES) + " ss_<every backend>; "
                         "with --tp > 1: " + " ".join(TP_DEFAULT))
    from simplesharded.trainer import OPTIMIZER_IMPL
    ap.add_argument("--optimizer-impl", default="foreach", choices=list(OPTIMIZER_IMPL),
                    help="AdamW kernels, the same for every variant (default: foreach, as the "
                         "trainer's optimizer.implementation)")
    ap.add_argument("--json", default=None, help="write rows and raw timings here")
    ap.add_argument("--device", default="cpu",
                    help="cpu: gloo ranks (default); cuda (this machine's accelerator type): "
                         "one device per rank, NCCL for cuda")
    ap.add_argument("--host-malloc", default="caching", choices=["caching", "system"],
                    help="CPU ranks' malloc: caching (default, as run_train.sh sets it: freed "
                         "memory is reused, not returned to the OS and page-faulted again next "
                         "step; simplesharded/shims/host_malloc.py) or system (glibc's defaults)")
    ap.add_argument("--predict-memory", action=argparse.BooleanOptionalAction, default=True,
                    help="also print the planner's predicted peak memory per rank for "
                         + " ".join(FORECAST) + " (a trace of the model, seconds to a minute)")
    ap.add_argument("--profile", default="", metavar="DIR",
                    help="write a torch.profiler chrome trace and op table per variant and rank")
    ns = ap.parse_args(argv)
    tp = ns.tp
    accelerator = torch.accelerator.current_accelerator()
    if ns.device != "cpu" and getattr(accelerator, "type", None) != ns.device:
        ap.error(f"--device {ns.device}: this machine's accelerator is "
                 f"{getattr(accelerator, 'type', 'none')}; use cpu or that")
    # One device per rank: two NCCL ranks cannot share a GPU.
    devices = torch.accelerator.device_count() if ns.device != "cpu" else None
    world = ns.world_size or (devices if devices else 2 * tp)
    if devices and world > devices:
        ap.error(f"--world-size {world}: this machine has {devices} {ns.device} device(s), "
                 f"one per rank")
    variants = ns.variants or default_variants(tp)
    unknown = sorted(set(variants) - set(all_variants()))
    if unknown:
        ap.error(f"--variants {unknown} not one of {all_variants()}")
    no_tp = sorted(set(variants) & set(NO_TP_FORM)) if tp > 1 else []
    if no_tp:
        ap.error(f"--variants {no_tp} have no tensor-parallel form; with --tp {tp} leave "
                 f"them out")
    if world % tp:
        ap.error(f"--tp {tp} does not divide --world-size {world}")
    if ns.global_batch % (world // tp):
        ap.error(f"--global-batch {ns.global_batch} is not divisible by the data-parallel "
                 f"degree {world // tp} (--world-size {world} / --tp {tp})")
    from simplesharded.models import MODELS, build_model, get_model_spec
    if ns.model not in MODELS:
        ap.error(f"--model {ns.model!r} is not one of {sorted(MODELS)}")
    if ns.flavor not in MODELS[ns.model][1]:
        ap.error(f"--flavor {ns.flavor!r} is not one of {sorted(MODELS[ns.model][1])} "
                 f"(--model {ns.model})")
    try:
        _, model_args = get_model_spec(ns.model, ns.flavor)
        if tp > 1:
            model_args.check_tp(tp)
        # on meta, i.e. no memory and no init: the depth override and a missing optional
        # dependency (hf_llama: transformers) fail here, once, not in every variant's ranks
        build_model(ns.model, ns.flavor, device="meta",
                    **({"n_layers": ns.n_layers} if ns.n_layers else {}))
    except (ValueError, ImportError) as e:
        ap.error(f"{e} (--model {ns.model} --flavor {ns.flavor} --tp {tp})")
    if tp > 1 and ns.sequence_parallel and ns.seq_len % tp:
        ap.error(f"--tp {tp} does not divide --seq-len {ns.seq_len} (sequence parallelism "
                 f"splits the sequence; or --no-sequence-parallel)")
    args = BenchArgs(model=ns.model, flavor=ns.flavor, n_layers=ns.n_layers, world_size=world,
                     tp=tp, sequence_parallel=ns.sequence_parallel,
                     loss_parallel=ns.loss_parallel, global_batch=ns.global_batch,
                     seq_len=ns.seq_len, warmup=ns.warmup, steps=ns.steps,
                     optimizer_impl=ns.optimizer_impl, profile_dir=ns.profile,
                     device=ns.device, host_malloc=ns.host_malloc)
    results: dict[str, list[RunResult]] = {v: [] for v in variants}
    for rep in range(ns.reps):
        for v in variants:
            t0 = time.time()
            r = run_variant(v, args)
            results[v].append(r)
            status = r.error or f"median {1e3 * statistics.median(r.step_s):.0f} ms"
            print(f"[rep {rep + 1}/{ns.reps}] {v}: {status} ({time.time() - t0:.0f}s)",
                  file=sys.stderr, flush=True)
    rows = summarize(results, args)
    planned = forecast_peaks(args, variants) if ns.predict_memory else {}
    for r in rows:
        if r["variant"] in planned:
            r["planned_mb"] = planned[r["variant"]]
    depth = f" ({args.n_layers} layers)" if args.n_layers else ""
    mesh = f" = dp {args.dp} × tp {tp}" if tp > 1 else ""
    from simplesharded.mesh import backend_for
    print(f"\n{args.model}/{args.flavor}{depth}, {args.world_size} ranks{mesh} "
          f"({backend_for(args.device)}, {args.device}), "
          f"global batch {args.global_batch} × seq {args.seq_len}, fp32, AdamW "
          f"{args.optimizer_impl}, {args.steps} timed steps × {ns.reps} reps (median)"
          + (f", {args.host_malloc} malloc" if args.device == "cpu" else ""))
    if tp > 1:
        sp = ((", sequence parallel" if args.sequence_parallel else "")
              + (", loss parallel" if args.loss_parallel else ""))
        print(f"torch TP (parallelize_module, the model's styles{sp}) under every variant; "
              f"fsdp2_eager: fully_shard per block + root on the dp mesh; compute_floor: one tp "
              f"group ({tp} ranks) alone; compute_floor_concurrent: all {args.dp} tp groups at "
              f"once; neither floor communicates over dp")
    print()
    print(format_table(rows, args))
    print()
    agree, line = parity(rows)
    print(line)
    if tp == 1:  # the targets are for 1-D FSDP
        for line in targets(rows):
            print(line)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"args": asdict(args), "rows": rows,
                       "raw": {v: [asdict(r) for r in rs] for v, rs in results.items()}}, f,
                      indent=1)
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
