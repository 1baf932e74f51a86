"""The checks of scripts/gpu_check.sh (its driver: scripts/gpu_check.py), one function each:
``check_<name>(device, opts) -> [(status, row name, figure or why skipped)]``, run by
:func:`child` in a process of its own. ``device`` is the accelerator's type ("cuda") or "cpu";
``opts`` what the driver chose for the device (backends, storages, fake8's cases, the compiler
the trainer checks compile with). On CPU a check whose answer is an accelerator's still runs
its code at CPU sizes, then says SKIP with why and what it saw.

- parity: one process on the device's own backend (NCCL on a GPU, gloo on CPU):
  ``data_parallel`` + each backend trains STEPS SGD steps of a small llama3 with ragged
  buckets (the trainer's default storage) and with one shard per parameter (the library's);
  losses and final shards must match the uncompiled per-parameter run (relative TOL:
  inductor's kernels reassociate fp32 sums). At one rank DTensor issues no collective: this
  checks compile, kernels and the process group's start-up.
- fake8: the trainer (simplesharded.trainer.Trainer: meta-device init, TP, EP, activation
  checkpointing, data_parallel, our backends) on a fake process group of 8 ranks on this one
  device: collectives do nothing, but the bucketed and reordered graphs are lowered by
  inductor and run. Each case checks that the collectives in inductor's output code come in
  the order our passes put them, that the losses are finite, that bf16 attention runs a fused
  kernel, and on an accelerator the peak memory of a step against the planner's prediction
  for the same config: the peak less the cuBLAS workspaces, which are measured (freed, and the
  allocator's count read before and after), not netted from what stays allocated; what stays
  allocated beyond the model's state is reported beside it.
- train: ``python -m simplesharded.trainer`` at one rank, bf16 + full activation checkpointing
  + compile (inductor on an accelerator), deterministic mode, 15 steps with a checkpoint at
  step 10; a second run resumes from that checkpoint to step 15 and must log the first run's
  losses bit for bit; a third, uninterrupted, must too (deterministic mode twice).
- moe: deepseek_v3's MoE layer in bf16: its sorted path runs torch._grouped_mm (where
  models/expert_mm.py says it should) and agrees with the dense bmm path; then the debug
  deepseek_v3 through the trainer at one rank, compiled, whose step runs the grouped matmul.
- cp_attention: ContextParallel.attention (models/context_parallel.py: a rank's queries over
  the gathered keys, an [s, S] boolean mask, GQA) on a fake cp group: the SDPA kernel torch
  runs eagerly and under compile at a long sequence (the math kernel is a FAIL: it
  materialises [s, S] scores per head), then the 128k config's own shape on the fused kernels
  alone.
- bench: llama3 1B through the trainer at one rank, bf16 params, TF32 allowed, inductor:
  tokens/s per device, MFU against the peak of the dtype that runs (bf16's), memory as max
  active / reserved GiB and % of the device. MFU at or above 100 % is a FAIL (a wrong peak or
  FLOP count).
- calibrate: simplesharded.calibration's matmul in bf16, TF32 and fp32 against the published
  peaks (bf16 must beat fp32, none may beat its peak), then ``python -m
  simplesharded.tools.calibrate --dtype bfloat16 --force``.
- init: ``init_sharded`` on device shards: 2 gloo ranks on the device (llama3 fully sharded,
  at tp 2, and deepseek_v3 at ep 2) give the full parameters of 1 rank bit for bit, 1 rank
  those of the plain model given the same call, and ``device="cpu"`` the CPU's values.
- parity_gloo2: the parity check on 2 gloo processes with device tensors (both on device 0),
  real collectives through our passes; SKIP, with the reason, where gloo cannot run the
  functional collectives DTensor issues on that device.
- copy_stream: the parity model with ragged buckets and ``offload="params"``, then
  ``"optimizer"``, against the same without, compiled: the same numbers, and in a profile of a
  step the copies each way (shards or the resident copies' refresh to the device, gradients to
  the host) on streams of their own, under ``params`` part of their time beside kernels.
- float8, offload: the bench's run beside the same with ``--training.float8`` (float8 matmuls
  and gathers; sm_89 or newer) or ``--parallelism.offload params``: tokens/s, and for offload
  the peak device memory, side by side.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the checkout, uninstalled; the test helpers
for _path in (ROOT, os.path.join(ROOT, "tests", "support")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

ROW = "@@row "  # a result line on stdout: ROW + json [status, name, detail]
BACKENDS = ("eager", "aot_eager", "aot_eager_blockbucketing", "aot_eager_autobucketing",
            "inductor", "inductor_blockbucketing", "inductor_autobucketing")
CPU_BACKENDS = ("eager", "aot_eager", "aot_eager_blockbucketing", "aot_eager_autobucketing")
STEPS = 3
MODEL = dict(name="llama3", flavor="debug", n_layers=2)
BATCH_PER_RANK, SEQ = 2, 64
# relative, on every loss and on each final shard's max |diff| / max |ref| (as tests/test_parity)
TOL = {"inductor": 1e-4, "other": 1e-5}
RAGGED = "ragged:"  # a parity row's prefix: the run used ragged buckets
FUSED_ATTENTION = ("_flash_attention", "_cudnn_attention", "_efficient_attention",
                   "_fused_attention_overrideable")
MATH_ATTENTION = "_scaled_dot_product_attention_math"

Row = tuple[str, str, str]


def _first_line(e: BaseException) -> str:
    first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {first}"[:300]


def _lacks(feature_name: str) -> str | None:
    """The one-line refusal of passes/torch_compat.py's table for a feature this torch lacks."""
    from simplesharded.passes import torch_compat

    return torch_compat.refusal(getattr(torch_compat, feature_name))


def _tmp(name: str) -> str:
    """A fresh directory under the run's temp directory (the driver's), else the system's."""
    root = os.environ.get("GPU_CHECK_TMP") or tempfile.gettempdir()
    return tempfile.mkdtemp(prefix=f"{name}_", dir=root)


def _accelerator_memory() -> tuple[float, float]:
    """Max active and max reserved bytes since the last reset, as the trainer reports them."""
    stats = torch.accelerator.memory_stats()
    return (stats.get("active_bytes.all.peak", torch.accelerator.max_memory_allocated()),
            torch.accelerator.max_memory_reserved())


