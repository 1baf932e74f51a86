"""The ragged bucket layout (simplesharded/storage/ragged.py).

Single process: the geometry (every element of every parameter on exactly one rank, aligned
offsets, the smallest equal ranges), the split that cuts a gathered buffer into parameters,
and bad input. One spawn of 4 gloo ranks, run as a world of 4 and as two groups of 2 (the
second dim of a 2 × 2 mesh): ``Shard(0)`` locals made by DTensor → ragged range → back,
bitwise; the gather's views equal the full parameters; 3 compiled SGD steps on the ragged
ranges match one process on the whole batch; and the compiled graphs hold one all-gather and
no copy in forward, one reduce-scatter and one concatenation in backward.
"""
from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dist_utils import max_rel_diff, spawn

from simplesharded.passes.torch_compat import STEP_GRAPH, has
from simplesharded.storage.ragged import RaggedLayout, from_ragged, shard0_rows, to_ragged

SHAPES = [(7, 5), (7,), (3, 7), (3,), (1, 4), (2,)]  # uneven rows, a parameter smaller than w
aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("align", [1, 4, 16])
def test_every_element_on_exactly_one_rank(world, align):
    layout = RaggedLayout(tuple(SHAPES), world, align)
    end = 0
    for o, n in zip(layout.offsets, layout.numels):
        assert o % align == 0 and o >= end  # aligned, in order, never overlapping
        end = o + n
    assert layout.shard_numel == -(-end // world)  # the smallest equal ranges
    for i, n in enumerate(layout.numels):
        pieces = [layout.piece(i, r) for r in range(world)]
        assert pieces[0][0] == 0 and pieces[-1][1] == n
        for (a, b), (c, _) in zip(pieces, pieces[1:]):
            assert b == c  # consecutive ranks hold consecutive pieces
        for r, (a, b) in enumerate(pieces):  # ... inside the rank's range
            lo, hi = layout.rank_range(r)
            assert a == b or lo <= layout.offsets[i] + a and layout.offsets[i] + b <= hi


def test_split_cuts_the_bucket_into_its_parameters():
    layout = RaggedLayout(tuple(SHAPES), 4, 4)
    params = [torch.randn(s) for s in SHAPES]
    full = torch.zeros(layout.total)
    for p, o in zip(params, layout.offsets):
        full[o:o + p.numel()] = p.reshape(-1)
    sizes, index = layout.split_sizes()
    assert sum(sizes) == layout.total
    pieces = full.split(sizes)
    for p, j in zip(params, index):
        assert torch.equal(pieces[j].view(p.shape), p)
        assert pieces[j].untyped_storage().data_ptr() == full.untyped_storage().data_ptr()


def test_shard0_rows_are_dtensors_uneven_split():
    # torch.chunk is what DTensor's Shard(0) splits by; the spawned test checks DTensor itself
    for rows in range(0, 10):
        for world in (1, 2, 3, 4):
            sizes = [c.shape[0] for c in torch.empty(rows).chunk(world)]
            sizes += [0] * (world - len(sizes))
            assert [b - a for a, b in (shard0_rows(rows, world, r) for r in range(world))] \
                == sizes


def test_shard0_rows_nest_over_two_dims_as_dtensor():
    # (Shard(0), Shard(0)): the first dim chunks the rows, the second chunks each chunk; the
    # rank is row-major over the two (tests/test_ragged_fsdp_2d.py checks DTensor itself)
    def chunks(n, k):  # torch.chunk's sizes (DTensor's Shard), padded with empty ones to k
        sizes = [len(c) for c in torch.arange(n).chunk(k)] if n else []
        return sizes + [0] * (k - len(sizes))

    for rows in range(0, 12):
        for dims in ((2, 2), (2, 3), (3, 2)):
            want = [s for outer in chunks(rows, dims[0]) for s in chunks(outer, dims[1])]
            got = [shard0_rows(rows, dims, r) for r in range(dims[0] * dims[1])]
            assert [b - a for a, b in got] == want, (rows, dims)
            assert got[0][0] == 0 and all(a[1] == b[0] for a, b in zip(got, got[1:]))
    layout = RaggedLayout(((5, 3),), 4, cut_shape=(2, 2))
    assert [layout.shard0_piece(0, r) for r in range(4)] == [(0, 6), (6, 9), (9, 12), (12, 15)]
    with pytest.raises(ValueError, match="cut_shape"):
        RaggedLayout(((5, 3),), 4, cut_shape=(2, 3))


@pytest.mark.parametrize("shapes, world, align, message", [
    ((), 2, 1, "at least one parameter"),
    (((2, 2), ()), 2, 1, "0-d parameter"),
    (((2, 2),), 0, 1, "world=0"),
    (((2, 2),), 2, 0, "align=0"),
])
def test_bad_layouts_say_what_is_wrong(shapes, world, align, message):
    with pytest.raises(ValueError, match=message):
        RaggedLayout(shapes, world, align)


# ----------------------------------------------- data_parallel(storage="ragged"), fake world

def test_ragged_model_lists_its_parameters_and_state_dict_converts_them():
    import toy_blocks
    from pass_utils import fake_world

    import simplesharded as ss
    from simplesharded.storage.ragged_member import RaggedMember

    with fake_world(2) as mesh:
        plain = ss.data_parallel(toy_blocks.make_model(), mesh)
        model = ss.data_parallel(toy_blocks.make_model(), mesh, storage="ragged")
        # FSDP2's contract: the model's own parameters, by name, of their global shape
        assert [(n, p.shape) for n, p in model.named_parameters()] == \
            [(n, p.shape) for n, p in plain.named_parameters()]
        ragged = [p for _, p in model.named_parameters()
                  if isinstance(p, RaggedMember)]
        assert len(ragged) >= 4 * toy_blocks.N_LAYERS  # every block weight is bucketed
        for p in ragged:  # this rank's run of the flattened parameter: a 1-D view
            sizes = p.runs
            me = mesh.get_local_rank()
            assert p.to_local().shape == (sizes[me],) and sum(sizes) == p.numel()
        # as without: the members by FQN, in the same order, Shard(0) DTensors of their shape
        assert [(k, v.placements, v.shape) for k, v in model.state_dict().items()] == \
            [(k, v.placements, v.shape) for k, v in plain.state_dict().items()]
        block = model.layers[0]
        assert list(block.state_dict()) == list(plain.layers[0].state_dict())
        # a deep copy reads and converts its own buckets
        import copy

        from simplesharded.storage.ragged_shards import _ATTR
        from simplesharded.storage.sharded_state import sharded_state

        twin = copy.deepcopy(model)
        record = sharded_state(twin.layers[0].attention.wq).params["weight"]
        bucket = record.ragged.bucket
        assert bucket is not sharded_state(model.layers[0].attention.wq).params["weight"] \
            .ragged.bucket
        assert bucket.members[record.ragged.index] is twin.layers[0].attention.wq._parameters[
            "weight"]
        assert getattr(twin.layers[0], _ATTR).buckets[0] is bucket
        # the twin's members are views of the twin's bucket
        local = bucket.param.to_local()
        start, stop = bucket.runs[record.ragged.index]
        member = twin.layers[0].attention.wq._parameters["weight"].to_local()
        assert member.numel() == 0 or member.data_ptr() == local[start:stop].data_ptr()
        # and trains: its backward hands the twin's gradients to the twin's members
        twin(toy_blocks.batch(0)[0]).sum().backward()
        missing = [n for n, p in twin.named_parameters() if p.grad is None]
        assert not missing and all(p.grad is None for p in model.parameters()), missing
        assert len(bucket.param._post_accumulate_grad_hooks) == 1  # handed out once


@pytest.mark.parametrize("storage", ["ragged", "param"])
def test_a_deleted_model_is_freed(storage):
    """``del model`` frees the model and its shards once it has trained a step, as a plain
    module's: no hook, bucket or optimizer state keeps it (torch holds a tensor's hooks from
    C++, where the garbage collector cannot break a cycle through them)."""
    import gc
    import weakref

    import toy_blocks
    from pass_utils import fake_world

    import simplesharded as ss

    with fake_world(2) as mesh:
        model = ss.data_parallel(toy_blocks.make_model(), mesh, storage=storage)
        optimizer = torch.optim.AdamW(model.parameters())
        model(toy_blocks.batch(0)[0]).sum().backward()
        optimizer.step()
        refs = [weakref.ref(model), *(weakref.ref(p) for p in model.parameters())]
        del model, optimizer
    gc.collect()
    assert [r for r in refs if r() is not None] == []


def test_a_bucket_whose_members_are_all_frozen_is_read_without_autograd():
    """Frozen after wrapping, as per-parameter shards that do not require grad: a bucket none
    of whose members requires grad gives no gradient and no reduce-scatter (the compiled
    backward has one fewer), and a model frozen whole gives an output that needs none; the
    flags are guarded, so unfreezing compiles the gradient back."""
    import toy_blocks
    from pass_utils import capture_backend, fake_world

    import simplesharded as ss

    def reduce_scatters(gm):
        return sum(n.target is c10d.reduce_scatter_tensor.default for n in gm.graph.nodes)

    counts = {}
    for frozen in (False, True):
        torch._dynamo.reset()
        with fake_world(2) as mesh:
            model = ss.data_parallel(toy_blocks.make_model(n_layers=2), mesh, storage="ragged")
            embedding = dict(model.named_parameters())["tok_embeddings.weight"]
            embedding.requires_grad_(not frozen)  # the bucket before the first block, alone
            backend, captured = capture_backend()
            run = torch.compile(model, backend=backend, fullgraph=True)
            run(toy_blocks.batch(0)[0]).sum().backward()
            assert (embedding.grad is None) == frozen
            counts[frozen] = reduce_scatters(captured[1])
            if frozen:
                embedding.requires_grad_(True)
                run(toy_blocks.batch(0)[0]).sum().backward()
                assert embedding.grad is not None and len(captured) == 4  # recompiled
                model.requires_grad_(False)
                for forward in (model, run):
                    assert not forward(toy_blocks.batch(0)[0]).requires_grad
    assert counts[True] == counts[False] - 1, counts


def test_what_ragged_does_not_take_says_so():
    import toy_blocks
    from pass_utils import fake_world

    import simplesharded as ss

    with fake_world(2) as mesh:
        with pytest.raises(ValueError, match=r"^storage='ragged' takes mode='fully_shard' "
                                             r"\(on one or two .*: use storage='param'$"):
            ss.data_parallel(toy_blocks.make_model(), mesh, "replicate", storage="ragged")


def test_unknown_storage_is_one_line_listing_the_choices():
    import toy_blocks
    from dist_utils import world_of_one

    import simplesharded as ss

    with world_of_one() as mesh, pytest.raises(ValueError) as e:
        ss.data_parallel(toy_blocks.make_model(), mesh, storage="nope")
    assert str(e.value) == "storage='nope' is not one of ['auto', 'param', 'ragged']"


def test_flat_buckets_true_says_flat_storage_is_retired():
    import toy_blocks
    from dist_utils import world_of_one

    import simplesharded as ss

    with world_of_one() as mesh, pytest.raises(ValueError) as e:
        ss.data_parallel(toy_blocks.make_model(), mesh, flat_buckets=True)
    assert str(e.value) == ("flat_buckets=True: flat storage is retired; use storage='ragged' "
                            "(zero-copy buckets, docs/zero_copy.md)")


@pytest.mark.parametrize("old, new", [(False, "param"), ("ragged", "ragged")])
def test_flat_buckets_is_storage_deprecated(old, new):
    """flat_buckets=False and "ragged" still work for one release: one DeprecationWarning,
    at the caller's line, naming the replacement; the model is the one storage= makes."""
    import toy_blocks
    from dist_utils import world_of_one

    import simplesharded as ss

    with world_of_one() as mesh:
        with pytest.warns(DeprecationWarning) as caught:
            model = ss.data_parallel(toy_blocks.make_model(), mesh, flat_buckets=old)
        ours = [w for w in caught if "flat_buckets" in str(w.message)]
        assert [str(w.message) for w in ours] == [
            f"data_parallel(flat_buckets={old!r}) is deprecated: use storage={new!r}"]
        assert ours[0].filename == __file__
        want = ss.data_parallel(toy_blocks.make_model(), mesh, storage=new)
        assert [n for n, _ in model.named_parameters()] == \
            [n for n, _ in want.named_parameters()]
        ragged = [p for _, p in model.named_parameters()
                  if type(p).__name__ == "RaggedMember"]
        assert bool(ragged) is (new == "ragged")
        tokens, targets = toy_blocks.batch(0, 0)  # it trains as the storage= model does
        losses = []
        for m in (model, want):
            loss = toy_blocks.loss_fn(m(tokens), targets, targets.numel())
            loss.backward()
            losses.append(loss)
        assert torch.equal(*losses)
        assert all(p.grad is not None for p in model.parameters())


def test_storage_and_flat_buckets_together_are_refused():
    import toy_blocks
    from dist_utils import world_of_one

    import simplesharded as ss

    with world_of_one() as mesh, pytest.raises(ValueError) as e:
        ss.data_parallel(toy_blocks.make_model(), mesh, storage="ragged", flat_buckets="ragged")
    assert str(e.value) == ("data_parallel takes storage= or flat_buckets= (its deprecated "
                            "name), not both")


def test_to_empty_keeps_the_buckets_forward_reads():
    """FSDP2's habit: model.to_empty(device) before the init. It gives every parameter new
    storage (nn.Module._apply swaps a DTensor parameter's contents, keeping the object); a
    bucket is rebuilt around its members' new storage (ragged_shards.keep_buckets_whole), so
    the init and an optimizer built before reach what forward reads: the same training as
    per-parameter shards without to_empty."""
    from dist_utils import world_of_one

    import simplesharded as ss
    from simplesharded.models import build_model

    shapes = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128)
    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with world_of_one() as mesh:
        def trained(storage, to_empty):
            model = ss.data_parallel(build_model("llama3", "debug", device="meta", **shapes),
                                     mesh, storage=storage)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            if to_empty:
                model.to_empty(device="cpu")
            ss.init_sharded(model, seed=3)
            model(tokens).sum().backward()
            opt.step()
            with torch.no_grad():
                return model, model(tokens)

        (ref, ref_out), (model, out) = trained("param", False), trained("ragged", True)
        # every parameter is a ragged member, and the names are the model's
        assert all(type(p).__name__ == "RaggedMember" for _, p in model.named_parameters())
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
        want = ref.state_dict()
        got = model.state_dict()
        assert list(got) == list(want)
        for k, v in got.items():
            assert torch.equal(v.to_local(), want[k].to_local()), k
        assert torch.equal(out, ref_out)


