"""Distributed checkpoints (torch.distributed.checkpoint) with atomic commit and retention.

Layout: ``<folder>/step-<N>/`` holds one DCP checkpoint of model + optimizer + train state
(step, data-loader position, RNG). A save is written to ``step-<N>.tmp`` and renamed by rank 0
after every rank finished, so an interrupted save never replaces a good checkpoint. Loading
reshards: DTensor shards are read into whatever mesh/world size the new run uses; parameters and
optimizer state are keyed per parameter whatever the bucket storage (ragged buckets convert at
this boundary), so a checkpoint also loads into another storage. Each step
also holds ``model.json`` (:func:`model_meta`), which ``python -m simplesharded.trainer.export``
(export.py) reads to write a Hugging Face model directory.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

from simplesharded.storage.ragged_shards import optim_state_by_bucket, optim_state_by_member

MODEL_JSON = "model.json"  # what export reads of the model, beside its tensors
_STEP_DIR = re.compile(r"^step-(\d+)$")


def complete_steps(folder: str) -> list[int]:
    """Steps with a committed checkpoint (renamed dir containing DCP metadata), ascending."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(folder, name, ".metadata")):
            steps.append(int(m.group(1)))
    return sorted(steps)


def step_dir(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}")


# Optimizer state keyed per parameter FQN (its param_groups' settings too): under pipeline
# parallelism each rank holds other parameters, and a param_groups list saved by one rank
# would name only that rank's parameters to every rank that loads it.
_OPTIONS = StateDictOptions(ignore_frozen_params=False, flatten_optimizer_state_dict=True)


def _app_state(model, optimizer, extra: dict):
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    # keyed per parameter as without ragged buckets, so it reloads at any world size/layout
    return {"model": model_sd, "optimizer": optim_state_by_member(model, optim_sd),
            "train": extra}


def model_meta(model, name: str, flavor: str) -> dict:
    """What export needs to know of the model besides its tensors: a transformers model's
    config, or our zoo's name, flavor and args."""
    config = getattr(model, "config", None)
    if hasattr(config, "to_dict"):
        return {"name": name, "hf_config": config.to_dict()}
    args = getattr(model, "args", None)
    return {"name": name, "flavor": flavor,
            "args": dataclasses.asdict(args) if dataclasses.is_dataclass(args) else None}


def save(folder: str, step: int, model, optimizer, loader_state: dict, keep_latest_k: int,
         meta: dict | None = None) -> str:
    """Save step ``step`` atomically; then delete all but the newest ``keep_latest_k``.
    ``meta`` (model_meta) is written as the step's model.json."""
    tmp = _begin(folder, step)
    dcp.save(_app_state(model, optimizer, _train_state(step, loader_state)), checkpoint_id=tmp)
    return _commit(folder, step, keep_latest_k, meta)


