"""Multi-process training with our bucketing backends vs the plain ones (2 gloo ranks, CPU).

Each rank trains ``toy_blocks.ToyBlocks`` (fp32, fully_shard, 7-row uneven parameters) for
STEPS steps on its own data (``toy_blocks.batch(rank, step)``: ranks differ), once per backend,
from the same initial shards, in one spawned job per compiler.

* aot_eager: ``aot_eager_blockbucketing`` and ``aot_eager_autobucketing`` must be BITWISE equal
  to ``aot_eager`` (every loss and every final parameter shard, AdamW): the FX graph runs op by
  op, bucketing only concatenates/splits buffers and the reordering only moves nodes, and a
  2-rank reduce-scatter adds the same two numbers per element whatever buffer they sit in.
* inductor: over ragged buckets, ``inductor_autobucketing`` (the trainer's default), and the
  step graph under ``inductor_blockbucketing``, vs plain ``aot_eager`` within a
  relative tolerance (SGD); with host offload of the shards (``offload="params"``) bitwise
  the same as without it, one copy per gather and per reduction in inductor's code. Inductor's kernels fuse and vectorise the aten program (the
  concatenation and copy-out nodes of a bucket change its fusion groups), and its C++
  reductions reassociate fp32 sums: a few ulps per step. C++
  vectorisation is on, as in production: we observed, for this exact run, loss rel. diff
  ≤ 4.6e-7 and parameter rel. diff ≤ 2.3e-7, and for 4 blocks with AdamW loss rel. diff ≤ 2e-6
  and parameter abs. diff ≤ 2.5e-5 (Adam turns tiny gradient differences into lr-sized updates,
  see test_parity.py). INDUCTOR_TOL = 1e-4 (relative, as in test_parity.py) covers these with margin,
  while any bucketing bug (wrong rows, wrong reduction) is an O(1) error. Over ragged buckets
  (``storage="ragged"``) the code has the block plan's collectives and the forward graph
  concatenates nothing.
  The generated code is checked to contain the bucketed collective counts, so the post-grad pass
  really ran (no cache bypass: dist_utils.BASE_ENV turns inductor's FX-graph and AOT caches
  off; only compiled kernels are shared, between the two ranks), and to
  run the collective starts and waits in the order our passes left them among the matmuls
  (tests/support/inductor_code.py; inductor's scheduler moved them until passes/pin_order.py).
* the inductor hooks do not leak: after compiling with the bucketing backends,
  ``torch._inductor.config.post_grad_custom_post_pass`` and ``joint_custom_pre_pass`` are None,
  and a later plain ``torch.compile(backend="inductor")`` of another model in the same process
  runs none of our pipeline (counted) and keeps one all-gather per parameter.
"""
from __future__ import annotations

import functools
import re
import tempfile

import pytest
import torch

import toy_blocks
from dist_utils import max_rel_diff, spawn
from inductor_code import code_order, format_order, graph_order, overlapped
from simplesharded.passes.torch_compat import STEP_GRAPH, has
from torch_range import needs_torch

pytestmark = pytest.mark.slow

WORLD = 2
STEPS = 10
INDUCTOR_LAYERS = 1  # C++ compile time grows with kernels (~1 s each here); buckets: 3
INDUCTOR_TOL = 1e-4
AOT = ("aot_eager", "aot_eager_blockbucketing", "aot_eager_autobucketing")
# data_parallel(..., storage="ragged") (simplesharded/storage/ragged_shards.py): bitwise the same
# training as without, every parameter a view of its bucket's gather (no copy-out);
# "ragged:eager" against "eager"
RAGGED = ("ragged:aot_eager_blockbucketing", "ragged:aot_eager_autobucketing", "ragged:eager")
# ... and under bf16 mixed precision against the same backend without
RAGGED_BF16 = ("bf16:aot_eager_blockbucketing", "bf16+ragged:aot_eager_blockbucketing")
# The trainer's default under inductor (ragged buckets, the auto plan), held against plain
# aot_eager (the same aten program unlowered: inductor's kernels within INDUCTOR_TOL of it),
# which runs last, after torch's own inductor on another model. Per-parameter shards
# bucketed under inductor: the fake8 TP case of tests/test_gpu_check.py.
INDUCTOR = ("ragged:inductor_autobucketing",)
# ... and with host offload of the shards, bitwise the same training as without under inductor
# (the copies are opaque ops that copy: simplesharded/storage/offload.py)
INDUCTOR_OFFLOAD = "offload+ragged:inductor_autobucketing"
INDUCTOR_OFFLOAD_OPTIMIZER = "offload_optimizer+ragged:inductor_autobucketing"