# ------------------------------------------------------------------------- 4 gloo ranks

def _full_params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _model(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2, w3, b3 = params
    h = torch.tanh(x @ w1.T + b1)
    out = h @ w2.T + b2
    return (out.sum(-1, keepdim=True) * w3.sum() + b3).sum(-1)


def _batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 5, generator=g), torch.randn(16, generator=g)


def _reference(steps: int, lr: float) -> list[torch.Tensor]:
    params = [p.clone().requires_grad_() for p in _full_params()]
    x, y = _batch()
    opt = torch.optim.SGD(params, lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(_model(params, x), y).backward()
        opt.step()
    return [p.detach() for p in params]


def _capture(graphs: dict):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(kind):
        def compiler(gm, _inputs):
            graphs[kind] = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            return make_boxed_func(gm.forward)
        return compiler
    return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))


def _one_world(mesh, steps: int, lr: float) -> dict:
    group, world, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    layout = RaggedLayout(tuple(SHAPES), world, align=4)
    fulls = _full_params()
    locals_ = [distribute_tensor(p, mesh, [Shard(0)]).to_local() for p in fulls]
    assert [tuple(t.shape) for t in locals_] == [
        (b - a, *s[1:]) for s, (a, b) in ((s, shard0_rows(s[0], world, me)) for s in SHAPES)]
    bucket = torch.zeros(layout.total)
    for p, o in zip(fulls, layout.offsets):
        bucket[o:o + p.numel()] = p.reshape(-1)
    lo, hi = layout.rank_range(me)

    flat = to_ragged(locals_, layout, group)
    assert torch.equal(flat, bucket[lo:hi])
    assert all(torch.equal(a, b) for a, b in zip(from_ragged(flat, layout, group), locals_))
    views = layout.gather(flat, group)
    assert all(torch.equal(v, p) for v, p in zip(views, fulls))

    # training: the optimizer steps the ragged range itself; a rank's loss is its share of
    # the global mean, the gather's backward sums the ranks' gradients
    x, y = _batch()
    rows = slice(me * 16 // world, (me + 1) * 16 // world)
    graphs: dict = {}

    @torch.compile(backend=_capture(graphs), fullgraph=True)
    def loss_of(local, x, y):
        return torch.nn.functional.mse_loss(_model(layout.gather(local, group), x), y) / world

    leaf = flat.clone().requires_grad_()
    opt = torch.optim.SGD([leaf], lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss_of(leaf, x[rows], y[rows]).backward()
        opt.step()
    trained = [v.detach().clone() for v in layout.gather(leaf.detach(), group)]
    return {"trained": trained, "graphs": graphs}


def _hsdp(rank: int, world: int) -> dict:
    """The toy model (2 blocks) under HSDP on an unnamed 2 × 2 mesh, with and without ragged
    buckets: 2 AdamW steps of 2 micro-batches, the first under ``no_gradient_sync``, eager and
    compiled; the optimizer state as a checkpoint holds it."""
    import toy_blocks
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    import simplesharded as ss
    from simplesharded.passes.collectives import count_collectives
    from simplesharded.storage.ragged_shards import model_buckets, optim_state_by_member

    mesh = init_device_mesh("cpu", (2, 2))
    numel = 2 * world * toy_blocks.BATCH_PER_RANK * toy_blocks.SEQ
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    out = {}

    def build(storage):
        torch._dynamo.reset()
        model = ss.data_parallel(toy_blocks.make_model(n_layers=2), mesh, "hybrid_shard",
                                 storage=storage)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    # compile_step: 2 steps, where this torch has it (passes/torch_compat.py)
    for storage in ("param", "ragged") if has(STEP_GRAPH) else ():
        model, opt = build(storage)
        cats: list = []  # the step graph's concatenations, as it runs

        def count_cats(kind, stage, gm, cats=cats):
            if stage == "agreement":
                cats.append(sum(n.target is torch.ops.aten.cat.default for n in gm.graph.nodes))
        step = ss.compile_step(model, opt, lambda m, x, y: toy_blocks.loss_fn(m(x), y, numel),
                               backend="aot_eager_blockbucketing", observer=count_cats)
        losses = [step(*toy_blocks.batch(rank, i)).item() for i in range(2)]
        out[(storage, "step")] = dict(losses=losses, cats=cats, full={
            k: v.full_tensor() for k, v in model.state_dict().items()})
    for storage, backend in [("param", "eager"), ("ragged", "eager"),
                             ("param", "aot_eager_blockbucketing"),
                             ("ragged", "aot_eager_blockbucketing")]:
        model, opt = build(storage)
        backwards: list = []  # each compiled backward's collectives: no-sync, then sync

        def observe(kind, stage, gm, backwards=backwards):
            if kind == "bw" and stage == "input":  # once per compiled backward
                backwards.append(dict(count_collectives(gm)))
        run = model if backend == "eager" else torch.compile(
            model, fullgraph=True, backend=ss.make_backend(backend, observer=observe))
        losses, unreduced = [], []
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            for micro in range(2):
                tokens, targets = toy_blocks.batch(rank, 2 * step + micro)
                with ss.no_gradient_sync(model) if micro == 0 else contextlib.nullcontext():
                    loss = toy_blocks.loss_fn(run(tokens), targets, numel)
                    loss.backward()
                losses.append(loss.item())
                if micro == 0:
                    unreduced.append(all(p.grad is None for p in model.parameters()))
            opt.step()
        state = get_state_dict(model, opt, options=options)[1]
        if storage == "ragged":
            state = optim_state_by_member(model, state)
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                for k, v in {**model.state_dict(), **state}.items()}
        out[(storage, backend)] = dict(
            losses=losses, full=full, backwards=backwards, unreduced=all(unreduced),
            placements=[(k, v.placements) for k, v in model.state_dict().items()],
            buckets=[(type(p).__name__, p.placements) for p in model.parameters()],
            n_buckets=len(list(model_buckets(model))))
    return out


def _ranks(rank, world, steps, lr):
    results = {4: _one_world(init_device_mesh("cpu", (4,)), steps, lr)}
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("row", "dp"))["dp"]
    results[2] = _one_world(mesh2, steps, lr)
    results["hsdp"] = _hsdp(rank, world)
    return results


