import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.flop_counter import FlopCounterMode

from simplesharded.passes.collectives import ALL_GATHER, WAIT, find_collectives
from simplesharded.passes.comm_cost import collective_time, comm_time
from simplesharded.passes.compute_cost import node_flops, node_time
from simplesharded.passes.hardware import HARDWARE, Hardware, get_hardware
from simplesharded.passes.memory import distinct_bytes, memory_timeline, peak_memory

aten = torch.ops.aten
HW = Hardware("test", flops_per_s=1e12, alpha_s=1e-3, bandwidth_Bps=1e9, mem_bw_Bps=1e10,
              memory_bytes=2**30)


def nodes(gm, target):
    return [n for n in gm.graph.nodes if n.target == target]


def test_comm_time_formula():
    # 4 ranks, 4 GB: a ring moves 3/4 of it per rank for all-gather / reduce-scatter, twice that
    # for all-reduce; plus one alpha.
    assert comm_time("all_gather", 4e9, 4, HW) == pytest.approx(1e-3 + 3.0)
    assert comm_time("reduce_scatter", 4e9, 4, HW) == pytest.approx(1e-3 + 3.0)
    assert comm_time("all_reduce", 4e9, 4, HW) == pytest.approx(1e-3 + 6.0)
    assert comm_time("all_gather", 2e6, 2, HW) == pytest.approx(1e-3 + 1e-3)
    assert comm_time("all_gather", 4e9, 1, HW) == 0.0
    with pytest.raises(ValueError, match="all_gather"):
        comm_time("broadcast", 1, 2, HW)


def test_collective_time_uses_full_input_of_reduce_scatter():
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(1024, device="meta")
    rs = g.call_function(torch.ops._c10d_functional.reduce_scatter_tensor.default,
                         (x, "sum", 4, "0"))
    rs.meta["val"] = torch.empty(256, device="meta")
    g.output(g.call_function(WAIT, (rs,)))
    (c,) = find_collectives(g)
    assert collective_time(c, HW) == comm_time("reduce_scatter", 4096, 4, HW)


def test_get_hardware():
    assert get_hardware("h100-ib400").flops_per_s == pytest.approx(989e12 * 0.5)
    assert get_hardware("a100-ib200").bandwidth_Bps == 25e9
    with pytest.raises(ValueError) as e:
        get_hardware("tpu")
    assert str(e.value) == (f"hardware='tpu' is not one of {sorted(HARDWARE)} or a calibration "
                            ".json file")
    assert "local" in str(e.value) and "h100-ib400" in str(e.value)
    with pytest.raises(ValueError, match="flops_per_s"):
        Hardware("bad", 0, 1, 1, 1, 1)


def mats(x, w, v, b, y, z):
    h = torch.addmm(b, torch.mm(x, w), v.t())  # mm: 2*8*16*32, addmm: 2*8*32*32
    return h.sum() + torch.bmm(y, z).sum() + F.linear(x, w.t()).sum()


MATS_ARGS = (torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 32), torch.randn(32),
             torch.randn(3, 4, 5), torch.randn(3, 5, 6))


def test_node_flops_traced_matches_eager_flop_counter():
    gm = make_fx(mats, tracing_mode="fake")(*MATS_ARGS)
    mm = nodes(gm, aten.mm.default)[0]
    assert node_flops(mm) == 2 * 8 * 32 * 16
    (addmm,) = nodes(gm, aten.addmm.default)
    assert node_flops(addmm) == 2 * 8 * 32 * 32
    (bmm,) = nodes(gm, aten.bmm.default)
    assert node_flops(bmm) == 2 * 3 * 4 * 5 * 6
    with FlopCounterMode(display=False) as counter:
        mats(*MATS_ARGS)
    assert sum(node_flops(n) for n in gm.graph.nodes) == counter.get_total_flops()


def test_node_flops_forward_and_backward_graphs_match_eager():
    from functorch.compile import aot_function, make_boxed_func
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm)

    def mlp(x, w1, w2):
        return (torch.relu(x @ w1) @ w2).square().mean()

    args = [torch.randn(8, 16), torch.randn(16, 32, requires_grad=True),
            torch.randn(32, 4, requires_grad=True)]
    aot_function(mlp, keep, keep)(*args).backward()
    assert len(graphs) == 2
    with FlopCounterMode(display=False) as counter:
        mlp(*args).backward()
    ours = sum(node_flops(n) for g in graphs for n in g.graph.nodes)
    assert ours == counter.get_total_flops() > 0


