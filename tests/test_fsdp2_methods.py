"""FSDP2's ``FSDPModule`` methods on a data_parallel model (simplesharded/fsdp2_methods.py):
the root has every one we name and each wrapped module the per-unit ones, under FSDP2's
names; scheduling hints are checked and taken, so a torchtitan-style setup trains as without
them; a method with another meaning here is one ValueError naming the equivalent; a model's
own method of the same name stays its own."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

import simplesharded as ss
import toy
from dist_utils import world_of_one
from simplesharded.fsdp2_methods import ROOT_METHODS, UNIT_METHODS


# FSDP2's methods of a newer torch than the oldest supported (torch 2.13's)
NEWER = {"reset_iter_state"}


def test_every_method_is_fsdp2s_under_its_name():
    assert set(UNIT_METHODS) < set(ROOT_METHODS)
    assert {n for n in ROOT_METHODS if not callable(getattr(FSDPModule, n, None))} <= NEWER


def _train(hints: bool, storage: str) -> dict:
    """Two steps of the toy model on one rank, with FSDP2's hints set as torchtitan sets
    them (explicit prefetch per block, no resharding after backward, the last backward) or
    not; the parameters after them."""
    with world_of_one() as mesh:
        model = ss.data_parallel(toy.make_model(), mesh, storage=storage)
        blocks = list(model.blocks)
        if hints:
            for i, block in enumerate(blocks):
                block.set_modules_to_forward_prefetch(blocks[i + 1:i + 2])
                block.set_modules_to_backward_prefetch(blocks[max(i - 1, 0):i])
            model.set_reshard_after_backward(False)
            model.set_force_sum_reduction_for_comms(True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            if hints:
                model.set_is_last_backward(True)
                model.set_post_optim_event(None)
            x, y = toy.rank_batch(0, step)
            toy.loss_fn(model(x), y, y.numel()).backward()
            opt.step()
            opt.zero_grad()
        return {n: p.full_tensor() for n, p in model.named_parameters()}


@pytest.mark.parametrize("storage", ["param", "ragged"])
def test_torchtitans_hints_are_taken_and_change_nothing(storage):
    with_hints, without = _train(True, storage), _train(False, storage)
    assert with_hints.keys() == without.keys()
    assert all(torch.equal(with_hints[n], without[n]) for n in without)


class _Abort(Exception):
    pass


def _after_an_aborted_step(where: str | None) -> tuple[dict, bool]:
    """Steps 0 and 1, then (``where`` set) an iteration with gradient sync off: one
    micro-batch's forward and backward, and a second one aborted in its ``where`` (a hook of
    block 1 raises), then ``reset_iter_state()``, ``zero_grad`` and sync back on; then step 3.
    The parameters after it, and whether the aborted backward had a gather issued ahead."""
    from simplesharded.storage.sharded_state import sharded_state

    with world_of_one() as mesh:
        model = ss.data_parallel(toy.make_model(), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        abort = {"on": False}

        def raise_in_forward(module, args, out):
            if abort["on"] and where == "forward":
                raise _Abort

        def raise_in_backward(module, grad_in, grad_out):
            if abort["on"] and where == "backward":
                raise _Abort

        model.blocks[1].register_forward_hook(raise_in_forward)
        model.blocks[1].register_full_backward_hook(raise_in_backward)

        def step(s: int) -> None:
            x, y = toy.rank_batch(0, s)
            toy.loss_fn(model(x), y, y.numel()).backward()

        for s in (0, 1):
            step(s)
            opt.step()
            opt.zero_grad()
        in_flight = False
        if where is not None:
            scope = sharded_state(model).scope
            model.set_requires_gradient_sync(False)
            step(2)  # summed on the rank, to be discarded
            abort["on"] = True
            with pytest.raises(_Abort):
                step(2)
            abort["on"] = False
            in_flight = bool(scope.prefetch.pending)
            model.reset_iter_state()
            assert scope.last_eager is None and not scope.prefetch.pending
            opt.zero_grad()
            model.set_requires_gradient_sync(True)
        step(3)
        opt.step()
        return {n: p.full_tensor() for n, p in model.named_parameters()}, in_flight


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_reset_iter_state_leaves_nothing_of_an_aborted_iteration(where):
    """After reset_iter_state() the aborted iteration is gone: its no-sync gradient sums
    discarded (step 3 trains bitwise as if it had never run) and, aborted in backward, the
    gather issued ahead for it waited for and dropped. (Before these world-of-one runs: the
    tests below hold a fake world for the module.)"""
    want, _ = _after_an_aborted_step(None)
    got, in_flight = _after_an_aborted_step(where)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert in_flight == (where == "backward")


def test_a_unit_has_the_unit_methods_and_the_root_all(fake_world):
    mesh = ss.build_mesh(dp_shard=4, device="cpu")
    model = ss.data_parallel(toy.make_model(), mesh)
    assert all(callable(getattr(model, n)) for n in ROOT_METHODS)
    block = model.blocks[0]
    assert all(callable(getattr(block, n)) for n in UNIT_METHODS)
    assert not hasattr(block, "unshard") and not hasattr(block, "set_requires_gradient_sync")

    with pytest.raises(ValueError, match=r"modules\[1\] \(Linear\) is not a module of a "
                                         r"data_parallel model"):
        block.set_modules_to_forward_prefetch([model.blocks[1], nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=r"reshard_after_backward='no' is not one of "
                                         r"\[False, True\]"):
        model.set_reshard_after_backward("no")


@pytest.mark.parametrize("method, args, says", [
    ("set_gradient_divide_factor", (8.0,), "grad_reduction='sum'"),
    ("set_reduce_scatter_divide_factor", (8.0,), "grad_reduction='sum'"),
    ("set_reshard_after_forward", (False,), "model.unshard()"),
    ("set_requires_all_reduce", (False,), "set_requires_gradient_sync(False)"),
    ("set_custom_all_gather", (object(),), "quantize_gathers"),
    ("set_custom_reduce_scatter", (object(),), "quantize_grads"),
    ("set_all_reduce_hook", (print,), "traced reduction"),
])
def test_a_method_meaning_something_else_here_says_what_to_use(fake_world, method, args, says):
    mesh = ss.build_mesh(dp_shard=4, device="cpu")
    model = ss.data_parallel(toy.make_model(), mesh)
    for module in (model, model.blocks[2]):
        with pytest.raises(ValueError) as e:
            getattr(module, method)(*args)
        line = str(e.value)
        assert line.startswith(f"{method} (FSDP2) has no counterpart") and says in line
        assert "\n" not in line


def test_a_models_own_method_of_that_name_stays(fake_world):
    class Own(toy.Toy):
        def unshard(self):
            return "mine"

        def set_reshard_after_forward(self, flag):
            return flag

    torch.manual_seed(0)
    model = ss.data_parallel(Own(), ss.build_mesh(dp_shard=4, device="cpu"))
    assert model.unshard() == "mine" and model.set_reshard_after_forward(3) == 3
    assert model.reshard.__module__ == "simplesharded.fsdp2_methods"


def test_reset_iter_state_is_the_roots(fake_world):
    model = ss.data_parallel(toy.make_model(), ss.build_mesh(dp_shard=4, device="cpu"))
    with pytest.raises(RuntimeError, match=r"call it on the root"):
        model.blocks[0].reset_iter_state()
