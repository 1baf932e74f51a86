"""FSDP2's per-parameter contract under ragged buckets (simplesharded/storage/ragged_shards.py).

Whatever the storage, ``named_parameters()`` lists the model's own parameters under their own
names and global shapes, and each is a parameter the optimizer steps: under ragged buckets a
DTensor whose local tensor is this rank's run of the parameter, a view of its bucket
(simplesharded/storage/ragged_member.py). One spawn of 2 gloo ranks, the toy model (2 blocks):

- the names and shapes are the unwrapped model's;
- AdamW with two parameter groups chosen by name (no weight decay on norms and biases) trains
  10 steps bitwise as on per-parameter storage, eager and under ``aot_eager_autobucketing``
  (losses, and every parameter through ``state_dict()`` and ``full_tensor()``);
- a member frozen after wrapping, and a whole bucket's (the embedding), keep their values
  and get no gradient, and the rest trains as per-parameter storage with the same
  parameters frozen;
- torch's ``clip_grad_norm_`` on the members gives the global norm (as on per-parameter
  storage, to rounding: the ranks' partial sums are over other ranges);
- the optimizer's state, saved with DCP through torch's ``get_optimizer_state_dict`` (a
  member's state is laid out as the member), loads into the other storage's optimizer, each
  way, equal by name;
- FSDP2's full-checkpoint round trip through torch's state-dict API (``get_model_state_dict``
  and ``get_optimizer_state_dict`` with ``full_state_dict=True``, loaded with
  ``set_model_state_dict`` / ``set_optimizer_state_dict``, every rank given the full dicts or
  rank 0 alone with ``broadcast_from_rank0=True``), each way between the storages: the
  parameters and states equal by name, a member's state still laid out as the member, and
  the next step equal;
- ``load_state_dict(..., assign=True)`` keeps the members the model's parameters (the same
  objects, the next step equal);
- outside forward, ``module.weight`` is the parameter itself, as under FSDP2: one rank reads
  it alone (no collective), an init run after sharding and ``to_empty`` on a meta-built model
  writes the shards through it (training then as from the same values written before sharding), and its
  ``.grad`` is the parameter's gradient;
- a submodule called on its own outside the root's forward (the embedding, a block; eager and
  compiled; bf16 ``param_dtype``, fp32 ``output_dtype``) gives the unsharded model's outputs and the mean of the
  ranks' gradients, as FSDP2's units gather in their own forward; the root then trains
  with the compiled block inside its uncompiled forward as with the block uncompiled;
- FSDP2's ``unshard()`` / ``reshard()``: forwards without grad between them gather nothing
  and give the gathering forwards' outputs; one with grad and sync on is refused;
- the optimizer-in-backward habit (one optimizer per parameter, stepped by its
  post-accumulate-grad hook): the hooks run once per parameter per backward and train as on
  per-parameter storage, eager and compiled.
"""
from __future__ import annotations

import torch

from dist_utils import full_state_through_torch, optim_state_through_dcp, spawn

STEPS = 10
FROZEN = "layers.0.attention.wk.weight"  # one member of its block's bucket
FROZEN_BUCKET = "tok_embeddings.weight"  # the whole bucket before the first block


def _groups(model):
    named = list(model.named_parameters())
    no_decay = [p for n, p in named if "norm" in n or "bias" in n]
    decay = [p for n, p in named if not ("norm" in n or "bias" in n)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


_KEPT: dict = {}  # storage -> (model, optimizer) of the eager run without freezing


def _train(rank: int, world: int, storage: str, backend: str, freeze: bool) -> dict:
    import toy_blocks

    import simplesharded as ss

    torch._dynamo.reset()
    torch.manual_seed(0)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    raw_names = [(n, p.shape) for n, p in toy_blocks.make_model(n_layers=2).named_parameters()]
    torch.manual_seed(0)
    model = ss.data_parallel(toy_blocks.make_model(n_layers=2), mesh, storage=storage)
    names = [(n, p.shape) for n, p in model.named_parameters()]
    params = dict(model.named_parameters())
    if freeze:
        params[FROZEN].requires_grad_(False)
        params[FROZEN_BUCKET].requires_grad_(False)
    frozen_before = params[FROZEN].full_tensor()
    bucket_before = params[FROZEN_BUCKET].full_tensor()
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    run = model if backend == "eager" else torch.compile(
        model, fullgraph=True, backend=ss.make_backend(backend))
    norms, frozen_grads = [], []

    def first_step():
        frozen_grads.append(params[FROZEN].grad is None and params[FROZEN_BUCKET].grad is None)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        norms.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())

    losses = toy_blocks.train(run, opt, rank, world, STEPS, first_step)
    frozen_grad = frozen_grads[0]
    if backend == "eager" and not freeze:
        _KEPT[storage] = model, opt
    return dict(raw_names=raw_names, names=names, losses=losses, norms=norms,
                frozen_grad_none=frozen_grad,
                frozen_kept=torch.equal(frozen_before, params[FROZEN].full_tensor())
                and torch.equal(bucket_before, params[FROZEN_BUCKET].full_tensor()),
                full={k: v.full_tensor() for k, v in model.state_dict().items()},
                members={n: p.full_tensor() for n, p in model.named_parameters()},
                kinds=[type(p).__name__ for _, p in model.named_parameters()])


