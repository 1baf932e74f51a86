"""``python -m simplesharded.passes.report``: collectives per training step, per backend.

Traces one forward+backward of a registry model wrapped by data_parallel on a fake process
group (no communication, one process) and counts the collectives in the forward and backward
graphs before our passes and after the last one.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch
import torch.distributed as dist

DEFAULT_BACKENDS = ("aot_eager", "aot_eager_blockbucketing", "aot_eager_autobucketing",
                    "aot_eager_upstreambucketing")


def trace_counts(model_name: str, flavor: str, backend: str, world_size: int = 2,
                 mode: str = "fully_shard", reshard_after_forward: bool | str = "auto",
                 seq_len: int = 64, n_layers: int | None = None, **backend_options) -> dict[str, dict[str, dict[str, int]]]:
    """{"fw"|"bw": {"before"|"after": counts}} for one compile; needs a (fake) process group."""
    from simplesharded import data_parallel, disable_gather, make_backend
    from simplesharded.mesh import build_mesh
    from simplesharded.models import build_model

    from .collectives import count_collectives

    seen: dict[str, dict[str, dict[str, int]]] = defaultdict(dict)

    def observe(kind, stage, gm):
        if kind in ("fw", "bw"):
            seen[kind].setdefault("before", count_collectives(gm))
            seen[kind]["after"] = count_collectives(gm)

    torch.manual_seed(0)
    model = build_model(model_name, flavor, device="meta",
                        **({"n_layers": n_layers} if n_layers else {}))
    mesh = build_mesh(2 if mode == "hybrid_shard" else 1, -1, "cpu")
    data_parallel(model, mesh, mode, reshard_after_forward=reshard_after_forward)
    with disable_gather(model):
        model.init_weights(buffer_device=torch.device("cpu"))
    compiled = torch.compile(model, fullgraph=True,
                             backend=make_backend(backend, observer=observe, **backend_options))
    tokens = torch.randint(0, 256, (1, seq_len))
    compiled(tokens).float().sum().backward()
    return dict(seen)


def fake_world(world_size: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3")
    ap.add_argument("--flavor", default="debug")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--n-layers", type=int, default=None, help="override the flavor's depth")
    ap.add_argument("--mode", default="fully_shard",
                    choices=["replicate", "fully_shard", "hybrid_shard"])
    from simplesharded.sharding import RESHARD_BY_NAME

    ap.add_argument("--reshard", default="auto", choices=list(RESHARD_BY_NAME),
                    help="data_parallel's reshard_after_forward (auto, True, False)")
    ap.add_argument("--backends", nargs="+", default=list(DEFAULT_BACKENDS))
    args = ap.parse_args(argv)
    fake_world(args.world_size)
    try:
        rows = []
        for name in args.backends:
            torch._dynamo.reset()
            c = trace_counts(args.model, args.flavor, name, args.world_size, args.mode,
                             RESHARD_BY_NAME[args.reshard], n_layers=args.n_layers)
            rows.append((name, c))
    finally:
        dist.destroy_process_group()
    print(f"collectives per step: {args.model}/{args.flavor}, {args.mode}, "
          f"world {args.world_size}, reshard_after_forward={args.reshard}")
    print(f"{'backend':32s} {'fw AG':>11s} {'bw AG':>11s} {'bw RS':>11s} {'bw AR':>11s} {'total':>13s}")
    for name, c in rows:
        def pair(kind, op):
            return f"{c[kind]['before'][op]}→{c[kind]['after'][op]}"
        total_b = sum(sum(c[k]["before"].values()) for k in ("fw", "bw"))
        total_a = sum(sum(c[k]["after"].values()) for k in ("fw", "bw"))
        print(f"{name:32s} {pair('fw', 'all_gather'):>11s} {pair('bw', 'all_gather'):>11s} "
              f"{pair('bw', 'reduce_scatter'):>11s} {pair('bw', 'all_reduce'):>11s} "
              f"{f'{total_b}→{total_a}':>13s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
