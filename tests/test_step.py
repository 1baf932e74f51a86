"""compile_step (simplesharded/step/__init__.py, optim_update.py): forward, loss, backward and the
optimizer's step (AdamW, Adam, SGD) in one compiled graph, against the split step (the same
model compiled with the same backend, ``loss.backward()``, eager ``optimizer.step()``,
``zero_grad()``).

One spawn of 2 gloo ranks runs every case (``_job``), each on its model: a small Llama 3 (2
blocks), the GPT whose blocks sit in a ModuleDict and whose output projection is tied to the
embedding (models/gpt.py), or transformers' LlamaForCausalLM, and the skipping of
non-finite steps (``skip_nonfinite``) against the split step that skips the same ones; the
tests read its results.
Graph tests on a fake world of 2: the step graph's collectives, update placement, resharding
and notes. Single-process tests: the traced update alone against torch's eager one, and the
errors.
"""
from __future__ import annotations

import collections
import functools
import math
import warnings

import pytest
import torch

from dist_utils import max_rel_diff, spawn
from simplesharded.passes.torch_compat import STEP_GRAPH
from torch_range import needs_torch

STEPS = 10
MAX_NORM = 0.3  # below every step's gradient norm here: clipping acts at each step
# (name, model, backend, optimizer class, weight_decay, (max_norm, clip_norm) or None,
#  micro-batches per step)
CASES = [
    ("tied_gpt_aot_eager_adamw_accumulation2", "gpt", "aot_eager", "AdamW", 0.1, None, 2),
    ("hf_llama_blockbucketing_adam_l2_clip_previous", "hf_llama", "aot_eager_blockbucketing",
     "Adam", 0.01, (MAX_NORM, "previous"), 1),
    ("llama3_blockbucketing_sgd_nesterov_clip", "llama3", "aot_eager_blockbucketing", "SGD",
     0.01, (MAX_NORM, "current"), 1),
]
# The options an optimizer of CASES gets besides lr and weight_decay.
OPT_OPTIONS = {"SGD": {"momentum": 0.9, "nesterov": True}}
BITWISE = [c[0] for c in CASES if c[5] is None]
CLIPPED = [c[0] for c in CASES if c[5] is not None]
SHAPES = dict(dim=64, n_layers=2, n_heads=4, vocab_size=128)
# A moment update's lerp: in place after passes/update_inplace.py, functional before it.
LERP = (torch.ops.aten.lerp.Scalar, torch.ops.aten.lerp_.Scalar)


def _plain_model(name="llama3", ac="none"):
    """``ac``: activation checkpointing's mode, as the trainer applies it under compile (every
    block's forward annotated, simplesharded/trainer/recipe.py)."""
    from simplesharded.models import build_model
    from simplesharded.trainer.recipe import apply_activation_checkpointing

    torch.manual_seed(0)
    kv = {} if name == "gpt" else {"n_kv_heads": 2}
    model = build_model(name, "debug", device="cpu", **SHAPES, **kv)
    apply_activation_checkpointing(model, ac, every=1)
    return model


def _model(mesh, name="llama3", ac="none", **dp_options):
    import simplesharded as ss

    dp_options.setdefault("storage", "param")  # the bucketing pass's graphs are read
    return ss.data_parallel(_plain_model(name, ac), mesh, **dp_options)


def _loss(model, tokens, labels):
    from simplesharded.models import logits_of

    logits = logits_of(model(tokens))  # a tensor, or transformers' output object
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _summed_loss(model, tokens, labels):  # llama3's own loss, as pass_utils.capture_graphs
    return model(tokens, labels) / labels.numel()


def _batches(rank):
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return [torch.randint(0, 128, (2, 16), generator=g) for _ in range(STEPS)]


def _lr(i):  # a schedule: the step graph takes it as an input, nothing recompiles
    return 1e-2 * (0.9 ** i)