@contextlib.contextmanager
def _one_rank(device: str, host: bool = False):
    """This process as a 1-rank process group on ``device``'s backend (``host``: and gloo
    for host tensors, as the trainer's under offload), as the trainer starts without
    torchrun; torn down after."""
    import torch.distributed as dist

    from simplesharded.mesh import init_distributed

    init_distributed(device, host=host)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ops_run(fn) -> set[str]:
    """The aten ops ``fn()`` dispatched (the profiler's CPU-side op events: every device)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


# ---------------------------------------------------------------------------------- parity
def _tol(backend: str) -> float:
    from simplesharded.backends import BackendName

    backend = backend.removeprefix(RAGGED)
    if backend == "uncompiled":
        return TOL["other"]
    return TOL["inductor" if BackendName.parse(backend).compiler == "inductor" else "other"]


def _train(backend: str, mesh, device: str, rank: int, storage: str = "param",
           offload: str = "none", trace: str | None = None) -> dict:
    """STEPS steps of ``backend`` ("uncompiled": no torch.compile) with ``data_parallel``'s
    ``storage`` and ``offload``; losses and the local shards of ``state_dict()`` (per
    parameter whatever the storage). ``trace``: a path where the profiler's trace of one more
    step goes (chrome trace JSON)."""
    import simplesharded as ss
    from simplesharded.models import build_model, logits_of

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(MODEL["name"], MODEL["flavor"], device="cpu",
                        n_layers=MODEL["n_layers"]).to(device)  # same init on every device
    ss.data_parallel(model, mesh, "fully_shard", storage=storage, offload=offload)
    run = model if backend == "uncompiled" else torch.compile(
        model, backend=ss.make_backend(backend), fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    losses = []

    def step():
        tokens = torch.randint(0, 256, (BATCH_PER_RANK, SEQ + 1), generator=g).to(device)
        logits = logits_of(run(tokens[:, :-1]))
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    t0 = time.perf_counter()
    for _ in range(STEPS):
        losses.append(step())
    if trace:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
        prof.export_chrome_trace(trace)
    shards = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().cpu().clone()
              for n, p in model.state_dict().items()}
    torch._dynamo.reset()
    return dict(losses=losses, shards=shards, seconds=time.perf_counter() - t0)


def _compare(results: dict, rank: int) -> list[Row]:
    """(status, name, detail) per run, against results["uncompiled"]."""
    from dist_utils import max_rel_diff

    ref = results["uncompiled"]
    out = []
    for be, got in results.items():
        if be == "uncompiled":
            continue
        if "error" in got:
            out.append(("FAIL", be, got["error"]))
            continue
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
        shard_diff = max(max_rel_diff(got["shards"][n], p) for n, p in ref["shards"].items())
        ok = loss_diff <= _tol(be) and shard_diff <= _tol(be) and all(
            map(math.isfinite, got["losses"]))
        out.append(("PASS" if ok else "FAIL", be,
                    f"rank {rank}: loss rel diff {loss_diff:.1e}, shard rel diff "
                    f"{shard_diff:.1e} (tol {_tol(be):.0e}), losses "
                    f"{' '.join(f'{x:.5f}' for x in got['losses'])}, {got['seconds']:.1f}s"))
    return out


def _run_backends(mesh, device: str, rank: int, backends, storages=("ragged", "param")) -> dict:
    """The uncompiled per-parameter reference, then per storage the uncompiled run (ragged)
    and each of ``backends``: {row name: _train's result}."""
    results = {"uncompiled": _train("uncompiled", mesh, device, rank)}
    runs = []
    for storage in storages:
        prefix = RAGGED if storage == "ragged" else ""
        extra = ("uncompiled",) if storage == "ragged" else ()
        runs += [(prefix + be, be, storage) for be in (*extra, *backends)]
    for name, be, storage in runs:
        try:
            results[name] = _train(be, mesh, device, rank, storage)
        except Exception as e:  # reported as this backend's failure; the others still run
            results[name] = {"error": _first_line(e)}
    return results


def check_parity(device: str, opts: dict) -> list[Row]:
    """One process, the device's own backend (mesh.init_mesh makes a 1-rank group)."""
    import torch.distributed as dist

    import simplesharded as ss
    from simplesharded.mesh import backend_for

    mesh = ss.init_mesh(dp_shard=-1, device=device)
    try:
        results = _run_backends(mesh, device, 0, opts["backends"], opts["storages"])
    finally:
        dist.destroy_process_group()
    tag = f"parity[1 rank, {backend_for(device)}] "
    return [(s, tag + be, d) for s, be, d in _compare(results, 0)]


def _gloo2_probe(rank: int, world: int, device: str) -> dict:
    """The ops DTensor issues, as it issues them, on gloo with ``device`` tensors: gloo has no
    device path for some ops (its coalesced all-gather, which the functional one becomes, has
    none for CUDA), and some releases crash the process instead of raising."""
    if device != "cpu":
        torch.accelerator.set_device_index(0)  # one device: both ranks share it
    x = torch.ones(4, device=device)
    try:
        out = torch.ops._c10d_functional.all_gather_into_tensor(x, world, "0")
        torch.ops._c10d_functional.wait_tensor(out)
        x = torch.ones(4 * world, device=device)
        out = torch.ops._c10d_functional.reduce_scatter_tensor(x, "sum", world, "0")
        torch.ops._c10d_functional.wait_tensor(out)
    except Exception as e:  # noqa: BLE001 - the reason is the skip message
        return {"unsupported": f"gloo on {device} cannot run DTensor's collectives: "
                               f"{_first_line(e)}"}
    return {}


def _gloo2_job(rank: int, world: int, device: str, backends, storages) -> dict:
    from simplesharded.mesh import build_mesh

    if device != "cpu":
        torch.accelerator.set_device_index(0)
    mesh = build_mesh(dp_replicate=1, dp_shard=world, device=device)
    results = _run_backends(mesh, device, rank, backends, storages)
    return {"rows": _compare(results, rank)}


def check_parity_gloo2(device: str, opts: dict) -> list[Row]:
    from dist_utils import spawn

    tag = f"parity[2 ranks, gloo on {device}] "
    try:
        probe = spawn(2, _gloo2_probe, device, timeout_s=120)
    except Exception as e:  # a rank died: gloo cannot run them on this device either
        probe = [{"unsupported": f"gloo on {device} crashed running DTensor's collectives: "
                                 f"{_first_line(e)}"}]
    skip = next((r["unsupported"] for r in probe if "unsupported" in r), None)
    if skip:
        return [("SKIP", tag.strip(), skip)]
    # on CPU one bucketing backend: the 1-rank parity check ran every backend there
    backends = opts["backends"] if device != "cpu" else ["aot_eager_blockbucketing"]
    ranks = spawn(2, _gloo2_job, device, tuple(backends), tuple(opts["storages"]),
                  timeout_s=600)
    return [(s, tag + be, d) for r in ranks for s, be, d in r["rows"]]


# ----------------------------------------------------------------------------------- fake8
# (name, config file, overrides). Every case is the trainer's own recipe on 8 fake ranks; the
# cost model is a fixed profile (calibrating on a fake group measures nothing).
FAKE_WORLD = 8
FAKE_CASES = (
    ("fp32_block", "configs/llama3_debug.toml",
     ["--compile.backend", "inductor_blockbucketing"]),
    ("fp32_auto", "configs/llama3_debug.toml",
     ["--compile.backend", "inductor_autobucketing"]),
    ("bf16_ac_auto", "configs/llama3_debug.toml",
     ["--compile.backend", "inductor_autobucketing", "--training.mixed_precision_param",
      "bfloat16", "--activation_checkpoint.mode", "full"]),
    ("bf16_tp2_block", "configs/llama3_debug.toml",
     ["--compile.backend", "inductor_blockbucketing", "--training.mixed_precision_param",
      "bfloat16", "--parallelism.tensor_parallel_degree", "2"]),
    ("ep2_moe_block", "configs/deepseek_v3_debug.toml",
     ["--compile.backend", "aot_eager_blockbucketing", "--parallelism.expert_parallel_degree",
      "2"]),
)
CPU_CASES = ("fp32_block",)
# The planner's memory model is of the aot_eager backends (inductor fuses and frees on its own
# schedule): a case under inductor_X is checked through aot_eager_X's measured peak, run beside
# it (_memory_row).
MEMORY_TOL = 0.35  # |measured / predicted - 1|


def _fake_cfg(config: str, overrides: list[str], device: str):
    from simplesharded.trainer import check_static
    from simplesharded.trainer.config import load_config

    cfg = load_config(None, ["--job.config_file", os.path.join(ROOT, config), "--compile.enable",
                             "--compile.hardware", "h100-ib400", "--training.steps", "2",
                             "--training.val_every", "0", "--metrics.save_jsonl", "false",
                             # the fake group's values are made up: a NaN is not a finding
                             "--training.on_nonfinite", "skip",
                             "--job.dump_folder", _tmp("fake8"), *overrides,
                             # on CPU the path is what is checked: 2 blocks compile in half the
                             # time of the debug model's 6
                             *(["--model.n_layers", "2"] if device == "cpu" else [])])
    return check_static(cfg, FAKE_WORLD)


def _predicted_peak(cfg) -> int:
    """The planner's per-rank peak bytes for ``cfg``'s config and backend. Called before this
    process touches the device or a process group: the planner traces in forked children,
    each with a fake group of its own."""
    from simplesharded.tools.forecast import forecast_backend, predicted_peak_bytes

    backend = forecast_backend(cfg.compile.backend)
    return predicted_peak_bytes(cfg, FAKE_WORLD, [backend], cfg.compile.hardware)[backend]


def cublas_workspace_bytes(device: str) -> int | None:
    """The bytes of cuBLAS's workspaces the caching allocator holds now, measured: torch frees
    them (torch._C._cuda_clearCublasWorkspaces, as torch's own leak checks do) and the
    allocated count falls by exactly that much. The next matmul allocates them again. None on
    a device without them."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if device != "cuda" or clear is None:
        return None
    torch.accelerator.synchronize()
    before = torch.accelerator.memory_allocated()
    clear()
    return before - torch.accelerator.memory_allocated()


def _state_bytes(trainer) -> int:
    """What the model holds between steps: parameters, gradients, buffers, optimizer state."""
    def nbytes(t):
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.numel() * local.element_size()

    total = sum(nbytes(t) for p in trainer.model.parameters()
                for t in (p, p.grad) if t is not None)
    total += sum(nbytes(b) for b in trainer.model.buffers())
    total += sum(nbytes(v) for s in trainer.optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor))
    return total


def _held_tensors(trainer, device: str, top: int = 8) -> str:
    """The largest ``device`` tensors alive after a step that are not the model's state (by
    storage): shape, dtype, class and their holders' classes, for the check's output."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    state = {local(t).untyped_storage().data_ptr()
             for p in trainer.model.parameters() for t in (p, p.grad) if t is not None}
    state |= {b.untyped_storage().data_ptr() for b in trainer.model.buffers()}
    state |= {local(v).untyped_storage().data_ptr() for st in trainer.optimizer.state.values()
              for v in st.values() if isinstance(v, torch.Tensor)}
    found: dict[int, tuple] = {}
    with warnings.catch_warnings():  # isinstance on torch's deprecated module attributes
        warnings.simplefilter("ignore")
        tensors = []
        for o in gc.get_objects():
            try:
                if isinstance(o, torch.Tensor):
                    tensors.append(o)
            except ReferenceError:  # a dead weak proxy
                continue
    for obj in tensors:
        try:
            t = local(obj)
            if t.device.type != device or t.is_meta:
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr not in state and ptr not in found:
                found[ptr] = (t.untyped_storage().nbytes(), tuple(t.shape), t.dtype, obj)
        except Exception:  # a tensor without storage (fake, functional)
            continue
    lines = []
    for nbytes, shape, dtype, obj in sorted(found.values(), key=lambda v: -v[0])[:top]:
        holders = sorted({type(r).__name__ for r in gc.get_referrers(obj)} - {"list", "frame"})
        lines.append(f"  {nbytes / 2**20:.2f} MiB {shape} {dtype} {type(obj).__name__} "
                     f"held by {holders}")
    total = sum(v[0] for v in found.values())
    return (f"live {device} tensors beyond the state after the step: {total / 2**20:.1f} MiB "
            f"in {len(found)} storages\n" + "\n".join(lines))


