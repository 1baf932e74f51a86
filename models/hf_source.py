"""Any Hugging Face causal LM from a local directory: ``--model.name hf --model.path DIR``.

DIR holds a ``config.json`` and optionally the weights as ``*.safetensors`` (one file, or
several with ``model.safetensors.index.json``) and a ``tokenizer.json``. The path is local
only: nothing is ever downloaded (the hub is offline during transformers' loading calls, and
``local_files_only=True``), and a hub id instead of a directory is a one-line error.

Life of such a model in the trainer:
  1. :func:`build_hf_model`: ``AutoModelForCausalLM.from_config`` on the meta device (no
     memory), with the trainer's protocol added (:class:`_Trainable`: a forward that returns
     the summed cross-entropy computed by ``models/loss.py``, ``num_flops_per_token``).
  2. ``data_parallel`` shards it: uninitialised shards, dim 0 split over the dp ranks.
  3. :func:`materialize`: each rank fills its own shards. With safetensors files, it reads
     only its rows of each tensor (``safe_open(...).get_slice(name)[lo:hi]``), closing the
     file after each parameter (:class:`_OneFile`), so no rank ever holds the full model
     (MoE experts saved one by one: only its experts, see :class:`_Converted`). Without them, the model's own init (``_init_weights``) runs
     module by module through ``simplesharded/init.py``: block by block on full-size
     temporaries on the mesh's device, seeded, of which each rank keeps its slice, so the
     values do not depend on the world size. Buffers the files do not hold (RoPE
     frequencies) are computed by ``_init_weights`` too, as transformers' own loading does.

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

from simplesharded.models.loss import lm_loss

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
                   n_layers=_get(text, "num_hidden_layers", "n_layer"), dim=dim)

    def check_tp(self, tp: int) -> None:
        raise ValueError(f"tensor_parallel_degree={tp}: model.name='hf' has no tensor-parallel "
                         f"styles here (use 1)")


def read_args(path: str) -> HFSourceArgs:
    return HFSourceArgs.from_config(path, load_hf_config(path))


class _Trainable:
    """Mixed into the transformers model's class (FQNs, and so the safetensors names, stay
    as they are): the trainer's forward and FLOP count."""

    def forward(self, tokens, labels=None, loss_chunks: int = 0):
        """Summed cross-entropy of the next-token logits against ``labels`` (already shifted
        by the data loader), or the logits when ``labels`` is None. The head is applied by
        ``lm_loss``, so long sequences never hold full fp32 logits (training.loss_chunks)."""
        hidden = self.base_model(input_ids=tokens, use_cache=False)[0]
        head = self.get_output_embeddings()
        if labels is None:
            return head(hidden)
        return lm_loss(hidden, head, labels, loss_chunks)

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


def build_hf_model(path: str) -> nn.Module:
    """The model of ``path``'s config.json on the meta device, with the trainer's protocol
    (:class:`_Trainable`) and ``model.args`` (:class:`HFSourceArgs`)."""
    config = load_hf_config(path)
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
    return model


# ---------------------------------------------------------------------------- weights

def safetensors_files(path: str) -> dict[str, str]:
    """Tensor name → file holding it, from the index or the single file; {} when none."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as fh:
            weight_map = json.load(fh)["weight_map"]
        return {name: os.path.join(path, f) for name, f in weight_map.items()}
    from safetensors import safe_open

    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="pt") as h:
                out.update({name: os.path.join(path, f) for name in h.keys()})
    return out


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) → every FQN it has (tied parameters have several)."""
    out: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(fqn)
    return out


def _candidates(model: nn.Module, fqns: list[str]) -> Iterator[str]:
    """Names a parameter may have in the files: its FQNs, and each without/with the base
    model prefix (older checkpoints, e.g. GPT-2's, were saved from the base model)."""
    prefix = getattr(model, "base_model_prefix", "")
    for f in fqns:
        yield f
    if prefix:
        for f in fqns:
            yield f[len(prefix) + 1:] if f.startswith(prefix + ".") else f"{prefix}.{f}"


def _post_order(module: nn.Module, owner) -> Iterator[tuple[nn.Module, object]]:
    """(module, the PreTrainedModel whose _init_weights applies to it), children first:
    the order of transformers' own initialize_weights."""
    from transformers import PreTrainedModel

    for child in module.children():
        yield from _post_order(child, child if isinstance(child, PreTrainedModel) else owner)
    yield module, owner