def _case(rank, mesh, model_name, backend, opt_name, wd, clip, accumulation):
    import simplesharded as ss

    opt_cls = getattr(torch.optim, opt_name)
    batches = _batches(rank)
    # The split step: today's recipe.
    ref = _model(mesh, model_name)
    ref_c = torch.compile(ref, backend=ss.make_backend(backend), fullgraph=True)
    options = OPT_OPTIONS.get(opt_name, {})
    ref_opt = opt_cls(ref.parameters(), lr=_lr(0), weight_decay=wd, foreach=False, **options)
    max_norm, clip_norm = clip or (None, None)
    ref_losses, ref_norms, last_norm = [], [], None
    for i, b in enumerate(batches):
        ref_opt.param_groups[0]["lr"] = _lr(i)
        loss = 0.0
        for micro in b.chunk(accumulation):  # .grad accumulates over the micro-batches
            part = _loss(ref_c, micro, micro)
            part.backward()
            loss = loss + part.detach()
        if clip_norm == "current":
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        elif clip_norm == "previous":  # the first step is not clipped
            norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
            if last_norm is not None:
                torch.nn.utils.clip_grads_with_norm_(ref.parameters(), max_norm, last_norm)
            last_norm = norm
        if clip is not None:
            ref_norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    # The step graph.
    torch._dynamo.reset()
    model = _model(mesh, model_name)
    opt = opt_cls(model.parameters(), lr=_lr(0), weight_decay=wd, **options)
    step = ss.compile_step(model, opt, _loss, backend=backend, max_norm=max_norm,
                           clip_norm=clip_norm or "current", accumulation_steps=accumulation)
    losses = []
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for i, b in enumerate(batches):
        opt.param_groups[0]["lr"] = _lr(i)
        losses.append(step(b, b).item())
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    ref_state, state = ref_opt.state_dict()["state"], opt.state_dict()["state"]
    return {
        "losses": losses, "ref_losses": ref_losses, "ref_norms": ref_norms, "graphs": graphs,
        "param_rel": max(max_rel_diff(b.to_local(), a.to_local())
                         for a, b in zip(ref.parameters(), model.parameters())),
        "params_equal": [torch.equal(a.to_local(), b.to_local())
                         for a, b in zip(ref.parameters(), model.parameters())],
        "max_abs_diff": max((a.to_local() - b.to_local()).abs().max().item()
                            for a, b in zip(ref.parameters(), model.parameters())),
        "state_equal": all(torch.equal(_local(ref_state[k][n]), _local(state[k][n]))
                           for k in ref_state for n in ref_state[k]),
        "grads_none": all(p.grad is None for p in model.parameters()),
    }


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


AC_STEPS = 3
# Per rank and step: 256 tokens, so the blocks' activations outweigh the shards and the state.
AC_BATCH = (4, 64)
AC_RUNS = ("full", "none")  # activation checkpointing


def _ac_case(rank, mesh):
    """The step graph with activation checkpointing of every block (as the trainer annotates
    it under compile; passes/step_recompute.py) and without. Per run: the losses of
    ``AC_STEPS`` steps, the parameters after them, and then the peak of live tensor bytes of
    one whole step (forward, backward, update; bench_run._step_peak_bytes: shards and
    optimizer state included). Against the split step with the same checkpointing:
    test_trainer_step_scope_trains_as_model_scope."""
    import simplesharded as ss
    from simplesharded.tools.bench_run import _step_peak_bytes

    g = torch.Generator().manual_seed(200 + rank)
    batches = [torch.randint(0, 128, AC_BATCH, generator=g) for _ in range(AC_STEPS + 1)]
    out = {}
    for ac in AC_RUNS:
        torch._dynamo.reset()
        model = _model(mesh, ac=ac)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        step = ss.compile_step(model, opt, _loss, backend="aot_eager")
        losses = [step(b, b).item() for b in batches[:AC_STEPS]]
        last = batches[-1]
        out[ac] = {"losses": losses,
                   "peak": _step_peak_bytes(lambda: step(last, last), model, opt, "cpu")[0],
                   "params": [p.to_local().clone() for p in model.parameters()]}
    out["param_rel"] = max(max_rel_diff(a, b) for a, b in zip(out["none"].pop("params"),
                                                               out["full"].pop("params")))
    return out


SKIP_STEPS = 4
# (rank, step) -> (loss scale, loss shift) where a step goes non-finite, on one rank only:
# step 1's gradients (a loss times inf) and step 2's loss alone (plus an inf that no
# gradient sees, so the gradient norm stays finite and only the loss's all-reduce tells).
SKIP_INJECTED = {(1, 1): (float("inf"), 0.0), (0, 2): (1.0, float("inf"))}
# (name, optimizer class, its options, (max_norm, clip_norm) or None)
SKIP_CASES = [
    ("skip_adamw", "AdamW", {"weight_decay": 0.1}, None),
    ("skip_sgd_momentum_clip_previous", "SGD", {"weight_decay": 0.01, "momentum": 0.9},
     (MAX_NORM, "previous")),
]


def _scaled_loss(model, tokens, labels, scale, shift):
    return _loss(model, tokens, labels) * scale[0] + shift[0]


