"""Tests of host offload (simplesharded/storage/offload.py, ``data_parallel(offload=...)``,
``--parallelism.offload``); all single-process but the last two:

1. what ``offload=`` takes (the three names, FSDP2's offload policies) and the one-line
   refusals: another value, a storage without ragged buckets, ``compile_step``, the trainer's
   key and the keys it does not take yet (through the trainer's preflight, as run_train.sh
   runs it);
2. the compiled graphs of the toy model on a fake process group of 2 ranks
   (aot_eager_blockbucketing): under ``params`` one ``to_compute`` copy per bucket gather,
   feeding its all-gather alone and right before it in forward and in backward's regathers
   (the reordering pass moved each with its gather); one ``to_host`` copy per bucket
   reduce-scatter, after its wait, whose own wait stands right before the next copy; under ``optimizer`` the gathers read the resident copy
   (no copy before them) and the reduced gradients are copied to the host as under
   ``params``;
3. (slow, one spawn each) two gloo ranks train the toy model 10 steps, eager and under
   aot_eager_blockbucketing, with each offload (and under aot_eager and
   aot_eager_autobucketing with ``params``): the losses, the parameters, the optimizer's
   state and the ``state_dict()`` (keys and values) bit for bit those without offload, the
   parameters' names and the param groups unchanged, and a DCP checkpoint saved with
   ``params`` offload loads into a model without offload bit for bit; torch's full state
   dicts of a model without offload, broadcast from rank 0 (``set_model_state_dict`` and
   ``set_optimizer_state_dict``), load into each offloaded model, and the next step is equal;
   four gloo ranks train the trainer's llama3 under hybrid_shard with gradient accumulation,
   with tensor and with context parallelism, and its DeepSeek-V3 with expert parallelism,
   compiled, with and without ``params`` offload, bit for bit.
"""
from __future__ import annotations

import copy

import pytest
import torch

from simplesharded.passes.annotations import OFFLOAD_KEY, RAGGED_KEY, annotations
from simplesharded.passes.graph_utils import ancestors
from simplesharded.passes.torch_compat import STEP_GRAPH, has

import pass_utils as pu
import toy_blocks
from dist_utils import memo

# autouse, as in every file that makes process groups: none may be left behind
from traced_graphs import _no_leaked_process_group  # noqa: F401

LAYERS = 2
STEPS = 10
LR = 1e-2
BACKEND = "aot_eager_blockbucketing"
# ... and params offload under these too: aot_eager runs the traced graphs without our passes
# (each copy waited where it is made), autobucketing under the planner's own cap (inductor:
# tests/test_bucketing_training.py)
MORE_BACKENDS = ("aot_eager", "aot_eager_autobucketing")
# The toy model's ragged buckets: before the first block, each block, after the last
BUCKETS = ["pre", "layers.0", "layers.1", "post"]
TO_COMPUTE = torch.ops.simplesharded.to_compute.default
TO_HOST = torch.ops.simplesharded.to_host.default
WAIT = torch.ops._c10d_functional.wait_tensor.default


# ------------------------------------------------------------------ what it takes, refusals


def test_offload_takes_names_and_fsdp2_policies():
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    from simplesharded.storage.offload import offload_choice

    assert [offload_choice(k) for k in ("none", "optimizer", "params")] == [
        ("none", True), ("optimizer", True), ("params", True)]
    assert offload_choice(CPUOffloadPolicy()) == ("params", True)
    assert offload_choice(CPUOffloadPolicy(pin_memory=False)) == ("params", False)
    assert offload_choice(OffloadPolicy()) == offload_choice(None) == ("none", True)


