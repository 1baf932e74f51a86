"""Eager prefetch: an uncompiled forward issues a ragged bucket's gather one bucket ahead, so
that it runs under the compute of the bucket before it (FSDP2's prefetch; compiled, the
reordering pass places the gathers: passes/reordering.py).

Without it a bucket is gathered at its first read and waited at once. On a GPU the process
group orders a collective after the work already queued on the current stream, so a gather
issued when a block starts begins when the previous block's kernels have run: nothing overlaps
it. Here, when a forward gathers a bucket, it also issues the gather of the bucket the last
forward gathered next, and that bucket's first read only waits for it. Backward does the same
one bucket ahead in its own order: when a bucket is gathered again for backward (eager
resharding's re-gather, simplesharded/storage/eager_reshard.py, or activation checkpointing's
recompute), the gather of the bucket forward gathered before it is issued, and one backward
never reads is waited for and dropped when the backward ends. (Eager resharding also issues
the first bucket it gathers again when the backward starts; under activation checkpointing
the first block recomputed gathers at its recompute.) At most two buckets are gathered at
once in each direction, as under FSDP2.

Invariant: every rank issues the same gathers in the same order. The forward's prediction is
the last forward's order of gathers, the backward's this forward's, both run alike on every
rank; a prediction the forward does not follow (a bucket prefetched and not read) costs one
gather, waited for and dropped when the forward ends, on every rank alike. Only a forward of
the root predicts and records (a submodule called on its own runs part of the order), and the
first forward records without predicting.
"""
from __future__ import annotations

import torch
from torch.autograd import Variable

_c10d = torch.ops._c10d_functional


class EagerPrefetch:
    """The model's eager prefetch: the order of the last root forward's gathers, and the
    gathers issued ahead of their reads, in forward and in backward (module doc). Buckets are
    ragged_shards.py's ``RaggedShards``: ``name``, ``block`` and ``prefetch_gather()``."""

    def __init__(self):
        self.pending: dict[str, torch.Tensor] = {}  # bucket name → its issued gather
        self.successor: dict[str, object] = {}  # bucket name → the bucket gathered after it
        self.predecessor: dict[str, object] = {}  # bucket name → the bucket gathered before
        self._order: list | None = None  # this root forward's gathers (None: not recording)
        self._drop_queued = False  # a backward's pending gathers are dropped at its end

    def __deepcopy__(self, memo):
        return EagerPrefetch()  # a copy predicts from its own first forward

    def begin(self, root: bool) -> None:
        """An uncompiled forward starts (of the root: recorded, and predicted from the last)."""
        self._order = [] if root else None

    def take(self, name: str) -> torch.Tensor | None:
        """The gather of bucket ``name`` issued ahead (to wait for), or None."""
        return self.pending.pop(name, None)

    def gathered(self, bucket) -> None:
        """``bucket`` was gathered in this forward: recorded, and the bucket the last forward
        gathered after it issued now."""
        if self._order is None:
            return
        self._order.append(bucket)
        after = self.successor.get(bucket.name)
        if after is not None:
            self._start(after.name, after.prefetch_gather)

    def _start(self, name: str, start) -> bool:
        """Bucket ``name``'s gather issued now by ``start()`` (None: it cannot be), unless it
        is already: whether it was."""
        if name in self.pending:
            return False
        pending = start()
        if pending is not None:
            self.pending[name] = pending
        return pending is not None

    def issue(self, name: str, start) -> None:
        """In a backward: :meth:`_start`, and the gather dropped at the backward's end if
        never read."""
        if self._start(name, start) and not self._drop_queued:
            self._drop_queued = True
            Variable._execution_engine.queue_callback(self.drop)

    def recomputed(self, bucket) -> None:
        """``bucket`` was gathered for a recompute in backward: the bucket the last forward
        gathered before it (backward's next) issued now, if it is a block's (activation
        checkpointing wraps blocks: the root's buckets are never recomputed)."""
        before = self.predecessor.get(bucket.name)
        if before is not None and before.block is not None:
            self.issue(before.name, before.prefetch_gather)

    def drop(self) -> None:
        """Gathers issued and not read finish and are dropped (a forward's or backward's end)."""
        for pending in self.pending.values():
            _c10d.wait_tensor(pending)
        self.pending.clear()
        self._drop_queued = False

    def end(self) -> None:
        """The forward ended: gathers issued and not read finish and are dropped; a root
        forward's order becomes the next one's prediction."""
        self.drop()
        if self._order is not None:
            order = self._order
            self.successor = {a.name: b for a, b in zip(order, order[1:]) if a is not b}
            self.predecessor = {b.name: a for a, b in zip(order, order[1:]) if a is not b}
        self._order = None

    def reset(self) -> None:
        """After an aborted iteration (FSDP2's ``reset_iter_state``): nothing issued ahead
        left, and the order forgotten (the next forward records it again)."""
        self.end()
        self.successor.clear()
        self.predecessor.clear()