def _skip_case(rank, mesh, opt_name, options, clip):
    """``training.on_nonfinite skip`` both ways: the split step as the trainer's model scope
    runs it (the loss all-reduced and the norm read on the host, the optimizer's step not
    taken when either is not finite, the gradients dropped) against compile_step's
    ``skip_nonfinite``, over SKIP_STEPS steps with SKIP_INJECTED's non-finite steps."""
    import torch.distributed as dist

    import simplesharded as ss

    opt_cls = getattr(torch.optim, opt_name)
    batches = _batches(rank)[:SKIP_STEPS]
    extras = [tuple(torch.tensor([v]) for v in SKIP_INJECTED.get((rank, i), (1.0, 0.0)))
              for i in range(SKIP_STEPS)]
    max_norm, clip_norm = clip or (None, "current")
    ref = _model(mesh)
    ref_c = torch.compile(ref, backend=ss.make_backend("aot_eager"), fullgraph=True)
    ref_opt = opt_cls(ref.parameters(), lr=_lr(0), foreach=False, **options)
    ref_taken, last_norm = [], None
    for i, (b, extra) in enumerate(zip(batches, extras)):
        ref_opt.param_groups[0]["lr"] = _lr(i)
        loss = _scaled_loss(ref_c, b, b, *extra)
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).full_tensor()
        total = loss.detach().clone()
        dist.all_reduce(total)
        ref_taken.append(bool(torch.isfinite(total) and torch.isfinite(norm)))
        if ref_taken[-1]:
            if max_norm is not None:  # clip_norm "previous": the last taken step's norm
                if last_norm is not None:
                    torch.nn.utils.clip_grads_with_norm_(ref.parameters(), max_norm, last_norm)
                last_norm = norm
            ref_opt.step()
        ref_opt.zero_grad()
    torch._dynamo.reset()
    model = _model(mesh)
    opt = opt_cls(model.parameters(), lr=_lr(0), **options)
    step = ss.compile_step(model, opt, _scaled_loss, backend="aot_eager", max_norm=max_norm,
                           clip_norm=clip_norm, skip_nonfinite=True)
    taken = []
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for i, (b, extra) in enumerate(zip(batches, extras)):
        opt.param_groups[0]["lr"] = _lr(i)
        taken.append(bool(step(b, b, *extra)[1]))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    ref_state, state = ref_opt.state_dict()["state"], opt.state_dict()["state"]
    return {
        "taken": taken, "ref_taken": ref_taken, "graphs": graphs,
        "params_equal": [torch.equal(a.to_local(), b.to_local())
                         for a, b in zip(ref.parameters(), model.parameters())],
        "state_equal": all(torch.equal(_local(ref_state[k][n]), _local(state[k][n]))
                           for k in ref_state for n in ref_state[k]),
        "state_keys": sorted({n for k in state for n in state[k]}),
    }


def _job(rank, world):
    from simplesharded.mesh import build_mesh

    mesh = build_mesh(dp_replicate=1, dp_shard=world, device="cpu")
    out = {name: _case(rank, mesh, *case) for name, *case in CASES}
    out["ac"] = _ac_case(rank, mesh)
    out.update({name: _skip_case(rank, mesh, *case) for name, *case in SKIP_CASES})
    return out


@functools.lru_cache(maxsize=None)
def _results():
    return spawn(2, _job, timeout_s=900)


@needs_torch(STEP_GRAPH)
@pytest.mark.slow
@pytest.mark.parametrize("case", BITWISE)
def test_step_graph_matches_split_step_bitwise(case):
    """10 steps with a changing learning rate: every parameter shard and every optimizer state
    tensor bitwise equal to the split step's, the same losses, one graph compiled, and no
    ``.grad`` left on the parameters. With 2 micro-batches per step the split step runs
    backward on each, accumulating ``.grad``; the step graph sums them in the same order."""
    for rank, res in enumerate(_results()):
        r = res[case]
        assert all(r["params_equal"]), (rank, r["max_abs_diff"], r["params_equal"])
        assert r["state_equal"], rank
        assert r["losses"] == r["ref_losses"], (rank, r["losses"], r["ref_losses"])
        assert r["graphs"] == 1, (rank, r["graphs"])
        assert r["grads_none"], rank


@needs_torch(STEP_GRAPH)
@pytest.mark.slow
@pytest.mark.parametrize("case", CLIPPED)
def test_clipped_step_graph_matches_split_step_with_clip_grad_norm(case):
    """With max_norm, clipping active at every step (the previous norm's from the second):
    the split step clips with torch.nn.utils.clip_grad_norm_ (clip_norm="current"), or with
    clip_grads_with_norm_ and the last step's get_total_norm ("previous"); the step graph
    computes the norm with one all-reduce in torch's order (simplesharded/step/grad_clip.py), so
    after 10 steps every parameter and state tensor is bitwise the split step's."""
    for rank, res in enumerate(_results()):
        r = res[case]
        assert min(r["ref_norms"]) > MAX_NORM, (rank, r["ref_norms"])
        assert all(r["params_equal"]), (rank, r["max_abs_diff"], r["param_rel"])
        assert r["state_equal"], rank
        assert r["losses"] == r["ref_losses"], (rank, r["losses"], r["ref_losses"])
        assert r["graphs"] == 1 and r["grads_none"], rank


@needs_torch(STEP_GRAPH)
@pytest.mark.slow
def test_step_graph_with_activation_checkpointing_trains_alike_in_less_memory():
    """Every block checkpointed: the step graph's losses over 3 steps and its parameters after
    them within 1e-5 relative of the step graph's without (measured: bitwise, the
    recomputation runs the same ops on the same inputs), and its whole step's peak of live
    tensor bytes below that one's, on every rank (measured: 3.0 MB against 5.1 MB)."""
    for rank, res in enumerate(_results()):
        r = res["ac"]
        got, plain = r["full"], r["none"]
        bad = [(i + 1, a, b) for i, (a, b) in enumerate(zip(got["losses"], plain["losses"]))
               if not abs(a - b) <= 1e-5 * abs(b)]
        assert len(got["losses"]) == AC_STEPS and not bad, (rank, bad)
        assert r["param_rel"] <= 1e-5, (rank, r["param_rel"])
        assert got["peak"] < plain["peak"], (rank, got["peak"], plain["peak"])


