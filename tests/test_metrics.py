"""Step metrics (simplesharded/trainer/metrics.py, device_peaks.py) on CPU, the GPU paths with a mocked
device: the peak for MFU per GPU model, form factor and the dtype the matmuls run as (TF32's
for float32 with TF32 allowed); per-device tokens/s; the allocator's peaks (active and
reserved, GiB and % of the device) reset after the first step; the TensorBoard check of the
trainer's preflight."""
import os
from types import SimpleNamespace

import pytest
import torch

from simplesharded.trainer import device_peaks, metrics


@pytest.mark.parametrize("name,dtype,tflops", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4),   # the SXM part's name
    ("NVIDIA H100 PCIe", "bfloat16", 756.5),
    ("NVIDIA H100 NVL", "bfloat16", 835.5),
    ("NVIDIA H100 80GB HBM3", "tf32", 494.7),
    ("NVIDIA H100 80GB HBM3", "float32", 66.9),
    ("NVIDIA H100 PCIe", "float32", 51.2),
    ("NVIDIA H200", "bfloat16", 989.4),
    ("NVIDIA H200 NVL", "float16", 835.5),
    ("NVIDIA H800", "bfloat16", 989.4),
    ("NVIDIA H800 PCIe", "bfloat16", 756.5),
    ("NVIDIA H20", "bfloat16", 148.0),             # not H200's
    ("NVIDIA GH200 480GB", "bfloat16", 989.4),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312.0),
    ("NVIDIA A100-PCIE-40GB", "tf32", 156.0),
    ("NVIDIA A800-SXM4-80GB", "bfloat16", 312.0),
    ("NVIDIA L40S", "bfloat16", 362.05),
    ("NVIDIA B200", "bfloat16", 2250.0),
    ("AMD Instinct MI300X", "bfloat16", 1307.4),
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "bfloat16", None),  # a slice: its peak is unknown
    ("NVIDIA GeForce RTX 4090", "bfloat16", None),
    ("NVIDIA GA100", "bfloat16", None),             # whole tokens only
])
def test_published_peaks(name, dtype, tflops):
    assert device_peaks.peak_tflops(name, dtype) == tflops


def test_every_listed_device_has_every_dtype_dense():
    for model, forms in device_peaks.TFLOPS.items():
        for form, table in forms.items():
            assert set(table) == set(device_peaks.PEAK_KINDS), (model, form)
            # dense bf16 is twice dense TF32 on every listed part (a sparse figure among dense
            # ones would be 2x off)
            assert table["bfloat16"] == pytest.approx(2 * table["tf32"], rel=0.02), (model, form)
            assert table["float32"] < table["bfloat16"]
    with pytest.raises(ValueError, match=r"dtype='fp8' is not one of"):
        device_peaks.peak_tflops("NVIDIA H100", "fp8")


@pytest.fixture
def gpu(monkeypatch):
    """torch.cuda answering as the GPU named by gpu(name)."""
    def use(name):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    return use


def test_peak_flops_by_device_and_dtype(gpu, monkeypatch):
    gpu("NVIDIA H100 PCIe")
    assert metrics.peak_flops("cuda", 0.0, "bfloat16") == pytest.approx(756.5e12)
    assert metrics.peak_flops(torch.device("cuda", 3), 0.0, "float16") == pytest.approx(756.5e12)
    assert metrics.peak_flops("cuda", 400.0, "bfloat16") == 400e12  # configured wins
    assert metrics.peak_flops("cpu", 0.0, "bfloat16") == 0.0
    gpu("NVIDIA H100 80GB HBM3")
    # fp32 params: the fp32 peak unless fp32 matmuls may use TF32
    monkeypatch.setattr(torch.backends.cuda, "matmul", SimpleNamespace(fp32_precision="none"))
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert metrics.peak_flops("cuda", 0.0, "float32") == pytest.approx(66.9e12)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert metrics.peak_flops("cuda", 0.0, "float32") == pytest.approx(494.7e12)
    monkeypatch.setattr(torch.backends.cuda.matmul, "fp32_precision", "ieee")  # cuBLAS' wins
    assert metrics.peak_flops("cuda", 0.0, "float32") == pytest.approx(66.9e12)
    gpu("NVIDIA GeForce RTX 4090")
    assert metrics.peak_flops("cuda", 0.0, "bfloat16") == 0.0  # unknown: no MFU


