"""Lower reduce-scatters for transports that have no real one (gloo).

gloo implements ``reduce_scatter_tensor`` as a copy of the input, an all-reduce of the whole
buffer and a copy of this rank's chunk: twice the bytes on the wire of a reduce-scatter, two
extra buffer copies, and the reduction of every element on every rank. On CPU those cycles
come out of the same cores that run compute. An all-to-all moves exactly a reduce-scatter's
bytes (each rank receives the chunks it owns), after which the rank adds its ``ws`` chunks:

    RS(x, sum)  ⇒  a2a(x) → view [ws, *shard] → chunk 0 + chunk 1 + ... (rank order)

Measured for one llama3-small block on 2 gloo ranks: about half the CPU time and wall time
of gloo's reduce-scatter (``python -m simplesharded.tools.bench_collectives``). With 2 ranks
every element is the same ``a + b`` as before: bitwise equal. With more ranks the sum runs in
rank order instead of gloo's ring order (last-bit differences only). Only ``sum`` reductions
on gloo groups are lowered; NCCL has a native reduce-scatter and is left alone. Runs last
(after bucketing and reordering), so the collective stays where reordering put it.
"""
from __future__ import annotations

from torch import fx

from .annotations import LOWERED_KEY
from .collectives import ALL_TO_ALL, REDUCE_SCATTER, WAIT, collectives_on
from .graph_utils import aten, call, fake_mode_of

LOWERED_BACKENDS = ("gloo",)


def lower_reduce_scatters(gm: fx.GraphModule,
                          transports: tuple[str, ...] | None = LOWERED_BACKENDS
                          ) -> fx.GraphModule:
    """Rewrite every sum reduce-scatter on a group of one of ``transports`` (None: any) as
    all-to-all + local adds; return ``gm`` (edited in place). Guarantees: same values (bitwise
    for 2 ranks); the new collective is issued where the old one was and waited where it was
    waited; idempotent."""
    graph = gm.graph
    lowered = [c for c in collectives_on(graph, REDUCE_SCATTER, transports)
               if str(c.start.args[1]) == "sum" and c.group_size > 1
               and not c.start.args[0].meta["val"].shape[0] % c.group_size]
    if not lowered:  # nothing to rewrite (NCCL): no code to regenerate either
        return gm
    fake_mode = fake_mode_of(graph)
    for c in lowered:
        inp, op, ws, name = c.start.args[:4]
        custom = dict(c.start.meta.get("custom") or {}, **{LOWERED_KEY: "reduce_scatter"})

        def emit(target, args, c=c, custom=custom):
            # the all-to-all issued where the reduce-scatter was, the rest where it was waited
            issue = target is ALL_TO_ALL
            with graph.inserting_before(c.start if issue else c.wait):
                return call(graph, target, args, fake_mode=fake_mode,
                            custom=custom if issue else c.wait.meta.get("custom"))

        total = reduce_scatter_as_all_to_all(inp, inp.meta["val"].shape[0], ws, name,
                                             list(c.wait.meta["val"].shape), emit)
        c.wait.replace_all_uses_with(total)
        graph.erase_node(c.wait)
        graph.erase_node(c.start)
    gm.recompile()
    return gm


def reduce_scatter_as_all_to_all(inp, rows: int, ws: int, group_name: str,
                                 shard_shape: list[int], emit=None):
    """The sum reduce-scatter of ``inp`` (``rows`` on dim 0, in ``ws`` equal chunks) over
    group ``group_name``, as an all-to-all and the chunks added in rank order: for the graphs
    this pass lowers and for eager reductions (simplesharded/storage/deferred_reduce.py) alike.
    ``emit(target, args)`` issues each op: runs it (default), or the pass inserts a node.
    Adds, not ``sum(dim=0)``: a reduction over the outer dim of ``[ws, n]`` runs ~3x slower
    on CPU than ``ws - 1`` vector adds."""
    if emit is None:
        def emit(target, args):
            return target(*args)
    splits = [rows // ws] * ws
    flat = emit(WAIT, (emit(ALL_TO_ALL, (inp, splits, splits, group_name)),))
    parts = emit(aten.view.default, (flat, [ws] + shard_shape))
    total = emit(aten.select.int, (parts, 0, 0))
    for r in range(1, ws):
        total = emit(aten.add.Tensor, (total, emit(aten.select.int, (parts, 0, r))))
    return total
