"""Memory of one uncompiled training step per rank: data_parallel with reshard_after_forward
True / False / "auto" next to FSDP2 eager (``fully_shard`` per block + root), 2 gloo ranks.

    python scripts/eager_memory.py [--flavor small] [--batch 2] [--seq-len 256]

Per variant (fresh processes each) and rank, after one warm-up step: ``held`` is the resident
set after forward minus the one before it (what the autograd graph keeps for backward:
activations and, without reshard, gathered parameters), ``peak`` the highest resident set
during forward + backward minus the same baseline (the kernel's high-water mark, reset before
the step through /proc/self/clear_refs). glibc is told to serve every allocation above 64 KiB
with its own mmap (MALLOC_MMAP_THRESHOLD_), so a freed tensor leaves the resident set at once
and RSS follows live tensors. Linux only.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
from dist_utils import spawn  # noqa: E402  (gloo ranks in fresh processes)

VARIANTS = ("ss_reshard_true", "ss_reshard_false", "ss_reshard_auto", "fsdp2_eager")


def _rss_mb(key: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _job(rank, world, variant, flavor, batch, seq_len):
    import torch.nn.functional as F

    import simplesharded as ss
    from simplesharded.blocks import find_blocks
    from simplesharded.mesh import build_mesh
    from simplesharded.models import build_model, logits_of

    torch.manual_seed(0)
    model = build_model("llama3", flavor, device="cpu")
    mesh = build_mesh(1, world, "cpu")
    if variant == "fsdp2_eager":
        from torch.distributed.fsdp import fully_shard
        for _, block in find_blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        reshard = {"true": True, "false": False, "auto": "auto"}[variant.rsplit("_", 1)[1]]
        ss.data_parallel(model, mesh, reshard_after_forward=reshard)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, model.args.vocab_size, (batch, seq_len + 1), generator=g)

    def forward():
        logits = logits_of(model(tokens[:, :-1]))
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

    forward().backward()  # warm-up: gradients and every one-off buffer exist from here on
    for p in model.parameters():
        p.grad = None
    base = _rss_mb()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    loss = forward()
    held = _rss_mb() - base
    loss.backward()
    peak = _rss_mb("VmHWM") - base
    params = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    return dict(held=held, peak=peak, base=base, params_mb=params)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavor", default="small")
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = ap.parse_args(argv)
    env = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    print(f"llama3/{args.flavor}, 2 gloo ranks, {args.batch}x{args.seq_len} tokens per rank; "
          f"MB above the resident set before the step")
    print(f"{'variant':<18} {'rank':>4} {'held after fw':>14} {'peak fw+bw':>11}")
    for variant in args.variants:
        for rank, r in enumerate(spawn(2, _job, variant, args.flavor, args.batch,
                                       args.seq_len, env=env)):
            print(f"{variant:<18} {rank:>4} {r['held']:>14.1f} {r['peak']:>11.1f}")
    print(f"(full fp32 parameters: {r['params_mb']:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
