"""A parameter of a ragged bucket as users see it: :class:`RaggedMember`.

A parameter in a ragged bucket (simplesharded/storage/ragged.py) is, on each rank of the mesh
dim the bucket is cut over (or of two dims, flattened row-major), a contiguous run of its
flattened elements, of any length (possibly none). What ``named_parameters()`` and the optimizer
hold is a ``RaggedMember``: a DTensor with the parameter's global shape and the placements it
has on per-parameter storage (``Shard(0)`` on each cut dim), whose local tensor is this rank's
run, a 1-D view of the bucket's local range. The runs' lengths live on the tensor, not in a
placement: DTensor's dispatch caches sharding decisions by placement, so a placement that
carried them would hand one tensor's runs to another of the same shape. DTensor computes on the
local tensors as for ``Shard(0)``, which is right for what optimizers and ``clip_grad_norm_``
do:

- elementwise ops (every torch optimizer's update, ``zeros_like`` for its state) run on the
  local runs; a result laid out as a member (same global shape, placements and local size)
  is a ``RaggedMember`` of the same runs, so optimizer state is one too;
- reductions (``vector_norm``, ``sum``) are partial per rank and reduced over the mesh, as
  for ``Shard(0)``: a sum of the runs' partial results, whatever their lengths; ``any()`` and
  ``all()`` of the whole member are reduced at once (``reduce_whole``);
- in-place random fills draw the full tensor and keep the run (``fill_random``), and a view
  as the member's own shape is a member (``same_view``): DTensor would take the run for a
  ``Shard(0)`` chunk in both;
- an op pairing a member with a plain DTensor chunked where the member is cut is one
  ``ValueError`` (``_refuse_chunks``);
- ``full_tensor()`` and ``redistribute`` to ``Replicate()`` gather the runs in rank order;
  any other redistribution raises one line (on every rank alike);
- DCP saves and loads it as up to ``2·ndim - 1`` boxes of the global tensor per rank (a run
  of row-major elements), so optimizer state checkpoints load at any world size or storage.

An op that makes DTensor move a member's data itself (a matmul of a member with a replicated
tensor, say) would treat the run as a ``Shard(0)`` chunk: gather with ``full_tensor()``
first.

Before torch 2.12 DTensor's C++ dispatch never calls a subclass's ``__torch_dispatch__``: there
the same rewrapping runs in ``__torch_function__`` (passes/torch_compat.py:
``dtensor_subclass_dispatch``), on each op's result as the C++ path computed it.

Invariant: a member's runs are the bucket layout's, a function of global shapes and the world
size, so every rank holds the same runs.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.optim.optimizer import _foreach_supported_types as _optim_foreach_types
from torch.utils._foreach_utils import _foreach_supported_types as _util_foreach_types
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from simplesharded.passes.torch_compat import dtensor_subclass_dispatch

# all_gather_tensor's name from 2.13 on (the old one warns there); the same op
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor

REFUSAL = ("a parameter in a ragged bucket holds a ragged run of its elements: it gathers "
           "with full_tensor() or redistribute(placements=[Replicate()]) only; "
           "state_dict() gives it as a per-parameter Shard(0) DTensor")


@dataclass(frozen=True)
class Cut:
    """The mesh dims a member's runs are cut over, and the process group that gathers them:
    one dim (``group`` None: that dim's), or two whose ranks are flattened row-major (the
    order of DTensor's nested ``Shard(0)``), gathered over ``group``, the name of a group of
    all of them in that order (simplesharded/mesh.py: ``flat_dp_mesh``)."""

    dims: tuple[int, ...]
    group: str | None = None

    def rank(self, mesh) -> int:
        """This rank's place among the cut dims' ranks: row-major over its coordinates."""
        out = 0
        for d in self.dims:
            out = out * mesh.size(d) + mesh.get_local_rank(d)
        return out

    def group_of(self, mesh):
        """The group a gather of the runs goes over (a name, or a mesh dim)."""
        return self.group if self.group is not None else (mesh, self.dims[0])


class RaggedMember(DTensor):
    """A DTensor whose local tensor is this rank's run of the flattened tensor (of what the
    cut dims' gather rebuilds: the whole tensor, or its TP shard); rank r of the mesh dims
    ``cut`` (flattened row-major) holds ``runs[r]`` elements, in rank order."""

    runs: tuple[int, ...]
    cut: Cut

    @staticmethod
    def make(local: torch.Tensor, spec, runs: Sequence[int], cut: "Cut | int",
             requires_grad: bool = False) -> "RaggedMember":
        out = DTensor.__new__(RaggedMember, local, spec, requires_grad=requires_grad)
        out.runs, out.cut = tuple(runs), Cut((cut,)) if isinstance(cut, int) else cut
        return out

    def as_dtensor(self) -> DTensor:
        """The same local run and spec as a plain DTensor (what DTensor computes on), made
        once per local tensor: an optimizer's every foreach op unwraps every member."""
        plain = self.__dict__.get("_plain")
        if plain is None or plain[0] is not self._local_tensor:
            plain = self._local_tensor, DTensor(self._local_tensor.detach(), self._spec,
                                                requires_grad=False)
            self.__dict__["_plain"] = plain
        return plain[1]

    def __deepcopy__(self, memo):
        """A copy of the run, with the same runs (an optimizer's state, deep-copied with its
        optimizer; a model's members are copied with their bucket instead:
        ragged_shards.py's ``copy_into``). Torch's default clones through the subclass's
        dispatch, which before 2.12 gives a plain DTensor."""
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            out = RaggedMember.make(self._local_tensor.clone(), self._spec, self.runs,
                                    self.cut, requires_grad=self.requires_grad)
        if isinstance(self, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=self.requires_grad)
        memo[id(self)] = out
        return out

    def __repr__(self) -> str:
        return (f"RaggedMember(local_tensor={self._local_tensor}, device_mesh="
                f"{self._spec.mesh}, placements={self._spec.placements}, runs={self.runs})")

    def fill_random(self, func, args=(), kwargs=None) -> "RaggedMember":
        """``func``, an in-place random op (``normal_``, ``uniform_``, ...), on this member:
        drawn on a full temporary of its global shape from the default generator, of which
        this rank keeps its run. So every rank's run is its part of one draw (with
        generators seeded alike), as for the unsharded tensor, where DTensor's own random ops
        would draw for a ``Shard(0)`` chunk, not this run: the same numbers on every rank
        on CPU, overlapping offsets with CUDA's tracker. With ``reduce_whole`` (the
        resampling test of ``trunc_normal_``), a model's init after sharding gives the
        unsharded model's values."""
        full = torch.empty(self.shape, dtype=self.dtype, device=self._local_tensor.device)
        func(full, *args, **(kwargs or {}))
        with torch.no_grad():
            self._local_tensor.copy_(self.run_from(full))
        return self

    def same_view(self, shape) -> "RaggedMember | None":
        """A view of this member as its own shape (``view_as(self)``: autograd's and
        ``swap_tensors``' way to a leaf's gradient edge), or None for another shape. DTensor
        would view the run as a ``Shard(0)`` chunk's shape, which it is not."""
        if tuple(shape) != tuple(self.shape):
            return None
        return RaggedMember.make(self._local_tensor.view(self._local_tensor.shape), self._spec,
                                 self.runs, self.cut)

    def reduce_whole(self, func, op: str) -> DTensor | None:
        """``any()`` / ``all()`` of the whole member: its run's, reduced over the cut ranks by
        ``op`` (one all-reduce, as DTensor's own reduction would make every rank join), and
        replicated. DTensor would take the run for a ``Shard(0)`` chunk (torch 2.15 gathers it
        as one) or leave each rank its own run's answer (2.13: ``bool()`` of the ``Partial``
        result reads the local value), so ``trunc_normal_``'s resampling would loop a
        per-rank number of times. None (DTensor's way) for a member also sharded on a dim
        it is not cut over (a TP shard)."""
        mesh = self._spec.mesh
        if any(p.is_shard() for d, p in enumerate(self._spec.placements)
               if d not in self.cut.dims):
            return None
        local = func(self._local_tensor).to(torch.int32)
        total = funcol.wait_tensor(funcol.all_reduce(local, op, self.cut.group_of(mesh)))
        return DTensor.from_local(total.bool(), mesh, [Replicate()] * mesh.ndim,
                                  run_check=False)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        own = _own_op(func)
        if own and isinstance(args[0], RaggedMember):
            if own == "random":
                return args[0].fill_random(func, args[1:], kwargs)
            done = (args[0].same_view(args[1]) if own == "view"
                    else args[0].reduce_whole(func, own))
            if done is not None:
                return done
        if not kwargs and not any(isinstance(a, (list, tuple, dict)) for a in args):
            # one tensor op (an optimizer's per-parameter path on CPU): no pytree
            first = next((a for a in args if isinstance(a, RaggedMember)), None)
            for a in args:
                if type(a) is DTensor:  # a plain one: it may pair with the member (rare)
                    _refuse_pair(func, args)
                    break
            plain = [a.as_dtensor() if isinstance(a, RaggedMember) else a for a in args]
            out = func(*plain)
            if type(out) is DTensor:
                for a, p in zip(args, plain):
                    if out is p:  # in place: the member itself
                        return a
                return _rewrap(out, first, {})
            if isinstance(out, (list, tuple)) and any(type(o) is DTensor for o in out):
                member_of = {id(p): a for a, p in zip(args, plain) if p is not a}
                return type(out)(_rewrap(o, first, member_of) for o in out)
            return out
        flat, tree = tree_flatten((args, kwargs or {}))
        _refuse_chunks(func, args, kwargs)
        plain = [t.as_dtensor() if isinstance(t, RaggedMember) else t for t in flat]
        # a plain DTensor an op returns as it is (in place, out=) stands for its member
        member_of = {id(p): t for t, p in zip(flat, plain) if p is not t}
        call_args, call_kwargs = tree_unflatten(plain, tree)
        return _as_members(func(*call_args, **call_kwargs), args, flat, member_of)

    def _gathered(self) -> DTensor:
        """Every rank's run laid end to end (one all-gather of the longest run's length on
        every rank), as the DTensor the cut dims' gather rebuilds: ``Replicate()`` there."""
        mesh = self._spec.mesh
        longest = max(self.runs)
        run = self._local_tensor.reshape(-1)
        run = torch.nn.functional.pad(run, (0, longest - run.numel()))
        gathered = _all_gather(run, gather_dim=0, group=self.cut.group_of(mesh))
        gathered = funcol.wait_tensor(gathered)
        pieces = [gathered[r * longest:r * longest + n] for r, n in enumerate(self.runs)]
        placements, shape, _ = self._rebuilt()
        return DTensor.from_local(torch.cat(pieces).view(shape), mesh, placements,
                                  run_check=False, shape=self.shape, stride=self.stride())

    def _rebuilt(self) -> tuple[list, tuple, tuple]:
        """What the cut dims' gather rebuilds: its placements (``Replicate()`` on the cut
        dims), and this rank's shape and global offset of it (the whole tensor, or a TP shard)."""
        placements = list(self._spec.placements)
        for d in self.cut.dims:
            placements[d] = Replicate()
        shape, offset = compute_local_shape_and_global_offset(self.shape, self._spec.mesh,
                                                              placements)
        return placements, tuple(shape), tuple(offset)

    def redistribute(self, device_mesh=None, placements=None, *, async_op=False, **kwargs):
        mesh = device_mesh or self.device_mesh
        if (mesh != self.device_mesh or placements is None
                or not all(p.is_replicate() for p in placements)):
            raise ValueError(REFUSAL)
        return self._gathered().redistribute(mesh, placements, async_op=async_op, **kwargs)

    def full_tensor(self, *, grad_placements=None) -> torch.Tensor:
        return self._gathered().full_tensor(grad_placements=grad_placements)

    # DCP: a run as boxes of the global tensor.
    def _boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...], int, int]]:
        """This rank's run as (global offsets, sizes, start, stop) boxes: ``start:stop`` of
        the local run fills the box, row-major."""
        _, shape, offset = self._rebuilt()
        me = self.cut.rank(self._spec.mesh)
        first = sum(self.runs[:me])
        return [(tuple(o + b for o, b in zip(offset, box_offset)), sizes, start - first,
                 stop - first)
                for box_offset, sizes, start, stop in _row_major_boxes(
                    shape, first, first + self.runs[me])]

    def __create_write_items__(self, fqn: str, object):
        from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata,
                                                           MetadataIndex, TensorProperties)
        from torch.distributed.checkpoint.planner import (TensorWriteData, WriteItem,
                                                          WriteItemType)
        props = TensorProperties.create_from_tensor(self._local_tensor)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)),
                          type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                         sizes=torch.Size(sizes)),
                              properties=props, size=self.size()))
                for offsets, sizes, _, _ in self._boxes()]

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                for offsets, sizes, _, _ in self._boxes()]

    def run_from(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's run of ``full``, a tensor of the member's global shape (a full state
        dict's value): its boxes read in element order, on ``full``'s device. No
        collective: every rank holds ``full``."""
        pieces = [full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].reshape(-1)
                  for offsets, sizes, _, _ in self._boxes()]
        return torch.cat(pieces) if pieces else full.new_empty(0)

    def __get_tensor_shard__(self, index):
        for offsets, sizes, start, stop in self._boxes():
            if index.offset is None or torch.Size(offsets) == index.offset:
                return self._local_tensor.reshape(-1)[start:stop].view(sizes)
        raise ValueError(f"{index.fqn}: no box of this rank's run at {index.offset}")


# torch.load's default (weights_only) unpickler takes an optimizer state dict holding members
torch.serialization.add_safe_globals([RaggedMember, Cut])

# As DTensor registers itself: optimizers and clip_grad_norm_ take their foreach paths (one op
# per step for all members) only for types listed here, and step one tensor at a time
# otherwise (about ten ops per member).
for _supported in (_optim_foreach_types, _util_foreach_types):
    if RaggedMember not in _supported:
        _supported.append(RaggedMember)


_RANDOM_IN_PLACE = frozenset({"uniform_", "normal_", "bernoulli_", "exponential_", "random_",
                              "log_normal_", "cauchy_", "geometric_"})


def _own_op(func) -> str:
    """What a member does itself rather than through DTensor: "random" (``fill_random``: an
    in-place random fill, an aten op by its packet's name or, before 2.12, the method), "view"
    (``same_view``), "max" / "min" (``reduce_whole``: ``any()`` / ``all()``), or "" for every
    other op. Worked out once per op (an optimizer calls a few, many times)."""
    own = _OWN_OPS.get(func)
    if own is None:
        aten = torch.ops.aten
        name = getattr(getattr(func, "overloadpacket", func), "__name__", "")
        own = _OWN_OPS[func] = "random" if name in _RANDOM_IN_PLACE else {
            aten.view.default: "view", aten.any.default: "max",
            aten.all.default: "min"}.get(func, "")
    return own


_OWN_OPS: dict = {}


def _refuse_chunks(func, args, kwargs=None) -> None:
    """A ValueError when an op pairs a member with a plain DTensor sharded where the member is
    cut and laid out otherwise (``distribute_tensor``'s ``Shard(0)`` chunk of a matrix, say):
    DTensor would pair the member's run with the other's chunk, different elements, silently
    where they broadcast. One laid out as the member (its local tensor the run's shape: a
    gradient made from a member's local tensor) pairs as a member does. A foreach
    op pairs its lists' tensors by index (a list of members and per-parameter shards, as
    ``clip_grad_norm_`` takes, pairs nothing). Every rank raises alike: whether it does
    depends on placements only."""
    lists = [a for a in args if isinstance(a, (list, tuple))]
    single = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
    if not any(type(t) is DTensor for t in (*single, *(t for a in lists for t in a))):
        return  # members only (an optimizer's every op): nothing to pair
    for paired in (zip(*lists) if lists else [()]):
        _refuse_pair(func, [*paired, *single])


def _refuse_pair(func, tensors) -> None:
    member = next((t for t in tensors if isinstance(t, RaggedMember)), None)
    if member is None:
        return
    for t in tensors:
        if (type(t) is DTensor and t.ndim and t.device_mesh == member.device_mesh
                and any(t.placements[d].is_shard() for d in member.cut.dims)
                and t._local_tensor.shape != member._local_tensor.shape):
            name = getattr(func, "__name__", func)
            raise ValueError(
                f"{name}: a parameter in a ragged bucket (its local tensor a run of its "
                f"elements) mixed with a DTensor sharded as {tuple(t.placements)} (chunks): "
                f"write parameters within `with simplesharded.disable_gather(model):`, where "
                f"they are per-parameter Shard(0) DTensors, or load them with load_state_dict")


def _as_members(out, args, flat, member_of: dict, in_place: bool = False):
    """An op's result with each DTensor laid out as a member made a ``RaggedMember`` of its
    runs: for a foreach op the member at its index in the first list argument holding one,
    else the first member among the arguments (``flat``). By position, not by shape: two
    members of one shape have different runs."""
    lists = [a for a in args if isinstance(a, (list, tuple))
             and any(isinstance(t, RaggedMember) for t in a)]
    if isinstance(out, (list, tuple)) and lists:
        return type(out)(_rewrap(o, next((l[i] for l in lists if i < len(l)), None),
                                 member_of, in_place) for i, o in enumerate(out))
    first = next((t for t in flat if isinstance(t, RaggedMember)), None)
    return tree_map(lambda o: _rewrap(o, first, member_of, in_place), out)


def _torch_function(cls, func, types, args=(), kwargs=None):
    """Where DTensor's C++ dispatch computes a subclass's ops without its
    ``__torch_dispatch__`` (torch before 2.12), a member's results are made members here, one
    level up, as that dispatch would: each op runs as on a DTensor (``Shard(0)`` on the local
    runs), and a result laid out as a member takes its runs."""
    kwargs = kwargs or {}
    if _own_op(func) == "random" and args and isinstance(args[0], RaggedMember):
        return args[0].fill_random(func, args[1:], kwargs)
    _refuse_chunks(func, args, kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **kwargs)
    if func in torch.overrides.get_default_nowrap_functions():  # .grad and the like as they are
        return out
    return _as_members(out, args, tree_flatten((args, kwargs))[0], {}, in_place=True)


def _rewrap(out, member, member_of: dict, in_place: bool = False):
    """``out`` as a ``RaggedMember`` of ``member``'s runs when it is laid out as ``member``
    (global shape, placements, local size); the member itself when ``out`` is its plain face.
    ``in_place``: ``out`` itself made one (its class changed), keeping its autograd history,
    which a new wrapper above autograd would lose."""
    if type(out) is not DTensor:
        return out
    if id(out) in member_of:
        return member_of[id(out)]
    if (isinstance(member, RaggedMember) and out.shape == member.shape
            and out._spec.placements == member._spec.placements
            and out._local_tensor.numel() == member._local_tensor.numel()):
        if not in_place:
            return RaggedMember.make(out._local_tensor, out._spec, member.runs, member.cut)
        out.__class__ = RaggedMember
        out.runs, out.cut = member.runs, member.cut
    return out


def _row_major_boxes(shape: tuple[int, ...], start: int, stop: int):
    """Elements ``start:stop`` of a row-major tensor of ``shape`` as boxes: (offsets, sizes,
    start, stop), at most ``2·len(shape) - 1`` of them, in element order."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,), start, stop)]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row
    boxes = []

    def within(r: int, lo: int, hi: int):
        for offs, sizes, s, e in _row_major_boxes(shape[1:], lo - r * row, hi - r * row):
            boxes.append(((r,) + offs, (1,) + sizes, s + r * row, e + r * row))

    if start % row or first == last:
        within(first, start, min(stop, (first + 1) * row))
        first += 1
    full_stop = last if stop % row else last + 1
    if full_stop > first:
        boxes.append(((first,) + (0,) * (len(shape) - 1), (full_stop - first,) + shape[1:],
                      first * row, full_stop * row))
    if stop % row and last >= first:
        within(last, last * row, stop)
    return boxes


if not dtensor_subclass_dispatch():
    RaggedMember.__torch_function__ = classmethod(_torch_function)
