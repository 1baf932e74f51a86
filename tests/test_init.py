"""simplesharded/storage/init.py: a meta-device model, sharded, initialised group by group on
full-size temporaries, holds the same full parameters whatever the world size and layout.

Slow: one spawned job per world size (1, 2, 4 gloo ranks) builds every case of that size
(llama3 debug fully sharded; at 4 ranks also dp 2 x tp 2 as the trainer applies TP; the
deepseek_v3 debug MoE with its experts split over ep 2, at 4 ranks over efsdp 2 too, and
with tp 2 as well), initialises it with the same seed and gathers every parameter
(``full_tensor``): all of them must equal the 1-rank values bit for bit, buffers included.
At 2 and 4 ranks llama3 is also built with ragged buckets (``storage="ragged"``, its
members read from ``state_dict()``): the init writes through to the buckets. At 2 ranks,
the user's own ways too: a first forward before any init raises on every rank (the shards
hold NaN, simplesharded/storage/uninitialised.py), and ``model.init_weights()`` writes the
shards, inside ``disable_gather`` (the same values per-parameter and ragged) or not (FSDP2's
way: outside forward ``module.weight`` is the shard; on ragged buckets the unsharded model's
values).
Fast: at one rank the shards equal a plain, unsharded model given the same init, and the
init never holds more than one group's parameters at once.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_utils import memo, spawn
from simplesharded.passes.torch_compat import EXPERT_PARALLEL, has

SEED = 7
# world size → cases: (model, tp, ep[, storage])
CASES = {
    1: (("llama3", 1, 1), ("deepseek_v3", 1, 1)),
    2: (("llama3", 1, 1), ("deepseek_v3", 1, 2), ("llama3", 1, 1, "ragged")),
    4: (("llama3", 1, 1), ("llama3", 2, 1), ("deepseek_v3", 1, 2), ("deepseek_v3", 2, 2),
        ("llama3", 1, 1, "ragged")),
}
# the ep cases where this torch has expert parallelism (passes/torch_compat.py's table)
CASES = {world: tuple(c for c in cases if c[2] == 1 or has(EXPERT_PARALLEL))
         for world, cases in CASES.items()}


def _sharded(name: str, world: int, tp: int, ep: int, storage="param",
             **overrides) -> nn.Module:
    """The model on the meta device, parallelised as the trainer does (TP → EP →
    data_parallel fully_shard) on a CPU mesh of ``world`` ranks, not yet initialised."""
    import simplesharded as ss
    from simplesharded.models import build_model
    from simplesharded.trainer import apply_expert_parallel, apply_tensor_parallel

    mesh = ss.build_mesh(1, world // tp, "cpu", tp=tp, ep=ep)
    model = build_model(name, "debug", device="meta", **overrides)
    apply_tensor_parallel(model, mesh, sequence_parallel=True)
    apply_expert_parallel(model, mesh)
    return ss.data_parallel(model, mesh, "fully_shard", storage=storage)


def _job(rank: int, world: int) -> dict | None:
    from torch.distributed.tensor import DTensor

    from simplesharded.storage.init import init_sharded

    out = {}
    for case in CASES[world]:
        model = _sharded(*case[:1], world, *case[1:])
        init_sharded(model, seed=SEED)
        params = (dict(model.named_parameters()) if len(case) == 3 else
                  {k: v for k, v in model.state_dict().items() if isinstance(v, DTensor)})
        full = {k: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
                for k, p in params.items()}
        out[case] = {**full, **{k: b.clone() for k, b in model.named_buffers()}}
    users = ({(storage, within): _users_own_init(world, storage, within)
              for storage in ("param", "ragged") for within in (True, False)}
             if world == 2 else {})
    return (out, users) if rank == 0 else None


def _users_own_init(world: int, storage, within_disable_gather: bool) -> dict:
    """A first forward before the init raises (here: every rank gets past it or none would,
    so the spawn would hang instead of fail); then FSDP2's habit, ``model.init_weights()``,
    inside ``disable_gather`` or not; the full parameters after it."""
    import contextlib

    import simplesharded as ss

    model = _sharded("llama3", world, 1, 1, storage)
    tokens = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="holds NaN at the model's first forward: the model "
                                         "was built on the meta device"):
        model(tokens)
    torch.manual_seed(SEED)  # the random ops draw from it: the same for both layouts
    with ss.disable_gather(model) if within_disable_gather else contextlib.nullcontext():
        model.init_weights(buffer_device="cpu")
    assert torch.isfinite(model(tokens)).all()
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


@memo
def _full(world: int) -> dict:
    return spawn(world, _job)[0]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_same_full_parameters_at_any_world_size_and_layout(world):
    ref = _full(1)[0]
    for (name, tp, ep, *storage), got in _full(world)[0].items():
        want = ref[name, 1, 1]
        assert sorted(got) == sorted(want), (name, tp, ep, storage)
        bad = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
        assert not bad, f"{name} world={world} tp={tp} ep={ep} {storage}: differ from 1 rank: {bad}"
    # the init ran: not torch.empty's leftovers
    assert ref["llama3", 1, 1]["norm.weight"].eq(1).all()
    assert 0.01 < float(ref["llama3", 1, 1]["layers.0.attention.wq.weight"].std()) < 0.03


@pytest.mark.slow
def test_users_own_init_reaches_every_layout():
    users = _full(2)[1]
    plain, ragged = users["param", True], users["ragged", True]
    assert sorted(plain) == sorted(ragged)
    bad = [k for k in plain if not torch.equal(plain[k], ragged[k])]
    assert not bad, bad
    for got in users.values():  # inside disable_gather or not: the init ran
        assert got["norm.weight"].eq(1).all()
        assert 0.01 < float(got["layers.0.attention.wq.weight"].std()) < 0.03
    # FSDP2's way, after sharding, outside forward, on ragged buckets: a member's random fill
    # is its run of one full draw and trunc_normal_'s "any out of range?" is the whole
    # tensor's, so the members hold the unsharded model's values (per-parameter shards hold
    # DTensor's per-chunk draws on CPU)
    from simplesharded.models import build_model

    unsharded = build_model("llama3", "debug", device="cpu")
    torch.manual_seed(SEED)
    unsharded.init_weights(buffer_device="cpu")
    got = users["ragged", False]
    bad = [k for k, v in unsharded.state_dict().items() if not torch.equal(got[k], v)]
    assert not bad, bad


# ---------------------------------------------------------------------------- one rank


@pytest.fixture
def one_rank():
    from simplesharded.tools.cluster_trace import fake_world

    with fake_world(1):
        yield


@pytest.mark.parametrize("name", ["llama3", "deepseek_v3", "gpt"])
def test_sharded_equals_plain_model_given_the_same_init(one_rank, name):
    """At one rank a shard is the whole parameter: it equals, bit for bit, the plain model
    initialised by the same function and seed (gpt: a tied embedding and head; deepseek_v3:
    buffers in blocks), and the caller's RNG state is left as it was."""
    from simplesharded.storage.init import init_sharded
    from simplesharded.models import build_model

    model = _sharded(name, 1, 1, 1, n_layers=2)
    plain = build_model(name, "debug", device="cpu", n_layers=2)  # real storage, other values
    torch.manual_seed(0)
    state = torch.get_rng_state()
    init_sharded(model, seed=SEED)
    assert torch.equal(torch.get_rng_state(), state)
    init_sharded(plain, seed=SEED)
    shards = {k: p.to_local() for k, p in model.named_parameters()}
    assert sorted(shards) == sorted(k for k, _ in plain.named_parameters())
    bad = [k for k, p in plain.named_parameters() if not torch.equal(shards[k], p)]
    assert not bad, bad
    buffers = dict(model.named_buffers())
    assert all(torch.equal(buffers[k], b) for k, b in plain.named_buffers())
    init_sharded(plain, seed=SEED + 1)  # another seed, other values
    assert not any(torch.equal(shards[k], p) for k, p in plain.named_parameters() if p.std() > 0)


