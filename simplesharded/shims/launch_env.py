"""The environment run_train.sh starts its ranks with (simplesharded/trainer/launch.py sets it
before torchrun starts them), the bench's and calibration's too. A variable the user already
set always wins.

- CPU ranks (gloo): the caching malloc of :mod:`simplesharded.shims.host_malloc`; one share of the
  cores each (``OMP_NUM_THREADS``); ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, so that ranks
  restarted by ``torchrun --max-restarts`` do not reuse the dead workers' store (gloo hangs
  on it otherwise). Only on CPU: it opens a second store on a random port, which firewalled
  clusters block.
- Accelerator ranks: ``PYTORCH_ALLOC_CONF=expandable_segments:True``. Bucketing makes
  buffers of many sizes; expandable segments let the caching allocator grow one mapping
  instead of fragmenting into fixed segments (torchtitan's default for the same reason).
  ``OMP_NUM_THREADS`` gets the same share of the cores as on CPU (torchrun would set 1).
"""
from __future__ import annotations

import os

from simplesharded.shims.host_malloc import caching_env

ALLOC_CONF = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # the new name, the old one
SHARE_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def allocator_env(device: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The caching allocator's setting for ranks on ``device`` (an accelerator type):
    ``PYTORCH_ALLOC_CONF=expandable_segments:True``, unless ``environ`` (default: this
    process's) sets either name; nothing on CPU. For every launcher of accelerator ranks
    (run_train.sh, the bench, calibration, scripts/gpu_check.sh)."""
    environ = os.environ if environ is None else environ
    if device == "cpu" or any(k in environ for k in ALLOC_CONF):
        return {}
    return {ALLOC_CONF[0]: "expandable_segments:True"}


def launch_env(device: str, nproc: int, environ: dict[str, str] | None = None,
               cores: int | None = None) -> dict[str, str]:
    """What ranks of ``device`` ("cpu" or an accelerator type), ``nproc`` per node, need set,
    without the variables ``environ`` (default: this process's) already sets."""
    environ = os.environ if environ is None else environ
    cores = cores or os.cpu_count() or 1
    out = {"OMP_NUM_THREADS": str(max(1, cores // nproc))}
    if device == "cpu":
        out.update(caching_env(environ))
        out[SHARE_STORE] = "1"
    out.update(allocator_env(device, environ))
    return {k: v for k, v in out.items() if k not in environ or k == "GLIBC_TUNABLES"}
