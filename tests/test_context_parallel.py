"""Context parallelism (models/context_parallel.py) composed with FSDP, and TP, on one mesh.

Fast, one process: the head-tail layout, the per-rank causal mask, RoPE at global positions,
the attention maths against one unsplit SDPA (the K/V gather stood in for by a concatenation),
the mesh (``(dp_shard, cp, tp?)`` over a ``dp_shard_cp`` root), the data loader's chunks, the
config and preflight error lines, and the compiled graphs on a fake process group: one K/V
gather per block on the cp group, never bucketed, never gathered again in backward (its result
is saved, with or without activation checkpointing), and overlapped by reordering with the
compute that does not need it.

The planner (a subprocess of ``python -m simplesharded.tools.forecast``): the K/V collectives it
finds in the traced graphs against their size from the model's shapes, and its memory by
sequence length.

Slow, one spawn per world size: a 2-block llama3 trains 3 SGD steps on the same global batch
as a 1-process reference (the dp ranks split the batch, the cp ranks of a dp rank each keep
their head-tail chunks of its sequences, the tp ranks read the same). Losses, the first step's
gradients and the final parameters (gathered to full tensors) must agree to 1e-5 relative:
what differs from the reference is the order of additions (the masked SDPA over gathered keys,
the reductions over dp_shard x cp, tp's row-parallel matmuls), a few fp32 ulps. A key at a
wrong position, a wrong rotation, a mask off by a chunk or a missing reduction over the cp
ranks is an O(1) error. The 2-rank job also trains the MoE model (compiled) and transformers'
Llama (eager and compiled, its attention through the attention interface) against their own
1-process references. The 4-rank job also runs the trainer with context parallel degree 2
(compiled, and with the whole step in one graph) and without (eager), whose losses must
agree.
"""
from __future__ import annotations

import operator
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from simplesharded.models import context_parallel as cpm
from simplesharded.passes.annotations import BUCKET_KEY, BUCKET_PARAMS_KEY, CP_KEY, annotations
from simplesharded.passes.bucketing import bucketable
from simplesharded.passes.collectives import find_collectives

from dist_utils import by_member, max_rel_diff, memo, spawn, storage_and_backend
from simplesharded.passes.torch_compat import CONTEXT_PARALLEL, STEP_GRAPH
from torch_range import needs_torch

ROOT = Path(__file__).resolve().parents[1]
LLAMA = str(ROOT / "configs" / "llama3_debug.toml")
ARGS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32)
GLOBAL_BATCH, SEQ, STEPS = 4, 16, 3
SGD = dict(lr=0.5)  # as tests/test_tp.py: parameter parity as tight as gradient parity
TOL = 1e-5
CP = 2


# The models run under CP besides llama3: the MoE model (llama3's attention, routed experts on
# each rank's own tokens) and transformers' Llama (through its attention interface)
MODEL_ARGS = {"llama3": {}, "deepseek_v3": dict(n_routed_experts=4, moe_hidden_dim=32,
                                                dense_hidden_dim=64),
              "hf_llama": {}}


def make_model(name: str = "llama3", **overrides):
    from simplesharded.models import build_model

    torch.manual_seed(0)
    return build_model(name, "debug", device="cpu",
                       **{**ARGS, **MODEL_ARGS[name], **overrides})


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


