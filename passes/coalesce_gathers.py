"""Let gloo write a bucket's gathered parameters straight into their own tensors.

A bucketed all-gather (passes/bucketing.py) gathers one flat buffer ``[ws, L]`` and then
copies every parameter's columns out of it. On gloo that is the third copy of every gathered
byte: gloo itself gathers into a scratch buffer and copies each rank's chunk into the output.
Its coalesced all-gather takes a list of inputs and copies each rank's chunk of input ``i``
straight into output ``i`` (one contiguous ``[ws * n_i]`` tensor, rank-major: exactly the
gathered parameter), and flattens the inputs on its own worker thread instead of ours:

    cat(shards) → AG → wait → view [ws, L] → slice_i → clone_i
        ⇒  AG_coalesced(shards) → getitem_i → wait_i → view_i [ws, n_i]

Same bytes on the wire, one full copy of the bucket less, and the concatenation moves off
the compute thread: measured for one llama3-small block on 2 gloo ranks, see
``python -m simplesharded.tools.bench_collectives``. Values are copies, so outputs are bitwise
unchanged. Runs last (after reordering): the new collective is issued where the old one was and
waited where the old one was waited.

No transport is rewritten by default (``COALESCED_BACKENDS`` is empty), gloo included: torch's
gloo process group corrupts the heap under its coalesced gather when two finish at once
(simplesharded/shims/gloo_gather.py says how; benchmarks/RESULTS.md, Session 12). On gloo every
bucket is gathered with the plain all-gather instead (gloo_gather's kernel). NCCL gathers a
flat buffer faster than a group of per-parameter gathers anyway, and its copy-out runs on the
GPU. ``transports=("gloo",)`` (or None) still applies the rewrite where asked.
"""
from __future__ import annotations

import operator

from torch import fx

from .collectives import ALL_GATHER, ALL_GATHER_COALESCED, WAIT, collectives_on
from .graph_utils import aten, call, fake_mode_of

# Transports rewritten by default: none while gloo's coalesced gather can corrupt the heap (above).
COALESCED_BACKENDS: tuple[str, ...] = ()


def coalesce_gathers(gm: fx.GraphModule,
                     transports: tuple[str, ...] | None = COALESCED_BACKENDS) -> fx.GraphModule:
    """Rewrite every bucketed all-gather on a group of one of ``transports`` (None: any) as a
    coalesced all-gather with one output per parameter; return ``gm`` (edited in place).
    Guarantees: same values (copies only); issue and wait points unchanged; anything but the
    exact pattern bucketing emits is left alone; idempotent."""
    graph = gm.graph
    matches = [(c, m) for c in collectives_on(graph, ALL_GATHER, transports)
               if (m := _match(c)) is not None]
    if not matches:  # nothing to rewrite (NCCL): no code to regenerate either
        return gm
    fake_mode = fake_mode_of(graph)
    for c, (cat, rows, clones) in matches:
        inputs = list(cat.args[0])
        ws = c.group_size
        start_custom = c.start.meta.get("custom")
        wait_custom = c.wait.meta.get("custom")
        with graph.inserting_before(c.start):
            start = call(graph, ALL_GATHER_COALESCED, (inputs, ws, c.group_name),
                         fake_mode=fake_mode, custom=start_custom)
            outs = [call(graph, operator.getitem, (start, i), fake_mode=fake_mode,
                         custom=start_custom) for i in range(len(inputs))]
        with graph.inserting_before(c.wait):
            for i, clone in enumerate(clones):
                # Every output is waited, read or not: the work stays registered until then.
                wait = call(graph, WAIT, (outs[i],), fake_mode=fake_mode, custom=wait_custom)
                if clone is None:  # a member nobody reads
                    continue
                view = call(graph, aten.view.default, (wait, list(clone.meta["val"].shape)),
                            fake_mode=fake_mode, custom=clone.meta.get("custom"))
                clone.replace_all_uses_with(view)
        for clone in clones:
            if clone is not None:
                slice_ = clone.args[0]
                graph.erase_node(clone)
                graph.erase_node(slice_)
        for node in (rows, c.wait, c.start, cat):
            if not node.users:
                graph.erase_node(node)
    gm.recompile()
    return gm


def _match(c):
    """(cat, rows view, [clone per input or None]) if ``c`` is a bucketed gather exactly as
    bucketing emits it, else None."""
    cat = c.start.args[0]
    if not (isinstance(cat, fx.Node) and cat.target is aten.cat.default
            and len(cat.args) == 1 and len(cat.users) == 1):
        return None
    inputs = cat.args[0]
    if any(not isinstance(i, fx.Node) or len(i.meta["val"].shape) != 1 for i in inputs):
        return None
    ws = c.group_size
    rows = next(iter(c.wait.users), None)
    if not (len(c.wait.users) == 1 and rows.target is aten.view.default
            and list(rows.args[1]) == [ws, sum(i.meta["val"].shape[0] for i in inputs)]):
        return None
    bounds, offset = {}, 0
    for k, i in enumerate(inputs):
        n = i.meta["val"].shape[0]
        bounds[(offset, offset + n)] = k
        offset += n
    clones: list = [None] * len(inputs)
    for slice_ in rows.users:
        if not (slice_.target is aten.slice.Tensor and slice_.args[1] == 1
                and len(slice_.users) == 1):
            return None
        k = bounds.get((slice_.args[2], slice_.args[3]))
        clone = next(iter(slice_.users))
        if k is None or clones[k] is not None or clone.target is not aten.clone.default:
            return None
        clones[k] = clone
    return cat, rows, clones
