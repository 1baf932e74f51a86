"""The trainer's asynchronous checkpoint (simplesharded/trainer/checkpoint.py ``AsyncSaver``,
``checkpoint.async_mode async``) on one gloo rank: the save returns before the files are
written, the parameters and optimizer state are changed in place right after it, and the
committed checkpoint still holds the values at the save; nothing is committed before
``wait``."""
from __future__ import annotations

import os

import pytest
import torch

import simplesharded as ss
import toy
from dist_utils import world_of_one
from simplesharded.trainer import checkpoint as ckpt


def _trained(mesh, storage: str):
    model = ss.data_parallel(toy.make_model(), mesh, storage=storage)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = toy.rank_batch(0, 0)
    toy.loss_fn(model(x), y, y.numel()).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _values(model, opt) -> dict:
    out = {f"p:{n}": p.full_tensor().clone() for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        name = next(n for n, q in model.named_parameters() if q is p)
        out.update({f"{k}:{name}": v.full_tensor().clone() if hasattr(v, "full_tensor")
                    else v.clone() for k, v in state.items()})
    return out


@pytest.mark.parametrize("storage", ["param", "ragged"])
def test_a_save_holds_the_values_at_the_save(tmp_path, storage):
    with world_of_one() as mesh:
        saver = ckpt.AsyncSaver()
        model, opt = _trained(mesh, storage)
        want = _values(model, opt)
        saver.save(str(tmp_path), 1, model, opt, {"pos": 3}, keep_latest_k=2)
        with torch.no_grad():  # the next steps, at once: the thread may be writing meanwhile
            for p in model.parameters():
                p.mul_(0)
            for state in opt.state.values():
                for v in state.values():
                    v.mul_(0)
        assert ckpt.complete_steps(str(tmp_path)) == []  # committed by wait only
        assert saver.wait() == os.path.join(str(tmp_path), "step-1")
        assert saver.wait() is None and ckpt.complete_steps(str(tmp_path)) == [1]

        fresh, fresh_opt = _trained(mesh, storage)
        train = ckpt.load(str(tmp_path), 1, fresh, fresh_opt, {"pos": 0})
        got = _values(fresh, fresh_opt)
    assert train["step"] == 1 and train["loader"] == {"pos": 3}
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
