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
``x`` and drops the copy. An input that holds several parameters (a ragged bucket, whose
members compile_step updates one run at a time: simplesharded/step/__init__.py) is functionalized
into a chain of ``slice_scatter``s, each writing one slice with a value computed elementwise
from that slice alone, and then copied back: each link's ops then run in place on the slice
of ``x`` and the scatters and the copy go.

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
        if y.target is aten.slice_scatter.default:
            changed |= _reinplace_slices(graph, x, y, copy, pos)
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


def _reinplace_slices(graph: fx.Graph, x: fx.Node, y: fx.Node, copy: fx.Node, pos) -> bool:
    """``copy_(x, y)`` where ``y`` is a chain of ``slice_scatter``s down to ``x``, each
    scattering into a slice a value its link computes elementwise from a read of that same
    slice of the previous scatter (through views): every link then runs in place on the
    slice of ``x``. Nothing changes unless every scatter is such a link, each scatter is read
    only by the next links' reads and scatter (the last: by the copy only), and every other
    reader of ``x`` runs before the first link."""
    scatters = []
    node = y
    while node is not x:
        if not (isinstance(node, fx.Node) and node.target is aten.slice_scatter.default):
            return False
        scatters.append(node)
        node = node.args[0]
    scatters.reverse()
    links = [_link(ss) for ss in scatters]
    if any(link is None for link in links):
        return False
    reads = {link[0] for link in links}
    for ss, nxt in zip(scatters, scatters[1:] + [copy]):
        if not set(ss.users) <= reads | {nxt}:
            return False
    if set(scatters[-1].users) != {copy}:
        return False
    ops = [op for link in links for op in link[2]]
    first = min(pos[op] for op in ops)
    todo = [u for u in x.users if u not in reads and u is not scatters[0] and u is not copy]
    while todo:
        u = todo.pop()
        if pos[u] > first or u.op == "output":
            return False
        if alias_kind(u) is not None:
            todo.extend(u.users)
    for read, _, chain in links:
        read.replace_input_with(read.args[0], x)
        for op in chain:
            op.target = INPLACE[op.target]
    copy.replace_all_uses_with(x)
    graph.erase_node(copy)
    for ss, (_, src_views, _) in zip(reversed(scatters), reversed(links)):
        graph.erase_node(ss)
        for v in src_views:  # the scatter's source and the views it was made by, in turn
            graph.erase_node(v)
    return True


def _link(ss: fx.Node):
    """(read, source views, ops) of one scatter: ``ss = slice_scatter(base, src, dim, a, b)``
    with ``src`` views of the last op of an in-place-able chain whose first op reads views of
    ``slice(base, dim, a, b)``, the one read of them; None when ``ss`` is not such a link."""
    base, src, *rest = ss.args
    region = tuple(rest) + (0, None, None, 1)[len(rest):]
    if region[3] != 1:
        return None
    src_views = []
    node = src
    while node.target in _FLAT_VIEWS and len(node.users) == 1:
        src_views.append(node)
        node = node.args[0]
    chain = []
    while (isinstance(node, fx.Node) and node.op == "call_function" and node.target in INPLACE
           and (not chain or set(node.users) == {chain[-1]})):
        chain.append(node)
        node = node.args[0]
    if not chain or len(chain[0].users) != 1:  # the last op: read by the scatter's views only
        return None
    chain.reverse()
    target = node  # what the chain's first op writes: views of the slice it reads
    if len(target.users) != 1 or any(not _same_layout(op, target) for op in chain):
        return None
    while target.target in _FLAT_VIEWS:
        if len(target.users) != 1:
            return None
        target = target.args[0]
    read = target
    if not (read.target is aten.slice.Tensor and read.args[0] is base and len(read.users) == 1
            and tuple(read.args[1:]) + (0, None, None, 1)[len(read.args) - 1:] == region):
        return None
    if any(base in _operands(op) or read in _operands(op) for op in chain):
        return None
    return read, src_views, chain


# Views that only reshape a contiguous tensor: what sits between a slice and its update.
_FLAT_VIEWS = (aten.view.default, aten._unsafe_view.default)
