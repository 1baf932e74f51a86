"""Run the functional all-gather on CPU tensors as gloo's plain all-gather.

In torch 2.13 ``_c10d_functional.all_gather_into_tensor`` runs as a coalesced gather of one
tensor, which gloo runs as ``allgather_coalesced``. That work corrupts the heap when two of
them finish at once: each of a gloo group's two worker threads stores the finished op's name
into one string the group shares, without a lock, and ``ALLGATHER_COALESCED`` is too long for
the string's inline buffer, so two threads can free the same heap buffer
(benchmarks/history/journal.md#issue-13-item-7-the-heap-corruption-found-and-no-longer-triggered).
``all_gather_into_tensor_out`` goes through gloo's plain all-gather, whose name fits inline.

``install()`` (``data_parallel`` calls it on a gloo mesh; ``uninstall()`` undoes it) gives the
functional op a CPU kernel that allocates the output and gathers into
it with the ``_out`` op: the same bytes and values, and the work registered on the output as
before, so ``wait_tensor`` waits on it. A kernel for the op's CPU key covers every path that
gathers CPU tensors: our compiled graphs (aot_eager and inductor, whose generated code calls
the op), DTensor's eager redistribution and the plain backends. Other devices keep torch's
kernel (NCCL has no such race).
"""
from __future__ import annotations

import torch

_LIBRARY: torch.library.Library | None = None


def install() -> None:
    """Register the CPU kernel (idempotent; once per process)."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    library = torch.library.Library("_c10d_functional", "IMPL")
    library.impl("all_gather_into_tensor", _gather_into_fresh_tensor, "CPU")
    _LIBRARY = library


def uninstall() -> None:
    """Give the op torch's own CPU kernel back (the library's registration dropped)."""
    global _LIBRARY
    if _LIBRARY is not None:
        _LIBRARY._destroy()
        _LIBRARY = None


def installed() -> bool:
    return _LIBRARY is not None


def _gather_into_fresh_tensor(input: torch.Tensor, group_size: int, group_name
                              ) -> torch.Tensor:
    input = input.contiguous()
    out = input.new_empty((input.shape[0] * group_size, *input.shape[1:]))
    return torch.ops._c10d_functional.all_gather_into_tensor_out(
        input, group_size, group_name, out=out)
