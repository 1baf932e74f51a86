"""Helpers for the pass tests: capture real traced graphs, run them without communication, and
check schedules.

* ``fake_world(W)``: a fake process group (no communication, this process is rank 0) and a 1-D
  ``dp_shard`` mesh; destroyed on exit.
* ``capture_graphs(model, mesh, ...)``: wrap ``model`` with ``data_parallel``, compile it with
  ``make_backend("aot_eager_blockbucketing", observer=...)``, run one forward+backward and return
  deepcopies of the fw/bw graphs as its pass pipeline received them (after our joint recompute
  tagging and torch's partitioner, before bucketing/reordering) and after each of its passes.
  ``capture_backend()`` is the same capture as a bare PassPipeline backend.
* ``run_simulated(gm, inputs, W)``: execute a graph with an ``fx.Interpreter`` that implements the
  functional collectives locally, as if rank ``r`` held ``x + r/8`` whenever this rank holds ``x``
  (rank-distinct data, so a collective that puts rank r's data in the wrong row changes the
  result; every per-rank transform is elementwise, so it commutes with the pure
  cat/view/slice of bucketing and before/after comparisons are exact).
* schedule checks, written independently of passes/reordering.py from its documented definitions:
  ``check_waits_before_use``, ``gathered_intervals`` / ``gathered_bytes_in_flight`` /
  ``max_gathers_alive``, ``prefetch_depths`` / ``prefetch_depth``, ``reduction_intervals``;
  ``graph_signature`` for idempotence (node op/target/args with names normalised to indices).
"""
from __future__ import annotations

import contextlib
import copy
import operator
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch.utils._pytree import tree_flatten, tree_map

# the passes' own names for the collectives, short for the tests
from simplesharded.passes.collectives import (ALL_GATHER as AG,
                                              ALL_GATHER_COALESCED as AG_COALESCED,
                                              ALL_REDUCE as AR, ALL_TO_ALL as A2A,
                                              REDUCE_SCATTER as RS, WAIT)

aten = torch.ops.aten
STARTS = (AG, RS, AR)
RANK_OFFSET = 0.125  # simulated rank r holds x + r * RANK_OFFSET (exact in fp32 and bf16)


# ------------------------------------------------------------------------------ process group


@contextlib.contextmanager
def fake_world(world_size: int):
    """Fake process group of ``world_size`` (this process is rank 0) + 1-D dp_shard mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "another test left a process group initialised"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------ capture


def capture_backend():
    """(backend, captured): an aot_autograd backend that runs our joint recompute tagging and
    torch's partitioner, and appends a deepcopy of every fw/bw graph to ``captured`` before
    anything else touches it (then runs the graph unchanged)."""
    import functools

    from simplesharded.passes.pipeline import PassPipeline, aot_backend
    from simplesharded.passes.plans import BlockPlan
    from simplesharded.passes.recompute import tag_gathers_for_recompute

    captured: list[fx.GraphModule] = []

    def capture(gm):
        captured.append(copy.deepcopy(gm))
        return gm

    recompute = functools.partial(tag_gathers_for_recompute, plan=BlockPlan())
    pipeline = PassPipeline(joint=[("recompute", recompute)],
                            graph=[("capture", capture)])
    return aot_backend(pipeline), captured


def dynamo_trace_restarts() -> int:
    """How many times dynamo has restarted a frame's trace so far in this process (each
    restart traces the whole frame again; the count is cleared by ``torch._dynamo.reset``).
    Read from dynamo's own timing table, which keeps one entry per attempt."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(len(v) for k, v in compilation_time_metrics.items()
               if k.startswith("compile_attempt_") and k != "compile_attempt_0")


