"""Joint-graph pass: reshard after forward by recomputing parameter all-gathers in backward.

Without tags, aot_autograd's partitioner keeps every gathered (full-size) parameter alive from
forward to backward, which defeats sharding. Every forward op that turns a shard into a full
parameter carries the ``ss_param`` annotation (set in simplesharded/sharding.py); this pass
marks those ops MUST_RECOMPUTE when their parameter reshards after forward, and the last op of
each chain MUST_SAVE when it does not. The partitioner then re-gathers in backward.
"""
from __future__ import annotations

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from .collectives import PARAM_KEY, tangent_dependent

RESHARD_KEY = "ss_reshard"
AC_KEY = "ss_ac"  # annotation of a block under activation checkpointing (value: block index)


def tag_gathers_for_recompute(gm: fx.GraphModule, plan=None) -> fx.GraphModule:
    """Tag the joint graph ``gm`` in place and return it.

    Also: forward nodes annotated ``ss_ac`` (blocks under activation checkpointing, see
    simplesharded/train.py) are PREFER_RECOMPUTE with one region id per block — our own
    activation checkpointing, which composes with the parameter gathers inside the block.
    Guarantees: only forward nodes annotated with ``ss_param`` are tagged; with
    ``ss_reshard=True`` every such node is MUST_RECOMPUTE (so no gathered tensor is saved for
    backward), otherwise the chain's output is MUST_SAVE. ``plan`` may carry
    ``reshard_after_forward`` (bool) to override the per-parameter annotation. Idempotent.
    """
    override = getattr(plan, "reshard_after_forward", None)
    backward = tangent_dependent(gm.graph)
    for node in gm.graph.nodes:
        custom = node.meta.get("custom") or {}
        if node.op != "call_function" or node in backward:
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
        if reshard:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = region
        elif not any((u.meta.get("custom") or {}).get(PARAM_KEY) == custom[PARAM_KEY]
                     for u in node.users):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return gm


def _seeded(node: fx.Node) -> bool:
    """Ops that may draw random numbers (e.g. CPU SDPA's dropout path). Recomputing them makes
    the partitioner save RNG state, which torch 2.13 mis-orders next to the DTensor mesh it
    also saves; leaving them to the min-cut keeps their outputs saved instead (the same choice
    selective activation checkpointing makes for attention)."""
    import torch

    return isinstance(node.target, torch._ops.OpOverload) and \
        torch.Tag.nondeterministic_seeded in node.target.tags


def _save_outputs(node: fx.Node) -> None:
    import operator

    getitems = [u for u in node.users if u.target is operator.getitem]
    for target in getitems or [node]:
        target.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def _is_output_of_seeded(node: fx.Node) -> bool:
    import operator

    return node.target is operator.getitem and _seeded(node.args[0])
