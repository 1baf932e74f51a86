"""The optimizer update, written so that torch.compile traces it into the step graph.

``Optimizer.step`` cannot be traced as one graph with the backward (dynamo breaks the graph
in its grad-mode decorator), and torch's fused AdamW kernel cannot be functionalized by
aot_autograd. So the update runs here, on each parameter's local shard (Adam and AdamW are
elementwise, so a shard's update needs only that shard), with the optimizer's own state
tensors and hyperparameters. It reproduces, op for op, the for-loop (``foreach=False``)
update torch runs eagerly on CPU, with two changes that leave every value bitwise the same:
the learning rate is a float64 tensor (a graph input of one element, so a schedule never
recompiles; its 0-d view in the graph is what torch itself turns a Python float into for
these ops), and the few ops that take it as a Scalar argument are spelled with tensor ops in
the kernel's own order.

SGD (with or without momentum, Nesterov and weight decay) is written too: its eager
``param.add_(grad, alpha=-lr)`` takes the rate as a Scalar, and ``addcmul`` of the
gradient and the negated rate as a 0-d tensor of the parameter's dtype gives that kernel's
bits for float32 parameters (both round once: ``param + grad * -lr``); its momentum buffer
is created as zeros, which with ``dampening=0`` makes the first step's
``buf * momentum + grad`` the gradient itself, as torch's first step clones it (another
dampening is refused).

One job: :func:`prepare` checks an optimizer and fills its state as its first ``step`` would;
:func:`apply_update` is the traced update of one step.
"""
from __future__ import annotations

import torch
import torch.fx.traceback as fx_traceback
from torch.distributed.tensor import DTensor
from torch import nn

from simplesharded.passes.annotations import UPDATE_KEY
from simplesharded.storage.step_routes import graph_input

# The optimizers whose update is written here (exact classes: a subclass may change step),
# each with the kind apply_update takes.
KINDS = {torch.optim.AdamW: "adamw", torch.optim.Adam: "adam", torch.optim.SGD: "sgd"}
SUPPORTED = tuple(KINDS)
# Options whose update is not written here: (option, the value we support).
_UNSUPPORTED = {torch.optim.AdamW: (("amsgrad", False), ("maximize", False),
                                    ("differentiable", False), ("capturable", False)),
                torch.optim.Adam: (("amsgrad", False), ("maximize", False),
                                   ("differentiable", False), ("capturable", False),
                                   ("decoupled_weight_decay", False)),
                torch.optim.SGD: (("maximize", False), ("differentiable", False),
                                  ("dampening", 0))}
# Per kind, the group's hyperparameters the traced update reads (besides the learning rate).
_HYPERS = {"adamw": ("betas", "weight_decay", "eps"), "adam": ("betas", "weight_decay", "eps"),
           "sgd": ("momentum", "dampening", "weight_decay", "nesterov")}
