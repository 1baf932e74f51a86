"""Greedy ``generate()`` of a Hugging Face Llama under data_parallel, every forward gathering
against ``model.unshard()`` first (each parameter gathered once for the whole loop), next to
FSDP2 eager (``fully_shard`` per layer + root) the same two ways (its gather-once way: every
unit's ``unshard()`` with ``set_reshard_after_forward(False)``), 2 gloo ranks.

    python scripts/generate_unshard.py [--layers 4] [--hidden 256] [--new-tokens 32]

Per variant (fresh ranks each, one warm-up call), the best of 3 calls' wall time on rank 0,
the ratio to data_parallel gathering every forward, and whether the tokens equal one process's
unsharded model's (the same random weights on every rank). CPU, gloo: the ratios are what the
collectives cost against this machine's compute, not a GPU's.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
from dist_utils import spawn  # noqa: E402  (gloo ranks in fresh processes)

VARIANTS = ("ss_gather_each_forward", "ss_unshard", "fsdp2_gather_each_forward", "fsdp2_unshard")


def _model(layers: int, hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def _prompt():
    return torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(0))


def _generate(model, new_tokens: int):
    prompt = _prompt()
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens)


def _job(rank, world, variant, layers, hidden, new_tokens):
    from torch.distributed.device_mesh import init_device_mesh

    import simplesharded as ss

    model = _model(layers, hidden)
    mesh = init_device_mesh("cpu", (world,))
    if variant.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        units = [m for m in model.modules() if hasattr(m, "unshard") and hasattr(m, "reshard")]
    else:
        ss.data_parallel(model, mesh)
        units = [model]
    held = variant.endswith("unshard")

    def call():
        if held:  # FSDP2's unshard is per unit, and its forward reshards unless told not to
            for unit in units:
                if variant.startswith("fsdp2"):
                    unit.set_reshard_after_forward(False, recurse=False)
                unit.unshard()
        out = _generate(model, new_tokens)
        if held:
            for unit in units:
                unit.reshard()
                if variant.startswith("fsdp2"):
                    unit.set_reshard_after_forward(True, recurse=False)
        return out

    tokens = call()  # warm-up
    times = []
    for _ in range(3):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return tokens, min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    expected = _generate(_model(args.layers, args.hidden), args.new_tokens)
    rows = {v: spawn(2, _job, v, args.layers, args.hidden, args.new_tokens)[0]
            for v in VARIANTS}
    base = rows["ss_gather_each_forward"][1]
    print(f"generate {args.new_tokens} tokens, Llama {args.layers} layers x {args.hidden}, "
          f"2 gloo ranks (best of 3, rank 0)")
    print(f"{'variant':28} {'ms':>8} {'/ ss gathering':>15} {'tokens as 1 process':>20}")
    for v, (tokens, seconds) in rows.items():
        print(f"{v:28} {seconds * 1e3:8.0f} {seconds / base:15.2f} "
              f"{str(torch.equal(tokens, expected)):>20}")


if __name__ == "__main__":
    main()
