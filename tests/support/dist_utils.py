"""Helpers for multi-process tests: spawn gloo ranks on CPU and collect one result per rank.

``spawn(world_size, fn, *args)`` runs ``fn(rank, world_size, *args)`` in ``world_size`` new
processes after a gloo ``init_process_group`` on a free TCP port, and returns ``[result of
rank 0, result of rank 1, ...]``. Results travel back as pickle files; an exception in any
rank is re-raised in the parent as ``RankError`` carrying that rank's traceback (the other
ranks are terminated, so a rank stuck in a collective cannot hang the suite). ``fn`` must be
importable (a module-level function of a test module or of this file).

The ranks are forked from a forkserver that has imported torch and simplesharded once per
test process: a fresh interpreter per rank spent ~2 s of CPU importing them, and the suite
starts a few hundred ranks on two cores. A rank's environment is the parent's at the call,
plus ``BASE_ENV`` (also the server's own environment, for what torch reads when imported);
``spawn(..., env=...)`` starts fresh interpreters instead, for variables read when a process
starts (glibc's malloc tunables) that a fork would not apply, and so does a machine with an
accelerator, whose ranks could not use it if forked (see ``_spawn_once``).
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import os
import pickle
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessException

from simplesharded.mesh import exit_rank, spawn_local
from simplesharded.shims import gloo_gather

# Environment every rank starts with: one thread per rank (2 cores are shared by up to 4
# ranks). Inductor: its FX-graph and AOT-autograd caches are off (a cached graph would skip our
# post-grad passes in these tests), but the compiled-kernel cache stays on in a private directory
# shared by every rank of the session: kernels are keyed by their source and built under a
# file lock, so ranks compiling identical kernels build each once (halves inductor compile
# time here versus TORCHINDUCTOR_FORCE_DISABLE_CACHES=1, which gives every compile a fresh dir).
BASE_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
            "TORCHINDUCTOR_COMPILE_THREADS": "1"}
_SESSION_CACHE: list[str] = []


def _session_cache_dir() -> str:
    """The spawned ranks' inductor cache: the test session's (tests/conftest.py, shared by all
    its workers), else one made for this process."""
    if os.environ.get("SIMPLESHARDED_TEST_INDUCTOR_CACHE"):
        return os.environ["SIMPLESHARDED_TEST_INDUCTOR_CACHE"]
    if not _SESSION_CACHE:
        d = tempfile.mkdtemp(prefix="ss_inductor_cache_")
        atexit.register(shutil.rmtree, d, ignore_errors=True)
        _SESSION_CACHE.append(d)
    return _SESSION_CACHE[0]


class RankError(RuntimeError):
    """A spawned rank raised; the message holds its rank and traceback."""


def _entry(rank: int, world_size: int, outdir: str, timeout_s: float,
           fn: Callable, args: tuple, environ: dict[str, str] | None = None) -> None:
    if environ is not None:  # forked from the server: the caller's environment, not its
        os.environ.clear()
        os.environ.update(environ)
    faulthandler.enable()  # a rank killed by a signal prints its Python stacks to stderr
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    path = os.path.join(outdir, f"rank{rank}.pkl")

    def error(e: BaseException):  # stamped when raised: the earliest is the likely cause
        return ("error", (time.time(), f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        # gloo's plain all-gather, as data_parallel installs on a gloo mesh: a test that
        # gathers DTensors before (or without) data_parallel must not run torch's coalesced
        # CPU kernel (simplesharded/shims/gloo_gather.py)
        gloo_gather.install()
        try:
            result = ("ok", fn(rank, world_size, *args))
        except BaseException as e:  # noqa: BLE001 - shipped to the parent, which re-raises
            result = error(e)
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        result = error(e)
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)
    exit_rank(1 if result[0] == "error" else 0)  # gloo outlives destroy_process_group


def spawn(world_size: int, fn: Callable, *args, timeout_s: float = 300.0,
          env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results by rank.

    ``timeout_s`` bounds every collective (gloo timeout) and, plus a minute, the whole job.
    Retried once if the free port was taken by someone else before rank 0 bound it.
    """
    try:
        return _spawn_once(world_size, fn, args, timeout_s, env)
    except RankError as e:
        if "address already in use" not in str(e).lower():
            raise
        return _spawn_once(world_size, fn, args, timeout_s, env)


