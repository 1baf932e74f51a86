"""The planner with pipeline parallelism (``python -m simplesharded.tools.forecast`` on a config
with ``parallelism.pipeline_parallel_degree`` > 1).

Costs per block come from the same traces as without a pipeline: one micro-batch
(``pipeline_parallel_microbatch_size`` sequences) through models of 4 and 6 blocks on the
``world / pp`` ranks of one pp coordinate (pp is the outermost mesh dim, so those ranks and
their dp/tp links are the ones every stage sees). Everything is linear in depth, so a stage of
``n`` blocks costs ``n`` x the per-block difference, and the last stage adds what is not a block
(final norm, output head, loss; the embedding's lookup is negligible next to it), with the
backend's own FSDP waits inside. The stage's parameters are counted from the model's FQNs
(simplesharded/pipeline/stage_split.py's cut: embedding with the first stage, norm and head with the
last).

The step is then simulated per pp rank (pp_simulate.py) in the schedule's order (pp_orders.py):
activations (micro-batch x seq x dim, whole sequences also under sequence parallelism) sent between
stages on the link joining ranks ``world / pp`` apart (inter-node as soon as one pp coordinate
fills a node); FSDP per stage as simplesharded/pipeline/pipelining.py runs ``pipeline_fsdp_policy``:
``every_microbatch`` and ``reduce_once`` gather in every micro-batch's forward (and backward,
as traced), ``every_microbatch`` reduces per micro-batch, the other two once per stage and step
on the dp link; ``gather_once`` gathers the stage's parameters once per step (one flat
collective: a dense stage's parameters are one bucket of simplesharded/storage/gather_once.py) and its
micro-batches lose the traced FSDP waits; ``auto`` is resolved per stage by the pipeline's own
rule (pipelining.auto_policy_of) on the stage's parameter count.
"""
from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass

from simplesharded.pipeline.pipelining import AUTO, DEFERRED, POLICIES, auto_policy_of
from simplesharded.tools.pp_orders import rank_orders, stage_rank
from simplesharded.tools.pp_simulate import PipelineStep, StageCost, simulate_pipeline

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_FSDP_DIMS = ("dp_shard", "dp_replicate")


@dataclass
class StagePlan:
    """What the simulation needs of one config beyond its per-stage costs."""

    schedule: str
    policy: str
    pp: int
    n_stages: int
    blocks: list[int]
    n_microbatches: int
    p2p_bytes: int
    p2p_link: str
    p2p_s: float
    policies: list[str]  # each stage's, ``auto`` resolved


def p2p_link(world_size: int, pp: int, hw) -> str:
    """The link between neighbouring pp ranks, ``world / pp`` apart (pp outermost): the
    intra-node one only when every pipeline lies within a node; otherwise some stage boundary
    crosses nodes, and the slowest boundary holds the others up."""
    from simplesharded.passes.comm_cost import INTER_NODE, INTRA_NODE
    within = world_size <= hw.gpus_per_node and hw.intra_node_bandwidth_Bps > 0
    return INTRA_NODE if within else INTER_NODE


def p2p_seconds(nbytes: int, link: str, hw) -> float:
    """One point-to-point transfer of ``nbytes`` on ``link``: latency + bytes / bandwidth."""
    from simplesharded.passes.comm_cost import INTRA_NODE
    if link == INTRA_NODE:
        return hw.intra_node_alpha_s + nbytes / hw.intra_node_bandwidth_Bps
    return hw.alpha_s + nbytes / hw.bandwidth_Bps


