"""Settings that would be process-wide are scoped to the calls that need them: dynamo's
recompile limit to the trainer's compiled calls, the hub's offline flag to transformers'
loading calls, and the rank-agreement check's run-time state to its process group."""
import os

import pytest
import torch
import torch.distributed as dist


def test_recompile_limit_holds_only_inside_the_compiled_calls():
    from simplesharded.models import build_model
    from simplesharded.tools.cluster_trace import fake_world
    from simplesharded.trainer import parallelize
    from simplesharded.trainer.config import load_config
    from simplesharded.mesh import build_mesh

    cfg = load_config(None, ["--compile.enable", "--no-compile.fullgraph",
                             "--compile.backend", "aot_eager"])
    before = torch._dynamo.config.recompile_limit
    with fake_world(2):
        model = build_model("llama3", "debug", device="meta", n_layers=12)
        step = parallelize(model, build_mesh(1, -1, "cpu"), cfg)
    assert torch._dynamo.config.recompile_limit == before  # nothing set process-wide
    seen = []
    step.compiled = lambda: seen.append(torch._dynamo.config.recompile_limit)
    step()
    assert seen == [max(before, 12 + 8)]
    assert torch._dynamo.config.recompile_limit == before


def test_hub_is_offline_only_during_loading(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from huggingface_hub import constants
    from transformers import AutoConfig, LlamaConfig

    from simplesharded.models import hf_source

    (tmp_path / "config.json").write_text("{}")
    seen = []

    def from_pretrained(path, **kwargs):
        seen.append((constants.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE"),
                     kwargs.get("local_files_only")))
        return LlamaConfig(num_hidden_layers=1)

    monkeypatch.setattr(AutoConfig, "from_pretrained", from_pretrained)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    env = os.environ.get("HF_HUB_OFFLINE")
    hf_source.load_hf_config(str(tmp_path))
    assert seen == [(True, env, True)]  # offline, without touching the environment
    assert constants.HF_HUB_OFFLINE is False


def test_agreement_state_belongs_to_the_process_group():
    from simplesharded.passes import agreement
    from simplesharded.tools.cluster_trace import fake_world

    with fake_world(2):
        agreement.agree("fingerprint")  # a fake group checks nothing, but remembers it
        assert agreement._CHECKS[dist.group.WORLD].agreed == {"fingerprint"}
    with fake_world(2):  # a new group: a fresh store, nothing agreed on yet
        assert dist.group.WORLD not in agreement._CHECKS