@needs_torch(STEP_GRAPH)
@pytest.mark.slow
@pytest.mark.parametrize("case", [c[0] for c in SKIP_CASES])
def test_step_graph_skips_a_nonfinite_step_as_the_split_step(case):
    """skip_nonfinite: a step whose gradients (one rank's loss times inf), or one rank's loss
    alone, are not finite is skipped on both ranks alike, and after the later finite steps
    every parameter shard and optimizer state tensor (step counts, momentum) is bitwise the
    split step's that skipped the same steps, in one graph (the flag is a graph output: no
    recompile when a step goes non-finite). With clip_norm="previous" the skipped steps'
    norm is not kept for the next step."""
    for rank, res in enumerate(_results()):
        r = res[case]
        assert r["ref_taken"] == [True, False, False, True], (rank, r["ref_taken"])
        assert r["taken"] == r["ref_taken"], (rank, r["taken"])
        assert all(r["params_equal"]), (rank, r["params_equal"])
        assert r["state_keys"] and r["state_equal"], rank
        assert r["graphs"] == 1, (rank, r["graphs"])


# ------------------------------------------------------------------------- single process


@pytest.mark.parametrize("opt_name,wd,options", [
    ("AdamW", 0.1, {}), ("AdamW", 0.0, {}), ("Adam", 0.01, {}),
    ("SGD", 0.01, {"momentum": 0.9}), ("SGD", 0.0, {"momentum": 0.9, "nesterov": True}),
    ("SGD", 0.01, {})])
def test_traced_update_is_bitwise_torchs_eager_update(opt_name, wd, options):
    """apply_update compiled (aot_eager) against torch's eager for-loop step on the same
    gradients, 10 steps with a changing learning rate, shapes with vector tails: parameters
    and every state tensor bitwise equal (SGD: with momentum, with Nesterov's, without)."""
    from simplesharded.step.optim_update import (apply_update, hyperparameters, prepare,
                                                 step_inputs, update_kind)

    torch.manual_seed(0)
    shapes = [(64, 64), (37,), (13, 5), (1,)]
    init = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(STEPS)]

    def make():
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        return ps, getattr(torch.optim, opt_name)(ps, lr=_lr(0), weight_decay=wd,
                                                   foreach=False, **options)

    ref, ref_opt = make()
    for i in range(STEPS):
        ref_opt.param_groups[0]["lr"] = _lr(i)
        for p, g in zip(ref, grads[i]):
            p.grad = g.clone()
        ref_opt.step()
    ps, opt = make()
    prepare(opt)
    hypers = hyperparameters(opt)
    kind = update_kind(opt)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def update(gs, lrs, states):
        with torch.no_grad():
            apply_update(kind, [ps], hypers, [gs], lrs, states)

    for i in range(STEPS):
        opt.param_groups[0]["lr"] = _lr(i)
        update(grads[i], *step_inputs(opt))
    assert all(torch.equal(a, b) for a, b in zip(ref, ps))
    keys = {k for a in ref for k, v in ref_opt.state[a].items() if v is not None}
    assert keys == ({"momentum_buffer"} if options.get("momentum") else set()) \
        if opt_name == "SGD" else {"step", "exp_avg", "exp_avg_sq"}
    for k in keys:
        assert all(torch.equal(ref_opt.state[a][k], opt.state[b][k]) for a, b in zip(ref, ps)), k


@needs_torch(STEP_GRAPH)
@pytest.mark.parametrize("make,match", [
    (lambda ps: torch.optim.RMSprop(ps, lr=0.1), "cannot trace torch.optim.rmsprop.RMSprop"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1),
     "SGD with dampening=0.1"),
    (lambda ps: torch.optim.AdamW(ps, amsgrad=True), "AdamW with amsgrad=True"),
    (lambda ps: torch.optim.Adam(ps, maximize=True), "Adam with maximize=True"),
])
def test_an_update_not_written_is_one_error_naming_the_optimizer(make, match):
    import simplesharded as ss

    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match=match):
        ss.compile_step(model, make(model.parameters()), lambda m, x: m(x).sum(),
                        backend="aot_eager")


