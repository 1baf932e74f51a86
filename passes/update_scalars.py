"""Step-graph pass for inductor: the 0-d values an optimizer update computes (its bias
corrections, its step size) become buffers of their own, computed once per step.

Inductor inlines a pointwise value into every kernel that reads it, and reads a 0-d one inside
the kernel's loop: Adam's ``1 - beta1 ** step``, ``1 - beta2 ** step`` and its square root,
in float64, were recomputed for every vector of a parameter's elements (two ``std::pow`` and a
``sqrt`` per 8 floats on CPU; the C++ compiler cannot hoist them out of the loop, as the
kernel's stores might alias the step count it loads). The custom op :func:`materialized` is
opaque to inductor: its result is a buffer, and the elementwise kernel loads one number.

Invariant: every value is unchanged (the op returns a copy of its input, computed by the same
ops in the same dtype); each 0-d node of an update that a node of more than one element reads
is read through one such copy, inserted right after it; a second run changes nothing.
"""
from __future__ import annotations

import torch
from torch import fx

from .annotations import UPDATE_KEY, annotations
from .graph_utils import call, fake_mode_of


@torch.library.custom_op("simplesharded::materialized", mutates_args=())
def materialized(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` that a compiler cannot inline into its readers."""
    return x.clone()


@materialized.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


MATERIALIZED_OP = torch.ops.simplesharded.materialized.default


def materialize_update_scalars(gm: fx.GraphModule) -> fx.GraphModule:
    graph = gm.graph
    todo = [n for n in graph.nodes
            if n.op == "call_function" and n.target is not MATERIALIZED_OP
            and UPDATE_KEY in annotations(n) and _dims(n) == 0
            and any(_numel(u) > 1 for u in n.users)]
    if not todo:
        return gm
    fake_mode = fake_mode_of(graph, todo)
    for node in todo:
        readers = list(node.users)
        with graph.inserting_after(node):
            copy = call(graph, MATERIALIZED_OP, (node,), fake_mode=fake_mode,
                        custom=annotations(node))
        for u in readers:
            u.replace_input_with(node, copy)
    gm.recompile()
    return gm


def _val(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _numel(node) -> int:
    v = _val(node)
    return 0 if v is None else v.numel()


def _dims(node) -> int:
    v = _val(node)
    return -1 if v is None else v.dim()
