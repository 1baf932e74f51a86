"""The annotation keys in ``node.meta["custom"]`` (written with ``fx.traceback.annotate`` while
tracing, or by our passes on the nodes they create), defined once; every writer and reader
imports them from here.

Written by data_parallel (simplesharded/storage/gather.py) on every op that gathers a parameter:
  PARAM_KEY          the parameter's FQN; how every pass finds what a collective serves
  DP_GROUPS_KEY      the process groups of its data-parallel dims: a collective is ours to
                     bucket and move only on one of these (TP's collectives stay where they are)
  BLOCK_KEY          FQN of its block (simplesharded/blocks.py); absent outside blocks
  RESHARD_KEY        its reshard_after_forward: True, False or "auto" (passes/recompute.py)
Written by activation checkpointing under compile (simplesharded/trainer/recipe.py):
  AC_KEY             index of the checkpointed block a forward op belongs to
  AC_TP_KEY          True when that block's tensor-parallel reduce-scatters run again in
                     backward (activation_checkpoint.recompute_tp_outputs; recompute.py)
Written by the MoE layer (models/moe.py; its token dispatch: models/ep_dispatch.py):
  ROUTING_KEY        on the ops that decide where tokens go (the top-k choice, and under
                     expert parallelism the exchanged counts, split sizes and the orders built
                     from them): recompute.py saves them for backward, never recomputes them
Written by context parallelism (models/context_parallel.py):
  CP_KEY             on the all-gather of K and V over the cp group (its value: the group's
                     name): a collective of the model, not of a parameter; no pass merges
                     it, only cp_overlap.py moves it, and backward reads its saved result
                     (recompute.py)
Written by compile_step's traced update (simplesharded/step/optim_update.py):
  UPDATE_KEY         on every op of a parameter's optimizer update: that parameter's FQN
                     (its index in the optimizer when it is not the model's); how
                     update_placement.py finds an update to move next to its reduction
Written by float8 linear layers (simplesharded/float8.py):
  FLOAT8_KEY         on the ops of a Float8Linear's weight cast to float8 (tensorwise
                     dynamic scaling), with their role: "amax" (the tensor-wide max, fp32),
                     "scale" (the fp32 scale the matmul reads), "values" (the e4m3fn
                     weight), "op" (the rest); how float8_gather.py finds the cast a gathered
                     weight feeds, and casts its shard instead. On the all-reduce (max) of
                     the shards' amax that pass adds, and on its all-gather of the cast
                     shard's bytes (and their waits): "amax_reduce" and "payload"
Written by our passes:
  BUCKET_KEY         the bucket a merged collective implements (bucketing.py)
  BUCKET_PARAMS_KEY  FQNs of every parameter a merged collective serves (bucketing.py)
  LOWERED_KEY        the kind an all-to-all implements (lowering.py): it is then one of ours
  REGATHER_KEY       on the ops step_regather.py adds to a step graph's traced backward: a
                     gather made again for backward, bucketed apart from the forward's
                     gathers (bucketing.py)
  QUANT_KEY          on the two all-gathers (and their waits) quantized_gather.py makes of a
                     parameter's gather: "payload" (int8 or float8 values) or "scales" (one
                     fp32 scale per block); what makes that pass idempotent. On the two
                     all-to-alls (and their waits) quantized_reduce.py makes of a gradient
                     reduce-scatter, the same roles; on its bf16 reduce-scatter, "bf16"
  GATHERED_KEY       FQN of the gathered parameter a forward view of it holds (recompute.py):
                     a saved view reaches the backward graph as a placeholder carrying it, so
                     the memory cap counts it (gathered_spans.py, memory.py)
Written by ragged buckets (simplesharded/storage/ragged_shards.py):
  RAGGED_KEY         the bucket's name, on its gather and (its split's backward) its
                     reduce-scatter: every member is a view of the gathered buffer, and a
                     merge with another collective would copy it out again, so no plan
                     merges it (plans.py); grads_in_place.py finds the split's backward by it
Written by host offload (simplesharded/storage/offload.py), with the bucket's annotation:
  OFFLOAD_KEY        "to_compute" on the copy of a host shard to the compute device that its
                     all-gather reads ("resident": the view of the shard's resident copy it
                     reads instead, offload "optimizer"), "to_host" on the copy of its
                     reduced gradient back
"""
from __future__ import annotations

from torch import fx

PARAM_KEY = "ss_param"
DP_GROUPS_KEY = "ss_dp_groups"
BLOCK_KEY = "ss_block"
RESHARD_KEY = "ss_reshard"
AC_KEY = "ss_ac"
AC_TP_KEY = "ss_ac_tp"
ROUTING_KEY = "ss_routing"
CP_KEY = "ss_cp"
BUCKET_KEY = "ss_bucket"
BUCKET_PARAMS_KEY = "ss_bucket_params"
LOWERED_KEY = "ss_lowered"
GATHERED_KEY = "ss_gathered"
REGATHER_KEY = "ss_regather"
UPDATE_KEY = "ss_update"
RAGGED_KEY = "ss_ragged"
QUANT_KEY = "ss_quant"
FLOAT8_KEY = "ss_float8"
OFFLOAD_KEY = "ss_offload"
# Graph-level, in GraphModule.meta: lines a pass leaves about what it did not do and why; a
# graph dump (pipeline.py) prints them at its top.
NOTES_KEY = "ss_notes"


def add_note(gm: fx.GraphModule, note: str) -> None:
    notes = gm.meta.setdefault(NOTES_KEY, [])
    if note not in notes:
        notes.append(note)


def annotations(node: fx.Node) -> dict:
    """The node's annotations ({} when it has none)."""
    return node.meta.get("custom") or {}


def has_float8_casts(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` holds a float8 weight cast a Float8Linear annotated (FLOAT8_KEY)."""
    return any(annotations(n).get(FLOAT8_KEY) == "values" for n in gm.graph.nodes)


def gathered_param(node: fx.Node) -> str | None:
    """FQN of the gathered parameter ``node`` holds (itself or a view of it), if any."""
    custom = annotations(node)
    return custom.get(GATHERED_KEY) or custom.get(PARAM_KEY)