def _optimizer_in_backward(rank: int, world: int, storage: str, backend: str) -> dict:
    """The optimizer-in-backward habit: one AdamW per parameter, stepped by the parameter's
    post-accumulate-grad hook, no step after backward: the parameters after 3 steps, and how
    often the hooks ran."""
    import toy_blocks

    import simplesharded as ss

    torch._dynamo.reset()
    torch.manual_seed(0)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    model = ss.data_parallel(toy_blocks.make_model(n_layers=2), mesh, storage=storage)
    opts = {p: torch.optim.AdamW([p], lr=1e-2) for p in model.parameters()}
    calls = []

    def step(p):
        calls.append(p)
        opts[p].step()
        opts[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    run = model if backend == "eager" else torch.compile(
        model, fullgraph=True, backend=ss.make_backend(backend))
    numel = world * toy_blocks.BATCH_PER_RANK * toy_blocks.SEQ
    for i in range(3):
        tokens, targets = toy_blocks.batch(rank, i)
        toy_blocks.loss_fn(run(tokens), targets, numel).backward()
    return dict(calls=len(calls), n=len(opts),
                params={n: p.full_tensor() for n, p in model.named_parameters()})


def _init_in_place(model) -> None:
    """An init through the modules' own attributes, in place (``reset_parameters``' way):
    a value per module, then arithmetic on it."""
    with torch.no_grad():
        for i, module in enumerate(model.modules()):
            if isinstance(getattr(module, "weight", None), torch.nn.Parameter):
                module.weight.fill_(0.05 * (i % 7) - 0.1).mul_(1.5).add_(0.01 * i)


def _outside_forward(rank: int, world: int, storage: str) -> dict:
    """FSDP2's reads outside forward: the model built on the meta device and initialised
    after ``data_parallel`` through ``module.weight``, against the same init run before it;
    3 eager steps each."""
    import toy_blocks

    import simplesharded as ss

    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = toy_blocks.ToyBlocks(2)
    model = ss.data_parallel(model, mesh, storage=storage)
    model.to_empty(device="cpu")  # FSDP2's step before the init: new storage, same objects
    _init_in_place(model)
    reference = toy_blocks.ToyBlocks(2)
    _init_in_place(reference)
    reference = ss.data_parallel(reference, mesh, storage="param")
    params = dict(model.named_parameters())
    read = model.layers[1].feed_forward.w2.weight
    if rank == 0:  # one rank alone: a read that gathered would pair with the forward's
        float(read.to_local().sum())
    grads = []

    def grads_are_the_parameters():
        grads.append(all(m.weight.grad is params[f"{n}.weight"].grad is not None
                         for n, m in model.named_modules() if n and hasattr(m, "weight")))

    losses = [toy_blocks.train(m, torch.optim.AdamW(m.parameters(), lr=1e-2), rank, world, 3,
                               grads_are_the_parameters if m is model else None)
              for m in (model, reference)]
    return dict(same_object=read is params["layers.1.feed_forward.w2.weight"],
                kind=type(read).__name__, losses=losses, grads=grads,
                equal=all(torch.equal(p.full_tensor(), q.full_tensor())
                          for p, q in zip(model.parameters(), reference.parameters())))


def _called_alone(rank: int, world: int, storage: str, backend: str) -> dict:
    """Submodules called on their own, outside the root's forward (FSDP2's units gather in
    their own forward): the embedding, then block 1 on its output, compiled or not, with a
    bf16 ``param_dtype`` and fp32 ``output_dtype`` (so the block's fp32 input must be cast,
    and each call's output, as the root's are), against
    the unsharded model called the same way on each rank's batch; the gradients are the mean
    of the ranks' as a root's forward reduces them. Then 2 steps of the root."""
    import toy_blocks

    import simplesharded as ss

    torch._dynamo.reset()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    bf16 = torch.bfloat16
    model = ss.data_parallel(toy_blocks.make_model(n_layers=2), mesh, storage=storage,
                             mp_policy=ss.MixedPrecisionPolicy(param_dtype=bf16,
                                                               output_dtype=torch.float32))
    block = model.layers[1] if backend == "eager" else torch.compile(
        model.layers[1], fullgraph=True, backend=ss.make_backend(backend))

    def alone(embed, layer, r):
        h = embed(toy_blocks.batch(r)[0])
        out = layer(h)
        out.float().square().mean().backward()
        return h, out

    h, out = alone(model.tok_embeddings, block, rank)
    reference = toy_blocks.make_model(n_layers=2).to(bf16)
    expected, expected_grads = [], {}
    for r in range(world):  # each rank's bf16 gradient, their mean in the shards' fp32
        expected.append(alone(reference.tok_embeddings, reference.layers[1], r))
        for n, p in reference.named_parameters():
            if p.grad is not None:
                expected_grads[n] = expected_grads.get(n, 0) + p.grad.float() / world
        reference.zero_grad()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    if block is not model.layers[1]:  # the compiled block inside the uncompiled root's forward
        model.layers[1] = block
    losses = toy_blocks.train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), rank,
                              world, 2)
    return dict(h=torch.equal(h, expected[rank][0].float()),
                out=torch.equal(out, expected[rank][1].float()),
                dtype=out.dtype, names=sorted(grads) == sorted(expected_grads),
                grads=all(torch.equal(grads[n], g) for n, g in expected_grads.items()
                          if n in grads),
                diff={n: (grads[n] - g).abs().max().item() for n, g in expected_grads.items()},
                n_grads=len(grads), losses=losses)


