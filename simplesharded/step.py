"""``compile_step``: forward, loss, backward and the optimizer step as one compiled graph.

Compiled model plus eager ``optimizer.step()`` is two graphs and a host loop: the last
bucket's reduce-scatter must finish before the step starts, and the next forward's first
all-gather cannot start before the step ends. Here the whole step is one graph: dynamo traces
``torch.autograd.grad`` (``trace_autograd_ops``) and the update on the local shards
(simplesharded/optim_update.py), so the collectives and the update are nodes of one graph
that the backend's passes see together.

Gradients never land on ``.grad``: they live inside the graph, and after the step every
parameter's ``.grad`` is None, as after ``optimizer.zero_grad()``. The optimizer's state
tensors are the graph's inputs, updated in place, so ``optimizer.state_dict()`` holds them.
The learning rate of each param group is read from ``param_groups`` at every call and passed
in as a tensor: a schedule that changes it does not recompile.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from simplesharded.backends import make_backend
from simplesharded.grad_clip import clip_, global_norm
from simplesharded.optim_update import (apply_update, hyperparameters, prepare,
                                        step_inputs)


def compile_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[..., torch.Tensor], *, backend: str,
                 max_norm: float | None = None, with_grad_norm: bool = False,
                 **backend_options) -> Callable[..., torch.Tensor]:
    """A callable ``step(*batch) -> loss`` that runs ``loss_fn(model, *batch)``, its backward,
    global-norm clipping of the gradients to ``max_norm`` (None: none), the optimizer's step
    and the zeroing of the gradients as one ``torch.compile(fullgraph=True)`` graph.

    ``model``: as :func:`simplesharded.data_parallel` returned it (or a plain module).
    ``optimizer``: AdamW or Adam over its parameters (another one is a TypeError naming it;
    simplesharded/optim_update.py). ``backend``: a name :func:`simplesharded.make_backend`
    takes; ``backend_options`` go to it. ``with_grad_norm``: ``step`` returns ``(loss,
    norm)``, the gradients' global norm before clipping (computed in the graph).
    """
    params = prepare(optimizer)
    groups = [[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups]
    decoupled = type(optimizer) is torch.optim.AdamW
    fqns = {id(p): n for n, p in model.named_parameters()}
    # Each update's ops carry its parameter's name (passes/update_placement.py finds them
    # by it); one the model does not own gets its place in the optimizer.
    names = [[fqns.get(id(p), f"{i}.{j}") for j, p in enumerate(g)] for i, g in enumerate(groups)]
    # Read by the traced update as constants (dynamo guards on them); refreshed at each call,
    # so a change recompiles instead of being ignored.
    hypers = hyperparameters(optimizer)
    optimizer.zero_grad(set_to_none=True)
    if max_norm is not None:
        max_norm = float(max_norm)

    def step_graph(lrs, states, *batch):
        loss = loss_fn(model, *batch)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        with torch.no_grad():
            norm = None
            if max_norm is not None:
                norm = clip_(list(grads), max_norm)
            elif with_grad_norm:
                norm = global_norm([g for g in grads if g is not None])
            it = iter(grads)
            nested = [[next(it) for _ in g] for g in groups]
            apply_update(decoupled, groups, hypers, nested, lrs, states, names)
        return (loss.detach(), norm) if with_grad_norm else loss.detach()

    compiled = torch.compile(step_graph, backend=make_backend(backend, **backend_options),
                             fullgraph=True)

    def step(*batch):
        now = hyperparameters(optimizer)
        if now != hypers:
            hypers[:] = now
        lrs, states = step_inputs(optimizer)
        # Scoped to the call: dynamo reads it while tracing, and nothing else should see it.
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            return compiled(lrs, states, *batch)

    return step
