"""Host offload's copies on the copy streams: where the reordering pass issues the copies to
the device (passes/offload_copies.py; the copies to the host: tests/test_offload.py) and the
stream protocol of a copy each way (simplesharded/storage/offload.py).

1. A hand-built chain of gradients each copied to the host: after reordering, each copy's
   wait stands right before the next copy, the last before the output.
   Hand-built forwards ``h = h @ ready(copy(host_i))`` (one rank: no gather) and
   ``h = h @ all_gather(ready(copy(host_i)))`` (two): after reordering, every wait stands
   right before its reader, each copy but the first right before the previous copy's wait;
   a cap of one copy moves none; the gathered bytes the memory sweep counts stay within the
   cap; a second run changes nothing.
2. The protocols (each copy, and the resident copy's refresh), with streams that log what is
   asked of them (a CPU has no second stream):
   the copy stream waits for the compute stream before the copy is issued on it, an event is
   recorded after the copy; to the device, the graph's wait of the copy makes the compute
   stream wait for that event, to the host the wait of the gradient copied blocks the host
   until it, each once. The values are the source's. The GPU check's copy_stream row runs the
   real streams.
"""
from __future__ import annotations

import torch
from torch import fx

from simplesharded.passes.annotations import OFFLOAD_KEY, PARAM_KEY
from simplesharded.passes.memory import gathered_timeline
from simplesharded.passes.reordering import reorder_graph
from simplesharded.storage import offload

import pass_utils as pu

aten = torch.ops.aten
TO_COMPUTE = torch.ops.simplesharded.to_compute.default
TO_HOST = torch.ops.simplesharded.to_host.default
ROWS = 8


