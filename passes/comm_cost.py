"""Communication time of a collective: alpha-beta, ``comm_time`` = alpha + ring-algorithm bytes /
bus bandwidth, on the link the group's ranks use (``group_link``: intra-node NVLink-class or
inter-node NIC). The schedule simulator (simulate.py) puts each link on its own lane.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from .collectives import Collective, group_ranks

if TYPE_CHECKING:
    from .hardware import Hardware


# Bytes each rank sends (= receives) in a ring algorithm, as a multiple of `nbytes`, where nbytes
# is the gathered output of an all-gather, the full input of a reduce-scatter, the tensor of an
# all-reduce; of an all-to-all (every rank to every other directly), what it receives: all
# but its own part, (n-1)/n of it when the parts are even (the balanced routing the cost
# model assumes for expert parallelism's data-dependent splits).
RING_FACTOR = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
               "all_reduce": lambda n: 2 * (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}


INTRA_NODE, INTER_NODE = "intra-node", "inter-node"  # the links of a Hardware


@functools.lru_cache(maxsize=256)
def intra_node(ranks: tuple[int, ...], world_size: int, gpus_per_node: int) -> bool:
    """Whether a process group with these global ranks, and every group of its family, has
    all its ranks within one node (nodes: ``gpus_per_node`` consecutive ranks).

    Decided for the family, not for the group alone, so that every rank decides the same:
    each rank sees only its own group, and all ranks must pick the same buckets without
    talking to each other. A DeviceMesh dim's groups are arithmetic progressions of one size
    n and stride s that tile the world (the mesh is ``arange(world)`` in row-major order);
    the family is every such progression. A group that is not one (a user-made group) is
    taken to span nodes, which no rank can contradict.
    """
    n = len(ranks)
    if n <= 1:
        return True
    stride = ranks[1] - ranks[0]
    if stride <= 0 or any(b - a != stride for a, b in zip(ranks, ranks[1:])) or \
            world_size % (n * stride) or ranks[0] >= world_size:
        return False
    bases = (b for b in range(world_size) if (b // stride) % n == 0)
    return all(b // gpus_per_node == (b + (n - 1) * stride) // gpus_per_node for b in bases)


def group_link(group_name: str, hw: Hardware) -> str:
    """INTRA_NODE when ``hw`` has an intra-node link and the group's family lies within nodes
    (:func:`intra_node`; with tp innermost, tp groups do when tp divides gpus_per_node), else
    INTER_NODE, also for a group that cannot be resolved (no live process group)."""
    if not hw.intra_node_bandwidth_Bps:
        return INTER_NODE
    found = group_ranks(group_name)
    if found is None:
        return INTER_NODE
    ranks, world = found
    return INTRA_NODE if intra_node(ranks, world, hw.gpus_per_node) else INTER_NODE


def comm_time(kind: str, nbytes: int, group_size: int, hw: Hardware,
              link: str = INTER_NODE) -> float:
    """Seconds for one collective on ``link``: alpha + ring bytes / bandwidth; 0 for a group
    of one."""
    if kind not in RING_FACTOR:
        raise ValueError(f"kind={kind!r} is not one of {sorted(RING_FACTOR)}")
    if link not in (INTRA_NODE, INTER_NODE):
        raise ValueError(f"link={link!r} is not one of {[INTRA_NODE, INTER_NODE]}")
    if group_size <= 1:
        return 0.0
    alpha, bandwidth = ((hw.intra_node_alpha_s, hw.intra_node_bandwidth_Bps)
                        if link == INTRA_NODE and hw.intra_node_bandwidth_Bps
                        else (hw.alpha_s, hw.bandwidth_Bps))
    return alpha + RING_FACTOR[kind](group_size) * nbytes / bandwidth


def collective_time(c: Collective, hw: Hardware, group_size: int | None = None,
                    link: str | None = None) -> float:
    """comm_time of a found Collective (its nbytes is the produced buffer: the shard for a
    reduce-scatter, so the full input is nbytes * group size) on its group's link (``link``
    overrides :func:`group_link`). all_reduce nodes do not carry their group size; pass it."""
    n = group_size if group_size is not None else c.group_size
    nbytes = c.nbytes * n if c.kind == "reduce_scatter" else c.nbytes
    return comm_time(c.kind, nbytes, n, hw, link or group_link(c.group_name, hw))