def test_shard_sequence_and_loader_chunks():
    """shard_sequence keeps a rank's chunks; the loader's cp ranks read the dp rank's samples
    and keep their chunks of inputs and labels alike."""
    from simplesharded.trainer.data import DistributedTokenLoader

    x = torch.arange(2 * 8).view(2, 8)
    assert cpm.shard_sequence(x, 1, 2).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    tokens = torch.arange(1000)
    whole = DistributedTokenLoader(tokens, 16, 2, dp_rank=1, dp_world=2, seed=3)
    parts = [DistributedTokenLoader(tokens, 16, 2, dp_rank=1, dp_world=2, seed=3, cp_rank=r,
                                    cp=CP) for r in range(CP)]
    for _ in range(2):
        xs, ys = next(whole)
        for r, loader in enumerate(parts):
            xr, yr = next(loader)
            assert xr.shape == (2, 16 // CP) and xr.is_contiguous()
            assert torch.equal(xr, cpm.shard_sequence(xs, r, CP))
            assert torch.equal(yr, cpm.shard_sequence(ys, r, CP))


@needs_torch(CONTEXT_PARALLEL)
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
    # EP borrows its ranks from dp_shard x cp: efsdp = dp_shard * cp / ep
    d = resolve_degrees(8, ep=8, cp=2)
    assert (d.shard, d.cp, d.ep, d.efsdp) == (4, 2, 8, 1)
    assert d.dims() == (("efsdp", 1), ("ep", 8))  # the ep mesh; cp is its sibling
    with pytest.raises(ValueError, match=r"^ep=3 does not divide dp_shard=4 x cp=2 \(expert "
                                         r"parallelism borrows its ranks from the data-parallel "
                                         r"shards and the cp ranks\)$"):
        resolve_degrees(8, ep=3, cp=2)
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
    model = ss.data_parallel(make_model(), mesh, storage="param")
    for n, p in model.named_parameters():
        assert p.device_mesh is root and p.placements == (Shard(0),), n

    mesh = ss.build_mesh(1, 1, "cpu", tp=2, cp=2)
    assert mesh.mesh_dim_names == ("dp_shard", "cp", "tp") and tp_dim(mesh) == "tp"
    assert dense_mesh(mesh).mesh_dim_names == ("dp_shard_cp", "tp")
    assert dp_mesh(dense_mesh(mesh)).mesh_dim_names == ("dp_shard_cp",)
    hsdp = ss.build_mesh(2, 1, "cpu", cp=2)
    assert hsdp.mesh_dim_names == ("dp_replicate", "dp_shard", "cp")
    assert dense_mesh(hsdp).mesh_dim_names == ("dp_replicate", "dp_shard_cp")


def test_cp_with_ep_mesh_is_the_ep_mesh_with_a_cp_sibling(fake_world):
    """cp 2 x ep 2 on 4 ranks (dp_shard 2): build_mesh gives the ep mesh (efsdp 2, ep 2),
    unflattened from dp_shard_cp as the cp mesh (dp_shard 2, cp 2) is; cp_mesh finds the latter
    from the former, whose dense root shards the dense parameters over dp_shard x cp and
    whose efsdp the expert weights."""
    import simplesharded as ss
    from simplesharded.mesh import (cp_dim, cp_mesh, dense_mesh, ep_dim, expert_dp_mesh,
                                    group_labels)

    mesh = ss.build_mesh(1, 2, "cpu", ep=2, cp=2)
    assert mesh.mesh_dim_names == ("efsdp", "ep") and ep_dim(mesh) == "ep"
    assert cp_dim(mesh) is None and cp_mesh(mesh).mesh_dim_names == ("cp",)
    assert cp_mesh(mesh).mesh.tolist() == mesh["ep"].mesh.tolist() == [0, 1]  # ep = cp here
    assert cp_mesh(mesh["efsdp"]) is None  # a slice without ep reads as no cp either
    assert dense_mesh(mesh).mesh_dim_names == ("dp_shard_cp",)
    assert dense_mesh(mesh).mesh.tolist() == [0, 1, 2, 3]
    assert expert_dp_mesh(mesh).mesh.tolist() == [0, 2]
    assert {"ep", "cp", "efsdp"} <= set(group_labels(mesh).values())
    # ep 4 spans both cp groups of the 4 ranks; cp stays (dp_shard 2, cp 2)
    wide = ss.build_mesh(1, 2, "cpu", ep=4, cp=2)
    assert wide["ep"].mesh.tolist() == [0, 1, 2, 3] and cp_mesh(wide).mesh.tolist() == [0, 1]


@needs_torch(CONTEXT_PARALLEL)
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
     "parallelism (llama3, deepseek_v3, --model.name hf of the Llama family); model gpt/debug "
     "has none"),
    (["--parallelism.context_parallel_degree", "2", "--parallelism.expert_parallel_degree", "3",
      "--model.name", "deepseek_v3"], 8,
     "parallelism.expert_parallel_degree=3 does not divide parallelism.data_parallel_shard_degree"
     "=4 x parallelism.context_parallel_degree=2 (expert parallelism borrows its ranks from the "
     "data-parallel shards and the cp ranks)"),
])
def test_config_errors_are_one_line(argv, world, message):
    with pytest.raises(ValueError) as e:
        _load(argv, world)
    assert str(e.value) == message


