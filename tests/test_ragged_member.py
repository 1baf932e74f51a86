"""A ragged bucket's member as a DTensor (simplesharded/storage/ragged_member.py), in one process on a
fake group of 2 (this process is rank 0).

- DTensor's dispatch caches sharding decisions by placement: a member's runs live on the
  tensor, so neither a per-parameter ``Shard(0)`` shard nor another member of the same shape
  is handed a member's runs by an op seen before (the bug a ``Shard(0)`` subclass carrying
  the runs had);
- results laid out as a member (``detach``, ``zeros_like``, elementwise ops, a deep copy) keep
  its runs, a foreach op's by index; in-place ops return the member itself; reductions are
  plain DTensors;
- a redistribution other than to ``Replicate()`` is refused in one line;
- a run is cut into the boxes DCP writes, row-major and at most ``2·ndim - 1`` of them;
- a full state dict's tensor that torch's state-dict API distributes to a member becomes the
  member's run of it (full_state_dict.py), a tensor of another shape one line naming its key;
- an optimizer state dict holding members saves and loads with ``torch.load``'s default
  (``weights_only``) unpickler, the members keeping their runs.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from pass_utils import fake_world

from simplesharded.storage.ragged_member import RaggedMember, _row_major_boxes


def _spec(mesh, shape):
    meta = TensorMeta(torch.Size(shape), torch.empty(shape).stride(), torch.float32)
    return DTensorSpec(mesh, (Shard(0),), tensor_meta=meta)


def test_members_keep_their_own_runs_through_dispatch():
    with fake_world(2) as mesh:
        a = RaggedMember.make(torch.ones(9), _spec(mesh, (3, 5)), (9, 6), 0)
        b = RaggedMember.make(torch.ones(2), _spec(mesh, (3, 5)), (2, 13), 0)
        plain = DTensor(torch.ones(2, 5), _spec(mesh, (3, 5)), requires_grad=False)
        for op in (torch.Tensor.detach, torch.zeros_like, lambda t: t * 2,
                   lambda t: t.to(torch.float64)):
            got_a, got_b, got_plain = op(a), op(b), op(plain)
            assert type(got_a) is RaggedMember and got_a.runs == (9, 6)
            assert type(got_b) is RaggedMember and got_b.runs == (2, 13)
            assert type(got_plain) is DTensor and got_plain.placements == (Shard(0),)
            assert got_a.to_local().shape == (9,) and got_plain.to_local().shape == (2, 5)
        # a foreach op's results take their runs by index, whatever the shapes
        # (c's runs stand for a third rank's: a's local size and shape, other runs)
        c = RaggedMember.make(torch.ones(9), _spec(mesh, (3, 5)), (9, 3, 3), 0)
        for got, want in zip(torch._foreach_mul([b, a, c], 2.0), [b, a, c]):
            assert type(got) is RaggedMember and got.runs == want.runs
        assert [t.runs for t in torch._foreach_add([c, a], [a, c])] == [(9, 3, 3), (9, 6)]
        assert a.add_(1) is a and torch.equal(a.to_local(), torch.full((9,), 2.0))
        total = a.sum()
        assert type(total) is DTensor and total.placements[0].is_partial()
        p = torch.nn.Parameter(a)
        assert type(p) is RaggedMember and p.runs == (9, 6) and p.requires_grad
        import copy

        for twin, of in ((copy.deepcopy(a), a), (copy.deepcopy(p), p)):  # state, parameter
            assert type(twin) is RaggedMember and twin.runs == of.runs
            assert twin.requires_grad == of.requires_grad
            assert torch.equal(twin.to_local(), of.to_local())
            assert twin.to_local().data_ptr() != of.to_local().data_ptr()
        with pytest.raises(ValueError, match="ragged run"):
            a.redistribute(mesh, [Shard(1)])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_a_run_is_cut_into_row_major_boxes(shape, data):
    n = torch.Size(shape).numel()
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    values = torch.arange(n).view(shape)
    boxes = _row_major_boxes(tuple(shape), start, stop)
    assert len(boxes) <= 2 * len(shape) - 1
    seen = []
    for offsets, sizes, lo, hi in boxes:
        box = values[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        assert torch.equal(box.reshape(-1), torch.arange(lo, hi))
        seen.append((lo, hi))
    assert [x for lo, hi in seen for x in range(lo, hi)] == list(range(start, stop))


def test_a_full_tensor_distributed_to_a_member_is_its_run():
    from torch.distributed.checkpoint import state_dict as dsd

    from simplesharded.storage import full_state_dict

    full_state_dict.install()
    with fake_world(2) as mesh:
        # rank 0 of 2 holds the first 9 of the 15 elements, rank 1 the other 6
        a = RaggedMember.make(torch.zeros(9), _spec(mesh, (3, 5)), (9, 6), 0)
        full = torch.arange(15.0).view(3, 5)
        assert torch.equal(a.run_from(full), torch.arange(9.0))
        local = {"w": a, "step": torch.tensor(0.0)}
        dsd._distribute_state_dict({"w": full, "step": torch.tensor(3.0)}, local,
                                   torch.device("cpu"))
        assert type(local["w"]) is RaggedMember and local["w"].runs == (9, 6)
        assert torch.equal(local["w"].to_local(), torch.arange(9.0))
        assert local["step"].item() == 3.0  # torch's own code for the rest
        with pytest.raises(ValueError, match=r"^w: the full state dict's tensor has shape "
                                             r"\(4, 5\), the model's is \(3, 5\)$"):
            dsd._distribute_state_dict({"w": torch.zeros(4, 5)}, {"w": a}, torch.device("cpu"))


def test_an_optimizer_state_of_members_loads_with_torch_loads_defaults():
    import io

    import toy_blocks

    import simplesharded as ss

    with fake_world(2) as mesh:
        model = ss.data_parallel(toy_blocks.make_model(n_layers=1), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)
        buffer.seek(0)
        loaded = torch.load(buffer)  # weights_only=True, torch's default
        for i, state in opt.state_dict()["state"].items():
            got = loaded["state"][i]["exp_avg"]
            assert type(got) is RaggedMember and got.runs == state["exp_avg"].runs
            assert torch.equal(got.to_local(), state["exp_avg"].to_local())
