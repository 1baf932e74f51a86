"""Checks of a training config that need no process group but more than the config: the
model it names, the degrees and the sequence length against the model's sizes, the dataset
file; and the features the config asks for against this torch (passes/torch_compat.py).
``python -m simplesharded.trainer --check-only`` (run_train.sh's preflight) runs them once
before torchrun starts any rank; every rank runs them again for direct torchrun users. Rules
about the config alone live in config_checks.py's ``validate``."""
from __future__ import annotations

import os

from simplesharded.models import hf_source
from simplesharded.models.context_parallel import supports_context_parallel
from simplesharded.passes.torch_compat import (CONTEXT_PARALLEL, EXPERT_PARALLEL, STEP_GRAPH,
                                               refusal)
from simplesharded.trainer.config import Config
from simplesharded.trainer.config_checks import resolve
from simplesharded.trainer.data import load_tokenizer

HF = "hf"  # model.name of a Hugging Face model read from model.path (models/hf_source.py)


def check_static(cfg: Config, world_size: int) -> Config:
    """Everything that can be checked before any process-group work; returns resolved cfg."""
    cfg = resolve(cfg, world_size)
    if cfg.model.n_layers < 0 or (cfg.model.n_layers and cfg.model.name == HF):
        raise ValueError(f"model.n_layers={cfg.model.n_layers}: a zoo model's number of blocks, "
                         f"or 0 for its flavor's (a Hugging Face model's is its config.json's)")
    if cfg.model.name == HF:
        args = _check_hf(cfg)
    else:
        args = _check_zoo(cfg)
    what = (f"model.path={cfg.model.path!r}" if cfg.model.name == HF
            else f"model {cfg.model.name}/{cfg.model.flavor}")
    if cfg.training.seq_len > args.max_seq_len:
        raise ValueError(f"training.seq_len={cfg.training.seq_len} is above the maximum "
                         f"{args.max_seq_len} of {what}")
    path = cfg.training.dataset_path
    if path and not os.access(path, os.R_OK):
        raise ValueError(f"training.dataset_path={path!r} does not exist or is not readable")
    tp = cfg.parallelism.tensor_parallel_degree
    if tp > 1:
        try:
            args.check_tp(tp)
        except ValueError as e:
            raise ValueError(f"parallelism.{e} ({what})") from None
    ep = cfg.parallelism.expert_parallel_degree
    if ep > 1:
        if not hasattr(args, "check_ep"):
            raise ValueError(f"parallelism.expert_parallel_degree={ep} needs a model with "
                             f"routed experts (deepseek_v3); {what} has none")
        try:
            args.check_ep(ep)
        except ValueError as e:  # a zoo model's line ends with a count of its flavor's
            raise ValueError(f"parallelism.{e} ({what})" if cfg.model.name == HF
                             else f"parallelism.{e} of {what}") from None
    if cfg.parallelism.pipeline_parallel_degree > 1:
        _check_pipeline(cfg)
    cp = cfg.parallelism.context_parallel_degree
    if cp > 1 and cfg.model.name == HF:
        try:
            hf_source.check_context_parallel(cfg.model.path)
        except ValueError as e:
            raise ValueError(f"parallelism.context_parallel_degree={cp} with "
                             f"model.path={cfg.model.path!r}: {e}") from None
    elif cp > 1 and not supports_context_parallel(cfg.model.spec()[0]):
        raise ValueError(f"parallelism.context_parallel_degree={cp} needs a model whose "
                         f"attention runs under context parallelism (llama3, deepseek_v3, "
                         f"--model.name hf of the Llama family); {what} has none")
    return cfg


def check_packages(cfg: Config) -> None:
    """The optional packages the config asks for are importable by this python: one line
    naming the key otherwise, before any rank builds a model. Separate from check_static,
    whose checks hold for the config on any machine."""
    import importlib.util
    import sys

    if cfg.metrics.enable_tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError(f"metrics.enable_tensorboard=true needs the tensorboard package, "
                         f"which {sys.executable} lacks: pip install tensorboard, or "
                         f"--metrics.enable_tensorboard false")
    if cfg.checkpoint.enable and importlib.util.find_spec("numpy") is None:
        # torch.distributed.checkpoint agrees on its save plan with gather_object, which
        # serialises through numpy
        raise ValueError(f"checkpoint.enable=true needs numpy (torch's distributed "
                         f"checkpoint uses it), which {sys.executable} lacks: pip install "
                         f"numpy, or --checkpoint.enable false")