# compile_step under inductor against the same step graph under aot_eager (itself bitwise
# the split step: tests/test_step.py)
STEP_BACKENDS = ("aot_eager_blockbucketing", "inductor_blockbucketing")
STEP_BLOCKS = 3

_COLLECTIVE = {"all_gather": r"all_gather_into_tensor(_out)?\.default\(",
               # our bucketing backends lower gloo's reduce-scatter to all_to_all_single + sum
               "reduce_scatter": r"(reduce_scatter_tensor(_out)?|all_to_all_single)\.default\("}


def _led_copies(code: str) -> int:
    """Host offload copies inductor's code issues before the all-gather of the copy before
    them (passes/offload_copies.py: a copy ahead): the k-th copy with fewer than k gathers
    ahead of it."""
    calls = re.findall(r"simplesharded\.to_compute\.default\(|all_gather_into_tensor(?:_out)?"
                       r"\.default\(", code[code.index("def call("):])
    gathers, led, k = 0, 0, 0
    for call in calls:
        if call.startswith("simplesharded"):
            led += 0 < k and gathers < k
            k += 1
        else:
            gathers += 1
    return led


def _code_counts(code: str) -> dict[str, int]:
    return {k: len(re.findall(pat, code)) for k, pat in _COLLECTIVE.items()}


def _train(rank, world, backend, n_layers, opt_name, get_code=False, mode="fully_shard"):
    """STEPS steps of one backend; returns losses, final local shards, the collective counts
    and the order of collectives among matmuls (tests/support/inductor_code.py) of the graphs our
    pipeline produced (kind → ...) and, optionally, the same of inductor's code. ``backend``
    may carry options before a colon: ``ragged`` (storage="ragged"), ``bf16``
    (param_dtype), ``offload`` (offload="params"), ``offload_optimizer`` (offload="optimizer").
    Parameters are read from ``state_dict()``,
    which lists a ragged bucket's members."""
    options, _, backend = backend.rpartition(":")
    options = set(options.split("+")) - {""}
    import simplesharded as ss
    from simplesharded.mesh import build_mesh
    from simplesharded.passes.collectives import count_collectives

    mesh = build_mesh(dp_replicate=1, dp_shard=world, device="cpu")
    graph_counts: dict[str, dict] = {}
    graph_orders: dict[str, list] = {}

    def observe(kind, stage, gm):  # the last stage seen is what gets compiled/run
        graph_orders[kind] = graph_order(gm)
        graph_counts[kind] = count_collectives(gm)
        graph_counts[kind]["all_to_all"] = sum(
            n.target is torch.ops._c10d_functional.all_to_all_single.default
            for n in gm.graph.nodes)
        graph_counts[kind]["all_gather_coalesced"] = sum(
            n.target is torch.ops._c10d_functional.all_gather_into_tensor_coalesced.default
            for n in gm.graph.nodes)
        graph_counts[kind]["cat"] = sum(n.target is torch.ops.aten.cat.default
                                        for n in gm.graph.nodes)
        graph_counts[kind]["clone"] = sum(n.target is torch.ops.aten.clone.default
                                          for n in gm.graph.nodes)
        graph_counts[kind]["copy_"] = sum(n.target is torch.ops.aten.copy_.default
                                          for n in gm.graph.nodes)

    torch._dynamo.reset()
    # ZeRO-3 (every block re-gathered in backward): the counts below assume it
    mp = ss.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if "bf16" in options else None
    model = ss.data_parallel(toy_blocks.make_model(n_layers=n_layers), mesh, mode,
                             reshard_after_forward=True, mp_policy=mp,
                             storage="ragged" if "ragged" in options else "param",
                             offload=("params" if "offload" in options else "optimizer"
                                      if "offload_optimizer" in options else "none"))
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
           if opt_name == "adamw" else torch.optim.SGD(model.parameters(), lr=0.1))
    compiled = model if backend == "eager" else torch.compile(
        model, fullgraph=True, backend=ss.make_backend(backend, observer=observe))
    numel = world * toy_blocks.BATCH_PER_RANK * toy_blocks.SEQ
    losses, code_counts, code_orders, copies = [], None, None, None
    for step in range(STEPS):
        tokens, targets = toy_blocks.batch(rank, step)

        def fwd_bwd():
            loss = toy_blocks.loss_fn(compiled(tokens), targets, numel)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            return loss

        if step == 0 and get_code:
            from torch._inductor.utils import run_and_get_code

            loss, codes = run_and_get_code(fwd_bwd)
            code_counts = [_code_counts(c) for c in codes]
            code_orders = [code_order(c) for c in codes]
            copies = [{**{op: len(re.findall(rf"simplesharded\.{op}\.default\(", c))
                          for op in ("to_compute", "to_host")}, "led": _led_copies(c),
                       # waits of a graph input: optimizer offload's resident copies
                       "input_waits": len(re.findall(r"wait_tensor\.default\(primals_", c))}
                      for c in codes]
        else:
            loss = fwd_bwd()
        opt.step()
        losses.append(loss.item())
    params = {n: p.to_local().detach().clone() for n, p in model.state_dict().items()}
    torch._dynamo.reset()
    return dict(losses=losses, params=params, graph_counts=graph_counts, code_counts=code_counts,
                graph_orders=graph_orders, code_orders=code_orders, copies=copies)


