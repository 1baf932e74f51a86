"""The planner's pipeline model: schedule orders (simplesharded/tools/pp_orders.py), the step's
simulation (pp_simulate.py), the p2p links and the timeline (pp_forecast.py, pp_timeline.py).
Single-process, synthetic costs: no trace."""
import pytest

from simplesharded.tools.pp_orders import Action, rank_orders, stage_rank
from simplesharded.tools.pp_simulate import StageCost, simulate_pipeline


def _kinds(order):
    return [f"{a.kind}{a.microbatch}" for a in order]


def _run(schedule, pp, stages, m, fw=1.0, bw=2.0, p2p=0.0, **cost):
    costs = [StageCost(fw, bw, **cost) for _ in range(stages)]
    return simulate_pipeline(rank_orders(schedule, pp, stages, m),
                             stage_rank(schedule, stages, pp), costs, [p2p] * (stages - 1), m)


def test_1f1b_two_stages_four_microbatches_order():
    first, last = rank_orders("1F1B", 2, 2, 4)
    assert _kinds(first) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert _kinds(last) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert {a.stage for a in first} == {0} and {a.stage for a in last} == {1}


@pytest.mark.parametrize("schedule,pp,stages,m", [("1F1B", 2, 2, 4), ("1F1B", 4, 4, 8),
                                                  ("1F1B", 4, 4, 3),
                                                  ("Interleaved1F1B", 2, 4, 4),
                                                  ("Interleaved1F1B", 4, 8, 8)])
def test_every_action_once_forward_before_backward(schedule, pp, stages, m):
    orders = rank_orders(schedule, pp, stages, m)
    ranks = stage_rank(schedule, stages, pp)
    for r, order in enumerate(orders):
        assert len(order) == len(set(order))
        assert {a.stage for a in order} == {s for s in range(stages) if ranks[s] == r}
        for a in order:
            if a.kind == "B":
                assert order.index(Action("F", a.stage, a.microbatch)) < order.index(a)
    assert sum(len(o) for o in orders) == 2 * stages * m


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (8, 32)])
def test_1f1b_bubble_is_textbook_for_equal_costs(pp, m):
    step = _run("1F1B", pp, pp, m)
    assert step.step_s == pytest.approx((m + pp - 1) * 3.0)
    assert step.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))
    assert step.exposed_p2p_s == [0.0] * pp


def test_interleaving_shrinks_the_bubble_by_stages_per_rank():
    # same model work split into twice as many stages of half the cost each
    pp, m = 4, 8
    plain = _run("1F1B", pp, pp, m, fw=2.0, bw=4.0)
    inter = _run("Interleaved1F1B", pp, 2 * pp, m, fw=1.0, bw=2.0)
    assert plain.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))
    assert inter.step_s < plain.step_s
    assert inter.step_s == pytest.approx(m * 6.0 + (pp - 1) * 6.0 / 2)


def test_in_flight_microbatches_per_stage():
    pp, m = 4, 8
    act = 10
    step = _run("1F1B", pp, pp, m, act_bytes=act, static_bytes=1000)
    assert step.max_in_flight == {s: pp - s for s in range(pp)}
    assert step.peak_stage_bytes == {s: 1000 + act * (pp - s) for s in range(pp)}
    inter = _run("Interleaved1F1B", pp, 2 * pp, m, act_bytes=act)
    for r in range(pp):  # the rank's stages together hold more than 1F1B's pp - r
        held = sum(inter.max_in_flight[s] for s in inter.by_rank_stages[r])
        assert held > pp - r
    memory = step.memory[0]
    assert memory[0] == (0.0, 1000) and memory[-1][1] == 1000  # all freed by the end


def test_p2p_wait_is_exposed_and_lengthens_the_step():
    pp, m = 2, 4
    free = _run("1F1B", pp, pp, m)
    slow = _run("1F1B", pp, pp, m, p2p=0.5)
    assert slow.step_s > free.step_s
    assert slow.exposed_p2p_s[1] > 0
    assert any(b.kind == "wait" for b in slow.boxes)
    assert slow.p2p_sends == 2 * m  # one activation and one gradient per micro-batch


