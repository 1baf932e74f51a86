"""``python -m simplesharded.tools.forecast``: dry-run a config at cluster scale, on this CPU.

Traces one forward+backward of the config's model, parallelized as the trainer does, over a
*fake* process group of --world-size ranks (cluster_trace.py; once per reshard-after-forward
decision, each trace in a forked process, as many side by side as there are cores), then for
each backend applies its passes to copies of the traced graphs and simulates the schedule
with the cost model (passes/simulate.py: a compute stream and a communication lane per
link). Prints step time, exposed communication, bytes sent per rank, tokens/s per rank and
peak memory per rank, then communication per process group (dp_shard, tp, ep, ...) and, with
expert parallelism, the all-to-alls' volume and exposed time; with context parallelism, the K/V
all-gathers found in the traced graphs (their ``ss_cp`` annotation) next to their size from
the model's shapes, 2 · tokens · kv_heads · head_dim · bytes per layer; --seq-lens reports the
peak memory per rank at each of several sequence lengths; --timeline draws the timeline of
one backend's step. With pipeline parallelism the step is the schedule's (pp_forecast.py).
Host offload (``--parallelism.offload``, as the trainer takes it) is modelled from the same
traces (offload_cost.py): the state it moves off the device, its copies over the profile's
host link and the optimizer step on the host.
"""
from __future__ import annotations

import argparse
import copy
import math
import multiprocessing
import os
import time
import traceback

from simplesharded.backends import BackendName
from simplesharded.tools import offload_cost
from simplesharded.tools.cluster_trace import (Traced, apply_backend_passes, fake_world,
                                               host_memory, memory_report, static_memory,
                                               trace)

# The backends forecast here: their inductor twins run the same passes (forecast_backend).
BACKENDS = ("aot_eager", "aot_eager_blockbucketing", "aot_eager_autobucketing")
BLOCK, AUTO = BackendName("aot_eager", "block"), BackendName("aot_eager", "auto")


