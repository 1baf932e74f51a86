"""Find the collectives of an FX graph: start node, its wait, size, group and what it serves.

This file is the one place that knows the op names of torch's functional collectives
(``torch.ops._c10d_functional``); every other pass asks it.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from .annotations import (BLOCK_KEY, BUCKET_PARAMS_KEY, DP_GROUPS_KEY, LOWERED_KEY, PARAM_KEY,
                          RAGGED_KEY, annotations)

_c10d = torch.ops._c10d_functional
ALL_GATHER = _c10d.all_gather_into_tensor.default
# One gather per input, one output each, read through getitem: recognised and costed where a
# graph holds one; no pass of ours emits it (gloo's coalesced gather can corrupt the heap,
# docs/torch_internals.md).
ALL_GATHER_COALESCED = _c10d.all_gather_into_tensor_coalesced.default
REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
ALL_REDUCE = _c10d.all_reduce.default
WAIT = _c10d.wait_tensor.default
# An all-to-all is one of ours only when a pass of ours emitted it to implement another kind
# (passes/lowering.py); its node then carries the LOWERED_KEY annotation = kind. Any other
# (expert parallelism's token dispatch, models/ep_dispatch.py) is found and costed, never moved.
ALL_TO_ALL = _c10d.all_to_all_single.default
KINDS = {ALL_GATHER: "all_gather", REDUCE_SCATTER: "reduce_scatter", ALL_REDUCE: "all_reduce",
         ALL_TO_ALL: "all_to_all",
         # Forms that write into a given buffer (torch's own bucketing emits them); counted
         # and costed, but our passes only rewrite the three plain forms above.
         _c10d.all_gather_into_tensor_out.default: "all_gather",
         ALL_GATHER_COALESCED: "all_gather",
         _c10d.reduce_scatter_tensor_out.default: "reduce_scatter"}
PLAIN = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)


@dataclass
class Collective:
    """One functional collective: ``start`` issues it, ``wait`` makes its result usable."""

    kind: str
    start: fx.Node
    wait: fx.Node | None
    nbytes: int
    group_name: str
    group_size: int
    dtype: torch.dtype | None
    params: list[str] = field(default_factory=list)
    block: str | None = None  # the block of its (first) parameter (BLOCK_KEY), None outside

    @property
    def ours(self) -> bool:
        """A data-parallel collective of a parameter: the only kind our passes rewrite/move."""
        return bool(self.params)

    @property
    def prebucketed(self) -> bool:
        """A ragged bucket's gather or reduce-scatter (RAGGED_KEY): already one bucket, which
        no plan merges with another (plans.py)."""
        return bool(annotations(self.start).get(RAGGED_KEY))

    @property
    def module(self) -> str:
        """FQN of the module owning the (first) parameter served, "" if unknown."""
        return self.params[0].rpartition(".")[0] if self.params else ""


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in KINDS


def _lowered_kind(node: fx.Node) -> str | None:
    if node.target is not ALL_TO_ALL:
        return None
    return annotations(node).get(LOWERED_KEY)


def kind_of(node: fx.Node) -> str:
    """"all_gather", "reduce_scatter", "all_reduce" or "all_to_all" (one that implements
    none of the others) for a node where is_collective holds."""
    return _lowered_kind(node) or KINDS[node.target]


def process_group_backend(group_name: str) -> str:
    """"gloo", "nccl", "fake", ... for a live process group; "" if it cannot be resolved."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return str(dist.get_backend(_resolve_process_group(group_name)))
    except Exception:
        return ""


def collectives_on(graph: fx.Graph, target, transports: tuple[str, ...] | None
                   ) -> list["Collective"]:
    """Our waited collectives of op ``target`` whose process group's backend is one of
    ``transports`` (None: any), in graph order: what a transport-specific lowering rewrites."""
    backends: dict[str, str] = {}  # resolving a group is not free: once per group
    out = []
    for c in find_collectives(graph):
        if c.start.target is not target or c.wait is None or not c.ours:
            continue
        if transports is not None:
            if c.group_name not in backends:
                backends[c.group_name] = process_group_backend(c.group_name)
            if backends[c.group_name] not in transports:
                continue
        out.append(c)
    return out


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is WAIT


def is_collective_or_wait(node: fx.Node) -> bool:
    return is_collective(node) or is_wait(node)


def group_label(group_name: str) -> str:
    """The mesh dim a process group was made for ("dp_shard", "tp", ...), from the
    description DeviceMesh gives its groups; the group name when there is none."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        desc = _resolve_process_group(group_name).group_desc
    except Exception:
        return group_name
    if desc == "default_pg":  # a 1-D mesh over every rank reuses the default group
        return "world"
    return desc[len("mesh_"):] if desc.startswith("mesh_") else group_name


def group_ranks(group_name: str) -> tuple[tuple[int, ...], int] | None:
    """(global ranks of a live process group, world size), or None when it cannot be
    resolved (no process group, e.g. a hand-built graph in a test)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        ranks = dist.get_process_group_ranks(_resolve_process_group(group_name))
        return tuple(sorted(ranks)), dist.get_world_size()
    except Exception:
        return None


def node_params(node: fx.Node) -> list[str]:
    """Parameter FQNs a node serves, from the annotations sharding/bucketing put on it."""
    custom = annotations(node)
    if BUCKET_PARAMS_KEY in custom:
        return list(custom[BUCKET_PARAMS_KEY])
    return [custom[PARAM_KEY]] if PARAM_KEY in custom else []


def node_block(node: fx.Node) -> str | None:
    """The block (BLOCK_KEY annotation) of the parameter a node serves; None outside blocks."""
    return annotations(node).get(BLOCK_KEY)


