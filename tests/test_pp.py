"""Pipeline parallelism composed with FSDP on 4 gloo ranks (pp 2 x dp_shard 2): parity with one
process, the FSDP policies' reductions, the trainer.

A small Llama 3 (4 blocks) is cut into stages (simplesharded/pipeline/stage_split.py: 2 for 1F1B, 4 for
the interleaved and V schedules, one or two per rank), each stage sharded by ``data_parallel``
over the dp ranks of its pp coordinate and compiled or not, and trained for 5 SGD steps by
torch's schedule (simplesharded/pipeline/pipelining.py) on the same global batch as a one-process
reference: each dp rank takes its rows, split into 4 micro-batches of one sequence; the loss is
the summed cross-entropy over the global token count, computed on the last stage. Losses (the
same on every rank; the 5 steps' and a forward-only one after them, through the schedule's
``eval`` as the trainer validates: every eager case and one compiled one) and the final
parameters (gathered to full tensors) must agree to 1e-5 relative: a missing, doubled or
misplaced micro-batch gradient, a reduction over the wrong ranks or a stage fed the wrong
activations is an O(1) error.

Schedules ``1F1B``, ``Interleaved1F1B`` and ``ZBVZeroBubble`` (split backward: its weight part
runs on the rank-local accumulators under reduce_once, on the shards otherwise; compiled, one
node computes both); backends eager and ``aot_eager_blockbucketing``; policies
``every_microbatch``, ``reduce_once`` and ``gather_once``: 1F1B runs every policy eager and the
two not compiled elsewhere compiled, each other schedule every backend and, between them, every
policy (so every policy meets every backend; and gather_once with 2 micro-batches a step, 1F1B,
eager; ragged buckets in two cases, and offloaded to the host in two more). The last step of
each runs under torch.profiler, which counts the gradient reductions and the parameter gathers
the process groups ran (gloo's reduce-scatter, all-to-all or all-reduce calls; its all-gathers:
eager, compiled and lowered ones alike): reduce_once and gather_once must run exactly one
reduction per stage and step, every_microbatch at least one per micro-batch and stage;
gather_once exactly one gather per bucket and stage and step, whatever the number of micro-batches,
the others at least one per micro-batch and stage.

The trainer runs in the same job (eager, llama3 debug): pp 2 gives the losses and validation
loss of the same run without pp, pp 2 x tp 2 (two stages per rank) those of the run on one
process (gather_once), pp 2 with host offload those of pp 2 without it, bit for bit, and a
checkpoint pp 2 saves loads into a run without pp and into one at pp 2 x tp 2 (the FQN-keyed
DCP checkpoint reshards across pp and tp degrees). Context parallelism in the stages (pp 2 x cp
2, eager): the losses and validation loss of the run without either, each stage's K/V gathers
over its cp group (counted as they are issued), and the pp group joining the ranks of one cp
index.

One spawn of 4 ranks runs it all (the mesh is built once per rank: DTensor reuses a cached
plan of an equal mesh built earlier, whose groups would not be the ones data_parallel
annotated, and the passes would leave those collectives alone); the tests read its results.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_utils import max_rel_diff, memo, spawn
from simplesharded.passes.torch_compat import CONTEXT_PARALLEL, has
from torch_range import needs_torch

pytestmark = pytest.mark.slow

ARGS = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32)
GLOBAL_BATCH, SEQ, STEPS, PP, MICROBATCHES = 8, 16, 5, 2, 4
# SGD, as tests/test_ep.py. At lr 0.1 five steps amplify fp32 rounding to 1e-5 in the embedding
# (every_microbatch); so does one process summing 8 micro-batches against its whole batch, 5.8e-6,
# and in float64 the same comparison gives 3.5e-13: rounding. At 0.05 the largest is 7.5e-7.
SGD = dict(lr=0.05)
TOL = 1e-5
SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
BACKENDS = ("eager", "aot_eager_blockbucketing")
POLICIES = ("reduce_once", "every_microbatch", "gather_once")
# 1F1B runs every policy eager, and compiled those no other schedule compiles; the other
# schedules run each backend once, the policies spread over them, so every schedule meets
# every backend and every policy, and every policy every backend (the suite's time).
CASES = [("1F1B", "eager", p) for p in POLICIES] + [
    ("1F1B", "aot_eager_blockbucketing", p) for p in ("reduce_once", "every_microbatch")] + [
    ("Interleaved1F1B", "eager", "every_microbatch"),
    ("Interleaved1F1B", "aot_eager_blockbucketing", "gather_once"),
    ("ZBVZeroBubble", "eager", "gather_once"),
    ("ZBVZeroBubble", "aot_eager_blockbucketing", "reduce_once")]
# gather_once with 2 micro-batches a step (of two sequences): its gathers must not change
# (held parameters are the pipeline's business, not the compiler's: eager shows it)
FEWER = [("1F1B", "eager", "gather_once", 2)]
# Ragged buckets (storage="ragged") in the stages: a stage's deferred reduction and
# gather_once act per bucket (eager 1F1B holding, compiled ZBV's split backward reducing once)
RAGGED = [("1F1B", "eager", "gather_once", MICROBATCHES, "ragged"),
          ("ZBVZeroBubble", "aot_eager_blockbucketing", "reduce_once", MICROBATCHES, "ragged")]
# Host offload of the ragged buckets (simplesharded/storage/offload.py) in the stages:
# gather_once's held gather reads the resident copy, which must hold the last step's host shard
# before the forward's pre-hook refreshes it ("optimizer"); compiled, each micro-batch's graphs
# copy the shards in and the reduced gradients out ("params")
OFFLOADED = [("1F1B", "eager", "gather_once", MICROBATCHES, "ragged", "optimizer"),
             ("Interleaved1F1B", "aot_eager_blockbucketing", "every_microbatch", MICROBATCHES,
              "ragged", "params")]
ALL = CASES + FEWER + RAGGED + OFFLOADED
# The forward-only pass after training (the schedule's eval, as the trainer validates) runs in
# every eager case and in one compiled one: compiled, it is one more (inference) compile per
# stage, the same in every case.
EVALUATED = {c for c in CASES + FEWER if c[1] == "eager"} | {
    ("1F1B", "aot_eager_blockbucketing", "reduce_once")}
# what the process groups run for a gradient reduction on gloo: a reduce-scatter (eager
# DTensor: coalesced; deferred_reduce on other transports), its lowering to an all-to-all
# (compiled, and deferred_reduce), an all-reduce (replicated gradients)
REDUCTIONS = ("c10d::reduce_scatter_tensor_coalesced_", "c10d::_reduce_scatter_base_",
              "c10d::alltoall_base_", "c10d::allreduce_")
# and for a parameter gather: eager DTensor's, the compiled (functional) one, gather_once's
GATHERS = ("c10d::allgather_", "c10d::_allgather_base_", "c10d::allgather_coalesced_",
           "c10d::allgather_into_tensor_coalesced_")


def make_model():
    from simplesharded.models import build_model

    torch.manual_seed(0)
    return build_model("llama3", "debug", device="cpu", **ARGS)


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, ARGS["vocab_size"], (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits, labels):
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                           reduction="sum") / (GLOBAL_BATCH * SEQ)


@memo
def reference():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), **SGD)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        x, y = batch(STEPS)
        losses.append(loss_fn(model(x), y).item())  # the trained model's: validation's
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _case(mesh, schedule: str, backend: str, policy: str, microbatches: int = MICROBATCHES,
          storage: str = "param", offload: str = "none", *, evaluate: bool) -> dict:
    import simplesharded as ss
    from simplesharded.passes import agreement
    from simplesharded.pipeline.pipelining import pipeline, pipeline_peers
    from simplesharded.storage.ragged_shards import model_buckets

    torch._dynamo.reset()
    dp, dp_rank = mesh.size(1), mesh.get_local_rank(1)
    rows = GLOBAL_BATCH // dp
    mb = rows // microbatches

    def prepare(stage):
        ss.data_parallel(stage, mesh, grad_reduction="sum",  # loss_fn: global token count
                         storage=storage, offload=offload)
        if backend == "eager":
            return stage
        return torch.compile(stage, backend=ss.make_backend(backend), fullgraph=True)

    hidden = torch.empty(mb, SEQ, ARGS["dim"], device="meta")
    pipe = pipeline(make_model(), mesh, schedule=schedule, n_microbatches=microbatches,
                    loss_fn=loss_fn, prepare=prepare, policy=policy, hidden=hidden,
                    microbatch=torch.empty(mb, SEQ, dtype=torch.long, device="meta"),
                    output=torch.empty(mb, SEQ, ARGS["vocab_size"], device="meta"))
    opt = torch.optim.SGD(pipe.model.parameters(), **SGD)
    losses, reductions, gathers = [], None, None
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows]
        opt.zero_grad(set_to_none=True)
        if step == STEPS - 1:
            with torch.profiler.profile() as prof:
                out = pipe.step(x, y)
            reductions = sum(e.name in REDUCTIONS for e in prof.events())
            gathers = sum(e.name in GATHERS for e in prof.events())
        else:
            out = pipe.step(x, y)
        opt.step()
        total = torch.stack(out).sum().detach() if out else torch.zeros(())
        dist.all_reduce(total)  # the last stage's ranks hold the losses
        losses.append(total.item())
    if evaluate:  # forwards only: the schedule's eval, as the trainer validates
        with torch.no_grad():
            x, y = batch(STEPS)
            out = pipe.evaluate(x[dp_rank * rows:(dp_rank + 1) * rows],
                                y[dp_rank * rows:(dp_rank + 1) * rows])
            total = torch.stack(out).sum() if out else torch.zeros(())
            dist.all_reduce(total)
            losses.append(total.item())
    from torch.distributed.tensor import DTensor

    # per parameter as without ragged buckets: the state dict converts them (collectives)
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for n, p in (pipe.model.state_dict().items() if storage == "ragged"
                           else pipe.model.named_parameters())}
    return {"losses": losses, "params": params if dp_rank == 0 else {},
            "stages": [s.stage_index for s in pipe.stages],
            "deferred": [s.reductions for s in pipe.stages], "reductions": reductions,
            "held": [s.gathers for s in pipe.stages], "gathers": gathers,
            # gather_once's buckets: the stage's parameters sharded alike (placements, dtype),
            # or its ragged buckets (one collective each)
            "buckets": [len({(p.placements, p.dtype) for p in s.root.parameters()})
                        if storage != "ragged" else len(list(model_buckets(s.root)))
                        for s in pipe.stages],
            "peers": (agreement._PEERS[0], tuple(pipeline_peers(mesh)))}


TRAINER_BLOCKS = 4
TRAINER = ["--training.seq_len", "32", "--training.global_batch_size", "8",
           "--no-metrics.progress_bar", "--no-compile.enable", "--training.val_every", "100",
           "--training.val_steps", "1", "--lr_scheduler.warmup_steps", "15",
           "--lr_scheduler.decay_type", "constant",
           # 4 of llama3 debug's 6 blocks: Interleaved1F1B's 4 stages take one each
           "--model.n_layers", str(TRAINER_BLOCKS)]
TRAINER_RUNS = {  # name → (steps, arguments); the folder is per test session
    # saves at step 2 (and at its last, 3), run on to step 3
    "pp2": (3, ["--parallelism.pipeline_parallel_degree", "2", "--checkpoint.enable",
                "--checkpoint.interval", "2"]),
    "resumed_pp1": (3, ["--checkpoint.enable", "--checkpoint.load_step", "2"]),
    "pp1": (3, []),
    # tensor parallelism inside the stages (sequence parallel, loss parallel), two per rank
    "pp2_tp2": (3, ["--parallelism.pipeline_parallel_degree", "2",
                    "--parallelism.tensor_parallel_degree", "2",
                    "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                    "--parallelism.pipeline_fsdp_policy", "gather_once"]),
    # ragged buckets in the stages, the pipeline FSDP policy the trainer picks by default
    "pp2_ragged": (3, ["--parallelism.pipeline_parallel_degree", "2",
                       "--parallelism.storage", "ragged"]),
    # and on the host (the shards, their gradients and the optimizer's state), with pp2_ragged's
    # update kernels (offload's own default is the fused step): the copies alone differ
    "pp2_offload": (3, ["--parallelism.pipeline_parallel_degree", "2",
                        "--parallelism.storage", "ragged", "--parallelism.offload", "params",
                        "--optimizer.implementation", "foreach"]),
    # context parallelism in the stages (dp 1: 8 micro-batches of one sequence's chunks)
    "pp2_cp2": (3, ["--parallelism.pipeline_parallel_degree", "2",
                    "--parallelism.context_parallel_degree", "2"]),
    # pp2's step-2 checkpoint at pp 2 x tp 2: the stages' shards resharded over tp too
    "resumed_pp2_tp2": (3, ["--parallelism.pipeline_parallel_degree", "2",
                            "--parallelism.tensor_parallel_degree", "2",
                            "--checkpoint.enable", "--checkpoint.load_step", "2"]),
}


class _CountOnGroup(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the functional collectives issued on the group named ``group`` (its name is
    their last argument), by op name."""

    def __init__(self, group: str):
        super().__init__()
        self.group, self.counts = group, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and args and args[-1] == self.group:
            self.counts[func.__name__] = self.counts.get(func.__name__, 0) + 1
        return func(*args, **(kwargs or {}))