def draw_timeline(path: str, fw_sched, bw_sched, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--timeline needs matplotlib: pip install matplotlib") from e
    colors = {"all_gather": "tab:blue", "reduce_scatter": "tab:orange",
              "all_reduce": "tab:red"}
    # compute on top, then one row per communication lane (link)
    lanes = sorted({iv.stream for s in (fw_sched, bw_sched) for iv in s.intervals} - {"compute"})
    rows = {"compute": len(lanes), **{lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}}
    fig, ax = plt.subplots(figsize=(14, 1.4 + 0.7 * len(rows)))
    for sched, offset in ((fw_sched, 0.0), (bw_sched, fw_sched.makespan)):
        for iv in sched.intervals:
            y = rows[iv.stream]
            compute = iv.stream == "compute"
            color = colors.get(iv.label, "tab:green" if compute else "tab:gray")
            ax.broken_barh([(1e3 * (iv.start + offset), 1e3 * (iv.end - iv.start))],
                           (y - 0.4, 0.8), facecolors=color, linewidth=0)
    ax.axvline(1e3 * fw_sched.makespan, color="k", linestyle=":", linewidth=1)
    ax.set_yticks(list(rows.values()), [f"comm {r}" if r != "compute" else r for r in rows])
    ax.set_xlabel("ms (forward | backward)")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    from simplesharded.trainer.config import load_config
    from simplesharded.mesh import resolve_degrees
    from simplesharded.passes.hardware import HARDWARE, get_hardware
    from simplesharded.pipeline.pipelining import AUTO as AUTO_POLICY
    from simplesharded.pipeline.pipelining import POLICIES
    from simplesharded.trainer import check_static
    from simplesharded.trainer.preflight import check_torch
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="a configs/*.toml file")
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--hardware", default="h100-ib400", help=f"one of {sorted(HARDWARE)}")
    ap.add_argument("--local-batch", type=int, default=0,
                    help="sequences per data-parallel rank, shared by its tp ranks (default: "
                         "the config's, global_batch_size / dp as the trainer resolves it)")
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS))
    ap.add_argument("--memory-cap-mb", type=float, default=None,
                    help="the backends' memory cap (default: the config's compile.memory_cap_mb, "
                         "as the trainer uses it)")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=None, metavar="N",
                    help="also the peak memory per rank at each of these sequence lengths "
                         "(the timeline backend's, one trace each; with context parallelism "
                         "each must split into 2 × cp chunks)")
    ap.add_argument("--timeline", default=None, help="PNG path for the timeline")
    ap.add_argument("--timeline-backend", default=str(AUTO))
    ap.add_argument("--full-trace-layers", type=int, default=8,
                    help="trace every block up to this depth; deeper models are extrapolated "
                         "from traces of 4 and 6 blocks (blocks repeat, so the step is "
                         "periodic in depth: llama3 8B's numbers are the same either way)")
    ap.add_argument("--pp-schedules", nargs="+", default=None,
                    help="with pipeline_parallel_degree > 1: the schedules to compare on the "
                         "same traces (default: the config's)")
    ap.add_argument("--pp-policies", nargs="+", default=None, choices=(AUTO_POLICY, *POLICIES),
                    help="with pipeline_parallel_degree > 1: the FSDP policies to compare, as "
                         "parallelism.pipeline_fsdp_policy takes them (auto: per stage, as the "
                         "pipeline picks; default: the config's)")
    ns, rest = ap.parse_known_args(argv)
    try:
        hw = get_hardware(ns.hardware)
        cfg = load_config(ns.config, rest)
        bad = sorted(set(ns.backends) - set(BACKENDS))
        if bad:
            raise ValueError(f"--backends {bad} not one of {list(BACKENDS)}")
        cfg.training.dataset_path = ""  # nothing is read
        if ns.local_batch:
            p, t = cfg.parallelism, cfg.training
            dp = resolve_degrees(ns.world_size, p.data_parallel_replicate_degree,
                                 p.data_parallel_shard_degree, p.tensor_parallel_degree,
                                 p.expert_parallel_degree, p.context_parallel_degree,
                                 pp=p.pipeline_parallel_degree).dp
            t.local_batch_size = ns.local_batch
            t.global_batch_size = ns.local_batch * dp * t.gradient_accumulation_steps
        cfg = check_static(cfg, ns.world_size)  # the trainer's checks: degrees, batch, tp
        check_torch(cfg)  # the planner traces what the trainer would run: its torch's features
        offload_cost.check_hardware(hw, cfg.parallelism.offload)
        if ns.seq_lens:
            if ns.timeline_backend not in ns.backends:
                raise ValueError(f"--seq-lens reports --timeline-backend "
                                 f"{ns.timeline_backend!r}, which is not one of --backends "
                                 f"{ns.backends}")
            for n in ns.seq_lens:  # each as the trainer would check it
                check_static(_with_seq_len(cfg, n), ns.world_size)
    except ValueError as e:
        ap.error(str(e))
    p = cfg.parallelism
    t0 = time.perf_counter()
    cap_mb = cfg.compile.memory_cap_mb if ns.memory_cap_mb is None else ns.memory_cap_mb
    cap = int(cap_mb * 2**20) or None
    if p.pipeline_parallel_degree > 1:
        from simplesharded.tools import pp_forecast

        def traced_numbers(stage_cfg, sub, name):  # depth -> numbers, and the groups' links
            evaluated, keeps = evaluate_backends(stage_cfg, sub, hw, cap, [name], [4, 6])
            runs = evaluated[keeps[name]]
            return (lambda n: _numbers(name, runs, n)), runs[-1][name]["links"]
        try:
            ns.pp_backend = (forecast_backend(cfg.compile.backend) if cfg.compile.enable
                             else "aot_eager")
            return pp_forecast.run(cfg, ns, hw, cap, t0, traced_numbers)
        except ValueError as e:
            ap.error(str(e))
    n_layers = cfg.model.spec()[1].n_layers
    # Blocks are identical, so the schedule is periodic: for deep models trace two short
    # versions and extrapolate linearly (exact for the per-block part, and 10x faster).
    sizes = [None] if n_layers <= ns.full_trace_layers else [4, 6]
    evaluated, keeps = evaluate_backends(cfg, ns, hw, cap, ns.backends, sizes)
    drawn = _report(ns, cfg, hw, evaluated, keeps, sizes, n_layers, t0)
    _advise_tp_recompute(ns, cfg, hw, cap, sizes, n_layers, *drawn)
    if ns.seq_lens:
        _report_seq_lens(ns, cfg, hw, cap, sizes, n_layers)
    return 0


