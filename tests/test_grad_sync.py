"""set_requires_gradient_sync / no_gradient_sync (simplesharded/storage/grad_sync.py) and the trainer's
``training.gradient_sync = "last_microbatch"``: gradient accumulation with one reduction per
step.

One spawn of 2 gloo ranks runs every case (``_job``) and the tests read its results:
- the knob on the toy model: a no-sync backward runs no reduction (eager: no collective at
  all, the process group's sequence number does not move) and leaves every shard's ``.grad``
  None; the sync backward after it runs the reductions of one synced backward and gives the
  ``.grad`` of two synced backwards. Eager with sum and avg, tied weights, mixed precision
  (bf16 reduce; bf16 param + fp32 reduce; bf16 both); compiled with block bucketing (tied,
  avg): one reduction per bucket, and no-sync and sync-with-pending are two graphs, compiled
  once each (the second time through the root's ``set_requires_gradient_sync`` method, as
  FSDP2 users call it). The sums are kept in the reduction's dtype (bf16 under a bf16
  ``reduce_dtype``).
- the trainer on llama3 debug (in-process, eager, 5 steps, global batch 8): 4 micro-batches
  with ``last_microbatch`` against 1 micro-batch: the same losses and the same reductions per
  step, counted at runtime by the profiler (gloo events).

In this process, a gloo world of one rank (no spawn): the accumulators' dtype under each mixed
precision policy, per-parameter shards and ragged buckets, eager (and compiled for bf16), with
the sync backward or a pipeline stage's deferred reduction finishing the step.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import os

import pytest
import torch
import torch.distributed as dist

import toy
from dist_utils import max_rel_diff, spawn, world_of_one

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 5
# Toy cases: (name, backend, grad_reduction, (param_dtype, reduce_dtype) or None, tied).
TOY_CASES = [
    ("eager_sum", "eager", "sum", None, False),
    ("eager_avg_tied", "eager", "avg", None, True),
    ("eager_reduce_bf16", "eager", "sum", (None, torch.bfloat16), False),
    ("eager_param_bf16", "eager", "avg", (torch.bfloat16, torch.float32), True),
    ("eager_bf16", "eager", "avg", (torch.bfloat16, torch.bfloat16), False),
    ("blockbucketing_avg_tied", "aot_eager_blockbucketing", "avg", None, True),
]


def _gloo_events(fn) -> dict[str, int]:
    """Collectives this rank's gloo backend ran during ``fn()``, by profiler event name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return dict(collections.Counter(e.name for e in prof.events() if e.name.startswith("gloo:")))


def _reductions(events: dict[str, int]) -> int:
    """Everything but gathers: reduce-scatters (gloo: all-reduce, or all-to-all once our
    bucketing lowers them) and all-reduces."""
    return sum(n for name, n in events.items() if "gather" not in name)


def _toy_case(rank, world, mesh, backend, reduction, mp, tied):
    """Two micro-batches on one model: synced both times, uncompiled (the reference), then
    no-sync + sync, twice, on ``backend``. Returns what the backwards did and the gradient
    errors."""
    import simplesharded as ss
    from simplesharded.sharding import MixedPrecisionPolicy
    from simplesharded.storage.sharded_state import root_state

    from torch._dynamo.utils import counters

    pg = dist.distributed_c10d._get_default_group()
    policy = None if mp is None else MixedPrecisionPolicy(*mp)
    model = ss.data_parallel(toy.make_model(tied=tied), mesh, grad_reduction=reduction,
                             mp_policy=policy, storage="param")
    run = model if backend == "eager" else torch.compile(
        model, backend=ss.make_backend(backend), fullgraph=True)
    numel = world * toy.BATCH_PER_RANK * toy.D_OUT
    batches = [toy.rank_batch(rank, i) for i in range(2)]

    def grads():
        return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}

    out = {"ref_reductions": []}
    for x, y in batches:  # reference, uncompiled (one compile less): both backwards reduce
        loss = toy.loss_fn(model(x), y, numel)
        out["ref_reductions"].append(_reductions(_gloo_events(loss.backward)))
    want = grads()
    graphs0 = counters["stats"]["unique_graphs"]
    model.zero_grad(set_to_none=True)
    @contextlib.contextmanager
    def fsdp2_method():  # FSDP2's way: the root's method, here through the compiled wrapper
        run.set_requires_gradient_sync(False)
        yield
        run.set_requires_gradient_sync(True)

    for repeat in range(2):  # twice: the second time must reuse the graphs of the first
        # the compiled wrapper is accepted too; the second time through FSDP2's method
        with ss.no_gradient_sync(run) if repeat == 0 else fsdp2_method():
            loss = toy.loss_fn(run(batches[0][0]), batches[0][1], numel)
            seq = pg._get_sequence_number_for_group()
            events = _gloo_events(loss.backward)
            gathers = sum(events.values()) - _reductions(events)
            sums = root_state(model)[1].grad_sync.acc.values()
            for key, value in (("nosync_other_collectives",
                                pg._get_sequence_number_for_group() - seq - gathers),
                               ("nosync_reductions", _reductions(events)),
                               ("grad_none", all(p.grad is None for p in model.parameters())),
                               ("sum_dtypes", {leaf.grad.dtype for leaf in sums})):
                out.setdefault(key, []).append(value)
        x, y = batches[1]
        loss = toy.loss_fn(run(x), y, numel)
        out.setdefault("sync_reductions", []).append(_reductions(_gloo_events(loss.backward)))
        got = grads()
        out[f"err{repeat}"] = max(max_rel_diff(got[n], want[n]) for n in want)
        out[f"graphs{repeat}"] = counters["stats"]["unique_graphs"] - graphs0
        model.zero_grad(set_to_none=True)
    out["n_params"] = len(list(model.parameters()))
    return out


