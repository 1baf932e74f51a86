"""passes/torch_compat.py, the supported torch range and what each feature needs of it: the
table refuses a feature on a torch older than its row in one line (the version it reads is
replaced here), the trainer's preflight refuses the step graph, context parallelism
and expert parallelism the same way before any rank starts, and the range agrees with
pyproject.toml and scripts/bootstrap.sh."""
from __future__ import annotations

import os
import re

import pytest
from torch.torch_version import TorchVersion

from simplesharded.passes import torch_compat
from simplesharded.passes.torch_compat import (CONTEXT_PARALLEL, EXPERT_PARALLEL, FEATURES,
                                               STEP_GRAPH, TorchTooOld)
from simplesharded.trainer.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def torch_at(monkeypatch):
    """``torch_at("2.11.0")``: the table reads that version from now on in this test."""
    def at(version: str) -> None:
        monkeypatch.setattr(torch_compat, "installed", lambda: TorchVersion(version))
    return at


def test_each_row_is_refused_below_its_minimum_in_one_line(torch_at):
    for feature in FEATURES:
        torch_at(feature.minimum + ".0")
        assert torch_compat.has(feature) and torch_compat.refusal(feature) is None
        torch_compat.needs(feature)
        torch_at("2.10.1+cu126")
        line = torch_compat.refusal(feature)
        assert line == (f"{feature.name} needs torch >= {feature.minimum}; this is torch "
                        f"2.10.1+cu126 ({feature.reason})")
        assert "\n" not in line and not torch_compat.has(feature)
        with pytest.raises(TorchTooOld) as e:
            torch_compat.needs(feature)
        assert str(e.value) == line
        assert isinstance(e.value, RuntimeError)  # what callers that catch torch's errors see


def test_the_oldest_supported_torch_lacks_the_step_graph_cp_and_ep(torch_at):
    torch_at("2.11.0")
    assert not [f for f in (STEP_GRAPH, CONTEXT_PARALLEL, EXPERT_PARALLEL)
                if torch_compat.has(f)]
    assert torch_compat.outside_range() is None
    torch_at("2.13.0+cpu")
    assert all(torch_compat.has(f) for f in FEATURES)
    torch_at("2.15.0")
    assert all(torch_compat.has(f) for f in FEATURES) and torch_compat.outside_range() is None


def test_outside_the_range_is_one_warning_line(torch_at):
    torch_at("2.16.0")
    assert torch_compat.outside_range() == ("torch 2.16.0 is outside the supported range "
                                            ">=2.11,<2.16 (untested)")
    torch_at("2.10.0")
    assert torch_compat.outside_range().startswith("torch 2.10.0 is outside")


def test_rows_lie_inside_the_range_that_pyproject_and_bootstrap_install():
    low, high = torch_compat.SUPPORTED
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert f'"torch>={low},<{high}"' in f.read()
    with open(os.path.join(ROOT, "scripts", "bootstrap.sh")) as f:
        assert f'SIMPLESHARDED_TORCH:-${{MADE_WITH:-torch=={torch_compat.DEFAULT}.*}}' in f.read()
    assert low <= TorchVersion(torch_compat.DEFAULT) < high
    for feature in FEATURES:
        assert low <= TorchVersion(feature.minimum) < high, feature
        assert feature.reason and "\n" not in feature.reason
    assert len({f.name for f in FEATURES}) == len(FEATURES)


# (config arguments, the key the refusal names, the row)
PREFLIGHT = [
    (["--compile.enable", "--compile.scope", "step"], "compile.scope='step'", STEP_GRAPH),
    (["--parallelism.context_parallel_degree", "2"], "parallelism.context_parallel_degree=2",
     CONTEXT_PARALLEL),
    (["--parallelism.expert_parallel_degree", "2", "--model.name", "deepseek_v3"],
     "parallelism.expert_parallel_degree=2", EXPERT_PARALLEL),
]


