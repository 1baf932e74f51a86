"""Ranks agree on each compiled graph's collective sequence before its first collective runs.

Every rank compiles its own graphs, and every pass of ours must make the same decisions on
every rank (docs/rank_agreement.md says why they do). If they ever do not, the collectives no
longer match: gloo dies with "Received data size doesn't match", NCCL hangs. This pass is the
guard. It writes at the head of a graph one ``simplesharded::agree`` node carrying the
graph's fingerprint: per collective, in graph order, its op, the mesh dim of its process group
(group names differ between the groups of one mesh dim; the dim does not), its tensors'
dtypes and shapes and its other arguments. The node is compiled into the graph, so a graph
read back from a compile cache keeps it. At run time the node does its work once per
fingerprint and process group: it publishes the fingerprint in the process group's store and
waits for every rank's, then either returns or raises, on every rank, an error naming each
rank's first differing collective. A rank that never arrives (it compiled a different number of
graphs) is named after ``SIMPLESHARDED_AGREE_TIMEOUT_S`` seconds (default 600, NCCL's own
watchdog default), never a silent hang.

The store, not a collective, carries the check: a store wait has a timeout and cannot be
mismatched by the very collectives it is checking.

Which ranks must agree: every rank, unless :func:`set_agreement_peers` names fewer. Under
pipeline parallelism the stages are different models, so only the ranks holding the same
stages (one pp coordinate: simplesharded/pipeline/pipelining.py sets them) compile the same graphs.
"""
from __future__ import annotations

import datetime
import json
import os
import weakref

import torch
from torch import fx

from .collectives import group_label, group_ranks

TIMEOUT_ENV = "SIMPLESHARDED_AGREE_TIMEOUT_S"
_NAMESPACE = "_c10d_functional"
_KEY_PREFIX = "simplesharded/agree"


def fingerprint(graph: fx.Graph) -> list[list]:
    """Per collective start (every ``_c10d_functional`` op but ``wait_tensor``), in graph
    order: ``[skeleton, line, ranks]``. ``skeleton`` (op, dtypes, mesh dim) must be the same on
    every rank; ``line`` adds shapes and arguments, which must match among the members of the
    group (``ranks``, its global ranks): the groups of one mesh dim may legitimately move
    different sizes (uneven shards all-reduced over dp_replicate)."""
    out = []
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace != _NAMESPACE or target._opname == "wait_tensor":
            continue
        names = [a.name for a in target._schema.arguments]
        args = [_describe(a, name) for a, name in zip(node.args, names)]
        group = node.args[names.index("group_name")] if "group_name" in names else None
        found = group_ranks(group) if group is not None else None
        dtypes = sorted({str(v.dtype) for v in _tensor_vals(node.args)})
        skeleton = f"{target._opname}({', '.join(dtypes)}, {_describe(group, 'group_name')})"
        out.append([skeleton, f"{target._opname}({', '.join(args)})",
                    list(found[0]) if found else []])
    return out


def _tensor_vals(args):
    for a in args:
        if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
            yield a.meta["val"]
        elif isinstance(a, (list, tuple)):
            yield from _tensor_vals(a)


def _describe(a, name: str) -> str:
    if name == "group_name":
        label = group_label(a) if a is not None else "?"
        if label == a:  # not a mesh dim: the name is per group, its size is shared
            found = group_ranks(a)
            label = f"{len(found[0])} ranks" if found else "?"
        return f"group={label}"
    if isinstance(a, fx.Node):
        v = a.meta.get("val")
        return f"{v.dtype}{list(v.shape)}" if isinstance(v, torch.Tensor) else "?"
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_describe(x, name) for x in a) + "]"
    return repr(a)


