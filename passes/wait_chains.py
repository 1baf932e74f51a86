"""What travels with a collective's start or wait when the reorderer moves it.

* ``input_ops``: the pure ops that only build a start's input (a shard's cast, a host
  offload copy), which move with the start.

* ``gather_chain``: an all-gather's wait and the copy-out/view nodes computed from it alone
  (the per-parameter copies a bucket makes, and their reshapes into parameter form).
* ``reduction_epilogue``: a chain plus the pure ops computed from it alone whose results only
  the graph's output or compute outside them reads (the 1/N averaging of a reduced gradient,
  and under host offload its copy to the host, whose wait is placed afterwards).
* ``offload_copy``: the host offload copy a start's input is built from, and its wait (they
  move with the start when it is hoisted, and offload_copies.py moves the copy further).
* ``chain_uses`` / ``first_use``: the nodes outside a chain that read it, and the first of
  them: where the chain goes.

Invariant: every node of a chain reads only the wait and other nodes of the chain, so the
chain, moved as one in its own order to anywhere after the collective's start and before its
first use, keeps every definition before its uses. Nothing here edits the graph.
"""
from __future__ import annotations

from torch import fx

from .annotations import OFFLOAD_KEY, annotations
from .collectives import is_collective_or_wait, is_wait, started_by
from .graph_utils import NodeOrder

# Ops that only reshape/copy a gathered buffer into parameter form: they travel with the wait.
_CHAIN_OPS = {"view", "_unsafe_view", "slice", "clone", "alias", "reshape", "t", "permute",
              "transpose", "expand", "as_strided", "contiguous", "getitem"}


def _op_name(node: fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", None)
    if name is None:
        name = str(target)
    return name.split(".")[0]


def gather_chain(wait: fx.Node, order: NodeOrder) -> list[fx.Node]:
    """The wait plus the copy-out/view nodes that only depend on it, in graph order."""
    chain, frontier = [wait], [wait]
    members = {wait}
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if (user.op == "call_function" and _op_name(user) in _CHAIN_OPS
                    and user not in members
                    and all(a in members for a in user.all_input_nodes)):
                members.add(user)
                chain.append(user)
                frontier.append(user)
    return sorted(chain, key=order.__getitem__)


def reduction_epilogue(chain: list[fx.Node], order: NodeOrder) -> list[fx.Node]:
    """``chain`` plus the pure ops computed from it alone whose results only the graph's
    output or compute outside them reads (the 1/N averaging of a reduced gradient, read by
    the output, or by the optimizer's update in a step graph): they sink with the wait, or
    the first of them would pin the wait right after its start. One that feeds a collective
    (HSDP's replica all-reduce) stays where it is. Graph order."""
    members, candidates, frontier = set(chain), [], list(chain)  # computed from the chain alone
    while frontier:
        for user in frontier.pop().users:
            if (user.op == "call_function" and user not in members
                    and not is_collective_or_wait(user) and not user.is_impure()
                    and all(a in members for a in user.all_input_nodes)):
                members.add(user)
                candidates.append(user)
                frontier.append(user)
    kept, pending = set(chain), set(candidates)
    for node in sorted(candidates, key=order.__getitem__, reverse=True):
        if all(u in kept or u.op == "output" or _placed_later(u)
               or (u not in pending and not is_collective_or_wait(u)) for u in node.users):
            kept.add(node)
    return sorted(kept, key=order.__getitem__)


def chain_uses(chain: list[fx.Node]) -> list[fx.Node]:
    """Nodes outside the chain that read it (but a wait placed after the chain has moved,
    :func:`_placed_later`)."""
    members = set(chain)
    return [u for n in chain for u in n.users if u not in members and not _placed_later(u)]


def _placed_later(node: fx.Node) -> bool:
    """The wait of host offload's copy of a reduced gradient to the host (the gradient is what
    it reads): offload_copies.py places it once the reductions, and the gradient with them,
    have moved, so it pins neither."""
    return is_wait(node) and annotations(node).get(OFFLOAD_KEY) == "to_host"


def first_use(chain: list[fx.Node], order: NodeOrder) -> fx.Node | None:
    return min(chain_uses(chain), key=order.__getitem__, default=None)


def input_ops(start: fx.Node) -> list[fx.Node]:
    """The ops that only build ``start``'s input: call_functions, not collectives or waits,
    each read by ``start`` or by another of them alone (unordered)."""
    found, members = [], {start}
    frontier = list(start.all_input_nodes)
    while frontier:
        node = frontier.pop()
        if (node.op == "call_function" and len(node.users) == 1
                and next(iter(node.users)) in members and not is_collective_or_wait(node)):
            found.append(node)
            members.add(node)
            frontier.extend(node.all_input_nodes)
    return found


def offload_copy(start: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(copy, wait) of the host offload copy ``start``'s input is built from (annotated
    ``ss_offload="to_compute"``, simplesharded/storage/offload.py: the copy of a bucket's host
    shard on the compute device and the ``wait_tensor`` that makes it ready), if any."""
    for node in (start, *input_ops(start)):
        for wait in node.all_input_nodes:
            if is_wait(wait):
                copy = started_by(wait)
                if annotations(copy).get(OFFLOAD_KEY) == "to_compute":
                    return copy, wait
    return None
