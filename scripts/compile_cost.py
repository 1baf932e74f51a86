"""Where a first compile's time goes: CPU seconds of one forward + backward's compile of a small
Llama 3, plain against ``data_parallel``, under dynamo alone ("eager") and with aot_autograd.

    python scripts/compile_cost.py [--layers 4] [--backends eager aot_eager aot_eager_blockbucketing]

One process on a fake world of 2 (torch's fake process group: nothing is communicated, so
the figure is the compile alone), CPU time of this process (steadier than wall time on a busy
machine). A warm-up compile of a one-block model runs first, so that the one-off costs of a
process's first compile fall on none of the rows. The difference between the plain and the
data_parallel rows is what tracing the parameter reads costs (simplesharded/storage/gather.py: one
op per read in dynamo's graph, whose body runs on fake tensors there and is traced into
aten ops by aot_autograd).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

TORCH_BACKENDS = ("eager", "aot_eager", "inductor")  # torch's own: they compile a plain model too


def _model(layers: int):
    from simplesharded.models import build_model

    torch.manual_seed(0)
    return build_model("llama3", "debug", device="cpu", dim=64, n_layers=layers, n_heads=4,
                       n_kv_heads=2, vocab_size=64, multiple_of=32)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--backends", nargs="+",
                        default=["eager", "aot_eager", "aot_eager_blockbucketing"])
    args = parser.parse_args(argv)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    import simplesharded as ss

    x = torch.randint(0, 64, (2, 16))
    torch.compile(_model(1), backend="aot_eager", fullgraph=True)(x).sum().backward()
    params = sum(1 for _ in _model(args.layers).parameters())
    print(f"llama3 debug, {args.layers} blocks ({params} parameters), fake world of 2: CPU s "
          f"of the first forward + backward")
    print("| backend | plain | data_parallel | difference per parameter |")
    print("|---|---:|---:|---:|")
    for backend in args.backends:
        row = []
        for sharded in (False, True):
            if not sharded and backend not in TORCH_BACKENDS:
                row.append(None)  # our backends need a sharded model
                continue
            torch._dynamo.reset()
            model = _model(args.layers)
            if sharded:
                ss.data_parallel(model, ss.build_mesh(1, -1, "cpu"))
            be = backend if backend in TORCH_BACKENDS else ss.make_backend(backend)
            compiled = torch.compile(model, backend=be, fullgraph=True)
            t = time.process_time()
            compiled(x).sum().backward()
            row.append(time.process_time() - t)
        plain, sharded = row
        per = f"{(sharded - plain) / params:.3f}" if plain is not None else "–"
        print(f"| {backend} | {'–' if plain is None else f'{plain:.1f}'} | {sharded:.1f} | "
              f"{per} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