@functools.lru_cache(maxsize=None)  # read only: tests deepcopy a graph before changing it
def _step_graphs(backend="aot_eager_blockbucketing", max_norm=None, clip_norm="current",
                 split=True, **dp_options):
    """The step graph of the 2-block Llama on a fake world of 2, as our pipeline received it
    and after each pass; and (``split``) the split step's forward and backward graphs (the
    same model compiled alone, resharding after forward as data_parallel does by default)."""
    import copy

    import pass_utils as pu
    import simplesharded as ss

    seen = {}

    def observe(kind, stage, gm):
        seen.setdefault(stage, []).append(copy.deepcopy(gm))

    with pu.fake_world(2) as mesh:
        torch._dynamo.reset()
        model = _model(mesh, **dp_options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = ss.compile_step(model, opt, _summed_loss, backend=backend, max_norm=max_norm,
                               clip_norm=clip_norm, observer=observe)
        tokens = torch.randint(0, 128, (2, 16))
        step(tokens, tokens)
        step(tokens, tokens)
        seen["trace restarts"] = pu.dynamo_trace_restarts()
        torch._dynamo.reset()
    return seen, _split_graphs(backend) if split else None


@functools.lru_cache(maxsize=None)  # read only, as _step_graphs
def _split_graphs(backend: str):
    """The split step's forward and backward graphs of _step_graphs' model (compiled alone,
    resharding after forward as data_parallel does by default): one capture for every step
    graph it is compared with (clipping changes the step graph, not the split step's)."""
    import pass_utils as pu

    with pu.fake_world(2) as mesh:
        torch._dynamo.reset()
        tokens = torch.randint(0, 128, (2, 16))
        return pu.capture_graphs(_plain_model(), mesh, (tokens, tokens), loss=lambda out: out,
                                 reshard_after_forward="auto", backend=backend)


@needs_torch(STEP_GRAPH)
def test_step_graph_holds_the_bucketed_collectives_and_the_update():
    """One graph for two steps. Its traced backward carries data_parallel's annotations
    (passes/traced_backward.py), so block bucketing merges its reduce-scatters as in the split
    step's backward graph: the same all-gathers (one per bucket, forward's and those backward
    gathers again, passes/step_regather.py) and reduce-scatters (one per bucket) as the split
    step's two graphs together, and the update of every parameter in
    the same graph, each after its own bucket's reduce-scatter. Each reduce-scatter is waited
    where the next one is issued (one in flight while backward computes), not right after its
    own start."""
    import pass_utils as pu

    seen, split = _step_graphs()
    assert len(seen["input"]) == 1  # compiled once
    # and traced once: a 0-d float64 learning rate made dynamo trace the whole step twice
    assert seen["trace restarts"] == 0
    first, final = seen["input"][0], seen["agreement"][0]
    rs_in = pu.starts(first, pu.RS)
    assert rs_in and all(pu.node_params(s) for s in rs_in)  # annotated
    counts = pu.collective_counts(final)
    split_fw = pu.collective_counts(split["fw"]["agreement"])
    split_bw = pu.collective_counts(split["bw"]["agreement"])
    assert split_bw["all_gather"] > 0  # the split step's backward gathers again too
    assert counts["all_gather"] == split_fw["all_gather"] + split_bw["all_gather"]
    assert counts["reduce_scatter"] == split_bw["reduce_scatter"]
    assert counts["reduce_scatter"] < len(rs_in)  # merged
    pos = pu._pos(final)
    update = [n for n in final.graph.nodes if "ss_update" in (n.meta.get("custom") or {})]
    assert update
    reds = sorted(pu.reduction_intervals(final))
    nodes = list(final.graph.nodes)
    mms = [i for i, n in enumerate(nodes) if n.target in (torch.ops.aten.mm.default,
                                                          torch.ops.aten.bmm.default)]
    # Waited where the next reduce-scatter is issued: the backward's matmuls in between run
    # while it is in flight, none is left between its wait and the next start.
    for (s, w, _), (nxt, _, _) in zip(reds, reds[1:]):
        assert not any(w < i < nxt for i in mms), (s, w, nxt)
    assert any(reds[0][0] < i < reds[0][1] for i in mms), reds[0]
    # Every parameter's moment update (one lerp each) runs once its bucket's reduce-scatter
    # is waited, while the next one is in flight (passes/update_placement.py;
    # tests/test_update_placement.py checks each bucket); the last reduction (the
    # embedding's, a bucket of its own) is waited before its own update only.
    lerps = [n for n in update if n.target in LERP]
    n_params = len(list(_plain_model().parameters()))
    assert len(lerps) == n_params
    # The update writes parameters and state in place (passes/update_inplace.py): no
    # functionalized copy-back is left.
    assert all(n.target is torch.ops.aten.lerp_.Scalar for n in lerps)
    assert not [n for n in final.graph.nodes if n.target is torch.ops.aten.copy_.default]
    last_start, last_wait, last = reds[-1]
    assert pu.node_params(last) == ["tok_embeddings.weight"]
    assert sum(pos[n] < last_start for n in lerps) > 0
    assert sum(pos[n] > last_wait for n in lerps) == 1


@needs_torch(STEP_GRAPH)
@pytest.mark.parametrize("grad_reduction", ["sum", "avg"])
def test_each_traced_reduction_carries_its_own_parameter(grad_reduction):
    """passes/traced_backward.py: every reduce-scatter of the traced backward is annotated with
    the parameter whose gradient it reduces (its output is that parameter's local shard, and
    each parameter has one), whether or not the gradient is scaled (grad_reduction "sum" has
    no scaling op to match by)."""
    import pass_utils as pu

    seen, _ = _step_graphs(split=False, grad_reduction=grad_reduction)
    first = seen["input"][0]
    with pu.fake_world(2) as mesh:
        shards = {n: tuple(p.to_local().shape) for n, p in _model(mesh).named_parameters()}
    rs = pu.starts(first, pu.RS)
    got = {}
    for s in rs:
        (fqn,) = pu.node_params(s)
        got[fqn] = tuple(s.meta["val"].shape)
    assert len(got) == len(rs)  # one reduce-scatter per parameter
    assert got == shards
    # and bucketing merges them; the update writes every parameter in place
    # (passes/update_inplace.py): nothing copied back
    final = seen["agreement"][0]
    assert len(pu.starts(final, pu.RS)) == 4  # pre, two blocks, post
    assert not [n for n in final.graph.nodes if n.target is torch.ops.aten.copy_.default]


def _backward_reads_of_gathers(gm):
    """{fqn: forward gather-chain nodes (its gather and views of it) a traced-backward node
    reads}."""
    from simplesharded.passes.step_regather import _gather_chains
    from simplesharded.passes.traced_backward import traced_backward_nodes

    backward = traced_backward_nodes(gm)
    return {fqn: [n for n in chain if any(u in backward for u in n.users)]
            for fqn, chain in _gather_chains(gm.graph, backward).items()
            if any(u in backward for n in chain for u in n.users)}


@needs_torch(STEP_GRAPH)
def test_step_graph_reshards_after_forward_as_the_split_step():
    """passes/step_regather.py: as traced, the backward reads every gathered parameter the
    forward gathered (the whole model gathered at the forward's end). After the pass, with
    data_parallel's default (reshard "auto": the last block and what follows stay gathered),
    the backward reads only those, and the others are gathered again in backward, once per
    bucket; a second run changes nothing."""
    import copy

    from simplesharded.backends import backend_plan
    from simplesharded.passes.step_regather import regather_for_backward

    seen, _ = _step_graphs()
    before = _backward_reads_of_gathers(seen["input"][0])
    after = _backward_reads_of_gathers(seen["regather"][0])
    n_params = len(list(_plain_model().parameters()))
    assert len(before) == n_params - 1  # all but the embedding, whose backward needs no weight
    kept = {f for f in before if not f.startswith("layers.0.")}
    assert set(after) == kept, sorted(after)
    gm = copy.deepcopy(seen["regather"][0])
    code = gm.code
    regather_for_backward(gm, backend_plan("aot_eager_blockbucketing"))
    assert gm.code == code


def _checkpointed_ops(gm):
    """(forward ops of checkpointed blocks, backward ops annotated with a block other than
    step_regather.py's gathers: the recomputed ones), each ``{node: block index}``."""
    from simplesharded.passes.annotations import AC_KEY, REGATHER_KEY, annotations
    from simplesharded.passes.traced_backward import traced_backward_nodes

    backward = traced_backward_nodes(gm)
    forward, recomputed = {}, {}
    for n in gm.graph.nodes:
        custom = annotations(n)
        if n.op == "call_function" and AC_KEY in custom and not custom.get(REGATHER_KEY):
            (recomputed if n in backward else forward)[n] = custom[AC_KEY]
    return forward, recomputed, backward


@needs_torch(STEP_GRAPH)
def test_step_graph_recomputes_the_checkpointed_blocks_in_its_backward():
    """passes/step_recompute.py, every block checkpointed. As traced, the backward reads many
    forward activations of each block; after the pass it reads only what is saved: a block's
    boundary (read by a forward op of no block or of another one), the outputs of attention
    (an op that may draw random numbers, kept as recompute.py keeps it) and gathered
    parameters (step_regather.py's, next). The ops it needs are recomputed in the backward,
    after the block's forward: per block a subset of its forward ops, among them every
    matmul but the last (w2's, whose output only the residual sum at the block's boundary
    reads), and they are still in the final graph. A second run changes nothing; without
    checkpointing the pass changes nothing."""
    import copy
    import operator

    from simplesharded.passes.annotations import AC_KEY, PARAM_KEY, annotations
    from simplesharded.passes.recompute import gathered_nodes
    from simplesharded.passes.step_recompute import recompute_checkpointed

    seen, _ = _step_graphs(split=False, ac="full")
    traced, after, final = seen["input"][0], seen["recompute_ac"][0], seen["agreement"][0]

    def read_by_backward(gm):
        forward, _, backward = _checkpointed_ops(gm)
        return {n for n in forward if any(u in backward for u in n.users)}, forward, backward

    before, _, _ = read_by_backward(traced)
    still, forward, backward = read_by_backward(after)
    gathered = gathered_nodes(after.graph, backward)

    def saved(n):
        source = n.args[0] if n.target is operator.getitem else n
        return (n in gathered or PARAM_KEY in annotations(n)
                or torch.Tag.nondeterministic_seeded in getattr(source.target, "tags", ())
                or any(u not in backward and annotations(u).get(AC_KEY) != forward[n]
                       for u in n.users))

    assert len(still) < len(before) // 2, (len(still), len(before))
    assert all(saved(n) for n in still), [n.name for n in still if not saved(n)]
    mm = torch.ops.aten.mm.default
    blocks = sorted(set(forward.values()))
    assert len(blocks) == SHAPES["n_layers"]
    for gm in (after, final):
        fwd, recomputed, _ = _checkpointed_ops(gm)
        pos = {n: i for i, n in enumerate(gm.graph.nodes)}
        for b in blocks:
            mine = [n for n, k in recomputed.items() if k == b]
            ops = collections.Counter(n.target for n in mine)
            fwd_ops = collections.Counter(n.target for n, k in fwd.items() if k == b)
            assert ops and not ops - fwd_ops, (b, ops - fwd_ops)
            assert ops[mm] == fwd_ops[mm] - 1, (b, ops[mm], fwd_ops[mm])
            last_forward = max(pos[n] for n, k in fwd.items() if k == b)
            assert min(pos[n] for n in mine) > last_forward, b
    gm = copy.deepcopy(after)
    code = gm.code
    assert recompute_checkpointed(gm).code == code
    plain, _ = _step_graphs()
    assert plain["recompute_ac"][0].code == plain["input"][0].code


def _annotated(gm, suffix=""):
    """{parameter: its nodes} of the ``ss_update`` annotations ending in ``suffix``."""
    out = {}
    for n in gm.graph.nodes:
        key = (n.meta.get("custom") or {}).get("ss_update", "")
        if key.endswith(suffix) and (suffix or "/" not in key):
            out.setdefault(key.removesuffix(suffix), []).append(n)
    return out


@needs_torch(STEP_GRAPH)
def test_step_graph_says_why_the_next_steps_first_gather_is_not_issued():
    """passes/cross_step.py: the final step graph's notes name the first gather's parameters
    (the embedding's bucket), the update that writes their shards, and the reason; the note
    is what a graph dump prints at its top."""
    seen, _ = _step_graphs()
    notes = seen["agreement"][0].meta.get("ss_notes", [])
    assert len(notes) == 1, notes
    assert "next step's first all-gather" in notes[0] and "tok_embeddings.weight" in notes[0]
    assert "waits on its collectives before it returns" in notes[0]


@needs_torch(STEP_GRAPH)
def test_clipped_step_graph_reduces_the_norm_once():
    """With max_norm: one all-reduce (the gradients' squared norms, one vector) in the step
    graph, on the dp group, besides the bucketed reduce-scatters. Each gradient's local norm
    runs as soon as its reduce-scatter is waited, so all but the last bucket's run before the
    last reduce-scatter is waited; every update waits for the norm's all-reduce."""
    import pass_utils as pu

    seen, split = _step_graphs(max_norm=1.0)
    final = seen["agreement"][0]
    counts = pu.collective_counts(final)
    assert counts["all_reduce"] == 1
    assert counts["reduce_scatter"] == \
        pu.collective_counts(split["bw"]["agreement"])["reduce_scatter"]
    pos = pu._pos(final)
    reds = sorted(pu.reduction_intervals(final))
    last_rs_wait = max(w for _, w, s in reds if "reduce_scatter" in str(s.target))
    norm_wait = max(w for _, w, s in reds if "all_reduce" in str(s.target))
    norms = _annotated(final, "/norm")
    assert len(norms) == len(list(_plain_model().parameters()))
    early = [p for p, ns in norms.items() if max(pos[n] for n in ns) < last_rs_wait]
    assert early and set(norms) - set(early) == {"tok_embeddings.weight"}, early
    updates = _annotated(final)
    lerps = [n for ns in updates.values() for n in ns if n.target in LERP]
    assert lerps and all(pos[n] > norm_wait for n in lerps)


@needs_torch(STEP_GRAPH)
def test_clipping_with_the_previous_norm_lets_updates_start_early():
    """clip_norm="previous": the updates read the last step's norm, so each one runs under the
    next reduce-scatter as without clipping; this step's norm is still reduced once."""
    import pass_utils as pu

    seen, _ = _step_graphs(max_norm=1.0, clip_norm="previous")
    final = seen["agreement"][0]
    assert pu.collective_counts(final)["all_reduce"] == 1
    pos = pu._pos(final)
    last_rs_wait = max(w for _, w, s in pu.reduction_intervals(final)
                       if "reduce_scatter" in str(s.target))
    lerps = [n for ns in _annotated(final).values() for n in ns
             if n.target in LERP]
    assert sum(pos[n] > last_rs_wait for n in lerps) == 1  # the embedding's, the last bucket


@needs_torch(STEP_GRAPH)
def test_clip_norm_and_accumulation_bad_values_are_one_error_each():
    import simplesharded as ss

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="clip_norm='lagged' is not one of"):
        ss.compile_step(model, opt, lambda m, x: m(x).sum(), backend="aot_eager",
                        max_norm=1.0, clip_norm="lagged")
    with pytest.raises(ValueError, match="accumulation_steps=0 is not a positive integer"):
        ss.compile_step(model, opt, lambda m, x: m(x).sum(), backend="aot_eager",
                        accumulation_steps=0)
    step = ss.compile_step(model, opt, lambda m, x: m(x).sum(), backend="aot_eager",
                           accumulation_steps=2)
    with pytest.raises(ValueError, match="accumulation_steps=2 does not divide"):
        step(torch.randn(3, 4))