def test_sdpa_flops_on_cpu_kernel():
    # torch's counter has no formula for the CPU flash kernel (eager counts 0); we count it as
    # the flash kernel: QK^T and PV, 2*B*H*S*S*D each.
    B, H, S, D = 2, 4, 16, 8
    q = torch.randn(B, H, S, D)
    gm = make_fx(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True),
                 tracing_mode="fake")(q)
    (sdpa,) = [n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert node_flops(sdpa) == 4 * B * H * S * S * D


def test_node_time_roofline_and_zero_cost_nodes():
    gm = make_fx(mats, tracing_mode="fake")(*MATS_ARGS)
    mm = nodes(gm, aten.mm.default)[0]
    moved = (8 * 16 + 16 * 32 + 8 * 32) * 4
    assert node_time(mm, HW) == pytest.approx(max(2 * 8 * 32 * 16 / 1e12, moved / 1e10))
    slow_mem = Hardware("m", 1e30, 1, 1, 1.0, 1)
    assert node_time(mm, slow_mem) == pytest.approx(moved)
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output") or n.target is aten.t.default:
            assert node_time(n, HW) == 0.0
        else:
            assert node_time(n, HW) > 0.0


def chain(a):
    b = a + 1
    c = b * 2
    d = c.view(8, 4)
    return d.view(4, 8) + b


def test_peak_memory_hand_computed():
    gm = make_fx(chain, tracing_mode="fake")(torch.randn(4, 8))
    names = [n.target for n in gm.graph.nodes]
    assert names[1:6] == [aten.add.Tensor, aten.mul.Tensor, aten.view.default, aten.view.default,
                          aten.add.Tensor]
    S = 4 * 8 * 4  # every tensor is 4x8 fp32
    # a: input. b allocated; a dead after b. c allocated. d, d' views of c (keep c alive).
    # e allocated while b and c still live; then b, c freed; e returned.
    assert memory_timeline(gm) == [S, 2 * S, 2 * S, 2 * S, 2 * S, 3 * S, S]
    assert memory_timeline(gm, include_inputs=False) == [0, S, 2 * S, 2 * S, 2 * S, 3 * S, S]
    peak, node = peak_memory(gm)
    assert peak == 3 * S and node.target is aten.add.Tensor and node.args[1].target is aten.add.Tensor


def test_peak_memory_inputs_reported_separately():
    gm = make_fx(lambda big, a: a * 2 + big.sum(), tracing_mode="fake")(
        torch.randn(64, 64), torch.randn(4))
    # with inputs: big + a + (a * 2) at the mul; without: (a * 2) + big.sum() + result at the add
    assert peak_memory(gm)[0] == 64 * 64 * 4 + 4 * 4 + 4 * 4
    assert peak_memory(gm, include_inputs=False)[0] == 4 * 4 + 4 + 4 * 4
    assert peak_memory(fx.Graph()) == (0, None)


def test_collective_buffer_lives_until_last_user_of_wait():
    g = fx.Graph()

    def add(target, args, shape):
        n = g.call_function(target, args)
        n.meta["val"] = torch.empty(shape, device="meta")
        return n

    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 8, device="meta")              # 128 B shard
    ag = add(ALL_GATHER, (x, 2, "0"), (8, 8))                       # 256 B gathered
    y = add(aten.mul.Tensor, (x, 3), (4, 8))                        # 128 B, overlaps the gather
    w = add(WAIT, (ag,), (8, 8))
    z = add(aten.sum.default, (w,), ())                             # 4 B
    g.output((z, y))
    # x is held until the wait (the collective reads it), the gathered buffer until z.
    assert memory_timeline(g) == [128, 384, 512, 512, 388, 132]
    assert peak_memory(g) == (512, y)
    for n in g.nodes:
        assert node_flops(n) == 0
        assert n.target is aten.mul.Tensor or n.target is aten.sum.default or \
            node_time(n, HW) == 0.0


def test_distinct_bytes_counts_aliases_once():
    """What forward saves for backward: the partitioner may save an all-to-all's result and
    its wait both (expert parallelism's token exchange); one buffer, counted once."""
    from simplesharded.passes.collectives import ALL_TO_ALL

    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 8, device="meta")                  # 128 B
    a2a = g.call_function(ALL_TO_ALL, (x, [2, 2], [2, 2], "0"))
    a2a.meta["val"] = torch.empty(4, 8, device="meta")                # 128 B received
    w = g.call_function(WAIT, (a2a,))
    w.meta["val"] = torch.empty(4, 8, device="meta")
    v = g.call_function(aten.view.default, (w, [32]))
    v.meta["val"] = torch.empty(32, device="meta")
    y = g.call_function(aten.mul.Tensor, (w, 2))
    y.meta["val"] = torch.empty(4, 8, device="meta")                  # 128 B fresh
    g.output((a2a, w, v, y))
    assert distinct_bytes(g, [a2a, w, v]) == 128
    assert distinct_bytes(g, [a2a, w, v, y]) == distinct_bytes(g, [a2a, y]) == 256
    assert distinct_bytes(g, [x, w]) == 256 and distinct_bytes(g, []) == 0
    # the graph's input is its owner's (a parameter shard): left out on request
    assert distinct_bytes(g, [x, w], include_inputs=False) == 128


def test_multi_output_and_inplace():
    def f(x):
        var, mean = torch.var_mean(x, dim=1)        # one node, two 64 B outputs
        y = x.clone()                               # 1 KiB
        y.add_(mean[:, None])                       # in place on y: no new buffer; mean dies
        return y, var.sum()                         # var lives until here

    gm = make_fx(f, tracing_mode="fake")(torch.randn(16, 16))
    targets = [n.target for n in gm.graph.nodes][1:-1]
    assert targets == [aten.var_mean.correction, operator.getitem, operator.getitem,
                       aten.clone.default, aten.unsqueeze.default, aten.add_.Tensor,
                       aten.sum.default]
    assert memory_timeline(gm, include_inputs=False) == [
        0, 128, 128, 128, 1152, 1152, 1152, 1024 + 64 + 4, 1024 + 4]
    add_ = nodes(gm, aten.add_.Tensor)[0]
    assert node_time(add_, HW) == pytest.approx((2 * 1024 + 64) / 1e10)  # read y, mean; write y


