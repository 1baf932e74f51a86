"""Backend registry: ``make_backend(name, **options)`` returns a ``torch.compile`` backend.

Factories are pure: each call builds a new backend with its own pass pipeline and options; no
torch config is changed outside the backend's own ``config.patch`` (see passes/pipeline.py).

  eager, aot_eager, inductor            collectives untouched (reshard-after-forward tagging only)
  {aot_eager,inductor}_blockbucketing   one bucket per transformer block + overlap reordering
  {aot_eager,inductor}_autobucketing    cost-model buckets + overlap reordering
  (both first run HSDP's replica all-reduces at the padded shard size, so that every rank
   plans from the same sizes, passes/replica_padding.py, and on gloo then lower the emulated
   reduce-scatter to all-to-all + adds, passes/lowering.py)
  {aot_eager,inductor}_upstreambucketing torch's own schedule_overlap_bucketing (baseline only)
(every compiled one first has the gathers that feed only a Float8Linear's weight cast send the
 cast shard in float8, on graphs that hold such a cast: passes/float8_gather.py; option
 float8_gathers=False gathers them as traced)

A name is parsed once into a :class:`BackendName` (compiler, bucketing), and
:func:`pass_pipeline` is the one place that turns it into passes: the backends here, and the
tools that run a backend's passes on traced graphs (tools/cluster_trace.py, bench_passes.py),
all build their pipeline with it.
"""
from __future__ import annotations

import functools
import types
from dataclasses import dataclass, fields
from typing import Callable

import torch

from simplesharded.passes.bucketing import bucket_collectives
from simplesharded.passes.grads_in_place import write_grads_in_place
from simplesharded.passes.lowering import LOWERED_BACKENDS, lower_reduce_scatters
from simplesharded.passes.pipeline import PassPipeline, aot_backend, inductor_backend
from simplesharded.passes.plan_protocol import Plan
from simplesharded.passes.plans import AutoPlan, BlockPlan
from simplesharded.passes.recompute import tag_gathers_for_recompute
from simplesharded.passes.step_regather import regather_for_backward
from simplesharded.passes.torch_compat import eager_backend
from simplesharded.passes.reordering import reorder_for_overlap
from simplesharded.passes.replica_padding import pad_replica_all_reduces
from simplesharded.passes.update_inplace import reinplace_updates
from simplesharded.passes.upstream import upstream_overlap_bucketing
from simplesharded.passes.view_cat import elide_view_cats

COMPILERS = ("aot_eager", "inductor")  # the compilers that run our passes
# none: collectives as traced; block, auto: our bucketing + reordering with BlockPlan or
# AutoPlan; upstream: torch's own bucketing and overlap scheduling
BUCKETINGS = ("none", "block", "auto", "upstream")


@dataclass(frozen=True)
class BackendName:
    """A registry name, parsed: ``compiler`` (aot_eager | inductor | eager) and ``bucketing``
    (none | block | auto | upstream). ``str()`` gives the name back."""

    compiler: str
    bucketing: str = "none"

    def __post_init__(self):
        ok = (self.compiler == "eager" and self.bucketing == "none") or (
            self.compiler in COMPILERS and self.bucketing in BUCKETINGS)
        if not ok:
            raise ValueError(f"no backend has compiler={self.compiler!r} and "
                             f"bucketing={self.bucketing!r}")

    def __str__(self) -> str:
        return self.compiler if self.bucketing == "none" else \
            f"{self.compiler}_{self.bucketing}bucketing"

    @classmethod
    def parse(cls, name: "str | BackendName") -> "BackendName":
        """The record of registry name ``name``; a ValueError listing the names otherwise."""
        if isinstance(name, BackendName):
            return name
        try:
            return _BY_NAME[name]
        except KeyError:
            raise ValueError(f"compile.backend={name!r} is not one of {sorted(BACKENDS)}") \
                from None

    @property
    def ours(self) -> bool:
        """Whether our bucketing and reordering passes run (block or auto)."""
        return self.bucketing in ("block", "auto")

    def on(self, compiler: str) -> "BackendName":
        """The same bucketing under ``compiler``."""
        return BackendName(compiler, self.bucketing)


_BY_NAME: dict[str, BackendName] = {
    str(b): b for b in [BackendName("eager")]
    + [BackendName(c, k) for c in COMPILERS for k in BUCKETINGS]}
BACKENDS: tuple[str, ...] = tuple(_BY_NAME)  # every name make_backend builds itself