def capture_graphs(model: torch.nn.Module, mesh, inputs: tuple, loss=None,
                   reshard_after_forward: bool = True, mp_policy=None,
                   backend: str = "aot_eager_blockbucketing") -> dict[str, dict[str, fx.GraphModule]]:
    """Shard ``model`` over ``mesh``, compile it with ``make_backend(backend)``, run forward +
    backward once and return deepcopies of the graphs its pipeline saw, by graph and stage:
    ``{"fw": {"input": gm, "bucketing": gm, "reordering": gm}, "bw": {...}}``. "input" is the
    graph after our joint recompute tagging and torch's partitioner, before any of our graph
    passes; the other stages are the backend's own results (to compare manual passes with)."""
    import simplesharded as ss

    seen: dict[str, dict[str, fx.GraphModule]] = {}

    def observe(kind, stage, gm):
        if kind in ("fw", "bw"):
            assert stage not in seen.setdefault(kind, {}), f"{kind} graph compiled twice"
            seen[kind][stage] = copy.deepcopy(gm)

    torch._dynamo.reset()
    ss.data_parallel(model, mesh, mode="fully_shard", mp_policy=mp_policy,
                     reshard_after_forward=reshard_after_forward, storage="param")
    compiled = torch.compile(model, fullgraph=True,
                             backend=ss.make_backend(backend, observer=observe))
    out = compiled(*inputs)
    (loss(out) if loss is not None else out.float().sum()).backward()
    torch._dynamo.reset()
    assert set(seen) == {"fw", "bw"}, f"expected one forward and one backward graph: {seen}"
    return seen


def fresh(gm: fx.GraphModule) -> fx.GraphModule:
    """A private copy to run passes on (the cached captures stay pristine)."""
    return copy.deepcopy(gm)


# -------------------------------------------------------------------- simulated execution


def _rank_data(x: torch.Tensor, r: int) -> torch.Tensor:
    return x if r == 0 else x + r * RANK_OFFSET


class SimulatedCollectives(fx.Interpreter):
    """Runs a graph on rank 0 of ``world_size`` simulated ranks (see module doc)."""

    def __init__(self, gm: fx.GraphModule, world_size: int):
        super().__init__(gm)
        self.world_size = world_size
        self.collective_calls = 0

    def call_function(self, target, args, kwargs):
        W = self.world_size
        if target is AG:
            x, ws = args[0], args[1]
            assert ws == W, (ws, W)
            self.collective_calls += 1
            return torch.cat([_rank_data(x, r) for r in range(W)])
        if target is AG_COALESCED:
            xs, ws = args[0], args[1]
            assert ws == W, (ws, W)
            self.collective_calls += 1
            return [torch.cat([_rank_data(x, r) for r in range(W)]) for x in xs]
        if target is RS:
            x, op, ws = args[0], args[1], args[2]
            assert ws == W and op == "sum", (ws, op)
            self.collective_calls += 1
            acc = _rank_data(x, 0).chunk(W)[0].clone()
            for r in range(1, W):
                acc = acc + _rank_data(x, r).chunk(W)[0]
            return acc
        if target is AR:
            x, op = args[0], args[1]
            assert op == "sum", op
            self.collective_calls += 1
            acc = x.clone()
            for r in range(1, W):
                acc = acc + _rank_data(x, r)
            return acc
        if target is WAIT:
            return args[0]
        return super().call_function(target, args, kwargs)