def aot_job(rank, world, tmp):
    out = {be: _train(rank, world, be, toy_blocks.N_LAYERS, "adamw")
           for be in AOT + ("eager",) + RAGGED + RAGGED_BF16}
    out["dcp_ragged"] = _dcp_round_trip(rank, world, tmp)
    out["optim_ragged"] = _optim_state_round_trip(rank, world)
    return out


def _optim_state_round_trip(rank, world):
    """The optimizer state of ragged buckets as a checkpoint holds it
    (``optim_state_by_member``) is the state of the same training without them: the same
    keys, values bit for bit. Loaded back into a fresh ragged model
    (``optim_state_by_bucket``, ``set_state_dict``), the next step is the same step."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_state_dict)

    import simplesharded as ss
    from simplesharded.mesh import build_mesh
    from simplesharded.storage.ragged_shards import optim_state_by_bucket, optim_state_by_member

    mesh = build_mesh(dp_replicate=1, dp_shard=world, device="cpu")
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    numel = world * toy_blocks.BATCH_PER_RANK * toy_blocks.SEQ

    def trained(storage, seed, steps):
        model = ss.data_parallel(toy_blocks.make_model(seed), mesh, storage=storage)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        step(model, opt, range(steps))
        return model, opt

    def step(model, opt, steps):
        for i in steps:
            tokens, targets = toy_blocks.batch(rank, i)
            opt.zero_grad(set_to_none=True)
            toy_blocks.loss_fn(model(tokens), targets, numel).backward()
            opt.step()

    def full(state):
        return {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                for k, v in state.items()}

    plain, plain_opt = trained("param", 0, 2)
    ragged, ragged_opt = trained("ragged", 0, 2)
    want_model, want = get_state_dict(plain, plain_opt, options=options)
    got = full(optim_state_by_member(ragged, get_state_dict(ragged, ragged_opt,
                                                            options=options)[1]))
    want = full(want)
    same_state = sorted(got) == sorted(want) and all(
        torch.equal(v, want[k]) if torch.is_tensor(v) else v == want[k] for k, v in got.items())
    fresh, fresh_opt = trained("ragged", 1, 1)  # other weights and state: all are replaced
    set_state_dict(fresh, fresh_opt, model_state_dict=want_model,
                   optim_state_dict=optim_state_by_bucket(
                       fresh, get_state_dict(plain, plain_opt, options=options)[1]),
                   options=options)
    step(plain, plain_opt, [2])
    step(fresh, fresh_opt, [2])
    after = full(plain.state_dict())
    same_next = all(torch.equal(v, after[k]) for k, v in full(fresh.state_dict()).items())
    return dict(same_state=same_state, same_next_step=same_next)


def _dcp_round_trip(rank, world, tmp):
    """A DCP checkpoint saved with per-parameter shards loads into ragged buckets (and back):
    the values land in the buckets, which forward then reads. Ragged buckets' state_dict()
    holds converted members, so their load ends with load_state_dict (as set_state_dict
    does)."""
    import torch.distributed.checkpoint as dcp

    import simplesharded as ss
    from simplesharded.mesh import build_mesh

    mesh = build_mesh(dp_replicate=1, dp_shard=world, device="cpu")
    tokens, _ = toy_blocks.batch(rank, 0)

    def model(storage, seed):  # each its own weights: a load must change every one
        return ss.data_parallel(toy_blocks.make_model(seed), mesh, storage=storage)

    def full(m):
        return {n: p.full_tensor() for n, p in m.state_dict().items()}

    def load(m, path):
        state = m.state_dict()
        dcp.load(state, checkpoint_id=path)
        m.load_state_dict(state)

    saved = model("param", 1)
    dcp.save(saved.state_dict(), checkpoint_id=f"{tmp}/param")
    ragged = model("ragged", 2)
    load(ragged, f"{tmp}/param")
    dcp.save(ragged.state_dict(), checkpoint_id=f"{tmp}/ragged")
    back = model("param", 3)
    load(back, f"{tmp}/ragged")
    with torch.no_grad():
        outputs = [m(tokens) for m in (saved, ragged, back)]
    want = full(saved)
    assert not any(torch.equal(v, want[n]) for n, v in full(model("ragged", 2)).items())
    return dict(loaded=all(torch.equal(v, want[n]) for n, v in full(ragged).items()),
                loaded_back=all(torch.equal(v, want[n]) for n, v in full(back).items()),
                same_output=all(torch.equal(o, outputs[0]) for o in outputs[1:]),
                placements=[(n, p.placements, p.shape) for n, p in ragged.state_dict().items()]
                == [(n, p.placements, p.shape) for n, p in saved.state_dict().items()])


def aot_replicate_job(rank, world):
    return {be: _train(rank, world, be, toy_blocks.N_LAYERS, "adamw", mode="replicate")
            for be in AOT[:2]}


def inductor_job(rank, world):
    from torch._inductor import config as inductor_config

    from simplesharded.passes.pipeline import PassPipeline

    calls = {"joint": 0, "graph": 0}
    run_joint, run_graph = PassPipeline.run_joint, PassPipeline.run_graph

    def counting_joint(self, gm):
        calls["joint"] += 1
        return run_joint(self, gm)

    def counting_graph(self, gm):
        calls["graph"] += 1
        return run_graph(self, gm)

    PassPipeline.run_joint, PassPipeline.run_graph = counting_joint, counting_graph
    out = {"hooks_after": {}}
    out["step"] = {be: _step_graph_train(rank, world, be) for be in STEP_BACKENDS
                   if has(STEP_GRAPH)}  # where this torch has it (passes/torch_compat.py)
    for be in (*INDUCTOR, INDUCTOR_OFFLOAD, INDUCTOR_OFFLOAD_OPTIMIZER):
        out[be] = _train(rank, world, be, INDUCTOR_LAYERS, "sgd", get_code=True)
        out["hooks_after"][be] = (inductor_config.post_grad_custom_post_pass,
                                  inductor_config.joint_custom_pre_pass)
    out["calls_before_plain"] = dict(calls)
    out["plain_torch"] = _plain_torch_inductor(rank, world)
    out["calls_after_plain"] = dict(calls)
    out["aot_eager"] = _train(rank, world, "aot_eager", INDUCTOR_LAYERS, "sgd")
    return out


def _step_graph_train(rank, world, backend):
    """STEPS steps of compile_step (the whole step in one graph: forward, backward, clipping,
    AdamW) over ragged buckets; losses, final local shards and, for the first step, the
    collectives in the graph our passes left and, under inductor, in its code."""
    import simplesharded as ss
    from simplesharded.mesh import build_mesh
    from simplesharded.passes.collectives import count_collectives

    mesh = build_mesh(dp_replicate=1, dp_shard=world, device="cpu")
    counts = {}

    def observe(kind, stage, gm):
        counts[kind] = count_collectives(gm)

    torch._dynamo.reset()
    torch.manual_seed(0)
    # STEP_BLOCKS linears (the Sequential's blocks): few kernels to compile; a bias is 1-D, and
    # inductor drops the no-op view over its gradient
    model = ss.data_parallel(
        torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(STEP_BLOCKS)]),
        mesh, reshard_after_forward=True, storage="ragged")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = ss.compile_step(model, opt, lambda m, x: m(x).tanh().square().mean(),
                           backend=backend, max_norm=0.5, observer=observe)
    g = torch.Generator().manual_seed(rank)
    losses, code = [], None
    for i in range(STEPS):
        batch = (torch.randn(4, 8, generator=g),)
        if i == 0 and backend.startswith("inductor"):
            from torch._inductor.utils import run_and_get_code

            loss, codes = run_and_get_code(step, *batch)
            code = [_code_counts(c) for c in codes]
        else:
            loss = step(*batch)
        losses.append(loss.item())
    params = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    torch._dynamo.reset()
    return dict(losses=losses, params=params, graph_counts=counts["fw"], code_counts=code)


def _plain_torch_inductor(rank, world):
    """torch's own inductor on another (tiny, sharded) model in the same process."""
    import simplesharded as ss
    from simplesharded.mesh import build_mesh
    from torch._inductor.utils import run_and_get_code

    mesh = build_mesh(dp_replicate=1, dp_shard=world, device="cpu")
    torch._dynamo.reset()
    torch.manual_seed(1)
    # two bias-free linears: almost no C++ kernels to compile, two parameters to gather
    model = ss.data_parallel(torch.nn.Sequential(torch.nn.Linear(5, 4, bias=False),
                                                 torch.nn.Linear(4, 6, bias=False)),
                             mesh, "fully_shard")
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    _, codes = run_and_get_code(lambda: compiled(x).sum().backward())
    torch._dynamo.reset()
    return [_code_counts(c) for c in codes]


