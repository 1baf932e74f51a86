"""torch's own overlap scheduler + bucketing, wrapped as a comparison baseline.

Never called by our passes; only the ``*_upstreambucketing`` backends use it. Its default
estimators benchmark on a GPU, so we feed it our CPU-capable cost model instead.
"""
from __future__ import annotations

from unittest import mock

from torch import fx


def upstream_overlap_bucketing(gm: fx.GraphModule, hardware="local") -> fx.GraphModule:
    from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing

    from .collectives import KINDS, group_args, tensor_nbytes
    from .comm_cost import comm_time, group_link
    from .compute_cost import node_time
    from .hardware import get_hardware

    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware

    def estimate(node: fx.Node, override_size=None) -> float | None:
        if node.op != "call_function":
            return None
        if node.target in KINDS:
            size, name = group_args(node)
            nbytes = override_size if override_size is not None else tensor_nbytes(node)
            if KINDS[node.target] == "reduce_scatter":
                nbytes *= size  # comm_time wants the full input, the node holds the shard
            return 1e3 * comm_time(KINDS[node.target], nbytes, max(size, 1), hw,
                                   group_link(name, hw))  # ms
        return 1e3 * node_time(node, hw)

    import torch._inductor.fx_passes.overlap_scheduling as upstream

    # Its roofline estimator asks triton for GPU DRAM bandwidth; scope a CPU-safe one to this
    # call only (restored on exit, so other compiles see torch unchanged).
    with mock.patch.object(upstream, "estimate_roofline_runtime_ms",
                           lambda node, *a, **k: 1e3 * node_time(node, hw)):
        return schedule_overlap_bucketing(gm, collective_bucketing=True,
                                          custom_runtime_estimation=estimate,
                                          collective_estimator="analytical",
                                          compute_estimator="analytical")
