"""passes/traced_backward.py on a hand-built graph: a traced backward's reductions take the
annotation of the annotated op up their input (a hybrid all-reduce after a reduce-scatter
too), a reduction with none up its input (the model's own) and forward collectives are left as
they are, and a second run changes nothing."""
from __future__ import annotations

import torch
from torch import fx

from simplesharded.passes.annotations import PARAM_KEY, annotations
from simplesharded.passes.traced_backward import annotate_traced_backward

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
ANN = {PARAM_KEY: "layers.0.w", "ss_dp_groups": ("0",)}


def _graph():
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.placeholder("y")

    def op(target, *args, backward=True, custom=None):
        n = g.call_function(target, args)
        if backward:
            n.meta["autograd_backward"] = True
        if custom is not None:
            n.meta["custom"] = dict(custom)
        return n

    fwd_ag = op(c10d.all_gather_into_tensor.default, x, 2, "0", backward=False)
    fwd_wait = op(c10d.wait_tensor.default, fwd_ag, backward=False)
    grad = op(aten.mul.Tensor, fwd_wait, y)  # the model's backward: two inputs
    entry = op(aten.view.default, grad, [-1], custom=ANN)  # gather.py's annotated entry op
    rs = op(c10d.reduce_scatter_tensor.default, op(aten.view.default, entry, [4, 2]),
            "sum", 2, "0")
    rs_wait = op(c10d.wait_tensor.default, rs)
    ar = op(c10d.all_reduce.default, op(aten.view.default, rs_wait, [-1]), "sum", "1")
    ar_wait = op(c10d.wait_tensor.default, ar)
    tp_ar = op(c10d.all_reduce.default, grad, "sum", "2")  # reads the model's op: not ours
    g.output((ar_wait, op(c10d.wait_tensor.default, tp_ar)))
    return fx.GraphModule(torch.nn.Module(), g), dict(
        fwd_ag=fwd_ag, rs=rs, rs_wait=rs_wait, ar=ar, ar_wait=ar_wait, tp_ar=tp_ar)


def test_reductions_take_their_entry_ops_annotation():
    gm, n = _graph()
    annotate_traced_backward(gm)
    for name in ("rs", "rs_wait", "ar", "ar_wait"):
        assert annotations(n[name]) == ANN, name
    assert annotations(n["tp_ar"]) == {}
    assert annotations(n["fwd_ag"]) == {}


def test_a_second_run_changes_nothing():
    gm, n = _graph()
    annotate_traced_backward(gm)
    before = {k: dict(annotations(v)) for k, v in n.items()}
    annotate_traced_backward(gm)
    assert {k: annotations(v) for k, v in n.items()} == before


def test_an_annotated_reduction_keeps_its_own():
    gm, n = _graph()
    own = {PARAM_KEY: "other", "ss_dp_groups": ("0",)}
    n["rs"].meta["custom"] = dict(own)
    annotate_traced_backward(gm)
    assert annotations(n["rs"]) == own
