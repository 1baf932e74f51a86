"""data_parallel(..., flat_buckets=True) (simplesharded/flat_shards.py) in one process: the
layout (each bucket's shards are views of one buffer, in module order; uneven or frozen ones
stay on their own; parameters, state_dict and placements as without), and eager training on
a world of one: gradients handed out as views of one tensor per bucket, accumulated over
backward passes, zero_grad and optimizer steps through the views, all bitwise as without.
Multi-rank training, compiled graphs' copies and DCP: tests/test_bucketing_training.py."""
from __future__ import annotations


import torch

import toy_blocks
from dist_utils import world_of_one
from pass_utils import fake_world

import simplesharded as ss
from simplesharded.sharded_state import sharded_params


def _records(model):
    return {r.fqn: r for r, _ in sharded_params(model)}


def test_buckets_are_one_buffer_each_in_module_order():
    with fake_world(2) as mesh:
        plain = ss.data_parallel(toy_blocks.make_model(), mesh)
        model = ss.data_parallel(toy_blocks.make_model(), mesh, flat_buckets=True)
        params = dict(model.named_parameters())
        records = _records(model)
        assert list(params) == [n for n, _ in plain.named_parameters()]
        assert [(k, v.placements, v.shape) for k, v in model.state_dict().items()] == \
            [(k, v.placements, v.shape) for k, v in plain.state_dict().items()]
        # 7 rows do not split evenly over 2 ranks: the embedding and the output stay alone
        assert records["tok_embeddings.weight"].flat is None
        assert records["output.weight"].flat is None
        for i in range(toy_blocks.N_LAYERS):
            names = [n for n in params if n.startswith(f"layers.{i}.")]
            slots = [records[n].flat for n in names]
            assert {s.flat.name for s in slots} == {f"layers.{i}/float32"}
            flat = slots[0].flat
            assert flat.fqns == names  # module order
            offsets = [s.offset for s in slots]
            assert offsets == [sum(s.numel for s in slots[:j]) for j in range(len(slots))]
            storage = flat.leaf.untyped_storage().data_ptr()
            for n, s in zip(names, slots):
                local = params[n].to_local()
                assert local.untyped_storage().data_ptr() == storage
                assert local.storage_offset() == s.offset
        assert records["norm.weight"].flat.flat.name == "post/float32"


def test_frozen_parameters_stay_alone():
    with fake_world(2) as mesh:
        model = toy_blocks.make_model()
        model.layers[0].attention.wq.weight.requires_grad_(False)
        ss.data_parallel(model, mesh, flat_buckets=True)
        records = _records(model)
        assert records["layers.0.attention.wq.weight"].flat is None
        assert records["layers.0.attention.wk.weight"].flat is not None


def _train(mesh, flat):
    """Two steps of two accumulated backward passes each; the grads after each backward."""
    model = ss.data_parallel(toy_blocks.make_model(), mesh, flat_buckets=flat)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads = []
    for step in range(2):
        for micro in range(2):
            tokens, targets = toy_blocks.batch(0, 2 * step + micro)
            toy_blocks.loss_fn(model(tokens), targets, targets.numel()).backward()
            grads.append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    tokens, _ = toy_blocks.batch(0, 9)
    with torch.no_grad():
        out = model(tokens)
    return model, grads, out


def test_eager_training_is_bitwise_and_gradients_are_views_of_one_tensor_per_bucket():
    with world_of_one() as mesh:
        _, ref_grads, ref_out = _train(mesh, flat=False)
        model, grads, out = _train(mesh, flat=True)
        assert len(grads) == len(ref_grads) == 4
        for got, want in zip(grads, ref_grads):
            assert got.keys() == want.keys()
            for n in want:
                assert torch.equal(got[n], want[n]), n
        # the optimizer's steps went through the views into the buffers forward reads
        assert torch.equal(out, ref_out)
        # one more backward: the block's gradients are views of one tensor
        tokens, targets = toy_blocks.batch(0, 7)
        toy_blocks.loss_fn(model(tokens), targets, targets.numel()).backward()
        block = [p for n, p in model.named_parameters() if n.startswith("layers.1.")]
        storages = {p.grad.to_local().untyped_storage().data_ptr() for p in block}
        assert len(storages) == 1
        assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())


