"""Multi-process tests that read the real compiled graphs (aot_eager) of the toy model.

A capture backend (our ``PassPipeline`` with the recompute joint pass, as in
``make_backend("aot_eager")``, plus a graph pass that records every graph) gives the
partitioned forward and backward graphs. From them we count collectives and inspect the
tensors saved for backward: the forward graph's outputs after the user outputs, which are the
backward graph's non-tangent inputs.

All checks of one world size run in one spawn (``_results(world)``, cached); each test then
asserts on its part, so a failing check fails (or xfails) only its own test.
"""
from __future__ import annotations

import functools
import glob
import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist

import toy
from dist_utils import build_mesh_for, max_rel_diff, memo, spawn

pytestmark = pytest.mark.slow

N_PARAMS = 19  # inp.weight + 4 blocks × (fc1, fc2) × (weight, bias) + head.weight/bias
# Parameters whose gathered value the backward needs: every weight (grad of its input =
# grad_out @ W) except inp.weight, whose input is the data (no grad wanted). Biases are never
# needed (grad_bias = sum of grad_out).
BACKWARD_PARAMS = {f"blocks.{i}.fc{j}.weight" for i in range(toy.N_BLOCKS) for j in (1, 2)} | {
    "head.weight"}
TIGHT = 1e-6  # fp32 aot_eager vs eager reference: only the order of the gradient sum differs


# ------------------------------------------------------------------ helpers run in the ranks


def _capture_compile(model):
    """torch.compile with aot_eager + our recompute pass + a pass recording (fw, bw) graphs."""
    from simplesharded.passes.pipeline import PassPipeline, aot_backend
    from simplesharded.passes.plans import BlockPlan
    from simplesharded.passes.recompute import tag_gathers_for_recompute

    graphs = []

    def record(gm):
        graphs.append(gm)
        return gm

    recompute = functools.partial(tag_gathers_for_recompute, plan=BlockPlan())
    pipeline = PassPipeline(joint=[("recompute", recompute)],
                            graph=[("capture", record)])
    return torch.compile(model, backend=aot_backend(pipeline), fullgraph=True), graphs


def _fw_bw(graphs):
    from simplesharded.passes.collectives import is_backward_graph

    # Training forward graphs take ``primals_*``; an inference-only graph (e.g. the
    # mixed-precision input cast hook, compiled as its own frame) takes ``arg*`` and is skipped.
    fw = [g for g in graphs if not is_backward_graph(g) and any(
        n.op == "placeholder" and n.name.startswith("primals") for n in g.graph.nodes)]
    bw = [g for g in graphs if is_backward_graph(g)]
    assert len(fw) == 1 and len(bw) == 1, (
        f"expected one training fw and one bw graph, got {len(fw)} + {len(bw)} "
        f"of {len(graphs)} graphs")
    return fw[0], bw[0]


def _gather_derived(fw) -> dict:
    """node → True when its value is computed only from all-gathers (gather, wait, slices,
    views, casts, transposes of a gathered parameter), i.e. it is a gathered parameter."""
    from simplesharded.passes.collectives import ALL_GATHER

    derived = {}
    for n in fw.graph.nodes:
        if n.op == "call_function" and n.target is ALL_GATHER:
            derived[n] = True
        elif n.op == "call_function":
            ins = n.all_input_nodes
            derived[n] = bool(ins) and all(derived.get(a, False) for a in ins)
        else:
            derived[n] = False
    return derived


