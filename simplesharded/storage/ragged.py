"""The ragged bucket layout: a bucket's parameters flattened end to end and cut into equal
contiguous ranges, one per rank, so that each gathered parameter is a view of the gathered
buffer (the layout YaFSDP uses; docs/zero_copy.md says why per-parameter ``Shard(0)`` cannot
give this).

One bucket of n parameters of one dtype, world w: parameter i is flattened and starts at
offset ``o_i``, a multiple of ``align`` elements; the total is padded to ``w·L``; rank r
holds elements ``[r·L, (r+1)·L)``. A parameter's local piece is the part of its range inside
the rank's: contiguous in the parameter's flattened order, of any length, possibly empty.
No DTensor placement describes it. Hence two kinds of operation:

- the read (:meth:`RaggedLayout.gather`): all-gather the rank's ``[L]`` into ``[w·L]`` and
  cut it with one split: every parameter is a view of the gathered buffer, so the gather's
  copy-out is gone. The split's backward concatenates the gradients (zeros in the gaps) into
  the reduce-scatter's input: that concatenation is the one copy left, which inductor can
  write in place;
- the boundary (:func:`to_ragged`, :func:`from_ragged`): move a bucket between the
  per-parameter ``Shard(0)`` locals that ``state_dict()``, DCP and optimizers see and its
  ragged range, with one all-to-all of exactly the elements that change rank.

Invariant: a layout is a function of the shapes, the world size and the alignment only, so
it is the same on every rank by construction, and so are the collectives built from it.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx.traceback as fx_traceback

from simplesharded.storage.sharded_state import reduction_dtype

_c10d = torch.ops._c10d_functional


def shard0_rows(rows: int, world: int | tuple[int, ...], rank: int) -> tuple[int, int]:
    """Rows [start, stop) of dim 0 that ``Shard(0)`` gives ``rank`` of ``world``: chunks of
    ceil(rows / world), the last ranks short or empty (DTensor's uneven sharding). ``world``
    as the sizes of several mesh dims, ``rank`` their row-major flattened rank: ``Shard(0)``
    on each dim, which DTensor nests (each dim cuts the previous one's chunk), so uneven rows
    split otherwise than over one dim of their product (5 rows on 2 × 2: 2, 1, 1, 1)."""
    if isinstance(world, tuple):
        start, stop, inner = 0, rows, math.prod(world)
        for size in world:
            inner //= size
            a, b = shard0_rows(stop - start, size, rank // inner % size)
            start, stop = start + a, start + b
        return start, stop
    chunk = -(-rows // world)
    start = min(chunk * rank, rows)
    return start, min(start + chunk, rows)


@dataclass(frozen=True)
class RaggedLayout:
    """Where each parameter of one bucket lives in the flattened bucket and on each rank."""

    shapes: tuple[tuple[int, ...], ...]
    world: int
    align: int = 1  # elements; a parameter starts at a multiple of it
    # The sizes of the mesh dims the ranks are, row-major, when the bucket is cut over two
    # (their product is ``world``): a parameter's ``Shard(0)`` local nests over them
    # (shard0_rows). None: one dim.
    cut_shape: tuple[int, ...] | None = None
    offsets: tuple[int, ...] = field(init=False)
    shard_numel: int = field(init=False)  # L: the elements each rank holds

    def __post_init__(self):
        if not self.shapes:
            raise ValueError("RaggedLayout: a bucket needs at least one parameter")
        if self.world < 1 or self.align < 1:
            raise ValueError(f"RaggedLayout: world={self.world} and align={self.align} "
                             "must be >= 1")
        if self.cut_shape is not None and math.prod(self.cut_shape) != self.world:
            raise ValueError(f"RaggedLayout: cut_shape={self.cut_shape} is not world="
                             f"{self.world}")
        if any(len(s) == 0 for s in self.shapes):
            raise ValueError("RaggedLayout: a 0-d parameter has no dim 0 to shard; keep it "
                             "out of ragged buckets")
        shapes = tuple(tuple(int(d) for d in s) for s in self.shapes)
        offsets, end = [], 0
        for s in shapes:
            end = -(-end // self.align) * self.align
            offsets.append(end)
            end += math.prod(s)
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "shard_numel", max(1, -(-end // self.world)))

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def total(self) -> int:
        """Elements of the gathered buffer, padding included: ``world · L``."""
        return self.world * self.shard_numel

    def rank_range(self, rank: int) -> tuple[int, int]:
        """Elements [start, stop) of the flattened bucket that ``rank`` holds."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def piece(self, i: int, rank: int) -> tuple[int, int]:
        """Parameter ``i``'s piece on ``rank``, as [start, stop) of its flattened elements
        (start == stop: none)."""
        lo, hi = self.rank_range(rank)
        o, n = self.offsets[i], self.numels[i]
        start, stop = min(max(lo - o, 0), n), min(max(hi - o, 0), n)
        return start, max(start, stop)

    def shard0_piece(self, i: int, rank: int) -> tuple[int, int]:
        """Parameter ``i``'s ``Shard(0)`` local on ``rank``, as [start, stop) of its
        flattened elements."""
        shape = self.shapes[i]
        row = math.prod(shape[1:])
        start, stop = self.shard0_rows(shape[0], rank)
        return start * row, stop * row

    def shard0_rows(self, rows: int, rank: int) -> tuple[int, int]:
        """Rows [start, stop) of a parameter's dim 0 in ``rank``'s ``Shard(0)`` local."""
        return shard0_rows(rows, self.cut_shape or self.world, rank)

    def split_sizes(self) -> tuple[list[int], list[int]]:
        """(sizes, index): sizes cut the gathered buffer into gaps and parameters in order;
        ``index[i]`` is parameter i's piece among them."""
        sizes, index, end = [], [], 0
        for o, n in zip(self.offsets, self.numels):
            if o > end:
                sizes.append(o - end)
            index.append(len(sizes))
            sizes.append(n)
            end = o + n
        if self.total > end:
            sizes.append(self.total - end)
        return sizes, index

    def gather(self, local: torch.Tensor, group: dist.ProcessGroup | str, grad_scale: float = 1.0,
               annotation: dict | None = None, precision: Precision | None = None,
               replicas: str | None = None,
               route: Callable[[torch.Tensor], torch.Tensor] | None = None,
               pending: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Every parameter of the bucket, full, as a view of one all-gather of ``local`` (this
        rank's ``[L]``) over ``group`` (or its name). Differentiable: the gradient of ``local`` is the
        reduce-scatter (sum over ranks) of the parameters' gradients laid out as the bucket,
        times ``grad_scale``. Traces under ``torch.compile`` as one all-gather, one split and
        views; the collectives (and the backward's scaling) carry ``annotation``, so the
        graph passes find them as they find a parameter's (passes/annotations.py).
        ``precision``: the dtypes of the gather and of the reduction (mixed precision).
        ``replicas``: the name of a group holding replicas of this rank's range (HSDP): the
        reduce-scatter's output is then summed over it too (one all-reduce). ``route``: what
        the gathered buffer passes through before the split (gradient-sync control,
        simplesharded/storage/grad_sync.py, sends its gradient elsewhere). ``pending``: this
        gather already issued (:func:`issue_gather`, an eager prefetch): only waited here."""
        if local.shape != (self.shard_numel,):
            raise ValueError(f"RaggedLayout.gather: local has shape {tuple(local.shape)}, "
                             f"expected ({self.shard_numel},)")
        annotation = annotation or {}
        # the split and views annotated too: they are the gather's chain, which the recompute
        # pass redoes in backward with the gather (passes/recompute.py)
        with fx_traceback.annotate(annotation):
            name = group if isinstance(group, str) else group.group_name
            full = _Gather.apply(local, self.world, name, grad_scale, annotation,
                                 precision or Precision(), replicas, pending)
            if route is not None:
                full = route(full)
            return self.views(full)

    def views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Every parameter of the bucket as a view of ``full``, a gathered ``[w·L]``."""
        sizes, index = self.split_sizes()
        pieces = full.split(sizes)
        return [pieces[j].view(s) for j, s in zip(index, self.shapes)]


@dataclass(frozen=True)
class Precision:
    """A gather's dtypes, as DTensor's ``redistribute(forward_dtype=, backward_dtype=)``
    takes them: the gather in ``gather_dtype`` (None: the shard's), the reduction in
    ``reduce_dtype`` (None: the shard's), its result in the shard's dtype. ``scale_first``:
    the gradient is scaled before its reduction (a float16 sum over ranks could overflow),
    otherwise after it, on the shard."""

    gather_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    scale_first: bool = False

    def reduction_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a bucket of ``dtype`` has its gradient reduced (and no-sync sums kept)
        in: a parameter's rule (sharded_state.reduction_dtype)."""
        return reduction_dtype(self.reduce_dtype, self.gather_dtype, dtype)


class _Gather(torch.autograd.Function):
    """All-gather on dim 0 whose backward is the reduce-scatter (sum) scaled, both under the
    bucket's annotation (the backward is traced after the forward's annotation has ended, so
    it sets its own). The casts of mixed precision are the only copies. ``pending``: the
    gather of ``local`` already issued (an eager prefetch), waited here instead."""

    @staticmethod
    def forward(ctx, local, world, group_name, grad_scale, annotation, precision, replicas,
                pending):
        ctx.world, ctx.group_name, ctx.dtype = world, group_name, local.dtype
        ctx.replicas = replicas
        ctx.grad_scale, ctx.annotation, ctx.precision = grad_scale, annotation, precision
        if pending is not None:
            return _c10d.wait_tensor(pending)
        return gather_buffer(local, world, group_name, precision)

    @staticmethod
    def backward(ctx, grad):
        with fx_traceback.annotate(ctx.annotation):
            out = reduce_gathered(grad, ctx.world, ctx.group_name, ctx.dtype, ctx.grad_scale,
                                  ctx.precision, ctx.replicas)
            return out, None, None, None, None, None, None, None


def issue_gather(local: torch.Tensor, world: int, group_name: str,
                 precision: Precision) -> torch.Tensor:
    """The all-gather of :func:`gather_buffer` issued and not waited: its result is defined
    only after ``wait_tensor`` (an eager prefetch holds it until its bucket is read; on a GPU
    the gather then runs on the collective stream under the compute queued before it is
    waited)."""
    if precision.gather_dtype is not None:
        local = local.to(precision.gather_dtype)
    return _c10d.all_gather_into_tensor(local, world, group_name)


def gather_buffer(local: torch.Tensor, world: int, group_name: str,
                  precision: Precision) -> torch.Tensor:
    """A bucket's gathered ``[w·L]`` from this rank's ``[L]``: cast to the gather's dtype (the
    only copy), then one all-gather over ``group_name``. The gather's forward; without
    autograd, ``gather_once``'s held buffer and eager resharding's re-gather in backward."""
    return _c10d.wait_tensor(issue_gather(local, world, group_name, precision))


def reduce_gathered(grad: torch.Tensor, world: int, group_name: str, dtype: torch.dtype,
                    grad_scale: float, precision: Precision, replicas: str | None
                    ) -> torch.Tensor:
    """This rank's ``[L]`` of the gradient of a gathered ``[w·L]`` buffer: the reduce-scatter
    (sum) over ``group_name``, all-reduced over ``replicas`` (HSDP), in ``dtype``, scaled by
    ``grad_scale`` before or after the sum as ``precision`` says. The gather's backward, and a
    pipeline stage's deferred reduction of a bucket's accumulated gradient."""
    if precision.scale_first and grad_scale != 1.0:
        grad = grad * grad_scale
    grad = grad.to(precision.reduce_dtype or dtype).contiguous()
    out = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(grad, "sum", world, group_name))
    if replicas is not None:
        out = _c10d.wait_tensor(_c10d.all_reduce(out, "sum", replicas))
    out = out.to(dtype)
    if not precision.scale_first and grad_scale != 1.0:
        out = out * grad_scale
    return out


def collective_on_concat(pieces: Iterable[torch.Tensor],
                         collective: Callable[[torch.Tensor], torch.Tensor],
                         sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """One ``collective`` for many tensors: ``pieces`` laid end to end on their last dim in
    one buffer, the collective run once on it, its result cut back on its last dim into
    ``sizes`` (views). Pieces given as a generator are freed before the collective runs."""
    buffer = torch.cat(list(pieces), dim=-1)
    return collective(buffer).split(sizes, dim=-1)


def to_ragged(locals_: list[torch.Tensor], layout: RaggedLayout,
              group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's ragged range ``[L]`` from its ``Shard(0)`` local of every parameter (one
    all-to-all over ``group``; gaps are zero)."""
    me = dist.get_rank(group)
    _check_locals(locals_, layout, me)
    flats = [t.reshape(-1) for t in locals_]
    starts = [layout.shard0_piece(i, me)[0] for i in range(len(flats))]
    outgoing = [_shared(layout, me, dst) for dst in range(layout.world)]
    incoming = [_shared(layout, src, me) for src in range(layout.world)]
    send = [flats[i][a - starts[i]:b - starts[i]] for pieces in outgoing for i, a, b in pieces]
    arriving, received = _exchange(send, outgoing, incoming, group)
    out = received[0].new_zeros(layout.shard_numel)
    lo = layout.rank_range(me)[0]
    for (i, a, b), part in zip(arriving, received):
        at = layout.offsets[i] + a - lo
        out[at:at + b - a] = part
    return out


def from_ragged(local: torch.Tensor, layout: RaggedLayout,
                group: dist.ProcessGroup) -> list[torch.Tensor]:
    """This rank's ``Shard(0)`` local of every parameter (shaped as DTensor shapes it) from
    its ragged range ``[L]`` (one all-to-all over ``group``): the inverse of :func:`to_ragged`."""
    me = dist.get_rank(group)
    if local.shape != (layout.shard_numel,):
        raise ValueError(f"from_ragged: local has shape {tuple(local.shape)}, expected "
                         f"({layout.shard_numel},)")
    lo = layout.rank_range(me)[0]
    outgoing = [_shared(layout, dst, me) for dst in range(layout.world)]
    incoming = [_shared(layout, me, src) for src in range(layout.world)]
    send = [local[layout.offsets[i] + a - lo:layout.offsets[i] + b - lo]
            for pieces in outgoing for i, a, b in pieces]
    arriving, received = _exchange(send, outgoing, incoming, group)
    outs, starts = [], []
    for i, shape in enumerate(layout.shapes):
        rows = layout.shard0_rows(shape[0], me)
        outs.append(received[0].new_empty((rows[1] - rows[0], *shape[1:])))
        start, stop = layout.shard0_piece(i, me)
        assert outs[-1].numel() == stop - start
        starts.append(start)
    for (i, a, b), part in zip(arriving, received):
        outs[i].view(-1)[a - starts[i]:b - starts[i]] = part
    return outs


def _shared(layout: RaggedLayout, shard0_rank: int, ragged_rank: int
            ) -> list[tuple[int, int, int]]:
    """(i, start, stop) for every parameter i: the elements that ``shard0_rank``'s
    ``Shard(0)`` local and ``ragged_rank``'s ragged range both hold (start == stop: none), in
    parameter order: what one rank sends another, in the order the other receives it."""
    return [(i, *_overlap(layout.shard0_piece(i, shard0_rank), layout.piece(i, ragged_rank)))
            for i in range(len(layout.shapes))]


def _sizes(exchange: list[list[tuple[int, int, int]]]) -> list[int]:
    """Elements per peer of an exchange built with :func:`_shared`."""
    return [sum(b - a for _, a, b in pieces) for pieces in exchange]


def _overlap(x: tuple[int, int], y: tuple[int, int]) -> tuple[int, int]:
    a, b = max(x[0], y[0]), min(x[1], y[1])
    return a, max(a, b)


def _check_locals(locals_: list[torch.Tensor], layout: RaggedLayout, rank: int) -> None:
    if len(locals_) != len(layout.shapes):
        raise ValueError(f"to_ragged: {len(locals_)} tensors for a layout of "
                         f"{len(layout.shapes)} parameters")
    for i, (t, shape) in enumerate(zip(locals_, layout.shapes)):
        start, stop = layout.shard0_rows(shape[0], rank)
        want = (stop - start, *shape[1:])
        if tuple(t.shape) != want:
            raise ValueError(f"to_ragged: parameter {i} has local shape {tuple(t.shape)}; "
                             f"Shard(0) of {shape} on rank {rank} of {layout.world} is {want}")


def _exchange(send: list[torch.Tensor], outgoing: list, incoming: list,
              group: dist.ProcessGroup) -> tuple[list, tuple[torch.Tensor, ...]]:
    """One all-to-all over ``group`` of ``send``, the pieces of ``outgoing`` (built with
    :func:`_shared`) peer by peer: the pieces of ``incoming`` in order, and what arrived for
    each."""
    arriving = [p for pieces in incoming for p in pieces]

    def all_to_all(buf):
        out = buf.new_empty(sum(_sizes(incoming)))
        dist.all_to_all_single(out, buf.contiguous(), _sizes(incoming), _sizes(outgoing),
                               group=group)
        return out

    return arriving, collective_on_concat(send, all_to_all, [b - a for _, a, b in arriving])
