"""A DCP checkpoint of the trainer to a Hugging Face model directory: ``config.json`` plus
``model-0000i-of-0000n.safetensors`` and their index, which ``transformers``'
``AutoModelForCausalLM.from_pretrained`` loads.

    python -m simplesharded.trainer.export --folder CKPT --step N --to DIR [--dtype bfloat16]

The model comes from the ``model.json`` the trainer writes into every checkpoint
(checkpoint.model_meta): our ``llama3`` is renamed and converted to transformers' Llama,
``hf_llama`` and Hugging Face models keep their names. One process, no process group: the
tensors of one output file are read from the checkpoint's shard files together (one
``dcp.load``; DCP reads only their byte ranges; the checkpoint's metadata is read once for
all files) and written, so at most one output file's tensors (``--max-shard-mb``) are in
memory at once, never the whole model.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp

from simplesharded.trainer.checkpoint import MODEL_JSON, complete_steps, step_dir
from simplesharded.trainer.config import DTYPE_NAMES



@dataclass
class Tensor:
    """One output tensor: its Hugging Face name, the checkpoint key it comes from, and how
    its values are converted (identity for most)."""
    name: str
    key: str
    shape: tuple[int, ...]
    convert: Callable[[torch.Tensor], torch.Tensor] = lambda t: t


def _rope_to_half(n_heads: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows of a q/k projection from our RoPE layout (adjacent pairs rotate together, as
    Meta's checkpoints) to transformers' (the first and second half of each head rotate
    together): within each head, the even rows then the odd rows."""
    def convert(w: torch.Tensor) -> torch.Tensor:
        rows, cols = w.shape
        return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
    return convert


_LLAMA3_NAMES = {  # our llama3's per-block names -> transformers' Llama
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}


def _llama3_hf_layout(args: dict, shapes: dict[str, tuple]) -> tuple[dict, list[Tensor]]:
    from simplesharded.models.hf_llama import llama_config
    from simplesharded.models.llama3 import Llama3Args

    a = Llama3Args(**args)
    fixed = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight":
             "model.norm.weight", "output.weight": "lm_head.weight"}
    out = []
    for fqn, shape in shapes.items():
        if fqn in fixed:
            out.append(Tensor(fixed[fqn], fqn, shape))
            continue
        _, layer, rest = fqn.split(".", 2)  # layers.<i>.<rest>
        if not fqn.startswith("layers.") or rest not in _LLAMA3_NAMES:
            raise ValueError(f"export: llama3 parameter {fqn!r} has no transformers name")
        t = Tensor(f"model.layers.{layer}.{_LLAMA3_NAMES[rest]}", fqn, shape)
        if rest == "attention.wq.weight":
            t.convert = _rope_to_half(a.n_heads)
        elif rest == "attention.wk.weight":
            t.convert = _rope_to_half(a.n_kv_heads)
        out.append(t)
    return llama_config(a).to_dict(), out


def hf_layout(meta: dict, shapes: dict[str, tuple]) -> tuple[dict, list[Tensor]]:
    """(transformers config dict, output tensors) for the model ``meta`` describes
    (checkpoint.model_meta) with parameter shapes ``shapes`` (FQN -> global shape)."""
    if "hf_config" in meta:  # a transformers model: its names already are Hugging Face's
        return meta["hf_config"], [Tensor(k, k, s) for k, s in shapes.items()]
    name = meta.get("name")
    if name == "hf_llama":
        from simplesharded.models.hf_llama import llama_config
        from simplesharded.models.llama3 import Llama3Args

        return (llama_config(Llama3Args(**meta["args"])).to_dict(),
                [Tensor(k, k, s) for k, s in shapes.items()])
    if name == "llama3":
        return _llama3_hf_layout(meta["args"], shapes)
    raise ValueError(f"export: model {name!r} has no Hugging Face counterpart here "
                     "(llama3, hf_llama and model.name=hf models export)")


def _shard(tensors: list[Tensor], nbytes: Callable[[Tensor], int], limit: int) -> list[list]:
    """Consecutive tensors grouped into files of at most ``limit`` bytes (a larger tensor
    gets a file of its own)."""
    files, size = [[]], 0
    for t in tensors:
        if files[-1] and size + nbytes(t) > limit:
            files.append([])
            size = 0
        files[-1].append(t)
        size += nbytes(t)
    return files


