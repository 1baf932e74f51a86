"""On gloo, gather into a buffer the graph allocates, so torch runs gloo's plain all-gather.

torch 2.13 runs the functional ``all_gather_into_tensor`` as a coalesced gather of one tensor,
which on gloo is ``ProcessGroupGloo::allgather_coalesced``. That work corrupts the heap when two
of them finish at once (benchmarks/RESULTS.md, Session 12): each of the group's two worker
threads, after a collective, stores the op's name into one string the group shares, without a
lock, and ``ALLGATHER_COALESCED`` is too long for the string's inline buffer, so two threads
can free the same heap buffer. The ``_out`` form goes through gloo's plain all-gather, whose
name (``ALLGATHER``), like every other op our graphs issue on gloo, fits inline: the race then
never touches the heap.

    all_gather_into_tensor(x, ws, g) → wait
        ⇒  buf = empty([ws * x.shape[0], ...]) → all_gather_into_tensor_out(x, ws, g, out=buf) → wait

Same gather, same bytes, values bitwise unchanged; the output buffer is allocated where the
op allocated it. Runs last (after reordering and the other gloo lowerings), so issue and wait
points stay where they were put.
"""
from __future__ import annotations

import torch
from torch import fx

from .collectives import ALL_GATHER, process_group_backend
from .graph_utils import aten, call, fake_mode_of

ALL_GATHER_OUT = torch.ops._c10d_functional.all_gather_into_tensor_out.default
OUT_BACKENDS = ("gloo",)


def gather_out(gm: fx.GraphModule,
               transports: tuple[str, ...] | None = OUT_BACKENDS) -> fx.GraphModule:
    """Rewrite every functional ``all_gather_into_tensor`` on a group of one of ``transports``
    (None: any), ours or not, as an ``all_gather_into_tensor_out`` into a fresh buffer; return
    ``gm`` (edited in place). Guarantees: same values; every other node, the issue order and
    the waits unchanged (the wait reads the ``_out`` node, which returns the buffer);
    idempotent."""
    graph = gm.graph
    backends: dict[str, str] = {}
    gathers = []
    for n in graph.nodes:
        if n.op != "call_function" or n.target is not ALL_GATHER:
            continue
        name = n.args[2]
        if transports is not None:
            if name not in backends:
                backends[name] = process_group_backend(name)
            if backends[name] not in transports:
                continue
        gathers.append(n)
    if not gathers:
        return gm
    fake_mode = fake_mode_of(graph, [g.args[0] for g in gathers])
    for g in gathers:
        inp, ws, name = g.args[:3]
        val = g.meta["val"]
        custom = g.meta.get("custom")
        with graph.inserting_before(g):
            buf = call(graph, aten.empty.memory_format, (list(val.shape),),
                       {"dtype": val.dtype, "device": val.device}, fake_mode=fake_mode,
                       custom=custom)
            out = call(graph, ALL_GATHER_OUT, (inp, ws, name), {"out": buf},
                       fake_mode=fake_mode, custom=custom)
        g.replace_all_uses_with(out)
        graph.erase_node(g)
    gm.recompile()
    return gm
