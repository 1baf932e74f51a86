"""``python -m simplesharded.tools.bench``: our backends vs FSDP2, DDP and a compute floor.

Every variant trains the same model on the same synthetic batch in its own processes (CPU
ranks forked from a fork server that imported torch once, accelerator ranks spawned) and process
group; variants alternate within each repetition so drift hits all of them alike. Reported:
median step time, ratios, collectives per step counted at runtime from the process groups'
sequence numbers (the same way for eager and compiled variants), compile seconds (first step minus a steady step, first
repetition), peak tensor memory per rank (and the planner's prediction of it) and rank 0's losses of the first steps, which must agree across
variants (see bench_run.PARITY_STEPS): they compute the same thing or the comparison is void.

``--device cuda`` (or this machine's other accelerator type) runs rank r on device r mod the
devices present, with the process-group backend mesh.backend_for picks (NCCL for cuda); the
default ``cpu`` uses gloo.

``--cp N`` splits every sequence over N ranks (models/context_parallel.py's head-tail chunks,
K/V gathered over cp in attention) on a dp × cp mesh: our backends shard the parameters over
dp × cp, the floor is one dp rank's cp group; peak memory per rank shows what CP saves.

``--tp N`` runs every variant on a dp × tp mesh (tp innermost, as the trainer's): torch TP with
the model's tensor-parallel styles on ``mesh["tp"]`` first, then the variant's data parallelism
over the dp dims.
FSDP2 becomes the standard 2-D recipe (``fully_shard`` per block + root on ``mesh["dp_shard"]``)
and the floors keep their meaning with a tp group in place of a single rank.

This file is the command line and the order of the runs (variants alternate within each
repetition); what each variant runs is bench_variants.py, running and timing its ranks
bench_run.py, and the rows, table, parity and targets bench_table.py.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict

import torch

from simplesharded.passes.torch_compat import CONTEXT_PARALLEL, refusal
from simplesharded.tools.bench_run import RunResult, run_variant
from simplesharded.tools.bench_table import (FORECAST, forecast_peaks, format_table, parity,
                                             summarize, targets)
from simplesharded.tools.bench_variants import (BASELINES, CP_DEFAULT, NO_CP_FORM, NO_TP_FORM,
                                                TP_DEFAULT, BenchArgs, check_variant,
                                                default_variants, is_step_variant)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3")
    ap.add_argument("--flavor", default="small")
    ap.add_argument("--n-layers", type=_positive_int, default=None,
                    help="override the flavor's depth")
    ap.add_argument("--world-size", type=_positive_int, default=None,
                    help="ranks in all, dp × cp × tp (default on cpu: 2 × --cp × --tp, i.e. "
                         "dp 2; on an accelerator: one rank per device)")
    ap.add_argument("--tp", type=_positive_int, default=1,
                    help="tensor-parallel degree: every variant runs on a dp × tp mesh, torch "
                         "TP with the model's tensor-parallel styles first (default: 1, no TP)")
    ap.add_argument("--cp", type=_positive_int, default=1,
                    help="context-parallel degree: each sequence split over --cp ranks "
                         "(default: 1, no CP)")
    ap.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True,
                    help="with --tp > 1, shard activations between blocks on the sequence dim "
                         "(the trainer's default)")
    ap.add_argument("--loss-parallel", action=argparse.BooleanOptionalAction, default=True,
                    help="with --tp > 1, vocabulary-sharded logits and torch's loss_parallel "
                         "cross-entropy (the trainer's default)")
    ap.add_argument("--global-batch", type=_positive_int, default=8)
    ap.add_argument("--seq-len", type=_positive_int, default=256)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=_positive_int, default=20)
    ap.add_argument("--reps", type=_positive_int, default=3)
    ap.add_argument("--variants", nargs="+", default=None,
                    help="default: all of " + " ".join(BASELINES) + " ss_<every backend>; "
                         "with --tp > 1: " + " ".join(TP_DEFAULT) + "; with --cp > 1: "
                         + " ".join(CP_DEFAULT))
    from simplesharded.trainer import OPTIMIZER_IMPL
    ap.add_argument("--optimizer-impl", default="foreach", choices=list(OPTIMIZER_IMPL),
                    help="AdamW kernels, the same for every variant (default: foreach, as the "
                         "trainer's optimizer.implementation without offload)")
    ap.add_argument("--json", default=None, help="write rows and raw timings here")
    ap.add_argument("--device", default="cpu",
                    help="cpu: gloo ranks (default); cuda (this machine's accelerator type): "
                         "one device per rank, NCCL for cuda")
    ap.add_argument("--host-malloc", default="caching", choices=["caching", "system"],
                    help="CPU ranks' malloc: caching (default, as run_train.sh sets it: freed "
                         "memory is reused, not returned to the OS and page-faulted again next "
                         "step; simplesharded/shims/host_malloc.py) or system (glibc's defaults)")
    ap.add_argument("--predict-memory", action=argparse.BooleanOptionalAction, default=True,
                    help="also print the planner's predicted peak memory per rank for "
                         + " ".join(FORECAST) + " (a trace of the model, seconds to a minute)")
    ap.add_argument("--profile", default="", metavar="DIR",
                    help="write a torch.profiler chrome trace and op table per variant and rank")
    ns = ap.parse_args(argv)
    tp, cp = ns.tp, ns.cp
    accelerator = torch.accelerator.current_accelerator()
    if ns.device != "cpu" and getattr(accelerator, "type", None) != ns.device:
        ap.error(f"--device {ns.device}: this machine's accelerator is "
                 f"{getattr(accelerator, 'type', 'none')}; use cpu or that")
    # One device per rank: two NCCL ranks cannot share a GPU.
    devices = torch.accelerator.device_count() if ns.device != "cpu" else None
    world = ns.world_size or (devices if devices else 2 * cp * tp)
    if devices and world > devices:
        ap.error(f"--world-size {world}: this machine has {devices} {ns.device} device(s), "
                 f"one per rank")
    variants = ns.variants or default_variants(tp, cp)
    unknown = sorted(set(v for v in variants if check_variant(v)))
    if unknown:
        ap.error(f"--variants {unknown}: {check_variant(unknown[0])}")
    # compile_step takes TP, but the bench's step variant does not run TP's loss parallelism
    no_tp = sorted(v for v in variants if v in NO_TP_FORM or is_step_variant(v)) if tp > 1 else []
    if no_tp:
        ap.error(f"--variants {no_tp} have no tensor-parallel form; with --tp {tp} leave "
                 f"them out")
    no_cp = sorted(v for v in variants if v in NO_CP_FORM or is_step_variant(v)) if cp > 1 else []
    if no_cp:
        ap.error(f"--variants {no_cp} have no context-parallel form here; with --cp {cp} leave "
                 f"them out (choices: {' '.join(CP_DEFAULT)} and the other ss_ backends)")
    # the flags named as given: --cp only where it is set
    inner = f"--cp {cp} × --tp {tp}" if cp > 1 else f"--tp {tp}"
    if world % (cp * tp):
        ap.error(f"{inner} does not divide --world-size {world}")
    if ns.global_batch % (world // (cp * tp)):
        ap.error(f"--global-batch {ns.global_batch} is not divisible by the data-parallel "
                 f"degree {world // (cp * tp)} (--world-size {world} / "
                 + (f"({inner}))" if cp > 1 else f"{inner})"))
    if cp > 1 and ns.seq_len % (2 * cp * (tp if ns.sequence_parallel else 1)):
        ap.error(f"--seq-len {ns.seq_len} does not split into 2 × --cp {cp} equal chunks"
                 + (f" of a multiple of --tp {tp} tokens" if tp > 1 and ns.sequence_parallel
                    else "") + " (context parallelism's head-tail layout)")
    from simplesharded.models import MODELS, build_model, get_model_spec
    if ns.model not in MODELS:
        ap.error(f"--model {ns.model!r} is not one of {sorted(MODELS)}")
    if ns.flavor not in MODELS[ns.model][1]:
        ap.error(f"--flavor {ns.flavor!r} is not one of {sorted(MODELS[ns.model][1])} "
                 f"(--model {ns.model})")
    try:
        _, model_args = get_model_spec(ns.model, ns.flavor)
        if tp > 1:
            model_args.check_tp(tp)
        # on meta, i.e. no memory and no init: the depth override and a missing optional
        # dependency (hf_llama: transformers) fail here, once, not in every variant's ranks
        meta = build_model(ns.model, ns.flavor, device="meta",
                           **({"n_layers": ns.n_layers} if ns.n_layers else {}))
        from simplesharded.models.context_parallel import supports_context_parallel
        from simplesharded.models.hf_context_parallel import is_hf_model
        if cp > 1 and not (supports_context_parallel(type(meta)) or is_hf_model(meta)):
            raise ValueError(f"--cp {cp}: this model's attention does not run under context "
                             f"parallelism (llama3, deepseek_v3 and hf_llama do)")
    except (ValueError, ImportError) as e:
        ap.error(f"{e} (--model {ns.model} --flavor {ns.flavor} --tp {tp}"
                 + (f" --cp {cp})" if cp > 1 else ")"))
    if tp > 1 and ns.sequence_parallel and ns.seq_len % tp:
        ap.error(f"--tp {tp} does not divide --seq-len {ns.seq_len} (sequence parallelism "
                 f"splits the sequence; or --no-sequence-parallel)")
    lacks = refusal(CONTEXT_PARALLEL) if cp > 1 else None  # after the flags' own errors
    if lacks:
        ap.error(f"--cp {cp}: {lacks}")
    args = BenchArgs(model=ns.model, flavor=ns.flavor, n_layers=ns.n_layers, world_size=world,
                     tp=tp, cp=cp, sequence_parallel=ns.sequence_parallel,
                     loss_parallel=ns.loss_parallel, global_batch=ns.global_batch,
                     seq_len=ns.seq_len, warmup=ns.warmup, steps=ns.steps,
                     optimizer_impl=ns.optimizer_impl, profile_dir=ns.profile,
                     device=ns.device, host_malloc=ns.host_malloc)
    results: dict[str, list[RunResult]] = {v: [] for v in variants}
    for rep in range(ns.reps):
        for v in variants:
            t0 = time.time()
            r = run_variant(v, args)
            results[v].append(r)
            status = r.error or f"median {1e3 * statistics.median(r.step_s):.0f} ms"
            print(f"[rep {rep + 1}/{ns.reps}] {v}: {status} ({time.time() - t0:.0f}s)",
                  file=sys.stderr, flush=True)
    rows = summarize(results, args)
    planned = forecast_peaks(args, variants) if ns.predict_memory else {}
    for r in rows:
        if r["variant"] in planned:
            r["planned_mb"] = planned[r["variant"]]
    depth = f" ({args.n_layers} layers)" if args.n_layers else ""
    mesh = "".join(f" × {name} {n}" for name, n in (("cp", cp), ("tp", tp)) if n > 1)
    mesh = f" = dp {args.dp}{mesh}" if mesh else ""
    from simplesharded.mesh import backend_for
    print(f"\n{args.model}/{args.flavor}{depth}, {args.world_size} ranks{mesh} "
          f"({backend_for(args.device)}, {args.device}), "
          f"global batch {args.global_batch} × seq {args.seq_len}, fp32, AdamW "
          f"{args.optimizer_impl}, {args.steps} timed steps × {ns.reps} reps (median; a × column "
          f"is the median of each rep's ratio)"
          + (f", {args.host_malloc} malloc" if args.device == "cpu" else ""))
    if tp > 1:
        sp = ((", sequence parallel" if args.sequence_parallel else "")
              + (", loss parallel" if args.loss_parallel else ""))
        print(f"torch TP (parallelize_module, the model's styles{sp}) under every variant; "
              f"fsdp2_eager: fully_shard per block + root on the dp mesh; compute_floor: one tp "
              f"group ({tp} ranks) alone; compute_floor_concurrent: all {args.dp} tp groups at "
              f"once; neither floor communicates over dp")
    if cp > 1:
        print(f"context parallel: each sequence split over {cp} ranks (head-tail chunks, K/V "
              f"all-gathered in attention); our backends shard over dp × cp; compute_floor: "
              f"one dp rank's cp group ({cp * tp} ranks) without data parallelism")
    print()
    print(format_table(rows, args))
    print()
    agree, line = parity(rows)
    print(line)
    if tp == cp == 1:  # the targets are for 1-D FSDP
        for line in targets(rows):
            print(line)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"args": asdict(args), "rows": rows,
                       "raw": {v: [asdict(r) for r in rs] for v, rs in results.items()}}, f,
                      indent=1)
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
