"""``python -m simplesharded.tools.bench_passes``: how long our compiler passes take on a config's graphs.

Traces the config's training step as the trainer compiles it, over a fake process group of
--world-size ranks (cluster_trace.py: dynamo, aot_autograd, our joint recompute pass,
partitioning), then runs the graph passes of the block- and autobucketing backends on copies
of the forward and backward graphs, in the pipeline the backends build (backends.pass_pipeline),
and prints each pass's time and the passes' share of the whole compile (trace + passes), in CPU
seconds of this process: on a shared machine wall time also counts the others' work. Each timed run
starts after a full garbage collection: the copies of the graphs are this bench's own
allocations (a compile hands the passes its graphs, it copies nothing), and at 405B the full
collection they would otherwise set off inside the passes costs 1.5-3 CPU s. The
lowerings are the real backend's: on the fake process group they find no gloo group and
return at once, as on NCCL. ``--n-layers`` traces that many blocks instead of the flavor's.
"""
from __future__ import annotations

import argparse
import copy
import gc
import time

BACKENDS = ("aot_eager_blockbucketing", "aot_eager_autobucketing")


def pass_times(traced, name: str, hardware: str) -> dict[str, dict[str, float]]:
    """{"fw"|"bw": {pass: seconds}} of backend ``name``'s graph passes on copies of
    ``traced``'s graphs, run by a PassPipeline as the backend runs them (each pass's time
    includes what the pipeline does after it), and "codegen": generating the final graph's
    code, once, as the backend does after the last pass."""
    from simplesharded.backends import BackendOptions, pass_pipeline
    from simplesharded.passes.pipeline import generate_code, lazily_compiled

    out: dict[str, dict[str, float]] = {"fw": {}, "bw": {}}
    last = [0.0]

    def observe(kind, stage, gm):  # called before the first pass and after each
        now = time.process_time()
        if stage != "input":
            out[kind][stage] = now - last[0]
        last[0] = now

    pipeline = pass_pipeline(name, BackendOptions(hardware=hardware, observer=observe))
    for kind in ("fw", "bw"):
        gm = lazily_compiled(copy.deepcopy(getattr(traced, kind)))
        gc.collect()  # see the module doc
        gm = pipeline.run_graph(gm)
        generate_code(gm)
        observe(kind, "codegen", gm)
    return out


def main(argv=None) -> int:
    from simplesharded.trainer.config import load_config
    from simplesharded.tools.cluster_trace import fake_world, trace
    from simplesharded.trainer import check_static

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="a configs/*.toml file")
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--hardware", default="h100-ib400", help="the auto plan's cost model")
    ap.add_argument("--n-layers", type=int, default=None, help="override the flavor's depth")
    ns, rest = ap.parse_known_args(argv)
    try:
        cfg = load_config(ns.config, rest)
        cfg.training.dataset_path = ""  # nothing is read
        cfg = check_static(cfg, ns.world_size)
    except ValueError as e:
        ap.error(str(e))
    with fake_world(ns.world_size):
        traced = trace(cfg, cfg.training.local_batch_size, ns.n_layers)
        rows = [(name, pass_times(traced, name, ns.hardware)) for name in BACKENDS]
    depth = ns.n_layers or "all"
    print(f"{cfg.model.label()} ({depth} blocks) on {ns.world_size} ranks: "
          f"fw {len(traced.fw.graph.nodes)} nodes, bw {len(traced.bw.graph.nodes)} nodes; "
          f"compile up to our graph passes {traced.trace_s:.1f} CPU s (of which our recompute "
          f"pass {traced.recompute_s:.2f} s)\n")
    stages = list(rows[0][1]["fw"])
    print("| backend | graph | " + " | ".join(f"{s} s" for s in stages) + " | passes CPU s |")
    print("|---|---|" + "---:|" * (len(stages) + 1))
    for name, times in rows:
        for kind in ("fw", "bw"):
            t = times[kind]
            print(f"| {name} | {kind} | " + " | ".join(f"{t[s]:.2f}" for s in stages)
                  + f" | {sum(t.values()):.2f} |")
    print()
    for name, times in rows:
        ours = traced.recompute_s + sum(sum(t.values()) for t in times.values())
        total = traced.trace_s + ours - traced.recompute_s
        print(f"{name}: our passes {ours:.1f} s of a {total:.1f} CPU s compile "
              f"({100 * ours / total:.0f} %)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
