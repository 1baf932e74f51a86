"""Step metrics: loss, grad norm, lr, tokens/s, MFU, memory; printed, JSONL, TensorBoard."""
from __future__ import annotations

import functools
import json
import os
import resource
import time
from dataclasses import dataclass, field

import torch

from simplesharded.calibration import matmul_kind
from simplesharded.trainer import device_peaks


def _device_type(device) -> str:
    return torch.device(device).type


def peak_flops(device, configured_tflops: float = 0.0, dtype: str = "bfloat16") -> float:
    """Peak FLOP/s of one device for matmuls in ``dtype`` (training.mixed_precision_param),
    as torchtitan counts MFU: the configured value, else the published dense figure of a
    known accelerator (simplesharded/trainer/device_peaks.py) for what the matmuls run as
    (simplesharded/calibration.py's matmul_kind: bf16's peak for bfloat16, TF32's for float32
    with TF32 allowed, plain fp32's otherwise), else 0 (unknown: no MFU)."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    kind = _device_type(device)
    module = getattr(torch, kind, None)
    if kind == "cpu" or not hasattr(module, "get_device_name"):
        return 0.0
    tflops = device_peaks.peak_tflops(module.get_device_name(), matmul_kind(dtype, device))
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


@functools.lru_cache(maxsize=None)
def device_memory_bytes(device) -> int:
    """The memory of accelerator ``device`` (its current one when it has no index), bytes;
    0 when the device does not say."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.accelerator.current_device_index()
    module = getattr(torch, device.type, None)
    try:
        return int(module.get_device_properties(index).total_memory)
    except (AttributeError, RuntimeError, AssertionError):
        pass
    try:
        return int(torch.accelerator.get_memory_info(index)[1])
    except (AttributeError, RuntimeError):
        return 0


def memory_stats(device) -> dict[str, float]:
    """Accelerator, as torchtitan reports it: the caching allocator's peaks since the last
    reset_peak_memory, in GiB and % of the device's memory: ``mem_max_active`` (blocks in
    use, the tensors' memory), ``mem_max_reserved`` (what the allocator holds from the device,
    what runs out first); ``mem_max_allocated_gib`` beside them, and
    ``mem_alloc_retries`` (a cudaMalloc that failed, the cache flushed, retried: memory is
    fragmented or nearly full). CPU: peak resident set size of this process, GiB."""
    if _device_type(device) == "cpu":
        return {"mem_peak_rss_gib": _rss_peak_bytes() / 2**30}
    stats = torch.accelerator.memory_stats()
    allocated = torch.accelerator.max_memory_allocated()
    active = stats.get("active_bytes.all.peak", allocated)
    reserved = torch.accelerator.max_memory_reserved()
    out = {"mem_max_active_gib": active / 2**30, "mem_max_reserved_gib": reserved / 2**30,
           "mem_max_allocated_gib": allocated / 2**30,
           "mem_alloc_retries": float(stats.get("num_alloc_retries", 0))}
    total = device_memory_bytes(device)
    if total:
        out.update(mem_max_active_pct=100 * active / total,
                   mem_max_reserved_pct=100 * reserved / total)
    return out


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
    if "mem_max_reserved_gib" in r:
        pct = "mem_max_reserved_pct" in r
        parts.append(f"memory active {r['mem_max_active_gib']:.2f}GiB"
                     + (f" ({r['mem_max_active_pct']:.1f}%)" if pct else "")
                     + f" reserved {r['mem_max_reserved_gib']:.2f}GiB"
                     + (f" ({r['mem_max_reserved_pct']:.1f}%)" if pct else ""))
        if r.get("mem_alloc_retries"):
            parts.append(f"alloc retries {r['mem_alloc_retries']:.0f}")
    elif "mem_peak_rss_gib" in r:
        parts.append(f"rss {r['mem_peak_rss_gib']:.2f}GiB")
    return "  ".join(parts)