def make_inputs(gm: fx.GraphModule, seed: int = 0, int_high: int = 7) -> list[Any]:
    """Random tensors shaped (and strided) like the graph's placeholders' meta["val"]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            out.append(val)
            continue
        shape, stride, dtype = tuple(val.shape), tuple(val.stride()), val.dtype
        base = torch.empty_strided(shape, stride, dtype=dtype)
        if dtype.is_floating_point:
            base.copy_(torch.randn(shape, generator=g))
        elif dtype == torch.bool:
            base.copy_(torch.randint(0, 2, shape, generator=g).bool())
        else:
            base.copy_(torch.randint(0, int_high, shape, generator=g))
        out.append(base)
    return out


def run_simulated(gm: fx.GraphModule, inputs: list[Any], world_size: int):
    interp = SimulatedCollectives(gm, world_size)
    with torch.no_grad():
        result = interp.run(*[a.clone() if isinstance(a, torch.Tensor) else a for a in inputs])
    return result, interp.collective_calls


def bitwise_equal(a, b) -> bool:
    """Same pytree structure, and every tensor leaf has the same dtype, shape and bits."""
    la, sa = tree_flatten(a)
    lb, sb = tree_flatten(b)
    if sa != sb or len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if not isinstance(x, torch.Tensor):
            if x != y:
                return False
            continue
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.dtype.is_floating_point:  # compare bits, so NaN == NaN with the same payload
            ity = {1: torch.uint8, 2: torch.int16, 4: torch.int32,
                   8: torch.int64}[x.element_size()]  # 1: float8
            x, y = x.contiguous().view(ity), y.contiguous().view(ity)
        if not torch.equal(x, y):
            return False
    return True


# ---------------------------------------------------------------------------- schedule checks


def _pos(gm_or_graph) -> dict[fx.Node, int]:
    graph = gm_or_graph.graph if isinstance(gm_or_graph, fx.GraphModule) else gm_or_graph
    return {n: i for i, n in enumerate(graph.nodes)}


def starts(gm: fx.GraphModule, target=None) -> list[fx.Node]:
    targets = STARTS if target is None else (target,)
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


def the_wait(start: fx.Node) -> fx.Node:
    waits = [u for u in start.users if u.op == "call_function" and u.target is WAIT]
    assert len(waits) == 1, f"{start} has {len(waits)} waits"
    return waits[0]


def check_waits_before_use(gm: fx.GraphModule) -> None:
    """Every collective's only user is its wait, the wait comes after the start, and the wait
    comes before every use of its result; the graph is topologically valid."""
    gm.graph.lint()
    pos = _pos(gm)
    for node in gm.graph.nodes:
        for inp in node.all_input_nodes:
            assert pos[inp] < pos[node], f"{node} uses {inp} before it is defined"
    for s in starts(gm):
        assert set(s.users) == {the_wait(s)}, f"{s} is read without its wait: {list(s.users)}"
        w = the_wait(s)
        assert pos[s] < pos[w], f"{w} before its start {s}"
        for u in w.users:
            assert pos[w] < pos[u], f"{u} uses {w} before the wait"


# Ops that only reshape/copy a gathered buffer into parameter form (wait_chains.py's documented
# "copy-out/view chain"); matched here by op overload packet rather than by name.
_CHAIN_PACKETS = {aten.view, aten._unsafe_view, aten.slice, aten.clone, aten.alias, aten.reshape,
                  aten.t, aten.permute, aten.transpose, aten.expand, aten.as_strided,
                  aten.contiguous}


def _is_chain_op(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    return getattr(node.target, "overloadpacket", None) in _CHAIN_PACKETS


def copy_out_chain(wait: fx.Node) -> set[fx.Node]:
    """The wait and every node reachable from it through chain ops all of whose inputs are
    already in the chain."""
    chain = {wait}
    changed = True
    while changed:
        changed = False
        for node in list(chain):
            for u in node.users:
                if u not in chain and _is_chain_op(u) and all(a in chain
                                                               for a in u.all_input_nodes):
                    chain.add(u)
                    changed = True
    return chain


def chain_uses(wait: fx.Node) -> list[fx.Node]:
    """Nodes outside the copy-out chain that read it (the gathered parameters' real uses).
    The graph output is not a use: a gathered parameter saved for backward is saved state,
    not a buffer in flight (reordering.py's definition)."""
    chain = copy_out_chain(wait)
    return [u for n in chain for u in n.users if u not in chain and u.op != "output"]


def _nbytes(node: fx.Node) -> int:
    val = node.meta["val"]
    return val.numel() * val.element_size()


def gathered_intervals(gm: fx.GraphModule) -> list[tuple[int, int, int, fx.Node]]:
    """(first, last, nbytes, start) per all-gather: alive from its start node to the last use of
    its wait's copy-out/view chain (or the chain's last node if nothing outside reads it)."""
    pos = _pos(gm)
    out = []
    for s in starts(gm, AG):
        w = the_wait(s)
        uses = chain_uses(w)
        last = max(pos[u] for u in uses) if uses else max(pos[n] for n in copy_out_chain(w))
        out.append((pos[s], last, _nbytes(s), s))
    return out


def gathered_bytes_in_flight(gm: fx.GraphModule) -> int:
    """Most bytes of gathered parameters alive at once, what ``memory_cap_bytes`` caps:
    gathered buffers, their copy-outs and saved gathered parameters (memory.gathered_timeline,
    a liveness sweep independent of reordering's own accounting)."""
    from simplesharded.passes.memory import gathered_timeline

    return max(gathered_timeline(gm), default=0)


def max_gathers_alive(gm: fx.GraphModule) -> int:
    iv = gathered_intervals(gm)
    n = len(gm.graph.nodes)
    return max((sum(1 for lo, hi, _, _ in iv if lo <= i <= hi) for i in range(n)), default=0)


def first_uses(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """All-gather start → position of the first real use of its gathered parameters."""
    pos = _pos(gm)
    out = {}
    for s in starts(gm, AG):
        uses = chain_uses(the_wait(s))
        if uses:
            out[s] = min(pos[u] for u in uses)
    return out


def prefetch_depths(gm: fx.GraphModule) -> list[tuple[fx.Node, int]]:
    """All-gathers in order of first use; for each, how many earlier-used all-gathers' compute
    it is issued before (0: issued after the previous bucket's compute started)."""
    pos = _pos(gm)
    use = first_uses(gm)
    order = sorted(use, key=use.__getitem__)
    return [(s, sum(1 for k in order[:j] if pos[s] < use[k])) for j, s in enumerate(order)]


def prefetch_depth(gm: fx.GraphModule) -> int:
    return max((d for _, d in prefetch_depths(gm)), default=0)


def reduction_intervals(gm: fx.GraphModule) -> list[tuple[int, int, fx.Node]]:
    """(start, wait) positions of every reduce-scatter / all-reduce."""
    pos = _pos(gm)
    return [(pos[s], pos[the_wait(s)], s) for s in starts(gm) if s.target is not AG]


# ------------------------------------------------------------------------ hand-built graphs


def chain_graph(n_layers: int, world_size: int = 2, save_gathered: bool = False,
                rows: int = 4, all_to_all_after: int | None = None,
                all_to_all_group: str = "0") -> fx.GraphModule:
    """A minimal FSDP-like forward: ``h = h @ all_gather(shard_i)`` for each layer, with fake
    tensor metadata as in traced graphs. ``save_gathered``: also return every gathered weight
    (what the partitioner does with reshard_after_forward=False). ``all_to_all_after``: after
    that layer's matmul, ``h`` goes through an all-to-all that is not ours (as expert
    parallelism's token exchange: no ``ss_param``), then ``h = relu(h)``; on the gathers'
    process group "0" unless ``all_to_all_group`` names another."""
    from torch._subclasses import FakeTensorMode

    mode = FakeTensorMode()
    g = fx.Graph()

    def placeholder(name, shape):
        node = g.placeholder(name)
        node.meta["val"] = mode.from_tensor(torch.empty(shape))
        return node

    def op(target, *args):
        node = g.call_function(target, args)
        with mode:
            node.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a
                                        for a in args])
        return node

    h = placeholder("x", (3, rows))
    shards = [placeholder(f"shard{i}", (rows // world_size, rows)) for i in range(n_layers)]
    gathered = []
    for i, s in enumerate(shards):
        start = op(AG, s, world_size, "0")
        w = op(WAIT, start)
        for node in (start, w):  # as sharding.gather_param annotates them: a dp gather
            node.meta["custom"] = {"ss_param": f"layers.{i}.weight", "ss_block": f"layers.{i}"}
        h = op(aten.mm.default, h, w)
        gathered.append(w)
        if i == all_to_all_after:
            h = op(WAIT, op(A2A, h, [1] * world_size, [1] * world_size, all_to_all_group))
            h = op(aten.relu.default, h)
    g.output((h, *gathered) if save_gathered else (h,))
    return fx.GraphModule(torch.nn.Module(), g)


# -------------------------------------------------------------------------------- structure


def graph_signature(gm: fx.GraphModule) -> list[tuple]:
    """Node op/target/args/kwargs in graph order, with nodes replaced by their index: two graphs
    with the same signature compute the same thing in the same order."""
    pos = _pos(gm)

    def norm(a):
        return ("%", pos[a]) if isinstance(a, fx.Node) else a

    return [(n.op, str(n.target), tree_map(norm, n.args), tree_map(norm, dict(n.kwargs)))
            for n in gm.graph.nodes]


def node_params(node: fx.Node) -> list[str]:
    custom = node.meta.get("custom") or {}
    if "ss_bucket_params" in custom:
        return list(custom["ss_bucket_params"])
    return [custom["ss_param"]] if "ss_param" in custom else []


def collective_counts(gm: fx.GraphModule) -> dict[str, int]:
    return {"all_gather": len(starts(gm, AG)), "reduce_scatter": len(starts(gm, RS)),
            "all_reduce": len(starts(gm, AR))}
