"""What a rank does on a GPU node before its first collective, checked on CPU with torch's
device calls mocked: the device is selected before the process group exists and handed to it
(``device_id``), a LOCAL_RANK beyond the visible devices is one clear error, and
``training.deterministic`` gives cuBLAS the workspace setting it needs."""
import os

import pytest
import torch
import torch.distributed as dist

from simplesharded import mesh as mesh_mod
from simplesharded.trainer import make_deterministic


@pytest.fixture
def fake_gpus(monkeypatch):
    """Two visible 'cuda' devices; records set_device_index and init_process_group calls."""
    calls = []
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 2)
    monkeypatch.setattr(torch.accelerator, "set_device_index",
                        lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda **kw: calls.append(("init_process_group", kw)))
    for k, v in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    return calls


def test_device_is_selected_then_bound_to_the_process_group(fake_gpus):
    assert mesh_mod.init_distributed("cuda") == "cuda"
    assert fake_gpus == [("set_device", 1),
                         ("init_process_group", {"backend": "nccl",
                                                 "device_id": torch.device("cuda", 1)})]


def test_cpu_ranks_bind_no_device(fake_gpus):
    mesh_mod.init_distributed("cpu")
    assert fake_gpus == [("init_process_group", {"backend": "gloo"})]


def test_more_ranks_than_visible_devices_is_one_line(fake_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError) as e:
        mesh_mod.init_distributed("cuda")
    assert "LOCAL_RANK=2" in str(e.value) and "2 visible cuda device(s)" in str(e.value)
    assert "\n" not in str(e.value)
    assert fake_gpus == []  # nothing started


def test_deterministic_sets_cublas_workspace_on_cuda_only(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        make_deterministic("cpu")
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        make_deterministic("cuda")
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's value wins
        make_deterministic("cuda")
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