@functools.lru_cache(maxsize=None)
def _run(job_name):
    if job_name == "aot_job":
        with tempfile.TemporaryDirectory() as tmp:
            return spawn(WORLD, aot_job, tmp, timeout_s=900)
    return spawn(WORLD, globals()[job_name], timeout_s=900)


def _block_counts(n_layers):
    """aot_autograd fw/bw counts after block bucketing: buckets embed, layers, head; the
    backward re-gathers all but the embedding."""
    return {"fw": {"all_gather": n_layers + 2, "reduce_scatter": 0},
            "bw": {"all_gather": n_layers + 1, "reduce_scatter": n_layers + 2}}


def _n_params(n_layers):
    return 1 + 9 * n_layers + 2


def test_aot_eager_bucketing_bitwise():
    ranks = _run("aot_job")
    want = _block_counts(toy_blocks.N_LAYERS)
    n = _n_params(toy_blocks.N_LAYERS)
    for rank, res in enumerate(ranks):
        ref = res["aot_eager"]
        assert ref["graph_counts"]["fw"]["all_gather"] == n
        assert ref["graph_counts"]["bw"]["reduce_scatter"] == n
        blk = res["aot_eager_blockbucketing"]["graph_counts"]
        # gloo's reduce-scatters were lowered to all-to-alls (passes/lowering.py), plain
        # aot_eager's were not
        assert blk["bw"]["all_to_all"] == blk["bw"]["reduce_scatter"] > 0
        assert ref["graph_counts"]["bw"]["all_to_all"] == 0
        # and no gather is the coalesced one, which can corrupt gloo's heap
        # (simplesharded/shims/gloo_gather.py; the functional one runs as gloo's plain all-gather)
        for kind in ("fw", "bw"):
            assert blk[kind]["all_gather_coalesced"] == 0
        for kind in ("fw", "bw"):
            for coll, count in want[kind].items():
                assert blk[kind][coll] == count, (rank, kind, coll, blk[kind])
        auto = res["aot_eager_autobucketing"]["graph_counts"]
        assert 1 <= auto["fw"]["all_gather"] < n and 1 <= auto["bw"]["reduce_scatter"] < n
        for be in AOT[1:]:
            got = res[be]
            assert got["losses"] == ref["losses"], (rank, be, got["losses"], ref["losses"])
            assert got["params"].keys() == ref["params"].keys()
            for name, p in ref["params"].items():
                assert torch.equal(got["params"][name], p), (rank, be, name)
        assert ref["losses"][-1] < ref["losses"][0]  # it trains
    assert ranks[0]["aot_eager"]["losses"] != ranks[1]["aot_eager"]["losses"]  # data differ


