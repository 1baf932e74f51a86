"""Host placement of a ragged bucket's shard (``data_parallel(..., offload=...)``,
``--parallelism.offload``): where the bucket's ``[L]`` lives between uses, and the two copies
that cross between the host and the compute device.

- ``"none"``: the shard on the compute device (the mesh's device type), no copy.
- ``"params"`` (FSDP2's ``CPUOffloadPolicy``): the shard, and so its members, their gradients
  and the optimizer's state, on the host (pinned when the compute device is an accelerator);
  each gather reads a copy on the compute device made right before it (:func:`to_compute`),
  and the reduced gradient is copied back to the host right after its reduction
  (:func:`to_host`, the first copy's backward).
- ``"optimizer"`` (ZeRO-Offload): the members, their gradients and the optimizer's state on
  the host as under ``"params"``, but the compute device keeps a resident copy of the shard
  that the gathers read: no copy before a gather; the reduced gradient is copied to the host
  as under ``"params"``, and the host shard, once stepped, is copied back to the resident
  one at the start of every forward (:meth:`Offload.refresh`, run by a forward pre-hook
  outside any compiled graph: one copy per bucket and forward, so per micro-batch under
  gradient accumulation). From pinned memory these copies run on the copy stream to the
  device, each waited at its bucket's first read, so the first blocks compute while the
  later buckets' copies are still crossing.

The host is the CPU. Where the compute device is the CPU too, host and device are the same
device, yet the copies are still made, by the same ops: what a CPU run tests is the program an
accelerator runs. Under ``torch.compile`` each copy is one node of its own custom op (dynamo
and aot_autograd keep an op opaque, so the copy stays a copy on CPU), annotated with the
bucket's annotation and ``OFFLOAD_KEY`` (passes/annotations.py).

Both copies are asynchronous, as collectives are, each on a copy stream of the device's own
(one per direction: the link carries both at once), made whole by a ``wait_tensor``
(``WAIT``) in the graph, for which the copy registers the event recorded after it as a c10d
work:

- ``to_compute`` (and the resident copy's refresh): the wait is of the copy, and makes the
  compute stream wait for it where the copy is first read. The copy's memory is the compute
  stream's, as the graph's other tensors (the copy stream first waits for what that stream
  has queued).
- ``to_host``: the wait is of the gradient copied, and blocks the host until the copy has
  landed. Reading the gradient, it also keeps its memory from being freed, or handed by
  inductor to another kernel, while the copy still reads it.

The reordering pass places them (passes/offload_copies.py): each copy to the device issued
one copy ahead of its wait under the memory cap (docs/memory_cap.md), each wait of a copy to
the host right before the next such copy, so the copies run beside compute. Outside a graph
(:func:`host_copy`) and in an eager backward a copy is waited at once. On the CPU a copy is
made at once and its wait finds no work.

Invariant: the host shard is the one the members view, so ``named_parameters()``,
``state_dict()``, parameter groups and checkpoints read what the optimizer steps, whatever the
offload; the resident copy is only ever read by gathers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx.traceback as fx_traceback

from torch._C._distributed_c10d import Work, _register_work as register_work
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from simplesharded.passes.annotations import OFFLOAD_KEY

OFFLOADS = ("none", "optimizer", "params")
HOST = torch.device("cpu")


def offload_choice(offload) -> tuple[str, bool]:
    """(kind, pin_memory) of what ``data_parallel(offload=...)`` takes: one of
    :data:`OFFLOADS`, or an FSDP2 offload policy (``CPUOffloadPolicy`` is ``"params"`` with
    its ``pin_memory``; the base ``OffloadPolicy`` is ``"none"``, and so is ``None``, the usual
    Python spelling of "no policy")."""
    if offload is None:
        return "none", True
    if isinstance(offload, str):
        if offload not in OFFLOADS:
            raise ValueError(f"offload={offload!r} is not one of {list(OFFLOADS)} (or an FSDP2 "
                             f"OffloadPolicy)")
        return offload, True
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if isinstance(offload, CPUOffloadPolicy):
        return "params", bool(offload.pin_memory)
    if type(offload) is OffloadPolicy:
        return "none", True
    raise ValueError(f"offload={offload!r} is not one of {list(OFFLOADS)} (or an FSDP2 "
                     f"OffloadPolicy)")


def check_host_group(kind: str, mesh) -> None:
    """A warning where ``kind`` puts shards on the host of an accelerator's mesh whose default
    group has no host backend: the gradients' norm (``clip_grad_norm_``) and a member's
    gather would then fail at their first collective, far from the cause."""
    import warnings

    import torch.distributed as dist

    if kind == "none" or mesh.device_type == HOST.type:
        return
    config = dist.get_backend_config()
    if f"{HOST.type}:" in config:
        return
    try:
        backend = dist.get_default_backend_for_device(mesh.device_type)
    except (RuntimeError, ValueError):  # a device type torch has no default backend for
        backend = "<its backend>"
    warnings.warn(f"offload={kind!r}: the process group ({config}) takes no host tensors, so a "
                  f"norm or gather of the host's gradients fails; initialise it with "
                  f"backend='{mesh.device_type}:{backend},cpu:gloo' (simplesharded.init_mesh("
                  f"..., host=True) does)", stacklevel=3)


def kept_dtensor(local: torch.Tensor, mesh, placements, shape, stride) -> DTensor:
    """``DTensor.from_local(local, ..., run_check=False)`` that leaves ``local`` where it is.
    ``from_local`` copies a tensor to its mesh's device type, so a host shard on an
    accelerator's mesh would silently come back on the accelerator (FSDP2 builds its
    offloaded shards as DTensors of host tensors the same way). Not differentiable in
    ``local``: for parameters, gradients and states."""
    if local.device.type == mesh.device_type or local.is_meta:
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                                  stride=stride)
    meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    return DTensor(local, DTensorSpec(mesh, tuple(placements), tensor_meta=meta),
                   requires_grad=False)


@torch.library.custom_op("simplesharded::to_compute", mutates_args=())
def to_compute(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of host tensor ``x`` on ``device`` (a new tensor even on the same device), ready
    once :data:`WAIT` has returned it. From pinned memory to an accelerator it is made on the
    device's copy stream and ``WAIT`` makes the current stream wait for it, so the copy runs
    beside the kernels issued between the two (the reordering pass issues it one copy ahead,
    passes/offload_copies.py); otherwise it is made here, and ``WAIT`` returns at once."""
    if device.type == HOST.type or not x.is_pinned():
        return x.to(device, copy=True)
    # From the compute stream's memory, as every other tensor of the graph: freed and reused
    # in that stream's order, which reads it only after WAIT
    out = torch.empty_like(x, device=device)
    return copy_on_stream(x, out, torch.accelerator.current_stream(device),
                          _copy_stream(device, device), to_host=False)


