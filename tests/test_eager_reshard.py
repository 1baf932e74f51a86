"""Uncompiled (eager) reshard after forward, and the default gradient reduction ("avg").

One spawn of 2 gloo ranks runs every case; a recorder wrapped around ``gather_param`` keeps a
weak reference to the storage of every gathered parameter, so after forward (autograd graph
alive, before backward) the bytes of gathered parameters still alive are exactly what the
graph holds for backward.

The fake-process-group tests at the bottom (no spawn) check the same bookkeeping on the
layouts a 2-rank run cannot show: hybrid (2-D mesh), TP-composed parameters, bf16 gathers.
"""
from __future__ import annotations

import functools
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

import toy
import toy_blocks
from dist_utils import build_mesh_for, max_rel_diff, memo, spawn

TIGHT = 1e-6  # eager vs the 1-process reference: only the order of the gradient sum differs


class GatherRecorder:
    """Wraps simplesharded.storage.gather.gather_param and a ragged bucket's gathers
    (``RaggedLayout.gather`` in forward; ``RaggedShards.issue_whole``, backward's and the
    prefetches', which the forward's gather then waits for): counts gathers (a storage
    recorded once), tracks the bytes of the gathered storages still alive (now and at their
    peak)."""

    def __init__(self):
        import simplesharded.storage.gather as gather
        from simplesharded.storage.ragged import RaggedLayout
        from simplesharded.storage.ragged_shards import RaggedShards

        self.gather_module, self.inner = gather, gather.gather_param
        self.layout_cls, self.inner_ragged = RaggedLayout, RaggedLayout.gather
        self.bucket_cls, self.inner_whole = RaggedShards, RaggedShards.issue_whole
        self.live: list[tuple[StorageWeakRef, int]] = []
        self.calls, self.peak = 0, 0

    def _local(self, t):
        from torch.distributed.tensor import DTensor

        return t.to_local() if isinstance(t, DTensor) else t

    def gather(self, *args, **kwargs):
        full = self.inner(*args, **kwargs)
        self._record(self._local(full))
        return full

    def gather_ragged(self, layout, *args, **kwargs):
        views = self.inner_ragged(layout, *args, **kwargs)
        self._record(views[0])  # every member is a view of the one gathered buffer
        return views

    def issue_whole(self, bucket):
        pending = self.inner_whole(bucket)
        self._record(pending)  # the storage its wait returns
        return pending

    def _record(self, local):
        storage = local.untyped_storage()
        if any(not ref.expired() and ref.cdata == storage._cdata for ref, _ in self.live):
            return  # a prefetched gather, now waited for
        self.live.append((StorageWeakRef(storage), storage.nbytes()))
        self.calls += 1
        self.peak = max(self.peak, self.live_bytes())

    def live_bytes(self) -> int:
        return sum(n for ref, n in self.live if not ref.expired())

    def settled_bytes(self) -> int:
        """live_bytes once it stops changing: gloo's worker thread drops its reference to a
        collective's output a moment after the caller's wait returns (seen: the last
        gather, 1 run in ~30), so a storage nothing else holds can read as alive briefly."""
        last, same = self.live_bytes(), 0
        for _ in range(200):  # at most ~2 s; usually 3 polls
            time.sleep(0.01)
            now = self.live_bytes()
            same = same + 1 if now == last else 0
            if same == 2:
                break
            last = now
        return now

    def __enter__(self):
        self.gather_module.gather_param = self.gather
        recorder = self
        self.layout_cls.gather = lambda layout, *a, **k: recorder.gather_ragged(layout, *a, **k)
        self.bucket_cls.issue_whole = lambda bucket: recorder.issue_whole(bucket)
        return self

    def __exit__(self, *exc):
        self.gather_module.gather_param = self.inner
        self.layout_cls.gather = self.inner_ragged
        self.bucket_cls.issue_whole = self.inner_whole


def _block_bytes(model) -> list[int]:
    """Gathered fp32 bytes of each block's parameters."""
    return [sum(p.numel() * 4 for p in layer.parameters()) for layer in model.layers]


