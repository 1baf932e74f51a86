"""GPU smoke test: every backend against the uncompiled run, the bench's compute floor and
calibration, on this machine's accelerator (a CPU dry run with gloo when there is none).

Checks (``--checks``, default all), each printed as PASS / FAIL / SKIP with its numbers:

  parity        one process on the device's own backend (NCCL on a GPU, gloo on CPU):
                ``data_parallel`` + each backend (``--backends``, default all seven) trains
                STEPS SGD steps of a small llama3; losses and final shards must match the
                uncompiled run (relative TOL: inductor's kernels reassociate fp32 sums). At one
                rank DTensor issues no collectives: this checks compile and kernels.
  parity_gloo2  the same on 2 processes with gloo on device tensors (both on device 0), the
                only way one GPU runs real collectives through our passes; skipped, with the
                reason, when gloo cannot run a collective data_parallel needs on that device.
  bench         ``python -m simplesharded.bench --device <dev>`` with the compute floors
                (eager and inductor: the model alone, no data parallelism).
  calibrate     ``python -m simplesharded.calibrate --force`` (one rank per GPU; 2 gloo ranks
                on CPU): the numbers the default backends plan with.

Exit status 1 if any check failed. Run through scripts/gpu_smoke.sh on a fresh machine (it makes
this working tree importable without installing it); ``--cpu`` forces the dry run.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
# the test suite's helpers: gloo ranks in fresh processes (errors shipped to the parent), and
# the relative difference its parity tests use
from dist_utils import max_rel_diff, spawn  # noqa: E402

BACKENDS = ("eager", "aot_eager", "aot_eager_blockbucketing", "aot_eager_autobucketing",
            "inductor", "inductor_blockbucketing", "inductor_autobucketing")
CHECKS = ("parity", "parity_gloo2", "bench", "calibrate")
STEPS = 3
MODEL = dict(name="llama3", flavor="debug", n_layers=2)
BATCH_PER_RANK, SEQ = 2, 64
# relative, on every loss and on each final shard's max |diff| / max |ref| (as tests/test_parity)
TOL = {"inductor": 1e-4, "other": 1e-5}
# what the uncompiled run of a fully sharded model issues; all must work for a reference
NEEDED_OPS = ("all_gather_into_tensor", "reduce_scatter_tensor")


def _tol(backend: str) -> float:
    return TOL["inductor" if backend.startswith("inductor") else "other"]


def _train(backend: str, mesh, device: str, rank: int) -> dict:
    """STEPS steps of ``backend`` ("uncompiled": no torch.compile); losses and local shards."""
    import simplesharded as ss
    from simplesharded.models import build_model, logits_of

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(MODEL["name"], MODEL["flavor"], device="cpu",
                        n_layers=MODEL["n_layers"]).to(device)  # same init on every device
    ss.data_parallel(model, mesh, "fully_shard")
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
    shards = {n: p.to_local().detach().cpu().clone() for n, p in model.named_parameters()}
    torch._dynamo.reset()
    return dict(losses=losses, shards=shards, seconds=time.perf_counter() - t0)


def _compare(results: dict, rank: int) -> list[tuple[str, str, str]]:
    """(status, name, detail) per backend, against results["uncompiled"]."""
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


def _run_backends(mesh, device: str, rank: int, backends) -> dict:
    results = {"uncompiled": _train("uncompiled", mesh, device, rank)}
    for be in backends:
        try:
            results[be] = _train(be, mesh, device, rank)
        except Exception as e:  # reported as this backend's failure; the others still run
            first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
            results[be] = {"error": f"{type(e).__name__}: {first}"[:300]}
    return results


def check_parity(device: str, backends) -> list[tuple[str, str, str]]:
    """One process, the device's own backend (mesh.init_mesh makes a 1-rank group)."""
    import torch.distributed as dist

    import simplesharded as ss
    from simplesharded.mesh import backend_for

    env = dict(os.environ)
    mesh = ss.init_mesh(dp_shard=-1, device=device)  # sets torchrun's variables for rank 0
    try:
        results = _run_backends(mesh, device, 0, backends)
    finally:
        dist.destroy_process_group()
        os.environ.clear()  # the later checks start their own process groups
        os.environ.update(env)
    tag = f"parity[1 rank, {backend_for(device)}] "
    return [(s, tag + be, d) for s, be, d in _compare(results, 0)]