def _fake_case(name: str, cfg, device: str, predicted: int | None) -> list[Row]:
    from inductor_code import code_order, format_order, graph_order

    from simplesharded.backends import BackendName
    from simplesharded.passes.collectives import count_collectives
    from simplesharded.passes.pipeline import LAST_STAGE

    inductor = BackendName.parse(cfg.compile.backend).compiler == "inductor"
    bf16 = cfg.training.mixed_precision_param == "bfloat16"
    tag = f"fake8[{name}, {cfg.compile.backend}]"
    orders: dict[str, list] = {}
    counts: dict[str, dict] = {}

    def observe(kind, stage, gm):
        # read now: what our last pass hands over (inductor edits the graph afterwards)
        if stage == LAST_STAGE:
            orders[kind], counts[kind] = graph_order(gm), count_collectives(gm)

    t0 = time.perf_counter()
    mem, record, codes = _fake_steps(cfg, device, observe)
    compile_s = time.perf_counter() - t0
    rows = [("PASS", tag + " runs",
             f"2 steps, loss {record['loss']:.4f}, grad norm {record['grad_norm']:.3g}, "
             f"compile + first step {compile_s:.0f}s, collectives {counts}")]
    if inductor:
        for kind, code in zip(("fw", "bw"), codes):
            ours, got = orders.get(kind, []), code_order(code)
            rows.append(("PASS" if got == ours else "FAIL", f"{tag} {kind} collective order",
                         f"{sum(t[0] == 'start' for t in ours)} collectives among "
                         f"{sum(t[0] == 'mm' for t in ours)} matmuls as our passes ordered "
                         "them" if got == ours else
                         f"ours {format_order(ours)} | inductor {format_order(got)}"))
        if bf16 and device == "cpu":
            rows.append(("SKIP", f"{tag} fused attention", "the fused SDPA kernels are an "
                         "accelerator's (CPU runs its own flash kernel)"))
        elif bf16:
            fused = sorted({k for k in FUSED_ATTENTION for c in codes if k in c})
            rows.append(("PASS" if fused else "FAIL", f"{tag} fused attention",
                         f"kernels {fused}" if fused else "no fused SDPA kernel in the code"))
    if device == "cpu":
        rows.append(("SKIP", f"{tag} memory", "the planner's figure is checked against an "
                     "accelerator allocator's peak; a CPU process has none"))
    elif predicted is None:
        rows.append(("SKIP", f"{tag} memory", "no planner figure for this case"))
    elif not mem["stepped"]:
        rows.append(("SKIP", f"{tag} memory", "no optimizer step ran (non-finite values from "
                     "this torch's fake group): the peak would lack the optimizer state"))
    else:
        rows.append(_memory_row(tag, cfg, device, predicted, mem, inductor))
    return rows


def _fake_steps(cfg, device: str, observe=None) -> tuple[dict, dict, list]:
    """Two trainer steps of ``cfg`` on the fake group (the first compiles): the second step's
    memory ({"peak", "workspace", "held", "stepped"}; None figures on CPU), its record, and
    the generated code (inductor's)."""
    from torch._inductor.utils import run_and_get_code

    from simplesharded.tools.cluster_trace import fake_world
    from simplesharded.trainer import Trainer

    torch._dynamo.reset()
    mem = dict.fromkeys(("peak", "workspace", "held"))
    with fake_world(FAKE_WORLD):
        trainer = Trainer(cfg, device, observer=observe)
        record, codes = run_and_get_code(trainer.train_step)  # compiles, then runs
        if device != "cpu":
            torch.accelerator.synchronize()
            torch.accelerator.reset_peak_memory_stats()
        record = trainer.train_step()
        if device != "cpu":
            torch.accelerator.synchronize()
            mem["peak"] = torch.accelerator.max_memory_allocated()
            mem["workspace"] = cublas_workspace_bytes(device)  # freed: not in what is held
            mem["held"] = torch.accelerator.memory_allocated() - _state_bytes(trainer)
            if mem["held"] > 2**20:  # what holds it, in the check's output
                print(f"{cfg.compile.backend}: {_held_tensors(trainer, device)}", flush=True)
    torch._dynamo.reset()
    # torch's fake group copies inputs into collective outputs since 2.13; before, outputs
    # are left unset and a step's values may not be finite (then the optimizer skips it)
    mem["stepped"] = bool(trainer.optimizer.state)
    return mem, record, codes


def _memory_row(tag: str, cfg, device: str, predicted: int, mem: dict, inductor: bool) -> Row:
    """The planner's peak against the measured one, less the measured cuBLAS workspaces. The
    planner models the aot_eager backends (inductor frees saved tensors at their last use and
    fuses casts into their consumers): an inductor case is compared through its aot_eager twin,
    run here too, within ±MEMORY_TOL, and its own peak must stay under the planner's figure
    (the memory cap is set from it)."""
    def net(m):
        return m["peak"] - (m["workspace"] or 0)

    workspace = ("not measurable here (no torch._C._cuda_clearCublasWorkspaces): counted in "
                 "the peak" if mem["workspace"] is None
                 else f"{mem['workspace'] / 2**20:.0f} MiB, measured")
    held = (f"after the step {mem['held'] / 2**20:.0f} MiB allocated beyond the model's state "
            f"(parameters, gradients, buffers, optimizer state) and the workspaces")
    if not inductor:
        ratio = net(mem) / predicted
        return ("PASS" if abs(ratio - 1) <= MEMORY_TOL else "FAIL", f"{tag} memory",
                f"max_memory_allocated {mem['peak'] / 2**20:.0f} MiB per step, less the cuBLAS "
                f"workspaces ({workspace}), vs planner {predicted / 2**20:.0f} MiB: "
                f"x{ratio:.2f} (tol ±{MEMORY_TOL:.0%}); {held}")
    from simplesharded.tools.forecast import forecast_backend

    twin_backend = forecast_backend(cfg.compile.backend)  # the one the planner's figure is of
    twin_cfg = copy.deepcopy(cfg)
    twin_cfg.compile.backend = twin_backend
    twin, _, _ = _fake_steps(twin_cfg, device)
    ratio, own = net(twin) / predicted, net(mem) / predicted
    ok = twin["stepped"] and abs(ratio - 1) <= MEMORY_TOL and own <= 1 + MEMORY_TOL
    return ("PASS" if ok else "FAIL", f"{tag} memory",
            f"planner {predicted / 2**20:.0f} MiB (the aot_eager model) vs {twin_backend}'s "
            f"max_memory_allocated less the cuBLAS workspaces ({workspace}): "
            f"{net(twin) / 2**20:.0f} MiB, x{ratio:.2f} (tol ±{MEMORY_TOL:.0%}); "
            f"{cfg.compile.backend}'s {net(mem) / 2**20:.0f} MiB, x{own:.2f} (at most "
            f"x{1 + MEMORY_TOL:.2f}); {held}")


