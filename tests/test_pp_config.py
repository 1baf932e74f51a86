"""Pipeline parallelism's mesh and configuration, in one process: the pp dim of
``build_mesh``/``init_mesh`` (outermost, neither dp nor tp to ``mesh_roles``), ``data_parallel``
on a mesh with a pp dim (the shards live on the mesh without it), the config keys and each of
the preflight's one-line errors (``python -m simplesharded.trainer --check-only``, what
run_train.sh runs before torchrun)."""
from __future__ import annotations

import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]


@pytest.fixture(scope="module")
def world8():
    """A fake process group of 8 ranks, this process rank 5 (no communication)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "another test left a process group initialised"
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kw,dims,stage,dp,tp,ep", [
    (dict(pp=2), ("pp", "dp_shard"), ("dp_shard",), ("dp_shard",), None, None),
    (dict(pp=2, tp=2), ("pp", "dp_shard", "tp"), ("dp_shard", "tp"), ("dp_shard",), "tp", None),
    (dict(pp=2, dp_replicate=2, tp=2), ("pp", "dp_replicate", "dp_shard", "tp"),
     ("dp_replicate", "dp_shard", "tp"), ("dp_replicate", "dp_shard"), "tp", None),
    (dict(pp=2, ep=2), ("pp", "efsdp", "ep"), ("efsdp", "ep"), ("efsdp",), None, "ep"),
    (dict(pp=4), ("pp", "dp_shard"), ("dp_shard",), ("dp_shard",), None, None),
])
def test_pp_is_the_outermost_dim_and_neither_dp_nor_tp(world8, kw, dims, stage, dp, tp, ep):
    from simplesharded.mesh import (build_mesh, dense_mesh, dp_dims, ep_dim, mesh_roles,
                                    stage_mesh, tp_dim)

    mesh = build_mesh(device="cpu", **kw)
    assert mesh.mesh_dim_names == dims
    roles = mesh_roles(mesh)
    assert roles.pp == 0 and dp_dims(mesh) == dp and tp_dim(mesh) == tp and ep_dim(mesh) == ep
    assert stage_mesh(mesh).mesh_dim_names == stage
    # this rank's stage: the ranks of its pp coordinate (rank 5 of 8)
    pp = kw["pp"]
    assert sorted(stage_mesh(mesh).mesh.flatten().tolist()) == \
        list(range(5 // (8 // pp) * (8 // pp), (5 // (8 // pp) + 1) * (8 // pp)))
    # with ep: the dense mesh of the stage, (dp_shard, tp?) without pp
    if ep:
        assert dense_mesh(stage_mesh(mesh)).mesh_dim_names == ("dp_shard",)


def test_data_parallel_on_a_pp_mesh_shards_over_the_stage_dims_only(world8):
    """The shards' DTensors live on the mesh without pp: what a checkpoint keyed by FQN holds,
    whatever the pp degree."""
    import simplesharded as ss
    from simplesharded.mesh import build_mesh

    mesh = build_mesh(device="cpu", pp=2, tp=2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    ss.data_parallel(model, mesh, storage="param")
    shard = model[0]._parameters["weight"]
    assert shard.device_mesh.mesh_dim_names == ("dp_shard", "tp")
    assert tuple(shard.to_local().shape) == (4, 8)  # 8 rows over dp_shard 2 (8 / pp / tp)


def test_degrees_with_pp():
    from simplesharded.mesh import MeshDegrees, resolve_degrees

    d = resolve_degrees(8, 1, -1, 2, 1, pp=2)
    assert d == MeshDegrees(1, 2, 2, 1, pp=2) and d.world == 8
    assert d.dims() == (("pp", 2), ("dp_shard", 2), ("tp", 2))
    with pytest.raises(ValueError, match=r"^pp=3 does not divide the world size 8$"):
        resolve_degrees(8, 1, -1, 1, 1, pp=3)
    with pytest.raises(ValueError, match=r"dp_shard=3 does not equal the world size 4 "
                                         r"\(world size 8 / pp=2\)"):
        resolve_degrees(8, 1, 3, 1, 1, pp=2)
    d = resolve_degrees(8, 1, -1, 1, 1, 2, pp=2)  # cp splits each stage's ranks
    assert d.dims() == (("pp", 2), ("dp_shard", 2), ("cp", 2)) and d.world == 8


def test_config_keys_and_defaults():
    from simplesharded.trainer.config import Config, load_config
    from simplesharded.trainer.config_checks import pipeline_stages, resolve

    p = Config().parallelism
    assert (p.pipeline_parallel_degree, p.pipeline_parallel_schedule,
            p.pipeline_parallel_microbatch_size, p.pipeline_parallel_layers_per_stage,
            p.pipeline_fsdp_policy) == (1, "1F1B", 1, [], "auto")
    cfg = load_config(None, [*PP2, "--parallelism.pipeline_parallel_schedule",
                             "Interleaved1F1B", "--parallelism.pipeline_parallel_layers_per_stage",
                             "2,2,1,1", "--parallelism.pipeline_fsdp_policy", "every_microbatch"])
    assert pipeline_stages(cfg.parallelism) == 4
    cfg = resolve(cfg, 4)
    # dp = 4 / pp 2 = 2: the global batch 8 is 4 sequences per dp rank
    assert cfg.parallelism.data_parallel_shard_degree == 2 and cfg.training.local_batch_size == 4
    assert pipeline_stages(load_config(None, [*PP2, "--parallelism.pipeline_parallel_schedule",
                                              "ZBVZeroBubble"]).parallelism) == 4


def test_auto_policy_gathers_once_when_the_stage_fits_the_memory_cap():
    """auto: gather_once when a stage's parameters, gathered in the param dtype, fit
    compile.memory_cap_mb; reduce_once above it and without a cap."""
    from simplesharded.models import build_model
    from simplesharded.pipeline.pipelining import auto_policy
    from simplesharded.pipeline.stage_split import cut_stages

    model = build_model("llama3", "debug", device="meta")
    (_, stage), = cut_stages(model, 2, [0], None)
    mib = sum(p.numel() for p in stage.parameters()) * 4 / 2**20  # fp32
    assert auto_policy(stage, mib, torch.float32) == "gather_once"
    assert auto_policy(stage, mib * 0.99, torch.float32) == "reduce_once"
    assert auto_policy(stage, mib * 0.5, torch.bfloat16) == "gather_once"  # half the bytes
    assert auto_policy(stage, 0.0, torch.float32) == "reduce_once"


def _error(argv: list[str], world: int, capsys, monkeypatch) -> str:
    """The preflight's stderr for ``argv`` on ``world`` ranks: exactly one ``error:`` line."""
    from simplesharded.trainer import main as train_main

    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert train_main(["--check-only", "--job.config_file",
                       os.path.join(ROOT, "configs", "llama3_debug.toml"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err[len("error: "):-1]


@pytest.mark.parametrize("argv,world,expected", [
    ([*PP2[:1], "3"], 4,
     "parallelism.pipeline_parallel_degree=3 does not divide the world size 4"),
    ([*PP2, "--parallelism.pipeline_parallel_schedule", "GPipe"], 4,
     "parallelism.pipeline_parallel_schedule='GPipe' is not one of ['1F1B', 'Interleaved1F1B', "
     "'InterleavedZeroBubble', 'ZBVZeroBubble']"),
    ([*PP2, "--parallelism.pipeline_fsdp_policy", "gather_twice"], 4,
     "parallelism.pipeline_fsdp_policy='gather_twice' is not one of ['auto', 'every_microbatch', "
     "'gather_once', 'reduce_once']"),
    # global 8 over dp 4: 2 sequences per rank, 1 micro-batch of 2 for 1F1B on pp 2
    ([*PP2, "--parallelism.pipeline_parallel_microbatch_size", "2"], 8,
     "schedule 1F1B with pipeline_parallel_degree=2 needs at least 2 micro-batches per step; "
     "training.local_batch_size=2 / parallelism.pipeline_parallel_microbatch_size=2 gives 1 "
     "(raise the global batch or lower the micro-batch size)"),
    ([*PP2, "--parallelism.pipeline_parallel_microbatch_size", "3"], 4,
     "parallelism.pipeline_parallel_microbatch_size=3 does not divide "
     "training.local_batch_size=4"),
    ([*PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
      "--training.global_batch_size", "6"], 4,
     "schedule Interleaved1F1B with pipeline_parallel_degree=2 needs at least 2 and a multiple "
     "of 2 micro-batches per step; training.local_batch_size=3 / "
     "parallelism.pipeline_parallel_microbatch_size=1 gives 3 (raise the global batch or lower "
     "the micro-batch size)"),
    # llama3 debug has 6 blocks: 4 pp ranks x 2 stages is too many
    (["--parallelism.pipeline_parallel_degree", "4", "--parallelism.pipeline_parallel_schedule",
      "Interleaved1F1B", "--training.global_batch_size", "8"], 8,
     "parallelism.pipeline_parallel_degree=4 (schedule Interleaved1F1B, model llama3/debug): 8 "
     "pipeline stages but Llama3 has 6 blocks: every stage needs at least one"),
    ([*PP2, "--parallelism.pipeline_parallel_layers_per_stage", "4,3"], 4,
     "parallelism.pipeline_parallel_layers_per_stage=[4, 3] (schedule 1F1B, model llama3/debug):"
     " layers per stage [4, 3] do not give 2 stages of at least one block each summing to the 6 "
     "blocks of Llama3"),
    ([*PP2, "--parallelism.pipeline_parallel_layers_per_stage", "3,2,1"], 4,
     "parallelism.pipeline_parallel_layers_per_stage=[3, 2, 1] gives 3 stages; schedule 1F1B on "
     "pipeline_parallel_degree=2 runs 2"),
    ([*PP2, "--parallelism.pipeline_parallel_layers_per_stage", "6,0"], 4,
     "parallelism.pipeline_parallel_layers_per_stage=[6, 0] must give every stage at least one "
     "block"),
    ([*PP2, "--parallelism.context_parallel_degree", "3", "--training.seq_len", "126"], 4,
     "parallelism.context_parallel_degree=3 does not divide the world size 2 (world size 4 / "
     "parallelism.pipeline_parallel_degree=2)"),
    ([*PP2, "--model.name", "gpt"], 4,
     "parallelism.pipeline_parallel_degree=2 (schedule 1F1B, model gpt/debug): GPT cannot be "
     "staged: parameter 'wte.weight' (stage 0) is tied to 'head.weight' (stage 1); pipeline "
     "stages cannot share a parameter"),
])
def test_preflight_error_lines(argv, world, expected, capsys, monkeypatch):
    assert _error(argv, world, capsys, monkeypatch) == expected


def test_preflight_refuses_hugging_face_models_it_cannot_cut(tmp_path, capsys, monkeypatch):
    """A Hugging Face model outside the families cut here is one line naming its path
    (models/hf_source.py check_pipeline; a Llama is cut: tests/test_hf_source.py)."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64,
        "n_head": 4, "n_layer": 2, "vocab_size": 512, "n_positions": 256,
        # in the vocabulary: else transformers warns, once per process (an order-dependent line)
        "bos_token_id": 0, "eos_token_id": 0}))
    got = _error([*PP2, "--model.name", "hf", "--model.path", str(tmp_path),
                  "--training.seq_len", "128"], 4, capsys, monkeypatch)
    assert got == (f"parallelism.pipeline_parallel_degree=2 with model.path='{tmp_path}': "
                   f"GPT2Config (model_type 'gpt2') is not cut into pipeline stages here "
                   f"(families: ['llama', 'mistral', 'qwen2', 'qwen3', 'mixtral', "
                   f"'qwen2_moe', 'qwen3_moe']); use 1")


def test_preflight_passes_the_readme_command(capsys, monkeypatch):
    from simplesharded.trainer import main as train_main

    monkeypatch.setenv("WORLD_SIZE", "4")
    for extra in ([], ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
                  ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]):
        assert train_main(["--check-only", *PP2, *extra]) == 0, capsys.readouterr().err


def test_the_pipeline_loss_adds_what_the_stages_carry(world8):
    """The last stage's loss (simplesharded/trainer/recipe.py: pipeline_loss): the logits'
    summed cross-entropy plus the model's carried term (a Hugging Face MoE's balancing loss,
    from the sums its stages pass on), over the token count; with tensor-parallel logits (a
    DTensor loss) the term joins it replicated, and backward runs through both."""
    from types import SimpleNamespace

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import loss_parallel
    from simplesharded.trainer.recipe import pipeline_loss

    model = SimpleNamespace(stage_carry=lambda: torch.zeros(3, device="meta"),
                            carried_loss=lambda carried, labels: 2 * carried.sum())
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 4, 10, generator=g, requires_grad=True)
    carried = torch.randn(3, generator=g, requires_grad=True)
    labels = torch.randint(0, 10, (1, 4), generator=g)
    want = (torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                              reduction="sum") + 2 * carried.sum()) / 8
    assert torch.allclose(pipeline_loss(8.0, model)((logits, carried), labels), want)
    assert pipeline_loss(8.0)(logits, labels).item() != want.item()  # no model: no term
    # the logits sharded on the vocabulary over tp, the loss computed by loss_parallel, as
    # the trainer does (one tp rank, this process: the same values)
    mesh = DeviceMesh("cpu", [torch.distributed.get_rank()])
    with loss_parallel():
        spread = DTensor.from_local(logits.detach().clone().requires_grad_(), mesh,
                                    [Shard(2)], run_check=False)
        loss = pipeline_loss(8.0, model)((spread, carried), labels)
        assert isinstance(loss, DTensor) and loss.placements == (Replicate(),)
        assert torch.allclose(loss.full_tensor(), want)
        loss.backward()
    assert torch.allclose(carried.grad, torch.full((3,), 2 / 8))
