"""passes/update_scalars.py: on a hand-built update graph, each 0-d value of the update that a
tensor of the update reads goes through one ``simplesharded::materialized`` copy (values
unchanged, a second run changes nothing, unannotated nodes left alone); under inductor, the
step graph's generated code computes Adam's bias corrections once per step, not inside a
parameter's elementwise loop, and trains as before."""
from __future__ import annotations

import re

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from simplesharded.passes.annotations import UPDATE_KEY
from simplesharded.passes.torch_compat import STEP_GRAPH
from simplesharded.passes.update_scalars import MATERIALIZED_OP, materialize_update_scalars
from torch_range import needs_torch


def _update(p, step, grad, lr):
    s = step + 1
    size = lr / (1 - torch.pow(0.9, s))  # 0-d, read by the elementwise update: wrapped
    new = p - grad * size
    return new * (lr * 2), s  # lr * 2: 0-d, read elementwise, but not annotated


def _graph():
    args = (torch.randn(6, 4), torch.tensor(3.0), torch.randn(6, 4), torch.tensor(0.1))
    gm = make_fx(_update, tracing_mode="fake")(*args)
    for n in gm.graph.nodes:
        if n.op == "call_function" and not (n.target is torch.ops.aten.mul.Tensor
                                            and n.args[1] == 2):
            n.meta["custom"] = {UPDATE_KEY: "w"}
    gm.recompile()
    return gm, args


def test_each_update_scalar_read_elementwise_is_materialized_once():
    gm, args = _graph()
    ref = gm(*args)
    gm = materialize_update_scalars(gm)
    gm.graph.lint()
    copies = [n for n in gm.graph.nodes if n.target is MATERIALIZED_OP]
    assert len(copies) == 1
    (copy,) = copies
    src = copy.args[0]
    assert src.target is torch.ops.aten.div.Tensor and list(src.users) == [copy]
    assert copy.meta["val"].shape == () and copy.meta["custom"] == {UPDATE_KEY: "w"}
    assert all(u.meta["val"].numel() > 1 for u in copy.users)
    got = gm(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    code = gm.code
    assert materialize_update_scalars(gm).code == code  # a second run changes nothing


@needs_torch(STEP_GRAPH)
def test_inductor_step_graph_computes_bias_corrections_outside_the_elementwise_loops():
    from torch._inductor.utils import run_and_get_code

    from simplesharded.step import compile_step

    def train(backend):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = compile_step(model, opt, lambda m, x: m(x).pow(2).mean(), backend=backend)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
        losses, codes = [], []
        for i in range(3):
            if i == 1:
                loss, codes = run_and_get_code(step, x)
            else:
                loss = step(x)
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in model.parameters()], "\n".join(codes)

    ref_losses, ref_params, _ = train("aot_eager_blockbucketing")
    losses, params, code = train("inductor_blockbucketing")
    assert code.count("torch.ops.simplesharded.materialized.default(") >= 4  # 2 per parameter
    # every std::pow sits in a kernel that loads no vector of elements
    kernels = re.split(r"async_compile\.cpp_pybinding", code)[1:]
    with_pow = [k for k in kernels if "std::pow" in k]
    assert with_pow and not any("Vectorized" in k for k in with_pow)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(params, ref_params))