def check_fake8(device: str, opts: dict) -> list[Row]:
    cases = [c for c in FAKE_CASES if c[0] in opts["cases"]]
    rows, cfgs = [], {}
    for name, config, overrides in cases:
        if "ep" in name and _lacks("EXPERT_PARALLEL"):
            rows.append(("SKIP", f"fake8[{name}]", _lacks("EXPERT_PARALLEL")))
            continue
        try:
            cfgs[name] = _fake_cfg(config, overrides, device)
        except ValueError as e:  # the trainer's preflight refuses it on this torch
            rows.append(("SKIP" if "torch" in str(e) else "FAIL", f"fake8[{name}]",
                         f"the trainer's preflight: {e}"))
    predicted = {}
    if device != "cpu":
        for name, cfg in cfgs.items():
            try:
                predicted[name] = _predicted_peak(cfg)
            except Exception as e:  # the memory row says so; the case still runs
                rows.append(("FAIL", f"fake8[{name}] planner", _first_line(e)))
    for name, cfg in cfgs.items():
        try:
            rows += _fake_case(name, cfg, device, predicted.get(name))
        except RuntimeError as e:
            # A fake group cannot know what the other ranks send: its all-to-all invents the
            # received rows, and a token exchange sized by invented counts can ask a rank for
            # rows it has none of. Not our code's failure; the real exchange is tested on gloo.
            status = "SKIP" if "alltoall_base: inputBuffer is empty" in str(e) else "FAIL"
            rows.append((status, f"fake8[{name}]", _first_line(e)))
        except Exception as e:  # this case's failure; the other cases still run
            rows.append(("FAIL", f"fake8[{name}]", _first_line(e)))
    return rows


# ----------------------------------------------------------------------------------- train
TRAIN_STEPS, RESUME_AT = 15, 10


def _trainer_args(compiler: str) -> list[str]:
    backend = f"{compiler}_autobucketing"
    return ["--job.config_file", os.path.join(ROOT, "configs", "llama3_debug.toml"),
            "--training.steps", str(TRAIN_STEPS), "--training.val_every", "0",
            "--training.mixed_precision_param", "bfloat16",
            "--activation_checkpoint.mode", "full", "--compile.enable", "true",
            "--compile.backend", backend, "--training.deterministic", "true",
            "--metrics.progress_bar", "false", "--metrics.log_freq", "1"]


def _left(opts: dict, share: float = 1.0) -> float:
    """Seconds to give a sub-run: ``share`` of what is left before the check's deadline (the
    driver kills the check there), at least 10."""
    return max(10.0, share * (opts.get("deadline", time.time() + 600) - time.time() - 5))


