"""Merge the collectives of one bucket into a single collective over a concatenated buffer.

all-gather:      N × (shard_i → AG → full_i)  ⇒  cat(flat shards) → AG → [ws, L] → copy-out
reduce-scatter:  N × (grad_i → RS → shard_i)  ⇒  cat(grad_i as [ws, n_i], dim=1) → RS → split
all-reduce:      N × (g_i → AR → g_i)         ⇒  cat(flat g_i) → AR → split
Shards arrive already padded to equal size per rank (DTensor pads uneven dim 0 before its
collective and slices after), so the per-rank layout [ws, L] keeps rank r's elements at row r,
and every element sees exactly the same reduction as before: outputs are bitwise unchanged.
Only collectives of the same kind, process group, dtype and reduce op share a buffer; mixed
dtypes inside one bucket become one collective per dtype.
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import fx

from .annotations import (BLOCK_KEY, BUCKET_KEY, BUCKET_PARAMS_KEY, PARAM_KEY, QUANT_KEY,
                          REGATHER_KEY, annotations)
from .collectives import (ALL_GATHER, ALL_REDUCE, PLAIN, REDUCE_SCATTER, WAIT, Collective,
                          find_collectives)
from .graph_utils import (NodeOrder, aten, call, fake_mode_of, flat, hoist_before,
                          stable_topological_sort)
from .plan_protocol import Plan


def bucket_collectives(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Merge collectives that ``plan`` puts in the same bucket; return ``gm`` (edited in place).

    ``plan.assign(gm, collectives) -> list[key | None]`` gives a bucket key per collective
    (None: leave alone). Guarantees: outputs bitwise equal; one collective per
    (bucket, kind, group, dtype, reduce op); graph stays topologically valid; idempotent
    (a bucket that already has one collective is left as is); only data-parallel collectives
    (``Collective.ours``) are offered to the plan, so TP collectives are never merged.
    """
    collectives = bucketable(gm.graph)
    merge_buckets(gm.graph, collectives, plan.assign(gm, collectives))
    gm.recompile()
    return gm


def bucketable(graph: fx.Graph) -> list[Collective]:
    """The collectives bucketing offers a plan: ours, plain and waited, in graph order."""
    return [c for c in find_collectives(graph)
            if c.wait is not None and c.start.target in PLAIN and c.ours]


def merge_buckets(graph: fx.Graph, collectives: list[Collective], keys: list,
                  fake_mode=None, detach: bool = False) -> list[Collective]:
    """The graph edit of bucket_collectives for given keys (one per collective); AutoPlan runs
    it on copies of a graph to compare candidates. Returns the collectives it merged (their
    nodes are gone). ``fake_mode``: what fake_mode_of(graph) answers, when the caller knows.
    ``detach``: leave each merged collective's start and wait in the graph instead, the start
    reading nothing and the wait read by nothing (find_collectives skips such a start), for a
    caller that puts them back (AutoPlan's trials)."""
    groups: dict[tuple, list[Collective]] = defaultdict(list)
    for c, key in zip(collectives, keys):
        if key is not None:
            # A step graph's backward gathers parameters again (step_regather.py): never in
            # one bucket with the forward's gathers of the same block.
            groups[(key, c.kind, c.group_name, c.group_size, c.dtype, _reduce_op(c),
                    bool(annotations(c.start).get(REGATHER_KEY)))].append(c)
    if fake_mode is None:
        fake_mode = fake_mode_of(graph, [c.start.args[0] for cs in groups.values() for c in cs])
    order = NodeOrder(graph)  # one for all merges: renumbering per bucket is quadratic
    merge = {"all_gather": _merge_all_gathers, "reduce_scatter": _merge_reduce_scatters,
             "all_reduce": _merge_all_reduces}
    merged: list[Collective] = []
    for (key, kind, *_), members in groups.items():
        if len(members) > 1:
            members = sorted(members, key=lambda c: order[c.start])
            _replace(members, merge[kind](graph, members, fake_mode, str(key), order), graph,
                     detach)
            merged += members
    # Users of an early reduction now read the merged one, defined at the bucket's last start.
    # (A merged gather is defined at its first start and copied out where each wait was: the
    # order stays valid, and the sort would change nothing.)
    if any(c.kind != "all_gather" for c in merged):
        stable_topological_sort(graph)
    return merged


def _reduce_op(c: Collective) -> str | None:
    if c.start.target is REDUCE_SCATTER or c.start.target is ALL_REDUCE:
        return str(c.start.args[1])
    return None


def _custom(members: list[Collective], bucket: str) -> dict:
    params = [p for c in members for p in c.params]
    custom = {BUCKET_PARAMS_KEY: params, PARAM_KEY: params[0] if params else "",
              BUCKET_KEY: bucket}
    if members[0].block is not None:
        custom[BLOCK_KEY] = members[0].block
    if annotations(members[0].start).get(REGATHER_KEY):
        custom[REGATHER_KEY] = True
    # Quantized payloads and their scales (quantized_gather.py) differ in dtype, so a merge
    # holds one role only; the merged gather keeps it, as the pass's idempotence needs.
    roles = {annotations(c.start).get(QUANT_KEY) for c in members}
    if len(roles) == 1 and None not in roles:
        custom[QUANT_KEY] = roles.pop()
    return custom


