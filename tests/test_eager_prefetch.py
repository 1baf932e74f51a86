"""Eager prefetch (simplesharded/storage/prefetch.py): an uncompiled step issues each ragged
bucket's gather one bucket ahead, in forward and in backward, so it is in flight while the
bucket before it computes.

One spawn of 2 gloo ranks. A dispatch mode logs every all-gather's issue and wait and every
matmul of a step: a gather issued ahead has the previous bucket's matmuls between its issue
and its wait. Each case runs beside the same case with prefetch switched off (the two hooks
patched to do nothing), which must give bitwise the same losses and parameters with the same
number of gathers.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import toy_blocks
from dist_utils import memo, spawn

STEPS = 3
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class _Log(TorchDispatchMode):
    """("gather", id) at an all-gather's issue, ("wait", id) at its wait, "mm" at a matmul,
    "op" at any other op."""

    def __init__(self):
        super().__init__()
        self.events: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops._c10d_functional.all_gather_into_tensor.default:
            self.events.append(("gather", id(out)))
        elif func is torch.ops._c10d_functional.wait_tensor.default:
            self.events.append(("wait", id(args[0])))
        else:
            self.events.append("mm" if func in MATMULS else "op")
        return out


def _gathers(events: list, phase_end: int) -> list[tuple[str, int, bool]]:
    """(forward or backward, matmuls between issue and wait, issued ahead: any compute between
    them) of each all-gather, in issue order."""
    out = []
    for i, e in enumerate(events):
        if isinstance(e, tuple) and e[0] == "gather":
            j = events.index(("wait", e[1]), i + 1)
            between = events[i + 1:j]
            out.append(("fw" if i < phase_end else "bw", between.count("mm"),
                        "mm" in between or "op" in between))
    return out


class _Detour(toy_blocks.ToyBlocks):
    """The toy model whose forward skips the blocks in ``skip``."""

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for i, layer in enumerate(self.layers):
            if i not in self.skip:
                h = layer(h)
        return self.output(self.norm(h))


def _run(rank: int, world: int, prefetch: bool, param_dtype, detour: bool,
         checkpointed: bool) -> dict:
    """STEPS steps of a 4-block toy model, eager, fully sharded in ragged buckets; with
    ``detour`` the second step's forward skips the last block (its prefetched gather is
    never read); ``checkpointed``: every block under activation checkpointing (backward
    gathers a block's bucket for its recompute)."""
    from unittest import mock

    import simplesharded as ss
    from simplesharded.storage import eager_reshard, prefetch as prefetch_module

    patches = [] if prefetch else [
        mock.patch.object(prefetch_module.EagerPrefetch, "gathered", lambda self, b: None),
        mock.patch.object(prefetch_module.EagerPrefetch, "recomputed", lambda self, b: None),
        mock.patch.object(eager_reshard, "prefetch", lambda g: None)]
    for p in patches:
        p.start()
    try:
        model = toy_blocks.make_model()
        model.__class__, model.skip = _Detour, set()
        if checkpointed:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import \
                checkpoint_wrapper

            for i, block in enumerate(model.layers):
                model.layers[i] = checkpoint_wrapper(block)
        mp = ss.MixedPrecisionPolicy(param_dtype=param_dtype) if param_dtype else None
        model = ss.data_parallel(model, ss.init_mesh(dp_shard=world, device="cpu"),
                                 mode="fully_shard", mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, logs = [], []
        for step in range(STEPS):
            model.skip = {len(model.layers) - 1} if detour and step == 1 else set()
            tokens, targets = toy_blocks.batch(rank, step)
            with _Log() as log:
                loss = toy_blocks.loss_fn(model(tokens), targets, targets.numel() * world)
                phase_end = len(log.events)
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            logs.append(_gathers(log.events, phase_end))
        params = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        return {"losses": losses, "gathers": logs, "params": params}
    finally:
        for p in patches:
            p.stop()


def _job(rank: int, world: int) -> dict:
    out = {}
    for name, case in CASES.items():
        for on in (True, False):
            out[(name, on)] = _run(rank, world, on, *case)
            dist.barrier()
    return out


# name → (param_dtype, detour, checkpointed)
CASES = {"fp32": (None, False, False), "bf16 gathers": (torch.bfloat16, False, False),
         "a bucket not read": (None, True, False), "checkpointed blocks": (None, False, True)}


@memo
def _results() -> list[dict]:
    return spawn(2, _job)


def test_prefetch_changes_no_value_and_no_count():
    """On and off: bitwise the same losses and parameters, the same gathers per step (but
    the skipped bucket's: below)."""
    for rank in _results():
        for name in CASES:
            on, off = rank[(name, True)], rank[(name, False)]
            assert on["losses"] == off["losses"], name
            assert all(torch.equal(on["params"][k], off["params"][k]) for k in off["params"])
            if not CASES[name][1]:
                assert [len(g) for g in on["gathers"]] == [len(g) for g in off["gathers"]]
            assert on["losses"][-1] < on["losses"][0], name  # it trains


def test_each_gather_is_in_flight_under_the_previous_buckets_compute():
    """Off, every gather is waited for before anything else runs. On, from the second step
    (the first records the order), every forward gather after the first is issued ahead,
    and each block's gather has the matmuls of the bucket before it in flight; in backward
    each gather again (the blocks resharded after forward, or recomputed under activation
    checkpointing) is issued ahead under matmuls."""
    for rank in _results():
        for name in ("fp32", "bf16 gathers", "checkpointed blocks"):
            off = rank[(name, False)]["gathers"]
            assert all(not ahead and not mm for step in off for _, mm, ahead in step), off
            on = rank[(name, True)]["gathers"]
            first = [g for g in on[0] if g[0] == "fw"]
            assert not any(ahead for _, _, ahead in first), first
            for step in on[1:]:
                fw = [g for g in step if g[0] == "fw"]
                bw = [g for g in step if g[0] == "bw"]
                assert len(fw) == toy_blocks.N_LAYERS + 2 and bw, step  # root buckets, blocks
                assert all(ahead for _, _, ahead in fw[1:]), fw
                assert all(mm > 0 for _, mm, _ in fw[2:]), fw  # [1]: under the embedding
                # under activation checkpointing the first block recomputed is not (the
                # backward cannot know which block it recomputes first)
                bw = bw[1:] if CASES[name][2] else bw
                assert all(ahead and mm > 0 for _, mm, ahead in bw), bw


def test_a_prefetched_bucket_the_forward_skips_is_dropped():
    """The second step skips the last block, whose gather the first step's order predicts:
    it is issued, never read, waited for and dropped at the end of the forward (one gather
    more than off, no hang), and the third step follows the second's order."""
    for rank in _results():
        on, off = (rank[("a bucket not read", s)]["gathers"] for s in (True, False))
        fw = [[g for g in step if g[0] == "fw"] for step in on]
        fw_off = [[g for g in step if g[0] == "fw"] for step in off]
        assert len(fw[1]) == len(fw_off[1]) + 1, (fw, fw_off)
        assert len(fw[2]) == len(fw_off[2]), (fw, fw_off)