def test_host_shards_stay_on_the_host_of_an_accelerators_mesh(monkeypatch):
    """On an accelerator, the mesh's device type is not the host's: ``DTensor.from_local``
    would copy a host shard to the mesh's device, and its members' host gradients would not
    match them (the H200 run's ``params`` offload failed so). A ``meta``-typed mesh stands in
    for the accelerator's."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from simplesharded.mesh import backend_for
    from simplesharded.storage.offload import check_host_group, kept_dtensor

    with pu.fake_world(2):
        mesh = DeviceMesh("meta", [0, 1])
        host = torch.arange(4.0)
        moved = DTensor.from_local(host, mesh, [Shard(0)], run_check=False)
        assert moved.to_local().device.type == "meta"  # what kept_dtensor exists for
        kept = kept_dtensor(host, mesh, [Shard(0)], (8,), (1,))
        assert (kept.device, kept.to_local().device, kept.shape) == (host.device,) * 2 + (
            torch.Size([8]),)
        # (a gradient made so is on the host too: autograd takes it for a host parameter)
        assert kept_dtensor(torch.ones(4), mesh, [Shard(0)], (8,), (1,)).device == host.device
        # an accelerator's group without a host backend: one warning naming the fix
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
        with pytest.warns(UserWarning, match="cpu:gloo"):
            check_host_group("params", mesh)
        monkeypatch.setattr(dist, "get_backend_config",
                            lambda group=None: "cuda:nccl,cpu:gloo")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_host_group("params", mesh)
            check_host_group("none", mesh)
    assert backend_for("cuda", host=True) == "cuda:nccl,cpu:gloo"
    assert backend_for("cuda") == "nccl"
    assert backend_for("cpu", host=True) == "gloo"


def test_refusals_are_one_line():
    import simplesharded as ss
    from simplesharded.trainer.config import load_config

    def wrap(**kwargs):
        with pu.fake_world(2) as mesh:
            ss.data_parallel(toy_blocks.make_model(n_layers=1), mesh, **kwargs)

    def step_graph():
        with pu.fake_world(2) as mesh:
            model = ss.data_parallel(toy_blocks.make_model(n_layers=1), mesh, offload="params")
            ss.compile_step(model, torch.optim.AdamW(model.parameters()),
                            lambda m, x: m(x).sum(), backend=BACKEND)

    cases = [
        (lambda: wrap(offload="cpu"), r"offload='cpu' is not one of \['none', 'optimizer', "
                                      r"'params'\] \(or an FSDP2 OffloadPolicy\)"),
        (lambda: wrap(offload=object()), "is not one of"),
        (lambda: wrap(offload="params", storage="param"),
         "offload='params' takes storage='ragged'.*got storage='param'"),
        (lambda: wrap(offload="optimizer", mode="replicate"),
         "offload='optimizer' takes storage='ragged'.*got storage='param' under "
         "mode='replicate'"),
        (lambda: load_config(None, ["--parallelism.offload", "cpu"]),
         r"parallelism.offload='cpu' is not one of \['none', 'optimizer', 'params'\]"),
        (lambda: load_config(None, ["--parallelism.offload", "params", "--parallelism.storage",
                                    "param"]),
         "parallelism.offload='params' moves ragged buckets to the host"),
        (lambda: load_config(None, ["--parallelism.offload", "optimizer", "--compile.enable",
                                    "--compile.scope", "step"]),
         "parallelism.offload='optimizer' does not take compile.scope='step'"),
    ]
    if has(STEP_GRAPH):  # else compile_step is refused for the torch first
        cases.append((step_graph, "compile_step does not take a model wrapped with "
                                  "offload='params'"))
    for make, match in cases:
        with pytest.raises(ValueError, match=match) as info:
            make()
        assert "\n" not in str(info.value)
    assert load_config(None, ["--parallelism.offload", "params"]).parallelism.offload == "params"
    # pipeline stages take it (tests/test_pp.py)
    assert load_config(None, ["--parallelism.offload", "optimizer",
                              "--parallelism.pipeline_parallel_degree", "2"])


def test_trainer_preflight_refuses_in_one_line(monkeypatch, capsys):
    """run_train.sh's preflight (``python -m simplesharded.trainer --check-only``): a bad
    value is one line and exit status 2, no traceback."""
    from simplesharded.trainer import main as train_main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train_main(["--check-only", "--parallelism.offload", "disk"]) == 2
    assert capsys.readouterr().err == ("error: parallelism.offload='disk' is not one of "
                                       "['none', 'optimizer', 'params']\n")
    assert train_main(["--check-only", "--parallelism.offload", "optimizer"]) == 0


# ------------------------------------------------------------------------- compiled graphs


@memo
def _graphs(offload: str, param_dtype=None) -> dict:
    """The final forward and backward graphs of one step of the toy model compiled on 2 fake
    ranks, every parameter resharded after forward (backward gathers again); ``param_dtype``:
    mixed precision's gathers."""
    import simplesharded as ss

    seen = {}

    def observe(kind, stage, gm):
        if kind in ("fw", "bw") and stage == "agreement":
            seen[kind] = copy.deepcopy(gm)

    with pu.fake_world(2) as mesh:
        torch._dynamo.reset()
        model = ss.data_parallel(toy_blocks.make_model(n_layers=LAYERS), mesh,
                                 reshard_after_forward=True, offload=offload,
                                 mp_policy=ss.MixedPrecisionPolicy(param_dtype=param_dtype))
        compiled = torch.compile(model, fullgraph=True,
                                 backend=ss.make_backend(BACKEND, observer=observe))
        tokens, targets = toy_blocks.batch(0)
        toy_blocks.loss_fn(compiled(tokens), targets, 2 * tokens.numel()).backward()
        torch._dynamo.reset()
    return seen


