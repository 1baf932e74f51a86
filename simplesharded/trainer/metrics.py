"""Step metrics: loss, grad norm, lr, tokens/s, MFU, memory; printed, JSONL, TensorBoard."""
from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass, field

import torch

from simplesharded.trainer import device_peaks


def _device_type(device) -> str:
    return torch.device(device).type


def _fp32_matmul_dtype() -> str:
    """"tf32" when fp32 matmuls may run on tensor cores (their peak is then TF32's), else
    "float32". The per-backend setting wins over the global one when it is set."""
    setting = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")
    if setting in ("tf32", "ieee"):
        return "tf32" if setting == "tf32" else "float32"
    return "float32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def peak_flops(device, configured_tflops: float = 0.0, dtype: str = "bfloat16") -> float:
    """Peak FLOP/s of one device for matmuls in ``dtype`` (training.mixed_precision_param):
    the configured value, else the published dense figure of a known accelerator
    (simplesharded/trainer/device_peaks.py), else 0 (unknown: no MFU)."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    kind = _device_type(device)
    module = getattr(torch, kind, None)
    if kind == "cpu" or not hasattr(module, "get_device_name"):
        return 0.0
    if dtype == "float32":
        dtype = _fp32_matmul_dtype()
    tflops = device_peaks.peak_tflops(module.get_device_name(), dtype)
    return (tflops or 0.0) * 1e12


def throughput(tokens_per_step: int, step_s: float, world: int, flops_per_token: float,
               peak: float) -> dict[str, float]:
    """``tps``: tokens per second per device (torchtitan's figure: the step's tokens over the
    world, tp ranks sharing their dp rank's tokens); ``tokens_per_s_global``: all devices;
    ``tflops``: achieved model TFLOP/s per device; ``mfu_pct`` when the peak is known."""
    tps = tokens_per_step / step_s / world
    out = {"tps": tps, "tokens_per_s_global": tokens_per_step / step_s,
           "tflops": flops_per_token * tps / 1e12}
    if peak:
        out["mfu_pct"] = 100 * flops_per_token * tps / peak
    return out


def _rss_peak_bytes() -> int:
    """Peak resident set size: VmHWM (which reset_peak_memory can reset), else ru_maxrss."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_stats(device) -> dict[str, float]:
    """GiB. Accelerator: the allocator's peaks since the last reset_peak_memory, tensors
    allocated (the main figure) and memory reserved by the caching allocator; CPU: peak
    resident set size of this process."""
    if _device_type(device) != "cpu":
        return {"mem_max_allocated_gib": torch.accelerator.max_memory_allocated() / 2**30,
                "mem_max_reserved_gib": torch.accelerator.max_memory_reserved() / 2**30}
    return {"mem_peak_rss_gib": _rss_peak_bytes() / 2**30}


def reset_peak_memory(device) -> None:
    """Start the peaks memory_stats reports afresh, e.g. after the first step, so they are
    the steady-state step's and not compilation's or calibration's."""
    if _device_type(device) != "cpu":
        torch.accelerator.reset_peak_memory_stats()
        return
    try:  # Linux: "5" resets the peak RSS (VmHWM) to the current RSS
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass  # elsewhere the peak stays the process's


@dataclass
class MetricsLogger:
    """Rank-0 sink for step records. Other ranks get a logger with ``enabled=False``."""

    folder: str
    enabled: bool = True
    save_jsonl: bool = True
    tensorboard: bool = False
    _writer: object = field(default=None, repr=False)
    _jsonl: object = field(default=None, repr=False)

    def __post_init__(self):
        if not self.enabled:
            return
        os.makedirs(self.folder, exist_ok=True)
        if self.save_jsonl:
            self._jsonl = open(os.path.join(self.folder, "metrics.jsonl"), "a")
        if self.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ValueError("metrics.enable_tensorboard=True needs the tensorboard package:"
                                 " pip install tensorboard") from e
            self._writer = SummaryWriter(os.path.join(self.folder, "tb"))

    def log(self, step: int, record: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self._jsonl:
            self._jsonl.write(json.dumps({"step": step, "time": time.time(), **record}) + "\n")
            self._jsonl.flush()
        if self._writer:
            for k, v in record.items():
                self._writer.add_scalar(k, v, step)

    def close(self) -> None:
        for h in (self._jsonl, self._writer):
            if h is not None:
                h.close()


def format_record(step: int, r: dict[str, float]) -> str:
    parts = [f"step {step:>5d}", f"loss {r['loss']:.4f}", f"gnorm {r['grad_norm']:.3f}",
             f"lr {r['lr']:.2e}", f"tps {r['tps']:,.0f}"]
    if r.get("mfu_pct") is not None:
        parts.append(f"tflops {r['tflops']:.1f}  mfu {r['mfu_pct']:.1f}%")
    if "mem_max_allocated_gib" in r:
        parts.append(f"mem {r['mem_max_allocated_gib']:.2f}GiB "
                     f"(reserved {r['mem_max_reserved_gib']:.2f}GiB)")
    elif "mem_peak_rss_gib" in r:
        parts.append(f"rss {r['mem_peak_rss_gib']:.2f}GiB")
    return "  ".join(parts)