def _trainer_run(folder: str, name: str) -> tuple[list[float], float] | tuple:
    """The run's losses and validation loss; with cp also the collectives its training steps
    issued on the cp group ({op: count}) and the ranks of this rank's pp and cp groups."""
    from simplesharded.mesh import PP_DIM, cp_mesh
    from simplesharded.trainer import Trainer, check_static
    from simplesharded.trainer.config import load_config

    torch._dynamo.reset()
    steps, args = TRAINER_RUNS[name]
    dump = str(Path(folder) / ("ckpt" if name == "pp2" or name.startswith("resumed") else name))
    cfg = check_static(load_config(None, [*TRAINER, *args, "--training.steps", str(steps),
                                          "--job.dump_folder", dump]), dist.get_world_size())
    trainer = Trainer(cfg, "cpu")
    cp = cp_mesh(trainer.mesh)
    if cp is None:
        return trainer.run(), trainer.validate()
    with _CountOnGroup(cp.get_group().group_name) as issued:  # eager: forward and backward
        losses = trainer.run()
    return (losses, trainer.validate(), issued.counts,
            dist.get_process_group_ranks(trainer.mesh.get_group(PP_DIM)),
            dist.get_process_group_ranks(cp.get_group()))


def job(rank, world, folder):
    from simplesharded.mesh import build_mesh

    mesh = build_mesh(1, -1, "cpu", pp=PP)
    out = {case: _case(mesh, *case, evaluate=case in EVALUATED) for case in ALL}
    for name in TRAINER_RUNS:
        if name != "pp2_cp2" or has(CONTEXT_PARALLEL):
            out[name] = _trainer_run(folder, name)
    return out