def test_one_group_of_parameters_at_a_time(one_rank):
    """While the init runs, the model holds real full-size parameters of one group only (a
    block, or one module outside the blocks); the others are meta stand-ins."""
    from simplesharded.blocks import find_blocks
    from simplesharded.storage.init import init_sharded

    model = _sharded("llama3", 1, 1, 1, n_layers=3)
    block = max(sum(p.numel() for p in b.parameters()) for _, b in find_blocks(model))
    seen = []

    def init(m):
        real = [p for p in m.parameters() if not p.is_meta]
        seen.append(sum(p.numel() for p in real))
        m.init_weights()

    init_sharded(model, init, seed=SEED)
    assert len(seen) == 3 + 4  # 3 blocks; tok_embeddings, norm, output, the root (RoPE)
    assert max(seen) == block, (seen, block)


def test_errors_are_one_line(one_rank):
    from simplesharded.storage.init import init_sharded
    from simplesharded.models import build_model

    with pytest.raises(ValueError, match="parameter 'tok_embeddings.weight' is on the meta "
                                         "device: shard the model with data_parallel first"):
        init_sharded(build_model("llama3", "debug", device="meta"))
    with pytest.raises(ValueError, match="Linear has no init_weights\\(\\); pass init_fn"):
        init_sharded(nn.Linear(2, 2))


def test_a_forward_before_the_init_names_what_holds_nan(one_rank):
    """Uncompiled, until one forward passes: the first parameter nobody initialised is named
    (here the init wrote the embedding only); once all are written, forward runs."""
    from simplesharded.storage.init import init_sharded

    model = _sharded("llama3", 1, 1, 1, n_layers=2)
    tokens = torch.randint(0, 256, (1, 8))
    with pytest.raises(ValueError, match=r"^'tok_embeddings.weight' holds NaN at the model's "
                                         r"first forward[^\n]*ss.init_sharded\(model, seed=0\)"):
        model(tokens)
    init_sharded(model, lambda m: nn.init.normal_(m.weight), seed=SEED,
                 modules=[model.tok_embeddings])
    # a block called on its own (FSDP2's unit) checks its own parameters
    h = torch.randn(1, 8, model.layers["0"].attention_norm.weight.shape[0])
    with pytest.raises(ValueError, match=r"^'attention_norm\.weight' holds NaN at a call of "
                                         r"TransformerBlock: the model was built on the meta"):
        model.layers["0"](h, model.freqs_cis[:8])
    assert model.tok_embeddings(tokens).isfinite().all()  # initialised: it runs
    with pytest.raises(ValueError, match=r"^'layers\.0\.attention_norm\.weight' holds NaN"):
        model(tokens)
    init_sharded(model, seed=SEED)
    assert torch.isfinite(model(tokens)).all()
    assert model.layers["0"](h, model.freqs_cis[:8]).isfinite().all()
