"""Context parallelism for Hugging Face models through transformers' attention interface.

A transformers model that declares ``_supports_attention_backend`` (Llama, Qwen2, Mistral, ...)
looks its attention function up by ``config._attn_implementation`` in ``AttentionInterface``
and rotates q and k by the ``position_ids`` its base model is called with. So CP needs no change
to the model's code: :func:`apply_hf_context_parallel` (called by models/context_parallel.py's
``apply_context_parallel``, whose ``ContextParallel`` it is handed) registers one attention
function,
``ss_context_parallel`` (:meth:`ContextParallel.attention`: K/V all-gathered over the cp group,
the per-rank causal mask of models/context_parallel.py), sets the model to it, gives each
attention module this rank's :class:`ContextParallel`, and makes the base model's default
``position_ids`` the global positions of this rank's head-tail chunks. No mask function is
registered under that name, so transformers builds no mask (and no packed-sequence check on
the non-contiguous positions): the attention function builds its own.

Not covered: sliding-window or chunked attention, attention sinks and soft-capping (the
function is plain causal attention: such a config is refused before training, and the
function refuses an attention layer that passes it a window or sinks), padding masks
(training reads full sequences), and caches (training only).
"""
from __future__ import annotations

import torch
from torch import nn


ATTENTION = "ss_context_parallel"
# Config keys that mean anything but plain causal attention over the whole sequence.
_UNSUPPORTED = ("sliding_window", "attention_chunk_size", "attn_logit_softcapping")


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model that runs its attention through the
    attention interface."""
    return (getattr(type(model), "_supports_attention_backend", False)
            and hasattr(model, "config") and hasattr(model, "base_model_prefix"))


def check_hf(model: nn.Module) -> None:
    """ValueError when ``model``'s attention is other than plain causal attention through the
    attention interface, which is all :func:`attention` computes."""
    check_hf_config(model.config, type(model))


def check_hf_config(config, cls: type) -> None:
    """ValueError naming what in transformers config ``config`` of model class ``cls`` rules
    context parallelism out: a class that does not call the attention interface, or a config
    key for attention other than causal over the whole sequence."""
    name = cls.__name__
    if not getattr(cls, "_supports_attention_backend", False):
        raise ValueError(f"{name} does not run its attention through transformers' attention "
                         f"interface, which context parallelism replaces")
    text = config.get_text_config()
    sliding = getattr(text, "use_sliding_window", True)  # Qwen2's switch for sliding_window
    layer_types = set(getattr(text, "layer_types", None) or ()) - {"full_attention"}
    if layer_types:
        raise ValueError(f"{name}: config layer_types has {sorted(layer_types)}, not plain "
                         f"causal attention; context parallelism needs full_attention layers")
    for key in _UNSUPPORTED:
        value = getattr(text, key, None)
        if value and (key != "sliding_window" or sliding):
            raise ValueError(f"{name}: config {key}={value!r} is not plain causal attention; "
                             f"context parallelism supports none of {list(_UNSUPPORTED)}")


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask=None, scaling: float | None = None, dropout: float = 0.0,
              **kwargs):
    """The attention interface's signature: q [B, H, s, D], k and v [B, Hkv, s, D] of this
    rank's s tokens (rotated) → ([B, s, H, D], None). ``attention_mask`` is None (no mask
    function is registered for this implementation); the causal mask over the gathered keys is
    built from positions."""
    cp = getattr(module, "context_parallel", None)
    if cp is None:
        raise ValueError(f"{type(module).__name__} runs attention {ATTENTION!r} without a cp "
                         f"group: apply_context_parallel sets it")
    extra = sorted(k for k in ("sliding_window", "s_aux", "sinks") if kwargs.get(k) is not None)
    if extra:
        raise ValueError(f"{type(module).__name__} asks attention {ATTENTION!r} for {extra}: "
                         f"context parallelism computes plain causal attention only")
    if dropout:
        raise ValueError(f"attention dropout {dropout} under context parallelism is not "
                         f"supported")
    y = cp.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                     scale=scaling)
    return y.transpose(1, 2).contiguous(), None


def apply_hf_context_parallel(model: nn.Module, cp) -> None:
    """Run ``model``'s attention under context parallelism ``cp`` (see the module doc)."""
    from transformers import AttentionInterface

    check_hf(model)
    AttentionInterface.register(ATTENTION, attention)
    model.config._attn_implementation = ATTENTION
    for module in model.modules():
        # the modules the attention interface is called with: the model's attention layers
        if type(module).__name__.endswith("Attention"):
            module.context_parallel = cp
    model.context_parallel = cp  # the balancing loss reads every cp rank's router rows
    base = getattr(model, model.base_model_prefix, model)

    def global_positions(_, args, kwargs):
        if kwargs.get("position_ids") is not None:
            return None
        tokens = args[0] if args else kwargs.get("input_ids")
        if tokens is None:
            tokens = kwargs["inputs_embeds"]
        positions = cp.positions(tokens.shape[1], tokens.device)
        return args, {**kwargs, "position_ids": positions.unsqueeze(0)}

    base.register_forward_pre_hook(global_positions, with_kwargs=True)
