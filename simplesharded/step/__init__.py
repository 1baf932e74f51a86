"""``compile_step``: forward, loss, backward and the optimizer step as one compiled graph.

Compiled model plus eager ``optimizer.step()`` is two graphs and a host loop: the last
bucket's reduce-scatter must finish before the step starts, and the next forward's first
all-gather cannot start before the step ends. Here the whole step is one graph: dynamo traces
``torch.autograd.grad`` (``trace_autograd_ops``) and the update on the local shards
(simplesharded/step/optim_update.py), so the collectives and the update are nodes of one graph
that the backend's passes see together.

Gradients never land on ``.grad``: they live inside the graph, and after the step every
parameter's ``.grad`` is None, as after ``optimizer.zero_grad()``. The optimizer's state
tensors are the graph's inputs, updated in place, so ``optimizer.state_dict()`` holds them.
The learning rate of each param group is read from ``param_groups`` at every call and passed
in as a tensor: a schedule that changes it does not recompile. A member of a ragged bucket
(``data_parallel(..., storage="ragged")``) is differentiated and updated through its bucket
(simplesharded/storage/step_routes.py), so per-parameter groups and frozen members work as elsewhere.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx.traceback as fx_traceback
from torch import nn

from simplesharded.backends import make_backend
from simplesharded.step.finite import all_finite
from simplesharded.step.grad_clip import clip_coefficient, global_norm, scaled
from simplesharded.passes.annotations import UPDATE_KEY
from simplesharded.passes.torch_compat import STEP_GRAPH, needs
from simplesharded.storage.step_routes import StepRoutes
from simplesharded.storage.ragged_shards import offload_of
from simplesharded.step.optim_update import (apply_update, hyperparameters, prepare,
                                             step_inputs, update_kind)

# What clipping divides by (see compile_step).
CLIP_NORMS = ("current", "previous")


def compile_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[..., torch.Tensor], *, backend: str,
                 max_norm: float | None = None, clip_norm: str = "current",
                 accumulation_steps: int = 1, with_grad_norm: bool = False,
                 skip_nonfinite: bool = False, **backend_options) -> Callable[..., torch.Tensor]:
    """A callable ``step(*batch) -> loss`` that runs ``loss_fn(model, *batch)``, its backward,
    global-norm clipping of the gradients to ``max_norm`` (None: none), the optimizer's step
    and the zeroing of the gradients as one ``torch.compile(fullgraph=True)`` graph.

    ``model``: as :func:`simplesharded.data_parallel` returned it (or a plain module).
    ``optimizer``: AdamW, Adam or SGD over its parameters (another one is a TypeError naming
    it; simplesharded/step/optim_update.py). ``backend``: a name :func:`simplesharded.make_backend`
    takes; ``backend_options`` go to it. ``with_grad_norm``: ``step`` returns ``(loss,
    norm)``, the gradients' global norm before clipping (computed in the graph).

    ``skip_nonfinite``: a step whose loss (on any rank of the default process group, all of
    which must run ``step``, as they do for the gradients' reductions) or global gradient
    norm is not finite changes nothing: parameters, optimizer state (step counts included)
    and, with ``clip_norm="previous"``, the norm kept for the next step stay bitwise as they
    were, on every rank alike (the flag: simplesharded/step/finite.py; the conditional update:
    optim_update.apply_update). ``step`` then returns a 0-d bool tensor last, True when the
    update was taken: ``(loss, taken)``, or ``(loss, norm, taken)`` with ``with_grad_norm``.
    The decision stays in the graph (no host read), at the price of one all-reduce of one
    element, the norm computed even without clipping, every update's commit waiting for the
    last gradient (the flag needs them all), and the update's new values computed into copies
    (each parameter's shard and state once more, alive until its commit).

    ``clip_norm``: which norm the clipping divides by. ``"current"`` (torch's
    ``clip_grad_norm_``): this step's, so every update waits for the norm's all-reduce, which
    waits for the last gradient. ``"previous"``: the previous step's (the first step, and the
    first after a restart, is not clipped), so each update runs as soon as its own gradient
    is reduced, under the rest of the backward (passes/update_placement.py). The trade: a
    step's gradients are clipped against the last step's size, so one spike is clipped a step
    late. Adam's and AdamW's first update does not depend on the gradients' scale, so the
    unclipped first step changes it only through ``eps``.

    ``accumulation_steps`` N > 1: every tensor of ``batch`` is split into N micro-batches
    along dim 0, and the graph runs ``loss_fn``'s forward and backward on each in turn (one
    micro-batch's activations alive at a time; its gradients reduce-scattered as its backward
    ends, as ``gradient_sync="every_microbatch"``), sums their gradients in micro-batch order
    (as ``loss.backward()`` per micro-batch accumulates ``.grad``) and steps once; ``step``
    returns the sum of the micro-batches' losses. The graph holds N copies of the forward and
    backward: compiling takes about N times as long.
    """
    needs(STEP_GRAPH)
    if offload_of(model) != "none":
        raise ValueError(f"compile_step does not take a model wrapped with offload="
                         f"{offload_of(model)!r} (the traced update steps the shards on the "
                         f"compute device): use offload='none' or the split step")
    if clip_norm not in CLIP_NORMS:
        raise ValueError(f"compile_step: clip_norm={clip_norm!r} is not one of {CLIP_NORMS}")
    if not (isinstance(accumulation_steps, int) and accumulation_steps >= 1):
        raise ValueError(f"compile_step: accumulation_steps={accumulation_steps!r} is not a "
                         f"positive integer")
    params = prepare(optimizer)
    routes = StepRoutes(model, params)
    groups = [[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups]
    kind = update_kind(optimizer)
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
    flat_names = [n for ns in names for n in ns]
    # clip_norm="previous": the last step's norm, a graph input the graph overwrites (0 before
    # the first step: a coefficient of 1).
    last_norm = torch.zeros((), dtype=torch.float32, device=_device_of(params))

    def step_graph(lrs, states, last_norm, *batch):
        if max_norm is not None and clip_norm == "previous":
            # First in the graph: an update depending on it is free to move up to its gradient
            with torch.no_grad():
                coef = clip_coefficient(last_norm, max_norm)
        loss, grads = None, None
        for micro in _micro_batches(batch, accumulation_steps):
            part = loss_fn(model, *micro)
            part_grads = routes.grads(torch.autograd.grad(part, routes.inputs(), allow_unused=True))
            with torch.no_grad():
                loss = part.detach() if loss is None else loss + part.detach()
                grads = part_grads if grads is None else [
                    b if a is None else a if b is None else a + b
                    for a, b in zip(grads, part_grads)]
        with torch.no_grad():
            norm = taken = None
            if max_norm is not None or with_grad_norm or skip_nonfinite:
                present = [i for i, g in enumerate(grads) if g is not None]
                norm = global_norm([grads[i] for i in present], [flat_names[i] for i in present])
            if skip_nonfinite:
                taken = all_finite(loss, norm)
            if max_norm is not None:
                if clip_norm == "current":
                    coef = clip_coefficient(norm, max_norm)
                clipped = []
                for g, name in zip(grads, flat_names):
                    with fx_traceback.annotate({UPDATE_KEY: name}):  # part of its update
                        clipped.append(None if g is None else scaled(g, coef))
                grads = clipped
                if clip_norm == "previous":
                    last_norm.copy_(norm if taken is None else torch.where(taken, norm,
                                                                           last_norm))
            it = iter(grads)
            nested = [[next(it) for _ in g] for g in groups]
            apply_update(kind, routes.update_targets(groups), hypers, nested, lrs, states,
                         names, flag=taken)
        out = (loss, *((norm,) if with_grad_norm else ()), *((taken,) if skip_nonfinite else ()))
        return out if len(out) > 1 else loss

    compiled = torch.compile(step_graph, backend=make_backend(backend, **backend_options),
                             fullgraph=True)

    def step(*batch):
        for t in batch:  # checked here: an error raised while dynamo traces is not this one
            if accumulation_steps > 1 and isinstance(t, torch.Tensor) and (
                    t.dim() == 0 or t.shape[0] % accumulation_steps):
                raise ValueError(f"compile_step: accumulation_steps={accumulation_steps} does "
                                 f"not divide a batch tensor's dim 0 (shape {tuple(t.shape)})")
        now = hyperparameters(optimizer)
        if now != hypers:
            hypers[:] = now
        lrs, states = step_inputs(optimizer)
        # Scoped to the call: dynamo reads it while tracing, and nothing else should see it.
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            return compiled(lrs, states, last_norm, *batch)

    return step


def _micro_batches(batch: tuple, n: int) -> list[tuple]:
    """``batch`` as ``n`` micro-batches: each tensor split into ``n`` equal parts along dim 0
    (anything else passed to each as it is)."""
    if n == 1:
        return [batch]
    parts = [t.chunk(n) if isinstance(t, torch.Tensor) else [t] * n for t in batch]
    return [tuple(p[i] for p in parts) for i in range(n)]


def _device_of(params: list) -> torch.device:
    return params[0].device if params else torch.device("cpu")
