"""``python -m simplesharded.plan``: dry-run a config at cluster scale, on this CPU.

Builds the model on the meta device, shards it over a *fake* process group of --world-size
ranks inside FakeTensorMode (no real memory, no communication), traces one forward+backward
(once per reshard-after-forward decision), then for each backend plan applies our passes to
copies of the traced graphs and simulates the schedule on two streams with the cost model
(passes/simulate.py). Prints step
time, exposed communication, bytes sent per rank and peak memory per rank; --timeline draws
the two-stream timeline of the first plan.
"""
from __future__ import annotations

import argparse
import copy
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

PLANS = ("aot_eager", "aot_eager_blockbucketing", "aot_eager_autobucketing")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Traced:
    fw: torch.fx.GraphModule
    bw: torch.fx.GraphModule
    param_shapes: list  # global parameter shapes
    trace_s: float


def trace(cfg, world_size: int, local_batch: int, n_layers: int | None = None,
          keep_gathered_bytes: int | None = None) -> Traced:
    """fw/bw graphs (after reshard-after-forward tagging and partitioning, before bucketing).
    ``n_layers`` builds the model with that many blocks instead of the flavor's;
    ``keep_gathered_bytes``: the budget of reshard_after_forward="auto" (passes/recompute.py)."""
    from simplesharded.backends import _RecomputePlan
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from simplesharded import MixedPrecisionPolicy, data_parallel
    from simplesharded.mesh import build_mesh
    from simplesharded.models import build_model

    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    from simplesharded.passes.recompute import tag_gathers_for_recompute

    p, t = cfg.parallelism, cfg.training
    graphs: dict[str, torch.fx.GraphModule] = {}

    class _Captured(Exception):
        pass

    def partition(joint, inputs, **kwargs):
        # Only the graphs are wanted: stop right after partitioning (nothing runs on fakes).
        graphs["fw"], graphs["bw"] = min_cut_rematerialization_partition(
            tag_gathers_for_recompute(joint, _RecomputePlan(None, keep_gathered_bytes)),
            inputs, **kwargs)
        raise _Captured

    capture = aot_autograd(fw_compiler=lambda gm, _: gm, partition_fn=partition)
    t0 = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        rep = p.data_parallel_replicate_degree
        mesh = build_mesh(rep, world_size // rep, "cpu")  # outside fake mode: real mesh object
        pdt, rdt = DTYPES[t.mixed_precision_param], DTYPES[t.mixed_precision_reduce]
        mp = MixedPrecisionPolicy(pdt, rdt) if (pdt, rdt) != (torch.float32,) * 2 else None
        with FakeTensorMode(allow_non_fake_inputs=True):
            extra = {"n_layers": n_layers} if n_layers else {}
            model = build_model(cfg.model.name, cfg.model.flavor, device="meta", **extra)
            shapes = [tuple(q.shape) for q in model.parameters()]
            from simplesharded.train import apply_activation_checkpointing
            apply_activation_checkpointing(model, cfg.activation_checkpoint.mode,
                                           cfg.activation_checkpoint.selective_every)
            data_parallel(model, mesh, p.mode, mp_policy=mp,
                          reshard_after_forward=p.reshard)
            tokens = torch.randint(0, 256, (local_batch, t.seq_len))
            try:
                torch.compile(model, fullgraph=True, backend=capture)(tokens)
            except Exception:
                if "bw" not in graphs:
                    raise
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()
    return Traced(graphs["fw"], graphs["bw"], shapes, time.perf_counter() - t0)


def apply_plan(traced: Traced, name: str, hardware: str, cap_bytes: int | None):
    """Copies of the traced graphs with backend ``name``'s passes applied (on a gloo
    ``hardware`` profile also the gloo lowerings, which the fake process group would skip)."""
    from simplesharded.passes.bucketing import bucket_collectives
    from simplesharded.passes.coalesce_gathers import coalesce_gathers
    from simplesharded.passes.cost_model import get_hardware
    from simplesharded.passes.lowering import lower_reduce_scatters
    from simplesharded.passes.planning import AutoPlan, BlockPlan
    from simplesharded.passes.reordering import reorder_for_overlap

    fw, bw = copy.deepcopy(traced.fw), copy.deepcopy(traced.bw)
    if name.endswith("bucketing"):
        plan = (BlockPlan(memory_cap_bytes=cap_bytes) if "block" in name
                else AutoPlan(hardware, cap_bytes))
        gloo = get_hardware(hardware).transport == "gloo"
        for gm in (fw, bw):
            bucket_collectives(gm, plan)
            reorder_for_overlap(gm, plan)
            if gloo:
                lower_reduce_scatters(gm, transports=None)
                coalesce_gathers(gm, transports=None)
    return fw, bw


@dataclass
class MemoryReport:
    params: int
    grads: int
    optimizer: int
    peak_activations: int  # fw/bw transient peak: gathered buffers + activations

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.peak_activations


def local_numel(shapes, world_size: int, mode: str, replicate: int = 1) -> int:
    """Elements of rank 0's shards (the largest: DTensor gives uneven remainders to the last
    ranks), summed over parameters of the given global shapes."""
    if mode == "replicate":
        return sum(math.prod(s) for s in shapes)
    shards = world_size // replicate if mode == "hybrid_shard" else world_size
    return sum(-(-s[0] // shards) * math.prod(s[1:]) for s in shapes if len(s))


def static_memory(shapes, world_size: int, mode: str, optimizer: str,
                  replicate: int = 1) -> tuple[int, int, int]:
    """Per-rank bytes of (fp32 parameter shards, fp32 gradients, optimizer states)."""
    n = local_numel(shapes, world_size, mode, replicate)
    states = {"AdamW": 2, "SGD": 1}.get(optimizer, 2)
    return 4 * n, 4 * n, states * 4 * n


def memory_report(traced: Traced, world_size: int, mode: str, optimizer: str,
                  fw_bw=None, replicate: int = 1) -> MemoryReport:
    """Per-rank bytes: static state (see static_memory) + the transient peak of the graphs."""
    from simplesharded.passes.cost_model import peak_memory

    fw, bw = fw_bw or (traced.fw, traced.bw)
    params, grads, opt = static_memory(traced.param_shapes, world_size, mode, optimizer,
                                       replicate)
    fw_peak, _ = peak_memory(fw, include_inputs=False)
    bw_peak, _ = peak_memory(bw, include_inputs=False)
    saved = sum(_nbytes(n) for n in bw.graph.nodes if n.op == "placeholder"
                and not n.name.startswith(("primals", "tangents")))
    return MemoryReport(params, grads, opt, int(max(fw_peak, saved + bw_peak)))


def _nbytes(node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def draw_timeline(path: str, fw_sched, bw_sched, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--timeline needs matplotlib: pip install matplotlib") from e
    colors = {"all_gather": "tab:blue", "reduce_scatter": "tab:orange",
              "all_reduce": "tab:red"}
    fig, ax = plt.subplots(figsize=(14, 2.8))
    for sched, offset in ((fw_sched, 0.0), (bw_sched, fw_sched.makespan)):
        for iv in sched.intervals:
            y = 1 if iv.stream == "compute" else 0
            color = colors.get(iv.label, "tab:green" if y else "tab:gray")
            ax.broken_barh([(1e3 * (iv.start + offset), 1e3 * (iv.end - iv.start))],
                           (y - 0.4, 0.8), facecolors=color, linewidth=0)
    ax.axvline(1e3 * fw_sched.makespan, color="k", linestyle=":", linewidth=1)
    ax.set_yticks([0, 1], ["comm", "compute"])
    ax.set_xlabel("ms (forward | backward)")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    from simplesharded.config import load_config
    from simplesharded.passes.cost_model import HARDWARE, get_hardware
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="a configs/*.toml file")
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--hardware", default="h100-ib400", help=f"one of {sorted(HARDWARE)}")
    ap.add_argument("--local-batch", type=int, default=0,
                    help="sequences per rank (default: global_batch_size / world size, min 1)")
    ap.add_argument("--plans", nargs="+", default=list(PLANS))
    ap.add_argument("--memory-cap-mb", type=float, default=0.0)
    ap.add_argument("--timeline", default=None, help="PNG path for the two-stream timeline")
    ap.add_argument("--timeline-plan", default="aot_eager_autobucketing")
    ap.add_argument("--full-trace-layers", type=int, default=32,
                    help="trace every block up to this depth (exact); deeper models are "
                         "extrapolated from traces of 4 and 6 blocks")
    ns, rest = ap.parse_known_args(argv)
    try:
        hw = get_hardware(ns.hardware)
        cfg = load_config(ns.config, rest)
        bad = sorted(set(ns.plans) - set(PLANS))
        if bad:
            raise ValueError(f"--plans {bad} not one of {list(PLANS)}")
        if ns.world_size % cfg.parallelism.data_parallel_replicate_degree:
            raise ValueError(f"--world-size {ns.world_size} is not divisible by "
                             f"data_parallel_replicate_degree "
                             f"{cfg.parallelism.data_parallel_replicate_degree}")
    except ValueError as e:
        ap.error(str(e))
    local_batch = ns.local_batch or max(1, cfg.training.global_batch_size // ns.world_size)
    from simplesharded.models import get_model_spec
    n_layers = get_model_spec(cfg.model.name, cfg.model.flavor)[1].n_layers
    # Blocks are identical, so the schedule is periodic: for deep models trace two short
    # versions and extrapolate linearly (exact for the per-block part, and 10x faster).
    sizes = [None] if n_layers <= ns.full_trace_layers else [4, 6]
    t0 = time.perf_counter()
    cap = int(ns.memory_cap_mb * 2**20) or None
    # reshard_after_forward="auto" is decided on the joint graph: the autobucketing plan keeps
    # blocks within its budget, the others the last block; one trace per distinct decision.
    from simplesharded.passes.planning import AutoPlan
    keeps = {name: AutoPlan(ns.hardware, cap).keep_gathered_bytes
             if "autobucketing" in name and cfg.parallelism.reshard == "auto" else None
             for name in ns.plans}
    traced = {keep: [trace(cfg, ns.world_size, local_batch, k, keep) for k in sizes]
              for keep in dict.fromkeys(keeps.values())}
    tokens = local_batch * cfg.training.seq_len
    how = ("traced in full" if sizes == [None] else
           f"extrapolated from traces of {sizes[0]} and {sizes[1]} blocks")
    full_shapes = [tuple(q.shape) for q in _meta_params(cfg)]
    full_numel = sum(math.prod(q) for q in full_shapes)
    rep = cfg.parallelism.data_parallel_replicate_degree
    size = f"{full_numel / 1e9:.2f}B" if full_numel >= 1e9 else f"{full_numel / 1e6:.1f}M"
    print(f"{cfg.model.name}/{cfg.model.flavor} ({size} params, {n_layers} "
          f"blocks) on {ns.world_size} ranks of {hw.name}, mode {cfg.parallelism.mode}, "
          f"{local_batch} × {cfg.training.seq_len} tokens per rank, AC "
          f"{cfg.activation_checkpoint.mode}; {how} in {time.perf_counter() - t0:.0f}s\n")
    print("| plan | step s | exposed comm s | comm GB/rank | collectives | tokens/s/rank | "
          "peak mem GiB/rank |\n|---|---:|---:|---:|---:|---:|---:|")
    drawn = None
    evaluated: dict[tuple, list[dict]] = {}

    def evaluate(name: str, keep) -> list[dict]:  # per trace; each (plan, traces) once
        if (name, keep) not in evaluated:
            evaluated[name, keep] = [_evaluate(tr, name, ns, cfg, hw, cap) for tr in traced[keep]]
        return evaluated[name, keep]

    for name in ns.plans:
        per_trace = evaluate(name, keeps[name])
        m = per_trace[0] if len(per_trace) == 1 else _extrapolate(per_trace, n_layers)
        if len(per_trace) > 1 and "autobucketing" in name:
            # Cost-model buckets may span several blocks, so their grouping (and with it the
            # gathered bytes in flight and the collective count) is not periodic in depth:
            # scale those from the block plan of the same traces instead.
            ref = evaluate("aot_eager_blockbucketing", keeps[name])
            ref_m = _extrapolate(ref, n_layers)
            m["peak_act"] = ref_m["peak_act"] + per_trace[-1]["peak_act"] - ref[-1]["peak_act"]
            m["collectives"] = ref_m["collectives"] * per_trace[-1]["collectives"] / max(
                1, ref[-1]["collectives"])
        static = sum(static_memory(full_shapes, ns.world_size, cfg.parallelism.mode,
                                   cfg.optimizer.name, rep))
        shard = local_numel(full_shapes, ns.world_size, cfg.parallelism.mode, rep)
        step = m["fw_s"] + m["bw_s"] + 7 * 4 * shard / hw.mem_bw_Bps  # + AdamW, memory bound
        print(f"| {name} | {step:.3f} | {m['exposed_s']:.3f} | {m['comm_bytes'] / 1e9:.2f} | "
              f"{m['collectives']:.0f} | {tokens / step:,.0f} | "
              f"{(static + m['peak_act']) / 2**30:.1f} |")
        if drawn is None or name == ns.timeline_plan:
            drawn = (name, per_trace[-1], static, m["peak_act"])
    name, last, static, act = drawn
    print(f"\nmemory per rank ({name}): params + grads + optimizer {static / 2**30:.2f} GiB "
          f"(fp32 shards), gathered buffers + activations {act / 2**30:.2f} GiB; the device "
          f"has {hw.memory_bytes / 2**30:.0f} GiB")
    if ns.timeline:
        shown = "" if sizes == [None] else f" (first {sizes[-1]} blocks)"
        draw_timeline(ns.timeline, last["fw_sched"], last["bw_sched"],
                      f"{cfg.model.name}/{cfg.model.flavor}{shown}, {ns.world_size} × "
                      f"{hw.name}, plan {name}")
        print(f"timeline written to {ns.timeline}")
    return 0


def _extrapolate(per_trace: list[dict], n_layers: int) -> dict:
    """Numbers of a ``n_layers``-block model from traces of 4 and 6 blocks (linear in depth)."""
    a, b = per_trace
    return {k: a[k] + (n_layers - 4) / 2 * (b[k] - a[k])
            for k in a if isinstance(a[k], (int, float))}


def _meta_params(cfg):
    from simplesharded.models import build_model
    return list(build_model(cfg.model.name, cfg.model.flavor, device="meta").parameters())


def _evaluate(traced: Traced, name: str, ns, cfg, hw, cap) -> dict:
    from simplesharded.passes.collectives import find_collectives
    from simplesharded.passes.simulate import simulate

    fw, bw = apply_plan(traced, name, ns.hardware, cap)
    fs, bs = simulate(fw, hw), simulate(bw, hw)
    mem = memory_report(traced, ns.world_size, cfg.parallelism.mode, cfg.optimizer.name,
                        (fw, bw), cfg.parallelism.data_parallel_replicate_degree)
    return {"fw_s": fs.makespan, "bw_s": bs.makespan,
            "exposed_s": fs.exposed_comm_s + bs.exposed_comm_s,
            "comm_bytes": fs.comm_bytes + bs.comm_bytes,
            "collectives": len(find_collectives(fw)) + len(find_collectives(bw)),
            "peak_act": int(mem.peak_activations), "fw_sched": fs, "bw_sched": bs}


if __name__ == "__main__":
    raise SystemExit(main())