def _trainer_run(args: list[str], dump: str, env: dict, timeout_s: float) -> dict:
    """``python -m simplesharded.trainer`` at one rank: {"rc", "losses" by step, "records",
    "out", "seconds"}."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "simplesharded.trainer", *args, "--job.dump_folder", dump]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env,
                           timeout=timeout_s)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        text = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                for x in (e.stdout, e.stderr)]
        rc, out = 124, f"timed out after {timeout_s:.0f}s\n" + "".join(text)
    records = {}
    path = os.path.join(dump, "metrics.jsonl")
    if os.path.exists(path):
        for line in open(path):
            r = json.loads(line)
            if "loss" in r:
                records[r["step"]] = r
    return {"rc": rc, "records": records, "losses": {s: r["loss"] for s, r in records.items()},
            "out": out, "seconds": time.perf_counter() - t0}


def _same(a: dict, b: dict, steps) -> tuple[bool, str]:
    """Whether runs ``a`` and ``b`` logged bit-identical losses at ``steps``; what differs."""
    missing = [s for s in steps if s not in a or s not in b]
    if missing:
        return False, f"no loss logged at steps {missing}"
    diff = [(s, a[s], b[s]) for s in steps if a[s] != b[s]]
    if not diff:
        return True, f"steps {steps[0]}-{steps[-1]} bit for bit ({a[steps[-1]]!r} at step " \
                     f"{steps[-1]})"
    s, x, y = diff[0]
    worst = max(abs(x - y) / max(abs(x), 1e-30) for _, x, y in diff)
    return False, (f"{len(diff)} of {len(steps)} steps differ, first step {s}: {x!r} vs {y!r}; "
                   f"largest rel diff {worst:.1e}")


def _run_failed(run: dict) -> str:
    lines = [ln for ln in run["out"].splitlines() if ln.strip()]
    err = next((ln for ln in reversed(lines) if ln.startswith(("error:", "Traceback"))
                or "Error" in ln), lines[-1] if lines else "no output")
    return f"exit {run['rc']}: {err.strip()[:300]}"


def check_train(device: str, opts: dict) -> list[Row]:
    """Three trainer runs, each a process of its own (as a user starts them), sharing one
    inductor cache so that only the first compiles from scratch."""
    compiler = opts["compiler"]
    tag = f"[llama3 debug, bf16, full AC, {compiler}_autobucketing, deterministic]"
    base = _trainer_args(compiler)
    env = {**os.environ, "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
           "TORCHINDUCTOR_CACHE_DIR": _tmp("inductor_cache")}
    first_dir, resumed_dir, again_dir = _tmp("train"), _tmp("resume"), _tmp("again")
    # torch's distributed checkpoint needs numpy (the trainer's preflight says so)
    numpy = importlib.util.find_spec("numpy") is not None
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", str(RESUME_AT)] * numpy
    first = _trainer_run(base + ckpt, first_dir, env, _left(opts, 0.6))
    steps = list(range(1, TRAIN_STEPS + 1))
    rows = []
    if first["rc"] != 0 or len(first["losses"]) != TRAIN_STEPS:
        return [("FAIL", f"train{tag} runs", _run_failed(first))]
    losses = [first["losses"][s] for s in steps]
    last = first["records"][TRAIN_STEPS]
    mem = (f", memory active {last['mem_max_active_gib']:.2f} GiB, reserved "
           f"{last['mem_max_reserved_gib']:.2f} GiB" if "mem_max_active_gib" in last else "")
    ok = all(map(math.isfinite, losses)) and losses[-1] < losses[0]
    saved = f", checkpoints at steps {RESUME_AT} and {TRAIN_STEPS}" if numpy else ""
    rows.append(("PASS" if ok else "FAIL", f"train{tag} runs",
                 f"{TRAIN_STEPS} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}{saved}{mem}, "
                 f"{first['seconds']:.0f}s"))
    resumed = None if not numpy else _trainer_run(base + ckpt + [
        "--checkpoint.folder", os.path.join(first_dir, "checkpoint"),
        "--checkpoint.load_step", str(RESUME_AT)], resumed_dir, env, _left(opts, 0.5))
    if resumed is None:
        rows.append(("SKIP", f"train{tag} resume", f"torch's distributed checkpoint needs "
                     f"numpy, which {sys.executable} lacks"))
    elif resumed["rc"] != 0:
        rows.append(("FAIL", f"train{tag} resume", _run_failed(resumed)))
    else:
        logged = sorted(resumed["losses"])
        same, detail = _same(first["losses"], resumed["losses"], steps[RESUME_AT:])
        started = logged[0] == RESUME_AT + 1 if logged else False
        rows.append(("PASS" if same and started else "FAIL", f"train{tag} resume",
                     f"from the step-{RESUME_AT} checkpoint, steps {logged[0] if logged else '-'}"
                     f"-{logged[-1] if logged else '-'} logged; the uninterrupted run's losses: "
                     f"{detail}; {resumed['seconds']:.0f}s"))
    again = _trainer_run(base, again_dir, env, _left(opts))
    if again["rc"] != 0:
        rows.append(("FAIL", f"deterministic{tag} twice", _run_failed(again)))
    else:
        same, detail = _same(first["losses"], again["losses"], steps)
        rows.append(("PASS" if same else "FAIL", f"deterministic{tag} twice",
                     f"a second process from scratch: {detail}; {again['seconds']:.0f}s"))
    for run, name in ((first, "first"), (resumed, "resumed"), (again, "second")):
        if run is None:
            continue
        print(f"--- trainer, {name} run (exit {run['rc']})\n" + "\n".join(
            run["out"].splitlines()[-25:]), flush=True)
    return rows


# ------------------------------------------------------------------------------------- moe
def _moe_layer(device: str):
    from simplesharded.models import get_model_spec
    from simplesharded.models.moe import MoE

    _, args = get_model_spec("deepseek_v3", "debug")
    torch.manual_seed(0)
    with torch.device(device):
        moe = MoE(args)
        moe.init_weights(out_std=0.02)
    return moe.to(torch.bfloat16).train(), args


def _moe_step(moe, x, cot):
    moe.zero_grad(set_to_none=True)
    x.grad = None
    y = moe(x)
    y.backward(cot)
    return y.detach().float(), x.grad.detach().float()


def check_moe(device: str, opts: dict) -> list[Row]:
    import dataclasses

    from simplesharded.models.expert_mm import uses_grouped_mm

    rows = []
    moe, args = _moe_layer(device)
    x = torch.randn(2, 128, args.dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    cot = torch.randn_like(x)
    wanted = uses_grouped_mm(x, moe.experts.w1)
    moe.args = dataclasses.replace(args, experts_impl="bmm")
    ref = _moe_step(moe, x, cot)
    moe.args = dataclasses.replace(args, experts_impl="sorted")
    got = {}
    ops = _ops_run(lambda: got.update(out=_moe_step(moe, x, cot)))
    grouped = "aten::_grouped_mm" in ops
    err = [((g - r).norm() / r.norm()).item() for g, r in zip(got["out"], ref)]
    tag = f"moe[deepseek_v3 debug layer, bf16, {device}]"
    if not wanted:
        status = "FAIL" if device != "cpu" else "SKIP"
        why = (f"models/expert_mm.py does not take torch._grouped_mm here (torch "
               f"{torch.__version__} {'has it' if hasattr(torch, '_grouped_mm') else 'lacks it'})")
        rows.append((status, f"{tag} grouped mm", why))
    else:
        ok = grouped and max(err) <= 2e-2
        rows.append(("PASS" if ok else "FAIL", f"{tag} grouped mm",
                     f"torch._grouped_mm {'ran' if grouped else 'did NOT run'} (sorted path, "
                     f"forward + backward); against the dense bmm path: output rel diff "
                     f"{err[0]:.1e}, input gradient {err[1]:.1e} (tol 2e-02)"))
    del moe, x, cot
    rows += _moe_trainer(device, opts["compiler"])
    return rows


def _moe_trainer(device: str, compiler: str) -> list[Row]:
    """configs/deepseek_v3_debug.toml through the trainer at one rank in bf16, compiled: the
    step's code (or the ops it dispatched) holds the grouped matmul."""
    from torch._inductor.utils import run_and_get_code

    from simplesharded.trainer import Trainer, check_static
    from simplesharded.trainer.config import load_config

    backend = f"{compiler}_autobucketing"
    tag = f"moe[deepseek_v3 debug, trainer at 1 rank, bf16, {backend}]"
    cfg = load_config(None, [
        "--job.config_file", os.path.join(ROOT, "configs", "deepseek_v3_debug.toml"),
        "--training.mixed_precision_param", "bfloat16", "--compile.enable", "true",
        "--compile.backend", backend, "--training.steps", "2", "--training.val_every", "0",
        "--metrics.save_jsonl", "false", "--metrics.progress_bar", "false",
        "--job.dump_folder", _tmp("moe")])
    cfg = check_static(cfg, 1)
    torch._dynamo.reset()
    with _one_rank(device):
        trainer = Trainer(cfg, device)
        t0 = time.perf_counter()
        first, codes = run_and_get_code(trainer.train_step)
        compile_s = time.perf_counter() - t0
        second = {}
        ops = _ops_run(lambda: second.update(trainer.train_step()))
    torch._dynamo.reset()
    in_code = any("grouped_mm" in c for c in codes)
    grouped = in_code or "aten::_grouped_mm" in ops
    losses = [first["loss"], second["loss"]]
    ok = grouped and all(map(math.isfinite, losses))
    where = "in inductor's code" if in_code else "dispatched" if grouped else "NOT run"
    return [("PASS" if ok else "FAIL", tag,
             f"torch._grouped_mm {where}; losses {losses[0]:.4f} {losses[1]:.4f}, compile + "
             f"first step {compile_s:.0f}s")]


# ---------------------------------------------------------------------------- cp_attention
CP_CONFIG = "configs/llama3_8b_128k.toml"
CP_PROBE_SEQ = 32768  # a long sequence where the math kernel, were it chosen, still fits


def _attention_kernels(ops) -> list[str]:
    names = [n for n in ops if "scaled_dot_product" in n]
    return sorted(n.removeprefix("aten::") for n in names)