def _with_seq_len(cfg, seq_len: int):
    cfg = copy.deepcopy(cfg)
    cfg.training.seq_len = seq_len
    return cfg


def _report_seq_lens(ns, cfg, hw, cap, sizes, n_layers) -> None:
    """Peak memory per rank of the timeline backend at each of ``ns.seq_lens`` (the config's
    batch, degrees and activation checkpointing; one trace per length and depth)."""
    name = ns.timeline_backend
    print(f"\nmemory per rank by sequence length ({name}; "
          f"{cfg.training.local_batch_size} sequence(s) per dp rank, context parallel degree "
          f"{cfg.parallelism.context_parallel_degree})\n\n| seq_len | tokens/rank | "
          f"gathered buffers + activations GiB | peak GiB/rank | within "
          f"job.gpu_memory_gib |\n|---:|---:|---:|---:|---|")
    room = _room_bytes(cfg)
    for n in ns.seq_lens:
        c = _with_seq_len(cfg, n)
        evaluated, keeps = evaluate_backends(c, ns, hw, cap, [name], sizes)
        m = _numbers(name, evaluated[keeps[name]], n_layers)
        static, act = device_memory(m, c)
        peak = static + act
        tokens = _tokens_per_rank(c)
        fits = ("–" if not cfg.job.gpu_memory_gib else
                "yes" if peak <= room else "NO")
        print(f"| {n} | {tokens} | {act / 2**30:.2f} | {peak / 2**30:.1f} | {fits} |")


def evaluate_backends(cfg, ns, hw, cap, backends, sizes) -> tuple[dict, dict]:
    """Every backend of ``backends`` on traces of ``sizes`` blocks (None: the flavor's depth)
    of ``cfg``'s compiled step over ``ns.world_size`` fake ranks, cost model ``ns.hardware``:
    ({keep budget: [{backend: numbers} per trace size]}, {backend: its keep budget})."""
    from simplesharded.backends import BackendOptions, backend_plan

    # reshard_after_forward="auto" is decided on the joint graph by each backend's plan (the
    # auto plan keeps blocks within its budget, the block plan the last block): one trace
    # per distinct decision.
    opts = BackendOptions(hardware=ns.hardware, memory_cap_bytes=cap)
    keeps = {name: backend_plan(name, opts).keep_gathered_bytes
             if cfg.parallelism.reshard == "auto" else None for name in backends}
    # The autobucketing extrapolation also needs the block bucketing of its traces.
    need = {keep: {n for n in backends if keeps[n] == keep} for keep in keeps.values()}
    for keep, names in need.items():
        if len(sizes) > 1 and any(BackendName.parse(n) == AUTO for n in names):
            names.add(str(BLOCK))
    calls = [(_trace_and_evaluate, cfg, ns, hw, cap, k, keep, sorted(names))
             for keep, names in need.items() for k in sizes]
    results = iter(_in_children(calls))
    evaluated = {keep: [next(results) for _ in sizes] for keep in need}
    return evaluated, keeps


def predicted_peak_bytes(cfg, world_size: int, backends, hardware: str = "local",
                         n_layers: int | None = None,
                         full_trace_layers: int | None = None) -> dict[str, int]:
    """{backend: per-rank peak bytes the planner predicts} for ``cfg``'s compiled step on
    ``world_size`` ranks (``n_layers`` blocks; None: the flavor's), under the config's memory
    cap: fp32 shards, gradients and optimizer state plus the graphs' peak of gathered buffers
    and activations (under the config's host offload: device_memory). Every block is traced,
    or with ``full_trace_layers`` a deeper model is extrapolated from traces of 4 and 6
    blocks, as ``python -m simplesharded.tools.forecast`` does."""
    from simplesharded.passes.hardware import get_hardware
    depth = n_layers or cfg.model.spec()[1].n_layers
    sizes = ([4, 6] if full_trace_layers is not None and depth > full_trace_layers
             else [n_layers])
    ns = argparse.Namespace(world_size=world_size, hardware=hardware)
    cap = int(cfg.compile.memory_cap_mb * 2**20) or None
    evaluated, keeps = evaluate_backends(cfg, ns, get_hardware(hardware), cap, backends, sizes)
    out = {}
    for name in backends:
        out[name] = int(sum(device_memory(_numbers(name, evaluated[keeps[name]], depth), cfg)))
    return out


