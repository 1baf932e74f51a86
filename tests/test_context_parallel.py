"""Context parallelism composed with FSDP on one mesh: the mesh ``(dp_shard, cp, tp?)`` over a
``dp_shard_cp`` root that shards every parameter over dp_shard x cp, the degrees and the
config's error lines."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Shard

ROOT = Path(__file__).resolve().parents[1]
LLAMA = str(ROOT / "configs" / "llama3_debug.toml")
ARGS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32)


def make_model(**overrides):
    from simplesharded.models import build_model

    torch.manual_seed(0)
    return build_model("llama3", "debug", device="cpu", **{**ARGS, **overrides})


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
    (["--parallelism.context_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
      "--model.name", "deepseek_v3"], 8,
     "parallelism.context_parallel_degree=2 with expert_parallel_degree=2: expert parallelism "
     "together with context parallelism is not supported yet; set one of them to 1"),
])
def test_config_errors_are_one_line(argv, world, message):
    with pytest.raises(ValueError) as e:
        _load(argv, world)
    assert str(e.value) == message