def test_flat_buckets_need_nothing_else_from_the_user():
    """A mesh built the FSDP2 way (no dim names) and a plain torch module, in the split step
    and in compile_step (the whole step in one graph): bitwise the same as without flat
    buffers, and the parameters the optimizer holds are what the next forward reads."""
    def model(flat):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        return ss.data_parallel(m, mesh, flat_buckets=flat)

    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with world_of_one() as mesh:
        flat = model(True)
        assert _records(flat)["0.weight"].flat is not None
        flat(xs[0]).sum().backward()
        assert all(p.grad is not None and p.grad.shape == p.shape for p in flat.parameters())
        flat.zero_grad()
        losses, params, models = [], [], (model(False), flat)
        for m in models:
            torch._dynamo.reset()
            opt = torch.optim.AdamW(m.parameters(), lr=0.1)
            step = ss.compile_step(m, opt, lambda m, x: m(x).square().mean(),
                                   backend="aot_eager", max_norm=0.5)
            losses.append([step(x).item() for x in xs])
            params.append([p.to_local().clone() for p in m.parameters()])
            assert all(p.grad is None for p in m.parameters())
        torch._dynamo.reset()
        assert losses[0] == losses[1]
        assert all(torch.equal(a, b) for a, b in zip(*params))
        assert losses[0][-1] < losses[0][0]
        # the graph's updates reached the buffer the (eager) forward reads
        assert torch.equal(models[0](xs[0]), models[1](xs[0]))


def test_meta_init_writes_through_to_the_buffers_forward_reads():
    from simplesharded.models import build_model

    shapes = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128)
    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with world_of_one() as mesh:
        def built(flat):
            model = ss.data_parallel(build_model("llama3", "debug", **shapes), mesh,
                                     flat_buckets=flat)
            ss.init_sharded(model, seed=3)
            with torch.no_grad():
                return model, model(tokens)

        (ref, ref_out), (model, out) = built(False), built(True)
        assert all(r.flat is not None for r in _records(model).values())
        for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
            assert torch.equal(a.to_local(), b.to_local()), n
        assert torch.equal(out, ref_out)


def test_to_empty_rebuilds_the_buffers_forward_reads():
    """FSDP2's habit: model.to_empty(device) before the init. It gives every parameter new
    storage; the buckets are rebuilt around it, so the init and the optimizer (built before,
    on the same parameter objects) reach what forward reads."""
    from simplesharded.models import build_model

    shapes = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128)
    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with world_of_one() as mesh:
        def trained(flat, to_empty):
            model = ss.data_parallel(build_model("llama3", "debug", device="meta", **shapes),
                                     mesh, flat_buckets=flat)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            if to_empty:
                model.to_empty(device="cpu")
            ss.init_sharded(model, seed=3)
            model(tokens).sum().backward()
            opt.step()
            with torch.no_grad():
                return model, model(tokens)

        (ref, ref_out), (model, out) = trained(False, False), trained(True, True)
        assert all(r.flat is not None for r in _records(model).values())
        buffers = {id(r.flat.flat): r.flat.flat for r in _records(model).values()}
        for flat in buffers.values():  # every member a view of its bucket's leaf
            leaf = flat.leaf.detach()
            for p, slot in zip(flat.params, flat.slots):
                assert p.to_local().data_ptr() == slot.view_of(leaf).data_ptr()
        for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
            assert torch.equal(a.to_local(), b.to_local()), n
        assert torch.equal(out, ref_out)


def test_accumulation_without_sync_is_bitwise_and_leaves_grads_alone():
    """no_gradient_sync (FSDP2's set_requires_gradient_sync): a no-sync backward does not
    touch the buffer's leaf, so .grad stays None until the sync backward hands out the sum."""
    with world_of_one() as mesh:
        def accumulated(flat):
            model = ss.data_parallel(toy_blocks.make_model(), mesh, flat_buckets=flat)
            batches = [toy_blocks.batch(0, i) for i in range(3)]
            with ss.no_gradient_sync(model):
                for tokens, targets in batches[:2]:
                    toy_blocks.loss_fn(model(tokens), targets, targets.numel()).backward()
            untouched = all(p.grad is None for p in model.parameters())
            tokens, targets = batches[2]
            toy_blocks.loss_fn(model(tokens), targets, targets.numel()).backward()
            return untouched, {n: p.grad.to_local() for n, p in model.named_parameters()}

        (ref_untouched, ref), (untouched, got) = accumulated(False), accumulated(True)
        assert ref_untouched and untouched
        assert got.keys() == ref.keys()
        assert all(torch.equal(got[n], ref[n]) for n in ref)
