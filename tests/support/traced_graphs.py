"""The pass tests' graphs: the toy model's real traced graphs, captured once per session.

The forward and backward graphs of ``toy_blocks.ToyBlocks`` (embeddings → 4 blocks → norm +
output; 7-row uneven parameters) are captured once per configuration from a real
``torch.compile`` under a fake process group at world sizes 2 and 8 (rank 0's graphs), after
our joint recompute tagging and torch's partitioner, before any bucketing/reordering: exactly
what the backends' graph passes receive. The tests of each pass (tests/test_bucketing.py,
test_reordering.py, test_plans.py, test_pipeline.py) check the
passes' invariants (passes/README.md) on them; the cache is shared, so a session traces each
configuration once whichever files it runs.
"""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, settings

from simplesharded.passes.bucketing import bucket_collectives
from simplesharded.passes.plans import AutoPlan, BlockPlan

import pass_utils as pu
import toy_blocks

N_LAYERS = toy_blocks.N_LAYERS
HYPO = settings(max_examples=6, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------ graph cache

# name → (world size, make_model kwargs, capture kwargs)
CONFIGS = {
    "w2": (2, {}, {}),
    "w8": (8, {}, {}),
    # layers.1: fp32 attention + bf16 feed-forward (two dtypes in one bucket); layers.2: bf16
    "w8-bf16": (8, dict(bf16_blocks={1: "ffn", 2: "block"}), {}),
    "w2-noreshard": (2, {}, dict(reshard_after_forward=False)),
    # the default policy: the last block and the head stay gathered from forward to backward
    "w2-auto": (2, {}, dict(reshard_after_forward="auto")),
}
FP32 = ("w2", "w8")
_captured: dict[str, tuple] = {}


def captured(name: str):
    """(world size, {"fw"|"bw": {stage: gm}}) of a configuration, traced once per session
    (compiled with aot_eager_blockbucketing under a fake process group that is destroyed right
    after tracing)."""
    if name not in _captured:
        world, model_kw, cap_kw = CONFIGS[name]
        tok, tgt = toy_blocks.batch(0)
        with pu.fake_world(world) as mesh:
            stages = pu.capture_graphs(
                toy_blocks.make_model(**model_kw), mesh, (tok,),
                loss=lambda out: toy_blocks.loss_fn(out, tgt, tgt.numel()), **cap_kw)
        _captured[name] = (world, stages)
    return _captured[name]


def graphs(name: str):
    """(world size, fw graph, bw graph) before any of our graph passes."""
    world, stages = captured(name)
    return world, stages["fw"]["input"], stages["bw"]["input"]


def graph(name: str, which: str):
    world, fw, bw = graphs(name)
    return world, (fw if which == "fw" else bw)


_bucketed: dict[tuple, object] = {}


def block_bucketed(name: str, which: str):
    """Block-bucketed copy of a captured graph (cached; callers get a fresh copy)."""
    key = (name, which)
    if key not in _bucketed:
        _bucketed[key] = bucket_collectives(pu.fresh(graph(name, which)[1]), BlockPlan())
    return pu.fresh(_bucketed[key])


_auto: dict[tuple, object] = {}


def auto_bucketed(name: str, which: str, cap: int | None):
    """AutoPlan-bucketed copy of a captured graph (cached: the plan simulates candidates)."""
    key = (name, which, cap)
    if key not in _auto:
        _auto[key] = bucket_collectives(pu.fresh(graph(name, which)[1]),
                                        AutoPlan(memory_cap_bytes=cap))
    return pu.fresh(_auto[key])


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    """Captures open and destroy their fake group themselves (pass_utils.fake_world); make sure
    no test leaves one behind (destroy it, then fail)."""
    yield
    leaked = torch.distributed.is_initialized()
    if leaked:
        torch.distributed.destroy_process_group()
    assert not leaked, "a test left a process group initialised"


# -------------------------------------------------------------------------------- helpers


def my_block(fqn: str) -> str:
    """Expected block-plan bucket of a parameter (independent of plans.block_key)."""
    m = re.match(r"layers\.(\d+)\.", fqn)
    if m:
        return f"layers.{m.group(1)}"
    return "embed" if fqn.startswith("tok_embeddings") else "head"


def served(gm, target) -> list[tuple[list[str], torch.dtype, int, object]]:
    """(params, dtype, nbytes, node) of every collective of one kind."""
    return [(pu.node_params(s), s.meta["val"].dtype, pu._nbytes(s), s)
            for s in pu.starts(gm, target)]


def sizes(gm) -> list[int]:
    return [pu._nbytes(s) for s in pu.starts(gm, pu.AG)]


def assert_bitwise_same(before, after, world, seed=0):
    inputs = pu.make_inputs(before, seed=seed)
    ref, n_ref = pu.run_simulated(before, inputs, world)
    out, n_out = pu.run_simulated(after, inputs, world)
    assert pu.bitwise_equal(ref, out), "outputs changed"
    return n_ref, n_out
