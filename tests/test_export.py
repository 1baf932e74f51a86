"""`python -m simplesharded.trainer.export`: a trainer checkpoint to a Hugging Face model
directory that transformers loads, with the same logits as our model.

Why the logits must agree to 1e-5: the exported Llama computes the same function as our
llama3 (the q/k rows are permuted so transformers' half-split RoPE rotates the pairs our
adjacent-pair RoPE rotates; the values are exact copies), but its kernels differ in
summation order (RMSNorm in fp32 then cast, attention with repeated kv): rounding only.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from test_train_e2e import COMMON, PYTHON, ENV, run_ok, train_cmd

pytestmark = pytest.mark.slow


def _our_logits(ckpt_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    from simplesharded.models import build_model

    # the model the checkpoint's model.json describes (COMMON's shallower debug model)
    with open(os.path.join(ckpt_dir, "model.json")) as fh:
        n_layers = json.load(fh)["args"]["n_layers"]
    model = build_model("llama3", "debug", device="cpu", n_layers=n_layers)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=ckpt_dir, no_dist=True)
    model.load_state_dict(state["model"])
    with torch.no_grad():
        return model(tokens)


def test_llama3_checkpoint_exports_to_transformers_with_equal_logits(tmp_path):
    """Train llama3 debug 2 steps on 2 ranks with a checkpoint; export it in files of at most
    1 MB; transformers' AutoModelForCausalLM.from_pretrained gives our model's logits on a
    fixed batch (≤ 1e-5 rel); every file holds ≤ 1 MB unless a single tensor is larger."""
    import subprocess

    from transformers import AutoModelForCausalLM

    dump = tmp_path / "run"
    run_ok(train_cmd(2, *COMMON, "--training.steps", "2", "--checkpoint.enable",
                     "--checkpoint.interval", "2", "--job.dump_folder", str(dump)), tmp_path)
    folder, out = dump / "checkpoint", tmp_path / "hf"
    r = subprocess.run([PYTHON, "-m", "simplesharded.trainer.export", "--folder",
                        str(folder), "--to", str(out), "--max-shard-mb", "1"],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0 and "exported step 2" in r.stdout, r
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).exists() for f in files), files
    from safetensors import safe_open
    for f in files:
        with safe_open(str(out / f), "pt") as h:
            sizes = [h.get_slice(k).get_shape() for k in h.keys()]
        nbytes = [4 * torch.Size(s).numel() for s in sizes]
        assert sum(nbytes) <= 2**20 or len(nbytes) == 1, (f, nbytes)

    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    ours = _our_logits(str(folder / "step-2"), tokens)
    hf = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    with torch.no_grad():
        theirs = hf(tokens).logits
    rel = ((theirs - ours).abs().max() / ours.abs().max()).item()
    assert rel <= 1e-5, rel


def test_export_bad_input_is_one_line(tmp_path, capsys):
    """A folder without checkpoints and a bad --dtype: one `error:` line each, exit 2 (the
    command's own main, in this process: the real command runs in the test above)."""
    from simplesharded.trainer.export import main

    argv = ["--folder", str(tmp_path), "--to", str(tmp_path / "out")]
    for extra, want in (([], "holds no complete checkpoint"),
                        (["--dtype", "int8"], "--dtype")):
        with pytest.raises(SystemExit) as e:
            main([*argv, *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and err[-1].startswith(
            "python -m simplesharded.trainer.export: error: "), err
        assert want in err[-1] and "Traceback" not in "".join(err), err
    assert "bfloat16" in err[-1], err
