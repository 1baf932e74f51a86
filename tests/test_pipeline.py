"""The pass pipeline (passes/pipeline.py) as the backends run it: the manual passes on the
captured graphs (support/traced_graphs.py) equal what aot_eager_blockbucketing produced."""
from __future__ import annotations

import pytest

from simplesharded.passes.plans import BlockPlan
from simplesharded.passes.reordering import reorder_for_overlap

import pass_utils as pu
from traced_graphs import CONFIGS, block_bucketed, captured

# autouse, as in every pass test file: no test may leave a process group behind
from traced_graphs import _no_leaked_process_group  # noqa: F401


@pytest.mark.parametrize("config", list(CONFIGS))
def test_manual_passes_equal_backend_pipeline(config):
    """What these tests do by hand (bucket_collectives(BlockPlan()) then reorder_for_overlap with
    the default cap, on the captured input graphs) is exactly what aot_eager_blockbucketing's
    pipeline produced in the same compile."""
    world, stages = captured(config)
    for which in ("fw", "bw"):
        bucketed = block_bucketed(config, which)
        assert pu.graph_signature(bucketed) == pu.graph_signature(stages[which]["bucketing"])
        reordered = reorder_for_overlap(bucketed, BlockPlan())
        assert pu.graph_signature(reordered) == pu.graph_signature(stages[which]["reordering"])
