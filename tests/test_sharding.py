"""Fast single-process tests of the sharding frontend (simplesharded/sharding.py, mesh.py).

A fake process group (torch's ``fake`` backend, world size 4, this process is rank 0) gives a
real 4-way DeviceMesh without spawning: sharding is then visible (local shard < global shape)
and collectives can be counted with ``CommDebugMode`` (they move no data).
"""
from __future__ import annotations

import io
import types
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import simplesharded as ss
from simplesharded.mesh import resolve_degrees

import toy

from conftest import FAKE_WORLD as WORLD  # the fake_world fixture's ranks


def _count(comm: CommDebugMode, kind: str) -> int:
    """Collectives of ``kind`` (``all_gather``, ``reduce_scatter``) counted by ``comm``, under
    both namespaces it keys them by."""
    return sum(n for op, n in comm.get_comm_counts().items() if kind in str(op))


@pytest.fixture
def mesh1d(fake_world):
    return ss.build_mesh(dp_replicate=1, dp_shard=WORLD, device="cpu")


@pytest.fixture
def mesh2d(fake_world):
    return ss.build_mesh(dp_replicate=2, dp_shard=WORLD // 2, device="cpu")


# ---------------------------------------------------------------- bad input → ValueError


def test_unknown_mode_lists_choices(mesh1d):
    with pytest.raises(ValueError) as e:
        ss.data_parallel(toy.make_model(), mesh1d, mode="zero3", storage="param")
    msg = str(e.value)
    assert "'zero3'" in msg
    for mode in ("replicate", "fully_shard", "hybrid_shard"):
        assert mode in msg


def test_hybrid_shard_needs_2d_mesh(mesh1d):
    model = toy.make_model()
    with pytest.raises(ValueError, match="2-D mesh"):
        ss.data_parallel(model, mesh1d, mode="hybrid_shard", storage="param")
    # Nothing was touched by the failed call: it can still be wrapped.
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    ss.data_parallel(model, mesh1d, mode="fully_shard", storage="param")


def test_already_wrapped(mesh1d):
    model = ss.data_parallel(toy.make_model(), mesh1d, mode="fully_shard", storage="param")
    with pytest.raises(ValueError, match="already"):
        ss.data_parallel(model, mesh1d, mode="fully_shard", storage="param")
    with pytest.raises(ValueError, match="already"):
        ss.data_parallel(model, mesh1d, mode="replicate", storage="param")
    # FSDP2's habit, one call per layer and then the root's: the line names the layer and
    # the one call that does it here
    model = toy.make_model()
    for block in model.blocks:
        ss.data_parallel(block, mesh1d)
    with pytest.raises(ValueError, match=r"^blocks\.0 \(Block\) is already wrapped.*"
                                         r"data_parallel\(model, mesh, blocks=\[Block\]\)"):
        ss.data_parallel(model, mesh1d)


def test_mesh_device_differs_from_params():
    # The check reads only mesh.device_type (and ndim for the mode); no process group needed.
    fake_mesh = types.SimpleNamespace(device_type="cuda", ndim=1)
    with pytest.raises(ValueError) as e:
        ss.data_parallel(toy.make_model(), fake_mesh, mode="fully_shard", storage="param")
    assert "'cpu'" in str(e.value) and "'cuda'" in str(e.value)


@pytest.mark.parametrize("bad", ["mean", "SUM", None])
def test_bad_grad_reduction(mesh1d, bad):
    with pytest.raises(ValueError) as e:
        ss.data_parallel(toy.make_model(), mesh1d, mode="fully_shard", grad_reduction=bad, storage="param")
    assert "avg" in str(e.value) and "sum" in str(e.value)


# ---------------------------------------------------------------- resolve_degrees


def test_resolve_degrees_fills_minus_one():
    assert (resolve_degrees(8).replicate, resolve_degrees(8).shard) == (1, 8)
    d = resolve_degrees(8, dp_replicate=2)
    assert (d.replicate, d.shard, d.world) == (2, 4, 8)
    d = resolve_degrees(8, dp_replicate=-1, dp_shard=4)
    assert (d.replicate, d.shard) == (2, 4)
    d = resolve_degrees(4, dp_replicate=2, dp_shard=2)
    assert (d.replicate, d.shard) == (2, 2)


def test_resolve_degrees_product_mismatch_names_both_numbers():
    with pytest.raises(ValueError) as e:
        resolve_degrees(8, dp_replicate=3, dp_shard=2)
    msg = str(e.value)
    assert "6" in msg and "8" in msg  # the product and the world size
    with pytest.raises(ValueError) as e:
        resolve_degrees(4, dp_replicate=2, dp_shard=4)
    assert "8" in str(e.value) and "4" in str(e.value)


@pytest.mark.parametrize("kwargs", [dict(dp_replicate=3), dict(dp_replicate=-1, dp_shard=3),
                                    dict(dp_replicate=-1, dp_shard=-1), dict(dp_shard=0),
                                    dict(dp_replicate=True), dict(dp_shard=2.0)])
def test_resolve_degrees_rejects(kwargs):
    with pytest.raises(ValueError):
        resolve_degrees(8, **kwargs)


# ---------------------------------------------------------------- placements, names, state dict


@pytest.mark.parametrize("mode,placements", [("replicate", (Replicate(),)),
                                             ("fully_shard", (Shard(0),))])
def test_placements_1d(mesh1d, mode, placements):
    model = ss.data_parallel(toy.make_model(), mesh1d, mode=mode, storage="param")
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), name
        assert p.placements == placements, name