def test_hf_models_run_cp_when_their_attention_is_plain_causal(tmp_path):
    """--model.name hf: a Llama config passes the preflight at cp 2; sliding-window attention
    (Qwen2's use_sliding_window) is one error naming the key."""
    from transformers import LlamaConfig, Qwen2Config

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    LlamaConfig(**shape).save_pretrained(tmp_path / "llama")
    Qwen2Config(**shape, use_sliding_window=True, sliding_window=16).save_pretrained(
        tmp_path / "qwen2")
    cp = ["--parallelism.context_parallel_degree", "2", "--model.name", "hf", "--model.path"]
    assert _load([*cp, str(tmp_path / "llama")]).parallelism.context_parallel_degree == 2
    with pytest.raises(ValueError) as e:
        _load([*cp, str(tmp_path / "qwen2")])
    assert str(e.value).startswith(
        f"parallelism.context_parallel_degree=2 with model.path='{tmp_path / 'qwen2'}': "
        f"Qwen2ForCausalLM: config ")
    assert "sliding" in str(e.value) and "\n" not in str(e.value)


@needs_torch(CONTEXT_PARALLEL)
def test_preflight_prints_one_error_line(monkeypatch, capsys):
    """run_train.sh's preflight (``python -m simplesharded.trainer --check-only``): a CP error
    is one ``error:`` line and exit 2; a good CP config passes."""
    from simplesharded.trainer import main as train_main

    monkeypatch.setenv("WORLD_SIZE", "4")
    cp = ["--check-only", "--job.config_file", LLAMA, "--parallelism.context_parallel_degree"]
    assert train_main([*cp, "2"]) == 0
    assert capsys.readouterr().err == ""
    assert train_main([*cp, "2", "--model.name", "gpt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: parallelism.context_parallel_degree=2 needs a model whose "
                          "attention runs under context parallelism") and err.count("\n") == 1
    assert train_main([*cp, "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: parallelism.context_parallel_degree=3") and err.count("\n") == 1


def test_config_resolves_batch_over_dp_only():
    """The cp ranks of a dp rank share its sequences: 4 ranks at cp 2 are dp 2."""
    cfg = _load(["--parallelism.context_parallel_degree", "2"])
    assert cfg.parallelism.data_parallel_shard_degree == 2
    assert cfg.training.local_batch_size == cfg.training.global_batch_size // 2
    cfg = _load(["--parallelism.context_parallel_degree", "2",
                 "--parallelism.tensor_parallel_degree", "2"])
    assert cfg.parallelism.data_parallel_shard_degree == 1


# ------------------------------------------------------------------ the planner (forecast)


@needs_torch(CONTEXT_PARALLEL)
def test_forecast_costs_the_kv_gathers_and_memory_by_sequence_length():
    """`python -m simplesharded.tools.forecast` at cp 2 (dp 2 x cp 2, fake world): the K/V
    collectives it finds in the traced graphs are one gather and one reduce-scatter per layer,
    each gather as large as the model's shapes say (2 · tokens · kv_heads · head_dim · bytes
    of a dp rank's micro-batch), and sending (cp − 1) / cp of it; --seq-lens reports a row per
    length, whose tokens per rank are split over cp."""
    import re
    import subprocess
    import sys

    from simplesharded.models import get_model_spec

    # its own process: the forecast stands up its fake process group, which this module's
    # fake_world fixture may hold already
    out = subprocess.run(
        [sys.executable, "-m", "simplesharded.tools.forecast", "--config", LLAMA,
         "--world-size", "4", "--hardware", "h100-ib400", "--backends",
         "aot_eager_blockbucketing", "--timeline-backend", "aot_eager_blockbucketing",
         "--parallelism.context_parallel_degree", "2", "--seq-lens", "64", "256",
         "--model.n_layers", "2"],  # of the debug model's 6: three traces, each of 2 blocks
        capture_output=True, text=True, check=True, cwd=ROOT).stdout
    args = get_model_spec("llama3", "debug", n_layers=2)[1]
    local_batch, seq = 8 // 2, 128  # the debug config: global batch 8 over dp 2, fp32
    per_layer = 2 * local_batch * seq * args.n_kv_heads * (args.dim // args.n_heads) * 4
    line = next(x for x in out.splitlines() if x.startswith("context parallel:"))
    count, traced, formula, sent = re.match(
        r"context parallel: (\d+) K/V .*?, ([\d.,]+) MiB gathered per layer traced .*? = "
        r"([\d.,]+) MiB\), ([\d.,]+) MiB/rank sent", line).groups()
    assert int(count) == 2 * args.n_layers
    assert float(traced) == float(formula) == round(per_layer / 2**20, 2)
    # forward gathers and backward reduce-scatters, each sending half at cp 2
    assert float(sent) == round(2 * args.n_layers * per_layer / 2 / 2**20, 2)
    rows = {int(r[0]): r for r in (
        [c.strip() for c in x.strip("|").split("|")] for x in out.splitlines()
        if re.match(r"\| \d+ \| \d+ \|", x))}
    assert sorted(rows) == [64, 256]
    assert [int(rows[n][1]) for n in (64, 256)] == [local_batch * 64 // 2, local_batch * 256 // 2]
    assert float(rows[256][2]) > float(rows[64][2])  # activations grow with the sequence


# ------------------------------------------------------------------ compiled graphs (fake pg)


_GRAPHS: dict = {}


def _graphs(ac: bool):
    """{"fw"|"bw": {stage: gm}} of a 2-block CP model on the fake world of 4 (dp_shard 2 x
    cp 2) under aot_eager_blockbucketing, and the cp group's name; traced once per module."""
    if ac not in _GRAPHS:
        import pass_utils as pu

        import simplesharded as ss
        from simplesharded.trainer.recipe import apply_activation_checkpointing

        mesh = ss.build_mesh(1, 2, "cpu", cp=2)
        model = make_model()
        cpm.apply_context_parallel(model, mesh["cp"])
        if ac:
            apply_activation_checkpointing(model, "full", 1, compiled=True)
        tokens = torch.randint(0, ARGS["vocab_size"], (2, SEQ // CP))
        stages = pu.capture_graphs(model, mesh, (tokens, tokens),
                                   loss=lambda out: out, reshard_after_forward="auto")
        _GRAPHS[ac] = stages, mesh.get_group("cp").group_name
    return _GRAPHS[ac]


def _cp_collectives(gm):
    return [c for c in find_collectives(gm) if CP_KEY in annotations(c.start)]


@needs_torch(CONTEXT_PARALLEL)
@pytest.mark.parametrize("ac", [False, True], ids=["no-ac", "ac"])
def test_cp_gathers_one_per_block_untouched_by_our_passes(fake_world, ac):
    """Forward: one K/V all-gather per block on the cp group, carrying ss_cp and no parameter;
    backward: its reduce-scatter, and no all-gather on the cp group (the gathered K/V are
    saved, never gathered again, activation checkpointing or not). Bucketing merges the
    parameters' gathers but not these, and no pass moves them: each keeps its start, its wait
    and the nodes around them (the reordering pass leaves collectives that are not ours
    where they were traced, passes/reordering.py)."""
    stages, cp_group = _graphs(ac)
    n = ARGS["n_layers"]
    for kind, cp_kind in (("fw", "all_gather"), ("bw", "reduce_scatter")):
        before = _cp_collectives(stages[kind]["input"])
        assert [c.kind for c in before] == [cp_kind] * n, (kind, before)
        assert all(c.group_name == cp_group and not c.ours for c in before)
        assert all(c.wait is not None for c in before)
        for stage in ("bucketing", "reordering", "agreement"):
            gm = stages[kind][stage]
            after = _cp_collectives(gm)
            assert [(c.kind, c.start.name, c.wait.name) for c in after] == \
                [(c.kind, c.start.name, c.wait.name) for c in before], (kind, stage)
            for c in after:
                assert BUCKET_KEY not in annotations(c.start)
                assert BUCKET_PARAMS_KEY not in annotations(c.start)
                # the gathered buffer's input and first reader are the traced ones
                assert c.start.args[0].name in {a.name for a in before[0].start.graph.nodes}
        # never offered to a plan (BlockPlan's or AutoPlan's): only parameters' collectives are
        offered = {c.start for c in bucketable(stages[kind]["input"].graph)}
        assert offered and not offered & {c.start for c in before}
        ours = [c for c in find_collectives(stages[kind]["bucketing"]) if c.ours]
        assert len(ours) < len([c for c in find_collectives(stages[kind]["input"]) if c.ours])
    bw_cp_gathers = [c for c in find_collectives(stages["bw"]["agreement"])
                     if c.group_name == cp_group and c.kind == "all_gather" and not c.ours]
    assert bw_cp_gathers == []
    # backward reads the gathered K/V forward saved (the buffer, or its keys and values), never
    # a saved local K/V to gather again
    gathered = _cp_collectives(stages["fw"]["input"])[0]
    local_shape = gathered.start.args[0].meta["val"].shape
    B, Hkv, D = local_shape[1], local_shape[3], local_shape[4]
    full_shape = gathered.wait.meta["val"].shape
    shapes = [tuple(p.meta["val"].shape) for p in stages["bw"]["input"].graph.find_nodes(
        op="placeholder") if isinstance(p.meta.get("val"), torch.Tensor)]
    assert tuple(local_shape) not in shapes
    saved = [x for x in shapes if x in (tuple(full_shape), (B, Hkv, full_shape[0], D))]
    assert len(saved) >= n, shapes


@needs_torch(CONTEXT_PARALLEL)
def test_reordering_overlaps_each_cp_collective_with_compute_that_does_not_need_it(fake_world):
    """As traced, a cp collective is waited right after its start. After reordering, forward:
    the query projection (a matmul) runs between a K/V gather's start and its wait, and the
    wait is followed by nothing but views before the attention; backward: matmuls of the
    layer's other gradients run while the keys' gradients are reduce-scattered. Everything
    the start reads still comes before it, and a second run changes nothing."""
    import pass_utils as pu

    from simplesharded.passes.plans import BlockPlan
    from simplesharded.passes.reordering import reorder_for_overlap

    stages, _ = _graphs(False)
    mm = torch.ops.aten.mm.default
    for kind in ("fw", "bw"):
        traced = stages[kind]["input"]
        for c in _cp_collectives(traced):  # as traced: nothing between start and wait
            assert c.start.next is c.wait, (kind, c.start.next)
        gm = stages[kind]["agreement"]
        nodes = list(gm.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        for c in _cp_collectives(gm):
            between = nodes[pos[c.start] + 1:pos[c.wait]]
            assert any(n.target is mm for n in between), (kind, [n.name for n in between])
            reads, stack = set(), [c.start]
            while stack:
                for a in stack.pop().all_input_nodes:
                    if a not in reads:
                        reads.add(a)
                        stack.append(a)
            assert all(pos[a] < pos[c.start] for a in reads)
            if kind == "fw":
                first = min((u for u in _users_past_views(c.wait)), key=pos.__getitem__)
                assert "scaled_dot_product" in str(first.target), first
                # between them only views (the gathered K/V's, the queries' transpose)
                assert all(n.target in _VIEW_OPS for n in nodes[pos[c.wait] + 1:pos[first]]), \
                    [(n.name, n.target) for n in nodes[pos[c.wait] + 1:pos[first]]]
        again = pu.fresh(stages[kind]["reordering"])
        reorder_for_overlap(again, BlockPlan())
        assert pu.graph_signature(again) == pu.graph_signature(stages[kind]["reordering"])


@needs_torch(STEP_GRAPH)
def test_step_graph_leaves_cp_collectives_apart_and_overlaps_them(fake_world):
    """compile_step's one graph (passes/traced_backward.py): forward's K/V all-gathers and, in
    its traced backward, their reduce-scatters over the cp group, one per block, none taken
    for a parameter's (so no plan offers them to bucketing, and every pass keeps their start
    and wait); the reduce-scatters carry ``ss_cp`` as a joint graph's backward does, so
    reordering overlaps each with compute, as it does the gathers."""
    import copy

    import simplesharded as ss
    from simplesharded.passes.annotations import UPDATE_KEY

    seen = {}

    def observe(kind, stage, gm):
        seen.setdefault(stage, []).append(copy.deepcopy(gm))

    torch._dynamo.reset()
    mesh = ss.build_mesh(1, 2, "cpu", cp=2)
    model = make_model()
    cpm.apply_context_parallel(model, mesh["cp"])
    ss.data_parallel(model, mesh, storage="param")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = ss.compile_step(model, opt, lambda m, t, y: m(t, y) / y.numel(),
                           backend="aot_eager_blockbucketing", observer=observe)
    tokens = torch.randint(0, ARGS["vocab_size"], (2, SEQ // CP))
    step(tokens, tokens)
    torch._dynamo.reset()
    cp_group, n = mesh.get_group("cp").group_name, ARGS["n_layers"]
    assert len(seen["input"]) == 1 and any(UPDATE_KEY in annotations(x)
                                           for x in seen["input"][0].graph.nodes)
    traced = _cp_collectives(seen["input"][0])
    assert [c.kind for c in traced] == ["all_gather"] * n + ["reduce_scatter"] * n, traced
    assert all(c.group_name == cp_group and not c.ours and c.wait is not None for c in traced)
    assert [bool(c.start.meta.get("autograd_backward")) for c in traced] == [False] * n + [True] * n
    assert not {c.start for c in bucketable(seen["input"][0].graph)} & {c.start for c in traced}
    final = seen["agreement"][0]
    after = _cp_collectives(final)
    assert [(c.kind, c.start.name, c.wait.name) for c in after] == \
        [(c.kind, c.start.name, c.wait.name) for c in traced]
    nodes = list(final.graph.nodes)
    pos = {x: i for i, x in enumerate(nodes)}
    mm = torch.ops.aten.mm.default
    for c in after:
        assert BUCKET_KEY not in annotations(c.start)
        between = nodes[pos[c.start] + 1:pos[c.wait]]
        assert any(x.target is mm for x in between), (c.kind, [x.name for x in between])


def _views_of(node):
    out, stack = {node}, [node]
    while stack:
        for u in stack.pop().users:
            if u not in out and u.target in _VIEW_OPS:
                out.add(u)
                stack.append(u)
    return out


def _users_past_views(node):
    views = _views_of(node)
    return {u for v in views for u in v.users if u not in views}


_VIEW_OPS = {torch.ops.aten.permute.default, torch.ops.aten.unbind.int,
             torch.ops.aten.transpose.int, torch.ops.aten.view.default, operator.getitem}


# ------------------------------------------------------------------ parity (spawned ranks)


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, ARGS["vocab_size"], (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(step_fn, x, y, name: str):
    """The summed cross-entropy of ``x``'s tokens: our models compute it in their forward,
    transformers' return logits."""
    from simplesharded.models import logits_of

    if name == "hf_llama":
        logits = logits_of(step_fn(x))
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
    return step_fn(x, y, loss_chunks=1)


def train(model, step_fn, dp_rank: int, dp_size: int, cp_rank: int, cp: int, tp: int,
          name: str = "llama3"):
    """STEPS SGD steps; the summed loss of a rank's tokens over the global token count, so the
    ranks' losses sum to the reference's mean (tp ranks hold the same: divided out). The MoE
    model's expert bias is updated from the token counts of all ranks, as the trainer does."""
    opt = torch.optim.SGD(model.parameters(), **SGD)
    rows = GLOBAL_BATCH // dp_size
    losses, grads = [], None
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows]
        if cp > 1:
            x, y = cpm.shard_sequence(x, cp_rank, cp), cpm.shard_sequence(y, cp_rank, cp)
        loss = _loss(step_fn, x, y, name) / (GLOBAL_BATCH * SEQ)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            grads = by_member(model, grads=True)
        opt.step()
        if hasattr(model, "update_expert_bias"):
            model.update_expert_bias()
        total = loss.detach().clone()
        if dp_size * cp * tp > 1:  # a spawned rank: the others hold the rest of the sum
            dist.all_reduce(total)
        losses.append(total.item() / tp)
    return losses, grads, by_member(model)


@memo
def reference(name: str = "llama3"):
    model = make_model(name)
    return train(model, model, 0, 1, 0, 1, 1, name)


# world → [(dp_shard, tp, backend, activation checkpointing[, model])]; cp = 2 throughout
LAYOUTS = {
    2: [(1, 1, "eager", False), (1, 1, "eager", True), (1, 1, "aot_eager_blockbucketing", False),
        (1, 1, "aot_eager_blockbucketing", True),
        # storage="ragged": the parameters sharded over dp_shard x cp in ragged buckets
        (1, 1, "ragged:aot_eager_blockbucketing", False),
        (1, 1, "aot_eager_blockbucketing", False, "deepseek_v3"),
        (1, 1, "eager", False, "hf_llama"), (1, 1, "aot_eager_blockbucketing", False, "hf_llama")],
    4: [(2, 1, "eager", False), (2, 1, "aot_eager_blockbucketing", False),
        (1, 2, "eager", False), (1, 2, "aot_eager_blockbucketing", False)],
}
CASES = [(world, case) for world, cases in LAYOUTS.items() for case in cases]


def _case(rank, world, dp, tp, backend, ac, name="llama3"):
    import simplesharded as ss
    from simplesharded.trainer.recipe import apply_activation_checkpointing, apply_tensor_parallel

    torch._dynamo.reset()
    counts: dict = {}
    storage, backend = storage_and_backend(backend)

    def observe(kind, stage, gm):
        if kind in ("fw", "bw") and stage == "agreement":
            counts[kind] = sorted((c.kind, c.group_name) for c in _cp_collectives(gm))

    mesh = ss.build_mesh(1, dp, "cpu", tp=tp, cp=CP)
    model = make_model(name)
    apply_tensor_parallel(model, mesh, sequence_parallel=True)
    cpm.apply_context_parallel(model, mesh["cp"])
    if ac:
        apply_activation_checkpointing(model, "full", 1, compiled=backend != "eager")
    ss.data_parallel(model, mesh, grad_reduction="sum", storage=storage)
    step_fn = model if backend == "eager" else torch.compile(
        model, backend=ss.make_backend(backend, observer=observe), fullgraph=True)
    losses, grads, params = train(model, step_fn, mesh["dp_shard"].get_local_rank(), dp,
                                  mesh["cp"].get_local_rank(), CP, tp, name)
    return {"losses": losses, "grads": grads if rank == 0 else None,
            "params": params if rank == 0 else None, "counts": counts,
            "cp_group": mesh.get_group("cp").group_name}


# The trainer on the debug config, small; constant lr after warmup
TRAINER = ["--training.seq_len", "32", "--training.global_batch_size", "4",
           "--training.steps", "3", "--training.val_every", "3", "--training.val_steps", "1",
           "--no-metrics.progress_bar", "--lr_scheduler.warmup_steps", "15",
           "--lr_scheduler.decay_type", "constant",
           "--model.n_layers", "2"]  # of the debug model's 6: what compiles scales with them
# The compiled runs take the for-loop update, the one compile_step writes: the whole step in
# one graph (compile.scope step) is then compared with the split step exactly.
_CP2 = ["--parallelism.context_parallel_degree", "2", "--compile.enable",
        "--compile.backend", "aot_eager_blockbucketing", "--optimizer.implementation", "for-loop"]
TRAINER_RUNS = {"cp2_compiled": _CP2, "cp2_step": [*_CP2, "--compile.scope", "step"],
                "cp1_eager": []}


def _trainer_run(rank, world, folder: str, name: str):
    from simplesharded.trainer import Trainer, check_static
    from simplesharded.trainer.config import load_config

    torch._dynamo.reset()
    cfg = check_static(load_config(None, ["--job.config_file", LLAMA, *TRAINER,
                                          *TRAINER_RUNS[name], "--job.dump_folder",
                                          os.path.join(folder, name)]), world)
    trainer = Trainer(cfg, "cpu")
    losses = trainer.run()
    return losses, trainer.validate()


def job(rank, world, folder):
    out = {case: _case(rank, world, *case) for case in LAYOUTS[world]}
    if world == 4:
        for name in TRAINER_RUNS:
            out[name] = _trainer_run(rank, world, folder, name)
    return out


@memo
def run(world: int):
    with tempfile.TemporaryDirectory(prefix="ss_cp_") as folder:
        return spawn(world, job, folder, timeout_s=900)


def _ids(v):
    world, (dp, tp, backend, ac, *name) = v
    model = "".join("-" + n for n in name)
    return f"w{world}-dp{dp}-cp{CP}-tp{tp}-{backend}{'-ac' if ac else ''}{model}"


@needs_torch(CONTEXT_PARALLEL)
@pytest.mark.slow
@pytest.mark.parametrize("world,case", CASES, ids=[_ids(c) for c in CASES])
def test_parity_with_single_process(world, case):
    ref_losses, ref_grads, ref_params = reference(*case[4:])
    results = run(world)
    got = results[0][case]
    for r in results[1:]:  # every rank reports the same global loss
        assert r[case]["losses"] == got["losses"]
    rel = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref_losses))
    assert rel <= TOL, (got["losses"], ref_losses)
    for what, mine, ref in (("gradients", got["grads"], ref_grads),
                            ("final parameters", got["params"], ref_params)):
        assert set(mine) == set(ref)
        bad = {n: max_rel_diff(t, ref[n]) for n, t in mine.items()
               if not max_rel_diff(t, ref[n]) <= TOL}
        assert not bad, f"{what} beyond {TOL}: {bad}"
    if case[2] != "eager":  # the compiled graphs: one K/V gather per block, on the cp group
        for r in results:
            cp_group, counts = r[case]["cp_group"], r[case]["counts"]
            n = ARGS["n_layers"]  # the MoE model's too: its first block dense, the second MoE
            assert counts == {"fw": [("all_gather", cp_group)] * n,
                              "bw": [("reduce_scatter", cp_group)] * n}, counts


@needs_torch(CONTEXT_PARALLEL)
@pytest.mark.slow
def test_trainer_cp2_compiled_matches_no_cp():
    """The trainer on 4 ranks with context parallel degree 2, compiled (dp 2 x cp 2), gives the
    losses of the same run without CP (dp 4, eager), and the same validation loss: each is the
    mean over the global tokens (1e-4 rel, as the EP trainer test)."""
    r = run(4)[0]
    (cp_losses, cp_val), (ref_losses, ref_val) = r["cp2_compiled"], r["cp1_eager"]
    assert len(cp_losses) == len(ref_losses) == 3
    assert max(abs(a - b) / abs(b) for a, b in zip(cp_losses, ref_losses)) <= 1e-4, \
        (cp_losses, ref_losses)
    assert abs(cp_val - ref_val) <= 1e-4 * abs(ref_val), (cp_val, ref_val)


@needs_torch(CONTEXT_PARALLEL)
@needs_torch(STEP_GRAPH)
@pytest.mark.slow
def test_trainer_cp2_step_scope_matches_model_scope():
    """The same trainer run (4 ranks, dp 2 x cp 2) with the whole step in one graph
    (compile.scope step: the K/V gathers' reduce-scatters in its traced backward, apart from
    the parameters' reductions) gives model scope's losses and validation loss (measured: bit
    for bit; asserted ≤ 1e-6 relative, as the norm's sum in another order moves the last
    bits: tests/test_step.py)."""
    for r in run(4):
        (step_losses, step_val), (ref_losses, ref_val) = r["cp2_step"], r["cp2_compiled"]
        assert len(step_losses) == len(ref_losses) == 3
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(step_losses, ref_losses)), \
            (step_losses, ref_losses)
        assert abs(step_val - ref_val) <= 1e-6 * abs(ref_val), (step_val, ref_val)
