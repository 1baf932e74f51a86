"""Annotations for the backward that dynamo traces into a forward graph (``torch.autograd.grad``
under ``torch._dynamo.config.trace_autograd_ops``, as simplesharded/step/__init__.py uses it).

Our passes find the data-parallel collectives by the annotation ``data_parallel`` writes on
the forward's nodes (``node.meta["custom"]``). For a joint graph aot_autograd copies it onto
the backward's nodes; a traced ``autograd.grad`` ends up in aot_autograd's inference graph,
where that copy does not run, so its reductions carry no annotation and no pass would bucket,
reorder or lower them. Matching a backward node to a forward one by torch's ``seq_nr`` is no
help here: in such a graph it lands on a neighbouring parameter's node as soon as the forward
holds one autograd function more or less. The annotation reaches the backward another way:
the gradient of a gathered parameter enters its reduction through an op of simplesharded's
own autograd function (simplesharded/storage/gather.py), which dynamo traces with the annotation
that was active in forward. :func:`annotate_traced_backward` gives each reduction the
annotation of that op, found up the reduction's input. It reads one of torch's node-meta keys
(``autograd_backward``), the one place that does. Under inductor it runs on the graph its
joint passes get (passes/pipeline.py), before they drop no-op views such as a 1-D gradient's
``view(-1)``, which can be the op that carries the annotation.

Context parallelism's K/V all-gather (``ss_cp``, models/context_parallel.py) has a
reduce-scatter over cp as its backward, traced without the annotation too. It reduces an
activation's gradient, no parameter's, so no parameter annotation is found for it and the
data-parallel passes leave it where it was traced; but cp_overlap.py finds CP's collectives
by ``ss_cp``, as a joint graph's copy gives it to that reduce-scatter. So a traced backward's
reduce-scatter without a parameter, on a group that a forward all-gather annotated ``ss_cp``
runs on, gets that all-gather's ``ss_cp``: the backward of such a gather is the only
reduce-scatter a model issues on the cp group (a parameter's gradient is reduced over the dp
and cp ranks together, another group).
"""
from __future__ import annotations

import copy

from torch import fx

from .annotations import CP_KEY, annotations
from .collectives import (ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, group_args, is_collective,
                          node_params, param_source, wait_of)


def annotate_traced_backward(gm: fx.GraphModule) -> fx.GraphModule:
    """Give every collective of a traced backward (``autograd_backward`` meta) that has no
    parameter annotation, and its wait, the annotation of the first annotated node up its
    input chain (through nodes with one input, not through another collective's start: a
    hybrid all-reduce after a reduce-scatter finds the reduce-scatter's wait, annotated just
    before). A collective with none stays as it is: not ours (TP's, CP's). A graph without a
    traced backward (every graph aot_autograd partitions) is unchanged; a second run changes
    nothing. A reduce-scatter with none on a group a forward ``ss_cp`` all-gather runs on
    gets that ``ss_cp`` (module doc)."""
    cp_groups = {group_args(n)[1]: annotations(n)[CP_KEY] for n in gm.graph.nodes
                 if n.target is ALL_GATHER and CP_KEY in annotations(n)
                 and not n.meta.get("autograd_backward")}
    for node in gm.graph.nodes:
        if not (node.meta.get("autograd_backward") and is_collective(node)):
            continue
        if node_params(node) or CP_KEY in annotations(node):
            continue
        source = param_source(node)
        if source is not None:
            custom = annotations(source)
        elif node.target is REDUCE_SCATTER and group_args(node)[1] in cp_groups:
            custom = {CP_KEY: cp_groups[group_args(node)[1]]}
        else:
            continue
        for n in (node, wait_of(node)):
            if n is not None:
                n.meta["custom"] = copy.deepcopy(custom)
    return gm


def traced_backward_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """A step graph's traced backward: the nodes a traced ``autograd.grad`` made, and every
    node computed from one (a gradient's collectives carry no mark of their own, and the
    update reads the gradients). Empty unless that includes a gradient reduction: a forward
    graph aot_autograd partitioned can hold a few backward ops the partitioner moved into it
    (the transposes of the weights it saves), which are no traced backward."""
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