def insert_agreement_check(gm: fx.GraphModule) -> fx.GraphModule:
    """Put one ``simplesharded::agree(fingerprint)`` node first in a graph that has collectives;
    return ``gm`` (edited in place). Invariants: nothing else changes; a graph without
    collectives is untouched; idempotent (an existing check is replaced by a fresh one, since
    the passes before it may have changed the sequence)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is AGREE_OP:
            graph.erase_node(node)
    lines = fingerprint(graph)
    if not lines:
        return gm
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        graph.call_function(AGREE_OP, (json.dumps(lines),))
    gm.recompile()
    return gm


_PEERS: list = [None]  # the ranks this process's graphs are compared with; None: every rank


def set_agreement_peers(ranks) -> None:
    """Compare this process's graphs with those of ``ranks`` (global ranks, this one
    included) only; None: with every rank. Every rank of a group of peers must name the same
    ranks, before its first compiled graph runs."""
    _PEERS[0] = None if ranks is None else tuple(sorted(int(r) for r in ranks))


class _Checks:
    """Run-time state of the check on one default process group: the fingerprints its ranks
    have agreed on, and how many checks this rank has made (the n-th check on every rank
    compares with the n-th)."""

    def __init__(self):
        self.agreed: set[str] = set()
        self.count = 0


# Kept per default process group, whose store carries the checks: a group made again starts
# over with a fresh store. Not per pipeline or backend: the op in a compiled graph (which may
# come from a compile cache) carries only its fingerprint, and what the ranks share is the
# order in which they run their graphs' checks, one sequence per process and group.
_CHECKS: "weakref.WeakKeyDictionary[object, _Checks]" = weakref.WeakKeyDictionary()


@torch.library.custom_op("simplesharded::agree", mutates_args=())
def agree(fingerprint: str) -> None:
    """Compare this graph's collective sequence with every rank's, once per process group."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    checks = _CHECKS.setdefault(dist.group.WORLD, _Checks())
    if fingerprint in checks.agreed:
        return
    peers = _PEERS[0]
    if (len(peers) if peers is not None else dist.get_world_size()) > 1 and \
            str(dist.get_backend()) != "fake":
        checks.count += 1
        if peers is None:
            compare(fingerprint, checks.count)
        else:
            compare(fingerprint, checks.count, peers=peers)
    checks.agreed.add(fingerprint)


@agree.register_fake
def _(fingerprint: str) -> None:
    return None


AGREE_OP = torch.ops.simplesharded.agree.default
fx.node.has_side_effect(AGREE_OP)  # no outputs: dead-code elimination must keep it


def compare(fingerprint: str, seq: int, timeout_s: float | None = None,
            peers: tuple[int, ...] | None = None) -> None:
    """Publish ``fingerprint`` as check ``seq`` of this rank, wait for every rank's (every
    one of ``peers``, when given), raise the same error on every rank if they differ."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    ranks = list(peers) if peers is not None else list(range(dist.get_world_size()))
    rank = ranks.index(dist.get_rank())  # errors below name positions among the peers
    if timeout_s is None:
        timeout_s = float(os.environ.get(TIMEOUT_ENV, "600"))
    store = _get_default_store()
    prefix = _KEY_PREFIX if peers is None else f"{_KEY_PREFIX}/peers-{'-'.join(map(str, ranks))}"
    keys = [f"{prefix}/{seq}/{r}" for r in ranks]
    store.set(keys[rank], fingerprint)
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception:  # the store says only "timeout"; find who is missing
        missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        raise RuntimeError(
            f"simplesharded: rank {ranks[rank]} compiled graph #{seq} with collectives, but "
            f"rank(s) {missing} did not reach graph #{seq} within {timeout_s:.0f} s ({TIMEOUT_ENV}): "
            f"the ranks compiled different graphs, which would hang their collectives"
        ) from None
    sequences = [json.loads(store.get(k).decode()) for k in keys]
    mismatch = first_difference(sequences)
    if mismatch is not None:
        # Rank 0 hosts the store: if it raised and exited while a peer was still reading,
        # the peer would see "Connection reset by peer" instead of this message.
        store.set(f"{keys[rank]}/read", "1")
        try:
            store.wait([f"{k}/read" for k in keys], datetime.timedelta(seconds=30))
        except Exception:  # a peer that is gone cannot read any more: raise anyway
            pass
        raise RuntimeError(mismatch)


def first_difference(sequences: list[list[list]]) -> str | None:
    """None when the ranks' sequences agree, else one message naming the first differing
    collective of each rank that differs: from rank 0 in order and kind (``skeleton``), or
    from the first member of its group in shapes and arguments (``line``)."""
    ref = sequences[0]
    parts = []
    for r, seq in enumerate(sequences[1:], start=1):
        a, b = [e[0] for e in ref], [e[0] for e in seq]
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            parts.append(f"collective #{i}: rank 0 {_entry(ref, i)}, rank {r} {_entry(seq, i)} "
                         f"({len(a)} vs {len(b)} collectives)")
    if not parts:  # same kinds everywhere: members of each group must move the same tensors
        for i in range(len(ref)):
            first: dict[tuple, int] = {}
            for r, seq in enumerate(sequences):
                members = tuple(seq[i][2])
                q = first.setdefault(members, r)
                if seq[i][1] != sequences[q][i][1]:
                    parts.append(f"collective #{i}: rank {q} {_entry(sequences[q], i)}, "
                                 f"rank {r} {_entry(seq, i)}")
            if parts:
                break
    if not parts:
        return None
    return ("simplesharded: ranks compiled different collective sequences (their plans "
            "differ, e.g. different backend options per rank); first difference: "
            + "; ".join(parts))


def _entry(seq: list[list], i: int, limit: int = 200) -> str:
    if i >= len(seq):
        return "<end of graph>"
    line = seq[i][1]
    return line if len(line) <= limit else line[:limit - 5] + " ...)"