@pytest.mark.parametrize("argv,key,feature", PREFLIGHT, ids=["step", "cp", "ep"])
def test_preflight_checks_refuse_what_this_torch_lacks(torch_at, argv, key, feature):
    """trainer/preflight.py's check_torch (run_train.sh's preflight, and every rank, runs it
    after check_static): on 2.11 one line naming the setting and the table's refusal; on the
    default torch the same config passes. The config's own checks pass on any torch."""
    from simplesharded.trainer.preflight import check_static, check_torch

    torch_at("2.11.0+cu130")
    cfg = check_static(load_config(None, argv), 4)
    with pytest.raises(ValueError) as e:
        check_torch(cfg)
    assert str(e.value) == f"{key}: {torch_compat.refusal(feature)}"
    assert re.search(r"needs torch >= 2\.13; this is torch 2\.11\.0\+cu130 \(", str(e.value))
    torch_at(torch_compat.DEFAULT + ".0")
    check_torch(cfg)


def test_preflight_prints_the_refusal_as_one_error_line(torch_at, monkeypatch, capsys):
    """``python -m simplesharded.trainer --check-only`` (run_train.sh's preflight): exit 2 and
    one ``error:`` line, no traceback; out of the range, a passing preflight warns."""
    from simplesharded.trainer import main as train_main

    monkeypatch.setenv("WORLD_SIZE", "4")
    torch_at("2.12.1")
    assert train_main(["--check-only", "--parallelism.context_parallel_degree", "2"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: parallelism.context_parallel_degree=2: "
                   f"{torch_compat.refusal(CONTEXT_PARALLEL)}\n")
    assert train_main(["--check-only"]) == 0
    assert capsys.readouterr().err == ""
    torch_at("2.16.0")
    assert train_main(["--check-only"]) == 0
    assert capsys.readouterr().err == ("warning: torch 2.16.0 is outside the supported range "
                                       ">=2.11,<2.16 (untested)\n")


def test_library_entry_points_refuse_through_the_table(torch_at, fake_world):
    """The library's own entries: ``compile_step`` (tests/test_step.py), context parallelism's
    ``apply_context_parallel`` and the trainer's ``apply_expert_parallel`` refuse before they
    change the model."""
    import torch

    from simplesharded.mesh import build_mesh
    from simplesharded.models.context_parallel import apply_context_parallel
    from simplesharded.trainer.recipe import apply_expert_parallel

    ep_mesh = build_mesh(device="cpu", ep=2)  # the mesh itself builds on every release
    torch_at("2.11.0")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TorchTooOld, match=r"^context parallelism .* needs torch >= 2\.13;"):
        apply_context_parallel(model, None)
    with pytest.raises(TorchTooOld, match=r"^expert parallelism .* needs torch >= 2\.13;"):
        apply_expert_parallel(model, ep_mesh)


def test_our_eager_is_aot_eager_before_2_12(monkeypatch):
    """Under dynamo's eager backend torch 2.11 gives an autograd.Function whose forward returns
    a functional collective's waited result a zero gradient (a ragged bucket's gather): our
    ``eager`` is torch's ``aot_eager`` there, which runs no pass of ours either."""
    import torch

    import simplesharded as ss

    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert ss.make_backend("eager") == "aot_eager"
    monkeypatch.setattr(torch, "__version__", "2.12.1")
    assert ss.make_backend("eager") == "eager"


def test_tools_refuse_what_this_torch_lacks_in_one_line(torch_at, capsys):
    """The planner (``python -m simplesharded.tools.forecast``) and the bench refuse a config or
    flag this torch lacks with the trainer's line, after the input's own errors, before any
    trace or rank."""
    from simplesharded.tools import bench, forecast

    torch_at("2.11.0")
    with pytest.raises(SystemExit):
        forecast.main(["--config", os.path.join(ROOT, "configs", "deepseek_v3_16b.toml"),
                       "--world-size", "16"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"error: parallelism.expert_parallel_degree=8: "
                        f"{torch_compat.refusal(EXPERT_PARALLEL)}"), err
    with pytest.raises(SystemExit):
        bench.main(["--cp", "2", "--flavor", "debug"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"error: --cp 2: {torch_compat.refusal(CONTEXT_PARALLEL)}"), err
    with pytest.raises(SystemExit):  # the flag's own error first
        bench.main(["--cp", "4", "--seq-len", "36"])
    assert "--seq-len 36 does not split" in capsys.readouterr().err
