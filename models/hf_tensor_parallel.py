"""Tensor parallelism for a Hugging Face causal LM: transformers' own plan, as torch styles.

A transformers config names how its model splits over tensor-parallel ranks
(``base_model_tp_plan``: module patterns such as ``layers.*.self_attn.q_proj`` → ``"colwise"``),
for transformers' ``from_pretrained(tp_plan=...)``. Its ``"colwise"`` and ``"rowwise"`` are
torch's ``ColwiseParallel`` and ``RowwiseParallel`` (Megatron's split of attention by heads and
of the MLP by hidden units), so :func:`tp_styles` hands the same plan to ``parallelize_module``
on the trainer's tp mesh. The attention modules reshape by ``-1`` heads and keep their
query-per-key-value ratio, so each rank runs its own heads unchanged. A norm over each rank's
heads (``q_norm``, ``k_norm``: transformers' ``"replicated_with_grad_allreduce"``) keeps its
weight whole and sums its gradient over tp (:func:`_norm_of_heads`).

Sequence parallelism (the trainer's default, torchtitan's plan for its Llama): the hidden
states between the blocks' matmuls are DTensors sharded on the sequence dim, so the residual
adds and every norm outside attention run on 1/tp of the tokens; each attention and MLP
gathers its input once (:class:`_HiddenStates`), and each ``rowwise`` output is
reduce-scattered back to sequence shards instead of all-reduced. The base model's own code
(mask, positions, rotary embedding) reads the DTensor's global shape, so it is unchanged.
Without it, each ``rowwise`` output is all-reduced and the rest is whole on every tp rank.

The embedding splits by vocabulary and the head by vocabulary too (its logits gathered, or
kept sharded for ``loss_parallel``), unless they are tied: then both stay whole on each tp
rank (under sequence parallelism the embedding's output is cut to this rank's tokens, and the
head's input gathered). A pipeline stage without the embedding cuts its input to this rank's
tokens; one without the head returns its hidden states whole (models/hf_source.py).

A MoE layer (the module around transformers' ``"moe_tp_experts"``) runs whole on every tp
rank, as the zoo's MoE does: under sequence parallelism its input is gathered and its output
cut back to this rank's tokens, and its router and experts are replicated over tp (the same
values and gradients on each tp rank), not split as transformers' plan splits them; expert
parallelism splits the experts instead (models/hf_expert_parallel.py).

Not covered, refused before training (:func:`check_tp`): any other style of transformers'
(its own sequence parallelism, ...).
"""
from __future__ import annotations

import re

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle,
                                               PrepareModuleInput, PrepareModuleInputOutput,
                                               PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel)

from .hf_plans import plan_matches

SEQ = Shard(1)  # hidden states [batch, seq, hidden] under sequence parallelism


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
# transformers' split of a MoE's experts module; here the MoE layer runs whole on every tp rank
# (its experts split by expert over ep instead: models/hf_expert_parallel.py)
EXPERTS = "moe_tp_experts"


def _of_experts(pattern: str, style: str) -> bool:
    """Whether a plan entry splits a MoE's experts (the module, or a weight inside it)."""
    return style in (EXPERTS, "packed_colwise") or ".experts." in f"{pattern}."


def _plan(text) -> dict[str, str]:
    """The plan of a model's text config (``config.get_text_config()``)."""
    return dict(getattr(text, "base_model_tp_plan", None) or {})


def check_tp(config, tp: int) -> None:
    """ValueError naming what keeps the model of ``config`` from splitting over ``tp``
    ranks: no plan, a style not translated here, or a size ``tp`` does not divide."""
    name, text = type(config).__name__, config.get_text_config()
    plan = _plan(text)
    if not plan:
        raise ValueError(f"tensor_parallel_degree={tp}: {name} has no tensor-parallel plan "
                         f"(base_model_tp_plan) in transformers (use 1)")
    other = {k: v for k, v in plan.items() if not _of_experts(k, v) and (
        v not in STYLES or v == "replicated_with_grad_allreduce" and not k.endswith("norm"))}
    if other:
        k, v = next(iter(other.items()))
        raise ValueError(f"tensor_parallel_degree={tp}: {name}'s plan splits {k} as {v!r}, "
                         f"which is not translated here (only 'colwise', 'rowwise', and "
                         f"'replicated_with_grad_allreduce' of a norm; use 1)")
    # the vocabulary splits with an untied head only (a tied one stays whole)
    keys = ("num_attention_heads", "num_key_value_heads", "intermediate_size",
            *(() if getattr(text, "tie_word_embeddings", False) else ("vocab_size",)))
    sizes = {k: getattr(text, k, None) for k in keys}
    bad = {k: v for k, v in sizes.items() if isinstance(v, int) and v % tp}
    if bad:
        raise ValueError(f"tensor_parallel_degree={tp} does not divide "
                         + ", ".join(f"{k}={v}" for k, v in bad.items()))


