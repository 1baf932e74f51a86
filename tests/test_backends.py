"""The backend registry's two single sources: ``BackendName`` (every name parsed once) and
``pass_pipeline`` (the one list of passes per backend, which the backends, cluster_trace's
``apply_backend_passes``, bench_passes and the forecast all build from)."""
import functools

import pytest

from simplesharded.backends import (BACKENDS, BackendName, BackendOptions, backend_plan,
                                    pass_pipeline)
from simplesharded.passes.plans import AutoPlan, BlockPlan

OURS = ["padding", "bucketing", "reordering", "lowering", "view_cat"]


def test_every_name_parses_and_prints_back():
    assert len(BACKENDS) == 9
    for name in BACKENDS:
        assert str(BackendName.parse(name)) == name
    assert BackendName.parse("inductor_autobucketing") == BackendName("inductor", "auto")
    assert BackendName.parse("aot_eager") == BackendName("aot_eager", "none")
    assert BackendName("inductor", "block").on("aot_eager") == BackendName("aot_eager", "block")


@pytest.mark.parametrize("name", ["aot_eager_bucketing", "blockbucketing", "inductor_",
                                  "eager_blockbucketing", "aot_eager_blockbucketing2"])
def test_names_are_looked_up_not_matched(name):
    with pytest.raises(ValueError, match=rf"compile.backend='{name}' is not one of \["):
        BackendName.parse(name)


def test_no_record_for_a_backend_that_does_not_exist():
    with pytest.raises(ValueError, match="no backend has compiler='eager' and bucketing='block'"):
        BackendName("eager", "block")


@pytest.mark.parametrize("name", [n for n in BACKENDS if n != "eager"])
def test_pipeline_of_each_backend(name):
    backend = BackendName.parse(name)
    pipeline = pass_pipeline(name, BackendOptions(hardware="local"))
    assert [stage for stage, _ in pipeline.joint] == ["recompute"]
    # aot_eager runs the graph op by op: gradients are written into their buckets there
    ours = OURS + (["grads_in_place"] if backend.compiler == "aot_eager" else [])
    expected = {"none": [], "block": ours, "auto": ours, "upstream": ["upstream"]}
    assert [stage for stage, _ in pipeline.graph] == expected[backend.bucketing]
    plan = backend_plan(name, BackendOptions(hardware="local"))
    assert type(plan) is (AutoPlan if backend.bucketing == "auto" else BlockPlan)
    # every pass that takes a plan reads the same one
    plans = [p.keywords["plan"] for _, p in [*pipeline.joint, *pipeline.graph]
             if isinstance(p, functools.partial) and "plan" in p.keywords]
    assert plans and all(p == plan for p in plans)


def test_pipeline_options_reach_the_passes():
    mine = BlockPlan(memory_cap_bytes=123)
    pipeline = pass_pipeline("aot_eager_autobucketing", BackendOptions(plan=mine), lower_on=None)
    stages = dict(pipeline.graph)
    assert stages["bucketing"].keywords["plan"] is mine
    assert stages["lowering"].keywords["transports"] is None
    assert dict(pass_pipeline("aot_eager_blockbucketing").graph)[
        "lowering"].keywords["transports"] == ("gloo",)
    with pytest.raises(ValueError, match="'eager' compiles nothing"):
        pass_pipeline("eager")


def _registered_names():
    return [n for n, b in ((n, BackendName.parse(n)) for n in BACKENDS) if b.bucketing != "none"]


def test_our_names_are_entry_points_of_dynamos_backend_group():
    """pyproject.toml lists each of our names (torch's own excepted) in torch_dynamo_backends,
    pointing at its NAMED entry; the installed package exposes that to dynamo."""
    import importlib.metadata
    import pathlib
    import tomllib

    import torch

    from simplesharded.backends import NAMED

    project = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    declared = project["project"]["entry-points"]["torch_dynamo_backends"]
    assert declared == {n: f"simplesharded.backends:NAMED.{n}" for n in _registered_names()}
    assert sorted(vars(NAMED)) == sorted(declared)
    try:
        importlib.metadata.distribution("simplesharded")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("simplesharded is not installed (SIMPLESHARDED_PYTHON): no entry points")
    for name in declared:
        assert torch._dynamo.lookup_backend(name) is getattr(NAMED, name)


def test_a_backend_string_compiles_with_our_passes(monkeypatch):
    """torch.compile(model, backend="aot_eager_blockbucketing"): our backend, built at the
    first compile with make_backend's defaults, and the same numbers as eager."""
    import torch

    import simplesharded as ss
    import toy_blocks
    from dist_utils import world_of_one
    from simplesharded.backends import NAMED

    named = NAMED.aot_eager_blockbucketing
    monkeypatch.setattr(named, "_backend", None)
    built = []
    real = ss.make_backend

    def counting(name, **options):
        built.append(name)
        return real(name, **options)

    monkeypatch.setattr("simplesharded.backends.make_backend", counting)
    torch._dynamo.reset()
    with world_of_one() as mesh:
        model = ss.data_parallel(toy_blocks.make_model(), mesh)
        x = torch.randint(0, toy_blocks.VOCAB, (2, toy_blocks.SEQ),
                          generator=torch.Generator().manual_seed(0))
        eager = model(x)
        compiled = torch.compile(model, backend="aot_eager_blockbucketing", fullgraph=True)
        out = compiled(x)
        out.sum().backward()
        compiled(x)  # a second call: no new compile, no new backend
    assert built == ["aot_eager_blockbucketing"]
    torch.testing.assert_close(out, eager)