def _same_training(got, ref, what):
    assert got["losses"] == ref["losses"], (what, got["losses"], ref["losses"])
    assert got["params"].keys() == ref["params"].keys()
    for name, p in ref["params"].items():
        assert torch.equal(got["params"][name], p), (what, name)


def test_ragged_buckets_train_bitwise_as_without_and_copy_out_nothing():
    """storage="ragged": the same losses and parameters, bit for bit, under both
    bucketing backends, eager and bf16 mixed precision (AdamW, every bucket stepped as one
    tensor); the forward
    graph copies nothing out of its gathers (as many clones as unbucketed aot_eager, whose
    gathers are whole parameters) and concatenates nothing; a DCP checkpoint moves between
    the layouts, and so does the optimizer state. Every toy parameter is in a bucket (ragged
    takes uneven rows)."""
    n = toy_blocks.N_LAYERS
    for rank, res in enumerate(_run("aot_job")):
        for be in RAGGED:
            _same_training(res[be], res["aot_eager" if be != "ragged:eager" else "eager"],
                           (rank, be))
        _same_training(res[RAGGED_BF16[1]], res[RAGGED_BF16[0]], (rank, "bf16"))
        assert res[RAGGED_BF16[1]]["graph_counts"]["fw"]["cat"] == 0
        plain = res["aot_eager"]["graph_counts"]
        ragged = res["ragged:aot_eager_blockbucketing"]["graph_counts"]
        assert ragged["fw"]["all_gather"] == n + 2 and ragged["bw"]["all_gather"] == n + 1
        assert ragged["bw"]["reduce_scatter"] == ragged["bw"]["all_to_all"] == n + 2
        assert ragged["fw"]["cat"] == 0
        assert ragged["fw"]["clone"] == plain["fw"]["clone"], (ragged["fw"], plain["fw"])
        block = res["aot_eager_blockbucketing"]["graph_counts"]
        assert block["fw"]["clone"] - ragged["fw"]["clone"] >= _n_params(n) - 1
        # backward: no cat at all; each gradient is written into its bucket's reduce-scatter
        # input (passes/grads_in_place.py), and the re-gathers have no copy-in
        assert ragged["bw"]["cat"] == ragged["bw"]["copy_"] == 0 < block["bw"]["cat"], ragged
        assert ragged["fw"]["copy_"] == 0, ragged
        dcp = res["dcp_ragged"]
        assert dcp == dict(loaded=True, loaded_back=True, same_output=True,
                           placements=True), (rank, dcp)
        optim = res["optim_ragged"]
        assert optim == dict(same_state=True, same_next_step=True), (rank, optim)