class AsyncSaver:
    """``checkpoint.async_mode async``: a save copies the state to the host (DCP's staging)
    and returns; DCP writes the copy from a thread while training goes on, and
    the checkpoint is committed (renamed from ``.tmp``, then retention) once every rank has
    written it: at the next save, or at :meth:`wait` after the last step. A run that stops
    before then leaves the ``.tmp`` directory, never a half-written ``step-N``.

    Rank agreement: DCP's thread coordinates the ranks (its plan, its metadata) over a gloo
    group of its own, made here by every rank at once; the training step's collectives run
    meanwhile on the default group, and one group's collectives issued from two threads would
    interleave in a different order on different ranks. The commit's barriers run on the
    main thread, at the same step on every rank."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo")
        self.pending: tuple | None = None  # (future, folder, step, keep_latest_k, meta)

    def save(self, folder: str, step: int, model, optimizer, loader_state: dict,
             keep_latest_k: int, meta: dict | None = None) -> None:
        self.wait()
        tmp = _begin(folder, step)
        # DCP's default stager copies every tensor into new host storage before async_save
        # returns (docs/torch_internals.md): the thread writes the copies while the optimizer
        # updates the originals.
        state = _app_state(model, optimizer, _train_state(step, loader_state))
        future = dcp.async_save(state, checkpoint_id=tmp, process_group=self.group)
        self.pending = (future, folder, step, keep_latest_k, meta)

    def wait(self) -> str | None:
        """Commit the save in flight, once written; its directory (None: none in flight)."""
        if self.pending is None:
            return None
        future, folder, step, keep_latest_k, meta = self.pending
        self.pending = None
        # torch's newer async_save answers a response holding the upload's future
        getattr(future, "upload_completion", future).result()
        return _commit(folder, step, keep_latest_k, meta)


def _train_state(step: int, loader_state: dict) -> dict:
    return {"step": step, "loader": dict(loader_state), "rng": torch.get_rng_state()}


def _begin(folder: str, step: int) -> str:
    """A fresh ``step-<N>.tmp`` for every rank to write into."""
    tmp = step_dir(folder, step) + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp, exist_ok=True)
    dist.barrier()
    return tmp


def _commit(folder: str, step: int, keep_latest_k: int, meta: dict | None) -> str:
    """Once every rank has written ``step-<N>.tmp``: rename it to ``step-<N>`` (rank 0),
    with ``meta`` as its model.json, and keep the newest ``keep_latest_k``."""
    final, tmp = step_dir(folder, step), step_dir(folder, step) + ".tmp"
    dist.barrier()  # every rank's shards are on disk before the commit
    if dist.get_rank() == 0:
        if meta is not None:
            with open(os.path.join(tmp, MODEL_JSON), "w") as f:
                json.dump(meta, f, indent=2)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if keep_latest_k > 0:
            for old in complete_steps(folder)[:-keep_latest_k]:
                shutil.rmtree(step_dir(folder, old), ignore_errors=True)
    dist.barrier()
    return final


def load(folder: str, step: int, model, optimizer, loader_state_template: dict) -> dict:
    """Load step ``step`` into model/optimizer in place; -1 = the newest checkpoint that loads
    (a corrupt newest one is reported and the next older one is tried).

    Returns the train state ({"step", "loader", "rng"}). A checkpoint that cannot be read, or
    whose shapes do not match the model, raises ValueError naming the problem.
    """
    steps = complete_steps(folder)
    if step == -1:
        if not steps:
            raise ValueError(f"checkpoint.load_step=-1: no complete checkpoint in {folder!r}")
        errors = []
        for candidate in reversed(steps):
            try:
                return _load_one(folder, candidate, model, optimizer, loader_state_template)
            except CheckpointError as e:
                errors.append(str(e))
                if dist.get_rank() == 0:
                    print(f"[checkpoint] skipping step {candidate}: {e}", flush=True)
        raise ValueError("no loadable checkpoint: " + "; ".join(errors))
    if step not in steps:
        raise ValueError(f"checkpoint.load_step={step}: no complete checkpoint at "
                         f"{step_dir(folder, step)!r}; available steps: {steps}")
    return _load_one(folder, step, model, optimizer, loader_state_template)


class CheckpointError(ValueError):
    """A checkpoint on disk is corrupt or truncated (as opposed to not matching the model)."""


def _load_one(folder, step, model, optimizer, loader_state_template) -> dict:
    path = step_dir(folder, step)
    state = _app_state(model, optimizer, {"step": 0, "loader": dict(loader_state_template),
                                          "rng": torch.get_rng_state()})
    _check_shapes(path, state["model"])
    try:
        dcp.load(state, checkpoint_id=path)
    # DCP raises several types for corrupt/truncated files; its CheckpointException derives
    # from BaseException in torch 2.13, so it must be named.
    except (Exception, CheckpointException) as e:
        msg = str(e).strip().splitlines()
        raise CheckpointError(f"checkpoint {path!r} could not be loaded ({type(e).__name__}"
                              f"{': ' + msg[0] if msg else ''})") from e
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=optim_state_by_bucket(model, state["optimizer"]),
                   options=_OPTIONS)
    return state["train"]


def _check_shapes(path: str, model_sd: dict) -> None:
    """Compare global shapes in the checkpoint's metadata with the model's, by FQN."""
    try:
        meta = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:
        raise CheckpointError(f"checkpoint {path!r} has unreadable metadata "
                         f"({type(e).__name__}); it is corrupt or truncated") from e
    for fqn, tensor in model_sd.items():
        key = f"model.{fqn}"
        saved = meta.state_dict_metadata.get(key)
        if saved is None:
            raise ValueError(f"checkpoint {path!r} has no entry for parameter {fqn!r}: "
                             "it was saved from a different model")
        shape = getattr(saved, "size", None)
        if shape is not None and tuple(shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint {path!r}: parameter {fqn!r} has shape "
                             f"{tuple(shape)} but the model has {tuple(tensor.shape)}: it was "
                             "saved from a different model/flavor")