# Per kind, a parameter's state tensors the update reads and writes, in that order.
_STATE = {"adamw": ("step", "exp_avg", "exp_avg_sq"), "adam": ("step", "exp_avg", "exp_avg_sq"),
          "sgd": ("momentum_buffer",)}


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local tensor (a view, so in-place updates land
    on the shard), a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def prepare(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """Check that ``optimizer``'s update is one this module writes, create its state as its
    first eager ``step`` would (zeros, and a float32 step count), and return its parameters
    in group order. Raises TypeError naming the optimizer and what is not supported."""
    kind = type(optimizer)
    if kind not in KINDS:
        raise TypeError(f"compile_step cannot trace {kind.__module__}.{kind.__qualname__}: "
                        f"its update is written for {[c.__name__ for c in SUPPORTED]} only")
    params = []
    for group in optimizer.param_groups:
        bad = [f"{k}={group.get(k)!r}" for k, ok in _UNSUPPORTED[kind] if group.get(k, ok) != ok]
        if bad:
            raise TypeError(f"compile_step cannot trace {kind.__name__} with {', '.join(bad)}")
        fixed = [k for k in _HYPERS[KINDS[kind]] if isinstance(group[k], torch.Tensor)
                 or (k == "betas" and any(isinstance(b, torch.Tensor) for b in group[k]))]
        if fixed:
            raise TypeError(f"compile_step cannot trace {kind.__name__} with tensor {fixed}")
        for p in group["params"]:
            if not p.requires_grad:
                continue
            if torch.is_complex(p):
                raise TypeError(f"compile_step cannot trace {kind.__name__} on complex "
                                f"parameters")
            params.append(p)
            state = optimizer.state[p]
            if kind is torch.optim.SGD:
                if group["momentum"] != 0 and state.get("momentum_buffer") is None:
                    # module doc: with dampening 0, zeros make the first step torch's
                    state["momentum_buffer"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format)
            elif not state:
                # As Adam's _init_group does (its float32 step count on the CPU).
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return params


def update_kind(optimizer: torch.optim.Optimizer) -> str:
    """The update :func:`apply_update` runs for ``optimizer``: "adamw", "adam" or "sgd"."""
    return KINDS[type(optimizer)]


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[tuple]:
    """Per param group, what the traced update reads besides the learning rate: (betas,
    weight_decay, eps) for Adam and AdamW, (momentum, dampening, weight_decay, nesterov) for
    SGD. The step graph is specialised on them (a change recompiles it)."""
    keys = _HYPERS[update_kind(optimizer)]
    return [tuple(tuple(g[k]) if k == "betas" else g[k] for k in keys)
            for g in optimizer.param_groups]


def step_inputs(optimizer: torch.optim.Optimizer) -> tuple[list, list]:
    """What one step reads from ``optimizer``, taken at call time (``load_state_dict``
    replaces the state tensors): per group a float64 learning rate of one element, and per parameter
    its state tensors, in :func:`prepare`'s order: (step, exp_avg, exp_avg_sq) for Adam and
    AdamW, (momentum_buffer,) for SGD with momentum, () without."""
    # One element, not 0-d: dynamo gives a 0-d float64 CPU input a symbolic ``.item()``
    # value, which aot_autograd's scalar pass fails to turn back into a tensor and then
    # restarts the whole trace to specialize (every compile traced twice).
    lrs = [torch.tensor([g["lr"]], dtype=torch.float64) for g in optimizer.param_groups]
    # each state as the graph takes it (a ragged member's: the plain DTensor it is a view of)
    keys = _STATE[update_kind(optimizer)]
    states = [[tuple(graph_input(optimizer.state[p][k]) for k in keys
                     if optimizer.state[p].get(k) is not None)
               for p in g["params"] if p.requires_grad]
              for g in optimizer.param_groups]
    return lrs, states


def apply_update(kind: str, groups: list[list], hypers: list[tuple], grads: list,
                 lrs: list[torch.Tensor], states: list[list],
                 names: list[list[str]] | None = None,
                 flag: torch.Tensor | None = None) -> None:
    """One optimizer step on the local shards, traced. ``kind``: :func:`update_kind`'s.
    ``groups``: per param group its
    parameters (as :func:`prepare` returned them, grouped), ``grads`` the same nesting with
    their gradients (None: skipped, as torch skips a parameter without ``.grad``); ``hypers``
    from :func:`hyperparameters`, ``lrs`` and ``states`` from :func:`step_inputs`. Call under
    ``torch.no_grad()``. Nothing here reads the optimizer: dynamo would guard on its
    param_groups, learning rate included, and recompile when a schedule changes it.
    ``names``: the same nesting, each parameter's FQN; every op of its update is annotated
    with it (``ss_update``; its index in the optimizer without ``names``), so a pass can move
    the update next to its gradient's reduction (passes/update_placement.py).

    ``flag``: a 0-d bool tensor (simplesharded/step/finite.py) or None. Given, the update is
    taken only where it is True: each parameter's new values and state are computed into
    copies, the same ops on the same values, and written back selected by the flag
    (``torch.where``), so a False flag leaves parameters and state, step count included,
    bitwise as they were, and a True one gives the unconditional update's bits. A state
    tensor on another device than the flag (Adam's step count on the host, as torch keeps
    it, under an accelerator's flag) is written last, after every other update is issued:
    reading the flag there is a device-to-host copy, which waits for the flag."""
    # Last parameter first: backward reduces the gradients roughly in reverse parameter
    # order, so this is the order their gradients arrive in; without clipping our passes then
    # move each update up to its own reduction (passes/update_placement.py). Each update is
    # on its own parameter and state, so the order changes no value.
    if names is None:
        names = [[f"{i}.{j}" for j in range(len(ps))] for i, ps in enumerate(groups)]
    elsewhere = []  # (name, target, new value): written after the loop (see flag above)
    for params, gs, hyper, lr, sts, ns in reversed(list(zip(groups, grads, hypers, lrs,
                                                             states, names))):
        for p, g, st, name in reversed(list(zip(params, gs, sts, ns))):
            if g is None:
                continue
            with fx_traceback.annotate({UPDATE_KEY: name}):
                if flag is None:
                    _update(kind, p, g, st, hyper, lr.view(()))
                    continue
                targets = [local(p), *(local(s) for s in st)]
                work = [t.clone() for t in targets]
                _update(kind, work[0], g, tuple(work[1:]), hyper, lr.view(()))
                for t, w in zip(targets, work):
                    if t.device == flag.device:
                        t.copy_(torch.where(flag, w, t))
                    else:
                        elsewhere.append((name, t, w))
    copies = {}  # device -> the flag there, read once, unannotated: it stays after the loop
    for name, t, w in elsewhere:
        if t.device not in copies:
            copies[t.device] = flag.to(t.device)
        with fx_traceback.annotate({UPDATE_KEY: name}):
            t.copy_(torch.where(copies[t.device], w, t))


def _update(kind: str, p, g, state, hyper, lr) -> None:
    if kind == "sgd":
        _sgd(p, g, state, hyper, lr)
    else:
        _adam(p, g, state, hyper, lr, kind == "adamw")


def _adam(p, g, state, hyper, lr, decoupled: bool) -> None:
    param, grad = local(p), local(g)
    step_t, exp_avg, exp_avg_sq = state
    exp_avg, exp_avg_sq = local(exp_avg), local(exp_avg_sq)
    (beta1, beta2), wd, eps = hyper
    step_t += 1
    if wd != 0:
        if decoupled:
            param.mul_(1 - lr * wd)
        else:
            grad = grad.add(param, alpha=wd)
    exp_avg.lerp_(grad, 1 - beta1)
    # Eagerly addcmul_(grad, grad, value=1 - beta2). Dynamo rewrites an addcmul_ that has a
    # value into mul + fma, which rounds differently from the kernel; without a value it stays
    # aten.addcmul, and the value folded into the first factor gives the kernel's bits
    # (tests/test_step.py compares them).
    exp_avg_sq.mul_(beta2).addcmul_(grad * (1 - beta2), grad)
    # Eagerly these are Python floats from step_t.item(); in float64 0-d tensors the same
    # IEEE operations give the same values, without reading the step count on the host.
    step = step_t.to(torch.float64)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2.sqrt()).add_(eps)
    # addcdiv_(exp_avg, denom, value=-step_size) takes a Scalar value; its kernel computes
    # param + (value * exp_avg) / denom, spelled here in that order.
    param.add_((exp_avg * -step_size) / denom)


def _sgd(p, g, state, hyper, lr) -> None:
    param, grad = local(p), local(g)
    momentum, dampening, wd, nesterov = hyper
    if wd != 0:
        grad = grad.add(param, alpha=wd)
    if momentum != 0:
        (buf,) = state
        buf = local(buf)
        buf.mul_(momentum).add_(grad, alpha=1 - dampening)
        grad = grad.add(buf, alpha=momentum) if nesterov else buf
    # Eagerly add_(grad, alpha=-lr), whose kernel rounds once (a fused multiply-add); so does
    # addcmul's, with the rate as a 0-d tensor in the parameter's dtype: for float32
    # parameters (the trainer's) the kernel's own conversion of the Scalar; a bf16 parameter's
    # kernel would keep the rate in float32, so there the bits may differ. Without a value,
    # dynamo leaves aten.addcmul as it is.
    param.addcmul_(grad, (-lr).to(param.dtype))
