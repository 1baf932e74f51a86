"""Ragged buckets under ``mode="fully_shard"`` on a mesh of two data-parallel dims
(simplesharded/storage/ragged_shards.py): each bucket is cut over the four dp ranks flattened
row-major, the order in which DTensor's nested ``(Shard(0), Shard(0))`` gives each rank its
rows, and gathered and reduce-scattered over one group of all four
(simplesharded/mesh.py: ``flat_dp_mesh``). One spawn of 4 gloo ranks on an unnamed
``init_device_mesh("cpu", (2, 2))``, the toy model (2 blocks) with a 5-row weight added (5
rows nest as 2, 1, 1, 1 over 2 × 2, where one dim of 4 would give 2, 2, 1, 0), ragged buckets
against per-parameter shards of the same model:

- the flattened group holds the mesh's ranks in row-major order, and every bucket is placed
  ``(Shard(0), Shard(0))`` and gathers over it; a second call returns the same mesh;
- ``named_parameters()``: the same names, shapes and placements; each member's
  ``full_tensor()`` and ``state_dict()`` (its local, placements and values) as per-parameter
  storage gives them, bit for bit;
- three AdamW steps, eager and under ``aot_eager_autobucketing``: losses and parameters within
  1e-6 of per-parameter storage. Not bitwise: per-parameter storage reduces a gradient with
  two reduce-scatters, one per dp dim (DTensor's nested placements), a bucket with one over
  all four ranks, so each element is summed in another order. Compiled, every collective of
  a bucket runs over the flattened group, as one of ours (annotated with it), one
  reduce-scatter per bucket; torch's ``clip_grad_norm_`` over the members gives the norm;
- on a named mesh with a tp dim (``init_mesh(dp_replicate=2, dp_shard=1, tp=2)``), whose dp
  ranks are a group per tp rank: two eager AdamW steps as per-parameter storage, each bucket
  cut over its tp rank's dp ranks in row-major order;
- DCP: the model's ``state_dict()`` saved from ragged buckets loads into per-parameter
  storage, and the members themselves (saved as their runs' boxes) load into per-parameter
  shards and back, bit for bit by name; the optimizer state saved through torch's
  ``get_optimizer_state_dict`` loads into the other storage's optimizer, each way.
"""
from __future__ import annotations


import torch
import torch.distributed as dist
from torch import nn

from dist_utils import optim_state_through_dcp, shared_tmpdir, spawn

STEPS = 3
TOL = 1e-6
ODD_ROWS = 5


def _make():
    import toy_blocks

    class WithOddRows(toy_blocks.ToyBlocks):
        def __init__(self):
            super().__init__(n_layers=2)
            self.odd = nn.Linear(toy_blocks.DIM, ODD_ROWS, bias=False)

        def forward(self, tokens):
            h = self.tok_embeddings(tokens)
            for layer in self.layers:
                h = layer(h)
            h = self.norm(h)
            out = self.output(h)  # the odd rows add to the first logits (not to all alike,
            # which the loss would not see: its gradient would be rounding noise)
            return torch.cat([out[..., :ODD_ROWS] + self.odd(h), out[..., ODD_ROWS:]], -1)

    torch.manual_seed(0)
    model = WithOddRows()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return model


def _train(rank, world, mesh, storage, backend, kept):
    import toy_blocks

    import simplesharded as ss
    from simplesharded.passes.collectives import find_collectives
    from simplesharded.storage.ragged_shards import model_buckets

    torch._dynamo.reset()
    model = ss.data_parallel(_make(), mesh, "fully_shard", storage=storage)
    out = dict(
        kinds={type(p).__name__ for _, p in model.named_parameters()},
        names=[(n, tuple(p.shape), tuple(p.placements)) for n, p in model.named_parameters()],
        full0={n: p.full_tensor() for n, p in model.named_parameters()},
        state0={k: (v.placements, v.to_local().clone(), v.full_tensor())
                for k, v in model.state_dict().items()},
        buckets=[(b.placements, b.group_name) for b in model_buckets(model)])
    seen = {}

    def observe(kind, stage, gm):
        seen[f"{kind}_{stage}"] = [(c.kind, c.group_name, c.group_size, bool(c.params))
                                   for c in find_collectives(gm)]

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = model if backend == "eager" else torch.compile(
        model, fullgraph=True, backend=ss.make_backend(backend, observer=observe))

    def norm():
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        out["norm"] = (total.full_tensor() if hasattr(total, "full_tensor") else total).item()

    losses = toy_blocks.train(run, opt, rank, world, STEPS, norm)
    out.update(losses=losses, seen=seen,
               full={n: p.full_tensor() for n, p in model.named_parameters()})
    if backend == "eager":
        kept[storage] = model, opt
    return out


