"""Compose graph passes and plug them into torch's compilers.

The only file that touches aot_autograd's compiler hooks, inductor's custom-pass config and
fx's lazily compiled graph module (docs/torch_internals.md).
Two adapters run the same passes:
  * ``aot_backend``: aot_autograd with our partition_fn (joint passes, then torch's min-cut
    partitioner) and fw/bw compilers that run the graph passes, then execute the FX graph
    (its code generated once, after the last pass: ``lazily_compiled``).
  * ``inductor_backend``: ``compile_fx`` inside a ``torch._inductor.config.patch`` that installs
    our joint pre-pass and post-grad pass; the patch is owned by the call, so nothing leaks
    into other compiles. When the pipeline has graph passes, their output order is pinned for
    inductor's scheduler (pin_order.py) and torch's own collective scheduling stays off.
"""
from __future__ import annotations

import hashlib
import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from torch import fx

from .agreement import insert_agreement_check
from .annotations import NOTES_KEY, has_float8_casts
from .cross_step import explain_cross_step_prefetch
from .collectives import count_collectives, is_backward_graph
from .traced_backward import annotate_traced_backward, traced_backward_nodes
from .update_placement import has_updates, place_updates

# Returns the graph module ready to run: a pass that edits the graph regenerates its code.
GraphPass = Callable[[fx.GraphModule], fx.GraphModule]

# torch's own collective bucketing and overlap scheduling (all off by default): set globally,
# they would run after our post-grad pass and redo its buckets and order, so a compile with
# our graph passes scopes them off. (What inductor does on by default, fusion and
# reorder_for_peak_memory, is handled by pin_order.py.)
TORCH_COLLECTIVE_SCHEDULING_OFF = {
    "aten_distributed_optimizations.enable_overlap_scheduling": False,
    "bucket_all_gathers_fx": "none",
    "bucket_reduce_scatters_fx": "none",
    "bucket_all_reduces_fx": "none",
    "reorder_for_compute_comm_overlap": False,
}


LAST_STAGE = "agreement"  # every graph's last pass: what an observer sees there is final


@dataclass
class PassPipeline:
    """Joint-graph passes (before partitioning) and per-graph passes (forward and backward).

    ``dump_dir``: when set, every graph is written there before and after each pass, named
    ``<seq>_<fw|bw|joint>_<stage>.txt`` with the collective counts on the first line.
    """

    joint: Sequence[tuple[str, GraphPass]] = ()
    graph: Sequence[tuple[str, GraphPass]] = ()
    # Run first on a step graph (a forward graph with a traced backward, compile_step): what
    # the joint passes do for a graph aot_autograd partitions.
    step: Sequence[tuple[str, GraphPass]] = ()
    # Run last on a graph with an optimizer update (compile_step), once it is placed: how
    # the compiler wants the update written (update_inplace.py for aot_eager, which runs op
    # by op; update_scalars.py for inductor, which writes mutated inputs in place itself and
    # lowers some ops, such as addcmul, only in functional form).
    update: Sequence[tuple[str, GraphPass]] = ()
    # Run first among the graph passes, only on graphs that hold a Float8Linear's annotated
    # weight cast (float8_gather.py: the gathers that feed one send float8; before bucketing).
    float8: Sequence[tuple[str, GraphPass]] = ()
    dump_dir: str | None = None
    observer: Callable[[str, str, fx.GraphModule], None] | None = None  # (kind, stage, gm)
    _seq: itertools.count = field(default_factory=itertools.count, repr=False)

    def run_joint(self, gm: fx.GraphModule) -> fx.GraphModule:
        # Inductor runs this on a step graph too, before its own joint passes drop the views
        # whose annotation a traced backward's reductions are found by: annotated here, the
        # reductions keep it into the post-grad graph.
        annotate_traced_backward(gm)
        return self._run(gm, self.joint, "joint")

    def run_graph(self, gm: fx.GraphModule) -> fx.GraphModule:
        # Last: the ranks compare the sequence the passes produced (passes/agreement.py).
        passes = list(self.graph) + [(LAST_STAGE, insert_agreement_check)]
        if self.float8 and has_float8_casts(gm):
            passes = list(self.float8) + passes
        backward = is_backward_graph(gm)
        if not backward:
            # A backward traced into a forward graph (compile_step) gets the annotations
            # the passes find collectives by; a graph without one is unchanged.
            annotate_traced_backward(gm)
            if self.graph and has_updates(gm):
                # After the graph passes, before the agreement check: a step graph's updates
                # go next to their reductions once these are placed, and run in place last
                # (whether an input is read after its update depends on the final order).
                end = len(passes) - 1
                passes[end:end] = [
                    ("update_placement", place_updates),
                    ("cross_step", explain_cross_step_prefetch), *self.update]
            if traced_backward_nodes(gm):
                passes = list(self.step) + passes
        return self._run(gm, passes, "bw" if backward else "fw")

    def _run(self, gm, passes, kind):
        self._dump(gm, kind, "input")
        for name, p in passes:
            gm = p(gm)
            gm.graph.lint()  # the one check of each pass's output: the passes do not repeat it
            self._dump(gm, kind, name)
        return gm

    def _dump(self, gm, kind, stage):
        if self.observer is not None:
            self.observer(kind, stage, gm)
        if not self.dump_dir:
            return
        os.makedirs(self.dump_dir, exist_ok=True)
        path = Path(self.dump_dir) / f"{next(self._seq):03d}_{kind}_{stage}.txt"
        notes = "".join(f"# note: {line}\n" for line in gm.meta.get(NOTES_KEY, ()))
        path.write_text(f"# collectives: {count_collectives(gm)}\n" + notes
                        + gm.print_readable(print_output=False, include_stride=False))

    def uuid(self) -> str:
        """Cache key for inductor: changes with the pass list, options and our source files."""
        h = hashlib.sha256()
        for name, p in list(self.joint) + list(self.float8) + list(self.graph):
            h.update(name.encode())
            h.update(repr(getattr(p, "keywords", "")).encode())
        src = Path(__file__).parent
        for f in sorted(src.glob("*.py")):
            h.update(f.read_bytes())
        return h.hexdigest()