class _Reader(dcp.FileSystemReader):
    """The checkpoint's reader, its metadata read once: every ``dcp.load`` asks for it, and
    with optimizer state it can be large."""

    def __init__(self, path: str):
        super().__init__(path)
        self.metadata = super().read_metadata()

    def read_metadata(self, *args, **kwargs):
        return self.metadata


def export(folder: str, step: int, to: str, dtype: str | None = None,
           max_shard_bytes: int = 2 << 30) -> list[str]:
    """Write step ``step`` of the checkpoints in ``folder`` to ``to`` (module doc); returns
    the files written. ``dtype``: one of config.DTYPE_NAMES, default the checkpoint's."""
    from safetensors.torch import save_file


    path = step_dir(folder, step)
    if step not in complete_steps(folder):
        raise ValueError(f"export --step {step}: no complete checkpoint at {path!r}; "
                         f"available steps: {complete_steps(folder)}")
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ValueError(f"export --dtype {dtype!r} is not one of {sorted(DTYPE_NAMES)}")
    try:
        with open(os.path.join(path, MODEL_JSON)) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"export: {path!r} has no {MODEL_JSON} (saved by an older trainer): "
                         "the model it holds is unknown") from None
    reader = _Reader(path)
    saved = reader.metadata.state_dict_metadata
    shapes = {k[len("model."):]: tuple(v.size) for k, v in saved.items()
              if k.startswith("model.") and hasattr(v, "size")}
    config, tensors = hf_layout(meta, shapes)
    out_dtype = getattr(torch, dtype) if dtype else None

    def dtype_of(t: Tensor) -> torch.dtype:
        return out_dtype or saved[f"model.{t.key}"].properties.dtype

    def nbytes(t: Tensor) -> int:
        return dtype_of(t).itemsize * torch.Size(t.shape).numel()

    os.makedirs(to, exist_ok=True)
    files = _shard(tensors, nbytes, max_shard_bytes)
    names, weight_map = [], {}
    for i, group in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        # One read of the checkpoint per output file: DCP reads only these tensors' byte
        # ranges. Each is converted as it is taken, so a file's tensors are in memory once
        # (plus one converted copy).
        bufs = {t.key: torch.empty(t.shape, dtype=saved[f"model.{t.key}"].properties.dtype)
                for t in group}
        dcp.load({"model": bufs}, storage_reader=reader, no_dist=True)
        values = {}
        for t in group:
            values[t.name] = t.convert(bufs.pop(t.key)).to(dtype_of(t)).contiguous()
            weight_map[t.name] = name
        save_file(values, os.path.join(to, name), metadata={"format": "pt"})
        names.append(name)
        del values
    total = sum(nbytes(t) for t in tensors)
    with open(os.path.join(to, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = dict(config, dtype=str(out_dtype or dtype_of(tensors[0])).removeprefix("torch."))
    with open(os.path.join(to, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return [*names, "model.safetensors.index.json", "config.json"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simplesharded.trainer.export",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--folder", required=True,
                    help="the checkpoint folder (job.dump_folder/checkpoint.folder)")
    ap.add_argument("--step", type=int, default=-1, help="-1: the newest complete step")
    ap.add_argument("--to", required=True, help="output directory")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPE_NAMES),
                    help="output dtype (default: the checkpoint's)")
    ap.add_argument("--max-shard-mb", type=int, default=2048,
                    help="largest output file (the most tensor bytes in memory at once)")
    ns = ap.parse_args(argv)
    step = ns.step
    if step == -1:
        steps = complete_steps(ns.folder)
        if not steps:
            ap.error(f"--folder {ns.folder!r} holds no complete checkpoint")
        step = steps[-1]
    try:
        written = export(ns.folder, step, ns.to, ns.dtype, ns.max_shard_mb << 20)
    except (ValueError, ImportError) as e:
        ap.error(str(e))
    print(f"exported step {step} of {ns.folder} to {ns.to}: {', '.join(written)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