def tensor_nbytes(node: fx.Node) -> int:
    """Bytes of a node's tensor value, or of all tensors of a list value (coalesced ops). A
    data-dependent size (an expert-parallel all-to-all's) counts its optimisation hint."""
    from .torch_compat import optimization_hint

    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return sum(optimization_hint(v.numel()) * v.element_size() for v in vals
               if isinstance(v, torch.Tensor))


def group_args(node: fx.Node) -> tuple[int, str]:
    """(group size, group name) of a collective node, whatever its op's argument order."""
    if node.target is ALL_TO_ALL:  # all_to_all_single(input, out_splits, in_splits, name)
        return len(node.args[1]), str(node.args[3])
    kind = KINDS[node.target]
    if kind == "all_gather":
        return int(node.args[1]), str(node.args[2])
    if kind == "reduce_scatter":
        return int(node.args[2]), str(node.args[3])
    return _group_size(str(node.args[2])), str(node.args[2])  # all_reduce(input, op, name)


def _group_size(name: str) -> int:
    """Size of a live process group by name (0 if it cannot be resolved, e.g. in a test)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(name).size()
    except Exception:
        return 0


def wait_of(node: fx.Node) -> fx.Node | None:
    """The wait of a collective; for a coalesced one (outputs read through getitem, one wait
    each) the first in graph order, which is where the whole transfer must have ended."""
    waits = [u for u in node.users if is_wait(u)]
    if node.target is ALL_GATHER_COALESCED:
        waits = [w for g in node.users for w in g.users if is_wait(w)]
        order = {n: i for i, n in enumerate(node.graph.nodes)} if len(waits) > 1 else {}
        return min(waits, key=order.__getitem__) if waits else None
    assert len(waits) <= 1, f"{node} has {len(waits)} waits"
    return waits[0] if waits else None


def started_by(wait: fx.Node) -> fx.Node:
    """The collective node a wait waits for (through the getitem of a coalesced one)."""
    src = wait.args[0]
    if src.op == "call_function" and src.target is operator.getitem:
        return src.args[0]
    return src


def find_collectives(graph: fx.Graph | fx.GraphModule) -> list[Collective]:
    """Every collective in graph order, with the bytes it produces (the gathered buffer for an
    all-gather, the local shard for a reduce-scatter)."""
    graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
    found = []
    for node in graph.nodes:
        if not is_collective(node) or not node.args:  # no args: detached (merge_buckets)
            continue
        size, name = group_args(node)
        val = node.meta.get("val")
        nbytes = tensor_nbytes(node)
        if _lowered_kind(node) == "reduce_scatter" and size:  # its shard's bytes
            nbytes //= size
        if isinstance(val, (list, tuple)):  # coalesced: its outputs share one dtype here
            val = val[0] if val else None
        source = node if node_params(node) else param_source(node)
        params = node_params(source) if source is not None else []
        dp_groups = annotations(source).get(DP_GROUPS_KEY) if params else None
        if dp_groups is not None and name not in dp_groups:
            params = []  # e.g. TP's all-reduce of a replicated weight's gradient
        found.append(Collective(
            kind=kind_of(node), start=node, wait=wait_of(node), nbytes=nbytes,
            group_name=name, group_size=size,
            dtype=val.dtype if isinstance(val, torch.Tensor) else None, params=params,
            block=node_block(source) if params else None))
    return found


def param_source(node: fx.Node, depth: int = 4) -> fx.Node | None:
    """The annotated node an unannotated collective reduces, up its view/cast chain (nodes
    with one input, never through another collective).

    DTensor issues a replicate gradient's all-reduce outside the annotated region (when the
    Partial gradient meets the Replicate parameter), so the node itself carries no
    ``ss_param``, but the gradient it reduces does; in a backward dynamo traced, every
    reduction is found this way (traced_backward.py)."""
    for _ in range(depth):
        inputs = node.all_input_nodes
        if len(inputs) != 1:
            return None
        node = inputs[0]
        if is_collective(node):
            return None
        if node_params(node):
            return node
    return None


def count_collectives(graph: fx.Graph | fx.GraphModule) -> dict[str, int]:
    """{"all_gather": n, "reduce_scatter": n, "all_reduce": n, "all_to_all": n} for one
    graph."""
    counts = {kind: 0 for kind in KINDS.values()}
    for c in find_collectives(graph):
        counts[c.kind] += 1
    return counts


def count_by_group(graph: fx.Graph | fx.GraphModule, labels: dict[str, str] | None = None
                   ) -> dict[tuple[str, str], int]:
    """{(group label, kind): n} for one graph: the mesh dim of each collective's group (see
    :func:`group_label`; "dp_shard", "dp_replicate", "tp") and its kind. ``labels``: known
    {group name: label} (simplesharded.mesh.group_labels), tried first."""
    counts: dict[tuple[str, str], int] = {}
    labels = dict(labels or {})
    for c in find_collectives(graph):
        if c.group_name not in labels:
            labels[c.group_name] = group_label(c.group_name)
        key = (labels[c.group_name], c.kind)
        counts[key] = counts.get(key, 0) + 1
    return counts


def is_backward_graph(graph: fx.Graph | fx.GraphModule) -> bool:
    """aot_autograd names backward inputs ``tangents_*``; forward graphs have none."""
    graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
    return any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)


def tangent_dependent(graph: fx.Graph) -> set[fx.Node]:
    """Nodes of a joint graph that depend on a tangent input, i.e. the backward part."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name.startswith("tangents"):
                out.add(node)
        elif any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out