def lazily_compiled(gm: fx.GraphModule, graph: fx.Graph | None = None) -> fx.GraphModule:
    """``gm``'s graph, attributes and meta in the graph module kind dynamo itself makes, whose
    ``recompile`` only marks the code stale: every pass that edits the graph recompiles, and a
    plain GraphModule would generate the code of the whole graph each time (~2 CPU s per pass
    on Llama 3 70B's backward graph; aot_autograd hands the backward over as a plain one).
    :func:`generate_code` then generates it once, after the last pass. ``graph``: one to use
    instead of ``gm``'s own (a copy to edit, ``gm`` staying as it is).

    This and generate_code are the one place that touches fx's lazy module
    (docs/torch_internals.md)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    if graph is None and isinstance(gm, _LazyGraphModule):
        return gm
    lazy = _LazyGraphModule(gm, gm.graph if graph is None else graph)
    lazy.meta = gm.meta
    return lazy


def generate_code(gm: fx.GraphModule) -> None:
    """Generate the Python code of a :func:`lazily_compiled` module now, if it is stale."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    _LazyGraphModule.force_recompile(gm)


def aot_backend(pipeline: PassPipeline):
    """A torch.compile backend: aot_autograd + our passes + run the FX graph as is."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def partition(joint, joint_inputs, **kwargs):
        joint = pipeline.run_joint(joint)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def compiler(gm, example_inputs):
        gm = pipeline.run_graph(lazily_compiled(gm))
        generate_code(gm)  # once, now: the compile pays it, not the first step
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler, partition_fn=partition,
                        keep_inference_input_mutations=True)


def inductor_backend(pipeline: PassPipeline):
    """A torch.compile backend: inductor with our joint pre-pass and post-grad pass. With graph
    passes, inductor runs their collectives and matmuls in the order they left them
    (pin_order.py); without (plain ``inductor``) it schedules as torch's own backend does."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from .pin_order import pin_order

    class _Joint(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            pipeline.run_joint(graph.owning_module)

        def uuid(self):
            return "ss-joint-" + pipeline.uuid()

    class _PostGrad(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            pipeline.run_graph(graph.owning_module)
            if pipeline.graph:
                pin_order(graph.owning_module)

        def uuid(self):
            return "ss-postgrad-" + pipeline.uuid()

    patches = {"joint_custom_pre_pass": _Joint(), "post_grad_custom_post_pass": _PostGrad(),
               **(TORCH_COLLECTIVE_SCHEDULING_OFF if pipeline.graph else {})}

    def backend(gm: fx.GraphModule, example_inputs):
        with inductor_config.patch(patches):
            return compile_fx(gm, example_inputs, config_patches=patches)

    return backend