def test_replicate_all_reduce_bucketing_bitwise():
    """Replicate mode: one all-reduce per block instead of one per parameter, same bits."""
    n = _n_params(toy_blocks.N_LAYERS)
    for rank, res in enumerate(_run("aot_replicate_job")):
        ref, blk = res["aot_eager"], res["aot_eager_blockbucketing"]
        assert ref["graph_counts"]["bw"]["all_reduce"] == n
        assert blk["graph_counts"]["bw"]["all_reduce"] == toy_blocks.N_LAYERS + 2
        assert blk["graph_counts"]["bw"]["reduce_scatter"] == 0
        assert blk["losses"] == ref["losses"], (rank, blk["losses"], ref["losses"])
        for name, p in ref["params"].items():
            assert torch.equal(blk["params"][name], p), (rank, name)
        assert ref["losses"][-1] < ref["losses"][0]


def test_inductor_bucketing_matches_aot_eager():
    ranks = _run("inductor_job")
    want = _block_counts(INDUCTOR_LAYERS)
    n = _n_params(INDUCTOR_LAYERS)
    for rank, res in enumerate(ranks):
        ref = res["aot_eager"]
        # inductor's generated code has exactly the collectives our passes left
        auto = res["ragged:inductor_autobucketing"]
        assert [c["all_gather"] for c in auto["code_counts"]] == \
            [auto["graph_counts"]["fw"]["all_gather"], auto["graph_counts"]["bw"]["all_gather"]]
        assert auto["code_counts"][0]["all_gather"] < n
        for be in INDUCTOR:
            got = res[be]
            for s, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
                assert abs(a - b) <= INDUCTOR_TOL * abs(b), (rank, be, s, a, b)
            for name, p in ref["params"].items():
                assert max_rel_diff(got["params"][name], p) <= INDUCTOR_TOL, (rank, be, name)


