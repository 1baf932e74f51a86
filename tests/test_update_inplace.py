"""passes/update_inplace.py on hand-built functionalized graphs: an Adam-like update traced
with its input mutations kept as copy_ at the end (as aot_autograd keeps them in a step
graph) runs in place after the pass, with bitwise the same results; a chain whose input is
still read after the chain starts is left alone."""
from __future__ import annotations

import copy
import math

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from simplesharded.passes.update_inplace import reinplace_updates

aten = torch.ops.aten


def _adam_like(p, exp_avg, exp_avg_sq, grad):
    exp_avg.lerp_(grad, 0.1)
    exp_avg_sq.mul_(0.999).addcmul_(grad * 0.001, grad)
    p.mul_(0.99)
    p.add_((exp_avg * -0.01) / (exp_avg_sq.sqrt() + 1e-8))
    return (grad * 2).sum()


def _functional_graph(fn, *args):
    gm = make_fx(torch.func.functionalize(fn, remove="mutations_and_views"))(*args)
    return gm


def _inputs():
    """p, exp_avg, exp_avg_sq (non-negative, as a second moment is), grad."""
    g = torch.Generator().manual_seed(0)
    p, exp_avg, exp_avg_sq, grad = (torch.randn(37, 5, generator=g) for _ in range(4))
    return [p, exp_avg, exp_avg_sq.abs(), grad]


def _copies(gm):
    return [n for n in gm.graph.nodes if n.target is aten.copy_.default]


def test_functional_update_runs_in_place_with_the_same_bits():
    gm = _functional_graph(_adam_like, *_inputs())
    assert len(_copies(gm)) == 3  # p, exp_avg, exp_avg_sq written back at the end
    ref_inputs = _inputs()
    ref_out = copy.deepcopy(gm)(*ref_inputs)
    gm = reinplace_updates(gm)
    gm.graph.lint()
    assert _copies(gm) == []
    targets = {n.target for n in gm.graph.nodes}
    assert {aten.lerp_.Scalar, aten.mul_.Tensor, aten.addcmul_.default,
            aten.add_.Tensor} <= targets
    inputs = _inputs()
    out = gm(*inputs)
    assert torch.equal(out, ref_out)
    assert all(torch.equal(a, b) for a, b in zip(inputs, ref_inputs))
    code = gm.code
    assert reinplace_updates(gm).code == code  # a second run changes nothing


def test_input_read_after_the_chain_starts_is_left_alone():
    def fn(x):
        y = x + 1
        x.mul_(2)
        return y

    gm = _functional_graph(fn, torch.randn(4))
    nodes = list(gm.graph.nodes)
    add = next(n for n in nodes if n.target is aten.add.Tensor)
    mul = next(n for n in nodes if n.target is aten.mul.Tensor)
    mul.append(add)  # the old value is now read after the write would have happened
    gm.recompile()
    reinplace_updates(gm)
    assert len(_copies(gm)) == 1 and mul.target is aten.mul.Tensor
    x = torch.randn(4)
    before = x.clone()
    assert torch.equal(gm(x), before + 1) and torch.equal(x, before * 2)


SIZES = ((4, 5), (7,), (3, 2))


def _flat_update(flat, *state_and_grads):
    """The update of three parameters whose local tensors are slices of one buffer (a ragged
    bucket's members), each written in place through its slice, with their own state and
    gradients, as compile_step's update writes them."""
    n = len(SIZES)
    offset = 0
    for shape, m, g in zip(SIZES, state_and_grads[:n], state_and_grads[n:]):
        size = math.prod(shape)
        p = flat[offset:offset + size].view(shape)
        m.lerp_(g, 0.1)
        p.mul_(0.99)
        p.add_(m * -0.01)
        offset += size
    return sum(g.sum() for g in state_and_grads[n:])


def _flat_graph(fn):
    """Functionalized as aot_autograd leaves a step graph: views stay views, input mutations
    are copy_ at the end, dead nodes are gone."""
    gm = make_fx(torch.func.functionalize(fn, remove="mutations"))(*_flat_inputs())
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _flat_inputs():
    g = torch.Generator().manual_seed(1)
    flat = torch.randn(sum(math.prod(s) for s in SIZES), generator=g)
    return [flat] + [torch.randn(s, generator=g) for s in SIZES + SIZES]


def _scatters(gm):
    return [n for n in gm.graph.nodes if n.target is aten.slice_scatter.default]


def test_slices_of_one_buffer_are_updated_in_place_with_the_same_bits():
    gm = _flat_graph(_flat_update)
    # each slice written twice, then the buffer and each state copied back
    assert len(_scatters(gm)) == 2 * len(SIZES) and len(_copies(gm)) == 1 + len(SIZES)
    ref_inputs = _flat_inputs()
    ref_out = copy.deepcopy(gm)(*ref_inputs)
    gm = reinplace_updates(gm)
    gm.graph.lint()
    assert _scatters(gm) == [] and _copies(gm) == []
    inputs = _flat_inputs()
    assert torch.equal(gm(*inputs), ref_out)
    assert all(torch.equal(a, b) for a, b in zip(inputs, ref_inputs))
    code = gm.code
    assert reinplace_updates(gm).code == code


def test_a_buffer_read_between_its_slices_updates_keeps_its_scatters():
    def fn(flat, *state_and_grads):
        out = _flat_update(flat, *state_and_grads)
        return out + flat.sum()  # reads the buffer once every slice is written

    gm = _flat_graph(fn)
    ref_inputs = _flat_inputs()
    ref_out = copy.deepcopy(gm)(*ref_inputs)
    gm = reinplace_updates(gm)
    gm.graph.lint()
    assert len(_scatters(gm)) == 2 * len(SIZES)  # the sum reads the last scatter: kept
    inputs = _flat_inputs()
    assert torch.equal(gm(*inputs), ref_out)
    assert all(torch.equal(a, b) for a, b in zip(inputs, ref_inputs))
