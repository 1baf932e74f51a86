"""Any Hugging Face causal LM from a local directory: ``--model.name hf --model.path DIR``.

DIR holds a ``config.json`` and optionally the weights as ``*.safetensors`` (one file, or
several with ``model.safetensors.index.json``) and a ``tokenizer.json``. The path is local
only: nothing is ever downloaded (the hub is offline during transformers' loading calls, and
``local_files_only=True``), and a hub id instead of a directory is a one-line error.

This file's job: the directory and its config: the checks (a path that is no model directory,
weights in a format not read, a config whose logits the loss would not reproduce), the args
the trainer reads (:class:`HFSourceArgs`) and the model built from the config.

Life of such a model in the trainer:
  1. :func:`build_hf_model`: ``AutoModelForCausalLM.from_config`` on the meta device (no
     memory), with the trainer's protocol added (:class:`_Trainable`: a forward that returns
     the summed cross-entropy computed by ``models/loss.py``, ``num_flops_per_token``).
  2. ``data_parallel`` shards it: uninitialised shards, dim 0 split over the dp ranks.
  3. ``models/hf_loading.py``'s ``materialize``: each rank fills its own shards, from the
     safetensors files (only its rows of each tensor) or, without them, by the model's own
     init.

Blocks (buckets, ``reshard="auto"``, activation checkpointing) are found by
``simplesharded/blocks.py``: the numbered ``ModuleList`` (``model.layers.N``,
``transformer.h.N``) of any such model.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from typing import Iterator
from unittest import mock

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from simplesharded.models import hf_balance
from simplesharded.models.loss import lm_loss, with_term

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
# weights in formats this loader does not read (older PyTorch pickles, Meta's originals,
# TensorFlow, Flax): alone in a directory they would leave the model at its random init
OTHER_WEIGHTS = re.compile(r"pytorch_model.*\.bin|consolidated\..*\.pth|tf_model\.h5|"
                           r"flax_model\.msgpack")
# config keys of logit post-processing after the head (Gemma 2/3, Cohere, Granite)
POST_HEAD_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """transformers and safetensors imported, and the hub offline for the calls inside: no
    download can start, whatever the caller's environment says. huggingface_hub reads
    HF_HUB_OFFLINE once, when it is imported, into the flag every request checks, so the flag
    is what is set, for these calls only (the process's environment is left alone)."""
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
        from huggingface_hub import constants
    except ImportError:
        raise ValueError("model.name='hf' needs transformers and safetensors: "
                         "pip install 'simplesharded[hf]'") from None
    with mock.patch.object(constants, "HF_HUB_OFFLINE", True):
        yield


def check_path(path: str) -> str:
    """``path`` if it is a directory with a config.json, else a one-line ValueError."""
    if not path:
        raise ValueError("model.path='' must be a local directory holding config.json "
                         "(model.name='hf')")
    if not os.path.isdir(path):
        hint = ""
        if not os.path.exists(path) and path.count("/") == 1 and not path.startswith("."):
            hint = (f" (a hub id? nothing is downloaded here: fetch it first, e.g. "
                    f"`hf download {path} --local-dir DIR`, and pass DIR)")
        raise ValueError(f"model.path={path!r} is not a local directory{hint}")
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        raise ValueError(f"model.path={path!r} has no {CONFIG_FILE}")
    return path


def check_weights(path: str) -> None:
    """A one-line ValueError for weight files that would not load: a safetensors index
    naming a file that is not there, or weights only in another format (read as none, they
    would silently leave the model at its random init)."""
    names = os.listdir(path)
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise ValueError(f"model.path={path!r}: {INDEX_FILE} names {len(missing)} "
                             f"file(s) that are not there, e.g. {missing[0]!r}")
    elif not any(f.endswith(".safetensors") for f in names):
        other = sorted(f for f in names if OTHER_WEIGHTS.fullmatch(f))
        if other:
            raise ValueError(f"model.path={path!r} holds weights as {other[0]!r} but none as "
                             f"*.safetensors, the only format read here (without them the "
                             f"model would start from its random init): convert them, e.g. "
                             f"AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR)")


def load_hf_config(path: str):
    """The transformers config of the model in ``path`` (local files only)."""
    with _offline():
        from transformers import AutoConfig

        check_path(path)
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
        except Exception as e:  # transformers raises several types for a bad/unknown config
            msg = str(e).strip().splitlines()
            raise ValueError(f"model.path={path!r}: config.json cannot be read "
                             f"({type(e).__name__}: {msg[0] if msg else ''})") from None
    config.use_cache = False  # training only: no KV cache object built (and traced)
    # What a model's own forward does to the logits after its head, which our loss (head +
    # cross-entropy) would silently skip: refused rather than trained differently.
    text = config.get_text_config()
    for key in POST_HEAD_KEYS:
        value = getattr(text, key, None)
        if value not in (None, 1, 1.0):
            raise ValueError(f"model.path={path!r}: config.json sets {key}={value!r}, a "
                             f"transformation of the logits after the head that this trainer's "
                             f"loss does not apply (set it to null there to train without it)")
    return config


def _get(config, *names, default=None):
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return default


@dataclass
class HFSourceArgs:
    """What the trainer reads of a model's args, taken from its config.json."""

    path: str
    vocab_size: int
    max_seq_len: int
    n_layers: int
    dim: int  # attention width: heads * head_dim (hidden_size unless the config says)
    n_heads: int
    n_kv_heads: int
    hidden_size: int  # the width of the hidden states between blocks

    @classmethod
    def from_config(cls, path: str, config) -> "HFSourceArgs":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        hidden = _get(text, "hidden_size", "n_embd", "d_model")
        heads = _get(text, "num_attention_heads", "n_head")
        head_dim = _get(text, "head_dim")
        dim = heads * head_dim if heads and head_dim else hidden
        return cls(path=path, vocab_size=text.vocab_size,
                   max_seq_len=_get(text, "max_position_embeddings", "n_positions",
                                    default=2**31 - 1),
                   n_layers=_get(text, "num_hidden_layers", "n_layer"), dim=dim,
                   n_heads=heads, n_kv_heads=_get(text, "num_key_value_heads", default=heads),
                   hidden_size=hidden)

    def check_tp(self, tp: int) -> None:
        """ValueError when the model cannot split over ``tp`` ranks
        (models/hf_tensor_parallel.py)."""
        from .hf_tensor_parallel import check_tp

        check_tp(load_hf_config(self.path), tp)

    def check_ep(self, ep: int) -> None:
        """ValueError when the model's experts cannot split over ``ep`` ranks
        (models/hf_expert_parallel.py), read from the model built on the meta device."""
        from .hf_expert_parallel import check_ep

        check_ep(build_hf_model(self.path), ep)


def read_args(path: str, n_layers: int = 0) -> HFSourceArgs:
    """The args of ``path``'s model, ``n_layers`` blocks deep if set (:func:`build_hf_model`)."""
    return HFSourceArgs.from_config(path, _at_depth(load_hf_config(path), n_layers))


def _at_depth(config, n_layers: int):
    """``config`` with ``n_layers`` blocks (0: as it is): the planner traces a model 4 and 6
    blocks deep and extrapolates (simplesharded/tools/forecast.py); the trainer trains the
    config's depth."""
    if n_layers:
        text = config.get_text_config()
        text.num_hidden_layers = n_layers  # (GPT-2's n_layer through its attribute map)
        types = getattr(text, "layer_types", None)  # one entry per block (sliding, full)
        if isinstance(types, list):
            text.layer_types = [types[i % len(types)] for i in range(n_layers)]
    return config


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one tensor, whole (a tensor-parallel stage's hidden states: sent as such)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class _Trainable:
    """Mixed into the transformers model's class (FQNs, and so the safetensors names, stay
    as they are): the trainer's forward and FLOP count."""

    def forward(self, tokens, labels=None, loss_chunks: int = 0):
        """Summed cross-entropy of the next-token logits against ``labels`` (already shifted
        by the data loader), or the logits when ``labels`` is None. The head is applied by
        ``lm_loss``, so long sequences never hold full fp32 logits (training.loss_chunks).
        A MoE whose config asks for its router's load-balancing loss
        (``output_router_logits``) adds it as transformers' own causal LM does
        (models/hf_balance.py), from the router logits recorded during this forward.

        A pipeline stage (simplesharded/pipeline/stage_split.py) is called with what the
        previous stage sent: the tokens on the first stage, else the hidden states and, where
        the balancing loss is on, its sums so far (:meth:`stage_carry`) as the second
        argument (labels never reach a stage: the pipeline's loss function reads them)."""
        first = self.get_input_embeddings() is not None
        head = self.get_output_embeddings()
        recording = hf_balance.balancing(self)
        if recording and not (first and head is not None):
            return self._stage_forward(tokens, None if first else labels, first, head)
        balance = labels is not None and recording
        if balance:
            hf_balance.start(self)
        hidden = self._blocks(tokens, first, recording)
        if head is None:  # a pipeline stage before the last: its hidden states, whole
            return _whole(hidden)
        if labels is None:
            return head(hidden)
        loss = lm_loss(hidden, head, labels, loss_chunks)
        if not balance:
            return loss
        # loss parallelism: every tp rank routed all the tokens
        return with_term(loss, hf_balance.whole_model_loss(self, hf_balance.take(self), labels))

    def _blocks(self, x, first: bool, recording: bool):
        """The base model's hidden states from the tokens (``first``: the stage holds the
        embedding) or the previous stage's hidden states; transformers' own collection of the
        router logits off where ours record them (its hooks would break the graph)."""
        return self.base_model(**{"input_ids" if first else "inputs_embeds": x},
                               use_cache=False,
                               **({"output_router_logits": False} if recording else {}))[0]

    def _stage_forward(self, x, received, first: bool, head):
        """A pipeline stage's forward where the balancing loss is on: its output (hidden
        states, or the logits on the last stage) and the balancing sums with its blocks'
        added (models/hf_balance.py)."""
        hf_balance.start(self)
        hidden = self._blocks(x, first, True)
        sums = hf_balance.stage_sums(self, hf_balance.take(self), received, hidden.device)
        return (_whole(hidden) if head is None else head(hidden)), sums

    def stage_carry(self) -> torch.Tensor | None:
        """What a pipeline stage passes on beside the hidden states (meta): the balancing
        loss's sums where it is on (models/hf_balance.py), else None."""
        return hf_balance.sums_like(self) if hf_balance.balancing(self) else None

    def carried_loss(self, carried: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss term from :meth:`stage_carry`'s tensor, summed over tokens
        as the cross-entropy is."""
        return hf_balance.loss_from_sums(self, carried, labels)

    def stage_stand_in(self, fqn: str) -> nn.Module | None:
        """What a pipeline stage keeps where the modules after the last block were cut
        (simplesharded/pipeline/stage_split.py): the base model's forward applies its final
        norm unconditionally, so a stage before the last gets an identity there (no
        parameters: the stage's names stay the model's)."""
        prefix = self.base_model_prefix
        return nn.Identity() if fqn == f"{prefix}.norm" else None

    def tp_styles(self, sequence_parallel: bool = False, loss_parallel: bool = False) -> dict:
        """Tensor parallelism as ``parallelize_module(model, mesh["tp"], styles)`` takes it:
        transformers' own plan (models/hf_tensor_parallel.py)."""
        from .hf_tensor_parallel import tp_styles

        return tp_styles(self, sequence_parallel, loss_parallel)

    def ep_styles(self) -> dict:
        """Expert parallelism as ``parallelize_module(model, mesh["ep"], styles)`` takes it:
        transformers' own plan (models/hf_expert_parallel.py)."""
        from .hf_expert_parallel import ep_styles

        return ep_styles(self)

    def num_flops_per_token(self, seq_len: int) -> int:
        """6 FLOPs per non-embedding weight (forward + backward matmuls) plus attention
        scores, 12 * layers * (heads * head_dim) * seq_len (QK^T and AV, forward + backward,
        no causal discount): the count our llama3 uses. Non-embedding: every parameter but
        the input embeddings (token, position); a token embedding tied to the output head is
        counted once, as the head (its matmul is compute). MoE expert weights (FQNs with
        ``.experts.``) count num_experts_per_tok / num_experts of their size: only the
        routed experts run for a token."""
        head = self.get_output_embeddings()
        head_ids = {id(p) for p in head.parameters()} if head is not None else set()
        skip = {id(p) for m in self.modules() if isinstance(m, nn.Embedding)
                for p in m.parameters() if id(p) not in head_ids}
        text = self.config.get_text_config()
        k = _get(text, "num_experts_per_tok", "moe_topk")
        e = _get(text, "num_local_experts", "num_experts", "n_routed_experts")
        expert_share = k / e if k and e else 1.0
        n = 0.0
        for fqn, p in self.named_parameters():
            if id(p) in skip:
                continue
            n += p.numel() * (expert_share if ".experts." in f".{fqn}." else 1.0)
        a = self.args
        return int(6 * n + 12 * a.n_layers * a.dim * seq_len)


def build_hf_model(path: str, n_layers: int = 0) -> nn.Module:
    """The model of ``path``'s config.json on the meta device, with the trainer's protocol
    (:class:`_Trainable`) and ``model.args`` (:class:`HFSourceArgs`); ``n_layers`` blocks
    deep if set (:func:`_at_depth`)."""
    config = _at_depth(load_hf_config(path), n_layers)
    from transformers import AutoModelForCausalLM

    try:
        with _offline(), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        msg = str(e).strip().splitlines()
        raise ValueError(f"model.path={path!r}: {type(config).__name__} has no causal-LM "
                         f"class in transformers ({msg[0] if msg else ''})") from None
    if model.get_output_embeddings() is None or not isinstance(model.get_output_embeddings(),
                                                               nn.Linear):
        raise ValueError(f"model.path={path!r}: {type(model).__name__} has no nn.Linear "
                         f"output head")
    cls = type(model)
    model.__class__ = type(cls.__name__, (_Trainable, cls), {})
    model.args = HFSourceArgs.from_config(path, config)
    if getattr(config.get_text_config(), "output_router_logits", False):
        hf_balance.record_router_logits(model, path)
    return model




# Families whose base model's forward runs a stage's blocks unchanged: input_ids or
# inputs_embeds in, the same mask and rotary embedding for every block, the final norm, and no
# other module outside the blocks (GPT-2's position embedding, Gemma's embedding scale in the
# forward, per-block attention types indexed by position in the stage would not).
PIPELINE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")


def check_pipeline(path: str) -> None:
    """ValueError when the model of ``path`` cannot be cut into pipeline stages here, from its
    config alone: a family not in :data:`PIPELINE_FAMILIES`, attention types that differ
    between blocks, or a head tied to the embedding (two stages would share it). A MoE's
    balancing loss is carried along the stages (models/hf_balance.py)."""
    config = load_hf_config(path)
    text = config.get_text_config()
    kind = getattr(text, "model_type", type(config).__name__)
    if kind not in PIPELINE_FAMILIES:
        raise ValueError(f"{type(config).__name__} (model_type {kind!r}) is not cut into "
                         f"pipeline stages here (families: {list(PIPELINE_FAMILIES)}); use 1")
    types = set(getattr(text, "layer_types", None) or ())
    if len(types) > 1:
        raise ValueError(f"{type(config).__name__}: its blocks' attention differs "
                         f"(layer_types {sorted(types)}), which a stage would index wrongly; "
                         f"use 1")
    if getattr(text, "tie_word_embeddings", False):
        raise ValueError(f"{type(config).__name__}: tie_word_embeddings=true ties the head "
                         f"to the embedding, which the first and last stages cannot share; "
                         f"use 1")


def check_context_parallel(path: str) -> None:
    """ValueError when the model of ``path`` cannot run its attention under context
    parallelism (models/hf_context_parallel.py), from its config and class alone."""
    from .hf_context_parallel import check_hf_config

    config = load_hf_config(path)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:  # build_hf_model reports it, in its own words
        return
    check_hf_config(config, cls)


def hf_tokenizer_path(path: str) -> str:
    """DIR/tokenizer.json when the model directory has one, else ''."""
    f = os.path.join(path, TOKENIZER_FILE)
    return f if os.path.isfile(f) else ""


__all__ = ["HFSourceArgs", "build_hf_model", "check_path", "check_weights", "hf_tokenizer_path",
           "load_hf_config", "read_args"]
