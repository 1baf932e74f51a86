"""The cost model's link rule (intra- vs inter-node process groups) and `plan` on a dp x tp
mesh: the fake-process-group trace carries TP's collectives on the tp group and our dp
collectives bucketed per block as without TP."""
import dataclasses
import re
from pathlib import Path

import pytest
import torch.distributed as dist

from simplesharded.passes.comm_cost import INTER_NODE, INTRA_NODE, comm_time, group_link, intra_node
from simplesharded.passes.hardware import get_hardware

H100 = get_hardware("h100-ib400")
DEBUG_CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "llama3_debug.toml")


def _groups(sizes: tuple[int, ...], dim: int) -> list[tuple[int, ...]]:
    """Every group of mesh dim ``dim`` of a row-major mesh of ``sizes`` (as DeviceMesh)."""
    import torch

    mesh = torch.arange(int(torch.tensor(sizes).prod())).view(sizes)
    return [tuple(g.tolist()) for g in mesh.movedim(dim, -1).reshape(-1, sizes[dim])]


@pytest.mark.parametrize("sizes,gpus_per_node,expected", [
    ((32, 8), 8, (INTER_NODE, INTRA_NODE)),  # FSDP 32 x TP 8 on nodes of 8: tp on NVLink
    ((4, 16), 8, (INTER_NODE, INTER_NODE)),  # tp 16 > a node
    ((2, 4), 8, (INTRA_NODE, INTRA_NODE)),   # the whole mesh in one node
    ((4, 2, 4), 8, (INTER_NODE, INTRA_NODE, INTRA_NODE)),  # dp_shard 2 x tp 4 fill a node
    ((8, 3), 8, (INTER_NODE, INTER_NODE)),   # tp 3: groups 2,5,... straddle node borders
])
def test_link_of_every_mesh_dim_group(sizes, gpus_per_node, expected):
    """Each group of a mesh dim gets the same link (rank-invariant), and it is the intra-node
    one exactly when every group of the dim lies within one node."""
    world = 1
    for n in sizes:
        world *= n
    for dim, want in enumerate(expected):
        groups = _groups(sizes, dim)
        inside = all(g[0] // gpus_per_node == g[-1] // gpus_per_node for g in groups)
        assert (want == INTRA_NODE) is inside  # the expectation itself, by brute force
        got = {intra_node(g, world, gpus_per_node) for g in groups}
        assert got == {want == INTRA_NODE}, (sizes, dim, got)


def test_link_rule_is_decided_for_the_family_not_the_group():
    """tp 3 on nodes of 8: ranks (0, 1, 2) sit in node 0, but their sibling (6, 7, 8) does
    not; every rank must decide alike, so all say inter-node. A group that is no mesh dim's
    (not an arithmetic progression tiling the world) is inter-node too."""
    assert intra_node((0, 1, 2), 24, 8) is False
    assert intra_node((0, 1, 3), 8, 8) is False
    assert intra_node((5,), 8, 8) is True


def test_comm_time_uses_the_link():
    t_intra = comm_time("all_gather", 8e9, 8, H100, INTRA_NODE)
    t_inter = comm_time("all_gather", 8e9, 8, H100, INTER_NODE)
    assert t_intra == pytest.approx(H100.intra_node_alpha_s + 7e9 / H100.intra_node_bandwidth_Bps)
    assert t_inter == pytest.approx(H100.alpha_s + 7e9 / H100.bandwidth_Bps)
    assert t_inter > 5 * t_intra
    # hardware without an intra-node link: one link for every group
    flat = get_hardware("local")
    assert comm_time("all_gather", 8e9, 8, flat, INTRA_NODE) == \
        comm_time("all_gather", 8e9, 8, flat, INTER_NODE)
    with pytest.raises(ValueError, match="link"):
        comm_time("all_gather", 8, 2, H100, "pcie")


def test_group_link_of_live_groups():
    """On a fake process group of 16 ranks laid out dp_shard 2 x tp 8: the tp group is
    intra-node and the dp group inter-node on nodes of 8; with nodes of 16 both are
    intra-node; a profile without an intra-node link and an unknown group are inter-node."""
    from simplesharded.tools import cluster_trace as dry_run
    from simplesharded.mesh import build_mesh

    with dry_run.fake_world(16):
        mesh = build_mesh(1, -1, "cpu", tp=8)
        dp, tp = (mesh.get_group(d).group_name for d in ("dp_shard", "tp"))
        assert (group_link(dp, H100), group_link(tp, H100)) == (INTER_NODE, INTRA_NODE)
        big = dataclasses.replace(H100, gpus_per_node=16)
        assert (group_link(dp, big), group_link(tp, big)) == (INTRA_NODE, INTRA_NODE)
        assert group_link(tp, get_hardware("local")) == INTER_NODE
        assert group_link("no-such-group", H100) == INTER_NODE


def _traced_counts(world: int, tp: int, hw) -> tuple[dict, dict, int, int]:
    """Block-bucketed debug model (2 blocks) on ``world`` fake ranks with tensor parallel
    degree ``tp``: ({(group label, kind): count} over fw+bw, {label: link}, traced local
    shard elements, real local shard elements of the same model)."""
    from simplesharded.tools import cluster_trace as dry_run
    from simplesharded.trainer.config import load_config
    from simplesharded.mesh import build_mesh
    from simplesharded.models import build_model
    from simplesharded.passes.collectives import count_by_group
    from simplesharded.passes.simulate import simulate
    from simplesharded.trainer import check_static, parallelize

    # one shard per parameter: a block is one bucket with or without TP (ragged buckets keep
    # a TP block's shards and its replicated norms apart)
    cfg = check_static(load_config(DEBUG_CONFIG, [
        "--activation_checkpoint.mode", "none", "--parallelism.tensor_parallel_degree",
        str(tp), "--training.global_batch_size", str(world // tp),
        "--parallelism.storage", "param"]), world)
    with dry_run.fake_world(world):
        traced = dry_run.trace(cfg, cfg.training.local_batch_size, n_layers=2)
        fw, bw = dry_run.apply_backend_passes(traced, "aot_eager_blockbucketing", "h100-ib400",
                                              None)
        counts: dict = {}
        for gm in (fw, bw):
            for key, n in count_by_group(gm, traced.group_labels).items():
                counts[key] = counts.get(key, 0) + n
        links = {label: g.link for gm in (fw, bw)
                 for label, g in simulate(gm, hw, labels=traced.group_labels).by_group.items()}
        # the same layout on real (CPU) tensors, as the trainer builds it on CPU
        p = cfg.parallelism
        mesh = build_mesh(p.data_parallel_replicate_degree, p.data_parallel_shard_degree,
                          "cpu", tp)
        model = build_model("llama3", "debug", device="cpu", n_layers=2)
        cfg.compile.enable = False
        parallelize(model, mesh, cfg)
        real = sum(q.to_local().numel() for q in model.parameters())
    assert not dist.is_initialized()
    return counts, links, traced.local_numel, real


def test_plan_traces_tp_and_dp_groups():
    """world 4 = dp 2 x tp 2: TP's collectives are on the tp group, ours on dp_shard with
    one bucket per block exactly as the dp-2 trace without TP has them; with nodes of 2 ranks
    tp is intra-node and dp inter-node. The planner's shard size is the trainer's."""
    nodes_of_2 = dataclasses.replace(H100, gpus_per_node=2)
    counts, links, traced, real = _traced_counts(4, 2, nodes_of_2)
    tp_counts = {kind: n for (label, kind), n in counts.items() if label == "tp"}
    assert tp_counts.get("all_gather", 0) > 0 and tp_counts.get("reduce_scatter", 0) > 0
    # sequence parallelism: per block 2 gathers + 2 scatters in forward and again in backward
    assert tp_counts["all_gather"] >= 2 * 2 * 2 and tp_counts["reduce_scatter"] >= 2 * 2 * 2
    assert links == {"dp_shard": INTER_NODE, "tp": INTRA_NODE}
    assert traced == real

    plain, plain_links, _, _ = _traced_counts(2, 1, nodes_of_2)
    dp = {k: n for k, n in counts.items() if k[0] == "dp_shard"}
    assert dp == {k: n for k, n in plain.items() if k[0] == "dp_shard"}
    # one all-gather per bucket in forward (pre, 2 blocks, post) + re-gathers and reductions
    assert dp[("dp_shard", "reduce_scatter")] == 4
    assert set(plain_links) == {"dp_shard"}


def test_activation_checkpointing_gathers_tp_activations_again_in_backward():
    """Under full activation checkpointing each block's sequence-parallel all-gathers (before
    attention and before the MLP) run again in backward instead of being saved, as
    torchtitan's AC re-runs them (passes/recompute.py); TP's reduce-scatters and forward are
    unchanged, and forward hands backward fewer bytes. With
    activation_checkpoint.recompute_tp_outputs the block's reduce-scatters (attention's and
    the MLP's outputs) run again too: two more per block in backward, fewer bytes still."""
    from simplesharded.tools import cluster_trace as dry_run
    from simplesharded.trainer import check_static
    from simplesharded.trainer.config import load_config
    from simplesharded.passes.collectives import count_by_group

    got = {}
    for ac in ("none", "full", "full+tp"):
        cfg = check_static(load_config(DEBUG_CONFIG, [
            "--activation_checkpoint.mode", ac.split("+")[0],
            "--activation_checkpoint.recompute_tp_outputs", str(ac.endswith("+tp")),
            "--parallelism.tensor_parallel_degree", "2",
            "--training.global_batch_size", "2", "--parallelism.storage", "param"]), 4)
        with dry_run.fake_world(4):
            traced = dry_run.trace(cfg, cfg.training.local_batch_size, n_layers=2)
            fw, bw = dry_run.apply_backend_passes(traced, "aot_eager_blockbucketing",
                                                  "h100-ib400", None)
            got[ac] = ({k[1]: n for k, n in count_by_group(fw, traced.group_labels).items()
                        if k[0] == "tp"},
                       {k[1]: n for k, n in count_by_group(bw, traced.group_labels).items()
                        if k[0] == "tp"},
                       dry_run.saved_bytes(fw, bw))
    (fw0, bw0, saved0), (fw1, bw1, saved1) = got["none"], got["full"]
    fw2, bw2, saved2 = got["full+tp"]
    assert fw1 == fw0 == fw2
    assert bw1 == {**bw0, "all_gather": bw0["all_gather"] + 2 * 2}, (bw0, bw1)  # 2 per block
    # the reduce-scatters whose outputs backward reads run again (3 of the 4 here: the
    # partitioner's choice of what the blocks' boundary saves decides the fourth)
    more = bw2["reduce_scatter"] - bw1["reduce_scatter"]
    assert 2 <= more <= 2 * 2 and bw2 == {**bw1, "reduce_scatter": bw2["reduce_scatter"]}, (
        bw1, bw2)
    assert saved2 < saved1 < saved0, (saved0, saved1, saved2)


def test_plan_cli_reports_communication_per_group(capsys):
    """`python -m simplesharded.tools.forecast` on dp 2 x tp 2 (loss parallel, as the trainer runs it):
    the mesh in the header, one row per process group, TP's on the intra-node link."""
    from simplesharded.tools import forecast as plan

    assert plan.main(["--config", DEBUG_CONFIG, "--world-size", "4", "--hardware", "h100-ib400",
                      "--backends", "aot_eager_blockbucketing",
                      "--parallelism.tensor_parallel_degree", "2",
                      "--activation_checkpoint.mode", "none",
                      "--model.n_layers", "2"]) == 0  # of the debug model's 6: a shorter trace
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| aot_eager_blockbucketing")]
    step = next(r for r in rows if len(r) == 7)
    groups = {r[1]: r for r in rows if len(r) == 7 and r[1] in ("dp_shard", "tp")}
    assert set(groups) == {"dp_shard", "tp"}
    assert groups["tp"][2] == INTRA_NODE and int(groups["tp"][3]) > 0
    assert int(groups["dp_shard"][3]) > 0
    assert int(step[4]) == int(groups["dp_shard"][3]) + int(groups["tp"][3])  # collectives
    # global batch 8 over dp 2: 4 sequences per dp rank, shared by its 2 tp ranks
    assert "(mesh dp_shard 2 × tp 2)" in out and "4 × 128 tokens per dp rank" in out
    # the config's own claim beside the prediction (configs/llama3_debug.toml: 1-8, 15 GiB)
    assert "job.gpu_counts [1, 2, 4, 8] of job.gpu_memory_gib 15: world size 4 is one of" in out
    assert "recompute_tp_outputs" not in out  # within the room, and no AC: nothing to offer


def test_forecast_offers_tp_recompute_when_the_peak_is_above_the_room(capsys):
    """A TP step under full activation checkpointing whose peak is above what the config says
    a rank has: the forecast traces it again with activation_checkpoint.recompute_tp_outputs
    and prints that plan's peak and tokens/s beside the config's (the recomputed
    reduce-scatters cost time)."""
    from simplesharded.tools import forecast as plan

    assert plan.main(["--config", DEBUG_CONFIG, "--world-size", "4", "--hardware", "h100-ib400",
                      "--backends", "aot_eager_blockbucketing",
                      "--parallelism.tensor_parallel_degree", "2",
                      "--activation_checkpoint.mode", "full", "--model.n_layers", "2",
                      "--job.gpu_memory_gib", "0.01"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "recompute_tp_outputs" in ln)
    got = re.search(r"peak ([0-9.]+) GiB/rank, ([0-9,]+) tokens/s/rank \(without: ([0-9.]+) "
                    r"GiB, ([0-9,]+) tokens/s; room 0.01 GiB\)", line)
    assert got, line
    peak, rate, peak0, rate0 = (float(g.replace(",", "")) for g in got.groups())
    # the peak at this size moves below the printed precision (the saved bytes' drop is
    # test_activation_checkpointing_gathers_tp_activations_again_in_backward's)
    assert peak <= peak0 and rate < rate0, line
