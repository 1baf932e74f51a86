"""Compute time of an FX node: FLOPs from torch.utils.flop_counter's formulas, and a roofline
``node_time`` = max(FLOPs / flops_per_s, bytes touched / mem_bw) with one sustained rate each.

Collectives and waits cost 0 here: they run on a communication stream, costed by
comm_cost.py. Shapes come from the node's metadata (node_meta.py), so no tensor is ever run.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import fx
from torch.fx.passes.shape_prop import TensorMetadata
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from .collectives import is_collective, is_wait
from .node_meta import alias_kind, concrete_int, has_value, node_bytes, node_value
from .view_cat import adjacent_run

if TYPE_CHECKING:
    from .hardware import Hardware

aten = torch.ops.aten


# CPU (and other) attention kernels torch's flop_registry does not list; same math as the
# flash variants, whose formulas read only (grad_out,) query, key, value shapes.
_EXTRA_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu:
        flop_registry[aten._scaled_dot_product_flash_attention],
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        flop_registry[aten._scaled_dot_product_flash_attention_backward],
}


def _formula(packet):
    """The FLOP formula of an op, or None. Read live: ops outside torch (e.g. the MoE's
    simplesharded::expert_mm, models/expert_mm.py) register theirs when their module is
    imported."""
    return _EXTRA_FLOPS.get(packet) or flop_registry.get(packet)

# Allocate without touching memory: cost no time.
_NO_TRAFFIC = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default}


def _meta_arg(a):
    if not isinstance(a, fx.Node):
        return a
    v = a.meta.get("val")
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return concrete_int(v) if isinstance(v, torch.SymInt) else v.node.hint
    return node_value(a)


@functools.lru_cache(maxsize=None)
def _decomposes(op: torch._ops.OpOverload) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def node_flops(node: fx.Node) -> int:
    """FLOPs of one node (matmuls, convolutions, attention), from torch.utils.flop_counter's
    formulas on the node's metadata shapes. Ops torch has no formula for count 0, except
    CompositeImplicit ops (e.g. aten.linear, aten.matmul in pre-dispatch graphs), which are run
    on meta tensors under FlopCounterMode. Never raises."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or not (
            _formula(t.overloadpacket) is not None or _decomposes(t)):
        return 0
    try:
        key = cost_key(node)
        if key in _FLOPS_SEEN:
            return _FLOPS_SEEN[key]
        args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), _meta_arg)
        formula = _formula(t.overloadpacket)
        if formula is not None:
            flops = int(formula(*args, **kwargs, out_val=node_value(node)))
        else:
            with FlopCounterMode(display=False) as counter:
                t(*args, **kwargs)
            flops = int(counter.get_total_flops())
        if key is not None:
            if len(_FLOPS_SEEN) >= 4096:
                _FLOPS_SEEN.clear()
            _FLOPS_SEEN[key] = flops
        return flops
    except Exception:
        return 0


# FLOPs by cost_key: making the meta arguments and running the formula (or the op itself,
# under FlopCounterMode: ~1 ms) costs far more than the key, and a deep model repeats each
# such node once per block.
_FLOPS_SEEN: dict = {}


def node_time(node: fx.Node, hw: Hardware) -> float:
    """Roofline seconds of a compute node: max(FLOPs / flops_per_s, bytes read+written / mem_bw).
    0 for placeholders, output, views/getitem, collectives and waits (comm_cost.py), and a
    cat that view_cat.py turns into a view."""
    if node.op != "call_function" or is_collective(node) or is_wait(node):
        return 0.0
    if node.target in _NO_TRAFFIC or alias_kind(node) == "view":
        return 0.0
    if node.target is aten.cat.default and adjacent_run(node) is not None:
        return 0.0  # a view once view_cat.py has run
    if not has_value(node):
        return 0.0  # no tensor output (sym_size, scalar arithmetic, ...)
    moved = node_bytes(node) + sum(node_bytes(a) for a in node.all_input_nodes)
    return max(node_flops(node) / hw.flops_per_s, moved / hw.mem_bw_Bps)


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def cost_key(node: fx.Node):
    """Everything node_time(node, hw) reads, as a hashable key (None when some argument
    cannot be one): its op, its arguments with each input node replaced by what its metadata
    says (concrete shape, strides, dtype), and its own. Nodes with equal keys cost the same
    (node_flops caches FLOPs by this key)."""
    if node.op != "call_function" or is_collective(node) or is_wait(node):
        return None  # node_time answers 0 at once
    index = {n: i for i, n in enumerate(node.all_input_nodes)}  # which inputs are the same
    plain = True

    def leaf(a):
        nonlocal plain
        if isinstance(a, fx.Node):
            return (index[a], _value_key(a))
        if isinstance(a, _SYMBOLIC):
            plain = False  # handed to the FLOP formula as is
        return a

    key = (node.target, fx.node.map_aggregate((node.args, node.kwargs), leaf), _value_key(node))
    if not plain:
        return None
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _value_key(node: fx.Node):
    """What node_value, node_bytes and the FLOP formulas read of a node's metadata."""
    v = node.meta["val"] if "val" in node.meta else node.meta.get("tensor_meta")
    return _meta_key(v)


def _meta_key(v):
    if isinstance(v, (torch.Tensor, TensorMetadata)):
        stride = v.stride() if isinstance(v, torch.Tensor) else v.stride
        return (tuple(concrete_int(x) for x in v.shape), tuple(concrete_int(x) for x in stride),
                v.dtype)
    if isinstance(v, (tuple, list)):
        return tuple(_meta_key(x) for x in v)
    if isinstance(v, torch.SymInt):
        return ("sym", concrete_int(v))
    if isinstance(v, (torch.SymFloat, torch.SymBool)):
        return ("sym", v.node.hint)
    return None
