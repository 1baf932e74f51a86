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