def _step(model, rank):
    """One forward/backward on this rank's batch; loss = mean cross-entropy over its tokens
    (``grad_reduction="avg"`` semantics: the average over ranks is the global mean)."""
    tokens, targets = toy_blocks.batch(rank)
    with GatherRecorder() as rec:
        logits = model(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        held, fw_gathers = rec.settled_bytes(), rec.calls
        loss.backward()
        bw_gathers = rec.calls - fw_gathers
    grads = _member_grads(model)
    return dict(held=held, peak=rec.peak, fw=fw_gathers, bw=bw_gathers, grads=grads,
                loss=loss.item())


def _member_grads(model) -> dict:
    """Every parameter's full gradient by FQN (a ragged bucket's members hold theirs)."""
    return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}


def _bucket_bytes(model) -> dict[str, int]:
    """Gathered bytes of each ragged bucket (fp32), by its unit: a block's FQN, or the root's
    "pre" and "post" (the parameters before the first block and after the last)."""
    from simplesharded.storage.ragged_shards import model_buckets

    return {bucket.name.split("/")[0]: bucket.layout.total * 4
            for bucket in model_buckets(model)}


def eager_job(rank, world):
    import simplesharded as ss

    mesh = build_mesh_for(world, "fully_shard")
    out = {}
    for reshard in (True, False, "auto"):
        model = ss.data_parallel(toy_blocks.make_model(), mesh, reshard_after_forward=reshard, storage="param")
        out[reshard] = _step(model, rank)
        with torch.no_grad(), GatherRecorder() as rec:  # validation-style forward
            model(toy_blocks.batch(rank)[0])
            out[reshard]["nograd_held"] = rec.settled_bytes()
        out[reshard]["block_bytes"] = _block_bytes(model)
    # ragged buckets: one gather per block, re-gathered once for the block's backward
    for reshard in (True, False, "auto"):
        model = ss.data_parallel(toy_blocks.make_model(), mesh, reshard_after_forward=reshard,
                                 storage="ragged")
        out[("ragged", reshard)] = _step(model, rank)
        with torch.no_grad(), GatherRecorder() as rec:
            model(toy_blocks.batch(rank)[0])
            out[("ragged", reshard)]["nograd_held"] = rec.settled_bytes()
            out[("ragged", reshard)]["nograd_peak"] = rec.peak
        out[("ragged", reshard)]["bucket_bytes"] = _bucket_bytes(model)
    # ragged buckets under torch.utils.checkpoint: the recompute reads each member in turn
    model = ss.data_parallel(toy_blocks.make_model(), mesh, storage="ragged")
    for layer in model.layers:
        layer.forward = functools.partial(torch.utils.checkpoint.checkpoint,
                                          type(layer).forward.__get__(layer),
                                          use_reentrant=False)
    out["ragged_ac"] = _step(model, rank)
    # bf16 gathers (mixed precision) and a tied parameter (read by two modules, saved twice)
    for name, make, mp in (
            ("bf16", toy_blocks.make_model, ss.MixedPrecisionPolicy(torch.bfloat16)),
            ("tied", lambda: toy.make_model(tied=True), None)):
        for reshard in (True, False):
            model = ss.data_parallel(make(), mesh, mp_policy=mp, reshard_after_forward=reshard, storage="param")
            if name == "tied":
                x, y = toy.rank_batch(rank)
                F.mse_loss(model(x), y).backward()
                grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
            else:
                grads = _step(model, rank)["grads"]
            out[(name, reshard)] = grads
    dist.barrier()
    return out


@memo
def _run():
    return spawn(2, eager_job, timeout_s=240)


def _reference(world):
    """1 process, the concatenated batch of every rank, mean cross-entropy over all tokens."""
    model = toy_blocks.make_model()
    tokens, targets = zip(*(toy_blocks.batch(r) for r in range(world)))
    logits = model(torch.cat(tokens))
    F.cross_entropy(logits.flatten(0, 1), torch.cat(targets).flatten()).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.slow