def check_torch(cfg: Config) -> None:
    """A feature the config asks for that this torch lacks (passes/torch_compat.py's table):
    one line naming the setting, the feature, the installed torch and the one it needs. The
    trainer's entry runs it after :func:`check_static`, so a config's own errors come first."""
    p = cfg.parallelism
    for key, value, used, feature in (
            ("compile.scope", cfg.compile.scope, cfg.compile.scope == "step", STEP_GRAPH),
            ("parallelism.context_parallel_degree", p.context_parallel_degree,
             p.context_parallel_degree > 1, CONTEXT_PARALLEL),
            ("parallelism.expert_parallel_degree", p.expert_parallel_degree,
             p.expert_parallel_degree > 1, EXPERT_PARALLEL)):
        line = refusal(feature) if used else None
        if line is not None:
            raise ValueError(f"{key}={value!r}: {line}")


def _check_pipeline(cfg: Config) -> None:
    """The model can be cut into the stages the config asks for (simplesharded/pipeline/stage_split.py
    cuts the model the trainer builds, on the meta device here)."""
    from simplesharded.pipeline.stage_split import plan_stages
    from simplesharded.trainer.config_checks import pipeline_stages

    p = cfg.parallelism
    key = f"parallelism.pipeline_parallel_degree={p.pipeline_parallel_degree}"
    if cfg.model.name == HF:
        try:
            hf_source.check_pipeline(cfg.model.path)
        except ValueError as e:
            raise ValueError(f"{key} with model.path={cfg.model.path!r}: {e}") from None
    model = cfg.model.build()
    split = p.pipeline_parallel_layers_per_stage
    try:
        plan_stages(model, pipeline_stages(p), split or None)
    except ValueError as e:
        if split:
            key = f"parallelism.pipeline_parallel_layers_per_stage={split}"
        raise ValueError(f"{key} (schedule {p.pipeline_parallel_schedule}, model "
                         f"{cfg.model.label()}): {e}") from None


def _check_zoo(cfg: Config):
    from simplesharded.models import MODELS

    if cfg.model.name not in MODELS:  # the trainer's choices: the zoo and HF
        raise ValueError(f"model.name={cfg.model.name!r} is not one of {sorted([*MODELS, HF])}")
    cls, args = cfg.model.spec()
    if not hasattr(cls, "num_flops_per_token"):  # the trainer's model protocol (zoo models)
        trainable = sorted(n for n, (c, _) in MODELS.items() if hasattr(c, "num_flops_per_token"))
        raise ValueError(f"model.name={cfg.model.name!r} is not trainable here yet (bench it with "
                         f"python -m simplesharded.tools.bench --model {cfg.model.name}); the "
                         f"trainer takes {trainable + [HF]}")
    return args


def _check_hf(cfg: Config):
    """model.name='hf': the directory, its config and its tokenizer, read without torch
    models. Without model.tokenizer_path the directory's tokenizer.json is used (set here, in
    the resolved config every rank trains with)."""
    args = hf_source.read_args(cfg.model.path)
    hf_source.check_weights(cfg.model.path)
    if not cfg.model.tokenizer_path:
        cfg.model.tokenizer_path = hf_source.hf_tokenizer_path(cfg.model.path)
    if cfg.model.tokenizer_path:
        vocab = load_tokenizer(cfg.model.tokenizer_path).vocab_size
        if vocab > args.vocab_size:
            raise ValueError(f"model.tokenizer_path={cfg.model.tokenizer_path!r}: vocabulary "
                             f"{vocab} is larger than vocab_size {args.vocab_size} of "
                             f"model.path={cfg.model.path!r}")
    return args