def _bucket(node) -> str:
    return annotations(node)[RAGGED_KEY].split("/")[0]


def _copies(gm, target) -> list:
    return [n for n in gm.graph.nodes if n.target is target]


def _inputs(node) -> set:
    """What ``node`` reads, directly or not."""
    return ancestors([node])


def _gathers(gm) -> list:
    return [n for n in gm.graph.nodes if n.target is pu.AG]


@pytest.mark.parametrize("offload", ["params", "optimizer"])
def test_reduced_gradients_copied_to_the_host_after_their_reduction(offload):
    bw = _graphs(offload)["bw"]
    copies = _copies(bw, TO_HOST)
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    reductions = [n for n in bw.graph.nodes if n.target is pu.RS]
    # one copy per bucket, in the order of the reductions, each after its reduction's wait
    # and reading what the reduction produced (through the 1/dp scaling)
    assert [_bucket(c) for c in copies] == [_bucket(r) for r in reductions]
    assert sorted(map(_bucket, copies)) == sorted(BUCKETS)
    for copy_, rs in zip(copies, reductions):
        wait = pu.the_wait(rs)
        assert order[wait] < order[copy_]
        assert annotations(copy_)[OFFLOAD_KEY] == "to_host"
        assert wait in _inputs(copy_)
    # each copy's wait (of the gradient it copies) right before the next copy, the last
    # right before the output (offload_copies.py): a copy runs beside the next gradients'
    # compute, the gradient kept until it has landed
    output = next(iter(bw.graph.find_nodes(op="output")))
    for copy_, after in zip(copies, [*copies[1:], output]):
        (wait,) = [u for u in copy_.args[0].users if u.target is pu.WAIT]
        assert annotations(wait)[OFFLOAD_KEY] == "to_host"
        assert order[copy_] < order[wait] and wait.next is after
    # and those waits pin no reduction: each but the last is in flight over compute
    work = [order[n] for n in bw.graph.nodes if n.op == "call_function"
            and n.target not in (pu.AG, pu.RS, pu.WAIT) and not pu._is_chain_op(n)]
    for rs in reductions[:-1]:
        assert any(order[rs] < i < order[pu.the_wait(rs)] for i in work), rs