def _cp_attention_run(cp_obj, shape, dtype, device, backward=True, compiled=None):
    """q [B, s, H, D], k and v [B, s, Hkv, D] of one cp rank through its attention
    (forward + backward); the SDPA ops dispatched and, compiled, the generated code."""
    from torch._inductor.utils import run_and_get_code

    b, s, h, hkv, d = shape
    q = torch.randn(b, s, h, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(b, s, hkv, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(b, s, hkv, d, device=device, dtype=dtype, requires_grad=True)

    def step(fn):
        out = fn(q, k, v)
        if backward:
            out.backward(torch.ones_like(out))
        return out

    codes = []
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(cp_obj.attention, backend=compiled, fullgraph=True)
        if compiled == "inductor":
            _, codes = run_and_get_code(lambda: step(fn))
            ops = set()
        else:
            ops = _ops_run(lambda: step(fn))
        torch._dynamo.reset()
    else:
        ops = _ops_run(lambda: step(cp_obj.attention))
    return ops, codes


@contextlib.contextmanager
def _cp_gather_stand_in():
    """On a torch without context parallelism's K/V gather (``all_gather_single_autograd``,
    new in 2.13: passes/torch_compat.py), the older ``all_gather_tensor_autograd`` in its
    place, for this check only: what it checks is the attention kernel after the gather."""
    import torch.distributed._functional_collectives as funcol

    if hasattr(funcol, "all_gather_single_autograd"):
        yield None
        return

    class ContiguousGrad(torch.autograd.Function):  # the older gather's backward needs it
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad.contiguous()

    funcol.all_gather_single_autograd = lambda t, dim, group: ContiguousGrad.apply(
        funcol.all_gather_tensor_autograd(t, dim, group))
    try:
        yield "the K/V gather through all_gather_tensor_autograd on this torch"
    finally:
        del funcol.all_gather_single_autograd


def check_cp_attention(device: str, opts: dict) -> list[Row]:
    with _cp_gather_stand_in() as stand_in:
        rows = _cp_attention_rows(device, opts)
    return [(status, name, f"{detail} ({stand_in})" if stand_in else detail)
            for status, name, detail in rows]


def _cp_attention_rows(device: str, opts: dict) -> list[Row]:
    import torch.distributed as dist
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from simplesharded.models.context_parallel import ContextParallel
    from simplesharded.tools.cluster_trace import fake_world
    from simplesharded.trainer.config import load_config

    cfg = load_config(None, ["--job.config_file", os.path.join(ROOT, CP_CONFIG)])
    cp, seq = cfg.parallelism.context_parallel_degree, cfg.training.seq_len
    _, args = cfg.model.spec()
    h, hkv, d = args.n_heads, args.n_kv_heads, args.dim // args.n_heads
    dtype = torch.bfloat16
    probe = CP_PROBE_SEQ if device != "cpu" else 1024
    full = seq if device != "cpu" else 2048
    compiler = opts["compiler"]
    tag = f"cp_attention[cp {cp}, {h}/{hkv} heads of {d}, bf16]"
    rows, seen = [], {}
    with fake_world(cp):
        rank = cp // 2  # a middle rank: both of its chunks see some keys, not all
        cp_obj = ContextParallel(dist.group.WORLD.group_name, cp, rank)
        shape = (1, probe // cp, h, hkv, d)
        ops, _ = _cp_attention_run(cp_obj, shape, dtype, device)
        seen["eager"] = _attention_kernels(ops)
        ops, codes = _cp_attention_run(cp_obj, shape, dtype, device, compiled=compiler)
        seen[compiler] = (sorted({k for k in FUSED_ATTENTION for c in codes if k in c})
                          if codes else _attention_kernels(ops))
        if device != "cpu":
            torch.accelerator.synchronize()
            torch.accelerator.reset_peak_memory_stats()
        fused = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                 SDPBackend.EFFICIENT_ATTENTION]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            try:
                with sdpa_kernel(fused):
                    ops, _ = _cp_attention_run(cp_obj, (1, full // cp, h, hkv, d), dtype,
                                               device)
                if device != "cpu":
                    torch.accelerator.synchronize()
                full_result = (True, _attention_kernels(ops), time.perf_counter() - t0)
            except RuntimeError as e:
                why = "; ".join(str(w.message).splitlines()[0] for w in caught
                                if "not used because" in str(w.message) or "kernel" in
                                str(w.message).lower())
                full_result = (False, f"{_first_line(e)}" + (f" ({why[:600]})" if why else ""),
                               time.perf_counter() - t0)
        peak = _accelerator_memory() if device != "cpu" else None
    math_used = {k: any(MATH_ATTENTION in n for n in v) or not v for k, v in seen.items()}
    for how, kernels in seen.items():
        name = f"{tag} S={probe} {how}"
        text = (f"rank {rank}'s {probe // cp} queries over {probe} keys ([s, S] bool mask, "
                f"enable_gqa), forward + backward: " + (", ".join(kernels) or "no SDPA op"))
        if device == "cpu":
            rows.append(("SKIP", name, f"the kernel choice that counts is an accelerator's "
                         f"(on CPU: {text})"))
        else:
            rows.append(("FAIL" if math_used[how] else "PASS", name,
                         text + (" (the math kernel: [s, S] scores per head)"
                                 if math_used[how] else "")))
    ok, what, secs = full_result
    name = f"{tag} S={full} fused kernels only"
    if device == "cpu":
        rows.append(("SKIP", name, f"the shape of {CP_CONFIG} is an accelerator's (on CPU at "
                     f"S={full}: {'ran ' + ', '.join(what) if ok else what})"))
    elif ok:
        rows.append(("PASS", name, f"{CP_CONFIG}'s rank: {full // cp} queries over {full} "
                     f"keys, forward + backward on {', '.join(what)} in {secs:.1f}s, max "
                     f"active {peak[0] / 2**30:.1f} GiB, reserved {peak[1] / 2**30:.1f} GiB"))
    else:
        rows.append(("FAIL", name, f"no fused kernel takes it: {what}"))
    return rows


# ----------------------------------------------------------------------------------- bench
def _bench_run(device: str, extra: tuple[str, ...] = ()) -> dict:
    """llama3 1B through the trainer in this process at one rank (a 1-rank group, as without
    torchrun), bf16 params, TF32 on, inductor, with the trainer arguments ``extra``; on CPU
    llama3 debug, small and uncompiled. Its steady tokens/s, TFLOP/s, MFU, memory, losses and
    wall time, and a figure saying them."""
    from simplesharded.trainer import Trainer, check_static
    from simplesharded.trainer.config import load_config
    from simplesharded.trainer.metrics import peak_flops

    cpu = device == "cpu"
    torch.backends.cuda.matmul.allow_tf32 = True  # TF32 on, as a GPU run would have it
    torch.backends.cudnn.allow_tf32 = True
    flavor, seq, batch, steps = ("debug", 128, 2, 4) if cpu else ("1B", 2048, 4, 10)
    dump = _tmp("bench")
    cfg = load_config(None, [
        "--job.config_file", os.path.join(ROOT, "configs", "llama3_debug.toml"),
        "--model.flavor", flavor, "--training.seq_len", str(seq),
        "--training.global_batch_size", str(batch), "--training.steps", str(steps),
        "--training.val_every", "0", "--training.mixed_precision_param", "bfloat16",
        "--compile.enable", "false" if cpu else "true", "--compile.backend",
        "inductor_autobucketing", "--lr_scheduler.warmup_steps", "2",
        "--metrics.progress_bar", "false", "--job.dump_folder", dump, *extra])
    cfg = check_static(cfg, 1)
    torch._dynamo.reset()
    if device == "cuda":  # reserved memory as this run's alone, not an earlier run's cache
        gc.collect()
        torch.cuda.empty_cache()
    with _one_rank(device, host=cfg.parallelism.offload != "none"):
        t0 = time.perf_counter()
        trainer = Trainer(cfg, device)
        trainer.run()
        wall = time.perf_counter() - t0
        peak = peak_flops(device, 0.0, "bfloat16")
        name = torch.cuda.get_device_name() if device == "cuda" else device
    torch._dynamo.reset()
    records = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]
    steady = records[2:] or records  # after compile and the first steps
    mfu = [r["mfu_pct"] for r in steady if r.get("mfu_pct") is not None]
    out = {"tps": statistics.median(r["tps"] for r in steady),
           "tflops": statistics.median(r["tflops"] for r in steady),
           "mfu": statistics.median(mfu) if mfu else None,
           "losses": [r["loss"] for r in records], "wall": wall,
           "sizes": f"llama3 {flavor}, 1 rank, batch {batch} x {seq}", **{
               k: v for k, v in records[-1].items() if k.startswith("mem_max_")}}
    out["figure"] = (
        f"{out['tps']:,.0f} tokens/s per device, {out['tflops']:.1f} TFLOP/s, "
        + (f"MFU {out['mfu']:.1f}% of {name}'s bf16 peak {peak / 1e12:.0f} TFLOP/s"
           if out["mfu"] is not None else f"MFU unknown ({name} is not in the peak table)")
        + (f", memory active {out['mem_max_active_gib']:.1f} GiB "
           f"({out.get('mem_max_active_pct', 0):.0f}%), reserved "
           f"{out['mem_max_reserved_gib']:.1f} GiB ({out.get('mem_max_reserved_pct', 0):.0f}%)"
           if "mem_max_reserved_gib" in out else "")
        + f"; loss {out['losses'][0]:.3f} -> {out['losses'][-1]:.3f} in "
          f"{len(out['losses'])} steps, {wall:.0f}s with compile")
    return out


def _fresh_bench(device: str, extra: tuple[str, ...] = ()) -> dict:
    """:func:`_bench_run` in a process of its own (spawned), so that no run measures what an
    earlier one left (on the H200 the params offload run measured 28.8 GiB active after the
    plain run, 17.6 alone: the plain run's parameters and gradients, which a since-mended
    hook kept alive). On CPU in this process: no memory is measured there, and a spawn
    costs the suite a torch import per run."""
    if device == "cpu":
        return _bench_run(device, extra)
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_bench_run, device, extra).result()


def _plain_bench(device: str) -> dict:
    """The bench's plain run, once per driver run: the first check that needs it (bench,
    float8, offload) saves it in the run's temp directory and the later ones read it back (a
    1B compile and 10 steps each spared; on one device, runs in turn in processes of their own
    are comparable)."""
    root = os.environ.get("GPU_CHECK_TMP")
    path = os.path.join(root, f"bench_plain_{device}.json") if root else None
    if path and os.path.exists(path):
        with open(path) as f:
            return {**json.load(f), "reused": True}
    run = _fresh_bench(device)
    if path:
        with open(path, "w") as f:
            json.dump(run, f)
    return run


def check_bench(device: str, opts: dict) -> list[Row]:
    run = _plain_bench(device)
    tag = "bench[llama3 1B, 1 rank, batch 4 x 2048, bf16, TF32 on, inductor_autobucketing]"
    if device == "cpu":
        return [("SKIP", tag, f"a 1B model is an accelerator's bench; the same code on CPU "
                 f"at {run['sizes']}, uncompiled: {run['figure']}")]
    ok = all(map(math.isfinite, run["losses"])) and (run["mfu"] is None or 0 < run["mfu"] < 100)
    return [("PASS" if ok else "FAIL", tag, run["figure"])]


def _side_by_side(device: str, tag: str, variant: tuple[str, ...], why_cpu: str,
                  ok) -> list[Row]:
    """The bench's plain run (:func:`_plain_bench`) and the same with the trainer arguments
    ``variant``: both figures and the variant's tokens/s over the plain run's. ``ok(plain, run)``
    decides PASS; on CPU a SKIP saying ``why_cpu`` and what the CPU sizes gave."""
    plain, run = _plain_bench(device), _fresh_bench(device, variant)
    figure = (f"{' '.join(variant)}: {run['figure']}; without: {plain['figure']}"
              + (" (an earlier check's run, reused)" if plain.get("reused") else "") + "; "
              f"tokens/s x{run['tps'] / plain['tps']:.2f}")
    if device == "cpu":
        return [("SKIP", tag, f"{why_cpu}; the same code on CPU at {run['sizes']}, "
                 f"uncompiled: {figure}")]
    finite = all(map(math.isfinite, plain["losses"] + run["losses"]))
    return [("PASS" if finite and ok(plain, run) else "FAIL", tag, figure)]


def check_float8(device: str, opts: dict) -> list[Row]:
    """The bench's 1B in bf16 against the same with its blocks' Linears in float8
    (training.float8: float8 matmuls, the weights gathered in float8): tokens/s side by side.
    Float8 matmuls need sm_89 or newer; a loss more than 5 % off bf16's after 10 steps is a
    FAIL."""
    tag = "float8[llama3 1B, 1 rank, bf16 vs float8 Linears, inductor_autobucketing]"
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        return [("SKIP", tag, f"float8 matmuls need sm_89 or newer; this device is sm_"
                 f"{''.join(map(str, torch.cuda.get_device_capability()))}")]
    return _side_by_side(
        device, tag, ("--training.float8",), "float8 matmuls are an accelerator's",
        lambda plain, run: abs(run["losses"][-1] - plain["losses"][-1])
        <= 0.05 * abs(plain["losses"][-1]))


def check_offload(device: str, opts: dict) -> list[Row]:
    """The bench's 1B without offload against ``parallelism.offload params`` (shards,
    gradients and the optimizer step on the host, pinned; copies per bucket as graph nodes):
    peak device memory and tokens/s side by side. The offloaded run must hold less device
    memory at its peak and log the same losses (1e-3 relative: the host's optimizer step)."""
    tag = "offload[llama3 1B, 1 rank, params on the host vs none, inductor_autobucketing]"

    def ok(plain, run):
        same = all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(run["losses"], plain["losses"]))
        return same and run["mem_max_active_gib"] < plain["mem_max_active_gib"]
    return _side_by_side(device, tag, ("--parallelism.offload", "params"),
                         "the host and the device are one memory on CPU", ok)