def _gloo2_job(rank: int, world: int, device: str, backends) -> dict:
    import torch.distributed as dist

    from simplesharded.mesh import build_mesh

    if device != "cpu":
        torch.accelerator.set_device_index(0)  # one device: both ranks share it
    # torch's newer names first (the old ones warn)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    for op in NEEDED_OPS:  # can gloo run what the uncompiled reference needs on this device?
        x = torch.ones(4 * world, device=device)
        try:
            if op == "all_gather_into_tensor":
                gather(torch.empty(4 * world * world, device=device), x)
            else:
                scatter(torch.empty(4, device=device), x)
        except Exception as e:  # noqa: BLE001 - the reason is the skip message
            return {"unsupported": f"gloo on {device} cannot run {op}: "
                                   f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    mesh = build_mesh(dp_replicate=1, dp_shard=world, device=device)
    results = _run_backends(mesh, device, rank, backends)
    return {"rows": _compare(results, rank)}


def check_parity_gloo2(device: str, backends) -> list[tuple[str, str, str]]:
    tag = f"parity[2 ranks, gloo on {device}] "
    ranks = spawn(2, _gloo2_job, device, tuple(backends), timeout_s=600)
    skip = next((r["unsupported"] for r in ranks if "unsupported" in r), None)
    if skip:
        return [("SKIP", tag.strip(), skip)]
    return [(s, tag + be, d) for r in ranks for s, be, d in r["rows"]]


def _subprocess(cmd: list[str], timeout_s: int) -> tuple[int, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout_s}s: {' '.join(cmd)}"
    return p.returncode, p.stdout + p.stderr


def check_bench(device: str) -> list[tuple[str, str, str]]:
    cmd = [sys.executable, "-m", "simplesharded.bench", "--device", device,
           "--model", MODEL["name"], "--flavor", MODEL["flavor"], "--seq-len", "128",
           "--variants", "compute_floor", "compute_floor_inductor",
           "--warmup", "2", "--steps", "5", "--reps", "1"]
    rc, out = _subprocess(cmd, 1200)
    table = [ln for ln in out.splitlines() if ln.startswith(("|", "parity", MODEL["name"]))]
    print("\n".join(["$ " + " ".join(cmd[1:])] + table), flush=True)
    failed = rc != 0 or any("| failed:" in ln for ln in table)
    return [("FAIL" if failed else "PASS", f"bench compute floor [{device}]",
             f"exit {rc}" + ("" if table else ": " + out[-1500:]))]


def check_calibrate(device: str) -> list[tuple[str, str, str]]:
    rc, out = _subprocess([sys.executable, "-m", "simplesharded.calibrate", "--force"], 1200)
    print(out[-3000:], flush=True)
    return [("PASS" if rc == 0 else "FAIL", "calibrate (python -m simplesharded.calibrate)",
             f"exit {rc}")]


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="CPU dry run even if a GPU is present")
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    ap.add_argument("--checks", nargs="+", default=list(CHECKS), choices=CHECKS)
    ns = ap.parse_args(argv)
    accelerator = torch.accelerator.current_accelerator()
    device = "cpu" if ns.cpu or accelerator is None else accelerator.type
    if device == "cpu" and not ns.cpu:
        print("no accelerator found: CPU dry run of the same checks with gloo", flush=True)
    torch.set_float32_matmul_precision("highest")  # no TF32: parity is measured in fp32
    print(versions(device), flush=True)
    runs = {"parity": lambda: check_parity(device, ns.backends),
            "parity_gloo2": lambda: check_parity_gloo2(device, ns.backends),
            "bench": lambda: check_bench(device),
            "calibrate": lambda: check_calibrate(device)}
    rows = []
    for name in ns.checks:
        t0 = time.perf_counter()
        print(f"--- {name}", flush=True)
        try:
            got = runs[name]()
        except Exception as e:  # a check that crashes is a failed check, the rest still run
            got = [("FAIL", name, f"{type(e).__name__}: {str(e)[:1500]}")]
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
