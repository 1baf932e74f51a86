"""Step-graph pass: the optimizer update writes its state and parameters in place again.

aot_autograd functionalizes the traced update: ``exp_avg.lerp_(grad, w)`` becomes
``new = lerp(exp_avg, grad, w)`` and, at the graph's end, ``copy_(exp_avg, new)`` (the input
mutation the graph keeps). So every step allocates a fresh buffer for each parameter shard
and each state tensor and copies it back: three times the model's shard bytes per step, on
the compute thread (aot_eager runs the graph op by op). Inductor must not get it: it writes a
mutated input in place itself, fusing the update into the copy-back, and it lowers some ops
(``addcmul``) only in functional form (PassPipeline.update).
:func:`reinplace_updates` undoes it where that is safe: for each ``copy_(x, y)`` into a graph
input ``x`` whose value ``y`` is a chain of elementwise ops, the first reading ``x`` and each
next one the previous result (read by nothing else), it runs the chain's ops in place on
``x`` and drops the copy.

Invariant: every value the graph computes and every input's final contents are unchanged
(the in-place kernels compute what their functional forms do); a chain is rewritten only
when each op's result has ``x``'s shape, strides and dtype, and nothing reads ``x``, or a
view of it, after the chain's first op except the chain. Graphs without such copies are
unchanged; a second run changes nothing.
"""
from __future__ import annotations

import torch
from torch import fx

from .node_meta import alias_kind

aten = torch.ops.aten

# Functional op -> its in-place form (the same arguments, the first one written).
INPLACE = {
    aten.add.Tensor: aten.add_.Tensor, aten.add.Scalar: aten.add_.Scalar,
    aten.sub.Tensor: aten.sub_.Tensor, aten.mul.Tensor: aten.mul_.Tensor,
    aten.mul.Scalar: aten.mul_.Scalar, aten.div.Tensor: aten.div_.Tensor,
    aten.lerp.Scalar: aten.lerp_.Scalar, aten.lerp.Tensor: aten.lerp_.Tensor,
    aten.addcmul.default: aten.addcmul_.default, aten.addcdiv.default: aten.addcdiv_.default,
    aten.sqrt.default: aten.sqrt_.default,
}


def reinplace_updates(gm: fx.GraphModule) -> fx.GraphModule:
    graph = gm.graph
    pos = {n: i for i, n in enumerate(graph.nodes)}
    changed = False
    for copy in [n for n in graph.nodes if n.target is aten.copy_.default]:
        x, y = copy.args[0], copy.args[1]
        if x.op != "placeholder" or copy.users:
            continue
        chain = _chain(x, y, copy)
        if chain is None or not _only_chain_reads(x, chain, copy, pos):
            continue
        for op in chain:
            op.target = INPLACE[op.target]
        copy.replace_all_uses_with(chain[-1])
        graph.erase_node(copy)
        changed = True
    if changed:
        gm.recompile()
    return gm


def _chain(x: fx.Node, y: fx.Node, copy: fx.Node) -> list[fx.Node] | None:
    """The ops from ``x`` to ``y`` (first to last) if they form an in-place-able chain."""
    chain = []
    node = y
    while node is not x:
        if not (isinstance(node, fx.Node) and node.op == "call_function"
                and node.target in INPLACE and node.args and _same_layout(node, x)):
            return None
        # What the chain rewrites is read by the next link only (the last one: by anyone
        # after it, as it will read x then)
        if chain and set(node.users) != {chain[-1]}:
            return None
        chain.append(node)
        node = node.args[0]
    chain.reverse()
    if not chain or any(x in _operands(op) for op in chain):
        return None  # x read again as another operand: in place would read it mid-write
    return chain


def _operands(op: fx.Node) -> list[fx.Node]:
    """The nodes ``op`` reads besides its first argument."""
    out: list[fx.Node] = []
    fx.node.map_arg((op.args[1:], op.kwargs), out.append)
    return out


def _same_layout(node: fx.Node, x: fx.Node) -> bool:
    a, b = node.meta.get("val"), x.meta.get("val")
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype)


def _only_chain_reads(x: fx.Node, chain: list[fx.Node], copy: fx.Node, pos) -> bool:
    """Whether every reader of ``x`` (and of any view of it) other than the chain's first op
    and the copy runs before the chain's first op."""
    first = pos[chain[0]]
    todo = [u for u in x.users if u is not chain[0] and u is not copy]
    while todo:
        u = todo.pop()
        if pos[u] > first or u.op == "output":
            return False
        if alias_kind(u) is not None:  # a view (or an in-place op) still holds x
            todo.extend(u.users)
    return True
