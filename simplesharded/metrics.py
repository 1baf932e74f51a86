"""Step metrics: loss, grad norm, lr, tokens/s, MFU, memory; printed, JSONL, TensorBoard."""
from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass, field

import torch

# Dense bf16 peak FLOP/s per device, for MFU when metrics.peak_tflops is 0 (auto).
_KNOWN_PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}


def peak_flops(device: str, configured_tflops: float = 0.0) -> float:
    """Peak FLOP/s of one device: the configured value, else a known GPU, else 0 (unknown)."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if device == "cuda":
        name = torch.cuda.get_device_name()
        for key, peak in _KNOWN_PEAKS.items():
            if key in name:
                return peak
    return 0.0


def memory_stats(device: str) -> dict[str, float]:
    """GiB: CUDA allocator peaks on GPU; peak resident set size of this process on CPU."""
    if device == "cuda":
        return {"mem_max_active_gib": torch.cuda.max_memory_allocated() / 2**30,
                "mem_max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    return {"mem_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


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
             f"lr {r['lr']:.2e}", f"tok/s {r['tokens_per_s']:,.0f}"]
    if r.get("mfu_pct") is not None:
        parts.append(f"mfu {r['mfu_pct']:.1f}%")
    mem = [v for k, v in r.items() if k.startswith("mem_")]
    if mem:
        parts.append(f"mem {max(mem):.2f}GiB")
    return "  ".join(parts)
