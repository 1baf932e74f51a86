"""GPU smoke test: what a first run on one accelerator executes, check by check (a CPU dry run
of the same checks with gloo when there is none, or with --cpu).

Checks (``--checks``, default all), each printed as PASS / FAIL / SKIP with its numbers:

  parity        one process on the device's own backend (NCCL on a GPU, gloo on CPU):
                ``data_parallel`` + each backend (``--backends``) trains STEPS SGD steps of a
                small llama3; losses and final shards must match the uncompiled run (relative
                TOL: inductor's kernels reassociate fp32 sums). At one rank DTensor issues no
                collective: this checks compile, kernels and NCCL's start-up. Rows named
                ``ragged:<backend>`` train the same with ragged buckets (the trainer's default
                storage), uncompiled and under each bucketing backend, against the same
                reference.
  fake8         (``--cases``) the trainer itself (simplesharded.trainer.Trainer: meta-device init, TP, EP,
                activation checkpointing, data_parallel, our backends) on a fake process group
                of 8 ranks on this one device: collectives do nothing, but the bucketed and
                reordered graphs are lowered (by inductor: Triton and CUDA streams on a GPU)
                and run. Each case checks that the collectives in inductor's output code come
                in the order our passes put them, that the losses are finite, that bf16
                attention runs a fused kernel, and (on an accelerator) the peak memory of a
                step against the planner's prediction for the same config.
  parity_gloo2  the parity check on 2 processes with gloo on device tensors (both on device
                0), real collectives through our passes; SKIP, with the reason, when gloo cannot
                run the functional all-gather DTensor issues on that device.
  init          ``init_sharded`` (simplesharded/storage/init.py) on device shards: 2 gloo ranks on the
                device (llama3 fully sharded, at tp 2, and the deepseek_v3 MoE at ep 2) give
                the full parameters of 1 rank bit for bit, 1 rank those of the plain model
                given the same call, and ``device="cpu"`` the CPU's values.
  bench         ``python -m simplesharded.tools.bench --device <dev>`` with the compute floors.
  calibrate     ``python -m simplesharded.tools.calibrate --force``: the numbers the default
                backends plan with.

Every check runs in a process of its own (a crash or a hang is that check's FAIL, the others
still run). Exit status 1 if any check failed. Run through scripts/gpu_smoke.sh: it needs
nothing installed but torch.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the checkout, uninstalled; the test helpers
for _path in (ROOT, os.path.join(ROOT, "tests", "support")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

BACKENDS = ("eager", "aot_eager", "aot_eager_blockbucketing", "aot_eager_autobucketing",
            "inductor", "inductor_blockbucketing", "inductor_autobucketing")
CHECKS = ("parity", "fake8", "parity_gloo2", "init", "bench", "calibrate")
STEPS = 3
MODEL = dict(name="llama3", flavor="debug", n_layers=2)
BATCH_PER_RANK, SEQ = 2, 64
# relative, on every loss and on each final shard's max |diff| / max |ref| (as tests/test_parity)
TOL = {"inductor": 1e-4, "other": 1e-5}
ROW = "@@row "  # a child's result line: ROW + json [status, name, detail]

# fake8: (name, config file, overrides). Every case is the trainer's own recipe on 8 fake
# ranks; the cost model is a fixed profile (calibrating on a fake group measures nothing).
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
# The planner's memory model is of the aot_eager backends (inductor fuses and frees on its own
# schedule): the measured peak of a case under inductor_X is compared with aot_eager_X's.
MEMORY_TOL = 0.35  # |measured / predicted - 1|
FUSED_ATTENTION = ("_flash_attention", "_cudnn_attention", "_efficient_attention")


RAGGED = "ragged:"  # a parity row's prefix: the run used ragged buckets


def _tol(backend: str) -> float:
    from simplesharded.backends import BackendName

    backend = backend.removeprefix(RAGGED)
    if backend == "uncompiled":
        return TOL["other"]
    return TOL["inductor" if BackendName.parse(backend).compiler == "inductor" else "other"]


# ---------------------------------------------------------------------------------- parity
def _train(backend: str, mesh, device: str, rank: int, storage: str = "param") -> dict:
    """STEPS steps of ``backend`` ("uncompiled": no torch.compile) with ``data_parallel``'s
    ``storage``; losses and the local shards of ``state_dict()``
    (per parameter whatever the storage)."""
    import simplesharded as ss
    from simplesharded.models import build_model, logits_of

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(MODEL["name"], MODEL["flavor"], device="cpu",
                        n_layers=MODEL["n_layers"]).to(device)  # same init on every device
    ss.data_parallel(model, mesh, "fully_shard", storage=storage)
    run = model if backend == "uncompiled" else torch.compile(
        model, backend=ss.make_backend(backend), fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    losses = []
    t0 = time.perf_counter()
    for _ in range(STEPS):
        tokens = torch.randint(0, 256, (BATCH_PER_RANK, SEQ + 1), generator=g).to(device)
        logits = logits_of(run(tokens[:, :-1]))
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    shards = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().cpu().clone()
              for n, p in model.state_dict().items()}
    torch._dynamo.reset()
    return dict(losses=losses, shards=shards, seconds=time.perf_counter() - t0)


def _compare(results: dict, rank: int) -> list[tuple[str, str, str]]:
    """(status, name, detail) per backend, against results["uncompiled"]."""
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


def _first_line(e: BaseException) -> str:
    first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {first}"[:300]


def _run_backends(mesh, device: str, rank: int, backends) -> dict:
    """Each of ``backends`` with one shard per parameter, then uncompiled and each bucketing
    backend with ragged buckets: {row name: _train's result}."""
    from simplesharded.backends import BackendName

    results = {"uncompiled": _train("uncompiled", mesh, device, rank)}
    runs = [(be, be, "param") for be in backends]
    runs += [(RAGGED + be, be, "ragged") for be in ("uncompiled", *backends)
             if be == "uncompiled" or BackendName.parse(be).ours]
    for name, be, storage in runs:
        try:
            results[name] = _train(be, mesh, device, rank, storage)
        except Exception as e:  # reported as this backend's failure; the others still run
            results[name] = {"error": _first_line(e)}
    return results


def check_parity(device: str, backends) -> list[tuple[str, str, str]]:
    """One process, the device's own backend (mesh.init_mesh makes a 1-rank group)."""
    import torch.distributed as dist

    import simplesharded as ss
    from simplesharded.mesh import backend_for

    mesh = ss.init_mesh(dp_shard=-1, device=device)
    try:
        results = _run_backends(mesh, device, 0, backends)
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


def _gloo2_job(rank: int, world: int, device: str, backends) -> dict:
    from simplesharded.mesh import build_mesh

    if device != "cpu":
        torch.accelerator.set_device_index(0)
    mesh = build_mesh(dp_replicate=1, dp_shard=world, device=device)
    results = _run_backends(mesh, device, rank, backends)
    return {"rows": _compare(results, rank)}


def check_parity_gloo2(device: str, backends) -> list[tuple[str, str, str]]:
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
    ranks = spawn(2, _gloo2_job, device, tuple(backends), timeout_s=600)
    return [(s, tag + be, d) for r in ranks for s, be, d in r["rows"]]


# ----------------------------------------------------------------------------------- fake8
def _fake_cfg(config: str, overrides: list[str], device: str):
    from simplesharded.trainer.config import load_config
    from simplesharded.trainer import check_static

    cfg = load_config(None, ["--job.config_file", os.path.join(ROOT, config), "--compile.enable",
                             "--compile.hardware", "h100-ib400", "--training.steps", "2",
                             "--training.val_every", "0", "--metrics.save_jsonl", "false",
                             # the fake group's values are made up: a NaN is not a finding
                             "--training.on_nonfinite", "skip",
                             "--job.dump_folder", os.path.join("/tmp", "ss_gpu_smoke"),
                             *overrides])
    return check_static(cfg, FAKE_WORLD)


def _predicted_peaks(device: str, cases) -> dict[str, int]:
    """{case: the planner's per-rank peak bytes} for each case's config and backend. Runs before
    this process touches the device or a process group: the planner traces in forked
    children, each with a fake group of its own."""
    from simplesharded.tools.forecast import forecast_backend, predicted_peak_bytes

    out = {}
    for name, config, overrides in cases:
        cfg = _fake_cfg(config, overrides, device)
        backend = forecast_backend(cfg.compile.backend)
        out[name] = predicted_peak_bytes(cfg, FAKE_WORLD, [backend],
                                         cfg.compile.hardware)[backend]
    return out


def _fake_case(name: str, config: str, overrides: list[str], device: str,
               predicted: int | None) -> list[tuple[str, str, str]]:
    from inductor_code import code_order, format_order, graph_order
    from torch._inductor.utils import run_and_get_code

    from simplesharded.tools.cluster_trace import fake_world
    from simplesharded.passes.collectives import count_collectives
    from simplesharded.passes.pipeline import LAST_STAGE
    from simplesharded.trainer import Trainer

    from simplesharded.backends import BackendName

    cfg = _fake_cfg(config, overrides, device)
    inductor = BackendName.parse(cfg.compile.backend).compiler == "inductor"
    tag = f"fake8[{name}, {cfg.compile.backend}]"
    orders: dict[str, list] = {}
    counts: dict[str, dict] = {}

    def observe(kind, stage, gm):
        # read now: what our last pass hands over (inductor edits the graph afterwards)
        if stage == LAST_STAGE:
            orders[kind], counts[kind] = graph_order(gm), count_collectives(gm)

    torch._dynamo.reset()
    with fake_world(FAKE_WORLD):
        t0 = time.perf_counter()
        trainer = Trainer(cfg, device, observer=observe)
        record, codes = run_and_get_code(trainer.train_step)  # compiles, then runs
        compile_s = time.perf_counter() - t0
        if device != "cpu":
            torch.accelerator.synchronize()
            torch.accelerator.reset_peak_memory_stats()
        record = trainer.train_step()
        peak = overhead = None
        if device != "cpu":
            torch.accelerator.synchronize()
            peak = torch.accelerator.max_memory_allocated()
            # What stays allocated that the planner does not model: the caching allocator
            # holds the math libraries' workspaces (cuBLAS: one per stream), a constant of the
            # device, not of the model. The planner's part is the rest: state + step peak.
            state = sum(_nbytes(t) for p in trainer.model.parameters()
                        for t in (p, p.grad) if t is not None)
            state += sum(_nbytes(v) for s in trainer.optimizer.state.values()
                         for v in s.values() if isinstance(v, torch.Tensor))
            overhead = torch.accelerator.memory_allocated() - state
    torch._dynamo.reset()
    # torch's fake group copies inputs into collective outputs since 2.13; before, outputs
    # are left unset and a step's values may not be finite (then the optimizer skips it)
    stepped = bool(trainer.optimizer.state)
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
        if cfg.training.mixed_precision_param == "bfloat16" and device != "cpu":
            fused = sorted({k for k in FUSED_ATTENTION for c in codes if k in c})
            rows.append(("PASS" if fused else "FAIL", f"{tag} fused attention",
                         f"kernels {fused}" if fused else "no fused SDPA kernel in the code"))
    if peak is not None and predicted and not stepped:
        rows.append(("SKIP", f"{tag} memory", "no optimizer step ran (non-finite values from "
                     "this torch's fake group): the peak would lack the optimizer state"))
    elif peak is not None and predicted:
        ratio = (peak - overhead) / predicted
        rows.append(("PASS" if abs(ratio - 1) <= MEMORY_TOL else "FAIL", f"{tag} memory",
                     f"max_memory_allocated {peak / 2**20:.0f} MiB per step, less "
                     f"{overhead / 2**20:.0f} MiB the device keeps beside the model's state "
                     f"(library workspaces), vs planner {predicted / 2**20:.0f} MiB: "
                     f"x{ratio:.2f} (tol ±{MEMORY_TOL:.0%})"))
    return rows


def _nbytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def check_fake8(device: str, backends, cases=None) -> list[tuple[str, str, str]]:
    cases = [c for c in FAKE_CASES if cases is None or c[0] in cases]
    rows = []
    if _torch_before(2, 13):  # DeviceMesh._unflatten, which the ep mesh is made by, differs
        rows += [("SKIP", f"fake8[{c[0]}]", f"expert parallelism needs torch >= 2.13 "
                  f"(this is {torch.__version__})") for c in cases if "ep" in c[0]]
        cases = [c for c in cases if "ep" not in c[0]]
    predicted = _predicted_peaks(device, cases) if device != "cpu" else {}
    for name, config, overrides in cases:
        try:
            rows += _fake_case(name, config, overrides, device, predicted.get(name))
        except RuntimeError as e:
            # A fake group cannot know what the other ranks send: its all-to-all invents the
            # received rows, and a token exchange sized by invented counts can ask a rank for
            # rows it has none of. Not our code's failure; the real exchange is tested on gloo.
            status = "SKIP" if "alltoall_base: inputBuffer is empty" in str(e) else "FAIL"
            rows.append((status, f"fake8[{name}]", _first_line(e)))
        except Exception as e:  # this case's failure; the other cases still run
            rows.append(("FAIL", f"fake8[{name}]", _first_line(e)))
    return rows


def _torch_before(major: int, minor: int) -> bool:
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (major, minor)


# ------------------------------------------------------------------------------------ init
# (model, tp, ep) of the init check at 2 ranks; each is compared with the model at 1 rank
INIT_CASES = (("llama3", 1, 1), ("llama3", 2, 1), ("deepseek_v3", 1, 2))
INIT_SEED = 7


def _init_cases() -> tuple:
    """INIT_CASES this torch can build: before 2.13 DeviceMesh._unflatten refuses the ep
    mesh (simplesharded/mesh.py), so the MoE runs without ep there."""
    if not _torch_before(2, 13):
        return INIT_CASES
    return tuple((n, tp, 1) for n, tp, _ in INIT_CASES)


def _regions(model) -> dict:
    """fqn → (this rank's region of the parameter or buffer, on the CPU; its box)."""
    from simplesharded.storage.init import local_box

    out = {}
    for fqn, t in [*model.named_parameters(), *model.named_buffers()]:
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


def check_init(device: str, backends) -> list[tuple[str, str, str]]:
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


# ------------------------------------------------------------------------- bench, calibrate
def _subprocess(cmd: list[str], timeout_s: int) -> tuple[int, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout_s}s: {' '.join(cmd)}"
    return p.returncode, p.stdout + p.stderr


def check_bench(device: str, backends) -> list[tuple[str, str, str]]:
    cmd = [sys.executable, "-m", "simplesharded.tools.bench", "--device", device,
           "--model", MODEL["name"], "--flavor", MODEL["flavor"], "--seq-len", "128",
           "--variants", "compute_floor", "compute_floor_inductor",
           "--warmup", "2", "--steps", "5", "--reps", "1", "--no-predict-memory"]
    rc, out = _subprocess(cmd, 1200)
    table = [ln for ln in out.splitlines() if ln.startswith(("|", "parity", MODEL["name"]))]
    print("\n".join(["$ " + " ".join(cmd[1:])] + table), flush=True)
    failed = rc != 0 or any("| failed:" in ln for ln in table)
    return [("FAIL" if failed else "PASS", f"bench compute floor [{device}]",
             f"exit {rc}" + ("" if table and not failed else ": " + out[-1500:]))]


def check_calibrate(device: str, backends) -> list[tuple[str, str, str]]:
    rc, out = _subprocess([sys.executable, "-m", "simplesharded.tools.calibrate", "--force"], 1200)
    print(out[-3000:], flush=True)
    return [("PASS" if rc == 0 else "FAIL", "calibrate (python -m simplesharded.tools.calibrate)",
             f"exit {rc}" + ("" if rc == 0 else ": " + out[-1500:]))]


RUNS = {"parity": check_parity, "fake8": check_fake8, "parity_gloo2": check_parity_gloo2,
        "init": check_init, "bench": check_bench, "calibrate": check_calibrate}


# -------------------------------------------------------------------------------- driver
def versions(device: str) -> str:
    lines = [f"python {sys.version.split()[0]}, torch {torch.__version__}"]
    if device == "cpu":
        lines.append("device: cpu (gloo)")
    else:
        props = torch.cuda.get_device_properties(0) if device == "cuda" else None
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if device == "cuda" else "-"
        lines.append(f"device: {device} x{torch.accelerator.device_count()}"
                     + (f" ({props.name}, sm_{props.major}{props.minor}, "
                        f"{props.total_memory / 2**30:.0f} GiB)" if props else "")
                     + f", CUDA {torch.version.cuda}, NCCL {nccl}")
    try:
        import triton
        lines.append(f"triton {triton.__version__}")
    except ImportError:
        lines.append("triton: not installed")
    return "\n".join(lines)


def _child(name: str, device: str, backends, cases) -> int:
    """Run one check in this process; its rows go to stdout as ROW lines."""
    torch.set_float32_matmul_precision("highest")  # no TF32: parity is measured in fp32
    try:
        rows = (check_fake8(device, backends, cases) if name == "fake8"
                else RUNS[name](device, backends))
    except Exception as e:  # a check that crashes is a failed check
        rows = [("FAIL", name, _first_line(e))]
    for row in rows:
        print(ROW + json.dumps(list(row)), flush=True)
    return 0


def _run_check(name: str, device: str, backends, cases, timeout_s: int) -> list:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--device", device,
           "--backends", *backends, "--cases", *cases]
    # No compile cache: a cached graph skips our passes (nothing to compare the code with),
    # and a check is of what this machine compiles now.
    env = {**os.environ, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT,
                           env=env)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rows = [json.loads(ln[len(ROW):]) for ln in out.splitlines() if ln.startswith(ROW)]
        return rows + [["FAIL", name, f"timed out after {timeout_s}s"]]
    rows = [json.loads(ln[len(ROW):]) for ln in p.stdout.splitlines() if ln.startswith(ROW)]
    other = [ln for ln in p.stdout.splitlines() if not ln.startswith(ROW)]
    if other:
        print("\n".join(other), flush=True)
    if p.returncode != 0 or not rows:
        rows.append(["FAIL", name, f"exit {p.returncode}: {p.stderr[-1500:]}"])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="CPU dry run even if a GPU is present")
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    ap.add_argument("--checks", nargs="+", default=list(CHECKS), choices=CHECKS)
    ap.add_argument("--cases", nargs="+", default=[c[0] for c in FAKE_CASES],
                    choices=[c[0] for c in FAKE_CASES], help="fake8's cases")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per check")
    ap.add_argument("--child", choices=CHECKS, help=argparse.SUPPRESS)
    ap.add_argument("--device", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        return _child(ns.child, ns.device, ns.backends, ns.cases)
    accelerator = torch.accelerator.current_accelerator()
    device = "cpu" if ns.cpu or accelerator is None else accelerator.type
    if device == "cpu" and not ns.cpu:
        print("no accelerator found: CPU dry run of the same checks with gloo", flush=True)
    print(versions(device), flush=True)
    rows = []
    for name in ns.checks:
        t0 = time.perf_counter()
        print(f"--- {name}", flush=True)
        got = _run_check(name, device, ns.backends, ns.cases, ns.timeout)
        for row in got:
            print(" ".join(row[:2]) + ": " + row[2], flush=True)
        rows += got
        print(f"({name}: {time.perf_counter() - t0:.0f}s)", flush=True)
    failed = [r for r in rows if r[0] == "FAIL"]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} checks passed or skipped"
          + (f"; FAILED: {', '.join(r[1] for r in failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
