"""Reshard after forward without torch.compile (FSDP2's memory behaviour), through
saved-tensor hooks.

Autograd saves what backward needs, and for ``linear(x, w)`` that is ``w`` (a view of it):
left alone, every gathered parameter would live until backward. During one uncompiled root
forward with grad, every gather is registered here by the storage of its full tensor, and
saved-tensor hooks pack a saved tensor that aliases such a storage as a small record (which
parameter, which view of it); its unpack gathers the parameter again from the shard and
rebuilds the same view. A gathered parameter then dies when its modules are done with it,
and backward holds one re-gathered parameter per running autograd node.

Invariant: every rank issues its re-gathers in the same order. An unpack hook runs when the
autograd engine runs the node that saved the tensor, and the engine orders nodes by the graph
alone (dependencies, then creation order); every rank built the same graph by running the
same forward, and the reduce-scatters of the gradients are issued from those same nodes.

A ragged bucket (simplesharded/storage/ragged_shards.py) is one gather whose members are views of
it: its tensors saved in forward are packed as views of the bucket, and backward gathers the
bucket once, at the first unpack of one of them, and drops it at the last (FSDP2's unit:
a block's parameters are gathered for the block's backward). At that first unpack the gather
of the bucket forward gathered before it (the next one backward needs) is issued, and waited
for at its own first unpack (simplesharded/storage/prefetch.py, which holds the gathers issued
ahead and drops one the backward never reads when it ends).

``keep`` (``reshard_after_forward="auto"``) saves the tensor itself: the compiled plans'
rule (passes/recompute.py), read per module: a parameter read in the last block, or outside
every block after a block has run, stays gathered for backward, which needs it first. A tied
parameter is decided by its latest read (the compiled plan's "last use").
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

from simplesharded.storage.gather import _GatherScope, regather
from simplesharded.storage.sharded_state import RaggedBucketProtocol, sharded_state


class _Gathered:
    """One eager gather whose full tensor autograd may save: how to gather it again.
    ``shared`` (a ragged bucket, whose members are saved separately): backward's re-gather
    is held from the first unpack of a tensor saved from it to the last."""

    __slots__ = ("again", "label", "storage", "nbytes", "dtype", "keep", "shared", "packs",
                 "left", "held", "issue", "ahead", "unpacked", "before")

    def __init__(self, again: Callable[[], torch.Tensor], label: str, local: torch.Tensor,
                 keep: bool, shared: bool, issue: Callable[[], torch.Tensor] | None = None,
                 before: "_Gathered | None" = None, ahead=None):
        self.again, self.label, self.keep, self.shared = again, label, keep, shared
        self.storage = StorageWeakRef(local.untyped_storage())
        self.nbytes = local.untyped_storage().nbytes()
        self.dtype = local.dtype
        self.packs = self.left = 0  # tensors packed as views of it; of those, not unpacked
        self.held: torch.Tensor | None = None
        # a bucket's: how to issue its gather; the gathers issued ahead (prefetch.py, by
        # bucket name); the bucket gathered before it in forward; whether backward gathered it
        self.issue, self.ahead, self.unpacked, self.before = issue, ahead, False, before

    def gather(self) -> torch.Tensor:
        if not self.shared:
            with torch.no_grad():
                return self.again()
        if self.held is None:
            pending = self.ahead.take(self.label)
            with torch.no_grad():
                self.held = (self.again() if pending is None
                             else torch.ops._c10d_functional.wait_tensor(pending))
            self.left = self.packs
            if not self.unpacked:
                self.unpacked = True
                prefetch(self.before)
        full = self.held
        self.left -= 1
        if self.left <= 0:  # the last saved view unpacked (each is unpacked once per backward)
            self.held = None
        return full


def prefetch(g: _Gathered | None) -> None:
    """The gather of ``g`` or, if backward will not gather it again (nothing of it packed,
    kept, or gathered already), of the nearest bucket forward gathered before it that backward
    will, issued now (unless it is already)."""
    while g is not None and (g.keep or not g.packs or g.unpacked):
        g = g.before
    if g is not None:
        g.ahead.issue(g.label, g.issue)


class _Packed:
    """A saved tensor that aliased a gathered parameter: its view of the gathered storage."""

    __slots__ = ("source", "size", "stride", "offset", "dtensor")

    def __init__(self, source: _Gathered, local: torch.Tensor, dtensor: tuple | None):
        self.source = source
        self.size, self.stride = local.size(), local.stride()
        self.offset = local.storage_offset()
        self.dtensor = dtensor  # (mesh, placements, shape, stride) of a saved DTensor


def _local(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor holding ``t``'s data (a DTensor's local tensor), or None for other
    tensor subclasses (e.g. a collective's pending result), which are saved as they are."""
    if type(t) is DTensor:
        t = t.to_local()  # pack hooks run without grad: this is the local tensor itself
    return t if type(t) in (torch.Tensor, nn.Parameter) else None