@pytest.fixture
def tf32_restored():
    """The process's TF32 setting as it was after the test (set through the legacy setters
    only: mixing them with torch.backends.fp32_precision makes torch's getters raise)."""
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("enable, kind", [
    (lambda: None, "float32"),                                               # torch's default
    (lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True), "tf32"),
    (lambda: torch.set_float32_matmul_precision("high"), "tf32"),
    (lambda: torch.set_float32_matmul_precision("medium"), "tf32"),
    (lambda: torch.set_float32_matmul_precision("highest"), "float32"),
])
def test_mfu_peak_follows_the_tf32_setting(gpu, tf32_restored, enable, kind):
    """The peak MFU divides by is the one of what the matmuls run as, with torch's own
    setters: bf16's for bfloat16 whatever TF32 says; for float32 TF32's when TF32 is allowed,
    plain fp32's otherwise (torchtitan's choice)."""
    from simplesharded.calibration import matmul_kind

    gpu("NVIDIA H100 80GB HBM3")
    enable()
    assert matmul_kind("float32", "cuda") == kind
    assert matmul_kind("float32", "cpu") == "float32"  # no TF32 on a CPU
    assert matmul_kind("bfloat16", "cuda") == "bfloat16"
    table = device_peaks.TFLOPS["H100"][""]
    assert metrics.peak_flops("cuda", 0.0, "float32") == pytest.approx(table[kind] * 1e12)
    assert metrics.peak_flops("cuda", 0.0, "bfloat16") == pytest.approx(989.4e12)
    assert metrics.peak_flops("cuda", 0.0, "float16") == pytest.approx(989.4e12)


def test_tf32_override_variable_counts(gpu, monkeypatch):
    """$TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 makes cuBLAS take TF32 whatever the flags say."""
    gpu("NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert metrics.peak_flops("cuda", 0.0, "float32") == pytest.approx(19.5e12)
    monkeypatch.setenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1")
    assert metrics.peak_flops("cuda", 0.0, "float32") == pytest.approx(156.0e12)


def test_throughput_is_per_device():
    """64 sequences of 8192 tokens in 2 s on 8 devices: 32,768 tokens/s per device (what
    torchtitan's tps reports), 262,144 in all; MFU from the per-device rate."""
    r = metrics.throughput(64 * 8192, 2.0, 8, 6e9, 989.4e12)
    assert r["tps"] == 32768 and r["tokens_per_s_global"] == 262144
    assert r["tflops"] == pytest.approx(6e9 * 32768 / 1e12)
    assert r["mfu_pct"] == pytest.approx(100 * 6e9 * 32768 / 989.4e12)
    assert "mfu_pct" not in metrics.throughput(10, 1.0, 1, 1.0, 0.0)


def test_accelerator_memory_active_reserved_and_share_of_the_device(monkeypatch):
    """As torchtitan: max active and max reserved, GiB and % of the device's memory."""
    calls = []
    monkeypatch.setattr(torch.accelerator, "max_memory_allocated", lambda *a: 3 * 2**30)
    monkeypatch.setattr(torch.accelerator, "max_memory_reserved", lambda *a: 5 * 2**30)
    monkeypatch.setattr(torch.accelerator, "memory_stats", lambda *a: {
        "active_bytes.all.peak": 4 * 2**30, "num_alloc_retries": 0})
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.accelerator, "reset_peak_memory_stats",
                        lambda *a: calls.append("reset"))
    metrics.device_memory_bytes.cache_clear()
    m = metrics.memory_stats("cuda")
    metrics.device_memory_bytes.cache_clear()
    assert m == {"mem_max_active_gib": 4.0, "mem_max_reserved_gib": 5.0,
                 "mem_max_allocated_gib": 3.0, "mem_alloc_retries": 0.0,
                 "mem_max_active_pct": 5.0, "mem_max_reserved_pct": 6.25}
    metrics.reset_peak_memory("cuda:0")
    assert calls == ["reset"]
    line = metrics.format_record(2, {"loss": 1.0, "grad_norm": 0.5, "lr": 1e-4, "tps": 1234.5,
                                     "tflops": 300.0, "mfu_pct": 30.3, **m})
    assert "tps 1,234" in line and "mfu 30.3%" in line
    assert "memory active 4.00GiB (5.0%) reserved 5.00GiB (6.2%)" in line
    assert "retries" not in line
    line = metrics.format_record(2, {"loss": 1.0, "grad_norm": 0.5, "lr": 1e-4, "tps": 1.0,
                                     **m, "mem_alloc_retries": 3.0})
    assert line.endswith("alloc retries 3")


