"""Published peak matmul throughput per accelerator model and compute dtype, for MFU.

Dense figures (no structured sparsity) from the vendors' datasheets and whitepapers, per GPU;
where a datasheet prints only the with-sparsity figure, the dense one is half of it. ``tf32``
is an fp32 matmul on tensor cores (TF32 allowed), ``float32`` one without.

``peak_tflops("NVIDIA H100 PCIe", "bfloat16")`` → 756.5; ``None`` for a device or dtype not
listed, and for a MIG slice (a fraction of the GPU, which its name does not give).
"""
from __future__ import annotations

import re

_SXM_HOPPER = {"bfloat16": 989.4, "float16": 989.4, "tf32": 494.7, "float32": 66.9}
_PCIE_HOPPER = {"bfloat16": 756.5, "float16": 756.5, "tf32": 378.2, "float32": 51.2}
_NVL_HOPPER = {"bfloat16": 835.5, "float16": 835.5, "tf32": 417.5, "float32": 60.0}
_A100 = {"bfloat16": 312.0, "float16": 312.0, "tf32": 156.0, "float32": 19.5}
_MI300 = {"bfloat16": 1307.4, "float16": 1307.4, "tf32": 653.7, "float32": 163.4}

# {model: {form factor: {dtype: TFLOP/s}}}; "" is the form factor a name without one means
# (e.g. "NVIDIA H100 80GB HBM3" is the SXM part).
TFLOPS: dict[str, dict[str, dict[str, float]]] = {
    "A100": {"": _A100, "PCIE": _A100},  # SXM and PCIe share the datasheet figures
    "A800": {"": _A100, "PCIE": _A100},
    "H100": {"": _SXM_HOPPER, "PCIE": _PCIE_HOPPER, "NVL": _NVL_HOPPER},
    "H800": {"": _SXM_HOPPER, "PCIE": _PCIE_HOPPER},
    "H200": {"": _SXM_HOPPER, "NVL": _NVL_HOPPER},
    "GH200": {"": _SXM_HOPPER},
    "H20": {"": {"bfloat16": 148.0, "float16": 148.0, "tf32": 74.0, "float32": 44.0}},
    "L40S": {"": {"bfloat16": 362.05, "float16": 362.05, "tf32": 183.0, "float32": 91.6}},
    "B200": {"": {"bfloat16": 2250.0, "float16": 2250.0, "tf32": 1125.0, "float32": 75.0}},
    "MI300X": {"": _MI300},
    "MI325X": {"": _MI300},
}
FORM_FACTORS = ("PCIE", "NVL")
PEAK_KINDS = ("bfloat16", "float16", "tf32", "float32")


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """Dense peak TFLOP/s of the device ``device_name`` (as torch reports it) in ``dtype``
    (one of PEAK_KINDS), or None when not listed."""
    if dtype not in PEAK_KINDS:
        raise ValueError(f"dtype={dtype!r} is not one of {list(PEAK_KINDS)}")
    # Whole tokens: "H20" must not match "H200", nor "A100" "GA100".
    tokens = re.split(r"[^A-Z0-9]+", device_name.upper())
    if "MIG" in tokens:
        return None
    model = next((t for t in tokens if t in TFLOPS), None)
    if model is None:
        return None
    form = next((t for t in tokens if t in FORM_FACTORS), "")
    table = TFLOPS[model].get(form)
    return None if table is None else table.get(dtype)
