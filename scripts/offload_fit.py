"""The largest Llama 3 the planner predicts trains on one GPU, without and with host offload.

    python scripts/offload_fit.py [--hardware h100-ib400] [--host-memory-gib N]

For the widths of Llama 3 8B and 70B (configs/llama3_8b.toml, configs/llama3_70b.toml; 70B at
tensor parallel degree 1) at any depth (``model.n_layers``): world size 1, one sequence of the
config's ``seq_len`` per step (no gradient accumulation), the config's activation
checkpointing, compile backend and memory cap. Each flavor is traced once at 4 and at 6 blocks
(``python -m simplesharded.tools.forecast``'s extrapolation in depth); every depth and every
offload is read off those traces (the trace leaves offload out: simplesharded/tools/
offload_cost.py). A depth fits when the predicted peak is within the trainer's
MEMORY_HEADROOM of the profile's device memory and, given --host-memory-gib, what offload
keeps on the host is within that.

Model TFLOP/s: 6 x parameters x tokens / step, the matmul FLOPs of forward and backward
without attention's score products or activation checkpointing's recompute (the usual
"model FLOPs"); the figure ZeRO-Offload's paper quotes per GPU is of that kind.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # this checkout, installed or not
    sys.path.insert(0, str(ROOT))
FLAVORS = {"8B": "configs/llama3_8b.toml", "70B": "configs/llama3_70b.toml"}
# One GPU: no tensor parallelism, one sequence per step
ONE_GPU = ["--parallelism.tensor_parallel_degree", "1",
           "--training.gradient_accumulation_steps", "1", "--training.global_batch_size", "1"]
# Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX ATC 2021
ZERO_OFFLOAD = ("ZeRO-Offload (Ren et al., USENIX ATC 2021): models of up to 13B parameters "
                "trained on a single NVIDIA V100 32GB; 40 TFLOP/s on that single V100 for a 10B "
                "model (30 TFLOP/s for PyTorch alone, which fits 1.4B)")


def main(argv=None) -> int:
    from simplesharded.passes.hardware import get_hardware
    from simplesharded.storage.offload import OFFLOADS
    from simplesharded.tools import forecast
    from simplesharded.tools.cluster_trace import host_memory
    from simplesharded.trainer import check_static
    from simplesharded.trainer.config import MEMORY_HEADROOM, load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="h100-ib400")
    ap.add_argument("--host-memory-gib", type=float, default=0.0,
                    help="host memory offload may fill (0: not bounded)")
    ap.add_argument("--max-layers", type=int, default=1024, help="deepest depth tried")
    ap.add_argument("--flavors", nargs="+", default=list(FLAVORS), choices=list(FLAVORS))
    args = ap.parse_args(argv)
    hw = get_hardware(args.hardware)
    room = MEMORY_HEADROOM * hw.memory_bytes
    host_room = args.host_memory_gib * 2**30 or float("inf")
    bound = (f"{args.host_memory_gib:g} GiB" if args.host_memory_gib else "not bounded")
    print(f"one {hw.name} GPU ({hw.memory_bytes / 2**30:.0f} GiB; fits: peak within "
          f"{MEMORY_HEADROOM:.0%}, {room / 2**30:.1f} GiB), host memory {bound}; host link "
          f"{hw.host_link_Bps / 1e9:g} GB/s, host optimizer {hw.host_mem_bw_Bps / 1e9:g} GB/s\n")
    print("| widths | offload | n_layers | params | peak GiB | host GiB | step s | tokens/s | "
          "model TFLOP/s | fits |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for flavor in args.flavors:
        cfg = load_config(str(ROOT / FLAVORS[flavor]), ONE_GPU)
        cfg.training.dataset_path = ""  # nothing is read
        cfg = check_static(cfg, 1)
        backend = (forecast.forecast_backend(cfg.compile.backend) if cfg.compile.enable
                   else "aot_eager")
        ns = argparse.Namespace(world_size=1, hardware=args.hardware)
        cap = int(cfg.compile.memory_cap_mb * 2**20) or None
        evaluated, keeps = forecast.evaluate_backends(cfg, ns, hw, cap, [backend], [4, 6])
        runs = evaluated[keeps[backend]]
        depth = cfg.model.spec()[1].n_layers
        tokens = cfg.training.local_batch_size * cfg.training.seq_len
        for offload in OFFLOADS:
            c = copy.deepcopy(cfg)
            c.parallelism.offload = offload

            def at(n: int) -> dict:
                m = forecast._numbers(backend, runs, n)
                peak = sum(forecast.device_memory(m, c))
                host = host_memory(m["local_numel"], c.optimizer.name, offload)
                return {"n": n, "params": m["local_numel"], "peak": peak, "host": host,
                        "step": forecast.step_seconds(m, c, hw),
                        "fits": peak <= room and host <= host_room}

            fitting = [n for n in range(1, args.max_layers + 1) if at(n)["fits"]]
            shown = [at(depth)]
            if fitting and max(fitting) != depth:
                shown.append(at(max(fitting)))
            for r in shown:
                deepest = r["n"] == args.max_layers
                print(f"| {flavor} | {offload} | {r['n']}{'+' if deepest else ''} | "
                      f"{r['params'] / 1e9:.1f}B | {r['peak'] / 2**30:.1f} | "
                      f"{r['host'] / 2**30:.0f} | {r['step']:.2f} | {tokens / r['step']:,.0f} | "
                      f"{6 * r['params'] * tokens / r['step'] / 1e12:.0f} | "
                      f"{'yes' if r['fits'] else 'NO'} |")
            if not fitting:
                print(f"| {flavor} | {offload} | – | no depth fits | | | | | | |")
    print(f"\n{ZERO_OFFLOAD}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