def is_torch_backend(name: str) -> bool:
    """A backend name torch itself registers: make_backend passes it through untouched."""
    return name in torch._dynamo.list_backends(exclude_tags=())


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
    # The dtype the model's matmuls run in (a torch.dtype or its name; under mixed precision
    # the gathered parameters' dtype): what "calibrated" times its matmuls in. None: torch's
    # default dtype (float32; TF32 on an accelerator where this process allows it,
    # simplesharded/calibration.py's matmul_kind). A profile or a file is taken as it is.
    compute_dtype: object = None
    # A ready plan (passes.Plan) instead of the one the backend builds from the options above
    # (give those to the plan itself).
    plan: Plan | None = None
    observer: Callable | None = None  # observer(kind, stage, gm) after every pass (tools/tests)
    # Parameter all-gathers sent as "int8" or "fp8" (float8 e4m3fn) blocks of quantize_block
    # elements with one fp32 scale each, dequantized after the wait; None: as traced
    # (passes/quantized_gather.py). Master weights, optimizer and gradients stay as they are.
    quantize_gathers: str | None = None
    # Gradient reduce-scatters sent as "int8" blocks of quantize_block elements with one fp32
    # scale each through an all-to-all, summed in fp32 by their owner, or run in "bf16";
    # None: as traced (passes/quantized_reduce.py).
    quantize_grads: str | None = None
    quantize_block: int = 256
    # Gathers that feed only a Float8Linear's weight cast (simplesharded/float8.py) send the
    # cast shard in float8 after one all-reduce (max) of the shards' amax; bitwise the same
    # float8 weight (passes/float8_gather.py). Runs only on graphs that hold such a cast.
    float8_gathers: bool = True
    # the options above that switch a quantizing pass on (the trainer's compile keys of the
    # same names, simplesharded/trainer/recipe.py)
    QUANTIZERS = ("quantize_gathers", "quantize_grads")

    def __post_init__(self):
        if not isinstance(self.float8_gathers, bool):
            raise ValueError(f"float8_gathers={self.float8_gathers!r} is not a bool")
        # imported only when asked: importing simplesharded loads no pass it does not run
        if (self.quantize_gathers is not None
                or self.quantize_block != BackendOptions.quantize_block):
            from simplesharded.passes.quantized_gather import check_choice

            check_choice(self.quantize_gathers, self.quantize_block)
        if self.quantize_grads is not None:
            from simplesharded.passes.quantized_reduce import check_choice as check_grads

            check_grads(self.quantize_grads, self.quantize_block)

    def quantized(self) -> list[str]:
        """The quantizing options set, by name: each needs a backend that runs our passes."""
        return [name for name in self.QUANTIZERS if getattr(self, name) is not None]


# Options a built-in plan is made of: with plan=..., they belong on that plan.
_PLAN_OPTIONS = ("reshard_after_forward", "memory_cap_bytes", "bucket_patterns")


def _hardware(opts: BackendOptions):
    from simplesharded.calibration import resolve_hardware  # measures only when asked

    return resolve_hardware(opts.hardware, dtype=opts.compute_dtype)


def backend_plan(backend: str | BackendName, opts: BackendOptions = BackendOptions()) -> Plan:
    """The plan every pass of ``backend`` reads: ``opts.plan``, else the built-in one (AutoPlan
    for autobucketing; BlockPlan for the others, whose recompute pass reads its cap and
    reshard setting)."""
    if opts.plan is not None:
        return opts.plan
    if BackendName.parse(backend).bucketing == "auto":
        return AutoPlan(_hardware(opts), opts.memory_cap_bytes,
                        reshard_after_forward=opts.reshard_after_forward)
    return BlockPlan(tuple(opts.bucket_patterns), opts.memory_cap_bytes,
                     reshard_after_forward=opts.reshard_after_forward)


def _update_passes(compiler: str) -> list:
    """How ``compiler`` wants a step graph's update written (PassPipeline.update)."""
    if compiler == "aot_eager":
        return [("update_inplace", reinplace_updates)]
    # imported here: its custom op is registered only by a process that compiles with inductor
    from simplesharded.passes.update_scalars import materialize_update_scalars

    return [("update_scalars", materialize_update_scalars)]


