"""Make inductor keep the order of collectives and matmuls that our passes produced.

Inductor's scheduler does not follow the FX order it lowers. It fuses kernels, placing a fused
kernel where its first part was and everything the kernel reads before it, and it picks the
lowest-peak of several topological orders (``reorder_for_peak_memory``). In torch 2.13 both
undid our schedule: the peak-memory pass moved prefetched all-gathers and early reduce-scatters
down to their waits and weight-gradient matmuls to the end of backward, and fusing the copy
into a reduce-scatter's buffer with pointwise work from after it issued the reduce-scatter
several matmuls late.

``pin_order(gm)`` chains the graph's *events*, in graph order: every collective start, every
``wait_tensor``, host offload's copies (issued ahead of their waits by offload_copies.py: a
lower-peak order would issue each next to its wait), the rank-agreement
check and every op with a FLOP formula (matmuls, convolutions, attention), each depending on
the one before it, through inductor's ``control_deps`` (the mechanism torch's own
overlap scheduler uses to pin its order). Then no event can move past another, and no kernel
can merge work that an event needs with work that needs the event (the kernel would have to run
both before and after it). Other ops stay free to fuse and move. It runs only inside
inductor (``inductor_backend``): the ``control_deps`` nodes are an inductor lowering detail, so
our pass pipeline and the aot_eager backends never see them.
"""
from __future__ import annotations

from torch import fx
from torch.utils.flop_counter import flop_registry

from .agreement import AGREE_OP
from .annotations import OFFLOAD_KEY, annotations
from .collectives import is_wait


def _is_start(node: fx.Node) -> bool:
    return (getattr(node.target, "namespace", None) == "_c10d_functional"
            and not is_wait(node))


def _is_event(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    packet = getattr(node.target, "overloadpacket", None)
    # the rank-agreement check (passes/agreement.py) must stay ahead of the first collective
    return (is_wait(node) or _is_start(node) or packet in flop_registry
            or node.target is AGREE_OP
            or annotations(node).get(OFFLOAD_KEY) in ("to_compute", "to_host"))


def _events(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes ``pin_order`` chains, in graph order."""
    return [n for n in gm.graph.nodes if _is_event(n)]


def pin_order(gm: fx.GraphModule) -> fx.GraphModule:
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    from torch.utils._ordered_set import OrderedSet

    chain = _events(gm)
    deps = {node: OrderedSet([prev]) for prev, node in zip(chain, chain[1:])
            if prev not in node.all_input_nodes}  # a data edge already orders them
    preserve_node_ordering(gm.graph, deps)
    gm.recompile()
    return gm