def test_optional_packages_are_checked_before_training(monkeypatch, capsys):
    """metrics.enable_tensorboard without the tensorboard package (or checkpoint.enable
    without numpy): one line naming the key, from the preflight (run_train.sh's --check-only
    and every rank's start), not a traceback after the model is built."""
    import importlib.util

    from simplesharded.trainer.config import load_config
    from simplesharded.trainer.preflight import check_packages

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else find_spec(name, *a))
    check_packages(load_config(None, []))  # off: nothing to check
    cfg = load_config(None, ["--metrics.enable_tensorboard", "true"])
    with pytest.raises(ValueError) as e:
        check_packages(cfg)
    assert str(e.value).startswith("metrics.enable_tensorboard=true needs the tensorboard "
                                   "package, which ")
    assert str(e.value).endswith(": pip install tensorboard, or --metrics.enable_tensorboard "
                                 "false")
    from simplesharded.trainer import main as train_main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train_main(["--check-only", "--metrics.enable_tensorboard", "true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: metrics.enable_tensorboard=true needs") and err.count("\n") == 1
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    check_packages(cfg)  # installed: passes
    # torch's distributed checkpoint serialises its plan through numpy
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "numpy" else object())
    check_packages(load_config(None, []))
    with pytest.raises(ValueError, match=r"^checkpoint.enable=true needs numpy .*: pip install "
                                         r"numpy, or --checkpoint.enable false$"):
        check_packages(load_config(None, ["--checkpoint.enable", "true"]))


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="Linux /proc only")
def test_cpu_peak_rss_resets():
    big = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
    before = metrics.memory_stats("cpu")["mem_peak_rss_gib"]
    del big
    metrics.reset_peak_memory("cpu")
    after = metrics.memory_stats("cpu")["mem_peak_rss_gib"]
    assert after < before  # the peak is now the current RSS, not the freed tensor's
    assert "rss " in metrics.format_record(1, {"loss": 1.0, "grad_norm": 0.5, "lr": 1e-4,
                                              "tps": 1.0, "mem_peak_rss_gib": after})


def test_trainer_resets_the_peak_after_its_first_step(tmp_path, monkeypatch):
    """Trainer.run records step 1 (compile and calibration included), then resets the
    peaks, so every later record holds the steady step's peak; tps is per device."""
    from simplesharded.trainer import loop as train
    from simplesharded.trainer.config import load_config

    cfg = load_config(None, ["--training.steps", "3", "--job.dump_folder", str(tmp_path),
                             "--no-metrics.progress_bar"])
    trainer = train.Trainer.__new__(train.Trainer)
    params = [torch.nn.Parameter(torch.zeros(1))]
    opt = torch.optim.SGD(params, lr=0.1)
    trainer.__dict__.update(cfg=cfg, device="cpu", rank=0, world=4, step=0,
                            tokens_per_step=4096, flops_per_token=1e6, peak=0.0,
                            optimizer=opt, saver=None,
                            scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    events = []
    monkeypatch.setattr(trainer, "train_step",
                        lambda: events.append("step") or {"loss": 1.0, "grad_norm": 1.0})
    monkeypatch.setattr(train, "memory_stats",
                        lambda d: events.append("stats") or {"mem_peak_rss_gib": 1.0})
    monkeypatch.setattr(train, "reset_peak_memory", lambda d: events.append("reset"))
    trainer.run()
    assert events == ["step", "stats", "reset", "step", "stats", "step", "stats"]
    import json
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 3
    assert all(r["tps"] == pytest.approx(r["tokens_per_s_global"] / 4) for r in recs)


def test_compare_losses_script(tmp_path, capsys):
    """scripts/compare_losses.py on two runs' metrics.jsonl: a row per shared step, the largest
    relative difference, exit 1 above --rtol or with no step in common; a step logged twice
    (a resumed run) counts its last record."""
    import importlib.util
    import json

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "compare_losses", os.path.join(root, "scripts", "compare_losses.py"))
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)

    def run(name, records):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(
            "\n".join(json.dumps(r) for r in records) + "\n")
        return str(tmp_path / name)

    a = run("a", [{"step": 1, "loss": 9.0}, {"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.0},
                  {"step": 3, "val_loss": 2.0}])
    b = run("b", [{"step": 1, "loss": 4.0001}, {"step": 2, "loss": 3.0}])
    assert compare.main([a, b]) == 0
    out = capsys.readouterr().out
    assert "| 1 | 4.000000 | 4.000100 | 2.5e-05 |" in out and "| 2 | 3.000000 | 3.000000 |" in out
    assert "2 steps, max rel diff 2.5e-05: within rtol 0.0001" in out
    assert compare.main([a, b, "--rtol", "1e-5"]) == 1
    assert "ABOVE rtol 1e-05" in capsys.readouterr().out
    assert compare.main([a, run("c", [{"step": 7, "loss": 1.0}])]) == 1
    assert "logged no step in common" in capsys.readouterr().err
