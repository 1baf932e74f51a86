"""Context parallelism (models/context_parallel.py) composed with FSDP on one mesh.

One process: the head-tail layout, the per-rank causal mask, RoPE at global positions, the
attention maths against one unsplit SDPA (the K/V gather stood in for by a concatenation), the
mesh (``(dp_shard, cp, tp?)`` over a ``dp_shard_cp`` root that shards every parameter over
dp_shard x cp), and the config and preflight error lines.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from simplesharded.models import context_parallel as cpm

ROOT = Path(__file__).resolve().parents[1]
LLAMA = str(ROOT / "configs" / "llama3_debug.toml")
ARGS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32)


def make_model(**overrides):
    from simplesharded.models import build_model

    torch.manual_seed(0)
    return build_model("llama3", "debug", device="cpu", **{**ARGS, **overrides})


# ------------------------------------------------------------------ layout, mask, RoPE


def test_head_tail_positions():
    assert cpm.head_tail_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert cpm.head_tail_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert cpm.head_tail_positions(12, 2, 3).tolist() == [4, 5, 6, 7]
    assert cpm.head_tail_positions(6, 0, 1).tolist() == list(range(6))
    for cp in (2, 4):  # every token on exactly one rank; the gathered order is rank order
        gathered = cpm.gathered_positions(64, cp)
        assert sorted(gathered.tolist()) == list(range(64))
        assert torch.equal(gathered, torch.cat([cpm.head_tail_positions(64, r, cp)
                                                for r in range(cp)]))
    with pytest.raises(ValueError, match=r"sequence length 10 does not split into 2 \* 2 = 4"):
        cpm.head_tail_positions(10, 0, 2)


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_mask_is_the_full_mask_at_each_ranks_positions(cp):
    """Rank r's mask is the unsplit causal mask's rows at its queries' positions and columns at
    the gathered keys' positions; every rank has the same number of unmasked pairs (the point
    of head-tail balancing), which a plain split (rank r: tokens r*S/cp...) would not."""
    S = 32
    full = torch.ones(S, S, dtype=torch.bool).tril()
    keys = cpm.gathered_positions(S, cp)
    counts = []
    for r in range(cp):
        mask = cpm.causal_mask(S, r, cp)
        assert mask.shape == (S // cp, S)
        assert torch.equal(mask, full[cpm.head_tail_positions(S, r, cp)][:, keys])
        counts.append(int(mask.sum()))
    assert len(set(counts)) == 1 and sum(counts) == S * (S + 1) // 2, counts


def test_rope_rows_at_global_positions():
    table = torch.arange(20 * 3 * 2, dtype=torch.float32).view(20, 3, 2)
    cp = cpm.ContextParallel("unused", 2, 1)
    assert torch.equal(cp.rope(table, 4), table[[2, 3, 4, 5]])
    with pytest.raises(ValueError, match=r"sequence length 24 \(12 tokens on each of 2 cp "
                                         r"ranks\) exceeds max_seq_len=20"):
        cp.rope(table, 12)


@pytest.mark.parametrize("cp,heads", [(2, (4, 2)), (4, (4, 4))])
def test_attention_matches_unsplit_sdpa(monkeypatch, cp, heads):
    """Each rank's output of ContextParallel.attention, with the all-gather stood in for by a
    concatenation of every rank's stacked K/V, equals the unsplit causal SDPA at its rows; so
    do the gradients of q, k and v, summed over ranks as the gather's reduce-scatter sums
    them (here autograd through the concatenation)."""
    B, S, D = 2, 16, 8
    H, Hkv = heads
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, h, D, generator=g, requires_grad=True) for h in (H, Hkv, Hkv))
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), is_causal=True,
                                         enable_gqa=H != Hkv)
    grad_out = torch.randn(ref.shape, generator=g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)

    kv_by_rank = []  # each rank's stacked K/V as its attention lays them out for the gather

    def gather(kv, dim, group):
        assert dim == 0 and group == "cp-group"
        kv_by_rank.append(kv)
        return torch.cat(kv_by_rank_all)

    monkeypatch.setattr(cpm.funcol, "all_gather_single_autograd", gather)
    pos = [cpm.head_tail_positions(S, r, cp) for r in range(cp)]
    local = [(q[:, p], k[:, p], v[:, p]) for p in pos]
    kv_by_rank_all = [torch.stack((lk, lv), dim=2).transpose(0, 1).contiguous()
                      for _, lk, lv in local]
    outs = [cpm.ContextParallel("cp-group", cp, r).attention(*local[r]) for r in range(cp)]
    for r in range(cp):
        assert torch.equal(kv_by_rank[r], kv_by_rank_all[r])  # the layout the gather gets
        torch.testing.assert_close(outs[r], ref[:, :, pos[r]], rtol=1e-6, atol=1e-6)
    got = torch.autograd.grad([o for o in outs],
                              (q, k, v), [grad_out[:, :, p] for p in pos])
    for a, b in zip(got, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ mesh and degrees


def test_resolve_degrees_with_cp():
    from simplesharded.mesh import resolve_degrees

    d = resolve_degrees(8, dp_shard=-1, tp=2, cp=2)
    assert (d.replicate, d.shard, d.cp, d.tp, d.dp, d.world) == (1, 2, 2, 2, 2, 8)
    assert d.dims() == (("dp_shard", 2), ("cp", 2), ("tp", 2))
    assert resolve_degrees(8, 2, -1, cp=2).dims() == (("dp_replicate", 2), ("dp_shard", 2),
                                                      ("cp", 2))
    with pytest.raises(ValueError, match=r"^cp=3 does not divide the world size 8$"):
        resolve_degrees(8, cp=3)
    with pytest.raises(ValueError, match=r"^dp_shard=2 x cp=2 x tp=4 = 16 does not equal the "
                                         r"world size 8$"):
        resolve_degrees(8, dp_shard=2, tp=4, cp=2)
    with pytest.raises(ValueError, match=r"^ep=2 with cp=2: expert parallelism together with "
                                         r"context parallelism is not supported yet"):
        resolve_degrees(8, ep=2, cp=2)
    with pytest.raises(ValueError, match=r"cp=0 must be a positive int$"):
        resolve_degrees(8, cp=0)


def test_cp_mesh_roles_and_parameter_layout(fake_world):
    """(dp_shard, cp, tp?) read by name, its dense root (dp_shard_cp, tp?) sharding every
    parameter over dp_shard x cp as one dim; tp's parameters keep tp's placement after it."""
    import simplesharded as ss
    from simplesharded.mesh import (cp_dim, dense_mesh, dp_dims, dp_mesh, group_labels,
                                    mesh_roles, tp_dim)

    mesh = ss.build_mesh(1, 2, "cpu", cp=2)
    roles = mesh_roles(mesh)
    assert roles.names == ("dp_shard", "cp") and (roles.dp, roles.cp, roles.tp) == ((0,), 1, None)
    assert cp_dim(mesh) == "cp" and dp_dims(mesh) == ("dp_shard",)
    root = dense_mesh(mesh)
    assert root.mesh_dim_names == ("dp_shard_cp",) and mesh_roles(root).dp == (0,)
    assert set(group_labels(mesh).values()) >= {"dp_shard", "cp"}
    model = ss.data_parallel(make_model(), mesh)
    for n, p in model.named_parameters():
        assert p.device_mesh is root and p.placements == (Shard(0),), n

    mesh = ss.build_mesh(1, 1, "cpu", tp=2, cp=2)
    assert mesh.mesh_dim_names == ("dp_shard", "cp", "tp") and tp_dim(mesh) == "tp"
    assert dense_mesh(mesh).mesh_dim_names == ("dp_shard_cp", "tp")
    assert dp_mesh(dense_mesh(mesh)).mesh_dim_names == ("dp_shard_cp",)
    hsdp = ss.build_mesh(2, 1, "cpu", cp=2)
    assert hsdp.mesh_dim_names == ("dp_replicate", "dp_shard", "cp")
    assert dense_mesh(hsdp).mesh_dim_names == ("dp_replicate", "dp_shard_cp")


def test_apply_context_parallel_needs_a_model_that_reads_it(fake_world):
    import simplesharded as ss
    from simplesharded.models import build_model

    mesh = ss.build_mesh(1, 2, "cpu", cp=2)
    model = make_model()
    cpm.apply_context_parallel(model, mesh["cp"])
    cps = {id(m.context_parallel) for m in model.modules()
           if cpm.supports_context_parallel(type(m))}
    assert len(cps) == 1 and model.context_parallel.size == 2
    assert model.context_parallel.rank == mesh["cp"].get_local_rank()
    with pytest.raises(ValueError, match=r"^GPT has no attention that runs under context "
                                         r"parallelism"):
        cpm.apply_context_parallel(build_model("gpt", "debug", device="meta"), mesh["cp"])


# ------------------------------------------------------------------ config and preflight


def _load(argv, world=4):
    from simplesharded.trainer import check_static
    from simplesharded.trainer.config import load_config

    return check_static(load_config(None, ["--job.config_file", LLAMA, *argv]), world)


@pytest.mark.parametrize("argv,world,message", [
    (["--parallelism.context_parallel_degree", "0"], 4,
     "parallelism.context_parallel_degree=0 must be >= 1"),
    (["--parallelism.context_parallel_degree", "3", "--training.seq_len", "126"], 4,
     "parallelism.context_parallel_degree=3 does not divide the world size 4"),
    (["--parallelism.context_parallel_degree", "2", "--training.seq_len", "126"], 4,
     "parallelism.context_parallel_degree=2: training.seq_len=126 does not split into 2 * 2 = "
     "4 equal chunks (each cp rank holds a head and a tail chunk of every sequence)"),
    (["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "4",
      "--training.seq_len", "132"], 8,
     "parallelism.tensor_parallel_degree=4 does not divide training.seq_len=132 / "
     "context_parallel_degree=2 = 66 (sequence parallelism splits the sequence; or "
     "--no-parallelism.enable_sequence_parallel)"),
    (["--parallelism.context_parallel_degree", "2", "--model.name", "gpt"], 4,
     "parallelism.context_parallel_degree=2 needs a model whose attention runs under context "
     "parallelism (llama3, deepseek_v3); model gpt/debug has none"),
    (["--parallelism.context_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
      "--model.name", "deepseek_v3"], 8,
     "parallelism.context_parallel_degree=2 with expert_parallel_degree=2: expert parallelism "
     "together with context parallelism is not supported yet; set one of them to 1"),
])
def test_config_errors_are_one_line(argv, world, message):
    with pytest.raises(ValueError) as e:
        _load(argv, world)
    assert str(e.value) == message