@memo
def run():
    with tempfile.TemporaryDirectory(prefix="ss_pp_") as folder:
        return spawn(4, job, folder, timeout_s=900)


def one_process_job(rank, world, folder):
    return _trainer_run(folder, "pp1")


@memo
def one_process():
    """The trainer's run without pp on one process: the reference of the 4-rank runs."""
    with tempfile.TemporaryDirectory(prefix="ss_pp1_") as folder:
        return spawn(1, one_process_job, folder, timeout_s=300)[0]


def _id(case) -> str:
    return "-".join(map(str, case))


@pytest.mark.parametrize("case", ALL, ids=[_id(c) for c in ALL])
def test_parity_with_single_process(case):
    ref_losses, ref_params = reference()
    results = run()
    got = results[0][case]
    for r in results[1:]:  # every rank reports the same global loss
        assert r[case]["losses"] == got["losses"]
    # the 5 steps' losses, and the eval's after them where the case ran it
    assert len(got["losses"]) == STEPS + (case in EVALUATED)
    rel = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref_losses))
    assert rel <= TOL, (got["losses"], ref_losses)
    params = {}
    for r in results:  # dp rank 0 of each pp rank: its stages' parameters
        params.update(r[case]["params"])
    assert set(params) == set(ref_params)
    bad = {n: max_rel_diff(p, ref_params[n]) for n, p in params.items()
           if not max_rel_diff(p, ref_params[n]) <= TOL}
    assert not bad, f"final parameters beyond {TOL}: {bad}"