def _unsharded(rank: int, world: int, storage: str, backend: str) -> dict:
    """FSDP2's ``model.unshard()`` / ``model.reshard()`` on the root: between them, forwards
    without grad (a generation loop) read the parameters gathered once (eager: no collective)
    and give what gathering forwards give; one with grad and sync on is refused; after
    ``reshard()`` forwards gather again."""
    import contextlib

    import pytest
    import toy_blocks
    from torch.utils._python_dispatch import TorchDispatchMode

    import simplesharded as ss

    class Collectives(TorchDispatchMode):  # eager only: dynamo skips frames under a mode
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.namespace in ("c10d", "_c10d_functional", "c10d_functional")
            return func(*args, **(kwargs or {}))

    torch._dynamo.reset()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    model = ss.data_parallel(toy_blocks.make_model(n_layers=2), mesh, storage=storage)
    run = model if backend == "eager" else torch.compile(
        model, fullgraph=True, backend=ss.make_backend(backend))
    tokens = toy_blocks.batch(rank)[0]
    with torch.no_grad():
        expected = run(tokens)
        assert model.unshard(async_op=True).wait() is None
        with Collectives() if backend == "eager" else contextlib.nullcontext() as comm:
            outs = [run(tokens) for _ in range(3)]
    held = comm.count if comm else None
    with pytest.raises(RuntimeError, match="held gathered.*model.reshard"):
        run(tokens)
    model.reshard()
    with Collectives() if backend == "eager" else contextlib.nullcontext() as comm:
        run(tokens).sum().backward()
    return dict(equal=all(torch.equal(o, expected) for o in outs), held=held,
                again=comm.count if comm else None)


def _assign_keeps_the_parameters(rank: int, world: int) -> bool:
    """``load_state_dict(..., assign=True)`` (torchtune's way of loading sharded weights)
    into ragged buckets keeps each member the parameter the bucket's gradients reach: the same
    objects, and a step after it equal to the source model's."""
    import copy

    import toy_blocks

    src_model, src_opt = _KEPT["ragged"]
    model, opt = copy.deepcopy((src_model, src_opt))  # the optimizer's state comes along
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    before = [id(p) for p in model.parameters()]
    model.load_state_dict(src_model.state_dict(), assign=True)
    same_objects = [id(p) for p in model.parameters()] == before
    losses = [toy_blocks.train(m, o, rank, world, 1) for m, o in ((src_model, src_opt),
                                                                  (model, opt))]
    return same_objects and losses[0] == losses[1] and all(
        torch.equal(p.full_tensor(), q.full_tensor())
        for p, q in zip(src_model.parameters(), model.parameters()))


