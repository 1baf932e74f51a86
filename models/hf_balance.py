"""A Hugging Face MoE's load-balancing loss (``output_router_logits`` in its config.json),
added as transformers' causal LM adds it: recorded router logits, the loss of the whole model,
and under pipeline parallelism the sums it is made of, carried from stage to stage.

Recording: forward hooks on the routers append their logits to a :class:`RouterRecord` that
the model and its routers share while a forward asks (:func:`start`, :func:`take`). Which
module is a router, and which of its outputs are the logits, is transformers' own record of
them (``_can_record_outputs["router_logits"]``). transformers collects them itself when called
with ``output_router_logits=True``, but under a lock that dynamo cannot trace (a graph
break); these hooks are installed once and trace. A pipeline stage is a deep copy of the model
(simplesharded/pipeline/stage_split.py): it gets a record of its own, which its own routers
share.

The loss: ``load_balancing_loss_func`` of the model's module (Mixtral's, Qwen-MoE's, ...) over
every block's logits (:func:`whole_model_loss`). That function is ``E · Σ_e (c_e / N) ·
(p_e / N)`` over the N router rows of all blocks, ``c_e`` the rows choosing expert ``e``
among their top k and ``p_e`` the sum of their softmax probabilities: sums over blocks, so a
pipeline stage adds its blocks' to those it received and passes them on beside the hidden
states (:func:`stage_sums`), and the last stage's loss reads them (:func:`loss_from_sums`).
The gradient reaches every stage's routers through ``p``, as autograd carries it back along
the pipeline. ``tests/test_hf_source.py`` checks the two forms agree for every MoE family the
pipeline takes.

Weighting (both forms): the trainer's loss is a sum it divides by the step's token count, so
the balancing loss is multiplied by this rank's tokens: one process gets transformers' loss
exactly, data-parallel ranks the token-weighted mean of their batches'. Under context
parallelism each rank holds chunks of the sequences, and the loss is of whole sequences: every
cp rank's router rows are gathered first (the sums run over rows, in any order).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from simplesharded.models.loss import IGNORE_INDEX


@dataclass(eq=False)
class RouterRecord:
    """The router logits of the forward running, in block order (None: none asked)."""

    logits: list | None = None


def record_router_logits(model: nn.Module, path: str) -> None:
    """Hooks on ``model``'s routers recording their logits into ``model._router_record``, and
    the loss function of the model's module as ``model._balance`` (module doc)."""
    recorder = getattr(type(model), "_can_record_outputs", {}).get("router_logits")
    target = getattr(recorder, "target_class", None)
    routers = [m for m in model.modules() if target is not None and isinstance(m, target)]
    balance = next((vars(sys.modules[c.__module__])["load_balancing_loss_func"]
                    for c in type(model).__mro__
                    if "load_balancing_loss_func" in vars(sys.modules[c.__module__])), None)
    if not routers or balance is None:
        raise ValueError(f"model.path={path!r}: config.json sets output_router_logits, but "
                         f"{type(model).__name__} names no router module whose logits the "
                         f"load-balancing loss reads; set it to false")
    record = RouterRecord()
    for m in routers:  # attributes, not a closure: a deep copy's routers find its own record
        m._ss_router_record, m._ss_router_index = record, recorder.index
        m.register_forward_hook(_record)
    model._balance, model._router_record = balance, record


def _record(module: nn.Module, args, out) -> None:
    record = module._ss_router_record
    if record.logits is not None:
        index = module._ss_router_index
        record.logits.append(out[index] if isinstance(out, tuple) else out)


def balancing(model: nn.Module) -> bool:
    """Whether ``model`` adds a balancing loss (its config sets output_router_logits)."""
    return getattr(model, "_balance", None) is not None


def start(model: nn.Module) -> None:
    """Record the routers' logits from here (a forward that adds the loss)."""
    model._router_record.logits = []


def take(model: nn.Module) -> tuple:
    """The logits recorded since :func:`start`, in block order; recording stops."""
    record = model._router_record
    logits, record.logits = tuple(record.logits), None
    return logits


def _whole_rows(model: nn.Module, router_logits: tuple) -> tuple:
    """Each block's router rows over the whole sequences: under context parallelism every cp
    rank's rows gathered (module doc)."""
    cp = getattr(model, "context_parallel", None)
    if cp is not None:
        router_logits = tuple(cp.gather(logits) for logits in router_logits)
    return router_logits


def _tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()


def whole_model_loss(model: nn.Module, router_logits: tuple, labels: torch.Tensor
                     ) -> torch.Tensor:
    """transformers' load-balancing loss of the model's module on every block's
    ``router_logits``, times the config's ``router_aux_loss_coef`` and this rank's tokens
    (module doc)."""
    balance = model._balance(_whole_rows(model, router_logits), model.num_experts,
                             model.num_experts_per_tok)
    return model.config.router_aux_loss_coef * balance.float() * _tokens(labels)


def sums_like(model: nn.Module, device="meta") -> torch.Tensor:
    """What a pipeline stage passes on beside the hidden states (:func:`stage_sums`): per
    expert the rows choosing it, per expert their probabilities' sum, and the rows (fp32)."""
    return torch.zeros(2 * model.num_experts + 1, dtype=torch.float32, device=device)


def stage_sums(model: nn.Module, router_logits: tuple, received: torch.Tensor | None,
               device: torch.device) -> torch.Tensor:
    """``received`` (None on the first stage) plus this stage's blocks' sums
    (:func:`sums_like`, on ``device``), as transformers' loss function accumulates them over
    blocks; a stage of dense blocks only (Qwen-MoE's ``mlp_only_layers``) adds nothing."""
    experts, k = model.num_experts, model.num_experts_per_tok
    own = []
    for logits in _whole_rows(model, router_logits):
        weights = torch.softmax(logits, dim=-1)
        top = torch.topk(weights, k, dim=-1).indices.reshape(-1)
        chosen = weights.new_zeros(experts, dtype=torch.float32).scatter_add(
            0, top, weights.new_ones(top.shape, dtype=torch.float32))
        own.append(torch.cat([chosen, weights.float().sum(dim=0),
                              weights.new_full((1,), weights.shape[0], dtype=torch.float32)]))
    total = torch.stack(own).sum(dim=0) if own else sums_like(model, device)
    return total if received is None else received + total


def loss_from_sums(model: nn.Module, sums: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The last stage's balancing loss from every stage's :func:`stage_sums`: what
    :func:`whole_model_loss` gives on all blocks' logits (module doc)."""
    experts = model.num_experts
    rows = sums[-1]
    chosen, probs = sums[:experts] / rows, sums[experts:2 * experts] / rows
    balance = (chosen * probs).sum() * experts
    return model.config.router_aux_loss_coef * balance * _tokens(labels)