def materialize(model: nn.Module, seed: int = 0) -> str:
    """Fill a data_parallel-sharded (or plain) model built by :func:`build_hf_model`: from
    the safetensors files of ``model.args.path`` if it has any, else by the model's own init,
    seeded. Returns "loaded" or "initialised"."""
    from simplesharded.sharding import disable_gather

    where = safetensors_files(model.args.path)
    with disable_gather(model), torch.no_grad():
        if where:
            # Buffers first (RoPE frequencies: non-persistent, in no file), so that a buffer
            # the files do hold is read last and wins.
            _init_modules(model, seed, buffers_only=True)
            _load(model, where)
            return "loaded"
        _init_modules(model, seed, buffers_only=False)
        return "initialised"


def _natural(key: str) -> list:
    """Sort key that orders ``experts.10`` after ``experts.9``."""
    return [int(p) if p.isdigit() else p for p in key.split(".")]


class _Converted:
    """Parameters that transformers builds at load time from differently named tensors
    (``conversion_mapping.py``): renamed ones (``block_sparse_moe.gate`` → ``mlp.gate``)
    and MoE experts merged into one tensor (``experts.N.w1``/``w3`` → ``experts.gate_up_proj``
    [experts, 2 * ffn, dim]). transformers' own key renaming decides which file tensors make
    which parameter; the merge is done here, reading only this rank's experts (dim 0)."""

    def __init__(self, model: nn.Module, where: dict[str, str]):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                     rename_source_key)

        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        known = dict.fromkeys(model.state_dict(), True)  # only looked up by name
        self.renamed: dict[str, str] = {}  # parameter FQN → file tensor
        # parameter FQN → (its converter, {source pattern: file tensors in expert order})
        self.merged: dict[str, tuple[object, dict[str, list[str]]]] = {}
        for key in where:
            target, pattern = rename_source_key(key, renamings, converters,
                                               getattr(model, "base_model_prefix", None), known)
            if pattern is None:
                self.renamed.setdefault(target, key)
                continue
            conv = next(c for c in converters if pattern in c.source_patterns)
            self.merged.setdefault(target, (conv, {}))[1].setdefault(pattern, []).append(key)
        for _, groups in self.merged.values():
            for keys in groups.values():
                keys.sort(key=_natural)

    def read(self, fqn: str, shape: tuple, box: tuple[slice, ...], tensor) -> torch.Tensor:
        """This rank's region of parameter ``fqn`` from its merged sources (``tensor(name)``
        reads one file tensor whole: one expert's matrix)."""
        from transformers.core_model_loading import Concatenate, MergeModulelist

        conv, groups = self.merged[fqn]
        ops = list(conv.operations)
        merge_ok = ops and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
        cat = ops[1] if len(ops) == 2 and isinstance(ops[1], Concatenate) else None
        if not merge_ok or len(ops) > 2 or (len(ops) == 2 and (cat is None or cat.dim == 0)) \
                or any(s != slice(0, n) for s, n in zip(box[1:], shape[1:])):
            raise ValueError(f"parameter {fqn!r} is converted at load time by "
                             f"{[type(o).__name__ for o in ops]}; only experts merged on dim 0 "
                             f"(then concatenated on another dim) are read here")
        lo, hi = box[0].start, box[0].stop
        parts = [torch.stack([tensor(k) for k in groups[p][lo:hi]])
                 for p in conv.source_patterns if p in groups]
        return parts[0] if cat is None else torch.cat(parts, dim=cat.dim)


