"""``python -m simplesharded.tools.report``: collectives per training step, per backend.

Compiles one forward+backward of a registry model wrapped by data_parallel on a fake process
group (no communication, one process) and counts the collectives in the forward and backward
graphs before our passes and after the last one, per process group (the mesh dim it serves:
dp_shard / dp_replicate for data parallelism, tp for tensor parallelism with ``--tp N``, ep
and efsdp for expert parallelism with ``--ep N``, whose all-to-alls have columns of their
own). Nothing runs: the backward graph is compiled with the forward (torch compiles it lazily
otherwise) and the compile stops once it has passed every pass, so no step computes on the
fake group's uninitialised results (an expert-parallel dispatch would read its split sizes
from them).
"""
from __future__ import annotations

import argparse
import contextlib
from collections import defaultdict

import torch

DEFAULT_BACKENDS = ("aot_eager", "aot_eager_blockbucketing", "aot_eager_autobucketing",
                    "aot_eager_upstreambucketing")


class _Compiled(Exception):
    """Raised by the observer once the backward graph is final: the compile is all we need."""


def trace_counts(model_name: str, flavor: str, backend: str, world_size: int = 2,
                 mode: str = "fully_shard", reshard_after_forward: bool | str = "auto",
                 seq_len: int = 64, n_layers: int | None = None, tp: int = 1,
                 sequence_parallel: bool = True, hardware: str = "local", ep: int = 1,
                 storage: str = "param", **backend_options) -> dict[str, dict[str, dict]]:
    """{"fw"|"bw": {"before"|"after": counts by kind, "groups_before"|"groups_after": counts
    by (group label, kind)}} for one compile; needs a (fake) process group of
    ``world_size`` = dp × tp ranks, ``ep`` of the dp ranks splitting the experts (a MoE
    model's). ``hardware``: the auto plan's profile (a fake process group has nothing to
    calibrate). ``storage``: data_parallel's; ``"param"`` by default, the storage whose
    collectives the bucketing passes bucket (ragged buckets arrive bucketed)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from simplesharded import data_parallel, disable_gather, make_backend
    from simplesharded.mesh import build_mesh, group_labels
    from simplesharded.models import build_model
    from simplesharded.trainer import apply_expert_parallel

    from simplesharded.passes.collectives import count_by_group, count_collectives
    from simplesharded.passes.pipeline import LAST_STAGE

    seen: dict[str, dict[str, dict]] = defaultdict(dict)
    torch.manual_seed(0)
    model = build_model(model_name, flavor, device="meta",
                        **({"n_layers": n_layers} if n_layers else {}))
    mesh = build_mesh(2 if mode == "hybrid_shard" else 1, -1, "cpu", tp, ep)
    labels = group_labels(mesh)

    def observe(kind, stage, gm):
        if kind in ("fw", "bw"):
            seen[kind].setdefault("before", count_collectives(gm))
            seen[kind]["after"] = count_collectives(gm)
            seen[kind].setdefault("groups_before", count_by_group(gm, labels))
            seen[kind]["groups_after"] = count_by_group(gm, labels)
            if kind == "bw" and stage == LAST_STAGE:
                raise _Compiled

    if tp > 1:
        model.args.check_tp(tp)
        parallelize_module(model, mesh["tp"], model.tp_styles(sequence_parallel))
    if ep > 1:
        if not hasattr(model, "ep_styles"):
            raise ValueError(f"--ep {ep} needs a model with routed experts (deepseek_v3), "
                             f"not {model_name}")
        model.args.check_ep(ep)
        apply_expert_parallel(model, mesh)
    data_parallel(model, mesh, mode, reshard_after_forward=reshard_after_forward,
                  storage=storage)
    with disable_gather(model):
        model.init_weights(buffer_device=torch.device("cpu"))
    compiled = torch.compile(model, fullgraph=True,
                             backend=make_backend(backend, observer=observe, hardware=hardware,
                                                  **backend_options))
    tokens = torch.randint(0, 256, (1, seq_len))
    from simplesharded.models.ep_dispatch import ep_compile_config

    scoped = ep_compile_config() if ep > 1 else contextlib.nullcontext()
    try:
        with scoped, torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            compiled(tokens)
    except Exception:  # dynamo wraps _Compiled in its own error
        if "after" not in seen.get("bw", {}):
            raise
    return dict(seen)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3")
    ap.add_argument("--flavor", default="debug")
    ap.add_argument("--world-size", type=int, default=2, help="ranks: dp x tp")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (sequence "
                    "parallel on); the dp degree is world-size / tp")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel degree (MoE models: "
                    "--model deepseek_v3); the ep ranks are taken from dp_shard")
    ap.add_argument("--n-layers", type=int, default=None, help="override the flavor's depth")
    ap.add_argument("--mode", default="fully_shard",
                    choices=["replicate", "fully_shard", "hybrid_shard"])
    from simplesharded.sharding import RESHARD_BY_NAME

    ap.add_argument("--reshard", default="auto", choices=list(RESHARD_BY_NAME),
                    help="data_parallel's reshard_after_forward (auto, True, False)")
    ap.add_argument("--backends", nargs="+", default=list(DEFAULT_BACKENDS))
    ap.add_argument("--storage", default="param", choices=["param", "ragged", "auto"],
                    help="data_parallel's storage: param (default: one shard per parameter, "
                    "whose collectives the passes bucket), ragged (buckets arrive bucketed) "
                    "or auto (data_parallel's own default)")
    args = ap.parse_args(argv)
    if args.tp < 1 or args.world_size % args.tp:
        ap.error(f"--tp {args.tp} does not divide --world-size {args.world_size}")
    from simplesharded.tools.cluster_trace import fake_world

    try:
        with fake_world(args.world_size):
            rows = []
            for name in args.backends:
                torch._dynamo.reset()
                c = trace_counts(args.model, args.flavor, name, args.world_size, args.mode,
                                 RESHARD_BY_NAME[args.reshard], n_layers=args.n_layers,
                                 tp=args.tp, ep=args.ep, storage=args.storage)
                rows.append((name, c))
    except ValueError as e:
        print(f"error: {e}")
        return 2
    print(f"collectives per step: {args.model}/{args.flavor}, {args.mode}, "
          f"world {args.world_size} (dp {args.world_size // args.tp} x tp {args.tp}, "
          f"ep {args.ep} of the dp ranks), "
          f"reshard_after_forward={args.reshard}, storage={args.storage}; before our passes → after, per process group")
    ops = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
    heads = [f"{kind} {op}" for kind in ("fw", "bw") for op in ("AG", "RS", "AR", "A2A")]
    print(f"{'backend':32s} {'group':>12s} " + " ".join(f"{h:>9s}" for h in heads)
          + f" {'total':>11s}")
    for name, c in rows:
        groups = sorted({g for k in ("fw", "bw") for st in ("groups_before", "groups_after")
                         for g, _ in c[k][st]})
        for group in groups:
            def pair(kind, op, stage):
                return c[kind][f"groups_{stage}"].get((group, op), 0)
            cells, tb, ta = [], 0, 0
            for kind in ("fw", "bw"):
                for op in ops:
                    b, a = pair(kind, op, "before"), pair(kind, op, "after")
                    tb, ta = tb + b, ta + a
                    cells.append(f"{b}→{a}")
            print(f"{name:32s} {group:>12s} " + " ".join(f"{x:>9s}" for x in cells)
                  + f" {f'{tb}→{ta}':>11s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