def _summarize(graphs, model) -> dict:
    """Picklable facts about the captured forward/backward graphs."""
    from simplesharded.passes.collectives import count_collectives, find_collectives

    fw, bw = _fw_bw(graphs)
    derived = _gather_derived(fw)
    outputs = list(next(n for n in fw.graph.nodes if n.op == "output").args[0])
    bw_inputs = [n for n in bw.graph.nodes if n.op == "placeholder"]
    saved_in_bw = [n for n in bw_inputs if not n.name.startswith("tangents")]
    saved = outputs[len(outputs) - len(saved_in_bw):]

    def shape(n):
        v = n.meta.get("val") if hasattr(n, "meta") else None
        return tuple(v.shape) if isinstance(v, torch.Tensor) else None

    assert [shape(n) for n in saved] == [shape(n) for n in saved_in_bw]
    gathered_shapes = set()
    for _, p in model.named_parameters():
        if p.to_local().numel() < p.numel():  # sharded: its full shape only exists gathered
            gathered_shapes |= {tuple(p.shape), tuple(reversed(p.shape))}

    def colls(gm):
        return [dict(kind=c.kind, params=list(c.params), dtype=c.dtype, group_size=c.group_size,
                     group_name=c.group_name, nbytes=c.nbytes,
                     in_dtype=c.start.args[0].meta["val"].dtype)
                for c in find_collectives(gm)]

    return dict(
        fw_counts=count_collectives(fw), bw_counts=count_collectives(bw),
        fw_colls=colls(fw), bw_colls=colls(bw),
        # full_param_shape: a computed (non-input) tensor shaped like a full sharded parameter.
        # Inputs (placeholders) are shards or data, and an uneven shard (e.g. 3 of fc1's 7
        # rows) may share a full parameter's shape (head.weight), so they are not counted.
        saved=[dict(name=n.name, shape=shape(n), gathered=bool(derived.get(n)),
                    input=n.op == "placeholder",
                    full_param_shape=n.op != "placeholder" and shape(n) in gathered_shapes)
               for n in saved if isinstance(n, torch.fx.Node)],
        gathered_shapes=gathered_shapes,
        shard_bytes=sorted(p.to_local().numel() * p.to_local().element_size()
                           for p in model.parameters()))


def _reference_grads(world, tied=False, step=0, model=None):
    model = model or toy.make_model(tied=tied)
    x, y = toy.global_batch(world, step)
    loss = toy.loss_fn(model(x), y, x.shape[0] * toy.D_OUT)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _sharded_step(cm, model, rank, world, step=0):
    """One forward/backward on this rank's data; (global loss, full grads) — collective."""
    x, y = toy.rank_batch(rank, step)
    loss = toy.loss_fn(cm(x), y, world * x.shape[0] * toy.D_OUT)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item(), {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}


def _diffs(got, ref):
    assert got.keys() == ref.keys()
    return {n: max_rel_diff(got[n], ref[n]) for n in ref}


def _wrap(mesh, mode, **kw):
    """data_parallel on the toy; gradients summed over ranks unless told (the loss is
    normalised by the global element count, see _sharded_step)."""
    import simplesharded as ss
    kw.setdefault("grad_reduction", "sum")
    kw.setdefault("storage", "param")  # the bucketing pass's counts are read
    return ss.data_parallel(toy.make_model(tied=kw.pop("tied", False)), mesh, mode, **kw)


# ------------------------------------------------------------------ checks (run in every rank)


def check_fully_shard_reshard(rank, world, meshes):
    """reshard_after_forward=True; also cross-checks make_backend's dump_graphs counts."""
    import simplesharded as ss

    model = _wrap(meshes["fully_shard"], "fully_shard", reshard_after_forward=True)
    cm, graphs = _capture_compile(model)
    loss, grads = _sharded_step(cm, model, rank, world)
    out = _summarize(graphs, model)
    ref_loss, ref_grads = _reference_grads(world)
    out.update(loss=(loss, ref_loss), grad_diffs=_diffs(grads, ref_grads))
    # the registered backend produces the same graphs
    torch._dynamo.reset()
    with tempfile.TemporaryDirectory() as d:
        model2 = _wrap(meshes["fully_shard"], "fully_shard", reshard_after_forward=True)
        cm2 = torch.compile(model2, backend=ss.make_backend("aot_eager", dump_graphs=d),
                            fullgraph=True)
        _sharded_step(cm2, model2, rank, world)
        firsts = {}
        for kind in ("fw", "bw"):
            files = sorted(glob.glob(os.path.join(d, f"*_{kind}_input.txt")))
            with open(files[-1]) as f:
                firsts[kind] = f.readline().strip()
        out["dump_first_lines"] = firsts
    return out


def check_fully_shard_no_reshard(rank, world, meshes):
    model = _wrap(meshes["fully_shard"], "fully_shard", reshard_after_forward=False)
    cm, graphs = _capture_compile(model)
    loss, grads = _sharded_step(cm, model, rank, world)
    out = _summarize(graphs, model)
    ref_loss, ref_grads = _reference_grads(world)
    out.update(loss=(loss, ref_loss), grad_diffs=_diffs(grads, ref_grads))
    return out


def check_replicate(rank, world, meshes):
    model = _wrap(meshes["fully_shard"], "replicate")
    cm, graphs = _capture_compile(model)
    _sharded_step(cm, model, rank, world)
    return _summarize(graphs, model)


