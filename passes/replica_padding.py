"""Run HSDP's replica all-reduces on the padded shard, whose size is the same on every rank.

HSDP reduces a gradient in two steps (simplesharded/storage/gather.py): a reduce-scatter over
dp_shard, then an all-reduce over dp_replicate of its result. DTensor pads the reduce-scatter
to equal chunks, but unpads its result to this rank's own chunk before the all-reduce. With
uneven shards (7 rows over 2 ranks: 4 and 3) the all-reduce then moves a different number of
bytes on the ranks of one dp_shard group, and so do the bucket sizes and simulated times a
plan derives from it (AutoPlan): the ranks would pick different buckets, and their
collectives would no longer match (docs/rank_agreement.md). This pass reduces the padded
result and unpads after the wait, as FSDP2 does:

    RS → wait → slice (unpad) → view / cast → AR → wait → users
        ⇒  RS → wait → cast → AR → wait → slice → view → users

A cast moves before the all-reduce (the reduction keeps its dtype); the ops that only select
or reshape move after it. A chain holding any other op is padded back instead
(``constant_pad_nd`` to the reduce-scatter's rows, the all-reduce, then the slice): one copy
more, the same sizes.

Invariant: afterwards every all-reduce of ours that reduces a reduce-scatter's result (through
ops that serve nothing else) has the full padded size of that result, identical on every rank
by construction; only the unpadding and what follows it to the graph's output has this rank's
size (rank_local.py, which the planner leaves out of its costs). Values: an all-reduce is
elementwise, so the padding rows reduced along and then dropped leave every other element as
it was (bitwise for 2 replicas; with more, gloo's ring may add in another order for another
buffer size: last-bit differences, as any bucket does). Idempotent. Runs before bucketing,
whose plan reads these sizes.
"""
from __future__ import annotations

import math

import torch
from torch import fx

from .collectives import (ALL_REDUCE, REDUCE_SCATTER, WAIT, Collective, find_collectives,
                          is_collective, is_wait, started_by)
from .graph_utils import aten, call, fake_mode_of
from .node_meta import concrete_int

# Ops between the reduce-scatter and the all-reduce that select or reshape elements only: the
# all-reduce commutes with them, so they can follow it.
_SELECTS = {aten.slice.Tensor, aten.narrow.default, aten.view.default,
            aten._unsafe_view.default, aten.reshape.default, aten.alias.default,
            aten.clone.default}
# Elementwise dtype casts: they commute with the selections, and stay before the reduction.
_CASTS = {aten._to_copy.default, torch.ops.prims.convert_element_type.default}
# DTensor's chain is an unpad, a view and at most one cast; a longer one is not a shard's.
_MAX_CHAIN = 8


def pad_replica_all_reduces(gm: fx.GraphModule) -> fx.GraphModule:
    """Give every all-reduce of ours that reads an unpadded reduce-scatter result the padded
    result instead (module doc); return ``gm`` (edited in place)."""
    graph = gm.graph
    found = [(c, chain) for c in find_collectives(graph) if (chain := _unpadded(c))]
    if not found:  # even shards, no HSDP: no code to regenerate either
        return gm
    fake_mode = fake_mode_of(graph, [chain[0] for _, chain in found])
    for c, chain in found:
        root, ops = chain[0], chain[1:]
        if all(_cast(n) or n.target in _SELECTS for n in ops):
            new = _reduce_moved(graph, c, root, ops, fake_mode)
        else:
            new = _reduce_padded(graph, c, root, fake_mode)
        c.wait.replace_all_uses_with(new)
        graph.erase_node(c.wait)
        graph.erase_node(c.start)
        for n in reversed(ops):  # users before what they read
            if not n.users:
                graph.erase_node(n)
    gm.recompile()
    return gm