def _replace(members: list[Collective], new_values: list[fx.Node], graph: fx.Graph,
             detach: bool) -> None:
    """Members' results read from the bucket's; their collectives erased (``detach``: their
    starts read nothing, see merge_buckets). Each reader's inputs are rewritten once for the
    whole bucket (the graph's output reads every gradient: rewriting it per member was
    quadratic)."""
    new = {c.wait: v for c, v in zip(members, new_values)}
    # What replace_all_uses_with would tell an observer of the module (provenance tracking)
    hooks = getattr(graph.owning_module, "_replace_hooks", None) or ()
    for user in dict.fromkeys(u for c in members for u in c.wait.users):
        for hook in hooks:
            for old in user.all_input_nodes:
                if old in new:
                    hook(old=old, new=new[old].name, user=user)
        user.args, user.kwargs = fx.node.map_arg((user.args, user.kwargs),
                                                 lambda n: new.get(n, n))
    for c in members:
        if detach:
            c.start.args, c.start.kwargs = (), {}
        else:
            graph.erase_node(c.wait)
            graph.erase_node(c.start)


def _merge_all_gathers(graph, members, fake_mode, bucket, order):
    anchor = min((c.start for c in members), key=order.__getitem__)
    ws, name = members[0].group_size, members[0].group_name
    custom = _custom(members, bucket)
    for c in members:
        if c.start is not anchor:
            hoist_before(c.start.args[0], anchor, order)
    with graph.inserting_before(anchor):
        wait, sizes = _on_concat(graph, members, ALL_GATHER, (ws, name), fake_mode, custom)
        rows = call(graph, aten.view.default, (wait, [ws, sum(sizes)]), fake_mode=fake_mode,
                    custom=custom)
    # Copy-outs go right after the wait; reordering later moves them next to their users.
    offset, outs = 0, []
    for c, size in zip(members, sizes):
        with graph.inserting_before(c.wait):
            full_shape = list(c.wait.meta["val"].shape)
            part = call(graph, aten.slice.Tensor, (rows, 1, offset, offset + size),
                        fake_mode=fake_mode, custom=custom)
            part = call(graph, aten.clone.default, (part,),
                        {"memory_format": torch.contiguous_format}, fake_mode=fake_mode,
                        custom=custom)
            out = call(graph, aten.view.default, (part, full_shape), fake_mode=fake_mode,
                       custom=custom)
        offset += size
        outs.append(out)
    return outs


def _merge_reduce_scatters(graph, members, fake_mode, bucket, order):
    # every input exists by the last original reduce-scatter
    anchor = max((c.start for c in members), key=order.__getitem__)
    ws, name, op = members[0].group_size, members[0].group_name, members[0].start.args[1]
    custom = _custom(members, bucket)
    with graph.inserting_before(anchor):
        grads = [c.start.args[0] for c in members]
        cols = [math.prod(g.meta["val"].shape) // ws for g in grads]
        per_rank = [call(graph, aten.view.default, (flat(graph, g, fake_mode), [ws, n]),
                         fake_mode=fake_mode) for g, n in zip(grads, cols)]
        buf = call(graph, aten.cat.default, (per_rank, 1), fake_mode=fake_mode, custom=custom)
        buf = call(graph, aten.view.default, (buf, [-1]), fake_mode=fake_mode, custom=custom)
        start = call(graph, REDUCE_SCATTER, (buf, op, ws, name), fake_mode=fake_mode,
                     custom=custom)
        wait = call(graph, WAIT, (start,), fake_mode=fake_mode, custom=custom)
        return _split(graph, wait, members, cols, fake_mode, custom)


def _merge_all_reduces(graph, members, fake_mode, bucket, order):
    anchor = max((c.start for c in members), key=order.__getitem__)
    name, op = members[0].group_name, members[0].start.args[1]
    custom = _custom(members, bucket)
    with graph.inserting_before(anchor):
        wait, sizes = _on_concat(graph, members, ALL_REDUCE, (op, name), fake_mode, custom)
        return _split(graph, wait, members, sizes, fake_mode, custom)


def _on_concat(graph, members, target, args, fake_mode, custom) -> tuple[fx.Node, list[int]]:
    """One ``target`` collective (``args`` after its input) on the members' inputs flattened
    and concatenated: its wait, and each input's element count."""
    inputs = [c.start.args[0] for c in members]
    sizes = [math.prod(i.meta["val"].shape) for i in inputs]
    buf = call(graph, aten.cat.default, ([flat(graph, i, fake_mode) for i in inputs],),
               fake_mode=fake_mode, custom=custom)
    start = call(graph, target, (buf, *args), fake_mode=fake_mode, custom=custom)
    return call(graph, WAIT, (start,), fake_mode=fake_mode, custom=custom), sizes


def _split(graph, wait, members, sizes, fake_mode, custom) -> list[fx.Node]:
    """Views of consecutive pieces of a reduced flat buffer, shaped like each old result."""
    outs, offset = [], 0
    for c, n in zip(members, sizes):
        part = call(graph, aten.slice.Tensor, (wait, 0, offset, offset + n),
                    fake_mode=fake_mode, custom=custom)
        outs.append(call(graph, aten.view.default, (part, list(c.wait.meta["val"].shape)),
                         fake_mode=fake_mode, custom=custom))
        offset += n
    return outs
