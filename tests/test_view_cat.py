"""passes/view_cat.py on hand-built graphs (make_fx, fake values): a concatenation of adjacent
views of one tensor becomes a view of it (under a cast: one cast of the view), with bitwise
the same result; pieces out of order, from two tensors, with a gap, or of a tensor the graph
writes to keep their copy."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from simplesharded.passes.view_cat import elide_view_cats

aten = torch.ops.aten
SIZES = [3, 8, 5]


def _graph(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def _cats(gm):
    return [n for n in gm.graph.nodes if n.target is aten.cat.default]


def _check(fn, *args, elided: bool):
    gm = _graph(fn, *args)
    assert len(_cats(gm)) == 1
    ref = fn(*args)
    gm = elide_view_cats(gm)
    gm.graph.lint()
    assert (not _cats(gm)) is elided
    out = gm(*args)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    return gm, out


def _buffer():
    return torch.randn(sum(SIZES), generator=torch.Generator().manual_seed(0))


def _split_views(flat):
    # pieces of one buffer, reshaped and flattened again for a cat
    pieces = torch.split(flat, SIZES)
    return [p.view(1, -1).view(-1) for p in pieces]


def test_adjacent_split_pieces_are_the_buffer_itself():
    def fn(flat):
        return torch.cat(_split_views(flat)) * 1  # a reader, so the output is not an input

    gm, _ = _check(fn, _buffer(), elided=True)
    # the multiply reads the placeholder (through at most a view): no copy left
    mul = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
    assert mul.args[0].op == "placeholder" or mul.args[0].args[0].op == "placeholder"


def test_a_run_in_the_middle_is_a_slice_of_it():
    def fn(flat):
        return torch.cat([flat[3:6], flat[6:11].view(5, 1).view(-1)]) + 0

    gm, _ = _check(fn, _buffer(), elided=True)
    slices = [n for n in gm.graph.nodes if n.target is aten.slice.Tensor]
    assert [s.args[2:4] for s in slices][-1] == (3, 11)


def test_pieces_under_one_cast_become_one_cast():
    def fn(flat):
        return torch.cat([p.to(torch.bfloat16) for p in _split_views(flat)])

    gm, out = _check(fn, _buffer(), elided=True)
    casts = [n for n in gm.graph.nodes
             if n.target in (aten._to_copy.default, torch.ops.prims.convert_element_type.default)]
    assert len(casts) == 1 and out.dtype == torch.bfloat16


def test_pieces_out_of_order_keep_their_copy():
    def fn(flat):
        a, b, c = _split_views(flat)
        return torch.cat([b, a, c])

    _check(fn, _buffer(), elided=False)


def test_a_gap_between_pieces_keeps_the_copy():
    def fn(flat):
        return torch.cat([flat[0:3], flat[4:9]])

    _check(fn, _buffer(), elided=False)


def test_pieces_of_two_tensors_keep_their_copy():
    def fn(x, y):
        return torch.cat([x[0:3], y[3:9]])

    _check(fn, _buffer(), _buffer() + 1, elided=False)


def test_a_tensor_the_graph_writes_keeps_its_copy():
    def fn(flat):
        out = torch.cat(_split_views(flat))
        flat.add_(1)  # a view of flat would see this write; the cat's copy does not
        return out

    gm = make_fx(fn, tracing_mode="fake")(_buffer())
    assert _cats(elide_view_cats(gm))
    x = _buffer()
    assert torch.equal(gm(x), _buffer())


def test_a_slice_along_another_dim_is_not_a_run():
    def fn(m):
        return torch.cat([m[:, 0:2].reshape(-1), m[:, 2:4].reshape(-1)])

    _check(fn, torch.randn(3, 4), elided=False)