def _unpadded(c: Collective) -> list[fx.Node] | None:
    """[reduce-scatter's wait, ops..., the all-reduce's input] when ``c`` is an all-reduce of
    ours that reads fewer elements of a reduce-scatter's result than it holds, through ops
    that each read the previous one and serve nothing else; else None."""
    if c.kind != "all_reduce" or c.start.target is not ALL_REDUCE or c.wait is None \
            or not c.ours:
        return None
    chain = [c.start.args[0]]
    while not (is_wait(chain[-1]) and started_by(chain[-1]).target is REDUCE_SCATTER):
        n = chain[-1]
        if (len(chain) > _MAX_CHAIN or n.op != "call_function" or is_collective(n)
                or is_wait(n) or len(n.all_input_nodes) != 1
                or not isinstance(n.args[0], fx.Node)):
            return None
        chain.append(n.args[0])
    chain.reverse()
    root, x = chain[0], chain[-1]
    if any(len(n.users) != 1 for n in chain):  # e.g. a bucket's split: not a shard's unpad
        return None
    if _numel(x) >= _numel(root):  # even shard, or already padded
        return None
    if not all(_cast(n) or n.target in _SELECTS for n in chain[1:]) and (
            not _shape(x) or _shape(x)[1:] != _shape(root)[1:]):
        return None  # padding back needs the rows to be what differs
    return chain


def _cast(n: fx.Node) -> bool:
    if n.target is aten._to_copy.default:
        return set(n.kwargs) <= {"dtype"}
    return n.target in _CASTS


def _reduce_moved(graph, c, root, ops, fake_mode) -> fx.Node:
    """The casts of ``ops`` on ``root``, the all-reduce, then its selections: the node that
    replaces the old wait."""
    with graph.inserting_before(c.start):
        x = root
        for n in (n for n in ops if _cast(n)):
            x = _again(graph, n, x, fake_mode)
        start = call(graph, ALL_REDUCE, (x, *c.start.args[1:]), c.start.kwargs,
                     fake_mode=fake_mode, custom=c.start.meta.get("custom"))
    with graph.inserting_before(c.wait):
        y = call(graph, WAIT, (start,), fake_mode=fake_mode, custom=c.wait.meta.get("custom"))
        for n in (n for n in ops if not _cast(n)):
            y = _again(graph, n, y, fake_mode)
    return y


def _reduce_padded(graph, c, root, fake_mode) -> fx.Node:
    """The all-reduce's input padded to ``root``'s rows, the all-reduce, then the rows this
    rank holds: the node that replaces the old wait."""
    x = c.start.args[0]
    rows, mine = _shape(root)[0], _shape(x)[0]
    with graph.inserting_before(c.start):
        pad = [0, 0] * (len(_shape(x)) - 1) + [0, rows - mine]  # last dim first: dim 0's end
        x = call(graph, aten.constant_pad_nd.default, (x, pad, 0.0), fake_mode=fake_mode,
                 custom=x.meta.get("custom"))
        start = call(graph, ALL_REDUCE, (x, *c.start.args[1:]), c.start.kwargs,
                     fake_mode=fake_mode, custom=c.start.meta.get("custom"))
    with graph.inserting_before(c.wait):
        y = call(graph, WAIT, (start,), fake_mode=fake_mode, custom=c.wait.meta.get("custom"))
        return call(graph, aten.slice.Tensor, (y, 0, 0, mine), fake_mode=fake_mode,
                    custom=c.wait.meta.get("custom"))


def _again(graph, n: fx.Node, x: fx.Node, fake_mode) -> fx.Node:
    """``n`` applied to ``x`` instead of its own input, at the insertion point."""
    return call(graph, n.target, (x, *n.args[1:]), n.kwargs, fake_mode=fake_mode,
                custom=n.meta.get("custom"))


def _shape(n: fx.Node) -> list[int]:
    return [concrete_int(s) for s in n.meta["val"].shape]


def _numel(n: fx.Node) -> int:
    return math.prod(_shape(n))
