"""passes/rank_local.py on a hand-built graph: the shard-sized chains around our collectives
are found, and nothing that feeds other computation is."""
from __future__ import annotations

import torch
from torch import fx
from torch._subclasses import FakeTensorMode

from pass_utils import AG, RS, WAIT, aten

from simplesharded.passes.hardware import get_hardware
from simplesharded.passes.plans import _rank_invariant_time
from simplesharded.passes.rank_local import rank_local_nodes


def _graph():
    """Rank 1 of 2 with a 7-row weight (its chunk: 3 rows, padded to 4): cast + pad, gather,
    matmul; a gradient reduce-scatter, unpadded and cast back; and a shard also read by
    compute (not rank-local: it feeds something else)."""
    mode, g = FakeTensorMode(), fx.Graph()
    names = {}

    def ph(name, shape):
        n = g.placeholder(name)
        n.meta["val"] = mode.from_tensor(torch.empty(shape))
        return n

    def op(name, target, *args, custom=None):
        n = g.call_function(target, args)
        with mode:
            n.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args])
        if custom:
            n.meta["custom"] = custom
        names[name] = n
        return n

    ours = {"ss_param": "w"}
    x, shard, grad, other = ph("x", (5, 8)), ph("shard", (3, 8)), ph("grad", (8, 8)), ph("o", (3, 8))
    cast = op("cast", aten._to_copy.default, shard)
    pad = op("pad", aten.constant_pad_nd.default, cast, [0, 0, 0, 1])
    start = op("ag", AG, pad, 2, "0", custom=ours)
    w = op("wait", WAIT, start, custom=ours)
    y = op("mm", aten.mm.default, x, op("t", aten.t.default, w))
    rs = op("rs", RS, grad, "sum", 2, "0", custom=ours)
    red = op("rs_wait", WAIT, rs, custom=ours)
    unpad = op("unpad", aten.slice.Tensor, red, 0, 0, 3)
    back = op("back", aten._to_copy.default, unpad)
    shared = op("shared", aten.mul.Tensor, other, 2.0)
    start2 = op("ag2", AG, shared, 2, "0", custom=ours)
    op("wait2", WAIT, start2, custom=ours)
    z = op("z", aten.add.Tensor, shared, 1.0)  # the same tensor also feeds compute
    g.output((y, back, z))
    return fx.GraphModule(torch.nn.Module(), g), names


def test_finds_the_chains_around_our_collectives_only():
    gm, n = _graph()
    assert rank_local_nodes(gm.graph) == {n["cast"], n["pad"], n["unpad"], n["back"]}


def test_the_planner_costs_them_at_zero():
    gm, n = _graph()
    cost = _rank_invariant_time(gm.graph, get_hardware("local"))
    assert cost(n["cast"]) == cost(n["pad"]) == cost(n["back"]) == 0.0
    assert cost(n["mm"]) > 0 and cost(n["shared"]) > 0