# What the forkserver imports before it forks any rank (a module it cannot import is skipped):
# what most ranks import, the compiler's (aot_autograd, inductor's entry) included, so that a
# rank does not pay ~1 s of imports at its first compile.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo",
            "torch._functorch.aot_autograd", "torch._inductor.compile_fx",
            "simplesharded", "simplesharded.passes", "simplesharded.models",
            "simplesharded.tools.forecast", "simplesharded.trainer", "dist_utils"]


def start_forkserver() -> None:
    """Start this process's forkserver with ``BASE_ENV`` and ``_PRELOAD`` (once it runs, only
    check that it still does). A process has one forkserver, whoever asks first: the ranks
    and the planner's trace children (simplesharded/tools/forecast.py) share it, so the test
    session starts it before any test can, with the ranks' environment."""
    from simplesharded.shims import forkserver

    forkserver.start(BASE_ENV, _PRELOAD)


def _forked(world_size, entry_args, env):
    """Start the ranks from the forkserver (:func:`start_forkserver`)."""
    import torch.multiprocessing as mp

    from simplesharded.mesh import free_port

    start_forkserver()
    environ = {**os.environ, **env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    return mp.start_processes(_entry, args=(*entry_args, environ), nprocs=world_size,
                              join=False, start_method="forkserver")


def _spawn_once(world_size, fn, args, timeout_s, env):
    # Fresh interpreters where an accelerator is present: torch refuses CUDA in a process
    # forked after its parent counted the devices, which the server did importing inductor
    # (torch.cuda.is_available() in torch/_inductor/runtime/benchmarking.py)
    fresh = env is not None or torch.accelerator.is_available()
    env = {**BASE_ENV, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="ss_spawn_") as outdir:
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", _session_cache_dir())
        entry_args = (world_size, outdir, timeout_s, fn, args)
        ctx = (spawn_local(_entry, world_size, entry_args, join=False, env=env) if fresh
               else _forked(world_size, entry_args, env))
        deadline = time.monotonic() + timeout_s + 60
        failure = None
        try:
            while True:
                try:
                    if ctx.join(timeout=1.0):
                        break
                except ProcessException as e:  # a rank died; others are terminated by join
                    failure = e
                    break
                if time.monotonic() > deadline:
                    failure = TimeoutError(f"spawn({world_size}, {fn.__name__}) timed out")
                    break
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
                    p.join(5)
        results, errors = [], []
        for rank in range(world_size):
            path = os.path.join(outdir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append((value[0], f"--- rank {rank} ---\n{value[1]}"))
            results.append(value if status == "ok" else None)
        if errors:  # earliest first: later ones are usually peers losing their connection
            raise RankError(f"{len(errors)} of {world_size} ranks of {fn.__name__} raised "
                            "(earliest first):\n" + "\n".join(e for _, e in sorted(errors)))
        if failure is not None:
            raise RankError(f"{fn.__name__}: {failure}")
        return results


def build_mesh_for(world_size: int, mode: str):
    """The data-parallel mesh a mode runs on: 2-D (2, world/2) for hybrid_shard, else 1-D."""
    from simplesharded.mesh import build_mesh
    if mode == "hybrid_shard":
        return build_mesh(dp_replicate=2, dp_shard=world_size // 2, device="cpu")
    return build_mesh(dp_replicate=1, dp_shard=world_size, device="cpu")


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a-b| / max(max|b|, tiny): one relative number per tensor."""
    a, b = a.detach().double(), b.detach().double()
    if a.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def memo(fn: Callable) -> Callable:
    """Cache ``fn``'s result *or exception* per arguments, so tests sharing one spawned job
    spawn it once even when it fails."""
    cache: dict = {}

    def wrapper(*args):
        if args not in cache:
            try:
                cache[args] = (True, fn(*args))
            except Exception as e:  # noqa: BLE001 - re-raised for every caller
                cache[args] = (False, e)
        ok, value = cache[args]
        if not ok:
            raise value
        return value

    wrapper.__name__ = fn.__name__
    return wrapper


def storage_and_backend(case: str) -> tuple[str, str]:
    """A case's ``"storage:backend"`` → (``storage``, backend). The storage is empty
    (per-parameter shards: ``"param"``) or ``ragged`` (ragged buckets)."""
    storage, _, backend = case.rpartition(":")
    return {"": "param", "ragged": "ragged"}[storage], backend


def ragged_buckets(model) -> dict[str, int]:
    """Ragged bucket name → how many parameters it holds (storage="ragged")."""
    from simplesharded.storage.ragged_shards import model_buckets

    return {bucket.name: len(bucket.fqns) for bucket in model_buckets(model)}


def by_member(model, grads: bool = False) -> dict:
    """Each parameter (or its gradient) by FQN as a full tensor, ragged buckets' members
    through their per-parameter shards (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    from simplesharded.storage.ragged_shards import model_buckets

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    buckets = list(model_buckets(model))
    members = {fqn for b in buckets for fqn in b.fqns}
    out = {n: full(p.grad if grads else p) for n, p in model.named_parameters()
           if n not in members}
    for b in buckets:
        values = b.shards_of_runs([m.grad for m in b.members]) if grads else b.member_shards()
        out.update({fqn: full(v) for fqn, v in zip(b.fqns, values)})
    return out


@contextlib.contextmanager
def world_of_one():
    """This process as a gloo world of one rank (an in-memory store), its 1-D CPU mesh; the
    group is destroyed and dynamo reset on the way out."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    assert not dist.is_initialized(), "another test left a process group initialised"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def shared_tmpdir() -> str:
    """A fresh directory made by rank 0, its path on every rank (a DCP checkpoint's)."""
    import tempfile

    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    return path[0]


def optim_state_through_dcp(src: tuple, dst: tuple) -> bool:
    """``src`` = (model, optimizer)'s state saved with DCP, loaded into ``dst``'s (zeroed
    first) through torch's optimizer state-dict API: equal, state by state, by name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    (src_model, src_opt), (dst_model, dst_opt) = src, dst
    path = shared_tmpdir()
    dcp.save({"optim": get_optimizer_state_dict(src_model, src_opt)}, checkpoint_id=path)
    for state in dst_opt.state.values():
        for v in state.values():
            v.zero_()
    loaded = {"optim": get_optimizer_state_dict(dst_model, dst_opt)}
    dcp.load(loaded, checkpoint_id=path)
    set_optimizer_state_dict(dst_model, dst_opt, loaded["optim"])
    names = {id(p): n for n, p in dst_model.named_parameters()}
    want = {n: src_opt.state[p] for n, p in src_model.named_parameters()}

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    return all(torch.equal(full(v), full(want[names[id(p)]][k]))
               for p, state in dst_opt.state.items() for k, v in state.items())


def full_state_through_torch(src: tuple, dst: tuple, broadcast: bool) -> dict:
    """FSDP2's full-checkpoint round trip: ``src`` = (model, optimizer)'s full state dicts
    from torch's ``get_model_state_dict`` / ``get_optimizer_state_dict``
    (``full_state_dict=True``; with ``broadcast``, ``cpu_offload=True``: rank 0 alone holds
    them) loaded into ``dst``'s, zeroed first, with ``set_model_state_dict`` /
    ``set_optimizer_state_dict`` (``broadcast_from_rank0=broadcast``), then one step of each
    on the same batch. Whether the parameters and the optimizer states are equal by name
    after the load and after the step, and the type of each ``dst`` state."""
    import copy

    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)

    import toy_blocks

    (src_model, src_opt), (dst_model, dst_opt) = src, dst
    save = StateDictOptions(full_state_dict=True, cpu_offload=broadcast)
    load = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    # a copy, as a file would give: torch hands back a state's `step` tensor itself
    model_sd = copy.deepcopy(get_model_state_dict(src_model, options=save))
    optim_sd = copy.deepcopy(get_optimizer_state_dict(src_model, src_opt, options=save))
    assert bool(model_sd) == (not broadcast or dist.get_rank() == 0)
    with torch.no_grad():
        for p in dst_model.parameters():
            p.zero_()
        for state in dst_opt.state.values():
            for v in state.values():
                v.zero_()
    set_model_state_dict(dst_model, model_sd, options=load)
    set_optimizer_state_dict(dst_model, dst_opt, optim_sd, options=load)

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def same() -> bool:
        names = {id(p): n for n, p in dst_model.named_parameters()}
        want = {n: (p, src_opt.state[p]) for n, p in src_model.named_parameters()}
        return all(torch.equal(full(p), full(want[names[id(p)]][0]))
                   and all(torch.equal(full(v), full(want[names[id(p)]][1][k]))
                           for k, v in dst_opt.state[p].items())
                   for p in dst_model.parameters())

    kinds = sorted({type(v).__name__ for s in dst_opt.state.values() for v in s.values()})
    loaded = same()
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = [toy_blocks.train(m, o, rank, world, 1)
              for m, o in ((src_model, src_opt), (dst_model, dst_opt))]
    return dict(loaded=loaded, stepped=losses[0] == losses[1] and same(), kinds=kinds)