def _trainer_run(world, accumulation, sync):
    """STEPS steps of the trainer (eager) on llama3 debug: losses and the last step's gloo
    events."""
    from simplesharded.storage.ragged_shards import model_buckets
    from simplesharded.trainer import Trainer, check_static
    from simplesharded.trainer.config import load_config

    args = ["--training.seq_len", "32", "--training.global_batch_size", "8",
            "--training.steps", str(STEPS), "--training.val_every", "0",
            "--no-metrics.progress_bar", "--training.gradient_accumulation_steps",
            str(accumulation), "--training.gradient_sync", sync]
    cfg = check_static(load_config(os.path.join(ROOT, "configs", "llama3_debug.toml"), args),
                       world)
    trainer = Trainer(cfg, "cpu")
    # one reduction per ragged bucket (the trainer's default storage), and per other parameter
    buckets = list(model_buckets(trainer.model))
    members = sum(len(b.fqns) for b in buckets)
    out = {"losses": [], "reduced": len(trainer.params) - members + len(buckets)}
    for step in range(STEPS):
        if step == STEPS - 1:  # the profiler costs more than the eager step: one step
            out["events"] = _gloo_events(lambda: out["losses"].append(
                trainer.train_step()["loss"]))
        else:
            out["losses"].append(trainer.train_step()["loss"])
        trainer.step += 1
    return out


def _job(rank, world):
    from simplesharded.mesh import build_mesh

    mesh = build_mesh(dp_replicate=1, dp_shard=world, device="cpu")
    out = {name: _toy_case(rank, world, mesh, *case) for name, *case in TOY_CASES}
    out["trainer"] = {name: _trainer_run(world, acc, sync) for name, acc, sync in (
        ("acc1", 1, "every_microbatch"), ("acc4_last", 4, "last_microbatch"))}
    return out


@functools.lru_cache(maxsize=None)
def _results():
    return spawn(2, _job, timeout_s=900)


@pytest.mark.parametrize("case", [c[0] for c in TOY_CASES])
def test_no_sync_backward_reduces_nothing_and_sync_reduces_the_sum(case):
    """No-sync backward: no reduction, only the re-gathers of resharded parameters (eager: no
    other collective at all, by the group's sequence number), every ``.grad`` None. The sync backward after it: the
    reductions of one synced backward (eager: one per parameter, the tied weight once;
    compiled: one per bucket) and the gradients of two synced backwards, ≤ 1e-6 relative in
    fp32 (the sums differ in order only); with bf16 in the gradient's path both are
    bf16-rounded differently (observed ≤ 9e-3 apart; a missing or doubled micro-batch is O(1)).
    Twice in a row, so the state left by the first round is clean."""
    for rank, res in enumerate(_results()):
        r = res[case]
        tol = 2e-2 if "bf16" in case else 1e-6
        assert r["nosync_reductions"] == [0, 0] and r["grad_none"] == [True, True], (rank, r)
        assert r["ref_reductions"] == [r["n_params"]] * 2, (rank, r)
        if case.startswith("eager"):
            assert r["nosync_other_collectives"] == [0, 0], (rank, r)
            assert r["sync_reductions"] == [r["n_params"]] * 2, (rank, r)
        else:  # buckets: input layer, 4 blocks, head
            assert r["sync_reductions"] == [toy.N_BLOCKS + 2] * 2, (rank, r)
        assert r["err0"] <= tol and r["err1"] <= tol, (rank, r)


@pytest.mark.parametrize("case", [c[0] for c in TOY_CASES])
def test_no_sync_sums_are_kept_in_the_reduction_dtype(case):
    """The accumulators' sums are in the dtype the sync backward reduces in: reduce_dtype,
    else param_dtype, else the parameter's own (fp32)."""
    (mp,) = [c[3] for c in TOY_CASES if c[0] == case]
    want = (mp[1] or mp[0]) if mp is not None else torch.float32
    for rank, res in enumerate(_results()):
        assert res[case]["sum_dtypes"] == [{want}] * 2, (rank, res[case]["sum_dtypes"])


def test_compiled_modes_are_separate_graphs_compiled_once():
    """Compiled: no-sync and sync (with the pending gradients as inputs) are two graphs, and
    the second round of no-sync + sync compiles nothing new (guards select them)."""
    for rank, res in enumerate(_results()):
        r = res["blockbucketing_avg_tied"]
        assert (r["graphs0"], r["graphs1"]) == (2, 2), (rank, r)