def test_reduce_once_reduces_after_the_last_backward_and_counts_once():
    pp, m = 2, 4
    kw = dict(reduce_s=0.5, gathers=3, reductions=3, grad_sum_bytes=100)
    once = simulate_pipeline(rank_orders("1F1B", pp, pp, m), stage_rank("1F1B", pp, pp),
                             [StageCost(1.0, 2.0, **kw)] * pp, [0.0], m, policy="reduce_once")
    each = _run("1F1B", pp, pp, m, **kw)
    assert once.reductions == {0: 1, 1: 1} and each.reductions == {0: 3 * m, 1: 3 * m}
    assert once.gathers == each.gathers == {0: 3 * m, 1: 3 * m}
    last = max(b.end for b in once.boxes if b.kind == "B" and b.stage == 0)
    (r,) = [b for b in once.boxes if b.kind == "R" and b.stage == 0]
    assert r.start == last and once.step_s == pytest.approx(last + 0.5)
    assert once.exposed_reduce_s[0] == pytest.approx(0.5)
    assert once.peak_stage_bytes[0] == each.peak_stage_bytes[0] + 100


@pytest.mark.parametrize("m", [4, 8])
def test_gather_once_gathers_once_per_step_whatever_the_microbatches(m):
    pp = 2
    orders, ranks = rank_orders("1F1B", pp, pp, m), stage_rank("1F1B", pp, pp)
    kw = dict(reduce_s=0.5, reductions=3, grad_sum_bytes=100)
    held = [StageCost(1.0, 2.0, step_gathers=1, gathered_bytes=50, **kw)] * pp
    once = simulate_pipeline(orders, ranks, held, [0.0], m, policy="gather_once")
    deferred = simulate_pipeline(orders, ranks, [StageCost(1.0, 2.0, gathers=3, **kw)] * pp,
                                 [0.0], m, policy="reduce_once")
    assert once.gathers == {0: 1, 1: 1} and deferred.gathers == {0: 3 * m, 1: 3 * m}
    assert once.reductions == deferred.reductions == {0: 1, 1: 1}
    # the parameters are held from the gather to the reduction, on top of the gradient sums
    assert once.peak_stage_bytes[0] == deferred.peak_stage_bytes[0] + 50
    assert once.memory[0][-1][1] == deferred.memory[0][-1][1]  # released with the reduction
    # each stage's first forward gathers first, on the rank's compute: exposed
    slow = [StageCost(1.0, 2.0, gather_s=0.5, step_gathers=1)] * pp
    gated = simulate_pipeline(orders, ranks, slow, [0.0], m, policy="gather_once")
    (g,) = [b for b in gated.boxes if b.kind == "G" and b.stage == 0]
    first = min(b.start for b in gated.boxes if b.kind == "F" and b.stage == 0)
    assert (g.start, g.end, first) == (0.0, 0.5, 0.5)
    assert gated.exposed_fsdp_s == [pytest.approx(0.5)] * pp
    assert sum(b.kind == "G" for b in gated.boxes) == pp


def test_policies_per_stage():
    pp, m = 2, 4
    costs = [StageCost(1.0, 2.0, gathers=3, reductions=3, reduce_s=0.5)] * pp
    mixed = simulate_pipeline(rank_orders("1F1B", pp, pp, m), stage_rank("1F1B", pp, pp), costs,
                              [0.0], m, policy=["reduce_once", "every_microbatch"])
    assert mixed.reductions == {0: 1, 1: 3 * m}
    assert [b.stage for b in mixed.boxes if b.kind == "R"] == [0]
    with pytest.raises(ValueError, match="not one of"):
        simulate_pipeline(rank_orders("1F1B", pp, pp, m), stage_rank("1F1B", pp, pp), costs,
                          [0.0], m, policy="auto")  # the planner resolves auto first