def test_an_older_torch_is_refused_in_one_line_naming_the_feature(monkeypatch):
    """compile_step on a torch older than its row in passes/torch_compat.py: one line naming
    the feature, the installed torch and the one it needs, before anything is traced."""
    from torch.torch_version import TorchVersion

    import simplesharded as ss
    from simplesharded.passes import torch_compat

    monkeypatch.setattr(torch_compat, "installed", lambda: TorchVersion("2.11.0"))
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(torch_compat.TorchTooOld,
                       match=r"^compile_step \(compile.scope='step'\) needs torch >= 2\.13; "
                             r"this is torch \S+ \(dynamo before 2\.13 [^\n]*\)$"):
        ss.compile_step(model, opt, lambda m, x: m(x).sum(), backend="aot_eager")


# ------------------------------------------------------------------------------ the trainer

TRAINER_STEPS = 10
# configs/llama3_debug.toml, shortened as tests/test_trainer_paths.py does; for-loop AdamW (the
# update compile_step writes), its max_norm 1.0 clipping, 2 micro-batches per step, every
# block checkpointed (in the step graph: passes/step_recompute.py, once per micro-batch).
TRAINER_ARGS = ["--training.seq_len", "32", "--training.global_batch_size", "4",
                "--training.val_every", "0", "--no-metrics.progress_bar",
                "--optimizer.implementation", "for-loop", "--compile.enable",
                "--compile.backend", "aot_eager_blockbucketing",
                "--training.gradient_accumulation_steps", "2",
                "--activation_checkpoint.mode", "full", "--training.on_nonfinite", "skip",
                "--model.n_layers", "2"]  # of the debug model's 6: what compiles scales with them
