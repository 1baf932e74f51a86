"""Fast single-process tests of coalesced gathers (passes/coalesce_gathers.py, gloo lowering)
on real traced graphs (support/traced_graphs.py)."""
from __future__ import annotations

import pytest
import torch

from simplesharded.passes.planning import BlockPlan
from simplesharded.passes.reordering import reorder_for_overlap

import pass_utils as pu
from traced_graphs import assert_bitwise_same, block_bucketed, graph

# autouse, as in every pass test file: no test may leave a process group behind
from traced_graphs import _no_leaked_process_group  # noqa: F401


COALESCE_CASES = [("w2", "fw"), ("w2", "bw"), ("w8-bf16", "fw"), ("w8-bf16", "bw"),
                  ("w2-auto", "bw")]


def _issue_order(gm) -> list[tuple[str, tuple[str, ...]]]:
    from simplesharded.passes.collectives import find_collectives
    return [(c.kind, tuple(c.params)) for c in find_collectives(gm)]


def _reads_a_wait(node, hops=2) -> bool:
    """Does ``node`` read a wait_tensor through at most ``hops`` view/slice nodes?"""
    for _ in range(hops + 1):
        inputs = node.all_input_nodes
        if len(inputs) != 1:
            return False
        node = inputs[0]
        if node.target is pu.WAIT:
            return True
    return False


@pytest.mark.parametrize("config,which", COALESCE_CASES, ids=["-".join(c) for c in COALESCE_CASES])
def test_coalesced_gathers_drop_the_copy_out_and_keep_outputs(config, which):
    """Every multi-parameter bucket becomes one coalesced gather with a waited output per
    parameter and no clone copy-out; issue order, counts and outputs (bits) unchanged."""
    import operator

    from simplesharded.passes.coalesce_gathers import coalesce_gathers
    from simplesharded.passes.collectives import count_collectives

    world, g = graph(config, which)
    reordered = reorder_for_overlap(block_bucketed(config, which), BlockPlan())
    multi = [s for s in pu.starts(reordered, pu.AG) if len(pu.node_params(s)) > 1]
    if not multi:
        pytest.skip("no multi-parameter gather in this graph")
    # the default rewrites no transport (gloo's coalesced gather can corrupt the heap)
    untouched = coalesce_gathers(pu.fresh(reordered))
    assert pu.graph_signature(untouched) == pu.graph_signature(reordered)

    out = coalesce_gathers(pu.fresh(reordered), transports=None)
    assert count_collectives(out) == count_collectives(reordered)
    assert _issue_order(out) == _issue_order(reordered)
    co = pu.starts(out, pu.AG_COALESCED)
    assert len(co) == len(multi)
    pos = {n: i for i, n in enumerate(out.graph.nodes)}
    for s in co:
        items = list(s.users)
        assert all(u.target is operator.getitem for u in items)
        waits = [w for it in items for w in it.users]
        assert len(waits) == len(items) == len(s.args[0]), "every output waited once"
        assert all(w.target is pu.WAIT for w in waits)
        # only views read the outputs: nothing copies a gathered parameter any more
        assert all(u.target is torch.ops.aten.view.default for w in waits for u in w.users)
        assert all(pos[s] < pos[w] < pos[u] for w in waits for u in w.users)
    assert [n for n in out.graph.nodes
            if n.target is torch.ops.aten.clone.default and _reads_a_wait(n)] == []
    assert [n for n in reordered.graph.nodes
            if n.target is torch.ops.aten.clone.default and _reads_a_wait(n)] != []
    assert_bitwise_same(g, out, world)
    again = coalesce_gathers(pu.fresh(out), transports=None)
    assert pu.graph_signature(again) == pu.graph_signature(out)
