"""Step-graph pass: activation checkpointing in a step graph, by recomputing the checkpointed
blocks' forward ops for the traced backward.

Under compile, activation checkpointing annotates each checkpointed block's forward ops with
``ss_ac`` (simplesharded/trainer/recipe.py), and for a joint graph recompute.py tags them for
torch's partitioner, which recomputes them in the backward graph. A step graph
(``compile_step``) is no joint graph: dynamo traced ``torch.autograd.grad`` into it, and its
backward reads the forward's activations directly, so each block's activations would stay
alive from its forward to its backward: the annotation alone saves nothing.

This pass does what the partitioner does with those tags. Within one checkpointed block, an
op is recomputed unless it is saved; saved are, as recompute.py decides for a joint graph:
the block's boundary (an op read by a forward op outside its block, or by the graph's
output), collectives (expert parallelism's all-to-alls, TP's and CP's: running one again
would run it with every rank), the routing decisions (``ss_routing``), ops that draw random
numbers (their outputs are kept, as selective checkpointing keeps attention's) and ops that
write an input. The gathers of parameters (``ss_param``) and the forward's views of them are
left to step_regather.py, which runs next and gathers them again for whatever backward reads
them, these recomputations included.

For each forward op of a block that the traced backward reads, the pass copies the ops it is
computed from inside the block, down to what is saved, right before the first backward node
that reads it (a copy already made for an earlier reader is shared), and backward reads the
copy; the forward's activation dies after its last forward use. The copies are marked as
traced backward and keep their annotations (``ss_ac`` included: a traced backward's own ops
carry none, so a backward op annotated ``ss_ac`` without ``ss_regather`` is a recomputation).

Invariant: every value is unchanged (the same ops on the same inputs give the same bits); the
copies depend only on the graph, so every rank makes the same ones; afterwards no
traced-backward node reads a recomputable op of a checkpointed block. A graph without traced
backward or without ``ss_ac`` is unchanged; a second run changes nothing.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from .annotations import AC_KEY, PARAM_KEY, ROUTING_KEY, annotations
from .collectives import is_collective_or_wait
from .graph_utils import draws_random
from .recompute import gathered_nodes
from .traced_backward import mark_traced_backward, traced_backward_nodes


def recompute_checkpointed(gm: fx.GraphModule) -> fx.GraphModule:
    """Recompute, for the traced backward of step graph ``gm``, the forward ops of the
    checkpointed blocks it reads (module doc), in place; return ``gm``. Values unchanged;
    idempotent."""
    backward = traced_backward_nodes(gm)
    if not backward:
        return gm
    graph = gm.graph
    region = _recomputable(graph, backward)
    if not region:
        return gm
    pos = {n: i for i, n in enumerate(graph.nodes)}
    # (first backward reader, the forward op it reads), in the readers' order
    reads = sorted(((u, n) for n in region for u in n.users if u in backward),
                   key=lambda r: (pos[r[0]], pos[r[1]]))
    if not reads:
        return gm
    copies: dict[fx.Node, fx.Node] = {}
    for reader, node in reads:
        if node not in copies:
            needed: set[fx.Node] = set()
            todo = [node]
            while todo:  # what ``node`` is computed from inside its block, not yet copied
                n = todo.pop()
                if n not in needed and n not in copies:
                    needed.add(n)
                    todo.extend(i for i in n.all_input_nodes if i in region)
            with graph.inserting_before(reader):
                for n in sorted(needed, key=pos.__getitem__):
                    c = graph.node_copy(n, lambda x: copies.get(x, x))
                    c.meta = dict(n.meta)
                    mark_traced_backward(c)
                    copies[n] = c
        reader.replace_input_with(node, copies[node])
    gm.recompile()
    return gm


def _recomputable(graph: fx.Graph, backward: set[fx.Node]) -> set[fx.Node]:
    """The forward ops of checkpointed blocks that are recomputed (module doc): each with its
    block's ``ss_ac`` index, less what is saved."""
    gathered = gathered_nodes(graph, backward)
    block: dict[fx.Node, int] = {}
    for n in graph.nodes:
        custom = annotations(n)
        if n.op != "call_function" or n in backward or AC_KEY not in custom:
            continue
        if (n in gathered or PARAM_KEY in custom or ROUTING_KEY in custom
                or is_collective_or_wait(n) or _seeded(n) or _writes_input(n)):
            continue
        block[n] = custom[AC_KEY]
    # The boundary: read by a forward node of no block or of another one, or by the output.
    saved = {n for n in block for u in n.users if u not in backward and (
        u.op != "call_function" or annotations(u).get(AC_KEY) != block[n])}
    return set(block) - saved


def _seeded(node: fx.Node) -> bool:
    """An op that may draw random numbers (CPU attention's dropout path, dropout), or one of
    its outputs: recomputing it would draw other numbers. Kept, as recompute.py keeps it."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return draws_random(node)


def _writes_input(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable
