"""Hugging Face's ``LlamaForCausalLM`` in the zoo: a model we did not write, to bench against.

``build_model("hf_llama", "small")`` returns the transformers module itself, unwrapped (its
FQNs are ``model.layers.0.self_attn.q_proj.weight``, its forward returns a
``CausalLMOutputWithPast``; :func:`simplesharded.models.logits_of` reads the logits of either
kind of model). The flavors have our llama3 flavors' shapes (same dims, heads, FFN width, vocab,
RoPE theta, untied head), so a step costs the same FLOPs as llama3's; only the code differs.
Initialisation is Hugging Face's own (``init_weights``: normal(0.02) for every matrix).

transformers is optional (``pip install 'simplesharded[hf]'``); it is imported when a model is
built, so the zoo and its flavor table work without it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.nn as nn

from .llama3 import FLAVORS as LLAMA3_FLAVORS
from .llama3 import Llama3Args, ffn_hidden_dim


@dataclass
class HFLlamaArgs(Llama3Args):
    """Llama3Args' fields and checks, so overrides (``n_layers=2``) mean the same for both."""

    def check_tp(self, tp: int) -> None:
        # This zoo entry (the bench's peer of llama3) has no tp_styles; a Hugging Face
        # model read with --model.name hf has transformers' plan translated
        # (models/hf_tensor_parallel.py).
        raise ValueError(f"tensor_parallel_degree={tp}: hf_llama has no tensor-parallel styles "
                         f"here (use --tp 1, or model llama3 for TP)")


FLAVORS: dict[str, HFLlamaArgs] = {
    name: HFLlamaArgs(**dataclasses.asdict(LLAMA3_FLAVORS[name])) for name in ("debug", "small")
}


def llama_config(args: Llama3Args):
    """transformers' ``LlamaConfig`` with ``args``' shapes: the model hf_llama builds, and the
    config a llama3 checkpoint is exported with (simplesharded/trainer/export.py)."""
    try:
        from transformers import LlamaConfig
    except ImportError:
        raise ImportError("transformers is needed here: "
                          "pip install 'simplesharded[hf]'") from None
    return LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim,
        intermediate_size=ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier),
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads, rms_norm_eps=args.norm_eps,
        max_position_embeddings=args.max_seq_len, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        # sdpa: the attention kernel our llama3 calls, so both run the same attention math
        attn_implementation="sdpa",
        # training only: no KV cache object built (and traced) in every forward
        use_cache=False)


def build_hf_llama(args: HFLlamaArgs) -> nn.Module:
    """A randomly initialised ``transformers.LlamaForCausalLM`` with ``args``' shapes, on the
    current default device (``build_model`` calls this under ``torch.device(device)``)."""
    try:  # named for this model: llama_config's message serves export too
        from transformers import LlamaForCausalLM
    except ImportError:
        raise ImportError("model hf_llama needs transformers: "
                          "pip install 'simplesharded[hf]'") from None
    return LlamaForCausalLM(llama_config(args))