def test_placements_hybrid(mesh2d):
    ref = toy.make_model()
    model = ss.data_parallel(toy.make_model(), mesh2d, mode="hybrid_shard", storage="param")
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.placements == (Replicate(), Shard(0)), name
        assert p.shape == r.shape and p.requires_grad
        # rank 0 holds chunk 0 of torch.chunk(rows, 2), e.g. 4 of the 7 rows of fc1
        assert torch.equal(p.to_local(), r.detach().chunk(WORLD // 2)[0]), name


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_names_and_state_dict_keys_unchanged(mesh1d, mode, tied):
    ref = toy.make_model(tied=tied)
    model = ss.data_parallel(toy.make_model(tied=tied), mesh1d, mode=mode, storage="param")
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert list(model.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in model.named_modules()] == [n for n, _ in ref.named_modules()]
    if tied:  # one shard serves both modules
        assert model.blocks[0].fc2._parameters["weight"] is model.blocks[-1].fc2._parameters["weight"]
        assert len(list(model.parameters())) == len(list(ref.parameters())) == 18


def test_state_dict_holds_shards_and_saving_does_not_gather(mesh1d):
    ref = toy.make_model()
    model = ss.data_parallel(toy.make_model(), mesh1d, mode="fully_shard", storage="param")
    with CommDebugMode() as comm:
        sd = model.state_dict()
        buf = io.BytesIO()
        torch.save(sd, buf)
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    ref_sd = ref.state_dict()
    for k, v in sd.items():
        assert isinstance(v, DTensor), k
        assert v.shape == ref_sd[k].shape, k
        assert v.to_local().shape[0] == ref_sd[k].chunk(WORLD)[0].shape[0] < v.shape[0], k
    # the serialized state holds shards only: about 1/WORLD of the full fp32 bytes + overhead
    full_bytes = sum(t.numel() * t.element_size() for t in ref_sd.values())
    local_bytes = sum(v.to_local().numel() * 4 for v in sd.values())
    assert local_bytes < full_bytes / 2


@pytest.mark.parametrize("storage", ["param", "ragged"])
def test_a_read_gathers_in_forward_and_is_the_shard_outside(mesh1d, storage):
    """FSDP2's reads: inside the root's forward ``module.weight`` is gathered (one all-gather;
    a ragged bucket's gather serves its members), outside it is the parameter
    ``named_parameters()`` lists, with no collective; ``disable_gather`` makes reads in
    forward the shard too and restores the gathers on exit, an exception's included."""
    import copy

    model = ss.data_parallel(toy.make_model(), mesh1d, mode="fully_shard", storage=storage)
    x = toy.rank_batch(0, 0)[0]
    fc1 = model.blocks[0].fc1
    with CommDebugMode() as comm:
        w = fc1.weight
        w.to_local().sum()
    assert comm.get_total_counts() == 0
    assert w is dict(model.named_parameters())["blocks.0.fc1.weight"]
    assert isinstance(w, DTensor) and w.shape == (7, 8)
    for twin in (model, copy.deepcopy(model)):  # a deep copy's forward opens its own scope
        seen = []
        hook = twin.blocks[0].fc1.register_forward_pre_hook(
            lambda m, args: seen.append((type(m.weight), tuple(m.weight.shape))))
        with CommDebugMode() as comm:
            twin(x)
        hook.remove()
        assert seen == [(torch.Tensor, (7, 8))]
        assert comm.get_total_counts() >= 1  # the gathers

    def read_in_forward():  # in the forward's first module
        seen = []
        hook = model.inp.register_forward_pre_hook(lambda m, args: seen.append(type(m.weight)))
        try:
            model(x)
        except RuntimeError:  # the shard in a matmul with a plain tensor
            pass
        hook.remove()
        return seen[0]

    with ss.disable_gather(model) as m:
        assert m is model
        assert issubclass(read_in_forward(), DTensor)
        with ss.disable_gather(model):  # nesting keeps it disabled, restores to disabled
            pass
        assert issubclass(read_in_forward(), DTensor)
    assert read_in_forward() is torch.Tensor  # restored
    with pytest.raises(RuntimeError, match="boom"):
        with ss.disable_gather(model):
            raise RuntimeError("boom")
    assert read_in_forward() is torch.Tensor  # restored after an exception too


@pytest.mark.parametrize("storage", ["param", "ragged"])
def test_a_submodule_called_on_its_own_gathers_for_its_call(mesh1d, storage):
    """FSDP2's units gather in their own forward: a block called outside the root's forward
    gathers what it reads, once per call (one all-gather per parameter, or one for its ragged
    bucket), and its parameters are the shards again after it; its backward reduces what it
    gathered. Inside the root's forward it opens no call of its own: the root's forward
    gathers each parameter (or bucket) once."""
    model = ss.data_parallel(toy.make_model(), mesh1d, mode="fully_shard", storage=storage)
    block = model.blocks[0]
    # the classes data_parallel gives stay in the model's module (transformers reads it)
    assert {type(m).__module__ for m in model.modules()} == {
        type(m).__module__ for m in toy.make_model().modules()}
    h = torch.randn(2, toy.DIM, requires_grad=True)
    with CommDebugMode() as comm:
        out = block(h)
    gathers = _count(comm, "all_gather")
    assert gathers == (1 if storage == "ragged" else 4), comm.get_comm_counts()
    assert isinstance(block.fc1.weight, DTensor)  # the call is over: the shard again
    assert out.shape == h.shape and not isinstance(out, DTensor)
    with CommDebugMode() as comm:
        out.sum().backward()
    assert _count(comm, "reduce_scatter") == gathers
    assert block.fc1.weight.grad is not None and model.head.weight.grad is None
    with pytest.raises(RuntimeError):  # a call that raises closes its gathers too
        block(torch.randn(2, toy.DIM + 1))
    assert isinstance(block.fc1.weight, DTensor)

    def root_gathers():
        with CommDebugMode() as comm:
            model(toy.rank_batch(0, 0)[0])
        return _count(comm, "all_gather")

    # each parameter, or each bucket (before the blocks, each block, after them), once
    n_blocks = len(model.blocks)
    assert root_gathers() == (n_blocks + 2 if storage == "ragged"
                              else len(list(model.parameters())))


@pytest.mark.parametrize("storage", ["param", "ragged"])
def test_blocks_compiled_inside_an_uncompiled_forward_keep_no_gathers(mesh1d, storage):
    """Blocks compiled one by one under an uncompiled root (torchtitan's habit), 10 of them
    with ``fullgraph=True``: each compiles once, past dynamo's recompile limit of 8 for one
    code object (each block's graph names its own parameters), and its gathers are its
    graph's own, so none is left in the model's scope once the block has run (the root's
    forward would otherwise keep every block's until it ends). The last uncompiled ragged
    gather, the input layer's, is cached as in any uncompiled forward."""
    from simplesharded.storage.sharded_state import sharded_state

    torch._dynamo.reset()
    model = toy.Toy(n_blocks=10)
    model = ss.data_parallel(model, mesh1d, mode="fully_shard", storage=storage)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend="aot_eager", fullgraph=True)
    scope = sharded_state(model).scope
    seen = []
    model.head.register_forward_pre_hook(
        lambda m, args: seen.append((len(scope.gathered), list(scope.bucket_views))))
    model(toy.rank_batch(0, 0)[0]).sum().backward()
    assert seen == [(0, ["pre/float32"] if storage == "ragged" else [])], seen
    assert all(p.grad is not None for p in model.parameters())


def test_a_ragged_member_refuses_a_chunked_dtensor(mesh1d):
    """A ragged member's local tensor is a run, not ``Shard(0)``'s chunk: an op mixing the
    two (a copy from ``distribute_tensor``, say) is one ValueError naming the way that
    works, not a silent pairing of different elements; ops among members and with
    replicated or plain scalars run."""
    from torch.distributed.tensor import distribute_tensor

    model = ss.data_parallel(toy.make_model(), mesh1d, storage="ragged")
    w = model.blocks[0].fc1.weight
    chunked = distribute_tensor(torch.ones(7, 8), w.device_mesh, [Shard(0)])
    with torch.no_grad():
        with pytest.raises(ValueError, match="disable_gather.*Shard\\(0\\)"):
            w.copy_(chunked)
        w.fill_(2.0).mul_(distribute_tensor(torch.tensor(1.5), w.device_mesh, [Replicate()]))
    assert type(w).__name__ == "RaggedMember"
    assert torch.equal(w.to_local(), torch.full_like(w.to_local(), 3.0))


def test_a_random_init_of_a_ragged_member_is_the_full_tensors_run(mesh1d):
    """FSDP2's init after sharding on ragged buckets: a random in-place op on a member
    (``trunc_normal_``'s ``normal_``, ``normal_``) leaves it this rank's run of what the op
    draws on the unsharded tensor from the same generator state, as ``run_from`` cuts it:
    not DTensor's draw for its local tensor alone (on CPU a draw of fewer than 16 normals
    takes another path than the first 16 of a longer one)."""
    model = ss.data_parallel(toy.make_model(), mesh1d, storage="ragged")
    checked = 0
    for name, p in model.named_parameters():
        for init in (lambda t: nn.init.trunc_normal_(t, std=0.02), lambda t: t.normal_(1, 2)):
            torch.manual_seed(3)
            with torch.no_grad():
                init(p)
            torch.manual_seed(3)
            full = init(torch.empty(p.shape))
            assert type(p).__name__ == "RaggedMember", name
            assert torch.equal(p.to_local(), p.run_from(full)), name
            checked += p.to_local().numel() > 0
    assert checked >= 4  # runs this rank holds


def test_meta_model_gets_cpu_shards(mesh1d):
    model = toy.make_model(device="meta")
    ss.data_parallel(model, mesh1d, mode="fully_shard", storage="param")
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.to_local().device.type == "cpu", name
        assert not p.is_meta and p.shape == dict(toy.make_model().named_parameters())[name].shape


def test_scalar_parameter_is_replicated(mesh1d):
    """A 0-dim parameter cannot be sharded on dim 0; it is replicated instead of failing."""
    from torch.distributed.tensor import Replicate

    class WithScale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.scale = torch.nn.Parameter(torch.tensor(2.0))

        def forward(self, x):
            return self.lin(x) * self.scale

    model = ss.data_parallel(WithScale(), mesh1d, "fully_shard", storage="param")
    assert model._parameters["scale"].placements == (Replicate(),)
    assert model.lin._parameters["weight"].to_local().shape == (4 // WORLD, 4)


# ---------------------------------------------------------------- tensor parallel degrees


def test_resolve_degrees_with_tp():
    d = resolve_degrees(8, dp_shard=-1, tp=2)
    assert (d.replicate, d.shard, d.tp, d.dp, d.world) == (1, 4, 2, 4, 8)
    d = resolve_degrees(16, dp_replicate=2, dp_shard=-1, tp=4)
    assert (d.replicate, d.shard, d.tp) == (2, 2, 4)
    # one rule for the mesh dims: dp_shard always, dp_replicate and tp only when > 1
    assert resolve_degrees(4, tp=2).dims() == (("dp_shard", 2), ("tp", 2))
    assert resolve_degrees(2, dp_shard=1, tp=2).dims() == (("dp_shard", 1), ("tp", 2))
    assert resolve_degrees(4).dims() == (("dp_shard", 4),)
    assert [n for n, _ in resolve_degrees(8, 2, 2, 2).dims()] == ["dp_replicate", "dp_shard",
                                                                   "tp"]


@pytest.mark.parametrize("kwargs,needles", [
    (dict(tp=3), ["tp=3", "does not divide the world size 8"]),
    (dict(dp_shard=2, tp=2), ["dp_shard=2 x tp=2 = 4", "world size 8"]),
    (dict(tp=0), ["tp=0", "positive"]),
    (dict(tp=-1), ["tp=-1"]),
])
def test_resolve_degrees_tp_errors_name_the_degrees(kwargs, needles):
    with pytest.raises(ValueError) as e:
        resolve_degrees(8, **kwargs)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_tp_degree_must_divide_model_sizes():
    from simplesharded.models import get_model_spec

    _, args = get_model_spec("llama3", "debug")  # 16 heads, 4 kv heads, vocab 512
    args.check_tp(4)
    with pytest.raises(ValueError) as e:
        args.check_tp(8)
    assert str(e.value) == "tensor_parallel_degree=8 does not divide n_kv_heads=4"
    _, args = get_model_spec("llama3", "70B")
    args.check_tp(8)
    _, moe = get_model_spec("deepseek_v3", "debug")
    with pytest.raises(ValueError, match="dense_hidden_dim=768"):
        moe.check_tp(512)


def test_tp_styles_are_plain_data_over_real_modules():
    from torch.distributed.tensor.parallel import ParallelStyle

    from simplesharded.models import build_model

    for name in ("llama3", "deepseek_v3"):
        model = build_model(name, "debug", device="meta", n_layers=2)
        for sp in (True, False):
            styles = model.tp_styles(sequence_parallel=sp)
            assert all(isinstance(v, ParallelStyle) for v in styles.values())
            for fqn in styles:  # every key names a module of the model
                model.get_submodule(fqn)
            assert ("norm" in styles) == sp  # norms are sequence-parallel only with SP
    styles = build_model("llama3", "debug", device="meta", n_layers=2).tp_styles()
    assert {k for k in styles if k.startswith("layers.0.")} == {
        f"layers.0.{m}" for m in ("attention", "attention.wq", "attention.wk", "attention.wv",
                                  "attention.wo", "attention_norm", "ffn_norm", "feed_forward",
                                  "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}


def test_data_parallel_rejects_dtensor_not_on_the_tp_dim(fake_world):
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = ss.build_mesh(dp_replicate=1, dp_shard=WORLD // 2, device="cpu", tp=2)
    model = toy.make_model()
    lin = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    name = next(n for n, m in model.named_modules() if m is lin)
    lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), mesh["dp_shard"],
                                                      [Shard(0)]))
    with pytest.raises(ValueError) as e:
        ss.data_parallel(model, mesh, storage="param")
    assert f"'{name}.weight'" in str(e.value) and "mesh['tp']" in str(e.value)


def test_tp_parameter_layout_on_the_whole_mesh(fake_world):
    """A colwise (Shard(0)) TP weight becomes a strided shard over dp then Shard(0) over tp;
    a rowwise one (Shard(1)) keeps Shard(0) over dp; a plain one is replicated over tp."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = ss.build_mesh(dp_replicate=1, dp_shard=WORLD // 2, device="cpu", tp=2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Linear(12, 8),
                                torch.nn.LayerNorm(8))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    ss.data_parallel(model, mesh, storage="param")
    dp = WORLD // 2
    got = {n: (p.placements, tuple(p.shape), tuple(p.to_local().shape))
           for n, p in model.named_parameters()}
    assert got["0.weight"] == ((_StridedShard(0, split_factor=2), Shard(0)), (12, 8),
                               (12 // 2 // dp, 8))
    assert got["1.weight"] == ((Shard(0), Shard(1)), (8, 12), (8 // dp, 6))
    assert got["1.bias"][0] == (Shard(0), Replicate())  # rowwise bias: replicated over tp
    assert got["2.weight"][0] == (Shard(0), Replicate())