def check_copy_stream(device: str, opts: dict) -> list[Row]:
    """Host offload's copies on the device's copy streams (simplesharded/storage/offload.py,
    placed by passes/offload_copies.py): the parity model with ragged buckets, compiled, STEPS
    SGD steps with ``offload="params"``, then ``"optimizer"``, against the same without
    (losses and shards within the backend's TOL: a copy read before it landed, or a gradient
    overwritten while copied, would give other numbers), each then profiled for one more step:
    under ``params`` its copies each way on streams no kernel runs on, part of their time
    beside kernels (what running them there buys); under ``optimizer`` the resident copies'
    refresh and the gradients' copies on such streams (a tiny model's refresh may land before
    the first kernel: its share beside kernels is reported, not required)."""
    from dist_utils import max_rel_diff
    from torch.distributed.device_mesh import init_device_mesh

    backend = "inductor_blockbucketing" if device != "cpu" else "aot_eager_blockbucketing"
    tag = f"copy_stream[params and optimizer offload, 1 rank, {backend}]"
    traces = {kind: os.path.join(_tmp(f"copy_stream_{kind}"), "trace.json")
              for kind in ("params", "optimizer")}
    with _one_rank(device, host=True):
        mesh = init_device_mesh(device, (1,))
        plain = _train(backend, mesh, device, 0, "ragged")
        runs = {kind: _train(backend, mesh, device, 0, "ragged", offload=kind,
                             trace=trace if device != "cpu" else None)
                for kind, trace in traces.items()}
    ok, figures = True, []
    for kind, run in runs.items():
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], plain["losses"]))
        shard_diff = max(max_rel_diff(run["shards"][n], p) for n, p in plain["shards"].items())
        ok = ok and loss_diff <= _tol(backend) and shard_diff <= _tol(backend)
        figures.append(f"{kind} against no offload: loss rel diff {loss_diff:.1e}, shard rel "
                       f"diff {shard_diff:.1e} (tol {_tol(backend):.0e})")
    if device == "cpu":
        return [("SKIP", tag, f"a CPU has one stream (tests/test_offload_copies.py checks the "
                 f"order and the protocols); the same code on CPU, {'; '.join(figures)}")]
    for kind, trace in traces.items():
        with open(trace) as f:
            events = json.load(f).get("traceEvents", [])
        for way in ("HtoD", "DtoH"):
            seen = copy_overlap(events, way)
            figures.append(f"{kind}: {seen['copies']} {way} copies on stream(s) "
                           f"{seen['streams']} (kernels on {seen['kernel_streams']}), "
                           f"{seen['copy_us']:.0f} us, {100 * seen['beside']:.0f}% of it "
                           f"beside kernels")
            ok = ok and seen["copies"] > 0 and (seen["beside"] > 0 or kind == "optimizer")
    return [("PASS" if ok else "FAIL", tag, "; ".join(figures))]


def copy_overlap(events: list[dict], way: str = "HtoD") -> dict:
    """Of a chrome trace's events (the profiler's ``export_chrome_trace``): the copies ``way``
    ("HtoD" or "DtoH", as the trace names them) on streams no kernel runs on, their streams,
    the kernels' streams, the copies' microseconds and the share of those during which a
    kernel ran."""
    kernels = [e for e in events if e.get("cat") == "kernel"]
    kernel_streams = sorted({e.get("args", {}).get("stream") for e in kernels} - {None})
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and way in e.get("name", "")
              and e.get("args", {}).get("stream") not in kernel_streams]
    busy = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    merged: list[list[float]] = []  # the kernels' time as disjoint intervals
    for a, z in busy:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], z)
        else:
            merged.append([a, z])
    total = sum(e["dur"] for e in copies)
    beside = sum(max(0.0, min(z, e["ts"] + e["dur"]) - max(a, e["ts"]))
                 for e in copies for a, z in merged)
    return {"copies": len(copies), "streams": sorted({e["args"]["stream"] for e in copies}),
            "kernel_streams": kernel_streams, "copy_us": total,
            "beside": beside / total if total else 0.0}


# ------------------------------------------------------------------------------- calibrate
def check_calibrate(device: str, opts: dict) -> list[Row]:
    from simplesharded.calibration import calibrate
    from simplesharded.trainer import device_peaks

    name = torch.cuda.get_device_name() if device == "cuda" else device
    kinds = {}
    for kind, dtype, tf32 in (("bfloat16", "bfloat16", False), ("float32", "float32", False),
                              ("tf32", "float32", True)):
        if kind == "tf32" and device == "cpu":
            continue  # no TF32 on a CPU
        torch.backends.cuda.matmul.allow_tf32 = tf32
        result = calibrate(device=device, dtype=dtype)
        assert result["measured"]["compute"]["matmul_kind"] == kind, result["measured"]
        kinds[kind] = result["hardware"]["flops_per_s"] / 1e12
    torch.backends.cuda.matmul.allow_tf32 = False
    peaks = {k: device_peaks.peak_tflops(name, k) for k in kinds}
    text = ", ".join(f"{k} {v:.3g} TFLOP/s" + (f" ({100 * v / peaks[k]:.0f}% of the published "
                                              f"{peaks[k]:.0f})" if peaks[k] else "")
                     for k, v in kinds.items())
    tag = f"calibrate[matmul by compute dtype, {name}]"
    rows = []
    if device == "cpu":
        rows.append(("PASS", tag, text + " (CPU: no expectation between them)"))
    else:
        above = [k for k, v in kinds.items() if peaks[k] and v > 1.05 * peaks[k]]
        slow = kinds["bfloat16"] <= kinds["float32"]
        rows.append(("FAIL" if above or slow else "PASS", tag, text
                     + (f"; above the published peak: {above}" if above else "")
                     + ("; bf16 not faster than fp32" if slow else "")))
    cmd = [sys.executable, "-m", "simplesharded.tools.calibrate", "--force", "--dtype",
           "bfloat16"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=_left(opts))
    except subprocess.TimeoutExpired:
        return rows + [("FAIL", "calibrate[python -m simplesharded.tools.calibrate --dtype "
                        "bfloat16]", f"timed out after {_left(opts):.0f}s")]
    print(p.stdout[-3000:], flush=True)
    ok = p.returncode == 0 and "(bfloat16)" in p.stdout
    report = [" ".join(ln.split()) for ln in p.stdout.splitlines() if "matmul" in ln]
    rows.append(("PASS" if ok else "FAIL", "calibrate[python -m simplesharded.tools.calibrate "
                 "--dtype bfloat16]", (report[0] if report and ok else
                                       f"exit {p.returncode}: {(p.stdout + p.stderr)[-600:]}")))
    return rows