def test_offload_under_inductor_trains_bitwise_as_without():
    """offload="params" under inductor_autobucketing: every loss and final parameter bit for
    bit those of the same run without offload, and inductor's code copies each bucket's shard
    to the compute device once per gather and each reduced gradient to the host once per
    reduction (the copies stay the custom ops the passes placed)."""
    for rank, res in enumerate(_run("inductor_job")):
        got, ref = res[INDUCTOR_OFFLOAD], res["ragged:inductor_autobucketing"]
        assert got["losses"] == ref["losses"], rank
        assert got["params"].keys() == ref["params"].keys()
        for name, p in ref["params"].items():
            assert torch.equal(got["params"][name], p), (rank, name)
        assert got["code_counts"] == ref["code_counts"], rank
        fw, bw = got["copies"]
        assert fw.pop("led") > 0 and bw.pop("led") > 0, rank  # issued a copy ahead
        assert bw.pop("input_waits") == 0 and fw.pop("input_waits") == 0, rank
        assert fw == {"to_compute": ref["code_counts"][0]["all_gather"], "to_host": 0}, rank
        assert bw == {"to_compute": ref["code_counts"][1]["all_gather"],
                      "to_host": ref["code_counts"][1]["reduce_scatter"]}, rank


def test_optimizer_offload_under_inductor_trains_bitwise_as_without():
    """offload="optimizer" under inductor_autobucketing: every loss and final parameter bit
    for bit those of the same run without offload; inductor's forward waits for each bucket's
    resident copy (a graph input, refreshed before the forward on the copy stream) once per
    gather, copies nothing to the compute device, and backward copies each reduced gradient
    to the host once per reduction."""
    for rank, res in enumerate(_run("inductor_job")):
        got, ref = res[INDUCTOR_OFFLOAD_OPTIMIZER], res["ragged:inductor_autobucketing"]
        assert got["losses"] == ref["losses"], rank
        for name, p in ref["params"].items():
            assert torch.equal(got["params"][name], p), (rank, name)
        assert got["code_counts"] == ref["code_counts"], rank
        fw, bw = got["copies"]
        assert fw == {"to_compute": 0, "to_host": 0, "led": 0,
                      "input_waits": ref["code_counts"][0]["all_gather"]}, rank
        assert bw["to_compute"] == 0, rank
        assert bw["to_host"] == ref["code_counts"][1]["reduce_scatter"], rank


