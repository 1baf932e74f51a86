"""Step-graph pass: reshard after forward by gathering parameters again for the traced backward.

In a joint graph the recompute pass (recompute.py) tags each parameter's gather chain, and
torch's partitioner gathers it again in backward. A step graph (``compile_step``) is no joint
graph: dynamo traced ``torch.autograd.grad`` into it, and its backward reads the forward's
gathered parameters (and the views a matmul saves of them) directly, so without this pass
every full parameter would stay alive from its forward use to its backward use: the whole
model gathered at the end of the forward.

This pass decides as the recompute pass does (the same annotations,
``plan.reshard_after_forward`` and :func:`~.recompute.kept_gathered`'s budget). For each
parameter that reshards, it copies the chain from the shard to what backward reads right
before the first backward node that reads it, and backward reads the copy: the forward's
gathered tensor dies after its last forward use. The copies are marked as traced backward and
annotated ``ss_regather``, so bucketing merges them with each other, never with the forward's
gathers (bucketing.py groups by it), and reordering prefetches them as it does a backward
graph's.

Invariant: every value is unchanged (a gather of the same shard gives the same bits); the
copies depend only on the graph and the plan, so every rank makes the same ones; afterwards
no traced-backward node reads a forward node of a resharding parameter's gather or a view of
it. A graph without traced backward is unchanged; a second run changes nothing.
"""
from __future__ import annotations

import copy

from torch import fx

from .annotations import REGATHER_KEY, RESHARD_KEY, annotations
from .plan_protocol import Plan
from .recompute import gathered_nodes, kept_gathered
from .traced_backward import mark_traced_backward, traced_backward_nodes


def regather_for_backward(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    backward = traced_backward_nodes(gm)
    if not backward:
        return gm
    graph = gm.graph
    chains = _gather_chains(graph, backward)
    kept = kept_gathered(graph, backward, plan.keep_gathered_bytes, plan.memory_cap_bytes)
    override = plan.reshard_after_forward
    pos = {n: i for i, n in enumerate(graph.nodes)}
    changed = False
    for fqn, chain in chains.items():
        reshard = annotations(chain[0]).get(RESHARD_KEY, True) if override is None else override
        if reshard == "auto":
            reshard = fqn not in kept
        if not reshard:
            continue
        members = set(chain)
        read = [n for n in chain if any(u in backward for u in n.users)]
        if not read:
            continue
        needed: set[fx.Node] = set()
        todo = list(read)
        while todo:  # what the read nodes are computed from, inside the chain
            n = todo.pop()
            if n not in needed:
                needed.add(n)
                todo.extend(i for i in n.all_input_nodes if i in members)
        first = min((u for n in read for u in n.users if u in backward), key=pos.__getitem__)
        copies: dict[fx.Node, fx.Node] = {}
        with graph.inserting_before(first):
            for n in sorted(needed, key=pos.__getitem__):
                c = graph.node_copy(n, lambda x: copies.get(x, x))
                c.meta = {**n.meta, "custom": {**copy.deepcopy(annotations(n)),
                                               REGATHER_KEY: True}}
                mark_traced_backward(c)
                copies[n] = c
        for n in read:
            for u in [u for u in n.users if u in backward]:
                u.replace_input_with(n, copies[n])
        changed = True
    if changed:
        gm.recompile()
    return gm


def _gather_chains(graph: fx.Graph, backward: set[fx.Node]) -> dict[str, list[fx.Node]]:
    """{fqn: the forward nodes, in graph order, of its gather and the views of them}."""
    chains: dict[str, list[fx.Node]] = {}
    for node, (fqn, _) in gathered_nodes(graph, backward).items():
        if not annotations(node).get(REGATHER_KEY):  # a gather this pass made (bucketed)
            chains.setdefault(fqn, []).append(node)
    return chains