def stage_costs(per_block: dict, rest: dict, blocks: list[int], stage_numel: list[int],
                total_numel: int, local_numel: float, dp_shard: int, policy: str | list[str], hw,
                dp_link: str, optimizer: str, param_bytes: int,
                reduce_bytes: int) -> list[StageCost]:
    """StageCost of each stage from the traced numbers of one block (``per_block``) and of
    the rest of the model (``rest``): see the module doc. ``policy``: every stage's, or one per
    stage (none ``auto``)."""
    from simplesharded.passes.comm_cost import comm_time
    from simplesharded.tools.cluster_trace import static_memory

    def count(m, graph, kinds):
        return sum(v for k, v in m.items() if k.startswith(graph + ":")
                   and k.split(":")[1] in _FSDP_DIMS and k.split(":")[2] in kinds)

    def fsdp_exposed(m, graph="group"):
        if graph == "group":
            return sum(m.get(f"group:{d}:exposed_s", 0.0) for d in _FSDP_DIMS)
        return sum(m.get(f"{graph}:exposed:{d}", 0.0) for d in _FSDP_DIMS)

    def working(m):  # the graphs' peak above what forward saves
        return m["peak_act"] - m["saved"]

    reduce_kinds = ("reduce_scatter", "all_reduce", "all_to_all")
    policies = [policy] * len(blocks) if isinstance(policy, str) else policy
    out = []
    for s, (n, pol) in enumerate(zip(blocks, policies)):
        last = s == len(blocks) - 1
        part = [(per_block, n)] + ([(rest, 1)] if last else [])
        mix = lambda f: sum(f(m) * k for m, k in part)  # noqa: E731
        local = local_numel * stage_numel[s] / total_numel
        gathers = mix(lambda m: count(m, "fw", ("all_gather",)) + count(m, "bw", ("all_gather",)))
        reductions = mix(lambda m: count(m, "bw", reduce_kinds))
        # one flat reduce-scatter of the stage's summed gradients (deferred_reduce.py)
        reduce_s = (comm_time("reduce_scatter", int(local * dp_shard * reduce_bytes), dp_shard,
                              hw, dp_link) if pol in DEFERRED else 0.0)
        fw_s, bw_s, exposed = (mix(lambda m: m["fw_s"]), mix(lambda m: m["bw_s"]),
                               mix(fsdp_exposed))
        # every_microbatch: the stage's reduced shards; deferred: its unsharded gradients in
        # the gathered dtype (storage/grad_sync.py), both added to the sums after backward
        grads_returned = (param_bytes * local * dp_shard if pol in DEFERRED
                          else reduce_bytes * local)
        gather_s, step_gathers = 0.0, 0
        if pol == "gather_once":  # held parameters: no FSDP collective in any micro-batch
            fw_wait, bw_wait = (mix(lambda m, g=g: fsdp_exposed(m, g)) for g in ("fw", "bw"))
            fw_s, bw_s, exposed = fw_s - fw_wait, bw_s - bw_wait, exposed - fw_wait - bw_wait
            gathers, step_gathers = 0, 1
            gather_s = comm_time("all_gather", int(local * dp_shard * param_bytes), dp_shard,
                                 hw, dp_link)
        out.append(StageCost(
            fw_s=fw_s, bw_s=bw_s, reduce_s=reduce_s, gather_s=gather_s,
            step_gathers=step_gathers,
            fsdp_exposed_s=max(0.0, exposed),
            # held per micro-batch in flight: what forward saves for backward; the rest of
            # the graphs' peak is one action's own, the output head's included on every stage,
            # with the gradients a backward returns beside the accumulated ones
            act_bytes=int(mix(lambda m: m["saved"])),
            working_bytes=int(max(0.0, n * working(per_block) + working(rest))
                              + grads_returned),
            static_bytes=int(sum(static_memory(int(local), optimizer))),
            # the unsharded gradients' sums, kept in the reduction's dtype (grad_sync.py): the
            # trainer always sets reduce_dtype (training.mixed_precision_reduce)
            grad_sum_bytes=int(reduce_bytes * local * dp_shard),
            gathered_bytes=int(param_bytes * local * dp_shard),
            gathers=round(gathers), reductions=round(reductions)))
    return out


def stage_policies(policy: str, numels: list[int], memory_cap_mb: float,
                   param_dtype: str) -> list[str]:
    """Each stage's policy: ``policy``, or for ``auto`` what the pipeline picks for a stage of
    that many parameters (pipelining.auto_policy_of, the trainer's own rule)."""
    import torch
    if policy != AUTO:
        return [policy] * len(numels)
    return [auto_policy_of(n, memory_cap_mb, getattr(torch, param_dtype)) for n in numels]


def policy_label(policy: str, policies: list[str]) -> str:
    """``policy`` as the table shows it: ``auto`` with what it resolved to per stage."""
    if policy != AUTO:
        return policy
    counts = {q: policies.count(q) for q in POLICIES if q in policies}
    if len(counts) == 1:
        return f"auto: {policies[0]}"
    return "auto: " + ", ".join(f"{q} x{k}" for q, k in counts.items())