def _offloaded_chain(n_layers: int, world_size: int) -> fx.GraphModule:
    """The forward of ``n_layers`` matmuls, each weight a copy of a host shard made ready by a
    wait (then all-gathered on two ranks), annotated as storage/offload.py annotates them."""
    from torch._subclasses import FakeTensorMode

    mode, g = FakeTensorMode(), fx.Graph()

    def placeholder(name, shape):
        node = g.placeholder(name)
        node.meta["val"] = mode.from_tensor(torch.empty(shape))
        return node

    def op(target, *args, custom=None):
        node = g.call_function(target, args)
        with mode:
            node.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a
                                        for a in args])
        if custom:
            node.meta["custom"] = custom
        return node

    h = placeholder("x", (3, ROWS))
    hosts = [placeholder(f"host{i}", (ROWS // world_size, ROWS)) for i in range(n_layers)]
    for i, host in enumerate(hosts):
        param = {PARAM_KEY: f"layers.{i}.weight", "ss_block": f"layers.{i}"}
        copied = {**param, OFFLOAD_KEY: "to_compute"}
        w = op(pu.WAIT, op(TO_COMPUTE, host, torch.device("cpu"), custom=copied),
               custom=copied)
        if world_size > 1:
            w = op(pu.WAIT, op(pu.AG, w, world_size, "0", custom=param), custom=param)
        h = op(aten.relu.default, op(aten.mm.default, h, w))
    g.output((h,))
    return fx.GraphModule(torch.nn.Module(), g)


def _gradients_to_the_host(n_layers: int) -> fx.GraphModule:
    """A backward-like chain whose every gradient ``g_i`` is copied to the host and waited
    right after, as traced (storage/offload.py's annotations), the copies the outputs."""
    from torch._subclasses import FakeTensorMode

    mode, g = FakeTensorMode(), fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = mode.from_tensor(torch.empty(ROWS, ROWS))
    outs, h = [], x
    for i in range(n_layers):
        nodes = []
        for target, args in ((aten.mm.default, (h, x)), (aten.relu.default, None),
                             (TO_HOST, None), (pu.WAIT, None)):
            if args is None:  # relu of the matmul; the copy, then the wait, of the relu
                args = ((nodes[0],) if target is aten.relu.default else
                        (nodes[1], False) if target is TO_HOST else (nodes[1],))
            node = g.call_function(target, args)
            with mode:
                node.meta["val"] = target(*[a.meta["val"] if isinstance(a, fx.Node) else a
                                            for a in args])
            if target in (TO_HOST, pu.WAIT):
                node.meta["custom"] = {PARAM_KEY: f"layers.{i}.weight", OFFLOAD_KEY: "to_host"}
            nodes.append(node)
        h = nodes[1]
        outs.append(nodes[2])
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g)


def test_each_copy_to_the_host_is_waited_at_the_next():
    gm = _gradients_to_the_host(3)
    reorder_graph(gm.graph, None)
    gm.graph.lint()
    copies = [n for n in gm.graph.nodes if n.target is TO_HOST]
    output = next(iter(gm.graph.find_nodes(op="output")))
    for copy_, after in zip(copies, [*copies[1:], output]):
        (wait,) = [u for u in copy_.args[0].users if u.target is pu.WAIT]
        assert wait.next is after, (wait, after)
    # the next copy's gradient was computed while this one's copy was in flight
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for copy_, nxt in zip(copies, copies[1:]):
        assert order[copy_] < order[nxt.args[0]] < order[nxt]
    reorder_graph(gm.graph, None)  # idempotent
    assert [n for n in gm.graph.nodes if n.target is TO_HOST] == copies


def _copies_and_waits(gm):
    copies = [n for n in gm.graph.nodes if n.target is TO_COMPUTE]
    return copies, [next(iter(c.users)) for c in copies]


def _copy_bytes(gm) -> int:
    (copy_, *_), _ = _copies_and_waits(gm)
    return copy_.meta["val"].numel() * copy_.meta["val"].element_size()


def _reordered(n_layers, world_size, cap=None):
    gm = _offloaded_chain(n_layers, world_size)
    reorder_graph(gm.graph, cap)
    gm.graph.lint()
    return gm


def test_each_copy_is_issued_before_the_previous_copys_wait():
    for world_size in (1, 2):
        gm = _reordered(4, world_size)
        copies, waits = _copies_and_waits(gm)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for wait in waits:
            (reader,) = wait.users
            assert wait.next is reader, f"{wait} is not waited right before {reader}"
        waits.sort(key=order.__getitem__)
        nodes = list(gm.graph.nodes)
        first_mm = next(i for i, n in enumerate(nodes) if n.target is aten.mm.default)
        for ahead, wait in zip(waits, waits[1:]):
            (copy_,) = wait.all_input_nodes
            assert copy_.next is ahead, f"{copy_} is not issued right before {ahead}"
            # compute stands between the copy and its wait, what it runs beside (but where
            # prefetch issued both gathers before any compute, on two ranks)
            if order[ahead] > first_mm:
                between = nodes[order[copy_] + 1:order[wait]]
                assert any(n.target is aten.mm.default for n in between), (world_size, wait)


def test_a_cap_of_one_copy_moves_none():
    gm = _offloaded_chain(4, 1)
    copies, waits = _copies_and_waits(gm)
    before = [(c.next, w.prev) for c, w in zip(copies, waits)]
    reorder_graph(gm.graph, _copy_bytes(gm))
    assert [(c.next, w.prev) for c, w in zip(copies, waits)] == before
    assert all(c.next is w for c, w in zip(copies, waits))


def test_the_copies_stay_within_the_cap():
    for world_size in (1, 2):
        plain = _offloaded_chain(4, world_size)
        floor = max(gathered_timeline(plain.graph))
        for extra in (0, _copy_bytes(plain), 4 * _copy_bytes(plain)):
            gm = _reordered(4, world_size, cap=floor + extra)
            assert max(gathered_timeline(gm.graph)) <= floor + extra, (world_size, extra)


def test_reordering_twice_changes_nothing():
    for world_size in (1, 2):
        gm = _reordered(4, world_size)
        once = [n.name for n in gm.graph.nodes]
        reorder_graph(gm.graph, None)
        assert [n.name for n in gm.graph.nodes] == once


class _LoggedStream:
    """A stream that logs what is asked of it, in ``log``."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits for {other.name}")

    def __enter__(self):
        self.log.append(f"on {self.name}")

    def __exit__(self, *exc):
        self.log.append(f"off {self.name}")

    def record_event(self):
        self.log.append(f"event on {self.name}")
        return _LoggedEvent(self.log)


class _LoggedEvent:
    def __init__(self, log):
        self.log = log

    def wait(self, stream=None):
        self.log.append("current stream waits for the event")


def test_the_copy_to_the_device_protocol():
    log = []
    host = torch.randn(5, 3)
    out = offload.copy_on_stream(host, torch.empty_like(host), _LoggedStream("compute", log),
                                 _LoggedStream("copy", log), to_host=False)
    assert log == ["copy waits for compute", "on copy", "off copy", "event on copy"]
    ready = offload.WAIT(out)
    assert log[4:] == ["current stream waits for the event"]
    assert ready.data_ptr() == out.data_ptr() != host.data_ptr()
    assert torch.equal(ready, host)
    offload.WAIT(out)  # the work is waited once: a second wait finds none
    assert len(log) == 5


class _LoggedHostEvent(_LoggedEvent):
    def synchronize(self):
        self.log.append("host waits for the event")


def test_the_copy_to_the_host_protocol():
    log = []
    grad = torch.randn(4, 2)
    out = torch.empty_like(grad)
    stream = _LoggedStream("to host", log)
    stream.record_event = lambda: (log.append("event on to host"), _LoggedHostEvent(log))[1]
    copied = offload.copy_on_stream(grad, out, _LoggedStream("compute", log), stream,
                                    to_host=True)
    assert copied is out and torch.equal(out, grad)
    assert log == ["to host waits for compute", "on to host", "off to host", "event on to host"]
    # the wait is of the gradient copied: it blocks the host, once
    assert offload.WAIT(grad) is not None and log[4:] == ["host waits for the event"]
    offload.WAIT(grad)
    assert len(log) == 5


def test_the_refresh_protocol(monkeypatch):
    """``optimizer`` offload's refresh of the resident copy, from pinned memory: issued on the
    copy stream to the device after what the compute stream has queued (an earlier backward
    still reading the resident copy), waited by the compute stream at the bucket's first read,
    once; a refresh no read waited for is waited by the next refresh before it writes."""
    log = []
    compute, stream = _LoggedStream("compute", log), _LoggedStream("copy", log)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(offload, "_copy_stream", lambda device, to: stream)
    host = torch.randn(6, 2)
    off = offload.Offload("optimizer", torch.device("cpu"), pin=True,
                          resident=torch.zeros(6, 2))
    off.refresh(host)
    issued = ["copy waits for compute", "on copy", "off copy", "event on copy"]
    assert log == issued and torch.equal(off.resident, host)
    assert off.copy_in(host) is off.resident
    assert log[4:] == ["current stream waits for the event"]
    off.copy_in(host)  # waited once
    assert len(log) == 5
    log.clear()
    off.refresh(host)  # left unread: the next refresh waits for it first
    off.refresh(host * 2)
    assert log == [*issued, "current stream waits for the event", *issued]
    assert torch.equal(off.resident, host * 2)
    off.copy_in(host)  # no work left registered at exit