def test_eager_reshard_frees_gathered_params_for_backward():
    """True holds no gathered parameter from forward to backward and re-gathers each saved
    one in backward; False holds every saved one; "auto" the last block and the head."""
    for r in _run():
        on, off, auto = r[True], r[False], r["auto"]
        blocks = on["block_bytes"]
        assert on["held"] == 0, on["held"]
        # everything backward needs: the blocks, the final norm and the output head (the
        # embedding's backward needs only the token ids, so it is not held); the output's 7
        # rows (4 + 3 over 2 ranks) are gathered into a padded 8-row buffer
        head = (toy_blocks.DIM + 8 * toy_blocks.DIM) * 4
        assert off["held"] == sum(blocks) + head, (off["held"], blocks)
        assert off["held"] - on["held"] >= sum(blocks[:-1])  # all but one block less
        assert auto["held"] == blocks[-1] + head
        # forward peak: all gathered parameters at once without reshard; with it, less than
        # two blocks' worth (a block's gathers die as its modules finish)
        assert off["peak"] >= sum(blocks) + head
        assert on["peak"] < 2 * max(blocks)
        # re-gathers: one per saved weight (9 per block: 2 norms, wq/wk/wv/wo, w1/w2/w3;
        # plus norm and output); "auto" skips the last block, norm and output
        n_blocks = toy_blocks.N_LAYERS
        assert (on["bw"], off["bw"], auto["bw"]) == (9 * n_blocks + 2, 0, 9 * (n_blocks - 1))
        assert on["fw"] == off["fw"] == auto["fw"]
        for res in (on, off, auto):  # no-grad forward keeps nothing
            assert res["nograd_held"] == 0


@pytest.mark.slow
def test_eager_reshard_ragged_buckets():
    """Ragged buckets reshard as parameters do: True holds no gathered bucket from forward
    to backward and gathers each block's bucket once more for its backward (not once per
    saved member); False holds them all; "auto" the last block's and the root's post bucket
    (final norm, output). In forward, with or without grad, one block's bucket is alive at a
    time. Under activation checkpointing a block's recompute gathers its bucket once.
    Gradients: bitwise equal across all, and the one process's."""
    ref = _reference(2)
    for r in _run():
        on, off, auto = (r[("ragged", x)] for x in (True, False, "auto"))
        units = on["bucket_bytes"]
        blocks = [u for u in units if u not in ("pre", "post")]
        assert len(blocks) == toy_blocks.N_LAYERS and "pre" in units, units
        # the pre bucket is the embedding alone, which backward does not need
        assert on["held"] == 0, on["held"]
        assert off["held"] == sum(units[b] for b in blocks) + units["post"], (off["held"], units)
        assert auto["held"] == units[blocks[-1]] + units["post"], (auto["held"], units)
        # one bucket per block and the post bucket re-gathered (N + 1), not their members
        n = toy_blocks.N_LAYERS
        assert (on["bw"], off["bw"], auto["bw"]) == (n + 1, 0, n - 1)
        assert on["fw"] == off["fw"] == auto["fw"] == n + 2
        # at most the bucket being read, the next one in flight (storage/prefetch.py) and the
        # one before it: gloo's worker thread drops its reference to a gather's output a
        # moment after the wait returns (seen: 1 run in ~5); without the forward's one-bucket
        # cache, all five would be alive
        biggest = max(units.values())
        for res in (on, off, auto):
            assert res["nograd_held"] == 0
            assert res["nograd_peak"] <= 3 * biggest, (res["nograd_peak"], units)
        assert on["peak"] <= 3 * biggest, (on["peak"], units)
        # activation checkpointing: each block's recompute gathers its bucket once (the
        # members' reads share it, 9 per block); "auto", the default, keeps the post bucket
        ac = r["ragged_ac"]
        assert (ac["fw"], ac["bw"]) == (n + 2, n), (ac["fw"], ac["bw"])
        for name in ref:
            assert torch.equal(ac["grads"][name], off["grads"][name]), name
            assert torch.equal(on["grads"][name], off["grads"][name]), name
            assert torch.equal(auto["grads"][name], off["grads"][name]), name
            assert max_rel_diff(on["grads"][name], ref[name]) <= TIGHT, name


@pytest.mark.slow
def test_eager_reshard_gradients_bitwise_equal():
    """The re-gathered parameter is the same bits as the forward's gather (a copy of the same
    shards, the same cast), and backward runs the same graph: fp32, bf16 and a tied
    parameter give bitwise-equal gradients with and without reshard."""
    for r in _run():
        for key in (("auto",), ("bf16",), ("tied",)):
            a = r[True]["grads"] if key == ("auto",) else r[(key[0], True)]
            b = r["auto"]["grads"] if key == ("auto",) else r[(key[0], False)]
            for n in a:
                assert torch.equal(a[n], b[n]), (key, n)
        for n in r[True]["grads"]:
            assert torch.equal(r[True]["grads"][n], r[False]["grads"][n]), n


