"""The planner's model of host offload (simplesharded/tools/offload_cost.py, read by
simplesharded/tools/forecast.py): one trace of the debug Llama at 2 blocks on a fake process
group of 2 ranks (one process, aot_eager), read under each offload:

- the trace leaves offload out (no copy nodes) even when the config asks for it, and the
  buckets' shards it finds are the rank's parameters: forward gathers each once, backward
  reduces each once and regathers them (reshard after forward);
- ``params`` lowers the predicted peak by exactly the static bytes it moves (fp32 shards,
  gradients, AdamW's two states), less the one bucket copy a gather reads, plus the reduced
  gradients the device no longer holds at backward's peak (the outputs dropped are exactly
  those gradients); ``optimizer`` keeps the resident shard;
- the copies add their bytes over the profile's host link to the step, and the optimizer's
  step moves from the device's memory bandwidth to the host's;
- a profile without a host link is refused in one line.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
from pathlib import Path

import pytest
import torch

# autouse, as in every file that makes process groups: none may be left behind
from traced_graphs import _no_leaked_process_group  # noqa: F401

CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "llama3_debug.toml")
WORLD = 2
HARDWARE = "h100-ib400"


@pytest.fixture(scope="module")
def traced():
    """(config asking for offload params, the hardware, the trace, aot_eager's numbers)."""
    from simplesharded.passes.hardware import get_hardware
    from simplesharded.tools import cluster_trace, forecast
    from simplesharded.trainer import check_static
    from simplesharded.trainer.config import load_config

    cfg = load_config(CONFIG, ["--parallelism.offload", "params",
                               "--parallelism.reshard_after_forward", "always"])
    cfg.training.dataset_path = ""
    cfg = check_static(cfg, WORLD)
    hw = get_hardware(HARDWARE)
    ns = argparse.Namespace(world_size=WORLD, hardware=HARDWARE)
    with cluster_trace.fake_world(WORLD):
        t = cluster_trace.trace(cfg, cfg.training.local_batch_size, n_layers=2)
        m = forecast._evaluate(t, "aot_eager", ns, cfg, hw, None)
    return cfg, hw, t, m


def _with(cfg, offload: str):
    cfg = copy.deepcopy(cfg)
    cfg.parallelism.offload = offload
    return cfg


def test_the_trace_leaves_offload_out_and_finds_every_bucket(traced):
    _, _, t, m = traced
    copies = {torch.ops.simplesharded.to_compute.default, torch.ops.simplesharded.to_host.default}
    assert not [n for gm in (t.fw, t.bw) for n in gm.graph.nodes if n.target in copies]
    assert m["offload:forward"] == t.local_numel  # each bucket gathered once in forward
    assert m["offload:reduced"] == t.local_numel  # and reduced once
    assert m["offload:gathered"] > m["offload:forward"]  # backward regathers
    assert 0 < m["offload:largest"] < t.local_numel


def test_params_offload_lowers_the_peak_by_the_static_bytes_it_moves(traced):
    from simplesharded.passes.node_meta import node_value, value_bytes
    from simplesharded.tools import offload_cost
    from simplesharded.tools.forecast import device_memory

    cfg, _, t, m = traced
    n = t.local_numel
    (static_none, act_none), (static_params, act_params), (static_opt, act_opt) = (
        device_memory(m, _with(cfg, o)) for o in ("none", "params", "optimizer"))
    moved = 4 * n + 4 * n + 2 * 4 * n  # fp32 shards, gradients, AdamW's two states
    assert static_none - static_params == moved and static_params == 0
    assert static_opt == 4 * n  # the resident shard the gathers read
    largest = 4 * m["offload:largest"]
    # the graphs' peak counts the reduced gradients once, in the static state, with or
    # without offload: offload adds the gradient a copy to the host reads until the next
    # copy, and params the copy a gather reads and the next one
    assert act_none == m["peak_act"] and act_opt == m["peak_act"] + largest
    assert (static_none + act_none) - (static_params + act_params) == moved - 3 * largest
    # accumulating on the device, backward's gradients live beside the static ones to its
    # end; under offload they leave at their reduction all the same
    accumulating = _with(cfg, "none")
    accumulating.training.gradient_accumulation_steps = 2
    assert device_memory(m, accumulating)[1] == m["peak_act_accumulating"] > m["peak_act"]
    accumulating.parallelism.offload = "optimizer"
    assert device_memory(m, accumulating)[1] == m["peak_act"] + largest


def test_the_peak_leaves_out_the_gradients_the_static_state_holds(traced):
    """Backward's outputs are the parameters' gradients, as many bytes as static_memory's
    gradients: the transient peak is taken without them (each counted once)."""
    from simplesharded.passes.memory import peak_memory
    from simplesharded.passes.node_meta import node_value, value_bytes
    from simplesharded.tools.cluster_trace import static_memory, without_gradients

    _, _, t, m = traced
    outputs = [a for a in next(iter(reversed(t.bw.graph.nodes))).args[0]
               if isinstance(a, torch.fx.Node)]
    _, grads, _ = static_memory(t.local_numel, "AdamW")
    assert sum(value_bytes(node_value(a)) for a in outputs) == grads == 4 * m["offload:reduced"]
    assert next(iter(reversed(without_gradients(t.bw).nodes))).args[0] is None
    with_outputs, _ = peak_memory(t.bw, include_inputs=False)
    without, _ = peak_memory(without_gradients(t.bw), include_inputs=False)
    assert with_outputs - without > grads // 2  # most of them were alive at the peak


def test_copies_add_time_at_the_host_link_bandwidth(traced):
    from simplesharded.tools.forecast import step_seconds

    cfg, hw, t, m = traced
    n = t.local_numel
    adamw = 7 * 4 * n  # bytes an AdamW step streams
    none = step_seconds(m, _with(cfg, "none"), hw)
    copies = 4 * (m["offload:gathered"] + m["offload:reduced"])
    assert step_seconds(m, cfg, hw) - none == pytest.approx(
        copies / hw.host_link_Bps + adamw / hw.host_mem_bw_Bps - adamw / hw.mem_bw_Bps)
    # optimizer: the whole shard to the resident copy once, gradients back
    assert step_seconds(m, _with(cfg, "optimizer"), hw) - none == pytest.approx(
        4 * (n + m["offload:reduced"]) / hw.host_link_Bps + adamw / hw.host_mem_bw_Bps
        - adamw / hw.mem_bw_Bps)
    faster = dataclasses.replace(hw, host_link_Bps=2 * hw.host_link_Bps)
    assert step_seconds(m, cfg, hw) - step_seconds(m, cfg, faster) == pytest.approx(
        copies / hw.host_link_Bps / 2)


def test_a_profile_without_a_host_link_is_refused():
    from simplesharded.passes.hardware import get_hardware
    from simplesharded.tools import offload_cost

    bare = dataclasses.replace(get_hardware(HARDWARE), host_link_Bps=0.0)
    offload_cost.check_hardware(bare, "none")
    with pytest.raises(ValueError, match=r"^hardware 'h100-ib400' states no host link "
                                         r"\(host_link_Bps\), which forecasting offload needs$"):
        offload_cost.check_hardware(bare, "params")
