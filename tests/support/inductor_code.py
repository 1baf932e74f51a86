"""The order of collectives among matmuls, read from an FX graph and from inductor's output code.

``graph_order(gm)`` and ``code_order(code)`` return the same kind of sequence, so a test can
check that inductor ran the collectives where our post-grad passes put them:

  ("start", i, op)  the i-th collective start (op: all_gather_into_tensor, all_to_all_single, ...)
  ("wait", i, k)    the wait on output k of the i-th start (k > 0 only for coalesced ops)
  ("mm",)           a matmul (mm, addmm, bmm, baddbmm)

Matmuls are the compute anchors because inductor emits each as one extern kernel call, while
pointwise ops are fused into kernels that no longer map one-to-one to graph nodes. Starts are
numbered in issue order on both sides (inductor keeps the relative order of collectives), and
waits name their start through the buffer they wait on.
"""
from __future__ import annotations

import operator
import re

import torch
from torch import fx

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten
WAIT = _c10d.wait_tensor.default
MATMULS = ("mm", "addmm", "bmm", "baddbmm")
_MATMUL_TARGETS = {getattr(_aten, name).default for name in MATMULS}

# the wrapper's lines (Python wrapper: CPU and Triton alike)
# a start assigns its output; the *_out forms name the buffer they write (out=bufN); the
# in-place forms inductor turns a functional all-reduce into (all_reduce_) write their first
# argument, and are the graph's functional op of the same name without the underscore
_CODE_START = re.compile(r"\s*(?:(buf\d+) = )?torch\.ops\._c10d_functional\.(\w+?)(_?)"
                         r"\.default\((buf\d+)?(?:.*\bout=(buf\d+))?")
_CODE_OUTPUT = re.compile(r"\s*(buf\d+) = (buf\d+)\[(\d+)\]")
_CODE_WAIT = re.compile(r"_c10d_functional\.wait_tensor\.default\((buf\d+)\)")
_CODE_MATMUL = re.compile(r"extern_kernels\.(" + "|".join(MATMULS) + r")\(")


def graph_order(gm: fx.GraphModule) -> list[tuple]:
    starts: dict[fx.Node, int] = {}
    outputs: dict[fx.Node, tuple[int, int]] = {}
    order: list[tuple] = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is WAIT:
            src = n.args[0]
            order.append(("wait", *outputs.get(src, (starts.get(src), 0))))
        elif n.target is operator.getitem and n.args[0] in starts:
            outputs[n] = (starts[n.args[0]], n.args[1])
        elif getattr(n.target, "namespace", None) == "_c10d_functional":
            starts[n] = len(starts)
            order.append(("start", starts[n], n.target._opname))
        elif n.target in _MATMUL_TARGETS:
            order.append(("mm",))
    return order


def code_order(code: str) -> list[tuple]:
    """The sequence of inductor's generated ``call`` (its wrapper's body, in run order)."""
    body = code[code.index("def call("):]
    starts: dict[str, int] = {}
    outputs: dict[str, tuple[int, int]] = {}
    order: list[tuple] = []
    for line in body.splitlines():
        if m := _CODE_WAIT.search(line):
            buf = m.group(1)
            order.append(("wait", *outputs.get(buf, (starts.get(buf), 0))))
        elif m := _CODE_START.match(line):
            written = m.group(1) or m.group(5) or (m.group(4) if m.group(3) else None)
            starts[written] = len(starts)
            order.append(("start", len(starts) - 1, m.group(2)))
        elif (m := _CODE_OUTPUT.match(line)) and m.group(2) in starts:
            outputs[m.group(1)] = (starts[m.group(2)], int(m.group(3)))
        elif _CODE_MATMUL.search(line):
            order.append(("mm",))
    return order


def format_order(order: list[tuple]) -> str:
    """``S0 W0.0 mm S1 ...``: starts, waits (start.output) and matmuls, for failure messages."""
    short = {"start": lambda t: f"S{t[1]}", "wait": lambda t: f"W{t[1]}.{t[2]}",
             "mm": lambda t: "mm"}
    return " ".join(short[t[0]](t) for t in order)


def overlapped(order: list[tuple]) -> bool:
    """Whether some collective has a matmul between its start and its first wait."""
    in_flight, hidden = set(), set()
    for t in order:
        if t[0] == "start":
            in_flight.add(t[1])
        elif t[0] == "wait":
            in_flight.discard(t[1])
        else:
            hidden |= in_flight
    return bool(hidden)
