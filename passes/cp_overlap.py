"""Overlap context parallelism's collectives with the compute of their layer.

Context parallelism's K/V all-gather and the reduce-scatter of its gradient (annotated
``ss_cp``, models/context_parallel.py) are the one kind of collective that is not ours the
reorderer moves, and it moves them first (reordering.py). Tracing waits on a functional
collective at once, and the model projects and rotates the queries before the keys, so as
traced nothing hides the transfer. Each is issued before the compute of its layer that does
not need it (from the previous one's wait on: compute is never moved across that) and waited
right before its first use: the query projection and rotation and the causal mask run while
the keys travel, and in backward the queries' gradients while the keys' gradients are reduced.

Invariant: only pure compute moves, and only later (collectives, waits, impure and random ops
and what they read stay), so no other collective is issued later than traced; a moved node
feeds no node that stays, so every use still follows its definition; what the other steps of
the reorderer place with their collective (copy-outs, views, a reduction's averaging) stays
where it is, so a second run finds the graph as the first left it.
"""
from __future__ import annotations

from torch import fx

from .annotations import CP_KEY, annotations
from .collectives import Collective, is_collective_or_wait
from .graph_utils import NodeOrder, draws_random
from .node_meta import alias_kind
from .wait_chains import first_use, gather_chain, reduction_epilogue


def overlap_cp_collectives(collectives: list[Collective], order: NodeOrder) -> None:
    """Context parallelism's collectives (``ss_cp``): each issued before the compute that does
    not need it, and waited right before its first use (module doc)."""
    cp = [c for c in collectives if c.wait is not None and CP_KEY in annotations(c.start)]
    if not cp:
        return
    # What the other steps place with their collective: each wait's copy-outs and views, and
    # the pure ops only its result feeds (a reduction's averaging). They stay, so those steps
    # find them where they left them (idempotence) and no gathered buffer lives longer.
    held = {n for c in collectives if c.wait is not None
            for n in reduction_epilogue(gather_chain(c.wait, order), order)}
    floor = None  # the previous one's wait: compute is never moved across it
    for c in sorted(cp, key=lambda c: order[c.start]):
        _issue_before_independent_compute(c.start, floor, order, held)
        chain = _views_of_result(c.wait, order)
        use = first_use(chain, order)
        if use is not None:
            for node in chain:  # in graph order, so the chain keeps its own
                order.move_before(node, use)
        floor = c.wait


def _views_of_result(wait: fx.Node, order: NodeOrder) -> list[fx.Node]:
    """The wait and the views computed from it alone (the split of K/V into keys and values,
    whatever view ops the model used), in graph order."""
    chain, frontier = {wait}, [wait]
    while frontier:
        for user in frontier.pop().users:
            if (user not in chain and alias_kind(user) == "view"
                    and all(a in chain for a in user.all_input_nodes)):
                chain.add(user)
                frontier.append(user)
    return sorted(chain, key=order.__getitem__)


def _issue_before_independent_compute(start: fx.Node, floor: fx.Node | None,
                                      order: NodeOrder, held: set[fx.Node]) -> None:
    """Move the pure compute between ``floor`` (exclusive; None: the graph's start) and
    ``start`` that ``start`` does not read, directly or not, to right after ``start``, in its
    order. What stays: ``start``'s inputs, collectives and waits, ``held``, impure and random
    ops, and all they read. A moved node feeds no node that stays (that one would then read
    it), so every use still follows its definition."""
    window, node = [], (floor.next if floor is not None else next(iter(start.graph.nodes)))
    while node is not start:
        window.append(node)
        node = node.next
    stays = {start}
    for node in reversed(window):  # a reader comes after what it reads
        if (node.op != "call_function" or is_collective_or_wait(node) or node in held
                or node.is_impure() or draws_random(node) or any(u in stays for u in node.users)):
            stays.add(node)
    anchor = start
    for node in window:
        if node not in stays:
            order.move_after(node, anchor)
            anchor = node