# The step (0-based) whose forward reads an inf that rank 0 writes into one of its shards
# and puts back after the step: both scopes must skip it, and the runs go on alike.
TRAINER_INF_STEP = 4


def _trainer_job(rank, world):
    from pathlib import Path

    from simplesharded.trainer import Trainer, check_static
    from simplesharded.trainer.config import load_config

    config = str(Path(__file__).resolve().parents[1] / "configs" / "llama3_debug.toml")
    out = {}
    # both over ragged buckets, the trainer's default storage (which trains bitwise as
    # per-parameter shards: tests/test_bucketing_training.py)
    for run, extra in (("model", ["--parallelism.storage", "ragged"]),
                       ("step", ["--compile.scope", "step", "--parallelism.storage", "ragged"])):
        torch._dynamo.reset()
        cfg = check_static(load_config(None, ["--job.config_file", config, *TRAINER_ARGS,
                                              *extra]), world)
        trainer = Trainer(cfg, "cpu")
        # the first parameter that every token reads (an embedding row may go unread) with
        # elements on this rank (a ragged member's run may be empty)
        shard = next(p.to_local() for n, p in trainer.model.named_parameters()
                     if "embed" not in n and p.to_local().numel())
        records = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(TRAINER_STEPS):
                if i == TRAINER_INF_STEP and rank == 0:
                    kept = shard.view(-1)[0].clone()
                    with torch.no_grad():
                        shard.view(-1)[0] = float("inf")
                records.append(trainer.train_step())
                if i == TRAINER_INF_STEP and rank == 0:
                    with torch.no_grad():
                        shard.view(-1)[0] = kept
        out[run] = {"loss": [r["loss"] for r in records],
                      "grad_norm": [r["grad_norm"] for r in records],
                      "scheduler_warnings": sum("lr_scheduler.step()" in str(w.message)
                                                for w in caught)}
    return out


