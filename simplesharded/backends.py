"""Backend registry: ``make_backend(name, **options)`` returns a ``torch.compile`` backend.

Factories are pure: each call builds a new backend with its own pass pipeline and options; no
torch config is changed outside the backend's own ``config.patch`` (see passes/pipeline.py).

  eager, aot_eager, inductor            collectives untouched (reshard-after-forward tagging only)
  {aot_eager,inductor}_blockbucketing   one bucket per transformer block + overlap reordering
  {aot_eager,inductor}_autobucketing    cost-model buckets + overlap reordering
  (both first run HSDP's replica all-reduces at the padded shard size, so that every rank
   plans from the same sizes, passes/replica_padding.py)
  (on gloo both then lower the emulated reduce-scatter to all-to-all + adds, passes/lowering.py;
   gathering each bucket straight into per-parameter outputs, passes/coalesce_gathers.py, is
   off: gloo's coalesced gather can corrupt the heap, simplesharded/shims/gloo_gather.py)
  {aot_eager,inductor}_upstreambucketing torch's own schedule_overlap_bucketing (baseline only)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Callable

import torch

from simplesharded.passes.bucketing import bucket_collectives
from simplesharded.passes.coalesce_gathers import coalesce_gathers
from simplesharded.passes.lowering import lower_reduce_scatters
from simplesharded.passes.pipeline import PassPipeline, aot_backend, inductor_backend
from simplesharded.passes.plan_protocol import Plan
from simplesharded.passes.planning import AutoPlan, BlockPlan
from simplesharded.passes.recompute import tag_gathers_for_recompute
from simplesharded.passes.reordering import reorder_for_overlap
from simplesharded.passes.replica_padding import pad_replica_all_reduces
from simplesharded.passes.upstream import upstream_overlap_bucketing

COMPILERS = ("aot_eager", "inductor")


@dataclass(frozen=True)
class BackendOptions:
    """Options every backend accepts; the plain backends use only dump_graphs and
    reshard_after_forward."""

    dump_graphs: str | None = None  # directory: graphs before/after each pass
    # None: per parameter, as data_parallel set it (True, False or "auto"); a bool overrides it
    reshard_after_forward: bool | None = None
    memory_cap_bytes: int | None = None  # gathered bytes alive (docs/memory_cap.md)
    bucket_patterns: tuple[str, ...] = ()  # block plan: regexes whose match names a bucket
    # cost-model numbers of the auto plan and the upstream baseline: "calibrated" (measured
    # at make_backend time by every rank together, or read from the cache:
    # simplesharded/calibration.py), a calibration .json file, a profile name of
    # passes/hardware.py, or a Hardware
    hardware: object = "calibrated"
    # A ready plan (passes.Plan) instead of the one the backend builds from the options above
    # (give those to the plan itself).
    plan: Plan | None = None
    observer: Callable | None = None  # observer(kind, stage, gm) after every pass (tools/tests)


# Options a built-in plan is made of: with plan=..., they belong on that plan.
_PLAN_OPTIONS = ("reshard_after_forward", "memory_cap_bytes", "bucket_patterns")


def _hardware(opts: BackendOptions):
    from simplesharded.calibration import resolve_hardware  # measures only when asked

    return resolve_hardware(opts.hardware)


def _plan(kind: str, opts: BackendOptions) -> Plan:
    """The plan every pass of the backend reads: ``opts.plan``, else the built-in one."""
    if opts.plan is not None:
        return opts.plan
    if kind == "auto":
        return AutoPlan(_hardware(opts), opts.memory_cap_bytes,
                        reshard_after_forward=opts.reshard_after_forward)
    return BlockPlan(tuple(opts.bucket_patterns), opts.memory_cap_bytes,
                     reshard_after_forward=opts.reshard_after_forward)


def _pipeline(opts: BackendOptions, plan: Plan, graph_passes=()) -> PassPipeline:
    joint = [("recompute", functools.partial(tag_gathers_for_recompute, plan=plan))]
    return PassPipeline(joint=joint, graph=list(graph_passes), dump_dir=opts.dump_graphs,
                        observer=opts.observer)


def _compile(compiler: str, pipeline: PassPipeline) -> Callable:
    return aot_backend(pipeline) if compiler == "aot_eager" else inductor_backend(pipeline)


def _plain(compiler: str, opts: BackendOptions) -> Callable:
    return _compile(compiler, _pipeline(opts, _plan("block", opts)))


def _ours(compiler: str, kind: str, opts: BackendOptions) -> Callable:
    plan = _plan(kind, opts)
    # The padding first: the plan must see the same all-reduce sizes on every rank.
    passes = [("padding", pad_replica_all_reduces),
              ("bucketing", functools.partial(bucket_collectives, plan=plan)),
              ("reordering", functools.partial(reorder_for_overlap, plan=plan)),
              ("lowering", lower_reduce_scatters),
              ("coalescing", coalesce_gathers)]
    return _compile(compiler, _pipeline(opts, plan, passes))


def _upstream(compiler: str, opts: BackendOptions) -> Callable:
    passes = [("upstream", functools.partial(upstream_overlap_bucketing,
                                             hardware=_hardware(opts)))]
    return _compile(compiler, _pipeline(opts, _plan("block", opts), passes))


def _eager(opts: BackendOptions) -> str:
    return "eager"


BACKENDS: dict[str, Callable[[BackendOptions], Callable | str]] = {"eager": _eager}
for _c in COMPILERS:
    BACKENDS[_c] = functools.partial(_plain, _c)
    BACKENDS[f"{_c}_blockbucketing"] = functools.partial(_ours, _c, "block")
    BACKENDS[f"{_c}_autobucketing"] = functools.partial(_ours, _c, "auto")
    BACKENDS[f"{_c}_upstreambucketing"] = functools.partial(_upstream, _c)
del _c


def make_backend(name: str, **options) -> Callable | str:
    """Build the backend called ``name``. Unknown names torch knows are passed through."""
    known = {f.name for f in fields(BackendOptions)}
    bad = sorted(set(options) - known)
    if bad:
        raise ValueError(f"backend option(s) {bad} not one of {sorted(known)}")
    if isinstance(options.get("bucket_patterns"), str):
        options["bucket_patterns"] = (options["bucket_patterns"],)
    opts = BackendOptions(**options)
    if opts.plan is not None:
        if not isinstance(opts.plan, Plan):
            raise ValueError(f"plan={opts.plan!r} lacks a member of passes.Plan "
                             f"(assign, memory_cap_bytes, keep_gathered_bytes, "
                             f"reshard_after_forward)")
        both = [o for o in _PLAN_OPTIONS if options.get(o) not in (None, ())]
        if both:
            raise ValueError(f"backend option(s) {both} and plan=... both given: set them on "
                             f"the plan")
    if name in BACKENDS:
        return BACKENDS[name](opts)
    if name in torch._dynamo.list_backends(exclude_tags=()):
        return name
    raise ValueError(f"compile.backend={name!r} is not one of {sorted(BACKENDS)}")