def test_ragged_buckets_under_inductor():
    """storage="ragged" under inductor_autobucketing: inductor's code has one gather and one
    reduction per block, as the block plan buckets per-parameter shards (a ragged bucket is a
    block's, and no plan merges it), and the forward graph handed to inductor concatenates
    nothing."""
    want = _block_counts(INDUCTOR_LAYERS)
    for rank, res in enumerate(_run("inductor_job")):
        ragged = res["ragged:inductor_autobucketing"]
        assert ragged["code_counts"] == [want["fw"], want["bw"]], (rank, ragged["code_counts"])
        assert ragged["graph_counts"]["fw"]["cat"] == 0, rank


@needs_torch(STEP_GRAPH)
def test_step_graph_under_inductor_matches_aot_eager():
    """compile_step with inductor_blockbucketing (ragged buckets, clipping, AdamW): inductor's
    code issues the bucketed collectives our passes left in the step graph (one gather per
    block in forward, re-gathers in backward, one reduce-scatter per block), as the aot_eager
    step graph holds them, and training matches the aot_eager step graph within
    INDUCTOR_TOL."""
    for rank, res in enumerate(_run("inductor_job")):
        ref, got = (res["step"][be] for be in STEP_BACKENDS)
        assert ref["graph_counts"]["reduce_scatter"] == STEP_BLOCKS, ref["graph_counts"]
        assert STEP_BLOCKS < ref["graph_counts"]["all_gather"] < 2 * STEP_BLOCKS
        # inductor's joint passes drop the views a traced backward's reductions are found by,
        # unless these are annotated before them: then nothing would be bucketed
        assert got["graph_counts"] == ref["graph_counts"], rank
        (code,) = got["code_counts"]  # one graph: no separate backward
        assert code == {k: got["graph_counts"][k] for k in code}, (rank, code)
        for s, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            assert abs(a - b) <= INDUCTOR_TOL * abs(b), (rank, s, a, b)
        for name, p in ref["params"].items():
            assert max_rel_diff(got["params"][name], p) <= INDUCTOR_TOL, (rank, name)


def test_inductor_keeps_our_collective_order():
    """Inductor's generated code issues and waits for every collective where our passes put it
    among the matmuls (the kernels that map one-to-one to graph nodes), forward and backward.
    Both graphs overlap something (a start with a matmul before its wait), so an order that
    sank every start down to its wait would fail here."""
    for rank, res in enumerate(_run("inductor_job")):
        for be in INDUCTOR:
            got = res[be]
            for kind, code in zip(("fw", "bw"), got["code_orders"]):
                ours = got["graph_orders"][kind]
                assert code == ours, (f"rank {rank} {be} {kind}: inductor's order differs\n"
                                      f" ours:     {format_order(ours)}\n"
                                      f" inductor: {format_order(code)}")
                assert overlapped(ours), (rank, be, kind, format_order(ours))


def test_inductor_hooks_restored_after_compile():
    ranks = _run("inductor_job")
    for rank, res in enumerate(ranks):
        for be, hooks in res["hooks_after"].items():
            assert hooks == (None, None), (rank, be, hooks)
        # our pipeline ran for the bucketing backends (joint once, fw + bw graphs) ...
        assert res["calls_before_plain"]["joint"] >= 2
        assert res["calls_before_plain"]["graph"] >= 4
        # ... and not at all for torch's own inductor on another model afterwards,
        assert res["calls_after_plain"] == res["calls_before_plain"], rank
        # whose code keeps one all-gather and one reduce-scatter per parameter (2 each)
        fw, bw = res["plain_torch"]
        assert fw == {"all_gather": 2, "reduce_scatter": 0}, fw
        assert bw["all_gather"] in (0, 2) and bw["reduce_scatter"] == 2, bw
