"""``python -m simplesharded.tools.bench_moe``: one 16B-shaped MoE layer (dim 2048, 64 routed experts
of width 1408, top 6, 2 shared), forward + backward, with the routed experts run each way
(MoEArgs.experts_impl): "bmm", every expert on all T tokens (the old dropless form), and
"sorted", each expert on its routed rows only. Prints the step's matmul FLOPs (counted by
torch's FlopCounterMode on an eager step, which knows our expert_mm op) and the median
wall and process CPU time of --reps steps after a warm-up (CPU time is steadier where other
work shares the cores; with 2 threads on 2 cores it is ~2x the wall time).

Same weights, same input, same routing for every path; the outputs are compared too.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from simplesharded.models.moe import MoE, MoEArgs

SHAPE_16B = dict(dim=2048, moe_hidden_dim=1408, n_routed_experts=64, top_k=6, n_shared_experts=2)


def step(moe: MoE, x: torch.Tensor, cot: torch.Tensor):
    """Forward + backward of the layer; returns the output (for the cross-check)."""
    moe.zero_grad(set_to_none=True)
    x.grad = None
    y = moe(x)
    y.backward(cot)
    return y.detach()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--impls", nargs="+", default=["bmm", "sorted"])
    p.add_argument("--reps", type=int, default=2, help="timed steps per path, after 1 warm-up")
    p.add_argument("--compile", default="", help="a torch.compile backend (default: eager)")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype)

    torch.manual_seed(0)
    base = MoEArgs(n_heads=16, n_kv_heads=16, **SHAPE_16B)
    moe = MoE(base)
    moe.init_weights(out_std=0.02)
    moe.to(dtype).train()
    x = torch.randn(1, a.tokens, base.dim, dtype=dtype, requires_grad=True)
    cot = torch.randn_like(x)

    results, outputs = {}, {}
    for impl in a.impls:
        moe.args = dataclasses.replace(base, experts_impl=impl)
        with FlopCounterMode(display=False) as counter:  # eager: the compiled step runs the same ops
            outputs[impl] = step(moe, x, cot)
        flops = counter.get_total_flops()
        torch._dynamo.reset()
        fn = torch.compile(moe, backend=a.compile, fullgraph=True) if a.compile else moe
        t0 = time.perf_counter()
        step(fn, x, cot)  # warm-up (and compile)
        first = time.perf_counter() - t0
        wall, cpu = [], []
        for _ in range(a.reps):
            t0, c0 = time.perf_counter(), time.process_time()
            step(fn, x, cot)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        s, c = statistics.median(wall), statistics.median(cpu)
        results[impl] = dict(step_s=s, cpu_s=c, first_step_s=first, flops=flops,
                             tflops_per_s=flops / s / 1e12, wall_s=wall, process_cpu_s=cpu,
                             expert_passes_per_token=moe.expert_passes_per_token())
        print(f"{impl:7s} step {s:7.2f} s wall, {c:7.2f} s CPU (first {first:6.2f} s)  "
              f"{flops / 1e12:7.3f} TFLOP/step  {flops / s / 1e9:6.1f} GFLOP/s  "
              f"expert passes/token {moe.expert_passes_per_token():g}", flush=True)
    ref = outputs[a.impls[0]].double()
    for impl in a.impls[1:]:
        err = ((outputs[impl].double() - ref).norm() / ref.norm()).item()
        print(f"{impl} vs {a.impls[0]}: relative output difference {err:.1e}")
    if len(a.impls) > 1:
        r0, r1 = results[a.impls[0]], results[a.impls[-1]]
        print(f"{a.impls[-1]} / {a.impls[0]}: FLOPs {r1['flops'] / r0['flops']:.3f}, "
              f"step time {r1['step_s'] / r0['step_s']:.3f}, CPU time {r1['cpu_s'] / r0['cpu_s']:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), shape=SHAPE_16B, torch=torch.__version__,
                           threads=torch.get_num_threads(), results=results), f, indent=1)


if __name__ == "__main__":
    main()
