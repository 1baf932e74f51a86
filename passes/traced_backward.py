"""Annotations for the backward that dynamo traces into a forward graph (``torch.autograd.grad``
under ``torch._dynamo.config.trace_autograd_ops``, as simplesharded/step.py uses it).

Our passes find the data-parallel collectives by the annotation ``data_parallel`` writes on
the forward's nodes (``node.meta["custom"]``). For a joint graph aot_autograd copies it onto
the backward's nodes (matching each to the forward op whose autograd node made it, by
``seq_nr``); a traced ``autograd.grad`` ends up in aot_autograd's inference graph, where that
copy does not run, so its reduce-scatters carry no annotation and no pass would bucket,
reorder or lower them. :func:`annotate_traced_backward` does the same copy there. It reads
two of torch's node-meta keys (``seq_nr``, ``autograd_backward``), the one place that does.
"""
from __future__ import annotations

import copy

from torch import fx


def annotate_traced_backward(gm: fx.GraphModule) -> fx.GraphModule:
    """Give every traced-backward node (``autograd_backward`` meta) that has no annotation
    the ``custom`` annotation of the first forward node with its ``seq_nr``, as aot_autograd
    does for joint graphs. A graph without such nodes (every forward and backward graph
    aot_autograd partitions) is unchanged; a second run changes nothing."""
    forward: dict[int, fx.Node] = {}
    backward: list[fx.Node] = []
    for node in gm.graph.nodes:
        seq_nr = node.meta.get("seq_nr")
        if seq_nr is None:
            continue
        if node.meta.get("autograd_backward"):
            backward.append(node)
        else:
            forward.setdefault(seq_nr, node)
    for node in backward:
        fwd = forward.get(node.meta["seq_nr"])
        custom = fwd.meta.get("custom") if fwd is not None else None
        if custom and not node.meta.get("custom"):
            node.meta["custom"] = copy.deepcopy(custom)
    return gm


def traced_backward_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """A step graph's traced backward: the nodes a traced ``autograd.grad`` made, and every
    node computed from one (a gradient's collectives carry no mark of their own, and the
    update reads the gradients). Empty unless that includes a gradient reduction: a forward
    graph aot_autograd partitioned can hold a few backward ops the partitioner moved into it
    (the transposes of the weights it saves), which are no traced backward."""
    from .collectives import ALL_REDUCE, REDUCE_SCATTER

    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.meta.get("autograd_backward") or any(i in out for i in n.all_input_nodes):
            out.add(n)
    if not any(n.target in (REDUCE_SCATTER, ALL_REDUCE) for n in out):
        return set()
    return out


def mark_traced_backward(node: fx.Node) -> None:
    """Mark a node a pass adds to a step graph's backward as such."""
    node.meta["autograd_backward"] = True