def stage_numels(cfg, n_stages: int, blocks: list[int]) -> tuple[list[int], int]:
    """(parameters of each stage, of the whole model), from the meta model's FQNs."""
    from simplesharded.pipeline.stage_split import plan_stages
    model = cfg.model.build()
    plans = plan_stages(model, n_stages, blocks)
    numel = {n: p.numel() for n, p in model.named_parameters()}
    out = []
    for plan in plans:
        owned = plan.blocks + plan.outside
        out.append(sum(v for n, v in numel.items()
                       if any(n == o or n.startswith(o + ".") for o in owned)))
    return out, sum(numel.values())


def run(cfg, ns, hw, cap, t0, traced_numbers) -> int:
    """Trace, simulate and print (forecast.main's pipeline path). ``cap``: the memory cap in
    bytes (None: none), which ``auto`` judges by; ``traced_numbers(cfg, ns, name)``:
    forecast.py's numbers of backend ``name`` as a function of depth, and the links of the
    traced groups (passed in: forecast.py imports this module)."""
    import time

    from simplesharded.pipeline.stage_split import even_split
    from simplesharded.trainer import check_static
    from simplesharded.trainer.config_checks import PIPELINE_SCHEDULES

    p, t = cfg.parallelism, cfg.training
    pp, tp, world = p.pipeline_parallel_degree, p.tensor_parallel_degree, ns.world_size
    cp = p.context_parallel_degree  # a stage's cp ranks split its sequences
    args = cfg.model.spec()[1]
    name = ns.pp_backend
    mb, local_batch = p.pipeline_parallel_microbatch_size, t.local_batch_size
    m = local_batch // mb
    dp = world // (pp * tp * cp)

    schedules = ns.pp_schedules or [p.pipeline_parallel_schedule]
    policies = ns.pp_policies or [p.pipeline_fsdp_policy]
    for schedule in schedules:  # before minutes of tracing
        if schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"--pp-schedules {schedule!r} is not one of "
                             f"{list(PIPELINE_SCHEDULES)}")
        n = len(p.pipeline_parallel_layers_per_stage) or pp * PIPELINE_SCHEDULES[schedule][0]
        stage_rank(schedule, n, pp)
        rank_orders(schedule, pp, n, m)

    # one pp coordinate's ranks, one micro-batch, no pipeline: the per-block costs
    sc = copy.deepcopy(cfg)
    sp, st = sc.parallelism, sc.training
    sp.pipeline_parallel_degree, sp.pipeline_parallel_layers_per_stage = 1, []
    st.local_batch_size, st.gradient_accumulation_steps, st.global_batch_size = mb, 1, mb * dp
    sc = check_static(sc, world // pp)
    sub = argparse.Namespace(world_size=world // pp, hardware=ns.hardware)
    at, links = traced_numbers(sc, sub, name)
    four, five = at(4), at(5)
    per_block = {k: five[k] - four[k] for k in four}
    rest = {k: four[k] - 4 * per_block[k] for k in four}
    local_full = four["local_numel"] + (args.n_layers - 4) * per_block["local_numel"]

    act_bytes = _DTYPE_BYTES.get(t.mixed_precision_param, 4)
    # whole sequences on every tp rank: sequence-parallel stages gather their output at the
    # stage edge (the pipeline's tp styles), so each tp rank sends the full hidden states; a
    # cp rank its head-tail chunks of them
    nbytes = mb * (t.seq_len // cp) * args.dim * act_bytes
    link = p2p_link(world, pp, hw)
    print(f"{cfg.model.label()} ({args.n_layers} blocks) on {world} ranks of "
          f"{hw.name}: pp {pp} x dp {dp} (shard {sp.data_parallel_shard_degree}) x cp {cp} x tp "
          f"{tp}; {m} micro-batches of {mb} x {t.seq_len} tokens per pipeline step (local batch "
          f"{local_batch}), AC {cfg.activation_checkpoint.mode}, backend {name}; per-block "
          f"costs from traces of 4 and 6 blocks on {world // pp} fake ranks, "
          f"{time.perf_counter() - t0:.0f}s\n")
    print(f"activations between stages: {nbytes / 2**20:.1f} MiB per micro-batch and direction"
          f" on the {link} link ({1e3 * p2p_seconds(nbytes, link, hw):.2f} ms)\n")
    print("| schedule | FSDP policy | stages | step s | bubble | exposed p2p s | exposed "
          "reduce s | exposed FSDP s | tokens/s/GPU | peak GiB (max rank) |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    results = []
    for schedule in schedules:
        n_stages = (len(p.pipeline_parallel_layers_per_stage) or
                    pp * PIPELINE_SCHEDULES[schedule][0])
        blocks = (list(p.pipeline_parallel_layers_per_stage)
                  or even_split(args.n_layers, n_stages))
        numels, total = stage_numels(cfg, n_stages, blocks)
        for policy in policies:
            each = stage_policies(policy, numels, (cap or 0) / 2**20, t.mixed_precision_param)
            costs = stage_costs(per_block, rest, blocks, numels, total, local_full,
                                sp.data_parallel_shard_degree * cp, each, hw,
                                links.get("dp_shard_cp" if cp > 1 else "dp_shard", link),
                                cfg.optimizer.name,
                                act_bytes, _DTYPE_BYTES.get(t.mixed_precision_reduce, 4))
            plan = StagePlan(schedule, policy_label(policy, each), pp, n_stages, blocks, m,
                             nbytes, link, p2p_seconds(nbytes, link, hw), each)
            step = simulate(plan, costs)
            ranks = step.by_rank_stages
            # AdamW on the rank's fp32 shards, memory bound (as forecast.py counts it)
            optim_s = max(7 * 4 * sum(local_full * numels[s] / total for s in stages)
                          for stages in ranks) / hw.mem_bw_Bps
            total_s = step.step_s + optim_s
            tps = local_batch * t.seq_len * dp / total_s / world
            r = max(range(pp), key=lambda i: step.exposed_comm_s[i])
            print(f"| {schedule} | {plan.policy} | {n_stages} | {total_s:.4g} | "
                  f"{step.bubble_fraction:.1%} | {step.exposed_p2p_s[r]:.3g} | "
                  f"{step.exposed_reduce_s[r]:.3g} | {step.exposed_fsdp_s[r]:.3g} | "
                  f"{tps:,.0f} | {max(step.peak_rank_bytes) / 2**30:.3g} |")
            results.append((plan, costs, step))
    print("\n(exposed: the pp rank with the most; step includes the AdamW update, memory "
          "bound)")
    for plan, costs, step in results:
        print(f"\nper stage, {plan.schedule} / {plan.policy}\n\n| stage | rank | policy | blocks "
              "| F ms | B ms | in flight | saved GiB/micro-batch | gathers/step | reductions/step "
              "| peak GiB (stage) |\n|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        ranks = stage_rank(plan.schedule, plan.n_stages, plan.pp)
        for s, c in enumerate(costs):
            print(f"| {s} | {ranks[s]} | {plan.policies[s]} | {plan.blocks[s]} | "
                  f"{1e3 * c.fw_s:.1f} | "
                  f"{1e3 * c.bw_s:.1f} | {step.max_in_flight[s]} | {c.act_bytes / 2**30:.3g} | "
                  f"{step.gathers[s]} | "
                  f"{step.reductions[s]} | {step.peak_stage_bytes[s] / 2**30:.3g} |")
        print("peak per pp rank (its stages together), GiB: "
              + ", ".join(f"{b / 2**30:.3g}" for b in step.peak_rank_bytes))
    if ns.timeline:
        from simplesharded.tools.pp_timeline import draw_pipeline
        plan, _, step = results[0]
        draw_pipeline(ns.timeline, step, f"{cfg.model.label()}, {world} x "
                      f"{hw.name}, pp {pp} {plan.schedule} ({plan.policy}), {m} micro-batches")
        print(f"\ntimeline written to {ns.timeline}")
    return 0


def simulate(plan: StagePlan, costs: list[StageCost]) -> PipelineStep:
    """One step of ``plan`` with ``costs``."""
    orders = rank_orders(plan.schedule, plan.pp, plan.n_stages, plan.n_microbatches)
    return simulate_pipeline(orders, stage_rank(plan.schedule, plan.n_stages, plan.pp), costs,
                             [plan.p2p_s] * (plan.n_stages - 1), plan.n_microbatches,
                             plan.policies)


