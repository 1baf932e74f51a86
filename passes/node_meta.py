"""What a node's metadata says about its output: concrete shapes, bytes, and whether it aliases
an input (a view or an in-place op moves no data and allocates nothing).

Reads ``meta["val"]`` (FakeTensors or tensors, as aot_autograd and inductor leave them) or
``meta["tensor_meta"]`` (ShapeProp), so it works on CPU and on fake-process-group dry runs; the
compute cost (compute_cost.py) and the memory model (memory.py) both stand on it.
"""
from __future__ import annotations

import functools
import math
import operator

import torch
from torch import fx
from .torch_compat import optimization_hint
from torch.fx.passes.shape_prop import TensorMetadata

from .collectives import WAIT

aten = torch.ops.aten


UNBACKED_FALLBACK = 4096  # size assumed for a data-dependent (unbacked) symbolic dimension


def concrete_int(x) -> int:
    if isinstance(x, torch.SymInt):
        try:
            return int(optimization_hint(x, fallback=UNBACKED_FALLBACK))
        except Exception:
            return UNBACKED_FALLBACK
    return int(x)


def node_value(node: fx.Node):
    """A node's output as meta tensor(s) with concrete sizes: Tensor, list for tuple/list
    outputs (recursively), or None. Reads meta["val"] (aot/inductor) or meta["tensor_meta"]."""
    return _as_meta(node.meta["val"] if "val" in node.meta else node.meta.get("tensor_meta"))


def _as_meta(v):
    if isinstance(v, (torch.Tensor, TensorMetadata)):
        return _meta_tensor(v)
    if isinstance(v, (tuple, list)):
        return [_as_meta(x) for x in v]
    return None


def _meta_tensor(v: torch.Tensor | TensorMetadata) -> torch.Tensor:
    stride = v.stride() if isinstance(v, torch.Tensor) else v.stride
    return torch.empty_strided([concrete_int(x) for x in v.shape],
                               [concrete_int(x) for x in stride], dtype=v.dtype, device="meta")


def to_meta(val):
    """``meta["val"]`` with every tensor in it replaced by a meta tensor of the same concrete
    shape, strides and dtype, and everything else kept: all the cost model reads, and ops run
    on it ~30x faster than on FakeTensors (AutoPlan's trial graphs)."""
    if isinstance(val, torch.Tensor):
        return _meta_tensor(val)
    if isinstance(val, (tuple, list)):
        return type(val)(to_meta(x) for x in val)
    return val


def value_bytes(t) -> int:
    """Bytes of distinct elements (an expanded, stride-0 dim counts once); lists summed."""
    if isinstance(t, list):
        return sum(value_bytes(x) for x in t)
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return 0
    return math.prod(n for n, st in zip(t.shape, t.stride()) if st != 0) * t.element_size()


def node_bytes(node: fx.Node) -> int:
    """Bytes of a node's output tensors (tuples summed); 0 when it has no tensor metadata.
    value_bytes(node_value(node)), read off the metadata without making the meta tensors."""
    return _meta_bytes(node.meta["val"] if "val" in node.meta else node.meta.get("tensor_meta"))


def _meta_bytes(v) -> int:
    if isinstance(v, (torch.Tensor, TensorMetadata)):
        shape = [concrete_int(x) for x in v.shape]
        if math.prod(shape) == 0:
            return 0
        stride = v.stride() if isinstance(v, torch.Tensor) else v.stride
        return math.prod(n for n, st in zip(shape, stride) if concrete_int(st) != 0
                         ) * v.dtype.itemsize
    if isinstance(v, (tuple, list)):
        return sum(_meta_bytes(x) for x in v)
    return 0


def has_value(node: fx.Node) -> bool:
    """node_value(node) is not None, without making the meta tensors."""
    v = node.meta["val"] if "val" in node.meta else node.meta.get("tensor_meta")
    return isinstance(v, (torch.Tensor, TensorMetadata, tuple, list))


# Views although their schema does not say so (wait_tensor returns the collective's buffer,
# _unsafe_view reuses its freshly computed input).
_VIEW_TARGETS = {operator.getitem, WAIT, aten._unsafe_view.default}
# Schema says "may alias": a view only when the input is contiguous and the dtype unchanged.
_MAYBE_VIEW = {aten.reshape, aten.reshape_as, aten.flatten, aten.contiguous, aten.to,
               aten.type_as}


@functools.lru_cache(maxsize=None)
def _returns_alias(op: torch._ops.OpOverload) -> str | None:
    """What the op's schema says its outputs alias: "write" (an input it writes), "read",
    or None. Read once per op: every node asks."""
    infos = [r.alias_info for r in op._schema.returns if r.alias_info is not None]
    if not infos:
        return None
    return "write" if any(i.is_write for i in infos) else "read"


def alias_kind(node: fx.Node) -> str | None:
    """"view" (output shares an input's storage, no data moved), "inplace" (writes into an
    input, returns it) or None (fresh output)."""
    t = node.target
    if node.op != "call_function":
        return None
    if t in _VIEW_TARGETS:
        return "view"
    if not isinstance(t, torch._ops.OpOverload):
        return None
    returns = _returns_alias(t)
    if returns is None:
        return None
    if returns == "write":
        return "inplace"
    if t.overloadpacket in _MAYBE_VIEW:
        src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        i, o = node_value(src) if src is not None else None, node_value(node)
        if not (isinstance(i, torch.Tensor) and isinstance(o, torch.Tensor)
                and i.is_contiguous() and i.dtype == o.dtype):
            return None
    return "view"


def aliased_inputs(node: fx.Node) -> list[fx.Node]:
    """The input(s) whose storage the output of an aliasing node shares."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        for arg, val in zip(t._schema.arguments, node.args):
            if arg.alias_info is not None and isinstance(val, fx.Node):
                return [val]
    first = node.args[0] if node.args else None
    return [first] if isinstance(first, fx.Node) else []