def test_auto_resolves_per_stage_as_the_pipeline_does():
    """The planner's stages (its parameter counts) and the pipeline's own cut
    (pipelining.auto_policy on each stage module) give the same policies, on either side of
    the memory cap."""
    import torch

    from simplesharded.models import build_model
    from simplesharded.pipeline.pipelining import auto_policy
    from simplesharded.pipeline.stage_split import cut_stages
    from simplesharded.tools.pp_forecast import stage_numels, stage_policies
    from simplesharded.trainer.config import load_config

    cfg = load_config(None, [])  # llama3 debug: the first stage has the embedding, the last
    blocks = [1, 2, 3]           # the head: three different sizes
    numels, _ = stage_numels(cfg, 3, blocks)
    modules = [mod for _, mod in cut_stages(build_model(cfg.model.name, cfg.model.flavor,
                                                        device="meta"), 3, [0, 1, 2], blocks)]
    seen = set()
    for numel in numels:
        for cap_mb in (numel * 2 / 2**20, numel * 2 / 2**20 * 0.99, 0.0):
            ours = stage_policies("auto", numels, cap_mb, "bfloat16")
            assert ours == [auto_policy(mod, cap_mb, torch.bfloat16) for mod in modules]
            seen.add(tuple(ours))
    assert len({q for policies in seen for q in policies}) == 2  # both outcomes exercised
    assert stage_policies("every_microbatch", numels, 1e9, "bfloat16") == ["every_microbatch"] * 3


def test_unmodelled_schedule_is_refused():
    with pytest.raises(ValueError, match="not modelled"):
        rank_orders("ZBVZeroBubble", 2, 4, 4)
    with pytest.raises(ValueError, match="rounds of 4"):
        rank_orders("Interleaved1F1B", 4, 8, 6)


def test_p2p_crosses_nodes_when_the_pipeline_spans_them():
    from simplesharded.passes.comm_cost import INTER_NODE, INTRA_NODE
    from simplesharded.passes.hardware import get_hardware
    from simplesharded.tools.pp_forecast import p2p_link, p2p_seconds
    hw = get_hardware("h100-ib400")  # 8 GPUs per node
    assert p2p_link(8, 2, hw) == INTRA_NODE  # pp 2 x 4: neighbours 4 ranks apart, one node
    assert p2p_link(16, 2, hw) == INTER_NODE  # neighbours 8 ranks apart: the next node
    assert p2p_link(512, 8, hw) == INTER_NODE
    nbytes = 1 * 8192 * 16384 * 2 // 8
    assert p2p_seconds(nbytes, INTER_NODE, hw) == pytest.approx(hw.alpha_s
                                                                + nbytes / hw.bandwidth_Bps)
    assert p2p_seconds(nbytes, INTER_NODE, hw) > p2p_seconds(nbytes, INTRA_NODE, hw)