class _HiddenStates(ParallelStyle):
    """A module's hidden-state input (its first positional argument, or ``hidden_states=``:
    transformers calls attention by keyword and the MLP positionally) redistributed from
    ``src`` to ``dst``, a DTensor; a plain tensor is taken as laid out as ``src``."""

    def __init__(self, src, dst):
        super().__init__()
        self.src, self.dst = src, dst

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def convert(t):
            if not isinstance(t, torch.Tensor):
                return t
            if not isinstance(t, DTensor):
                t = DTensor.from_local(t, device_mesh, (self.src,), run_check=False)
            return t.redistribute(device_mesh, (self.dst,))

        def hook(_, args, kwargs):
            if args:
                return (convert(args[0]), *args[1:]), kwargs
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": convert(kwargs["hidden_states"])}
            return None

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith(
        ("RMSNorm", "LayerNorm"))


def tp_styles(model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """``parallelize_module``'s plan for ``model`` (or a pipeline stage of it, whose other
    modules are absent): module FQN → torch ParallelStyle (module doc)."""
    prefix = model.base_model_prefix
    base = model.get_submodule(prefix)
    names = [n for n, _ in base.named_modules()]
    seq = sequence_parallel
    styles, split_parents, norms, moe = {}, set(), set(), set()
    for pattern, style in _plan(model.config.get_text_config()).items():
        if _of_experts(pattern, style):
            if style == EXPERTS:  # the layer around the experts module
                moe.update(n.rpartition(".")[0] for n in plan_matches(pattern, names))
            continue
        for n in plan_matches(pattern, names):
            if style == "rowwise" and seq:  # reduce-scattered to this rank's tokens
                styles[f"{prefix}.{n}"] = RowwiseParallel(output_layouts=SEQ,
                                                          use_local_output=False)
            else:
                styles[f"{prefix}.{n}"] = STYLES[style]()
            if style == "colwise":
                split_parents.add(n.rpartition(".")[0])
            if style == "replicated_with_grad_allreduce":
                norms.add(n)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    if seq:
        for parent in split_parents:  # one gather of the input per attention and MLP
            styles[f"{prefix}.{parent}"] = _HiddenStates(SEQ, Replicate())
        for layer in moe:  # whole on every tp rank: all the tokens in, this rank's out
            styles[f"{prefix}.{layer}"] = PrepareModuleInputOutput(
                input_layouts=(SEQ,), desired_input_layouts=(Replicate(),),
                use_local_input=True, output_layouts=(Replicate(),),
                desired_output_layouts=(SEQ,), use_local_output=False)
        for n, m in base.named_modules():  # residual-stream norms on this rank's tokens
            if (_is_norm(m) and n not in norms and n.rpartition(".")[0] not in split_parents
                    and not any(n.startswith(f"{layer}.") for layer in moe)):
                styles[f"{prefix}.{n}"] = SequenceParallel()
        blocks = [n for n in names if re.fullmatch(r"layers\.\d+", n)]
        if embedding is None and blocks:  # a later pipeline stage: cut its whole input
            styles[f"{prefix}.{blocks[0]}"] = _HiddenStates(Replicate(), SEQ)
    if embedding is not None:
        name = next(n for n, m in model.named_modules() if m is embedding)
        if not tied:
            styles[name] = RowwiseParallel(input_layouts=Replicate(),
                                           output_layouts=SEQ if seq else Replicate(),
                                           use_local_output=not seq)
        elif seq:
            styles[name] = PrepareModuleOutput(output_layouts=Replicate(),
                                               desired_output_layouts=SEQ,
                                               use_local_output=False)
    if head is not None:
        name = next(n for n, m in model.named_modules() if m is head)
        into = SEQ if seq else Replicate()
        if not tied:
            styles[name] = (ColwiseParallel(input_layouts=into, output_layouts=Shard(-1),
                                            use_local_output=False) if loss_parallel else
                            ColwiseParallel(input_layouts=into, output_layouts=Replicate()))
        elif seq:
            styles[name] = PrepareModuleInput(input_layouts=(SEQ,),
                                              desired_input_layouts=(Replicate(),),
                                              use_local_output=True)
    return styles