def device_memory(m: dict, cfg) -> tuple[float, float]:
    """(static, transient) device bytes per rank of a backend's numbers ``m`` under ``cfg``'s
    optimizer and host offload: the fp32 shards, gradients and optimizer state the device
    keeps (static_memory), and the graphs' peak of gathered buffers and activations: with
    backward's reduced gradients beside the static ones when the step accumulates
    micro-batches on the device (cluster_trace.memory_report), and under host offload with
    the bytes its copies hold (offload_cost.in_flight_copy_bytes). Every peak the planner
    prints is their sum."""
    offload = cfg.parallelism.offload
    static = sum(static_memory(m["local_numel"], cfg.optimizer.name, offload))
    accumulating = cfg.training.gradient_accumulation_steps > 1 and offload == "none"
    peak = m["peak_act_accumulating"] if accumulating else m["peak_act"]
    return static, peak + offload_cost.in_flight_copy_bytes(m, offload)


def step_seconds(m: dict, cfg, hw) -> float:
    """Seconds of one step of a backend's numbers ``m``: forward and backward as simulated,
    offload's copies (charged serialised with compute, offload_cost.py) and the optimizer's
    step (memory bound: on the device, or on the host under offload)."""
    offload = cfg.parallelism.offload
    return (m["fw_s"] + m["bw_s"] + offload_cost.copy_seconds(m, offload, hw)
            + offload_cost.optimizer_seconds(m["local_numel"], offload, hw))


def forecast_backend(backend: str) -> str:
    """The backend of BACKENDS whose forecast models ``backend``'s compiled step: its
    aot_eager twin (inductor runs the same passes; eager is forecast as plain aot_eager)."""
    name = str(BackendName.parse(backend).on("aot_eager"))
    if name not in BACKENDS:
        raise ValueError(f"compile.backend={backend!r} is not forecast here; the planner "
                         f"models {list(BACKENDS)} and their inductor twins")
    return name


def _trace_and_evaluate(cfg, ns, hw, cap, n_layers, keep, names) -> dict[str, dict]:
    """{backend: _evaluate's numbers} for the backends ``names`` on one trace (see trace); the
    fake process group stays up throughout: the plans' cost model resolves the traced groups."""
    with fake_world(ns.world_size):
        traced = trace(cfg, cfg.training.local_batch_size, n_layers, keep, cap)
        return {name: _evaluate(traced, name, ns, cfg, hw, cap) for name in names}


def _in_children(calls: list[tuple]) -> list:
    """``fn(*args)`` for each ``(fn, *args)`` of ``calls``, each in a forked child process, as
    many at once as this process may use cores (the traces are independent, and torch's trace
    runs on one core): their (picklable) results in order, or a RuntimeError with a failed
    child's traceback. One trace per process: torch 2.13 fails the second compile in a
    process of a model whose output is a DTensor (loss parallel: "Node tangents_N was
    invalid, but is output" in the partitioner). The children come from a fork server
    (:func:`_children_context`), so torch is imported once per caller, not per child."""
    ctx = _children_context()
    running: list = []  # (child, its pipe's reading end), in the order of calls
    results: list = []
    failed = None

    def collect() -> None:
        nonlocal failed
        child, receive = running.pop(0)
        try:
            ok, value = receive.recv()  # before join: a large result fills the pipe until read
        except EOFError:
            ok, value = False, "the child process died without a result"
        child.join()
        results.append(value)
        failed = failed if ok or failed is not None else value

    for fn, *args in calls:
        if len(running) == len(os.sched_getaffinity(0)):
            collect()
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_child, args=(fn, args, send))
        child.start()
        send.close()  # the child holds the only writer: its death ends recv() with EOFError
        running.append((child, receive))
    while running:
        collect()
    if failed is not None:
        raise RuntimeError(f"forecasting in a child process failed:\n{failed}")
    return results