@pytest.mark.parametrize("kind", ["fw", "bw"])
def test_each_gather_reads_its_copy_issued_one_copy_ahead(kind):
    gm = _graphs("params")[kind]
    copies, gathers = _copies(gm, TO_COMPUTE), _gathers(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    # forward gathers every bucket; backward gathers again all but the embeddings' ("pre":
    # the embedding's backward reads no weight)
    want = BUCKETS if kind == "fw" else ["post", "layers.1", "layers.0"]
    assert sorted(map(_bucket, gathers)) == sorted(want)
    assert len(copies) == len(gathers)
    waits = []
    for g in gathers:
        (wait,) = g.all_input_nodes  # fp32: the gather reads the copy once it is ready
        assert wait.target is pu.WAIT and wait.next is g
        (copy_,) = wait.all_input_nodes
        assert copy_.target is TO_COMPUTE and _bucket(copy_) == _bucket(g)
        assert annotations(copy_)[OFFLOAD_KEY] == "to_compute"
        assert list(copy_.users) == [wait]
        # it copies the host shard: the bucket's input, or the 1-D view of it to_local took
        source = copy_.args[0]
        assert source.op == "placeholder" or source.args[0].op == "placeholder"
        waits.append(wait)
    # offload_copies.py: each copy but the first issued right before the previous copy's wait
    waits.sort(key=order.__getitem__)
    for ahead, wait in zip(waits, waits[1:]):
        (copy_,) = wait.all_input_nodes
        assert copy_.next is ahead or copy_.next.target is TO_COMPUTE
        assert order[copy_] < order[ahead]
    # reordering issued gathers ahead of earlier buckets' waits
    gathered = sorted(order[pu.the_wait(g)] for g in gathers)
    assert any(order[g] < gathered[0] for g in gathers[1:]), "no gather was prefetched"


def test_under_mixed_precision_each_copy_is_waited_at_its_cast():
    """bf16 gathers: each copy's wait is read by the cast to bf16 alone, right after it, and the
    cast feeds the gather; the copies still issued one copy ahead."""
    for kind in ("fw", "bw"):
        gm = _graphs("params", torch.bfloat16)[kind]
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        waits = []
        for g in _gathers(gm):
            assert g.meta["val"].dtype == torch.bfloat16
            wait = next(n for n in ancestors([g]) if n.target is pu.WAIT
                        and n.args[0].target is TO_COMPUTE)
            (cast,) = wait.users
            assert wait.next is cast and cast.meta["val"].dtype == torch.bfloat16
            assert g in cast.users or g in {u for n in cast.users for u in n.users}
            waits.append(wait)
        waits.sort(key=order.__getitem__)
        led = [w for ahead, w in zip(waits, waits[1:]) if order[w.args[0]] < order[ahead]]
        assert led, kind


def test_optimizer_offload_gathers_read_the_resident_copy():
    """Each gather reads its bucket's resident copy (a graph input) through the wait of its
    refresh, issued on the copy stream before the forward (Offload.refresh); in forward each
    such wait comes after the previous bucket's gather, so the first blocks start before the
    last refresh has landed. Backward's waits find the work waited already."""
    graphs = _graphs("optimizer")
    for kind in ("fw", "bw"):
        gm = graphs[kind]
        assert _copies(gm, TO_COMPUTE) == []
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        gathers = sorted(_gathers(gm), key=order.__getitem__)
        waits = []
        for g in gathers:
            (source,) = g.all_input_nodes
            assert annotations(source)[OFFLOAD_KEY] == "resident"
            ready = source.args[0]
            assert ready.target is WAIT and annotations(ready)[OFFLOAD_KEY] == "resident"
            assert ready.args[0].op == "placeholder"
            waits.append(ready)
        if kind == "fw":
            assert len(gathers) == len(BUCKETS), gathers
            assert all(order[g] < order[w] for g, w in zip(gathers, waits[1:])), gathers


# --------------------------------------------------------------- two ranks, bit for bit


def _wrapped(world: int, offload: str, seed: int = 0):
    import simplesharded as ss
    from simplesharded.mesh import build_mesh

    mesh = build_mesh(dp_replicate=1, dp_shard=world, device="cpu")
    return ss.data_parallel(toy_blocks.make_model(seed, n_layers=LAYERS), mesh,
                            offload=offload)


def _train(rank: int, world: int, offload: str, backend: str | None):
    """The toy model trained ``STEPS`` steps with ``offload``: (model, optimizer, losses)."""
    import simplesharded as ss

    torch._dynamo.reset()
    model = _wrapped(world, offload)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not any(p is q for q in decay)]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=LR)
    run = model if backend is None else torch.compile(model, backend=ss.make_backend(backend))
    losses = toy_blocks.train(run, opt, rank, world, STEPS)
    torch._dynamo.reset()
    return model, opt, losses