# ------------------------------------------------------------------------------------ init
# (model, tp, ep) of the init check at 2 ranks; each is compared with the model at 1 rank
INIT_CASES = (("llama3", 1, 1), ("llama3", 2, 1), ("deepseek_v3", 1, 2))
INIT_SEED = 7


def _init_cases() -> tuple:
    """INIT_CASES this torch can build: without expert parallelism (passes/torch_compat.py)
    the MoE runs without ep."""
    if not _lacks("EXPERT_PARALLEL"):
        return INIT_CASES
    return tuple((n, tp, 1) for n, tp, _ in INIT_CASES)


def _regions(model) -> dict:
    """fqn → (this rank's region of the parameter or buffer, on the CPU; its box). Parameters
    as ``state_dict()`` gives them (a ragged bucket's member as its per-parameter shard)."""
    from simplesharded.storage.init import local_box

    out = {}
    state = model.state_dict()
    params = [(fqn, state[fqn]) for fqn, _ in model.named_parameters()]
    for fqn, t in [*params, *model.named_buffers()]:
        local, box = local_box(t.detach())
        out[fqn] = (local.cpu().clone(), box, tuple(t.shape))
    return out


def _init_job(rank: int, world: int, device: str) -> dict:
    """Every case of ``world`` ranks initialised on ``device`` shards, as regions; at 1 rank
    also the plain model on ``device`` and the shards drawn with ``device="cpu"``."""
    import simplesharded as ss
    from simplesharded.models import build_model
    from simplesharded.trainer import apply_expert_parallel, apply_tensor_parallel

    if device != "cpu":
        torch.accelerator.set_device_index(0)  # one device: both ranks share it
    out = {}
    cases = _init_cases() if world > 1 else dict.fromkeys((n, 1, 1) for n, _, _ in INIT_CASES)
    for name, tp, ep in cases:
        for draw in ((None, "cpu") if world == 1 else (None,)):
            mesh = ss.build_mesh(1, world // tp, device, tp=tp, ep=ep)
            model = build_model(name, "debug", device="meta")
            apply_tensor_parallel(model, mesh, sequence_parallel=True)
            apply_expert_parallel(model, mesh)
            ss.data_parallel(model, mesh, "fully_shard")
            ss.init_sharded(model, seed=INIT_SEED, device=draw)
            out[name, tp, ep, draw] = _regions(model)
    # what the trainer did before init_sharded on a GPU: the model's init on the shards
    mesh = ss.build_mesh(1, world, device)
    model = ss.data_parallel(build_model("llama3", "debug", device="meta"), mesh)
    torch.manual_seed(INIT_SEED)
    with ss.disable_gather(model):
        model.init_weights()
    out["on shards"] = _regions(model)
    # Nothing above communicates: without it rank 0 could finish first and take the store
    # (which it hosts) down while the other rank still creates a mesh group.
    torch.distributed.barrier()
    if world == 1:
        for name in dict.fromkeys(n for n, _, _ in INIT_CASES):
            plain = build_model(name, "debug", device=device)
            ss.init_sharded(plain, seed=INIT_SEED)
            out[name, "plain"] = _regions(plain)
    return out


def _assemble(ranks: list[dict], key) -> dict:
    """The full tensors of ``key``'s case from every rank's regions."""
    full = {}
    for regions in ranks:
        for fqn, (local, box, shape) in regions[key].items():
            t = full.setdefault(fqn, torch.zeros(shape, dtype=local.dtype))
            t[box] = local
    return full


def _differ(got: dict, want: dict) -> list[str]:
    return [k for k in want if k not in got or not torch.equal(got[k], want[k])]


def check_init(device: str, opts: dict) -> list[Row]:
    from dist_utils import spawn

    import simplesharded as ss
    from simplesharded.models import build_model

    one = spawn(1, _init_job, device, timeout_s=600)
    two = spawn(2, _init_job, device, timeout_s=600)
    rows = []
    if _init_cases() != INIT_CASES:
        rows.append(("SKIP", "init ep=2", f"torch {torch.__version__} cannot build the ep mesh"))
    # the old way (the model's init on the shards) for comparison, in the first row
    old = len(_differ(_assemble(two, "on shards"), _assemble(one, "on shards")))
    for name, tp, ep in _init_cases():
        want = _assemble(one, (name, 1, 1, None))
        bad = _differ(_assemble(two, (name, tp, ep, None)), want)
        note = f" (init_weights on the shards instead: {old} differ)" if old is not None else ""
        old = None
        rows.append(("FAIL" if bad else "PASS", f"init[2 ranks on {device}] {name} tp={tp} "
                     f"ep={ep}", f"{len(want) - len(bad)} of {len(want)} tensors equal 1 "
                     f"rank's bit for bit" + (f"; differ: {bad[:4]}" if bad else "") + note))
    for name in dict.fromkeys(n for n, _, _ in INIT_CASES):
        sharded = _assemble(one, (name, 1, 1, None))
        bad = _differ(sharded, _assemble(one, (name, "plain")))
        rows.append(("FAIL" if bad else "PASS", f"init[1 rank on {device}] {name} vs plain",
                     f"{len(sharded) - len(bad)} of {len(sharded)} tensors equal"
                     + (f"; differ: {bad[:4]}" if bad else "")))
        cpu = build_model(name, "debug", device="cpu")
        ss.init_sharded(cpu, seed=INIT_SEED)
        want = {k: t.detach() for k, t in [*cpu.named_parameters(), *cpu.named_buffers()]}
        bad = _differ(_assemble(one, (name, 1, 1, "cpu")), want)
        on_device = len(_differ(sharded, want))
        rows.append(("FAIL" if bad else "PASS", f"init[device='cpu' on {device}] {name}",
                     f"{len(want) - len(bad)} of {len(want)} tensors equal the CPU's"
                     + (f"; differ: {bad[:4]}" if bad else "")
                     + f" (drawn on {device}: {on_device} differ from the CPU's)"))
    return rows


# -------------------------------------------------------------------------------- the child
CHECKS = {"parity": check_parity, "fake8": check_fake8, "train": check_train,
          "moe": check_moe, "cp_attention": check_cp_attention, "bench": check_bench,
          "calibrate": check_calibrate, "init": check_init, "parity_gloo2": check_parity_gloo2,
          "float8": check_float8, "offload": check_offload, "copy_stream": check_copy_stream}


def child(name: str, device: str, opts: dict) -> int:
    """Run check ``name`` in this process; its rows go to stdout as ROW lines. fp32 matmuls
    without TF32 (parity is measured in fp32), unless the check says otherwise."""
    torch.set_float32_matmul_precision("highest")
    if device != "cpu":
        torch.accelerator.set_device_index(0)
    try:
        rows = CHECKS[name](device, opts)
    except Exception as e:  # a check that crashes is a failed check, its traceback in the log
        rows = [("FAIL", name, _first_line(e))]
        traceback.print_exc()
    for row in rows:
        print(ROW + json.dumps(list(row)), flush=True)
    return 0
