"""Tensor parallelism for a Hugging Face causal LM: transformers' own plan, as torch styles.

A transformers config names how its model splits over tensor-parallel ranks
(``base_model_tp_plan``: module patterns such as ``layers.*.self_attn.q_proj`` → ``"colwise"``),
for transformers' ``from_pretrained(tp_plan=...)``. Its ``"colwise"`` and ``"rowwise"`` are
torch's ``ColwiseParallel`` and ``RowwiseParallel`` (Megatron's split of attention by heads and
of the MLP by hidden units: one all-reduce after each ``rowwise``), so :func:`tp_styles` hands
the same plan to ``parallelize_module`` on the trainer's tp mesh. The attention modules
reshape by ``-1`` heads and keep their query-per-key-value ratio, so each rank runs its own
heads unchanged. The output head splits by vocabulary (its logits gathered, or kept sharded
for ``loss_parallel``) unless it is tied to the input embedding, which, like the embedding
and every norm, stays whole on each tp rank (their gradients are equal there: their inputs
are).

A norm over each rank's heads (``q_norm``, ``k_norm``: transformers'
``"replicated_with_grad_allreduce"``) keeps its weight whole and sums its gradient over tp
(:func:`_norm_of_heads`).

Not covered, refused before training (:func:`check_tp`): any other style of transformers'
(packed or grouped experts, its own sequence parallelism), and sequence parallelism of ours:
activations between blocks stay whole on each tp rank.
"""
from __future__ import annotations

import re

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel


def _norm_of_heads() -> SequenceParallel:
    """A norm applied to each rank's own heads (Qwen3's, Gemma 3's ``q_norm`` / ``k_norm``):
    its weight replicated, its gradient the sum of the ranks' (each saw its heads only).
    torch's SequenceParallel does both; the shard dim it annotates is dim 0, not the heads'
    (which is 1 or 2 by model): a norm works along its last dim only, so any other dim gives
    the same values, and the weight's gradient comes out partial over tp, then summed."""
    return SequenceParallel(sequence_dim=0, use_local_output=True)


STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
          # transformers' name for a norm over per-rank heads (_norm_of_heads)
          "replicated_with_grad_allreduce": _norm_of_heads}


def _plan(config) -> dict[str, str]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return dict(getattr(text, "base_model_tp_plan", None) or {})


def check_tp(config, tp: int) -> None:
    """ValueError naming what keeps the model of ``config`` from splitting over ``tp``
    ranks: no plan, a style not translated here, or a size ``tp`` does not divide."""
    name = type(config).__name__
    plan = _plan(config)
    if not plan:
        raise ValueError(f"tensor_parallel_degree={tp}: {name} has no tensor-parallel plan "
                         f"(base_model_tp_plan) in transformers (use 1)")
    other = {k: v for k, v in plan.items() if v not in STYLES
             or v == "replicated_with_grad_allreduce" and not k.endswith("norm")}
    if other:
        k, v = next(iter(other.items()))
        raise ValueError(f"tensor_parallel_degree={tp}: {name}'s plan splits {k} as {v!r}, "
                         f"which is not translated here (only 'colwise', 'rowwise', and "
                         f"'replicated_with_grad_allreduce' of a norm; use 1)")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    # the vocabulary splits with an untied head only (a tied one stays whole)
    keys = ("num_attention_heads", "num_key_value_heads", "intermediate_size",
            *(() if getattr(text, "tie_word_embeddings", False) else ("vocab_size",)))
    sizes = {k: getattr(text, k, None) for k in keys}
    bad = {k: v for k, v in sizes.items() if isinstance(v, int) and v % tp}
    if bad:
        raise ValueError(f"tensor_parallel_degree={tp} does not divide "
                         + ", ".join(f"{k}={v}" for k, v in bad.items()))


def tp_styles(model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """``parallelize_module``'s plan for ``model``: module FQN → torch ParallelStyle."""
    if sequence_parallel:  # refused earlier, in the trainer's preflight
        raise ValueError("a Hugging Face model's tensor parallelism runs without sequence "
                         "parallelism here (--no-parallelism.enable_sequence_parallel)")
    prefix = model.base_model_prefix
    names = [n for n, _ in model.get_submodule(prefix).named_modules()]
    styles = {}
    for pattern, style in _plan(model.config).items():
        regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
        for n in filter(regex.fullmatch, names):
            styles[f"{prefix}.{n}"] = STYLES[style]()
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight is not embedding.weight:
        head_name = next(n for n, m in model.named_modules() if m is head)
        styles[head_name] = (ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
                             if loss_parallel else ColwiseParallel(output_layouts=Replicate()))
    return styles
