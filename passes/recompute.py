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


def tag_gathers_for_recompute(gm: fx.GraphModule, plan=None) -> fx.GraphModule:
    """Tag the joint graph ``gm`` in place and return it.

    Guarantees: only forward nodes annotated with ``ss_param`` are tagged; with
    ``ss_reshard=True`` every such node is MUST_RECOMPUTE (so no gathered tensor is saved for
    backward), otherwise the chain's output is MUST_SAVE. ``plan`` may carry
    ``reshard_after_forward`` (bool) to override the per-parameter annotation. Idempotent.
    """
    override = getattr(plan, "reshard_after_forward", None)
    backward = tangent_dependent(gm.graph)
    for node in gm.graph.nodes:
        custom = node.meta.get("custom") or {}
        if node.op != "call_function" or PARAM_KEY not in custom or node in backward:
            continue
        reshard = custom.get(RESHARD_KEY, True) if override is None else override
        if reshard:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = 0
        elif not any((u.meta.get("custom") or {}).get(PARAM_KEY) == custom[PARAM_KEY]
                     for u in node.users):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return gm
