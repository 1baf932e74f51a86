"""Fast single-process test of the joint recompute pass (passes/recompute.py) on a hand-built
graph. Its effect on the compiled graphs (what is saved for backward): tests/test_graphs.py."""
from __future__ import annotations

import torch

from simplesharded.passes.plans import BlockPlan

import pass_utils as pu

# autouse, as in every pass test file: no test may leave a process group behind
from traced_graphs import _no_leaked_process_group  # noqa: F401


def test_handbuilt_recompute_saves_routing_and_foreign_collectives():
    """In a checkpointed region, the joint pass tags compute for recompute but saves the
    routing decision (``ss_routing``) and an all-to-all that is not ours, with its wait."""
    from torch import fx
    from torch._subclasses import FakeTensorMode
    from torch.utils.checkpoint import CheckpointPolicy

    from simplesharded.passes.annotations import AC_KEY, ROUTING_KEY
    from simplesharded.passes.recompute import tag_gathers_for_recompute

    mode, g = FakeTensorMode(), fx.Graph()

    def node(target, *args, custom=None, name=None):
        n = g.placeholder(name) if target is None else g.call_function(target, args)
        with mode:
            n.meta["val"] = (mode.from_tensor(torch.empty(4, 4)) if target is None else
                             target(*[a.meta["val"] if isinstance(a, fx.Node) else a
                                      for a in args]))
        if custom is not None:
            n.meta["custom"] = custom
        return n

    x, tangent = node(None, name="primals_1"), node(None, name="tangents_1")
    region = {AC_KEY: 0}
    route = node(torch.ops.aten.argsort.default, x, custom={**region, ROUTING_KEY: True})
    a2a = node(pu.A2A, x, [2, 2], [2, 2], "0", custom=region)
    wait = node(pu.WAIT, a2a, custom=region)
    mm = node(torch.ops.aten.mm.default, wait, x, custom=region)
    grad = node(torch.ops.aten.mul.Tensor, tangent, mm)
    g.output((mm, route, grad))
    gm = tag_gathers_for_recompute(fx.GraphModule(torch.nn.Module(), g), BlockPlan())
    saved = CheckpointPolicy.MUST_SAVE
    assert [n.meta.get("recompute") for n in (route, a2a, wait)] == [saved] * 3
    assert mm.meta["recompute"] == CheckpointPolicy.PREFER_RECOMPUTE
    assert "recompute" not in grad.meta
