"""FSDP2's ``FSDPModule`` methods on a ``data_parallel`` model, so that code written for
``fully_shard`` runs here unchanged or stops at the one call that means something else.

Three kinds (``data_parallel`` gives the root every method, and each wrapped module under it
the per-unit ones, :data:`UNIT_METHODS`):

- **The same behaviour**: ``unshard`` / ``reshard`` (gather every parameter once and hold it,
  storage/gather_once.py), ``set_requires_gradient_sync`` (storage/grad_sync.py),
  ``reset_iter_state`` (after an aborted iteration: storage/forward_scope.py).
- **Scheduling hints, taken and not needed**: FSDP2 uses them to order its eager streams
  (which module's all-gather to issue next, whether to free a unit after backward, when the
  optimizer step is done). Here the compiled backends place every gather and free under a
  memory cap from the whole graph (passes/reordering.py, passes/recompute.py), and eager runs
  issue each bucket's gather one bucket ahead, in the order the last forward read them and
  backward in reverse (storage/prefetch.py), and reshard each block after its forward and
  backward (storage/eager_reshard.py), with results identical either way. So the call is
  checked (a prefetch list must name modules of this model) and changes nothing, as FSDP2's
  does when the order it asks for is the one it runs anyway.
- **Another meaning here**: a ``ValueError`` naming the equivalent (the divide factor is
  ``grad_reduction``; ``reshard_after_forward`` is chosen when wrapping).
"""
from __future__ import annotations

from typing import Callable, Sequence

from torch import nn

from simplesharded.storage.grad_sync import set_requires_gradient_sync
from simplesharded.storage.sharded_state import sharded_state


class Unsharded:
    """What FSDP2's ``unshard(async_op=True)`` returns: its gathers have already run."""

    def wait(self) -> None:
        return None


def unshard(self, async_op: bool = False) -> Unsharded | None:
    """FSDP2's method: gather every sharded parameter of the model once and hold it, so the
    forwards until :func:`reshard` gather nothing (a ``generate()`` loop's every step). The
    held parameters carry no gradient to the shards: forwards without grad, or with gradient
    sync off (its backward then adds to the no-sync accumulators), read them; one with grad
    and sync on is a RuntimeError. The optimizer's steps reach the shards, not the held
    copies: reshard and unshard again to read them. A collective: every rank calls it."""
    from simplesharded.storage.gather_once import gather_held  # loaded when first used

    gather_held(self)
    return Unsharded() if async_op else None


def reshard(self) -> None:
    """FSDP2's method: drop what :func:`unshard` held; forwards gather again."""
    from simplesharded.storage.gather_once import release_held

    release_held(self)


def reset_iter_state(self) -> None:
    """FSDP2's method (torch 2.13+), on the root: after an exception aborted a forward or a
    backward, the iteration's state goes: gathers issued ahead are waited for and dropped,
    buffers gathered for the backward and the parameters :func:`unshard` held are dropped,
    and gradients summed with gradient sync off are discarded (restart the micro-batches).
    Gradients already reduced onto the shards stay: ``zero_grad`` them as usual. Every rank
    calls it (the aborted iteration's gathers finish on all of them)."""
    from simplesharded.storage.forward_scope import abandon_iteration
    from simplesharded.storage.gather_once import release_held

    state = sharded_state(self)
    abandon_iteration(state.scope)
    release_held(self)
    state.grad_sync.discard()


def _reset_on_a_unit(self) -> None:
    """FSDP2's method raises on a module other than the root; so does this."""
    raise RuntimeError("reset_iter_state() resets the whole model's iteration: call it on the "
                       "root (the module data_parallel was given), not on a module inside it")


def set_requires_gradient_sync_method(self, requires_gradient_sync: bool, *,
                                      recurse: bool = True) -> None:
    """FSDP2's method on the root: :func:`set_requires_gradient_sync` for the whole model
    (one setting per model here, so ``recurse=False`` has nothing to narrow)."""
    if not recurse:
        raise ValueError("set_requires_gradient_sync(recurse=False): gradient sync is one "
                         "setting for the whole data_parallel model; use recurse=True")
    set_requires_gradient_sync(self, requires_gradient_sync)


