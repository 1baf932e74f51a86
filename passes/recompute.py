"""Joint-graph pass: reshard after forward by recomputing parameter all-gathers in backward.

Without tags, aot_autograd's partitioner keeps every gathered (full-size) parameter alive from
forward to backward, which defeats sharding. Every forward op that turns a shard into a full
parameter carries the ``ss_param`` annotation (set in simplesharded/storage/gather.py); this pass
marks those ops MUST_RECOMPUTE when their parameter reshards after forward, and the last op of
each chain MUST_SAVE when it does not. The partitioner then re-gathers in backward.

A parameter annotated ``ss_reshard="auto"`` is decided here, per unit (its block, found by
data_parallel in the module tree and carried by the ``ss_block`` annotation, or the
parameters before/after all blocks), in forward order. Backward runs the units in reverse, so
the trailing ones are needed first and keeping them gathered saves a re-gather that nothing
could hide. Without a budget: keep the last block and what follows it (torchtitan's default
policy; FSDP2 does the same for its root). With ``plan.keep_gathered_bytes``: keep trailing
units while their gathered bytes fit the budget (DeepSpeed ZeRO-3's ``max_live_parameters``
idea), so a small model keeps everything and a large one keeps nothing it cannot afford.
With ``plan.memory_cap_bytes`` the budget (either rule) is also held to the cap less twice the
largest unit: the cap counts every gathered byte alive (docs/memory_cap.md), and while the
largest unit is gathered and copied out of its bucket it holds twice its bytes next to what
stays gathered for backward.

Forward views of a gathered parameter (the transposes a matmul saves) are annotated
``ss_gathered`` with its FQN: the backward graph receives whichever of them the partitioner
saves as placeholders, and the memory cap counts those too.

Inside a checkpointed block, tensor parallelism's all-gathers of activations (sequence
parallelism's, before attention and the MLP: each holds tp x the block's sharded input) run
again in backward rather than being saved, as torchtitan's activation checkpointing re-runs
them: every rank of the tp group recomputes the same gathers in the same order. With
``ss_ac_tp`` (activation_checkpoint.recompute_tp_outputs) the block's TP reduce-scatters run
again too, as torchtitan's full AC and eager checkpointing do: attention's and the MLP's
outputs are not saved, for one more reduce-scatter each in backward.

What is never recomputed, with or without activation checkpointing: any other collective that
is not ours (expert parallelism's all-to-alls, TP's reduce-scatters but for ``ss_ac_tp``, its
all-reduces: recomputing one would run it again in backward, and an all-to-all's result
depends on the other ranks' tokens) and the routing
decisions of a MoE layer (nodes annotated ``ss_routing`` by models/moe.py and
models/ep_dispatch.py: the top-k choice, the exchanged counts, the split sizes and the orders
built from them). They are MUST_SAVE, so
a recomputed expert computation reads the very rows forward received, never a re-routing.
Context parallelism's K/V all-gather (``ss_cp``, models/context_parallel.py) is such a
collective: backward reads the gathered keys and values forward saved and never gathers them
again (the memory of the whole sequence's K/V per layer, instead of a second gather per layer).
(torch's partitioner also force-saves collectives that are not MUST_RECOMPUTE; this pass
states it for the routing too and does not lean on that default.)
"""
from __future__ import annotations

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from .annotations import (AC_KEY, AC_TP_KEY, CP_KEY, GATHERED_KEY, PARAM_KEY, RESHARD_KEY,
                          ROUTING_KEY, annotations)
from .collectives import find_collectives, node_block, tangent_dependent, tensor_nbytes
from .graph_utils import draws_random
from .plan_protocol import Plan


