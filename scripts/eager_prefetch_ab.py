"""Eager step time with the prefetch of simplesharded/storage/prefetch.py on and off, side by
side in one run: Llama 3 (the bench's ``small`` flavor by default) fully sharded in ragged
buckets (the default storage), uncompiled, AdamW.

    python -m torch.distributed.run --nproc_per_node 2 scripts/eager_prefetch_ab.py \
        [--flavor small] [--seq-len 256] [--batch 4] [--steps 5] [--reps 3] [--ac]

Each repetition times ``--steps`` steps with prefetch on, then off (its two hooks patched to do
nothing, as tests/test_eager_prefetch.py does), each after one untimed step (the first forward
after a switch records the order), and prints both medians and their ratio; the last line is
the median of the repetitions' ratios. Loss values are the same either way (the test checks
bitwise). On CPU (gloo) a rank's gather runs on gloo's threads beside its compute; on a GPU
the gather runs on the collective stream under the previous bucket's kernels.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from unittest import mock

import torch
import torch.distributed as dist


@contextlib.contextmanager
def _prefetch_off():
    from simplesharded.storage import eager_reshard, prefetch

    off = lambda *args: None  # noqa: E731
    with mock.patch.object(prefetch.EagerPrefetch, "gathered", off), \
            mock.patch.object(prefetch.EagerPrefetch, "recomputed", off), \
            mock.patch.object(eager_reshard, "prefetch", off):
        yield


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="small")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ac", action="store_true",
                        help="every block under activation checkpointing (backward's gathers "
                             "are its recomputes')")
    args = parser.parse_args(argv)

    import simplesharded as ss
    from simplesharded.models import build_model

    mesh = ss.init_mesh(dp_shard=-1)
    rank, device = dist.get_rank(), mesh.device_type
    torch.manual_seed(0)
    model = build_model("llama3", args.flavor, device=device)
    if args.ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import \
            checkpoint_wrapper

        for name, block in list(model.layers.named_children()):
            model.layers.register_module(name, checkpoint_wrapper(block))
    model = ss.data_parallel(model, mesh, mode="fully_shard")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.args.vocab_size
    g = torch.Generator().manual_seed(rank)

    def step() -> float:
        tokens = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=g).to(device)
        loss = torch.nn.functional.cross_entropy(
            model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device != "cpu":
            torch.accelerator.synchronize()
        return loss.item()

    def timed() -> float:
        step()  # the first forward after a switch records the order
        times = []
        for _ in range(args.steps):
            dist.barrier()
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    ratios = []
    for rep in range(args.reps):
        on = timed()
        with _prefetch_off():
            off = timed()
        ratios.append(on / off)
        if rank == 0:
            print(f"rep {rep + 1}: on {on * 1e3:.0f} ms, off {off * 1e3:.0f} ms, "
                  f"on/off {on / off:.3f}", flush=True)
    if rank == 0:
        print(f"llama3/{args.flavor}{' under full AC' if args.ac else ''}, "
              f"{dist.get_world_size()} ranks ({device}), "
              f"{args.batch} x {args.seq_len} tokens per rank: median on/off "
              f"{statistics.median(ratios):.3f} over {args.reps} reps")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