class _EagerReshard:
    """One uncompiled root forward's gathers, and the saved-tensor hooks that re-gather them
    in backward (module doc)."""

    def __init__(self, scope: _GatherScope):
        self.scope = scope
        self.by_storage: dict[int, _Gathered] = {}  # data_ptr → live gathered storage
        self.seen_block = False
        self.last_bucket: _Gathered | None = None  # the bucket gathered last (a chain back)
        self.unpacking = False  # a backward has unpacked a saved tensor

    def note(self, module: nn.Module, name: str, full: torch.Tensor) -> None:
        """A parameter of ``module`` was read and is ``full`` (new or a cached tied gather)."""
        local = _local(full)
        if local is None or local.numel() == 0:
            return  # nothing to free (or a layout we do not rebuild): autograd keeps it
        state = sharded_state(module)
        self._note(local, state.read_block, state.params[name].fqn,
                   lambda: regather(module, name), shared=False)

    def note_bucket(self, bucket: RaggedBucketProtocol, member: torch.Tensor) -> None:
        """Ragged ``bucket`` was gathered; ``member`` is one of its views (the storage of all)."""
        self._note(member, bucket.block, bucket.name, bucket.gather_whole, shared=True,
                   issue=bucket.issue_whole)

    def _note(self, local: torch.Tensor, block: str | None, label: str,
              again: Callable[[], torch.Tensor], shared: bool,
              issue: Callable[[], torch.Tensor] | None = None) -> None:
        self.seen_block = self.seen_block or block is not None
        keep = False
        if self.scope.reshard_after_forward == "auto" and self.scope.last_block is not None:
            keep = block == self.scope.last_block or (block is None and self.seen_block)
        ptr = local.untyped_storage().data_ptr()
        known = self.by_storage.get(ptr)
        if known is not None and not known.storage.expired():
            known.keep = keep  # the same gathered tensor read again: its latest read decides
        elif shared:
            self.by_storage[ptr] = self.last_bucket = _Gathered(
                again, label, local, keep, shared, issue, self.last_bucket,
                self.scope.prefetch)
        else:
            self.by_storage[ptr] = _Gathered(again, label, local, keep, shared)

    def __deepcopy__(self, memo):
        return None  # a copy of the model has run no forward

    def abandon(self) -> None:
        """The backward of this forward will not run on (an exception aborted it): buffers
        held for it dropped (the gathers issued ahead are the scope's: prefetch.py)."""
        g = self.last_bucket
        while g is not None:
            g.held = None
            g = g.before
        for g in self.by_storage.values():
            g.held = None

    def pack(self, t: torch.Tensor):
        source, local = None, _local(t)
        if local is not None:
            try:
                ptr = local.untyped_storage().data_ptr()
            except RuntimeError:  # no storage to look at (fake, functional): not ours
                ptr = 0
            source = self.by_storage.get(ptr) if ptr else None
        # A live weak reference to that storage means it is the gathered one (two live
        # storages never share a data pointer); a dtype view of it is saved as it is.
        if (source is None or source.keep or source.storage.expired()
                or local.dtype != source.dtype):
            # Saved as it is. Detached: the tensor itself would hold its grad_fn, which holds
            # this saved value (a cycle that leaks a graph dropped without backward). With
            # hooks autograd no longer checks in-place changes to it: unpack does.
            return t.detach(), t._version
        dtensor = (t.device_mesh, t.placements, t.shape, t.stride()) if type(t) is DTensor \
            else None
        source.packs += 1
        return _Packed(source, local, dtensor)

    def unpack(self, packed):
        if not self.unpacking:  # backward starts: the first bucket it gathers again, issued
            self.unpacking = True
            prefetch(self.last_bucket)
        if not isinstance(packed, _Packed):
            t, version = packed
            if t._version != version:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified "
                    f"by an inplace operation: {type(t).__name__} {tuple(t.shape)} saved at "
                    f"version {version}, now at version {t._version} (simplesharded)")
            return t
        full = packed.source.gather()
        local = _local(full)
        if local is None or local.untyped_storage().nbytes() != packed.source.nbytes:
            raise RuntimeError(f"re-gathering {packed.source.label} for backward gave a "
                               f"different layout than in forward")
        with torch.no_grad():
            view = local.as_strided(packed.size, packed.stride, packed.offset)
            if packed.dtensor is None:
                return view
            mesh, placements, shape, stride = packed.dtensor
            return DTensor.from_local(view, mesh, placements, run_check=False, shape=shape,
                                      stride=stride)
