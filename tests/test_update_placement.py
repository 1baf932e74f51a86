"""passes/update_placement.py on compile_step's traced step graph (the 2-block Llama of
tests/test_step.py on a fake world of 2, aot_eager_blockbucketing): each bucket's updates
run between its reduce-scatter's wait and the next one's, a second run changes nothing, and
with clipping nothing moves. Values: tests/test_step.py's bitwise parity runs this pass."""
from __future__ import annotations

import copy

import torch

from simplesharded.passes.torch_compat import STEP_GRAPH
from test_step import _plain_model, _step_graphs
from torch_range import needs_torch

# The ops that make a parameter's new state and value (its moments, the denominator, the
# step): each reads its gradient or what was computed from it.
_UPDATE_OPS = (torch.ops.aten.lerp.Scalar, torch.ops.aten.addcmul.default,
               torch.ops.aten.sqrt.default, torch.ops.aten.div.Tensor)


def _graphs(max_norm=None):
    seen, _ = _step_graphs(max_norm=max_norm)  # memoized there
    return seen


def _updates(gm):
    """parameter FQN -> its update's ops (annotated at trace time)."""
    from simplesharded.passes.annotations import UPDATE_KEY, annotations

    out: dict[str, list] = {}
    for n in gm.graph.nodes:
        name = annotations(n).get(UPDATE_KEY)
        if name is not None and n.target in _UPDATE_OPS:
            out.setdefault(name, []).append(n)
    return out


def _hand_built():
    """Two reductions in flight, then two parameters' updates (each: a step count from its
    state, then a product with its reduced gradient) and the copy back into a state."""
    from torch import fx

    from simplesharded.passes.annotations import UPDATE_KEY

    c10d, aten = torch.ops._c10d_functional, torch.ops.aten
    g = fx.Graph()
    g1, g2, s1, s2 = (g.placeholder(n) for n in ("g1", "g2", "s1", "s2"))
    rs1 = g.call_function(c10d.reduce_scatter_tensor.default, (g1, "sum", 2, "0"))
    rs2 = g.call_function(c10d.reduce_scatter_tensor.default, (g2, "sum", 2, "0"))
    w1 = g.call_function(c10d.wait_tensor.default, (rs1,))
    mm = g.call_function(aten.mm.default, (g1, g2))  # backward still computing
    w2 = g.call_function(c10d.wait_tensor.default, (rs2,))
    out = []
    for name, w, s in (("p1", w1, s1), ("p2", w2, s2)):
        step = g.call_function(aten.add.Tensor, (s, 1))
        new = g.call_function(aten.mul.Tensor, (w, step))
        for n in (step, new):
            n.meta["custom"] = {UPDATE_KEY: name}
        out.append(new)
    copy_back = g.call_function(aten.copy_.default, (s1, out[0]))
    copy_back.meta["custom"] = {UPDATE_KEY: "p1"}
    g.output((mm, *out))
    return fx.GraphModule(torch.nn.Module(), g)


def test_hand_built_update_moves_to_its_wait_and_no_further():
    """p1's update goes right after its wait, ahead of the compute and the other wait, in its
    order; p2's crosses no collective and stays; the in-place copy back stays last; a second
    run changes nothing."""
    from simplesharded.passes.update_placement import place_updates

    gm = _hand_built()
    traced = list(gm.graph.nodes)
    ph, (rs1, rs2, w1, mm, w2, step1, new1, step2, new2, copy_back, out) = traced[:4], traced[4:]
    gm = place_updates(gm)
    gm.graph.lint()
    placed = list(gm.graph.nodes)
    assert placed == [*ph, rs1, rs2, w1, step1, new1, mm, w2, step2, new2, copy_back, out]
    assert list(place_updates(gm).graph.nodes) == placed


@needs_torch(STEP_GRAPH)
def test_each_buckets_update_runs_between_its_wait_and_the_next():
    """Every parameter's update follows its bucket's reduce-scatter wait and precedes the
    next bucket's wait (the last bucket's: after its wait), so it overlaps the next
    reduction; the pipeline ran the pass on the step graph."""
    import pass_utils as pu

    seen = _graphs()
    assert "update_placement" in seen
    final = seen["agreement"][0]
    pos = pu._pos(final)
    updates = _updates(final)
    assert set(updates) == {n for n, _ in _plain_model().named_parameters()}
    reds = sorted(pu.reduction_intervals(final))
    assert len(reds) > 2
    waits = [w for _, w, _ in reds] + [len(pos)]
    for k, (_, wait, start) in enumerate(reds):
        params = pu.node_params(start)
        assert params
        for p in params:
            assert all(wait < pos[n] < waits[k + 1] for n in updates[p]), (k, p)
    # Moved: before, every update came after the last reduce-scatter's start.
    before = seen["lowering"][0]
    first = min(pu._pos(before)[n] for ns in _updates(before).values() for n in ns)
    assert first > sorted(pu.reduction_intervals(before))[-1][0]


@needs_torch(STEP_GRAPH)
def test_a_second_run_changes_nothing():
    from simplesharded.passes.update_placement import place_updates

    final = copy.deepcopy(_graphs()["agreement"][0])
    order = [n.name for n in final.graph.nodes]
    again = place_updates(final)
    again.graph.lint()
    assert [n.name for n in again.graph.nodes] == order


@needs_torch(STEP_GRAPH)
def test_with_clipping_nothing_moves():
    """Every update reads the clipped gradient, which waits on the global norm's all-reduce:
    the graph leaves the pass as it came."""
    seen = _graphs(max_norm=1.0)
    before, after = seen["lowering"][0], seen["update_placement"][0]
    assert [n.name for n in after.graph.nodes] == [n.name for n in before.graph.nodes]
