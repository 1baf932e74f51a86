"""The trainer: ``python -m simplesharded.trainer`` (./run_train.sh) trains a model of the zoo or
a Hugging Face model from a TOML config (config.py), in the order of recipe.py's
``parallelize``: tensor parallelism → expert parallelism → activation checkpointing →
data_parallel → compile. Its parts: the config, its parsing and its checks (config.py,
config_parse.py, config_checks.py, preflight.py), the recipe, the optimizer and schedule
(optim.py), the loop (loop.py), data, DCP checkpoints and their export to a Hugging Face
directory, metrics."""
from simplesharded.trainer.cli import main, make_deterministic
from simplesharded.trainer.loop import NonFiniteError, Trainer, local_loss
from simplesharded.trainer.optim import (OPTIMIZER_IMPL, build_optimizer, grad_norm_and_clip,
                                         lr_lambda)
from simplesharded.trainer.preflight import HF, check_static
from simplesharded.trainer.recipe import (apply_activation_checkpointing, apply_expert_parallel,
                                          apply_tensor_parallel, loss_chunks, parallelize,
                                          uses_loss_parallel)

__all__ = ["main", "make_deterministic", "NonFiniteError", "Trainer", "local_loss",
           "OPTIMIZER_IMPL", "build_optimizer", "grad_norm_and_clip", "lr_lambda", "HF",
           "check_static", "apply_activation_checkpointing", "apply_expert_parallel",
           "apply_tensor_parallel", "loss_chunks", "parallelize", "uses_loss_parallel"]