def test_trainer_last_microbatch_reduces_once_per_step():
    """llama3 debug, global batch 8 on 2 ranks, 5 steps: 4 micro-batches with last_microbatch
    give the losses of 1 micro-batch within 1e-5 relative, and a step (the last, profiled)
    runs the same reductions: one per ragged bucket or other parameter, plus the trainer's 2
    scalar all-reduces (grad norm, loss), where every_microbatch (the default) would run
    them once per micro-batch."""
    for rank, res in enumerate(_results()):
        runs = res["trainer"]
        ref, last = runs["acc1"], runs["acc4_last"]
        errs = [abs(a - b) / abs(b) for a, b in zip(last["losses"], ref["losses"])]
        assert len(errs) == STEPS and max(errs) <= 1e-5, (rank, last["losses"], ref["losses"])
        n = ref["reduced"]
        assert _reductions(ref["events"]) == n + 2, (rank, ref["events"])
        assert _reductions(last["events"]) == n + 2, (rank, last["events"])


# (param_dtype, reduce_dtype) or None → the dtype the no-sync sums are kept in
SUM_DTYPES = [(None, torch.float32),
              ((torch.bfloat16, torch.bfloat16), torch.bfloat16),
              ((torch.bfloat16, torch.float32), torch.float32),
              ((torch.bfloat16, None), torch.bfloat16),
              ((None, torch.bfloat16), torch.bfloat16)]


def _one_rank_sums(mesh, storage, mp, backend, finish):
    """Three micro-batches of the toy model on one rank: synced each (the reference), then two
    no-sync and a third finished by the sync backward (``finish="sync"``) or, no-sync too, by
    a pipeline stage's deferred reduction. The sums' dtypes and bytes after the two no-sync
    backwards, and the largest relative gradient error."""
    import simplesharded as ss
    from simplesharded.storage.deferred_reduce import reduce_accumulated
    from simplesharded.storage.ragged_shards import model_buckets
    from simplesharded.storage.sharded_state import root_state

    torch._dynamo.reset()
    policy = None if mp is None else ss.MixedPrecisionPolicy(*mp)
    model = ss.data_parallel(toy.make_model(), mesh, mp_policy=policy, storage=storage)
    assert bool(list(model_buckets(model))) == (storage == "ragged")
    run = model if backend == "eager" else torch.compile(
        model, backend=ss.make_backend(backend), fullgraph=True)
    batches = [toy.rank_batch(0, i) for i in range(3)]
    numel = 3 * toy.BATCH_PER_RANK * toy.D_OUT

    def backward(i):
        toy.loss_fn(run(batches[i][0]), batches[i][1], numel).backward()

    def grads():
        return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}

    for i in range(3):
        backward(i)
    want = grads()
    model.zero_grad(set_to_none=True)
    ss.set_requires_gradient_sync(run, False)
    backward(0)
    backward(1)
    sums = [leaf.grad for leaf in root_state(model)[1].grad_sync.acc.values()]
    out = {"dtypes": {g.dtype for g in sums},
           "bytes": sum(g.numel() * g.element_size() for g in sums)}
    if finish == "sync":
        ss.set_requires_gradient_sync(run, True)
        backward(2)
    else:
        backward(2)
        reduce_accumulated(model)
        ss.set_requires_gradient_sync(run, True)
    got = grads()
    out["err"] = max(max_rel_diff(got[n], want[n]) for n in want)
    return out


@pytest.mark.parametrize("storage", ["param", "ragged"])
def test_sums_in_the_reduction_dtype_one_rank(storage):
    """One rank, per-parameter shards or ragged buckets: the no-sync sums are kept in
    reduce_dtype, else param_dtype, else the shard's dtype (FSDP2's rule); bf16 sums take half
    the bytes of fp32 ones. The accumulated step's gradients against the synced one's: bit for
    bit without mixed precision (the same sums in the same order); with bf16 in the path within
    2e-2 relative (observed ≤ 6e-3; a missing or doubled micro-batch is O(1)), both for the sync
    backward and the deferred reduction. Compiled (block bucketing), bf16 sums too."""
    with world_of_one() as mesh:
        runs = {(mp, finish): _one_rank_sums(mesh, storage, mp, "eager", finish)
                for mp, _ in SUM_DTYPES for finish in ("sync", "deferred")}
        bf16 = (torch.bfloat16, torch.bfloat16)
        compiled = _one_rank_sums(mesh, storage, bf16, "aot_eager_blockbucketing", "sync")
    fp32_bytes = runs[(None, "sync")]["bytes"]
    for (mp, finish), r in runs.items():
        dtype = dict(SUM_DTYPES)[mp]
        assert r["dtypes"] == {dtype}, (mp, finish, r)
        assert r["bytes"] == fp32_bytes * dtype.itemsize // 4, (mp, finish, r)
        assert r["err"] == 0 if mp is None else r["err"] <= 2e-2, (mp, finish, r)
    assert compiled["dtypes"] == {torch.bfloat16} and compiled["err"] <= 2e-2, compiled
