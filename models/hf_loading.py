"""Filling the shards of a Hugging Face model built by ``models/hf_source.py``:
``materialize(model, seed)``, step 3 of its life in the trainer (after ``data_parallel``).

Each rank fills its own shards. With safetensors files in ``model.args.path``, it reads only
its rows of each tensor (``safe_open(...).get_slice(name)[lo:hi]``), closing the file after
each parameter (:class:`_OneFile`), so no rank ever holds the full model (MoE experts saved
one by one: only its experts, see :class:`_Converted`, which follows transformers' own weight
conversions). Without them, the model's own init (``_init_weights``) runs module by module
through ``simplesharded/storage/init.py``: block by block on full-size temporaries on the mesh's
device, seeded, of which each rank keeps its slice, so the values do not depend on the world
size. Buffers the files do not hold (RoPE frequencies) are computed by ``_init_weights`` too,
as transformers' own loading does.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Iterator

import torch
from torch import nn

from simplesharded.models.hf_source import INDEX_FILE


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
    """Fill a data_parallel-sharded (or plain) model built by ``hf_source.build_hf_model``: from
    the safetensors files of ``model.args.path`` if it has any, else by the model's own init,
    seeded. Returns "loaded" or "initialised"."""
    from simplesharded.storage.ragged_shards import members_as_shards
    from simplesharded.sharding import disable_gather

    where = safetensors_files(model.args.path)
    with disable_gather(model), torch.no_grad():
        if where:
            # Buffers first (RoPE frequencies: non-persistent, in no file), so that a buffer
            # the files do hold is read last and wins.
            _init_modules(model, seed, buffers_only=True)
            # Ragged buckets' members load by their own names, as per-parameter shards.
            with members_as_shards(model):
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

    from simplesharded.storage.init import local_box

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
    PreTrainedModel it belongs to), through :func:`simplesharded.storage.init.init_sharded`: on
    full-size temporaries, seeded, each rank keeping its region. ``buffers_only``: only the
    modules holding buffers (RoPE frequencies: non-persistent, hence in no file)."""
    from simplesharded.storage.init import init_sharded

    order = [(m, owner) for m, owner in _post_order(model, model)
             if not buffers_only or next(m.buffers(recurse=False), None) is not None]
    owner_of = {id(m): owner for m, owner in order}
    init_sharded(model, lambda m: owner_of[id(m)]._init_weights(m), seed,
                 modules=[m for m, _ in order])


__all__ = ["materialize", "safetensors_files"]
