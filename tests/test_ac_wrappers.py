"""torch's ``checkpoint_wrapper`` applied by the user before ``data_parallel``
(simplesharded/ac_wrappers.py), on a world of one: compiled with a bucketing backend
(``fullgraph=True``) it trains bitwise as the unwrapped model and its forward graph saves fewer
tensors for backward (its blocks are recomputed); uncompiled it runs torch's checkpoint; its
``state_dict()`` keys are the unwrapped model's, per-parameter and ragged alike, and load
across."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing, checkpoint_wrapper)

import simplesharded as ss
from dist_utils import world_of_one
from simplesharded.models import build_model, logits_of


def _train(base, mesh, wrapped: bool, storage, compiled: bool):
    model = copy.deepcopy(base)
    if wrapped:
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=checkpoint_wrapper,
            check_fn=lambda m: type(m).__name__ == "TransformerBlock")
    model = ss.data_parallel(model, mesh, storage=storage)
    saved = []

    def observe(kind, stage, gm):
        if kind == "fw":  # the forward's outputs: the loss's inputs and what backward reads
            saved.append(len(next(iter(gm.graph.find_nodes(op="output"))).args[0]))

    run = torch.compile(model, fullgraph=True, backend=ss.make_backend(
        "aot_eager_blockbucketing", observer=observe)) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(2):
        t = torch.randint(0, 256, (2, 17), generator=g)
        loss = torch.nn.functional.cross_entropy(logits_of(run(t[:, :-1])).flatten(0, 1),
                                                 t[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses, saved[-1] if saved else None


@pytest.mark.parametrize("storage", ["param", "ragged"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_checkpoint_wrapper_trains_as_without_and_keeps_the_keys(storage, compiled):
    torch.manual_seed(0)
    base = build_model("llama3", "debug", device="cpu", n_layers=2)
    with world_of_one() as mesh:
        plain, want, plain_saved = _train(base, mesh, False, storage, compiled)
        wrapped, got, wrapped_saved = _train(base, mesh, True, storage, compiled)
        assert any("_checkpoint_wrapped_module" in n for n, _ in wrapped.named_modules())
        assert got == want
        if compiled:
            assert wrapped_saved < plain_saved, (wrapped_saved, plain_saved)
        keys = list(wrapped.state_dict())
        assert keys == list(plain.state_dict())
        assert not [k for k in keys if "_checkpoint_wrapped_module" in k]
        # the wrapped model loads the unwrapped one's checkpoint (here: untrained) and back
        fresh = ss.data_parallel(copy.deepcopy(base), mesh, storage=storage)
        wrapped.load_state_dict(fresh.state_dict())
        plain.load_state_dict(wrapped.state_dict())
        for model in (wrapped, plain):
            full = {k: v.full_tensor() for k, v in model.state_dict().items()}
            assert all(torch.equal(full[k], v) for k, v in base.state_dict().items())
