"""Model zoo registry: name -> (model class or factory, flavors).

    model = build_model("llama3", "debug", device="cpu", max_seq_len=256)
    logits = logits_of(model(tokens))   # our models return logits, transformers' an output object
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn

from . import gpt, hf_llama, llama3, moe
from .gpt import GPT, GPTArgs
from .llama3 import Llama3, Llama3Args
from .moe import MoEArgs, MoETransformer

# A builder is called as builder(args) -> nn.Module: a model class, or a factory returning a
# module from elsewhere (hf_llama: transformers' own LlamaForCausalLM, left unwrapped).
MODELS: dict[str, tuple[Callable[[Any], nn.Module], dict]] = {
    "llama3": (Llama3, llama3.FLAVORS),
    "deepseek_v3": (MoETransformer, moe.FLAVORS),
    "gpt": (GPT, gpt.FLAVORS),
    "hf_llama": (hf_llama.build_hf_llama, hf_llama.FLAVORS),
}


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a zoo model's forward output: our models return the tensor itself,
    transformers' models a ModelOutput with ``.logits``."""
    return output if isinstance(output, torch.Tensor) else output.logits


def get_model_spec(name: str, flavor: str, **overrides) -> tuple[Callable[[Any], nn.Module], object]:
    """The builder and args of ``name``'s ``flavor``; ``overrides`` replace fields of the args
    (e.g. n_layers=2)."""
    if name not in MODELS:
        raise ValueError(f"model.name={name!r} is not one of {sorted(MODELS)}")
    cls, flavors = MODELS[name]
    if flavor not in flavors:
        raise ValueError(f"model.flavor={flavor!r} is not one of {sorted(flavors)} (model.name={name!r})")
    args = flavors[flavor]
    fields = sorted(f.name for f in dataclasses.fields(args))
    for key in overrides:
        if key not in fields:
            raise ValueError(f"model override {key!r} is not a field of {type(args).__name__}: {fields}")
    return cls, dataclasses.replace(args, **overrides)


def build_model(name: str, flavor: str, device: torch.device | str = "meta", **overrides) -> nn.Module:
    """Build a model; overrides replace fields of its args (e.g. vocab_size=259).

    On a real device the model is also init_weights()-ed; on meta it is left for the caller
    to shard (data_parallel) and then initialise (simplesharded.storage.init.init_sharded).
    """
    cls, args = get_model_spec(name, flavor, **overrides)
    with torch.device(device):
        model = cls(args)
    if torch.device(device).type != "meta":
        model.init_weights()
    return model


__all__ = ["MODELS", "get_model_spec", "build_model", "logits_of", "Llama3", "Llama3Args",
           "MoETransformer", "MoEArgs", "GPT", "GPTArgs"]