def check_hybrid(rank, world, meshes):
    model = _wrap(meshes["hybrid_shard"], "hybrid_shard", reshard_after_forward=True)
    cm, graphs = _capture_compile(model)
    loss, grads = _sharded_step(cm, model, rank, world)
    out = _summarize(graphs, model)
    ref_loss, ref_grads = _reference_grads(world)
    out.update(loss=(loss, ref_loss), grad_diffs=_diffs(grads, ref_grads))
    return out


def check_mixed_precision(rank, world, meshes):
    import simplesharded as ss

    mp = ss.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                 output_dtype=torch.float32)
    model = _wrap(meshes["fully_shard"], "fully_shard", mp_policy=mp, reshard_after_forward=True)
    cm, graphs = _capture_compile(model)
    x, y = toy.rank_batch(rank)
    out_t = cm(x)
    loss = toy.loss_fn(out_t, y, world * x.shape[0] * toy.D_OUT)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    out = _summarize(graphs, model)
    ref_loss, ref_grads = _reference_grads(world)
    out.update(loss=(total.item(), ref_loss), grad_diffs=_diffs(grads, ref_grads),
               output_dtype=out_t.dtype,
               grad_dtypes={n: (p.grad.dtype, p.grad.to_local().dtype)
                            for n, p in model.named_parameters()},
               param_dtypes={n: p.to_local().dtype for n, p in model.named_parameters()})
    return out


def check_uneven(rank, world, meshes):
    model = _wrap(meshes["fully_shard"], "fully_shard")
    ref = toy.make_model()
    init_equal = all(torch.equal(p.full_tensor(), r)
                     for (_, p), r in zip(model.named_parameters(), ref.parameters()))
    rows = {n: p.to_local().shape[0] for n, p in model.named_parameters()}
    cm, graphs = _capture_compile(model)
    loss, grads = _sharded_step(cm, model, rank, world)
    ref_loss, ref_grads = _reference_grads(world)
    grad_rows = {n: p.grad.to_local().shape[0] for n, p in model.named_parameters()}
    # one SGD step on the shards, then compare the full parameters with the reference's
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-0.1)
        stepped = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
        ref_stepped = {n: r - 0.1 * ref_grads[n] for n, r in ref.named_parameters()}
    return dict(init_equal=init_equal, rows=rows, grad_rows=grad_rows, loss=(loss, ref_loss),
                grad_diffs=_diffs(grads, ref_grads), step_diffs=_diffs(stepped, ref_stepped),
                counts=_summarize(graphs, model)["fw_counts"])


def check_tied(rank, world, meshes):
    model = _wrap(meshes["fully_shard"], "fully_shard", tied=True)
    first, last = model.blocks[0].fc2, model.blocks[-1].fc2
    one_shard = first._parameters["weight"] is last._parameters["weight"]
    cm, graphs = _capture_compile(model)
    loss, grads = _sharded_step(cm, model, rank, world)
    summary = _summarize(graphs, model)
    ref_loss, ref_grads = _reference_grads(world, tied=True)
    # an untied model with equal values in both copies: the tied grad is the sum of theirs
    untied = toy.make_model(tied=True)
    untied.blocks[-1].fc2.weight = torch.nn.Parameter(untied.blocks[0].fc2.weight.detach().clone())
    _, untied_grads = _reference_grads(world, model=untied)
    return dict(one_shard=one_shard, n_params=len(list(model.parameters())),
                names=[n for n, _ in model.named_parameters()],
                sd_keys=list(model.state_dict()), ref_sd_keys=list(
                    toy.make_model(tied=True).state_dict()),
                loss=(loss, ref_loss), grad_diffs=_diffs(grads, ref_grads),
                tied_grad=grads["blocks.0.fc2.weight"],
                untied_sum=untied_grads["blocks.0.fc2.weight"]
                + untied_grads["blocks.3.fc2.weight"],
                fw_counts=summary["fw_counts"], bw_counts=summary["bw_counts"])