def tag_gathers_for_recompute(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Tag the joint graph ``gm`` in place and return it.

    Also: forward nodes annotated ``ss_ac`` (blocks under activation checkpointing, see
    simplesharded/trainer/recipe.py) are PREFER_RECOMPUTE with one region id per block — our own
    activation checkpointing, which composes with the parameter gathers inside the block.
    Guarantees: only forward nodes annotated with ``ss_param`` are tagged; with
    ``ss_reshard=True`` every such node is MUST_RECOMPUTE (so no gathered tensor is saved for
    backward), otherwise the chain's output is MUST_SAVE; ``ss_reshard="auto"`` is resolved per
    unit by :func:`kept_gathered`. Reads ``plan.reshard_after_forward`` (a bool overrides the
    per-parameter annotation) and ``plan.keep_gathered_bytes`` (the "auto" budget).
    Forward collectives that are not ours and nodes annotated ``ss_routing`` are MUST_SAVE
    (module doc). Idempotent.
    """
    override = plan.reshard_after_forward
    backward = tangent_dependent(gm.graph)
    kept = kept_gathered(gm.graph, backward, plan.keep_gathered_bytes, plan.memory_cap_bytes)
    _annotate_views(gm.graph, backward)
    collectives = [c for c in find_collectives(gm.graph) if not c.ours]
    foreign = {n for c in collectives for n in (c.start, c.wait)}
    regathered = {n for c in collectives if _recomputed_under_ac(c) for n in (c.start, c.wait)}
    for node in gm.graph.nodes:
        custom = annotations(node)
        if node.op != "call_function" or node in backward:
            continue
        if node in regathered:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = custom[AC_KEY] + 1
            continue
        if node in foreign or ROUTING_KEY in custom:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            continue
        # One region id per checkpointed block (0 = none): the partitioner saves the boundary
        # between two regions and recomputes inside each.
        region = custom[AC_KEY] + 1 if AC_KEY in custom else 0
        if PARAM_KEY not in custom:
            if region and _seeded(node):
                _save_outputs(node)
            elif region and not _is_output_of_seeded(node):
                node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
                node.meta["ac_graph_id"] = region
            continue
        reshard = custom.get(RESHARD_KEY, True) if override is None else override
        if reshard == "auto":
            reshard = custom[PARAM_KEY] not in kept
        if reshard:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = region
        elif not any(annotations(u).get(PARAM_KEY) == custom[PARAM_KEY]
                     for u in node.users):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return gm


def _recomputed_under_ac(c) -> bool:
    """A tensor-parallel all-gather of activations inside a checkpointed block: gathered
    again in backward rather than saved (sequence parallelism's gather before attention and
    the MLP holds tp x the block's input; torchtitan's full AC re-runs it too); with
    ``ss_ac_tp`` also its reduce-scatters (attention's and the MLP's outputs). Every rank of
    the group recomputes the same collectives in the same order. Context parallelism's K/V
    gather and the MoE's routing exchanges stay saved (module doc)."""
    custom = annotations(c.start)
    kinds = ("all_gather", "reduce_scatter") if custom.get(AC_TP_KEY) else ("all_gather",)
    return (c.kind in kinds and AC_KEY in custom and CP_KEY not in custom
            and ROUTING_KEY not in custom)


def kept_gathered(graph: fx.Graph, backward: set[fx.Node], budget: int | None,
                  cap: int | None = None) -> set[str]:
    """FQNs of ``reshard="auto"`` parameters that stay gathered from forward to backward:
    trailing units while their bytes fit ``budget`` (None: the bytes of the last block and
    what follows it), held to ``cap`` less twice the largest unit when a cap is given.

    A parameter belongs to the unit its last forward use falls in: a tied output weight
    gathered with the embedding and read again by the head is needed first in backward, like
    the head, and is alive through the whole forward anyway (it is gathered once)."""
    pos = {node: i for i, node in enumerate(graph.nodes)}
    starts: dict[str, int] = {}  # unit → first forward position
    nbytes: dict[str, int] = {}  # fqn → gathered bytes (the largest node of its chain)
    last_use: dict[str, int] = {}  # fqn → position of its last forward reader
    seen_block = False
    for node in graph.nodes:
        custom = annotations(node)
        if node in backward or custom.get(RESHARD_KEY) != "auto" or PARAM_KEY not in custom:
            continue
        fqn = custom[PARAM_KEY]
        if fqn not in nbytes:
            key = node_block(node)
            seen_block = seen_block or key is not None
            key = key if key is not None else ("post" if seen_block else "pre")
            starts.setdefault(key, pos[node])
        nbytes[fqn] = max(nbytes.get(fqn, 0), tensor_nbytes(node))
        readers = [pos[u] for u in node.users if u not in backward
                   and annotations(u).get(PARAM_KEY) != fqn]
        last_use[fqn] = max([last_use.get(fqn, pos[node]), *readers])
    order = sorted(starts, key=starts.__getitem__)
    units: dict[str, list[str]] = {k: [] for k in order}
    for fqn, last in last_use.items():
        units[max((k for k in order if starts[k] <= last), key=starts.__getitem__)].append(fqn)
    unit_bytes = {k: sum(nbytes[f] for f in units[k]) for k in order}
    if budget is None:  # the last block and what follows it
        blocks = [i for i, k in enumerate(order) if k not in ("pre", "post")]
        budget = sum(unit_bytes[k] for k in order[blocks[-1]:]) if blocks else -1
    if cap is not None:
        budget = min(budget, cap - 2 * max(unit_bytes.values(), default=0))
    kept, total = set(), 0
    for key in reversed(order):
        size = unit_bytes[key]
        if total + size > budget:
            break
        total += size
        kept.update(units[key])
    return kept


def gathered_nodes(graph: fx.Graph, backward: set[fx.Node]) -> dict[fx.Node, tuple[str, bool]]:
    """The forward nodes that hold a gathered parameter, in graph order: ``{node: (fqn,
    view)}``, ``view`` False for the ops of its gather (annotated ``ss_param``), True for the
    views of them other ops make (a matmul's transposes)."""
    from .node_meta import alias_kind, aliased_inputs

    held: dict[fx.Node, tuple[str, bool]] = {}
    for node in graph.nodes:  # graph order: a view comes after what it views
        if node in backward or node.op != "call_function":
            continue
        fqn = annotations(node).get(PARAM_KEY)
        if fqn is not None:
            held[node] = (fqn, False)
        elif alias_kind(node) == "view":
            fqn = next((held[a][0] for a in aliased_inputs(node) if a in held), None)
            if fqn is not None:
                held[node] = (fqn, True)
    return held


def _annotate_views(graph: fx.Graph, backward: set[fx.Node]) -> None:
    """Mark the forward views of each gathered parameter (module doc) with its FQN."""
    for node, (fqn, view) in gathered_nodes(graph, backward).items():
        if view:
            # a dict of its own: fx.traceback.annotate may share one between nodes
            node.meta["custom"] = {**annotations(node), GATHERED_KEY: fqn}


def _seeded(node: fx.Node) -> bool:
    """Ops that may draw random numbers (e.g. CPU SDPA's dropout path). Recomputing them makes
    the partitioner save RNG state, which torch 2.13 mis-orders next to the DTensor mesh it
    also saves; leaving them to the min-cut keeps their outputs saved instead (the same choice
    selective activation checkpointing makes for attention)."""
    return draws_random(node)


def _save_outputs(node: fx.Node) -> None:
    import operator

    getitems = [u for u in node.users if u.target is operator.getitem]
    for target in getitems or [node]:
        target.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def _is_output_of_seeded(node: fx.Node) -> bool:
    import operator

    return node.target is operator.getitem and _seeded(node.args[0])