STEPS, LR = 3, 0.1


@functools.lru_cache(maxsize=1)
def _spawned() -> list[dict]:
    """The one spawn both tests below read."""
    return spawn(4, _ranks, STEPS, LR)


def test_round_trip_gather_and_training_match_one_process():
    steps, lr = STEPS, LR
    results = _spawned()
    reference = _reference(steps, lr)
    for world in (4, 2):
        for rank, r in enumerate(results):
            for got, want in zip(r[world]["trained"], reference):
                assert max_rel_diff(got, want) <= 1e-5, (world, rank)
        fw, bw = results[0][world]["graphs"]["fw"], results[0][world]["graphs"]["bw"]
        # forward: one gather, parameters are views of it: no copy of any kind
        assert fw.count(str(c10d.all_gather_into_tensor.default)) == 1
        copies = {str(op) for op in (aten.clone.default, aten.cat.default, aten.copy.default,
                                     aten._to_copy.default, aten.copy_.default,
                                     aten.slice_scatter.default)}
        assert not [t for t in fw if t in copies], fw
        # backward: the gradients laid out as the bucket (one cat), one reduce-scatter
        assert bw.count(str(c10d.reduce_scatter_tensor.default)) == 1
        assert bw.count(str(aten.cat.default)) == 1, bw