def _held_forward(model, rank: int) -> list[torch.Tensor]:
    """FSDP2's ``unshard()`` / ``reshard()`` around two eval forwards (the gathers held for
    both: simplesharded/storage/gather_once.py): their outputs."""
    tokens, _ = toy_blocks.batch(rank, STEPS)
    model.unshard()
    with torch.no_grad():
        outs = [model(tokens) for _ in range(2)]
    model.reshard()
    return outs


def _train_job(rank, world):
    """Every (offload, backend) case's losses, parameters, optimizer state and state_dict as
    full tensors, compared with offload "none"'s here; a DCP round trip from "params" into
    "none"; eval forwards between ``unshard()`` and ``reshard()``; torch's full state dicts
    from "none" into each offload."""
    import torch.distributed.checkpoint as dcp

    from dist_utils import by_member, full_state_through_torch, shared_tmpdir
    from simplesharded.storage.ragged_shards import optim_state_by_member

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def summary(model, opt, losses):
        names = {id(p): n for n, p in model.named_parameters()}
        flat = {f"state.{names[id(p)]}.{k}": v for p, s in opt.state.items()
                for k, v in s.items()}
        state = {k: full(v) for k, v in optim_state_by_member(model, flat).items()}
        return dict(losses=losses, params=by_member(model), optim=state,
                    sd={k: full(v) for k, v in model.state_dict().items()},
                    names=[n for n, _ in model.named_parameters()],
                    groups=[[names[id(p)] for p in g["params"]] for g in opt.param_groups])

    def same(a, b):
        return (a["losses"] == b["losses"] and a["names"] == b["names"]
                and a["groups"] == b["groups"] and list(a["sd"]) == list(b["sd"])
                and all(pu.bitwise_equal(a[k], b[k]) for k in ("params", "optim", "sd")))

    out = {}
    for backend in MORE_BACKENDS:  # params offload against none, under each
        base = summary(*_train(rank, world, "none", backend))
        out[("params", backend)] = same(summary(*_train(rank, world, "params", backend)), base)
    for backend in (None, BACKEND):
        plain = _train(rank, world, "none", backend)
        base = summary(*plain)
        offloaded = {}
        for offload in ("optimizer", "params"):
            model, opt, losses = _train(rank, world, offload, backend)
            out[(offload, backend)] = same(summary(model, opt, losses), base)
            offloaded[offload] = model, opt
            if offload == "params" and backend is None:
                path = shared_tmpdir()
                dcp.save(model.state_dict(), checkpoint_id=path)
                fresh = _wrapped(world, "none", seed=1)  # other values, same layout
                loaded = fresh.state_dict()
                dcp.load(loaded, checkpoint_id=path)
                fresh.load_state_dict(loaded)
                out["dcp"] = pu.bitwise_equal(by_member(fresh), base["params"])
        if backend is None:
            # the trained models' held gathers read the stepped shards
            held = _held_forward(plain[0], rank)
            for offload, (model, _) in offloaded.items():
                out[("unshard", offload)] = pu.bitwise_equal(_held_forward(model, rank), held)
            # FSDP2's full checkpoint, from rank 0, into host shards (last: it steps the
            # models, and `base` holds the optimizer's step counts themselves)
            for offload, pair in offloaded.items():
                got = full_state_through_torch(plain[:2], pair, broadcast=True)
                out[("full_state", offload)] = got["loaded"] and got["stepped"]
    return out


@pytest.mark.slow
def test_two_ranks_offload_is_bitwise_no_offload():
    from dist_utils import spawn

    for result in spawn(2, _train_job, timeout_s=600):
        assert result == {("optimizer", None): True, ("params", None): True,
                          ("optimizer", BACKEND): True, ("params", BACKEND): True,
                          **{("params", b): True for b in MORE_BACKENDS},
                          "dcp": True, ("unshard", "optimizer"): True,
                          ("unshard", "params"): True, ("full_state", "optimizer"): True,
                          ("full_state", "params"): True}