def _job(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from simplesharded.mesh import flat_dp_mesh

    mesh = init_device_mesh("cpu", (2, 2))  # unnamed: (dp_replicate, dp_shard) by position
    out, kept = {}, {}
    for backend in ("eager", "aot_eager_autobucketing"):
        for storage in ("param", "ragged"):
            out[(storage, backend)] = _train(rank, world, mesh, storage, backend, kept)
    flat = flat_dp_mesh(mesh)
    out["flat"] = (flat is flat_dp_mesh(mesh), flat.mesh.tolist(), mesh.mesh.flatten().tolist(),
                   flat.get_group(0).group_name, dist.get_rank(flat.get_group(0)))
    out["dcp"] = _through_dcp(kept)
    out["optim_dcp"] = [optim_state_through_dcp(kept[src], kept[dst])
                        for src, dst in (("ragged", "param"), ("param", "ragged"))]
    # a named mesh whose dp ranks are not the world: a group per tp rank
    import simplesharded as ss

    named = ss.init_mesh(dp_replicate=2, dp_shard=1, tp=2, device="cpu")
    for storage in ("param", "ragged"):
        out[("named", storage)] = _eager_on(rank, named, storage)
    return out


def _eager_on(rank, mesh, storage) -> dict:
    """Two eager AdamW steps on ``mesh`` (its dp rank's batches): the parameters and, for
    each bucket, the ranks of the group it is cut over."""
    import toy_blocks

    import simplesharded as ss
    from simplesharded.storage.ragged_shards import model_buckets

    model = ss.data_parallel(_make(), mesh, "fully_shard", storage=storage)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    numel = 2 * toy_blocks.BATCH_PER_RANK * toy_blocks.SEQ
    for step in range(2):
        tokens, targets = toy_blocks.batch(rank // 2, step)  # tp ranks: the same tokens
        toy_blocks.loss_fn(model(tokens), targets, numel).backward()
        opt.step()
        opt.zero_grad()
    return dict(kinds={type(p).__name__ for _, p in model.named_parameters()},
                names=[(n, tuple(p.placements)) for n, p in model.named_parameters()],
                full={n: p.full_tensor() for n, p in model.named_parameters()},
                groups={tuple(dist.get_process_group_ranks(b.shard_group()))
                        for b in model_buckets(model)})


def _through_dcp(kept) -> dict:
    """Bitwise checks, by name, of DCP between the storages (the eager models after
    training)."""
    import torch.distributed.checkpoint as dcp

    (ragged, _), (plain, _) = kept["ragged"], kept["param"]
    want = {n: p.full_tensor() for n, p in ragged.named_parameters()}
    # the model's state_dict() (members converted to per-parameter shards), into param storage
    path = shared_tmpdir()
    dcp.save(ragged.state_dict(), checkpoint_id=path)
    state = plain.state_dict()
    for v in state.values():
        v.to_local().zero_()
    dcp.load(state, checkpoint_id=path)
    plain.load_state_dict(state)
    model_ok = all(torch.equal(p.full_tensor(), want[n]) for n, p in plain.named_parameters())
    # the members themselves: each rank's run written as boxes of the global tensor
    path = shared_tmpdir()
    dcp.save(dict(ragged.named_parameters()), checkpoint_id=path)
    into_plain = {n: torch.zeros_like(p) for n, p in plain.named_parameters()}
    dcp.load(into_plain, checkpoint_id=path)
    boxes_out = all(torch.equal(v.full_tensor(), want[n]) for n, v in into_plain.items())
    # and back: per-parameter shards loaded into zeroed members (their boxes read)
    path = shared_tmpdir()
    dcp.save(into_plain, checkpoint_id=path)
    into_members = {n: torch.zeros_like(p) for n, p in ragged.named_parameters()}
    dcp.load(into_members, checkpoint_id=path)
    boxes_in = all(type(v).__name__ == "RaggedMember" and torch.equal(v.full_tensor(), want[n])
                   for n, v in into_members.items())
    return dict(model=model_ok, boxes_out=boxes_out, boxes_in=boxes_in)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() <= TOL * max(1.0, b.abs().max().item())


def test_ragged_buckets_take_fully_shard_on_two_dp_dims():
    from torch.distributed.tensor import Shard

    for rank, res in enumerate(spawn(4, _job, timeout_s=600)):
        same, flat_ranks, row_major, flat_group, flat_rank = res["flat"]
        assert same and flat_ranks == row_major == [0, 1, 2, 3] and flat_rank == rank
        for backend in ("eager", "aot_eager_autobucketing"):
            plain, ragged = res[("param", backend)], res[("ragged", backend)]
            key = (rank, backend)
            assert ragged["kinds"] == {"RaggedMember"}, key  # the storage was taken
            assert ragged["names"] == plain["names"], key
            assert all(p == (Shard(0), Shard(0)) for _, _, p in ragged["names"]), key
            assert ragged["buckets"] and all(
                b == ((Shard(0), Shard(0)), flat_group) for b in ragged["buckets"]), key
            assert not plain["buckets"]
            for n, v in plain["full0"].items():
                assert torch.equal(ragged["full0"][n], v), (key, n)
            assert ragged["state0"].keys() == plain["state0"].keys()
            for k, (placements, local, full) in plain["state0"].items():
                got = ragged["state0"][k]
                assert got[0] == placements and torch.equal(got[1], local), (key, k)
                assert torch.equal(got[2], full), (key, k)
            for s, (a, b) in enumerate(zip(ragged["losses"], plain["losses"])):
                assert abs(a - b) <= TOL * abs(b), (key, s, a, b)
            for n, v in plain["full"].items():
                assert _close(ragged["full"][n], v), (key, n)
            assert abs(ragged["norm"] - plain["norm"]) <= TOL * plain["norm"], key
        seen = res[("ragged", "aot_eager_autobucketing")]["seen"]
        n_buckets = len(res[("ragged", "eager")]["buckets"])
        for graph in ("fw_input", "bw_input"):
            assert seen[graph] and all(c[1:] == (flat_group, 4, True) for c in seen[graph]), \
                (rank, graph, seen[graph])
        assert sum(c[0] == "reduce_scatter" for c in seen["bw_input"]) == n_buckets
        assert res["dcp"] == dict(model=True, boxes_out=True, boxes_in=True), rank
        assert res["optim_dcp"] == [True, True], rank
        plain, ragged = res[("named", "param")], res[("named", "ragged")]
        assert ragged["kinds"] == {"RaggedMember"} and ragged["names"] == plain["names"]
        assert ragged["groups"] == {(rank % 2, rank % 2 + 2)}, (rank, ragged["groups"])
        for n, v in plain["full"].items():
            assert _close(ragged["full"][n], v), (rank, "named", n)