def check_meta_init(rank, world, meshes):
    import simplesharded as ss
    from torch.distributed.tensor import DTensor

    with torch.device("meta"):
        model = toy.Toy()
    ss.data_parallel(model, meshes["fully_shard"], "fully_shard", grad_reduction="sum", storage="param")
    with ss.disable_gather(model):
        model.init_weights(seed=0)
    ref = toy.make_model(seed=0)
    out = dict(
        placement_ok=all(isinstance(p, DTensor) and p.to_local().device.type == "cpu"
                         and not p.is_meta for p in model.parameters()),
        finite=all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters()),
        equals_reference=all(torch.equal(p.full_tensor(), r)
                             for p, r in zip(model.parameters(), ref.parameters())))
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    cm = torch.compile(model, backend=ss.make_backend("aot_eager"), fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss, _ = _sharded_step(cm, model, rank, world)
    opt.step()
    ref_loss, _ = _reference_grads(world)
    after = {n: p.full_tensor() for n, p in model.named_parameters()}
    out.update(loss=(loss, ref_loss),
               trained_finite=all(bool(torch.isfinite(t).all()) for t in after.values()),
               all_changed=all(not torch.equal(after[n], before[n]) for n in before))
    return out


def check_avg(rank, world, meshes):
    mode = "hybrid_shard" if "hybrid_shard" in meshes else "fully_shard"
    grads = {}
    for red in ("sum", "avg"):
        torch._dynamo.reset()
        model = _wrap(meshes[mode], mode, grad_reduction=red)
        cm, graphs = _capture_compile(model)
        _, grads[red] = _sharded_step(cm, model, rank, world)
    def scaled(graphs):  # the shapes "avg"'s 1/world multiplications run on
        _, bw = _fw_bw(graphs)
        return sorted(tuple(n.meta["val"].shape) for n in bw.graph.nodes
                      if n.target is torch.ops.aten.mul.Tensor and n.args[1] == 1 / world)

    out = dict(mode=mode, sum=grads["sum"], avg=grads["avg"], scaled=scaled(graphs),
               shards=sorted(tuple(p.to_local().shape) for p in model.parameters()))
    if world == 2:  # reduced in float16: scaled before the sum, which could overflow first
        import simplesharded as ss

        torch._dynamo.reset()
        model = _wrap(meshes[mode], mode, grad_reduction="avg",
                      mp_policy=ss.MixedPrecisionPolicy(reduce_dtype=torch.float16))
        cm, graphs = _capture_compile(model)
        _, out["avg16"] = _sharded_step(cm, model, rank, world)
        out["scaled16"] = scaled(graphs)
        out["full"] = sorted(tuple(p.shape) for p in model.parameters())
    return out


CHECKS = {
    2: [check_fully_shard_reshard, check_fully_shard_no_reshard, check_replicate,
        check_mixed_precision, check_uneven, check_tied, check_meta_init, check_avg],
    4: [check_hybrid, check_uneven, check_avg],
}


def graph_job(rank, world):
    meshes = {"fully_shard": build_mesh_for(world, "fully_shard")}
    if world == 4:
        meshes["hybrid_shard"] = build_mesh_for(world, "hybrid_shard")
    out = {}
    for check in CHECKS[world]:
        torch._dynamo.reset()
        try:
            out[check.__name__] = ("ok", check(rank, world, meshes))
        except Exception:  # noqa: BLE001 - reported by the test that reads this check
            out[check.__name__] = ("error", traceback.format_exc())
        dist.barrier()
    return out


# ------------------------------------------------------------------ tests (parent process)


@memo
def _results(world):
    return spawn(world, graph_job, timeout_s=240)


def result(world, check, rank=None):
    """The value a check returned on every rank (or one rank); its traceback if it raised."""
    per_rank = [r[check] for r in _results(world)]
    for r, (status, value) in enumerate(per_rank):
        if status == "error":
            pytest.fail(f"{check} raised on rank {r}:\n{value}", pytrace=False)
    values = [v for _, v in per_rank]
    return values if rank is None else values[rank]


def assert_close_loss(pair, tol=TIGHT):
    got, ref = pair
    assert abs(got - ref) <= tol * abs(ref), f"loss {got!r} vs reference {ref!r}"


def assert_grads(diffs, tol=TIGHT):
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= tol, f"grad of {worst}: rel diff {diffs[worst]:.3g} > {tol:g}"


def kinds(ag: int = 0, rs: int = 0, ar: int = 0) -> dict[str, int]:
    """count_collectives' answer: these counts, and no all-to-all (no expert parallelism)."""
    return {"all_gather": ag, "reduce_scatter": rs, "all_reduce": ar, "all_to_all": 0}


def test_fully_shard_counts_reshard_after_forward():
    for r in result(2, "check_fully_shard_reshard"):
        assert r["fw_counts"] == kinds(ag=N_PARAMS)
        assert r["bw_counts"] == kinds(ag=len(BACKWARD_PARAMS), rs=N_PARAMS)
        # each forward gather serves one distinct parameter; backward re-gathers the weights
        fw_params = [c["params"] for c in r["fw_colls"] if c["kind"] == "all_gather"]
        assert sorted(p for ps in fw_params for p in ps) == sorted(
            n for n, _ in toy.make_model().named_parameters())
        bw_params = {p for c in r["bw_colls"] if c["kind"] == "all_gather" for p in c["params"]}
        assert bw_params == BACKWARD_PARAMS
        assert all(c["group_size"] == 2 for c in r["fw_colls"] + r["bw_colls"])
        assert_close_loss(r["loss"])
        assert_grads(r["grad_diffs"])


def test_make_backend_dump_matches_captured_counts():
    r = result(2, "check_fully_shard_reshard", rank=0)
    assert r["dump_first_lines"]["fw"] == f"# collectives: {r['fw_counts']}"
    assert r["dump_first_lines"]["bw"] == f"# collectives: {r['bw_counts']}"


def test_fully_shard_counts_no_reshard():
    for r in result(2, "check_fully_shard_no_reshard"):
        assert r["fw_counts"] == kinds(ag=N_PARAMS)
        assert r["bw_counts"] == kinds(rs=N_PARAMS)
        assert_close_loss(r["loss"])
        assert_grads(r["grad_diffs"])


def test_saved_tensors_reshard_after_forward():
    """True → no gathered parameter is saved for backward (by provenance and by shape)."""
    for r in result(2, "check_fully_shard_reshard"):
        gathered = [s for s in r["saved"] if s["gathered"] or s["full_param_shape"]]
        assert not gathered, f"gathered parameters saved for backward: {gathered}"
        assert r["saved"], "nothing saved at all?"


def test_saved_tensors_no_reshard():
    """False → exactly the gathered parameters the backward needs are saved (full shape)."""
    for r in result(2, "check_fully_shard_no_reshard"):
        gathered = [s for s in r["saved"] if s["gathered"]]
        assert len(gathered) == len(BACKWARD_PARAMS), r["saved"]
        assert all(s["full_param_shape"] for s in gathered), gathered
        # and nothing else of a full parameter's shape sneaks in
        assert all(s["gathered"] for s in r["saved"] if s["full_param_shape"])


def test_replicate_counts():
    for r in result(2, "check_replicate"):
        assert r["fw_counts"] == kinds()
        assert r["bw_counts"] == kinds(ar=N_PARAMS)


def test_hybrid_counts_and_grads():
    for r in result(4, "check_hybrid"):
        assert r["fw_counts"] == kinds(ag=N_PARAMS)
        assert r["bw_counts"] == kinds(ag=len(BACKWARD_PARAMS), rs=N_PARAMS, ar=N_PARAMS)
        # gathers and reduce-scatters run over dp_shard, all-reduces over dp_replicate: two
        # different groups of 2 ranks each
        colls = r["fw_colls"] + r["bw_colls"]
        assert {c["group_size"] for c in colls} == {2}
        groups = {k: {c["group_name"] for c in colls if c["kind"] == k}
                  for k in ("all_gather", "reduce_scatter", "all_reduce")}
        assert len(groups["all_gather"]) == 1 and groups["reduce_scatter"] == groups["all_gather"]
        assert len(groups["all_reduce"]) == 1 and groups["all_reduce"] != groups["all_gather"]
        # HSDP order: reduce-scatter over dp_shard first, then all-reduce the *shard* over
        # dp_replicate (1/dp_shard of the bytes of all-reducing the full gradient): one
        # all-reduce per parameter, each of exactly this rank's (unpadded) shard size
        ar_bytes = sorted(c["nbytes"] for c in r["bw_colls"] if c["kind"] == "all_reduce")
        assert ar_bytes == r["shard_bytes"], (ar_bytes, r["shard_bytes"])
        gathered = [s for s in r["saved"] if s["gathered"] or s["full_param_shape"]]
        assert not gathered, gathered
        assert_close_loss(r["loss"])
        assert_grads(r["grad_diffs"])


def test_mixed_precision_dtypes():
    for r in result(2, "check_mixed_precision"):
        fw_ag = [c for c in r["fw_colls"] if c["kind"] == "all_gather"]
        bw_ag = [c for c in r["bw_colls"] if c["kind"] == "all_gather"]
        bw_rs = [c for c in r["bw_colls"] if c["kind"] == "reduce_scatter"]
        assert len(fw_ag) == N_PARAMS and len(bw_rs) == N_PARAMS
        # the shard is cast before the gather: gather input and output are bf16
        assert {(c["in_dtype"], c["dtype"]) for c in fw_ag + bw_ag} == {
            (torch.bfloat16, torch.bfloat16)}
        # gradients are reduced in fp32
        assert {(c["in_dtype"], c["dtype"]) for c in bw_rs} == {(torch.float32, torch.float32)}
        assert r["output_dtype"] == torch.float32  # the policy's output_dtype
        assert set(r["grad_dtypes"].values()) == {(torch.float32, torch.float32)}
        assert set(r["param_dtypes"].values()) == {torch.float32}
        assert not [s for s in r["saved"] if s["gathered"]]


def test_mixed_precision_loose_parity():
    # bf16 has an 8-bit mantissa (rel. rounding 2^-9 ≈ 2e-3) and every matmul input is
    # rounded; through 4 residual blocks we observe loss within 1.3e-3 and grads within 1.8e-2
    # of the fp32 reference (relative to each tensor's max). Allow 2e-2 / 5e-2.
    r = result(2, "check_mixed_precision", rank=0)
    assert_close_loss(r["loss"], tol=2e-2)
    assert_grads(r["grad_diffs"], tol=5e-2)


@pytest.mark.parametrize("world", [2, 4])
def test_uneven_dim0(world):
    res = result(world, "check_uneven")
    # torch.chunk semantics: 7 rows → 4+3 over 2 ranks, 2+2+2+1 over 4; head 3 rows → 2+1 and
    # 1+1+1+0 (one rank holds an empty shard)
    expect = {2: {"fc1": [4, 3], "head": [2, 1]}, 4: {"fc1": [2, 2, 2, 1], "head": [1, 1, 1, 0]}}
    for name in ("blocks.0.fc1.weight", "blocks.3.fc1.bias"):
        assert [r["rows"][name] for r in res] == expect[world]["fc1"], name
        assert [r["grad_rows"][name] for r in res] == expect[world]["fc1"], name
    for name in ("head.weight", "head.bias"):
        assert [r["rows"][name] for r in res] == expect[world]["head"], name
    for r in res:
        assert r["init_equal"]
        assert r["counts"]["all_gather"] == N_PARAMS
        assert_close_loss(r["loss"])
        assert_grads(r["grad_diffs"])
        assert_grads(r["step_diffs"])


def test_tied_parameters():
    for r in result(2, "check_tied"):
        assert r["one_shard"]
        assert r["n_params"] == N_PARAMS - 1
        assert r["sd_keys"] == r["ref_sd_keys"]
        assert "blocks.3.fc2.weight" in r["sd_keys"] and "blocks.3.fc2.weight" not in r["names"]
        # the shared shard is read by two modules and gathered once per forward; autograd
        # sums the two gradients at full size and reduces the sum once (the sum before the
        # reduction reorders additions, hence rounding-level differences, not bitwise)
        assert r["fw_counts"]["all_gather"] == N_PARAMS - 1, r["fw_counts"]
        assert r["bw_counts"]["reduce_scatter"] == N_PARAMS - 1, r["bw_counts"]
        assert_close_loss(r["loss"])
        assert_grads(r["grad_diffs"])
        assert max_rel_diff(r["tied_grad"], r["untied_sum"]) <= TIGHT


def test_meta_device_init():
    for r in result(2, "check_meta_init"):
        assert r["placement_ok"] and r["finite"]
        assert r["equals_reference"]  # disable_gather let init write into the shards
        assert_close_loss(r["loss"])
        assert r["trained_finite"] and r["all_changed"]


@pytest.mark.parametrize("world", [2, 4])
def test_grad_reduction_avg(world):
    for r in result(world, "check_avg"):
        assert r["mode"] == ("hybrid_shard" if world == 4 else "fully_shard")
        for n in r["sum"]:
            # scaling by 1/world (a power of two here) is exact in fp
            torch.testing.assert_close(r["avg"][n] * world, r["sum"][n], rtol=0, atol=0,
                                       msg=lambda m: f"{n}: {m}")
        # the scale runs once per parameter on its reduced shard, not on the full gradient,
        # unless the gradient is reduced in float16 (then on the full one, before the sum)
        assert r["scaled"] == r["shards"]
        if world == 2:
            assert r["scaled16"] == r["full"]
            for n in r["sum"]:
                torch.testing.assert_close(r["avg16"][n] * world, r["sum"][n], rtol=2e-3,
                                           atol=1e-4, msg=lambda m: f"{n}: {m}")