def pass_pipeline(backend: str | BackendName, opts: BackendOptions = BackendOptions(),
                  lower_on: tuple[str, ...] | None = LOWERED_BACKENDS) -> PassPipeline:
    """The passes ``backend`` runs, reading :func:`backend_plan`: the joint recompute pass,
    then the graph passes of its bucketing. ``lower_on``: the transports whose
    reduce-scatters are lowered (passes/lowering.py; None: every group's, for graphs traced
    on a fake process group that stand for gloo ones)."""
    backend = BackendName.parse(backend)
    if backend.compiler == "eager":
        raise ValueError("backend 'eager' compiles nothing: it has no passes")
    plan = backend_plan(backend, opts)
    graph: list = []
    quantize: list = []
    if opts.quantize_gathers is not None:
        from simplesharded.passes.quantized_gather import quantize_gathers

        # First: bucketing then merges the quantized payloads of a bucket into one gather,
        # and their scales into another.
        quantize = [("quantize", functools.partial(quantize_gathers,
                                                   choice=opts.quantize_gathers,
                                                   block=opts.quantize_block))]
    if backend.ours:
        # The padding first: the plan must see the same all-reduce sizes on every rank.
        graph = [("padding", pad_replica_all_reduces),
                 ("bucketing", functools.partial(bucket_collectives, plan=plan)),
                 ("reordering", functools.partial(reorder_for_overlap, plan=plan)),
                 ("lowering", functools.partial(lower_reduce_scatters, transports=lower_on)),
                ("view_cat", elide_view_cats)]
        if backend.compiler == "aot_eager":
            # after every pass that moves a gradient or its reduce-scatter: the writes reach
            # the buffer by graph order (inductor plans its own buffers)
            graph.append(("grads_in_place", write_grads_in_place))
    elif backend.bucketing == "upstream":
        graph = [("upstream", functools.partial(upstream_overlap_bucketing,
                                                hardware=_hardware(opts)))]
    if opts.quantize_grads is not None:
        from simplesharded.passes.quantized_reduce import quantize_reductions

        reduce = ("quantize_grads", functools.partial(quantize_reductions,
                                                      choice=opts.quantize_grads,
                                                      block=opts.quantize_block))
        if backend.ours:
            # After bucketing, which merges no all-to-all: a bucket's one reduce-scatter is
            # quantized once; after reordering, so the all-to-alls stand where it put the
            # reduce-scatter; before lowering, which then lowers a bf16 one on gloo.
            graph.insert([n for n, _ in graph].index("lowering"), reduce)
        else:  # no bucketing of ours (none; torch's own merges no all-to-all): per reduction
            quantize.append(reduce)
    graph = quantize + graph
    joint = [("recompute", functools.partial(tag_gathers_for_recompute, plan=plan))]
    # imported here, as the quantizing passes: `import simplesharded` loads no more modules
    from simplesharded.passes.step_recompute import recompute_checkpointed

    # Recompute first: regathering then serves the recomputed ops' reads of parameters too.
    step = [("recompute_ac", recompute_checkpointed),
            ("regather", functools.partial(regather_for_backward, plan=plan))]
    # Before the quantized gathers (which then leave the float8 bytes alone) and bucketing
    # (which merges a block's float8 gathers and their amax all-reduces).
    float8 = []
    if opts.float8_gathers:  # imported when a backend is built, not by `import simplesharded`
        from simplesharded.passes.float8_gather import float8_gathers

        float8 = [("float8", float8_gathers)]
    return PassPipeline(joint=joint, graph=graph, step=step, float8=float8,
                        update=_update_passes(backend.compiler),
                        dump_dir=opts.dump_graphs, observer=opts.observer)


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
    quantized = opts.quantized()
    needs = f"{' and '.join(quantized)} need{'s' if len(quantized) == 1 else ''}"
    if name not in _BY_NAME and is_torch_backend(name):
        if quantized:
            raise ValueError(f"{needs} one of our backends {list(BACKENDS)}: "
                             f"torch's {name!r} runs none of our passes")
        return name
    backend = BackendName.parse(name)
    if backend.compiler == "eager":
        if quantized:
            raise ValueError(f"{needs} a compiled backend: 'eager' runs no pass")
        return eager_backend()
    pipeline = pass_pipeline(backend, opts)
    return aot_backend(pipeline) if backend.compiler == "aot_eager" else inductor_backend(pipeline)


class _Named:
    """What ``torch.compile(model, backend="<name>")`` calls for one of our names: the
    backend ``make_backend(name)`` builds with its default options. Built at the process's
    first compile with it (after ``init_process_group``, as the calibrated hardware needs;
    every rank compiles the same graphs, so every rank builds it) and reused by the later
    ones. Options other than the defaults: ``make_backend``."""

    def __init__(self, name: str):
        self.name = name
        self._backend: Callable | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        if self._backend is None:
            self._backend = make_backend(self.name)
        return self._backend(gm, example_inputs)

    def __repr__(self) -> str:
        return f"simplesharded backend {self.name!r}"


# Our names that torch does not register itself, for torch.compile's backend strings: the
# entry points of the torch_dynamo_backends group in pyproject.toml point here, so dynamo
# finds them in an installed package without importing it first.
NAMED = types.SimpleNamespace(**{name: _Named(name) for name, b in _BY_NAME.items()
                                 if b.bucketing != "none"})