@pytest.mark.parametrize("case", CASES + RAGGED, ids=[_id(c) for c in CASES + RAGGED])
def test_reduce_once_reduces_once_per_stage_and_step(case):
    """One reduction per stage and step (a ragged bucket's: one per bucket)."""
    schedule, _, policy = case[:3]
    for rank, r in enumerate(run()):
        got = r[case]
        n_stages = len(got["stages"])
        assert n_stages == (1 if schedule == "1F1B" else 2)
        per_stage = got["buckets"] if case in RAGGED else [1] * n_stages
        if policy in ("reduce_once", "gather_once"):
            assert got["deferred"] == [STEPS * n for n in per_stage], (rank, got["deferred"])
            assert got["reductions"] == sum(per_stage), (rank, got["reductions"])
        else:
            assert got["deferred"] == [0] * n_stages
            assert got["reductions"] >= MICROBATCHES * n_stages, (rank, got["reductions"])


@pytest.mark.parametrize("case", ALL, ids=[_id(c) for c in ALL])
def test_gather_once_gathers_once_per_bucket_and_step(case):
    """gather_once: a step's all-gathers (counted by the profiler) are the stages' buckets,
    with 4 micro-batches as with 2; the other policies gather in every micro-batch."""
    schedule, _, policy = case[:3]
    for rank, r in enumerate(run()):
        got = r[case]
        n_stages = len(got["stages"])
        if policy == "gather_once":
            assert got["gathers"] == sum(got["buckets"]), (rank, got["gathers"], got["buckets"])
            assert got["held"] == [STEPS * b for b in got["buckets"]], (rank, got["held"])
        else:
            assert got["held"] == [0] * n_stages
            assert got["gathers"] >= MICROBATCHES * n_stages, (rank, got["gathers"])