def copy_on_stream(x: torch.Tensor, out: torch.Tensor, compute: torch.Stream,
                   stream: torch.Stream, to_host: bool) -> torch.Tensor:
    """``x`` copied into ``out`` on ``stream``, after what ``compute`` has queued (where ``x``
    was made, or a block of ``out``'s memory may still be in use), the event recorded after
    it registered as a c10d work: ``WAIT`` of ``out`` makes the stream then current wait for
    it, or with ``to_host`` ``WAIT`` of ``x`` blocks the host until it has landed. Reading
    ``x``, that wait keeps ``x``'s memory until then: every graph places it before ``x`` can
    be freed or its memory handed to another kernel."""
    stream.wait_stream(compute)
    with stream:
        out.copy_(x, non_blocking=True)
    register_work(x if to_host else out, _Copied(stream.record_event(), host=to_host))
    return out


@to_compute.register_fake
def _(x, device):
    return torch.empty_like(x, device=device)


# A collective's wait: returns its tensor, after the work registered for it (a copy's
# _Copied) is done; dynamo, aot_autograd, inductor and the passes know it as that
WAIT = torch.ops._c10d_functional.wait_tensor.default

_COPY_STREAMS: dict[tuple[torch.device, torch.device], torch.Stream] = {}


def _copy_stream(device: torch.device, to: torch.device) -> torch.Stream:
    """The stream of ``device``'s copies to ``to`` (the device itself: from the host): one per
    direction, so a copy each way runs at once, as the link takes them."""
    key = (device, to)
    if key not in _COPY_STREAMS:
        _COPY_STREAMS[key] = torch.Stream(device=device)
    return _COPY_STREAMS[key]


class _Copied(Work):
    """A copy on a copy stream, as a work ``WAIT`` waits for: the event recorded after it,
    which the current stream waits for, or with ``host`` the host."""

    def __init__(self, event: torch.Event, host: bool = False):
        super().__init__()
        self.event, self.host = event, host

    def wait(self, timeout=None) -> bool:
        if self.host:
            self.event.synchronize()
        else:
            self.event.wait()
        return True


@torch.library.custom_op("simplesharded::to_host", mutates_args=())
def to_host(x: torch.Tensor, pin: bool) -> torch.Tensor:
    """A copy of ``x`` on the host, pinned if ``pin`` (a new tensor even from the host), whole
    once :data:`WAIT` of ``x`` (the tensor copied, not the copy) has returned. From an
    accelerator into pinned memory it is made on the device's copy stream to the host, and
    that ``WAIT`` blocks the host until it has landed; otherwise it is made here, and the
    ``WAIT`` returns at once."""
    out = torch.empty_like(x, device=HOST, pin_memory=pin)
    if x.device.type == HOST.type or not pin:
        out.copy_(x)  # blocking
        return out
    return copy_on_stream(x, out, torch.accelerator.current_stream(x.device),
                          _copy_stream(x.device, HOST), to_host=True)