@pytest.mark.slow
def test_default_grad_reduction_averages():
    """data_parallel's default grad_reduction is "avg": each rank's loss is its own mean and
    the gradient equals the 1-process gradient of the mean loss over the global batch."""
    ref = _reference(2)
    for r in _run():
        got = r[False]["grads"]
        bad = {n: max_rel_diff(got[n], ref[n]) for n in ref}
        worst = max(bad, key=bad.get)
        assert bad[worst] <= TIGHT, (worst, bad[worst])


# ------------------------------------------------------- one process, fake process group

from conftest import FAKE_WORLD  # the fake_world fixture's ranks


def _fake_case(case: str, reshard):
    """(model, input) of one layout, wrapped with bf16 gathers (fake collectives move no data:
    only shapes, layouts and counts are meaningful)."""
    import simplesharded as ss
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mp = ss.MixedPrecisionPolicy(torch.bfloat16)
    if case == "tp":  # dp_shard 2 x tp 2: a colwise weight is a strided shard over dp
        mesh = ss.build_mesh(dp_replicate=1, dp_shard=FAKE_WORLD // 2, device="cpu", tp=2)
        model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Linear(12, 8),
                                    torch.nn.LayerNorm(8))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        x = torch.randn(4, 8, requires_grad=True)
    else:
        mesh = build_mesh_for(FAKE_WORLD, case.split("+")[0])
        model, x = toy_blocks.make_model(), toy_blocks.batch(0)[0]
    mode, _, storage = case.partition("+")
    mode = {"tp": "fully_shard"}.get(mode, mode)
    return ss.data_parallel(model, mesh, mode, mp_policy=mp, reshard_after_forward=reshard,
                            storage=storage or "param"), x


@pytest.mark.parametrize("case", ["fully_shard", "hybrid_shard", "tp", "hybrid_shard+ragged"])
def test_eager_reshard_layouts(fake_world, case):
    """Hybrid (2-D dp mesh; also with ragged buckets, whose members are views of the bucket's
    gather),
    TP-composed DTensor parameters and bf16 gathers: with reshard no gathered storage
    outlives forward and every saved one is re-gathered with the same layout (the unpack
    checks it); without, nothing is re-gathered."""
    counts = {}
    for reshard in (True, False):
        model, x = _fake_case(case, reshard)
        with GatherRecorder() as rec, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model(x)
            held, fw = rec.settled_bytes(), rec.calls
            out.float().sum().backward()
        counts[reshard] = (held, rec.calls - fw)
        # a re-gather inside backward builds no autograd graph, so DTensor has no cause to warn
        assert not [str(w.message) for w in caught if "DTensor" in str(w.message)]
        assert all(p.grad is not None and p.grad.shape == p.shape
                   for p in model.parameters() if p.grad is not None)
    (held_on, bw_on), (held_off, bw_off) = counts[True], counts[False]
    assert held_on == 0 and held_off > 0 and bw_off == 0, counts
    # toy_blocks: 9 saved weights per block + norm + output; tp: both Linear weights (x
    # requires grad) and the LayerNorm's weight and bias (its autograd node saves both)
    # ragged: one re-gather per block's bucket and the post bucket (norm and output)
    assert bw_on == {"tp": 4, "hybrid_shard+ragged": toy_blocks.N_LAYERS + 1}.get(
        case, 9 * toy_blocks.N_LAYERS + 2), counts


def test_eager_reshard_hooks_keep_autograd_guarantees(fake_world):
    """The saved-tensor hooks see every saved tensor of the forward: a graph dropped without
    backward still frees its activations (no reference cycle through a saved output), and
    an in-place change to a saved activation is still an error in backward."""
    import simplesharded as ss

    class ExpAfterLinear(torch.nn.Module):
        def __init__(self, inplace: bool):
            super().__init__()
            self.lin, self.inplace = torch.nn.Linear(4, 4), inplace

        def forward(self, x):
            h = self.lin(x).exp()  # exp saves its output
            self.saved = StorageWeakRef(h.untyped_storage())
            out = h * 3
            if self.inplace:
                h.add_(1)
            return out

    mesh = build_mesh_for(FAKE_WORLD, "fully_shard")
    model = ss.data_parallel(ExpAfterLinear(False), mesh, reshard_after_forward=True, storage="param")
    out = model(torch.randn(2, 4))
    del out
    assert model.saved.expired()
    model = ss.data_parallel(ExpAfterLinear(True), mesh, reshard_after_forward=True, storage="param")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(torch.randn(2, 4)).sum().backward()