def test_hsdp_and_no_sync_ragged_buckets_train_bitwise_as_without():
    """HSDP (hybrid_shard, 2 replicas × 2 shards, an unnamed mesh): ragged buckets are
    ``(Replicate(), Shard(0))`` as their members; eager and block-bucketed aot_eager train 2
    AdamW steps of 2 micro-batches, the first under ``no_gradient_sync``, bit for bit as
    without, parameters and optimizer state (converted per member); ``compile_step`` (2 steps)
    too, its graph without a cat. The no-sync backward reduces nothing (no gradient lands; its compiled graph has no
    reduction); the sync backward holds one reduce-scatter and one all-reduce per bucket."""
    from torch.distributed.tensor import Replicate

    results = _spawned()
    for rank, r in enumerate(results):
        res = r["hsdp"]
        for backend in ("eager", "aot_eager_blockbucketing"):
            plain, ragged = res[("param", backend)], res[("ragged", backend)]
            assert ragged["losses"] == plain["losses"], (rank, backend)
            assert ragged["placements"] == plain["placements"]
            # the parameters are the members: replicated over the replicas, a ragged run of
            # the bucket's cut over the shard dim
            assert {(kind, a, b) for kind, (a, b) in ragged["buckets"]} == \
                {("RaggedMember", Replicate(), Shard(0))}
            assert sorted(ragged["full"]) == sorted(plain["full"])
            diff = [k for k, v in ragged["full"].items()
                    if not (torch.equal(v, plain["full"][k]) if torch.is_tensor(v)
                            else v == plain["full"][k])]
            assert not diff, (rank, backend, diff[:5])
            assert ragged["unreduced"] and plain["unreduced"], (rank, backend)
        if has(STEP_GRAPH):
            plain, ragged = res[("param", "step")], res[("ragged", "step")]  # compile_step
            assert ragged["losses"] == plain["losses"], rank
            assert all(torch.equal(v, plain["full"][k]) for k, v in ragged["full"].items()), \
                rank
            # the step graph's traced backward writes each gradient into its bucket's
            # reduce-scatter input (passes/grads_in_place.py): no cat left
            assert ragged["cats"] and set(ragged["cats"]) == {0}, (rank, ragged["cats"])
        buckets = res[("ragged", "eager")]["n_buckets"]
        # compiled once each: the no-sync backward (it may re-gather, it reduces nothing),
        # the sync one
        no_sync, sync = res[("ragged", "aot_eager_blockbucketing")]["backwards"]
        assert no_sync["reduce_scatter"] == no_sync["all_reduce"] == 0, no_sync
        assert sync["reduce_scatter"] == sync["all_reduce"] == buckets, sync