def test_stage_placement_and_agreement_peers():
    """1F1B: stage = pp rank; interleaved: pp rank r holds r and r + 2; ZBV: the V. Each rank's
    compiled graphs are checked against the ranks of its pp coordinate only."""
    for rank, r in enumerate(run()):
        pp_rank = rank // 2
        assert r[("1F1B", "eager", "reduce_once")]["stages"] == [pp_rank]
        interleaved = r[("Interleaved1F1B", "eager", "every_microbatch")]
        assert interleaved["stages"] == [pp_rank, pp_rank + 2]
        assert r[("ZBVZeroBubble", "eager", "gather_once")]["stages"] == [pp_rank, 3 - pp_rank]
        peers, expected = r[("1F1B", "aot_eager_blockbucketing", "reduce_once")]["peers"]
        assert peers == expected == (2 * pp_rank, 2 * pp_rank + 1)


def test_trainer_pp2_matches_no_pp():
    """The trainer with --parallelism.pipeline_parallel_degree 2 (pp 2 x dp 2, 1F1B, 2
    micro-batches a step, reduce_once) gives the losses and the validation loss of the same
    run on dp 4 (3 eager steps, <= 1e-5 rel), on every rank."""
    results = run()
    for r in results:
        (pp2, val2), (pp1, val1) = r["pp2"], r["pp1"]
        assert len(pp2) == len(pp1) == 3
        assert max(abs(a - b) / abs(b) for a, b in zip(pp2, pp1)) <= TOL, (pp2, pp1)
        assert abs(val2 - val1) <= TOL * abs(val1), (val2, val1)