def _child(fn, args, send) -> None:
    try:
        send.send((True, fn(*args)))
    except BaseException:
        send.send((False, traceback.format_exc()))


def _children_context():
    """Children forked from a fork server that has run nothing but this module's import. A
    plain fork copies the caller's threads' locks mid-flight: a child forked from a process
    that compiled before (inductor's kernels and thread pools, a test worker) died of a
    segmentation fault, and under a CUDA build autograd refuses to run in such a child
    ("Unable to handle autograd's threading in combination with fork-based
    multiprocessing")."""
    from simplesharded.shims import forkserver
    forkserver.start(preload=[__name__])  # this process's: whoever started it, it imported torch
    return multiprocessing.get_context("forkserver")


def _report(ns, cfg, hw, evaluated, keeps, sizes, n_layers, t0) -> tuple[str, float, float]:
    """Print the forecast's tables and lines; return the drawn backend (the timeline's, else
    the first), its peak bytes per rank and its tokens/s per rank."""
    from simplesharded.mesh import resolve_degrees

    p, t = cfg.parallelism, cfg.training
    local_batch, tp = t.local_batch_size, p.tensor_parallel_degree
    tokens = _tokens_per_rank(cfg)
    how = ("traced in full" if sizes == [None] else
           f"extrapolated from traces of {sizes[0]} and {sizes[1]} blocks")
    full_numel = sum(math.prod(q.shape) for q in _meta_params(cfg))
    size = f"{full_numel / 1e9:.2f}B" if full_numel >= 1e9 else f"{full_numel / 1e6:.1f}M"
    degrees = resolve_degrees(ns.world_size, p.data_parallel_replicate_degree,
                              p.data_parallel_shard_degree, tp, p.expert_parallel_degree,
                              p.context_parallel_degree)
    mesh = " × ".join(f"{name} {n}" for name, n in degrees.dims())
    if degrees.ep > 1 and degrees.cp > 1:  # the ep mesh; cp is its sibling (mesh.py)
        mesh += f", cp {degrees.cp} beside ep (both over dp_shard {degrees.shard} × cp)"
    print(f"{cfg.model.label()} ({size} params, {n_layers} "
          f"blocks) on {ns.world_size} ranks of {hw.name} (mesh {mesh}), mode {p.mode}, "
          f"{local_batch} × {t.seq_len} tokens per dp rank, AC "
          f"{cfg.activation_checkpoint.mode}; {how}, traced and simulated in "
          f"{time.perf_counter() - t0:.0f}s\n")
    print("| backend | step s | exposed comm s | comm GB/rank | collectives | tokens/s/rank | "
          "peak mem GiB/rank |\n|---|---:|---:|---:|---:|---:|---:|")
    drawn = None
    rows, numbers = [], {}

    for name in ns.backends:
        m = numbers[name] = _numbers(name, evaluated[keeps[name]], n_layers)
        last = evaluated[keeps[name]][-1][name]  # the deepest trace: its links and timeline
        static, act = device_memory(m, cfg)
        step = step_seconds(m, cfg, hw)
        print(f"| {name} | {step:.3f} | {m['exposed_s']:.3f} | {m['comm_bytes'] / 1e9:.2f} | "
              f"{m['collectives']:.0f} | {tokens / step:,.0f} | "
              f"{(static + act) / 2**30:.1f} |")
        rows += [(name, label, link, m) for label, link in last["links"].items()]
        if drawn is None or name == ns.timeline_backend:
            drawn = (name, last, static, act, m, tokens / step)
    print("\ncommunication per process group, per rank and step (comm s: transfer time on the "
          "group's link; exposed s: compute waiting for it)\n\n"
          "| backend | group | link | collectives | GB/rank | comm s | exposed s |\n"
          "|---|---|---|---:|---:|---:|---:|")
    for name, label, link, m in rows:
        g = f"group:{label}:"
        print(f"| {name} | {label} | {link} | {m[g + 'count']:.0f} | "
              f"{m[g + 'bytes'] / 1e9:.2f} | {m[g + 'seconds']:.3f} | {m[g + 'exposed_s']:.3f} |")
    a2a = "kind:all_to_all:"
    if any(m.get(a2a + "count") for m in numbers.values()):
        print("\nall-to-alls (expert parallelism's token exchange), per rank and step; split "
              "sizes as balanced routing gives them\n\n| backend | all-to-alls | GB/rank | "
              "comm s | exposed s |\n|---|---:|---:|---:|---:|")
        for name, m in numbers.items():
            print(f"| {name} | {m[a2a + 'count']:.0f} | {m[a2a + 'bytes'] / 1e9:.2f} | "
                  f"{m[a2a + 'seconds']:.3f} | {m[a2a + 'exposed_s']:.3f} |")
    m = numbers[ns.backends[0]]
    if m.get("cp:count"):
        print("\n" + _cp_line(cfg, m))
    name, last, static, act, m, rate = drawn
    print(f"\nmemory per rank ({name}): params + grads + optimizer {static / 2**30:.2f} GiB "
          f"(fp32 shards on the device), gathered buffers + activations "
          f"{act / 2**30:.2f} GiB; the device has {hw.memory_bytes / 2**30:.0f} GiB")
    if p.offload != "none":
        print(_offload_line(cfg, hw, m))
    print(_stated_fit(cfg, ns.world_size, static + act))
    if ns.timeline:
        shown = "" if sizes == [None] else f" (first {sizes[-1]} blocks)"
        draw_timeline(ns.timeline, last["fw_sched"], last["bw_sched"],
                      f"{cfg.model.label()}{shown}, {ns.world_size} × "
                      f"{hw.name}, backend {name}")
        print(f"timeline written to {ns.timeline}")
    return name, static + act, rate