class _OneFile:
    """``safe_open`` handles, one open at a time, closed by :meth:`release`. safetensors maps a
    file into memory and the pages read stay resident until the file is closed; released
    after every parameter, they are at most one parameter's slice, whatever the size of the
    files (transformers writes up to 50 GB per file by default)."""

    def __init__(self, safe_open):
        self._open, self._path, self._handle = safe_open, None, None
        self._stack = contextlib.ExitStack()

    def __call__(self, f: str):
        if f != self._path:
            self.release()
            self._handle = self._stack.enter_context(self._open(f, framework="pt",
                                                                device="cpu"))
            self._path = f
        return self._handle

    def release(self) -> None:
        self._stack.close()
        self._path = self._handle = None

    def __enter__(self) -> "_OneFile":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _load(model: nn.Module, where: dict[str, str]) -> None:
    """Every parameter's local region, read from its file (and nothing else of it), one
    parameter mapped at a time (:class:`_OneFile`): while loading, a rank holds its shards
    plus the slice it is reading."""
    from safetensors import safe_open

    from simplesharded.init import local_box

    aliases, path = _aliases(model), model.args.path
    persistent = dict(model.state_dict(keep_vars=True))
    converted = None
    plain: list[tuple[str, str, torch.Tensor]] = []  # (file tensor, FQN, parameter)
    merged: list[tuple[str, str, torch.Tensor]] = []  # (merged FQN, FQN, parameter)
    for fqn, p in model.named_parameters():
        names = aliases.get(id(p), [fqn])
        name = next((n for n in _candidates(model, names) if n in where), None)
        if name is None:
            # Built only when needed: files saved by transformers <5 or in another layout.
            converted = converted or _Converted(model, where)
            name = next((converted.renamed[n] for n in names if n in converted.renamed), None)
        if name is not None:
            plain.append((name, fqn, p))
            continue
        name = next((n for n in names if n in converted.merged), None)
        if name is None:
            raise ValueError(f"model.path={path!r}: parameter {fqn!r} is in none of the "
                             f"safetensors files")
        merged.append((name, fqn, p))
    # Persistent buffers (replicated, small) are read whole when the files have them.
    params = {id(p) for p in model.parameters()}
    plain += [(fqn, fqn, b) for fqn, b in persistent.items()
              if id(b) not in params and fqn in where]
    with _OneFile(safe_open) as handle:
        for name, fqn, p in plain:
            sl = handle(where[name]).get_slice(name)
            shape = tuple(sl.get_shape())
            if shape != tuple(p.shape):
                raise ValueError(f"model.path={path!r}: tensor {name!r} has shape {shape} in "
                                 f"the safetensors files but the model's {fqn!r} has "
                                 f"{tuple(p.shape)} (config.json and weights disagree)")
            local, box = local_box(p.data)
            if local.numel() == 0:
                continue  # an uneven split can leave a rank nothing of a small tensor
            # Only this rank's region is read: rows lo:hi of a dim-0 shard.
            local.copy_(sl[box] if box else handle(where[name]).get_tensor(name))
            del sl  # it holds the file's mapping too
            handle.release()
        for name, fqn, p in merged:
            local, box = local_box(p.data)
            if not local.numel():
                continue
            try:
                data = converted.read(name, tuple(p.shape), box,
                                      lambda k: handle(where[k]).get_tensor(k))
            except ValueError as e:
                raise ValueError(f"model.path={path!r}: {e}") from None
            if data.shape != local.shape:
                raise ValueError(f"model.path={path!r}: parameter {fqn!r} merged from the "
                                 f"safetensors files has shape {tuple(data.shape)} on this "
                                 f"rank, the model's shard {tuple(local.shape)} (config.json "
                                 f"and weights disagree)")
            local.copy_(data)
            del data
            handle.release()


def _init_modules(model: nn.Module, seed: int, buffers_only: bool) -> None:
    """The model's ``_init_weights`` on every module in transformers' order (each by the
    PreTrainedModel it belongs to), through :func:`simplesharded.init.init_sharded`: on
    full-size temporaries, seeded, each rank keeping its region. ``buffers_only``: only the
    modules holding buffers (RoPE frequencies: non-persistent, hence in no file)."""
    from simplesharded.init import init_sharded

    order = [(m, owner) for m, owner in _post_order(model, model)
             if not buffers_only or next(m.buffers(recurse=False), None) is not None]
    owner_of = {id(m): owner for m, owner in order}
    init_sharded(model, lambda m: owner_of[id(m)]._init_weights(m), seed,
                 modules=[m for m, _ in order])


def hf_tokenizer_path(path: str) -> str:
    """DIR/tokenizer.json when the model directory has one, else ''."""
    f = os.path.join(path, TOKENIZER_FILE)
    return f if os.path.isfile(f) else ""


__all__ = ["HFSourceArgs", "build_hf_model", "check_path", "check_weights", "hf_tokenizer_path",
           "load_hf_config", "materialize", "read_args", "safetensors_files"]
