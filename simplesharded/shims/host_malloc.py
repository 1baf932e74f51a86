"""Host memory kept for reuse in CPU ranks, as an accelerator's caching allocator keeps it.

glibc's malloc serves a block above its mmap threshold (128 KiB at start, rising to at most
32 MiB) with fresh pages from the OS and gives them back on free; the OS zeroes each 4 KiB
page on its first touch. A training step allocates the same large tensors every step
(activations, logits, FSDP's gathered parameters and buckets, gloo's scratch buffers), so a CPU
rank pays a page fault per 4 KiB of them, every step, on the thread that first writes them.
That cost is neither compute nor communication; GPU ranks never pay it (their allocator caches),
and it falls unevenly on data-parallel schemes: DDP's buckets live across steps, FSDP's gathered
parameters are allocated per step. ``python -m simplesharded.tools.bench --host-malloc system``
shows the difference
(benchmarks/history/journal.md#issue-12-page-faults-per-step-a-caching-malloc-for-cpu-ranks-and-the-tables-after-the-heap-fix).

``CACHING`` (glibc tunables) backs malloc's heap with transparent huge pages (``hugetlb``:
one fault per 2 MiB instead of per 4 KiB for what is still new), turns its mmap path off and
never trims the heap: freed blocks go back to malloc's free lists and the next step reuses
them. Resident memory then stays at the run's peak, as a caching allocator's does. glibc reads
``GLIBC_TUNABLES`` when a process starts, so it is set for processes about to start (the
launcher's and the bench's ranks; not the test suite's, whose memory tests measure the loader
under glibc's defaults); it does nothing under another allocator
(jemalloc or tcmalloc preloaded) and a glibc that lacks a tunable ignores it. A tunable the user
set wins.
"""
from __future__ import annotations

import os

TUNABLES = "GLIBC_TUNABLES"
CACHING = {"glibc.malloc.hugetlb": "1", "glibc.malloc.mmap_max": "0",
           "glibc.malloc.trim_threshold": str(2**62)}


def caching_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``{"GLIBC_TUNABLES": ...}``: ``environ``'s tunables (default: this process's) plus those
    of ``CACHING`` it does not set."""
    environ = os.environ if environ is None else environ
    user = [item for item in environ.get(TUNABLES, "").split(":") if item]
    have = {item.partition("=")[0] for item in user}
    return {TUNABLES: ":".join(user + [f"{k}={v}" for k, v in CACHING.items()
                                       if k not in have])}