@functools.lru_cache(maxsize=None)
def _trainer_results():
    return spawn(2, _trainer_job, timeout_s=900)


@needs_torch(STEP_GRAPH)
@pytest.mark.slow
def test_trainer_step_scope_trains_as_model_scope():
    """compile.scope=step against scope=model, both over ragged buckets with activation
    checkpointing of every block, on llama3 debug, 10 steps (warmup and cosine schedule,
    max_norm 1.0), under on_nonfinite skip with one step made non-finite on rank 0 (an inf
    in one of its shards for that step): both scopes skip that step on both ranks, and the
    losses and gradient norms of the others are the same up to the clipping's rounding
    (measured: bit for bit, both sum the norm bucket by bucket; asserted ≤ 1e-6 relative, as
    another order of that sum moves the last bits)."""
    for rank, res in enumerate(_trainer_results()):
        for run in ("model", "step"):
            bad = [i for i, x in enumerate(res[run]["loss"]) if not math.isfinite(x)]
            assert bad == [TRAINER_INF_STEP], (rank, run, res[run]["loss"])
        for key in ("loss", "grad_norm"):
            a, b = res["step"][key], res["model"][key]
            assert all(abs(x - y) <= 1e-6 * abs(y) for i, (x, y) in enumerate(zip(a, b))
                       if i != TRAINER_INF_STEP), (rank, key, a, b)
        # the graph takes the optimizer's step: torch's scheduler must not warn that it saw none
        assert res["step"]["scheduler_warnings"] == 0, rank


def test_step_scope_refuses_what_it_does_not_do():
    """One error naming the setting (load_config validates)."""
    from simplesharded.trainer.config import load_config

    for extra, key in ((["--training.gradient_sync", "last_microbatch"],
                        "training.gradient_sync"),
                       (["--compile.backend", "eager"], "compile.backend")):
        with pytest.raises(ValueError, match=key):
            load_config("configs/llama3_debug.toml",
                        ["--compile.enable", "--compile.scope", "step",
                         "--compile.backend", "aot_eager", *extra])