def test_trainer_pp2_with_ragged_buckets_matches_no_pp():
    """--parallelism.storage ragged in pipeline stages: the losses and validation loss of
    the run on dp 4 without them (<= 1e-5 rel), on every rank."""
    for r in run():
        (got, val), (pp1, val1) = r["pp2_ragged"], r["pp1"]
        assert len(got) == 3
        assert max(abs(a - b) / abs(b) for a, b in zip(got, pp1)) <= TOL, (got, pp1)
        assert abs(val - val1) <= TOL * abs(val1), (val, val1)


def test_trainer_pp2_with_offload_equals_without():
    """--parallelism.offload params in pipeline stages: on CPU the copies change no value, so
    the losses and validation loss are those of the same run without offload, bit for bit."""
    for r in run():
        assert r["pp2_offload"] == r["pp2_ragged"], (r["pp2_offload"], r["pp2_ragged"])


def test_trainer_pp2_tp2_matches_one_process():
    """pp 2 x tp 2 (Interleaved1F1B: two stages per rank; sequence- and loss-parallel stages
    that hand each other whole sequences) gives the one-process run's losses and validation
    loss (3 eager steps, <= 1e-5 rel), on every rank, under gather_once (the held parameters
    are the tp-local ones)."""
    ref, ref_val = one_process()
    assert len(ref) == 3
    for r in run():
        got, val = r["pp2_tp2"]
        assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= TOL, (got, ref)
        assert abs(val - ref_val) <= TOL * abs(ref_val), (val, ref_val)


@needs_torch(CONTEXT_PARALLEL)
def test_trainer_pp2_cp2_matches_no_pp():
    """Context parallelism inside pipeline stages (pp 2 x cp 2, 1F1B, 8 micro-batches a step,
    eager): the losses and validation loss of the run on dp 4 without either (<= 1e-5 rel),
    on every rank. A stage's input is its rank's head-tail chunks (the recipe sizes the stage
    boundaries at seq_len / cp); each stage gathers K/V over its cp group, once per block and
    micro-batch forward, and reduce-scatters their gradient once in backward; the pp group,
    whose ranks the schedule sends activations between, joins the ranks of one cp index (rank
    r and r + 2), the cp group the two cp ranks of one stage."""
    per_step = (TRAINER_BLOCKS // PP) * 8  # the blocks over 2 stages; 8 micro-batches
    for rank, r in enumerate(run()):
        (got, val, issued, pp_ranks, cp_ranks), (ref, ref_val) = r["pp2_cp2"], r["pp1"]
        assert len(got) == len(ref) == 3
        assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= TOL, (got, ref)
        assert abs(val - ref_val) <= TOL * abs(ref_val), (val, ref_val)
        assert pp_ranks == [rank % 2, rank % 2 + 2], (rank, pp_ranks)
        assert cp_ranks == [rank // 2 * 2, rank // 2 * 2 + 1], (rank, cp_ranks)
        assert issued == {"all_gather_into_tensor.default": 3 * per_step,
                          "reduce_scatter_tensor.default": 3 * per_step}, (rank, issued)


@pytest.mark.parametrize("resumed", ["resumed_pp1", "resumed_pp2_tp2"])
def test_trainer_checkpoint_saved_with_pp2_resumes_elsewhere(resumed):
    """A checkpoint saved at step 2 by pp 2 x dp 2 loads into dp 4 and into pp 2 x tp 2 (DCP
    reshards the stages' FQN-keyed shards); the step-3 loss is the uninterrupted pp 2 run's,
    on every rank."""
    for r in run():
        (straight, _), (got, _) = r["pp2"], r[resumed]
        assert len(straight) == 3
        assert len(got) == 1 and abs(got[0] - straight[2]) <= TOL * abs(straight[2]), \
            (got, straight)