@to_host.register_fake
def _(x, pin):
    return torch.empty_like(x, device=HOST)


def host_copy(x: torch.Tensor, pin: bool) -> torch.Tensor:
    """:func:`to_host` of ``x``, whole: for copies outside a graph."""
    out = to_host(x, pin)
    WAIT(x)
    return out


class _ToCompute(torch.autograd.Function):
    """The gather's input on the compute device: a copy of the host shard (``resident`` None)
    or a view of the resident copy; the gradient, whatever the forward, copied to the host,
    under the bucket's annotation (the backward is traced after the forward's annotation has
    ended, so it sets its own)."""

    @staticmethod
    def forward(ctx, host, device, pin, annotation, resident):
        ctx.pin, ctx.annotation = pin, annotation
        if resident is not None:  # its refresh waited, as a copy's (Offload.refresh)
            return WAIT(resident).view_as(resident)
        return WAIT(to_compute(host, device))

    @staticmethod
    def backward(ctx, grad):
        with fx_traceback.annotate({**ctx.annotation, OFFLOAD_KEY: "to_host"}):
            host = to_host(grad, ctx.pin)
            WAIT(grad)  # traced right here; the reordering pass places it later
        return host, None, None, None, None


@dataclass(eq=False)
class Offload:
    """One bucket's offload: ``kind`` (:data:`OFFLOADS`), its compute device, whether its host
    tensors are pinned, and under ``"optimizer"`` the resident copy."""

    kind: str
    compute: torch.device
    pin: bool = False
    resident: torch.Tensor | None = None

    @classmethod
    def place(cls, kind: str, local: torch.Tensor, pin_memory: bool = True
              ) -> tuple["Offload", torch.Tensor]:
        """The offload of a bucket whose ``[L]`` is ``local`` (on the compute device), and the
        tensor the bucket holds: ``local`` itself, or its host copy."""
        if kind == "none":
            return cls(kind, local.device), local
        # pinned host memory only speaks to an accelerator, and needs one to allocate
        pin = pin_memory and local.device.type != HOST.type and torch.accelerator.is_available()
        host = host_copy(local.detach(), pin)
        off = cls(kind, local.device, pin)
        if kind == "optimizer":
            off.resident = local.detach().clone()
        return off, host

    @property
    def on_host(self) -> bool:
        return self.kind != "none"

    def read(self, host: torch.Tensor, annotation: dict) -> torch.Tensor:
        """The gather's input from the bucket's ``host`` ``[L]``: itself without offload; else
        on the compute device, its gradient copied to the host."""
        if not self.on_host:
            return host
        role = "to_compute" if self.resident is None else "resident"
        with fx_traceback.annotate({**annotation, OFFLOAD_KEY: role}):
            return _ToCompute.apply(host, self.compute, self.pin, annotation, self.resident)

    def copy_in(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` on the compute device, without autograd (a gather outside the graph:
        eager resharding's, ``gather_once``'s; a collective of the boundary)."""
        if not self.on_host:
            return host
        if self.resident is not None:
            return WAIT(self.resident)
        return host.to(self.compute)

    def on_compute(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a tensor laid out as the bucket) on the compute device, for a collective."""
        return t if t.device == self.compute else t.to(self.compute)

    def home(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` where the bucket's tensors live (a gradient or state from the compute
        device)."""
        if not self.on_host or t.device == HOST:
            return t
        return host_copy(t, self.pin)

    def refresh(self, host: torch.Tensor) -> None:
        """Under ``"optimizer"``: the resident copy made the host shard's values again. Every
        time: a write to the host shard (an optimizer step on the members, a load) leaves no
        trace to test, as the members' in-place updates run below autograd, on tensors that
        share no version counter with the bucket's. From pinned memory the copy is made on the
        copy stream to the device and waited at the bucket's first read (:meth:`read`,
        :meth:`copy_in`): the forward pre-hook issues every bucket's refresh at once, and the
        first blocks compute while the later buckets' copies cross (a gather prefetched
        ahead of a block waits for its own bucket's copy there)."""
        if self.resident is None:
            return
        WAIT(self.resident)  # a refresh that no read waited for (a bucket left unread)
        with torch.no_grad():
            if not self.pin:
                self.resident.copy_(host)
                return
            copy_on_stream(host, self.resident, torch.accelerator.current_stream(self.compute),
                           _copy_stream(self.compute, self.compute), to_host=False)