def _tokens_per_rank(cfg) -> int:
    """Tokens a rank trains on per step: a dp rank's tp ranks share its tokens, its cp ranks
    split them."""
    t, p = cfg.training, cfg.parallelism
    return (t.local_batch_size * t.seq_len
            // (p.tensor_parallel_degree * p.context_parallel_degree))


def _advise_tp_recompute(ns, cfg, hw, cap, sizes, n_layers, name: str, peak: float,
                         rate: float) -> None:
    """When backend ``name``'s peak is above the room a rank has (MEMORY_HEADROOM of the
    config's job.gpu_memory_gib, else of the hardware's memory) and the config could run its
    checkpointed blocks' TP reduce-scatters again in backward instead of saving them
    (activation_checkpoint.recompute_tp_outputs, off), the same step traced with it: its peak
    and tokens/s beside these, one line. A second trace, only then."""
    from simplesharded.trainer.config import MEMORY_HEADROOM
    from simplesharded.trainer.config_checks import validate

    room = _room_bytes(cfg) or MEMORY_HEADROOM * hw.memory_bytes
    if cfg.activation_checkpoint.recompute_tp_outputs or peak <= room:
        return
    alt = copy.deepcopy(cfg)
    alt.activation_checkpoint.recompute_tp_outputs = True
    try:
        validate(alt)
    except ValueError:  # no checkpointed TP blocks, or the step graph
        return
    evaluated, keeps = evaluate_backends(alt, ns, hw, cap, [name], sizes)
    m = _numbers(name, evaluated[keeps[name]], n_layers)
    print(f"{name} with --activation_checkpoint.recompute_tp_outputs (the checkpointed blocks' "
          f"TP reduce-scatters run again in backward, not saved): peak "
          f"{sum(device_memory(m, alt)) / 2**30:.2f} GiB/rank, "
          f"{_tokens_per_rank(alt) / step_seconds(m, alt, hw):,.0f} tokens/s/rank (without: "
          f"{peak / 2**30:.2f} GiB, {rate:,.0f} tokens/s; room {room / 2**30:.2f} GiB)")


def _offload_line(cfg, hw, m: dict) -> str:
    """What host offload costs per rank and step: its copies and the host's optimizer step."""
    offload = cfg.parallelism.offload
    to_device, to_host = offload_cost.copy_bytes(m, offload)
    host = host_memory(m["local_numel"], cfg.optimizer.name, offload)
    return (f"offload {offload}: the host holds {host / 2**30:.2f} GiB per rank (fp32 shards, "
            f"gradients, optimizer state); host to device {to_device / 1e9:.2f} GB, device to "
            f"host {to_host / 1e9:.2f} GB per step at {hw.host_link_Bps / 1e9:.0f} GB/s, "
            f"{offload_cost.copy_seconds(m, offload, hw):.3f} s serialised with compute; the "
            f"optimizer step on the host "
            f"{offload_cost.optimizer_seconds(m['local_numel'], offload, hw):.3f} s at "
            f"{hw.host_mem_bw_Bps / 1e9:.0f} GB/s")


def kv_gather_bytes(cfg) -> int:
    """Bytes one layer's K/V all-gather produces on each cp rank, from the model's shapes:
    K and V of every token of a dp rank's micro-batch (2 · tokens · kv_heads · head_dim ·
    the parameters' compute dtype's bytes), tp ranks holding their share of the heads."""
    import torch
    args = cfg.model.spec()[1]
    t, p = cfg.training, cfg.parallelism
    dtype = getattr(torch, t.mixed_precision_param)
    head_dim = args.dim // args.n_heads
    kv_heads = max(1, args.n_kv_heads // p.tensor_parallel_degree)
    return 2 * t.local_batch_size * t.seq_len * kv_heads * head_dim * dtype.itemsize


def _cp_line(cfg, m: dict) -> str:
    """The K/V all-gathers of the traced step (forward gathers, backward reduce-scatters of
    their gradients) next to their size from the model's shapes."""
    cp = cfg.parallelism.context_parallel_degree
    per_layer = kv_gather_bytes(cfg)
    return (f"context parallel: {m['cp:count']:.0f} K/V collectives over cp per step (a "
            f"gather per layer forward, a reduce-scatter backward), "
            f"{m['cp:gathered_bytes'] / 2**20:,.2f} MiB gathered per layer traced (2 · tokens "
            f"· kv_heads · head_dim · bytes = {per_layer / 2**20:,.2f} MiB), "
            f"{m['cp:sent_bytes'] / 2**20:,.2f} MiB/rank sent "
            f"((cp − 1) / cp of each, cp {cp})")


def _room_bytes(cfg) -> float:
    """The peak a rank's memory may reach: MEMORY_HEADROOM of the config's job.gpu_memory_gib
    (0 when the config states none)."""
    from simplesharded.trainer.config import MEMORY_HEADROOM
    return MEMORY_HEADROOM * cfg.job.gpu_memory_gib * 2**30


def _stated_fit(cfg, world_size: int, peak: float) -> str:
    """The config's own claim (job.gpu_counts, job.gpu_memory_gib) next to this prediction."""
    from simplesharded.trainer.config import MEMORY_HEADROOM

    j = cfg.job
    if not j.gpu_counts:
        return "the config states no job.gpu_counts"
    room = _room_bytes(cfg) / 2**30
    count = "is one of" if world_size in j.gpu_counts else "is not one of"
    fits = "within" if peak <= room * 2**30 else "ABOVE"
    return (f"the config is sized for job.gpu_counts {j.gpu_counts} of job.gpu_memory_gib "
            f"{j.gpu_memory_gib:g}: world size {world_size} {count} them; this peak, "
            f"{peak / 2**30:.1f} GiB, is {fits} {MEMORY_HEADROOM:.0%} of it ({room:.1f} GiB)")


def _numbers(name: str, per_trace: list[dict], n_layers: int) -> dict:
    """Backend ``name``'s numbers at depth ``n_layers`` from ``per_trace`` ({backend:
    numbers} of one full trace, or of the 4- and 6-block traces)."""
    if len(per_trace) == 1:
        return per_trace[0][name]
    own = [numbers[name] for numbers in per_trace]
    m = _extrapolate(own, n_layers)
    if BackendName.parse(name) == AUTO:
        # Cost-model buckets may span several blocks, so their count is not periodic in
        # depth: scale it from the block bucketing of the same traces instead. (The peak is:
        # the memory cap bounds the gathered bytes alive the same way at every depth.)
        ref = [numbers[str(BLOCK)] for numbers in per_trace]
        ref_m = _extrapolate(ref, n_layers)
        for key in [k for k in m if k == "collectives" or k.endswith(":count")]:
            m[key] = ref_m.get(key, 0) * own[-1][key] / max(1, ref[-1].get(key, 0))
    return m


def _extrapolate(per_trace: list[dict], n_layers: int) -> dict:
    """Numbers of a ``n_layers``-block model from traces of 4 and 6 blocks (linear in depth)."""
    a, b = per_trace
    return {k: a[k] + (n_layers - 4) / 2 * (b[k] - a[k])
            for k in a if isinstance(a[k], (int, float))}


def _meta_params(cfg):
    return list(cfg.model.build().parameters())


def _evaluate(traced: Traced, name: str, ns, cfg, hw, cap) -> dict:
    """One backend on one trace: its times, bytes, memory, and per process group (keys
    ``group:<mesh dim>:count|bytes|seconds|exposed_s``, the dims' links under ``links``)."""
    from simplesharded.passes.annotations import CP_KEY, annotations
    from simplesharded.passes.collectives import find_collectives
    from simplesharded.passes.simulate import simulate

    from simplesharded.trainer.recipe import quantize_options

    # the trainer's quantized collectives, so their bytes and (de)quantize ops are costed
    fw, bw = apply_backend_passes(traced, name, ns.hardware, cap,
                                  **quantize_options(cfg.compile))
    fs, bs = (simulate(gm, hw, labels=traced.group_labels) for gm in (fw, bw))
    # device_memory adds params' bucket copy
    mem = memory_report(traced, cfg.optimizer.name, (fw, bw))
    out = {"fw_s": fs.makespan, "bw_s": bs.makespan,
           "exposed_s": fs.exposed_comm_s + bs.exposed_comm_s,
           "comm_bytes": fs.comm_bytes + bs.comm_bytes,
           "collectives": len(find_collectives(fw)) + len(find_collectives(bw)),
           "peak_act": int(mem.peak_activations), "local_numel": traced.local_numel,
           "saved": mem.saved, "peak_act_accumulating": mem.peak_activations_accumulating,
           "fw_sched": fs, "bw_sched": bs, "links": {}}
    # the buckets' shards offload would copy: of the traced graphs, whose ragged buckets are
    # every backend's
    out.update({f"offload:{k}": v for k, v in
                offload_cost.bucket_shards(traced.fw, traced.bw).items()})
    # per graph, mesh dim and kind: the pipeline model (pp_forecast.py) tells FSDP's gathers
    # from its reductions per micro-batch
    for graph, gm in (("fw", fw), ("bw", bw)):
        for c in find_collectives(gm):
            key = f"{graph}:{traced.group_labels.get(c.group_name, '?')}:{c.kind}"
            out[key] = out.get(key, 0) + 1
    for graph, sched in (("fw", fs), ("bw", bs)):
        for label, g in sched.by_group.items():
            out[f"{graph}:exposed:{label}"] = g.exposed_s
    # Context parallelism's K/V collectives, found by annotation (their group may be the
    # parameters' too, when dp_shard is 1): count, a forward gather's output, bytes sent
    cp = [c for gm in (fw, bw) for c in find_collectives(gm) if CP_KEY in annotations(c.start)]
    gathers = [c.nbytes for c in find_collectives(fw)
               if CP_KEY in annotations(c.start) and c.kind == "all_gather"]
    out["cp:count"] = len(cp)
    out["cp:gathered_bytes"] = max(gathers, default=0)
    out["cp:sent_bytes"] = sum(
        (c.nbytes * c.group_size if c.kind == "reduce_scatter" else c.nbytes)
        * (c.group_size - 1) / c.group_size for c in cp)
    for sched in (fs, bs):
        for prefix, tallies in (("group", sched.by_group), ("kind", sched.by_kind)):
            for label, g in tallies.items():
                if prefix == "group":
                    out["links"][label] = g.link
                for field in ("count", "bytes", "seconds", "exposed_s"):
                    key = f"{prefix}:{label}:{field}"
                    out[key] = out.get(key, 0) + getattr(g, field)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