def test_one_default_for_the_api_and_the_trainer():
    """storage left out is "auto" in data_parallel and in the trainer alike: ragged buckets
    where they take the mode and mesh, one shard per parameter elsewhere."""
    import toy_blocks
    from pass_utils import fake_world
    from torch.distributed.device_mesh import init_device_mesh

    import simplesharded as ss
    from simplesharded.storage.ragged_member import RaggedMember
    from simplesharded.trainer.config import load_config

    def members(model):
        return {isinstance(p, RaggedMember) for p in model.parameters()}

    with fake_world(4):
        one_dim = init_device_mesh("cpu", (4,))
        two_dim = init_device_mesh("cpu", (2, 2))
        assert members(ss.data_parallel(toy_blocks.make_model(), one_dim)) == {True}
        assert members(ss.data_parallel(toy_blocks.make_model(), two_dim,
                                        "hybrid_shard")) == {True}
        assert members(ss.data_parallel(toy_blocks.make_model(), two_dim)) == {True}
        assert members(ss.data_parallel(toy_blocks.make_model(), one_dim,
                                        "replicate")) == {False}
        assert members(ss.data_parallel(toy_blocks.make_model(), one_dim,
                                        storage="param")) == {False}
    cfg = load_config()
    assert cfg.parallelism.storage == "auto" and cfg.parallelism.dp_storage == "ragged"