def test_stage_costs_from_per_block_numbers():
    from simplesharded.passes.hardware import get_hardware
    from simplesharded.tools.pp_forecast import stage_costs
    block = {"fw_s": 1.0, "bw_s": 2.0, "peak_act": 10, "saved": 6, "group:dp_shard:exposed_s": 0.1,
             "fw:dp_shard:all_gather": 1, "bw:dp_shard:all_gather": 1,
             "bw:dp_shard:reduce_scatter": 1, "fw:tp:all_gather": 5}
    rest = {"fw_s": 0.5, "bw_s": 0.5, "peak_act": 7, "saved": 2, "group:dp_shard:exposed_s": 0.0,
            "fw:dp_shard:all_gather": 2, "bw:dp_shard:all_gather": 0,
            "bw:dp_shard:reduce_scatter": 2}
    hw = get_hardware("h100-ib400")
    costs = stage_costs(block, rest, [3, 2], [300, 200], 500, 50.0, 4, "reduce_once", hw,
                        "inter-node", "AdamW", 2, 4)
    first, last = costs
    assert (first.fw_s, first.bw_s) == (3.0, 6.0)
    assert (last.fw_s, last.bw_s) == (2.5, 4.5)  # norm, head and loss on the last stage
    assert first.gathers == 6 and last.gathers == 6  # tp's gathers are not FSDP's
    assert first.reductions == 3 and last.reductions == 4
    # held per micro-batch in flight: what forward saves; the rest of the peak once, with
    # the unsharded gradients (param dtype) a deferred policy's backward returns
    assert first.act_bytes == 18 and first.working_bytes == 3 * 4 + 5 + 2 * 30 * 4
    assert last.act_bytes == 2 * 6 + 2 and last.working_bytes == 2 * 4 + 5 + 2 * 20 * 4
    assert first.static_bytes == 16 * 30 and last.static_bytes == 16 * 20  # AdamW fp32
    assert first.grad_sum_bytes == 4 * 30 * 4  # unsharded over dp_shard 4, fp32 reductions
    # bf16 reductions: the sums are bf16 (grad_sync.py), half the bytes
    (bf16,) = stage_costs(block, rest, [3], [300], 500, 50.0, 4, "reduce_once", hw,
                          "inter-node", "AdamW", 2, 2)
    assert bf16.grad_sum_bytes == 2 * 30 * 4
    assert first.reduce_s > last.reduce_s > 0
    # gather_once: the micro-batches lose the traced FSDP waits, one gather per step
    block["fw:exposed:dp_shard"], block["bw:exposed:dp_shard"] = 0.04, 0.06
    once, each = stage_costs(block, rest, [3, 2], [300, 200], 500, 50.0, 4,
                             ["gather_once", "every_microbatch"], hw, "inter-node", "AdamW", 2, 4)
    assert once.fw_s == pytest.approx(3.0 - 3 * 0.04) and once.bw_s == pytest.approx(6.0 - 0.18)
    assert (once.gathers, once.step_gathers) == (0, 1)
    assert once.gather_s > 0 and once.gathered_bytes == 2 * 30 * 4
    assert once.reduce_s == first.reduce_s
    assert (each.gathers, each.step_gathers, each.reduce_s) == (6, 0, 0.0)
    assert each.working_bytes == 2 * 4 + 5 + 4 * 20  # the reduced shards, reduce dtype


def test_timeline_has_one_row_per_stage_and_a_memory_curve_each():
    matplotlib = pytest.importorskip("matplotlib")
    from simplesharded.tools.pp_timeline import draw_pipeline
    step = _run("Interleaved1F1B", 2, 4, 4, p2p=0.2, act_bytes=2**20)
    fig = draw_pipeline(None, step, "test")
    try:
        ax, mem = fig.axes
        labels = [t.get_text() for t in ax.get_yticklabels()]
        assert labels == [f"stage {s} (rank {s % 2})" for s in range(4)]
        texts = {t.get_text() for t in ax.texts}
        assert {f"{k}{i}" for k in "FB" for i in range(4)} <= texts
        assert len(mem.get_lines()) == 4
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert {"bubble", "exposed p2p wait", "forward", "backward"} <= set(legend)
        # no micro-batch box takes the colour of a wait, a gather or a reduction
        from matplotlib.colors import to_rgb
        from simplesharded.tools.pp_timeline import _IDLE, microbatch_colour
        drawn = {tuple(c[:3]) for coll in ax.collections for c in coll.get_facecolor()}
        work = {to_rgb(microbatch_colour(i)) for i in range(4)}
        marks = {to_rgb(s["facecolor"]) for s in _IDLE.values() if s["facecolor"] != "none"}
        assert len(work) == 4 and work <= drawn and not work & marks, (work, marks)
    finally:
        matplotlib.pyplot.close(fig)


def test_forecast_refuses_an_unmodelled_schedule_before_tracing(capsys):
    import os

    from simplesharded.tools import forecast
    config = os.path.join(os.path.dirname(__file__), "..", "configs", "llama3_debug.toml")
    with pytest.raises(SystemExit):
        forecast.main(["--config", config, "--world-size", "4",
                       "--hardware", "h100-ib400", "--parallelism.pipeline_parallel_degree",
                       "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"])
    assert "not modelled" in capsys.readouterr().err