# ------------------------------------------------- with HSDP, TP and gradient accumulation

LLAMA = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "configs"
            / "llama3_debug.toml")
# 4 gloo ranks, the trainer's debug llama3 at 2 blocks, compiled by the bucketing backend;
# foreach AdamW pinned (offload's own default is the fused step, whose update kernels
# differ: the copies alone must be what differs)
COMPOSED = {"hybrid_shard + accumulation": ["--parallelism.data_parallel_replicate_degree", "2",
                                            "--training.gradient_accumulation_steps", "2"],
            "tensor parallel": ["--parallelism.tensor_parallel_degree", "2"],
            "context parallel": ["--parallelism.context_parallel_degree", "2"],
            "expert parallel": ["--job.config_file", str(__import__("pathlib").Path(LLAMA)
                                                         .with_name("deepseek_v3_debug.toml")),
                                "--parallelism.expert_parallel_degree", "2"]}
TRAINER = ["--model.n_layers", "2", "--training.seq_len", "32",
           "--training.global_batch_size", "8", "--training.val_every", "0",
           "--no-metrics.progress_bar", "--optimizer.implementation", "foreach",
           "--compile.enable", "--compile.backend", BACKEND]


def _composed(name: str) -> bool:
    """Whether this torch runs COMPOSED case ``name`` (context and expert parallelism need
    2.13: passes/torch_compat.py)."""
    from simplesharded.passes.torch_compat import CONTEXT_PARALLEL, EXPERT_PARALLEL

    needs = {"context parallel": CONTEXT_PARALLEL, "expert parallel": EXPERT_PARALLEL}
    return name not in needs or has(needs[name])


def _composed_job(rank, world):
    """Each COMPOSED case this torch runs, trained 3 steps through the trainer with
    ``parallelism.offload`` none and params: (its mesh and storage, the losses equal, the
    parameters bit for bit)."""
    from simplesharded.trainer import Trainer, check_static
    from simplesharded.trainer.config import load_config

    out = {}
    for name, args in COMPOSED.items():
        if not _composed(name):
            continue
        runs = {}
        for offload in ("none", "params"):
            torch._dynamo.reset()
            cfg = check_static(load_config(None, ["--job.config_file", LLAMA, *TRAINER, *args,
                                                  "--parallelism.offload", offload]), world)
            trainer = Trainer(cfg, "cpu")
            losses = [trainer.train_step()["loss"] for _ in range(3)]
            sd = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                  for k, v in trainer.model.state_dict().items()}
            runs[offload] = (losses, sd, (cfg.parallelism.mode, cfg.dp_storage()))
        (plain, plain_sd, what), (host, host_sd, _) = runs["none"], runs["params"]
        out[name] = (what, plain == host, pu.bitwise_equal(plain_sd, host_sd))
    torch._dynamo.reset()
    return out


@pytest.mark.slow
def test_offload_with_hsdp_tp_cp_ep_and_accumulation_is_bitwise_no_offload():
    """Host offload of ragged buckets composes: under hybrid_shard with gradient accumulation
    (the replica all-reduce after each reduce-scatter, the accumulated gradients on the host),
    and with tensor, context and expert parallelism (dp 2 x tp, cp or ep 2; DeepSeek-V3's
    debug model for ep), the trainer's losses and parameters with ``--parallelism.offload
    params`` are those without, bit for bit."""
    from dist_utils import spawn

    want = {"hybrid_shard + accumulation": (("hybrid_shard", "ragged"), True, True),
            "tensor parallel": (("fully_shard", "ragged"), True, True),
            "context parallel": (("fully_shard", "ragged"), True, True),
            "expert parallel": (("fully_shard", "ragged"), True, True)}
    for rank, result in enumerate(spawn(4, _composed_job, timeout_s=600)):
        assert result == {k: v for k, v in want.items() if _composed(k)}, rank
