"""Backend registry: ``make_backend(name, **options)`` returns a ``torch.compile`` backend.

Factories are pure: each call builds a new backend with its own pass pipeline and options.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import torch

from simplesharded.passes.pipeline import PassPipeline, aot_backend, inductor_backend
from simplesharded.passes.recompute import tag_gathers_for_recompute


@dataclass(frozen=True)
class BackendOptions:
    """Options every backend accepts (unused ones are ignored by the plain backends only when
    they are left at their defaults)."""

    dump_graphs: str | None = None  # directory: graphs before/after each pass
    reshard_after_forward: bool | None = None  # None: per parameter, as data_parallel set it


def _pipeline(opts: BackendOptions, graph_passes=()) -> PassPipeline:
    joint = [("recompute", lambda gm: tag_gathers_for_recompute(gm, opts))]
    return PassPipeline(joint=joint, graph=list(graph_passes), dump_dir=opts.dump_graphs)


def _eager(opts: BackendOptions) -> Callable | str:
    return "eager"


def _aot_eager(opts: BackendOptions) -> Callable:
    return aot_backend(_pipeline(opts))


def _inductor(opts: BackendOptions) -> Callable:
    return inductor_backend(_pipeline(opts))


BACKENDS: dict[str, Callable[[BackendOptions], Callable | str]] = {
    "eager": _eager,
    "aot_eager": _aot_eager,
    "inductor": _inductor,
}


def make_backend(name: str, **options) -> Callable | str:
    """Build the backend called ``name``. Unknown names torch knows are passed through."""
    known = {f.name for f in fields(BackendOptions)}
    bad = sorted(set(options) - known)
    if bad:
        raise ValueError(f"backend option(s) {bad} not one of {sorted(known)}")
    opts = BackendOptions(**options)
    if name in BACKENDS:
        return BACKENDS[name](opts)
    if name in torch._dynamo.list_backends(exclude_tags=()):
        return name
    raise ValueError(f"compile.backend={name!r} is not one of {sorted(BACKENDS)}")
