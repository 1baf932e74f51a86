"""compile_step (simplesharded/step.py, optim_update.py): forward, loss, backward and AdamW's
step in one compiled graph, against the split step (the same model compiled with the same
backend, ``loss.backward()``, eager ``optimizer.step()``, ``zero_grad()``).

One spawn of 2 gloo ranks runs every case (``_job``) on a small Llama 3 (2 blocks); the tests
read its results. Single-process tests: the traced update alone against torch's eager one,
and the errors.
"""
from __future__ import annotations

import functools

import pytest
import torch

from dist_utils import spawn

STEPS = 10
# (name, backend, optimizer class, weight_decay)
CASES = [
    ("aot_eager_adamw", "aot_eager", "AdamW", 0.1),
    ("blockbucketing_adamw", "aot_eager_blockbucketing", "AdamW", 0.1),
    ("blockbucketing_adam_l2", "aot_eager_blockbucketing", "Adam", 0.01),
]


def _model(mesh):
    import simplesharded as ss
    from models.llama3 import Llama3, Llama3Args

    torch.manual_seed(0)
    args = Llama3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128)
    return ss.data_parallel(Llama3(args), mesh)


def _loss(model, tokens, labels):
    return model(tokens, labels) / labels.numel()


def _batches(rank):
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return [torch.randint(0, 128, (2, 16), generator=g) for _ in range(STEPS)]


def _lr(i):  # a schedule: the step graph takes it as an input, nothing recompiles
    return 1e-2 * (0.9 ** i)


def _case(rank, mesh, backend, opt_name, wd):
    import simplesharded as ss

    opt_cls = getattr(torch.optim, opt_name)
    batches = _batches(rank)
    # The split step: today's recipe.
    ref = _model(mesh)
    ref_c = torch.compile(ref, backend=ss.make_backend(backend), fullgraph=True)
    ref_opt = opt_cls(ref.parameters(), lr=_lr(0), weight_decay=wd, foreach=False)
    ref_losses = []
    for i, b in enumerate(batches):
        ref_opt.param_groups[0]["lr"] = _lr(i)
        loss = _loss(ref_c, b, b)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    # The step graph.
    torch._dynamo.reset()
    model = _model(mesh)
    opt = opt_cls(model.parameters(), lr=_lr(0), weight_decay=wd)
    step = ss.compile_step(model, opt, _loss, backend=backend)
    losses = []
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for i, b in enumerate(batches):
        opt.param_groups[0]["lr"] = _lr(i)
        losses.append(step(b, b).item())
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    ref_state, state = ref_opt.state_dict()["state"], opt.state_dict()["state"]
    return {
        "losses": losses, "ref_losses": ref_losses, "graphs": graphs,
        "params_equal": [torch.equal(a.to_local(), b.to_local())
                         for a, b in zip(ref.parameters(), model.parameters())],
        "max_abs_diff": max((a.to_local() - b.to_local()).abs().max().item()
                            for a, b in zip(ref.parameters(), model.parameters())),
        "state_equal": all(torch.equal(_local(ref_state[k][n]), _local(state[k][n]))
                           for k in ref_state for n in ("step", "exp_avg", "exp_avg_sq")),
        "grads_none": all(p.grad is None for p in model.parameters()),
    }


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _job(rank, world):
    from simplesharded.mesh import build_mesh

    mesh = build_mesh(dp_replicate=1, dp_shard=world, device="cpu")
    return {name: _case(rank, mesh, *case) for name, *case in CASES}


@functools.lru_cache(maxsize=None)
def _results():
    return spawn(2, _job, timeout_s=900)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_step_graph_matches_split_step_bitwise(case):
    """10 steps with a changing learning rate: every parameter shard and every optimizer state
    tensor bitwise equal to the split step's, the same losses, one graph compiled, and no
    ``.grad`` left on the parameters."""
    for rank, res in enumerate(_results()):
        r = res[case]
        assert all(r["params_equal"]), (rank, r["max_abs_diff"], r["params_equal"])
        assert r["state_equal"], rank
        assert r["losses"] == r["ref_losses"], (rank, r["losses"], r["ref_losses"])
        assert r["graphs"] == 1, (rank, r["graphs"])
        assert r["grads_none"], rank


# ------------------------------------------------------------------------- single process


@pytest.mark.parametrize("opt_name,wd", [("AdamW", 0.1), ("AdamW", 0.0), ("Adam", 0.01)])
def test_traced_update_is_bitwise_torchs_eager_update(opt_name, wd):
    """apply_update compiled (aot_eager) against torch's eager for-loop step on the same
    gradients, 10 steps with a changing learning rate, shapes with vector tails: parameters
    and every state tensor bitwise equal."""
    from simplesharded.optim_update import apply_update, hyperparameters, prepare, step_inputs

    torch.manual_seed(0)
    shapes = [(64, 64), (37,), (13, 5), (1,)]
    init = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(STEPS)]

    def make():
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        return ps, getattr(torch.optim, opt_name)(ps, lr=_lr(0), weight_decay=wd,
                                                   foreach=False)

    ref, ref_opt = make()
    for i in range(STEPS):
        ref_opt.param_groups[0]["lr"] = _lr(i)
        for p, g in zip(ref, grads[i]):
            p.grad = g.clone()
        ref_opt.step()
    ps, opt = make()
    prepare(opt)
    hypers = hyperparameters(opt)
    decoupled = opt_name == "AdamW"

    @torch.compile(backend="aot_eager", fullgraph=True)
    def update(gs, lrs, states):
        with torch.no_grad():
            apply_update(decoupled, [ps], hypers, [gs], lrs, states)

    for i in range(STEPS):
        opt.param_groups[0]["lr"] = _lr(i)
        update(grads[i], *step_inputs(opt))
    assert all(torch.equal(a, b) for a, b in zip(ref, ps))
    for k in ("step", "exp_avg", "exp_avg_sq"):
        assert all(torch.equal(ref_opt.state[a][k], opt.state[b][k]) for a, b in zip(ref, ps)), k


@pytest.mark.parametrize("make,match", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), "cannot trace torch.optim.sgd.SGD"),
    (lambda ps: torch.optim.AdamW(ps, amsgrad=True), "AdamW with amsgrad=True"),
    (lambda ps: torch.optim.Adam(ps, maximize=True), "Adam with maximize=True"),
])
def test_an_update_not_written_is_one_error_naming_the_optimizer(make, match):
    import simplesharded as ss

    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match=match):
        ss.compile_step(model, make(model.parameters()), lambda m, x: m(x).sum(),
                        backend="aot_eager")