def _ranks(rank: int, world: int) -> dict:
    out = {}
    for backend in ("eager", "aot_eager_autobucketing"):
        for storage in ("param", "ragged"):
            out[("in_backward", storage, backend)] = _optimizer_in_backward(rank, world,
                                                                            storage, backend)
    for backend in ("eager", "aot_eager_autobucketing"):
        for storage in ("param", "ragged"):
            out[(storage, backend, False)] = _train(rank, world, storage, backend, False)
    for storage in ("param", "ragged"):
        out[(storage, "eager", True)] = _train(rank, world, storage, "eager", True)
    for storage in ("param", "ragged"):
        out[("outside", storage)] = _outside_forward(rank, world, storage)
    for backend in ("eager", "aot_eager_autobucketing"):
        for storage in ("param", "ragged"):
            out[("alone", storage, backend)] = _called_alone(rank, world, storage, backend)
    for backend in ("eager", "aot_eager_autobucketing"):
        for storage in ("param", "ragged"):
            out[("unshard", storage, backend)] = _unsharded(rank, world, storage, backend)
    out["optim_dcp"] = [optim_state_through_dcp(_KEPT[src], _KEPT[dst])
                        for src, dst in (("ragged", "param"), ("param", "ragged"))]
    out["assign"] = _assign_keeps_the_parameters(rank, world)
    out["full_state"] = {(src, dst, broadcast): full_state_through_torch(_KEPT[src], _KEPT[dst],
                                                                         broadcast)
                         for broadcast in (False, True)
                         for src, dst in (("ragged", "param"), ("param", "ragged"))}
    return out


def test_ragged_buckets_keep_the_per_parameter_contract():
    for rank, res in enumerate(spawn(2, _ranks)):
        for key in [("eager", False), ("aot_eager_autobucketing", False), ("eager", True)]:
            plain, ragged = res[("param", *key)], res[("ragged", *key)]
            assert set(ragged["kinds"]) == {"RaggedMember"}, key  # the storage was taken
            assert ragged["names"] == plain["names"] == ragged["raw_names"], key
            assert ragged["losses"] == plain["losses"], (rank, key)
            for k, v in plain["full"].items():
                assert torch.equal(ragged["full"][k], v), (rank, key, k)
            # a member's full_tensor() is the parameter
            for k, v in plain["members"].items():
                assert torch.equal(ragged["members"][k], v), (rank, key, k)
            assert abs(ragged["norms"][0] - plain["norms"][0]) <= 1e-6 * plain["norms"][0]
            if key[1]:
                assert ragged["frozen_grad_none"] and ragged["frozen_kept"], (rank, key)
                assert plain["frozen_grad_none"] and plain["frozen_kept"], (rank, key)
        assert res["optim_dcp"] == [True, True], rank
        for backend in ("eager", "aot_eager_autobucketing"):
            plain = res[("in_backward", "param", backend)]
            ragged = res[("in_backward", "ragged", backend)]
            assert ragged["calls"] == plain["calls"] == 3 * plain["n"], (rank, backend)
            for k, v in plain["params"].items():
                assert torch.equal(ragged["params"][k], v), (rank, backend, k)
        for storage, kind in (("param", "DTensor"), ("ragged", "RaggedMember")):
            got = res[("outside", storage)]
            assert got["same_object"] and got["kind"] == kind, (rank, storage, got)
            assert got["losses"][0] == got["losses"][1] and got["equal"], (rank, storage, got)
            assert got["grads"] == [True], (rank, storage)
        for backend in ("eager", "aot_eager_autobucketing"):
            for storage in ("param", "ragged"):
                got = res[("alone", storage, backend)]
                assert got["h"] and got["out"] and got["dtype"] == torch.float32, (rank, got)
                # the embedding's and block 1's parameters, equal to the ranks' mean
                assert got["names"] and got["grads"] and got["n_grads"] == 10, (rank, got["diff"])
            # the root's steps with block 1 compiled inside it, as with it uncompiled
            assert (res[("alone", storage, "eager")]["losses"]
                    == res[("alone", storage, "aot_eager_autobucketing")]["losses"]), rank
        for backend in ("eager", "aot_eager_autobucketing"):
            for storage in ("param", "ragged"):
                got = res[("unshard", storage, backend)]
                assert got["equal"], (rank, storage, backend)
                if backend == "eager":
                    assert got["held"] == 0 and got["again"] > 0, (rank, storage, got)
        assert res["assign"], rank
        for (src, dst, broadcast), got in res["full_state"].items():
            assert got["loaded"] and got["stepped"], (rank, src, dst, broadcast, got)
            # the optimizer's state of a member is laid out as the member, as before the load
            assert got["kinds"] == (["RaggedMember", "Tensor"] if dst == "ragged"
                                    else ["DTensor", "Tensor"]), (rank, dst, got)
        # freezing changed the training (the test would not see a frozen member trained)
        assert res[("ragged", "eager", True)]["losses"] != res[("ragged", "eager", False)]["losses"]