def _check_bool(method: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{method}: {name}={value!r} is not one of [False, True]")


def _prefetch_setter(direction: str) -> Callable:
    method = f"set_modules_to_{direction}_prefetch"

    def setter(self, modules: Sequence[nn.Module]) -> None:
        for i, m in enumerate(modules):
            if not isinstance(m, nn.Module) or sharded_state(m) is None:
                raise ValueError(f"{method}: modules[{i}] ({type(m).__name__}) is not a module "
                                 f"of a data_parallel model; pass modules of this model")

    setter.__name__ = method
    setter.__doc__ = (f"FSDP2's {direction} prefetch list: checked, then nothing to do; the "
                      f"compiled backends' reordering pass places every gather, and eager "
                      f"runs prefetch one bucket ahead (module docstring).")
    return setter


def _hint(method: str, arg: str) -> Callable:
    def taken(self, value=None, *, recurse: bool = True) -> None:
        _check_bool(method, arg, value)

    taken.__name__ = method
    taken.__doc__ = f"FSDP2's {method}: taken, nothing to do here (module docstring)."
    return taken


def _set_is_last_backward(self, is_last_backward: bool) -> None:
    """FSDP2's method: taken. Every backward here waits on its own reductions before it
    returns, which FSDP2 does only on the last one."""
    _check_bool("set_is_last_backward", "is_last_backward", is_last_backward)


def _set_post_optim_event(self, event) -> None:
    """FSDP2's method: taken. The gathers here are issued on the stream the optimizer step
    ran on (functional collectives wait on it when issued), so there is no event to wait."""


def _refusal(method: str, instead: str) -> Callable:
    def refuse(self, *args, **kwargs):
        raise ValueError(f"{method} (FSDP2) has no counterpart on a data_parallel model: "
                         f"{instead}")

    refuse.__name__ = method
    refuse.__doc__ = f"FSDP2's {method}: a ValueError saying what to use instead."
    return refuse


_DIVIDE = ("gradients are averaged over the data-parallel ranks (grad_reduction='avg'); for "
           "another divisor f pass data_parallel(..., grad_reduction='sum') and scale the "
           "loss by 1/f")

# On every wrapped module, as FSDP2 has them on every fully_shard unit.
UNIT_METHODS: dict[str, Callable] = {
    "set_modules_to_forward_prefetch": _prefetch_setter("forward"),
    "set_modules_to_backward_prefetch": _prefetch_setter("backward"),
    "set_reshard_after_backward": _hint("set_reshard_after_backward",
                                        "reshard_after_backward"),
    "set_force_sum_reduction_for_comms": _hint("set_force_sum_reduction_for_comms", "enable"),
    "set_reshard_after_forward": _refusal(
        "set_reshard_after_forward",
        "reshard_after_forward is chosen when wrapping, data_parallel(..., "
        "reshard_after_forward=True | False | 'auto'); to keep the parameters gathered across "
        "forwards (eval, generate()) call model.unshard() before them and model.reshard() "
        "after"),
    "set_gradient_divide_factor": _refusal("set_gradient_divide_factor", _DIVIDE),
    "set_reduce_scatter_divide_factor": _refusal("set_reduce_scatter_divide_factor", _DIVIDE),
    "set_requires_all_reduce": _refusal(
        "set_requires_all_reduce",
        "gradient reduction is one setting for the whole model, over every data-parallel "
        "dim: model.set_requires_gradient_sync(False) skips it"),
    "set_custom_all_gather": _refusal(
        "set_custom_all_gather",
        "the gathers are traced collectives our passes schedule; quantized gathers are "
        "make_backend(..., quantize_gathers='int8' | 'fp8')"),
    "set_custom_reduce_scatter": _refusal(
        "set_custom_reduce_scatter",
        "the reductions are traced collectives our passes schedule; MixedPrecisionPolicy's "
        "reduce_dtype picks their dtype, make_backend(..., quantize_grads='int8' | 'bf16') "
        "quantizes them"),
    "set_all_reduce_hook": _refusal(
        "set_all_reduce_hook",
        "HSDP's replica all-reduce is part of each gradient's traced reduction"),
    "reset_iter_state": _reset_on_a_unit,
}

# On the root only: the model-wide state.
ROOT_METHODS: dict[str, Callable] = {
    **UNIT_METHODS,
    "unshard": unshard,
    "reshard": reshard,
    "set_requires_gradient_sync": set_requires_gradient_sync_method,
    "set_is_last_backward": _set_is_last_backward,
    "set_post_optim_event": _set_post_optim_event,
    "reset_iter_state": reset_iter_state,
}
