"""Self-calibration (simplesharded/calibration.py): measured numbers, identical on every rank,
cached per machine and world size, re-measured by all ranks together when any rank lacks the
entry, and pinnable as a file.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dist_utils import spawn

from simplesharded import calibration as calibrate
from simplesharded.passes.hardware import Hardware, get_hardware


def test_single_process_measures_compute_then_reads_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(calibrate.CACHE_ENV, str(tmp_path))
    first = calibrate.calibrated()
    hw = Hardware(**first["hardware"])
    assert 1e8 < hw.flops_per_s < 1e16 and hw.mem_bw_Bps > 1e8 and hw.memory_bytes > 2**28
    # on a CPU device host and device are one memory: its figures are the elementwise one
    assert hw.host_link_Bps == hw.host_mem_bw_Bps == hw.mem_bw_Bps
    path = calibrate.cache_path(first["key"])
    assert path.exists() and json.loads(path.read_text()) == first

    def no_measuring(*a, **k):
        raise AssertionError("measured although the cache holds the entry")

    monkeypatch.setattr(calibrate, "calibrate", no_measuring)
    assert calibrate.calibrated_hardware() == hw
    assert calibrate.resolve_hardware(calibrate.CALIBRATED) == hw


def test_a_calibration_file_pins_the_profile(tmp_path):
    hw = dataclasses.replace(get_hardware("h100-ib400"), name="pinned")
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"hardware": dataclasses.asdict(hw)}))
    assert get_hardware(str(path)) == hw
    assert calibrate.resolve_hardware(str(path)) == hw
    with pytest.raises(ValueError, match=r"hardware='.*missing.json': not a readable calibration"):
        get_hardware(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=r"hardware='tpu' is not one of .* or a calibration"):
        calibrate.resolve_hardware("tpu")


def _calibrate_job(rank, world, cache_dir):
    import os

    os.environ[calibrate.CACHE_ENV] = cache_dir
    first = calibrate.calibrated()
    # rank 1 loses its entry: every rank must measure again (together), none may hang
    if rank == 1:
        calibrate.cache_path(first["key"]).unlink()
    second = calibrate.calibrated()
    third = calibrate.calibrated()  # every rank now holds the same entry: read, not measured
    # another compute dtype: its matmul measured, the collectives taken from the entry above
    measure = calibrate.measure_collectives
    calibrate.measure_collectives = None  # would raise if called
    try:
        bf16 = calibrate.calibrated(dtype="bfloat16")
    finally:
        calibrate.measure_collectives = measure
    assert bf16["measured"]["compute"]["matmul_kind"] == "bfloat16"
    assert bf16["measured"]["collectives"] == third["measured"]["collectives"]
    assert bf16["key"] != third["key"]
    return first, second, third


def test_every_rank_ends_with_the_same_profile(tmp_path):
    """2 gloo ranks, each with its own cache directory (as on two hosts)."""
    dirs = [str(tmp_path / f"host{r}") for r in range(2)]
    results = spawn(2, _calibrate_job_per_host, dirs, timeout_s=120)
    (a1, a2, a3), (b1, b2, b3) = results
    assert a1 == b1 and a2 == b2 and a3 == b3  # identical numbers on every rank, every time
    assert a2 == a3  # the third call read what the second measured
    m = a1["measured"]
    assert set(m["collectives"]) == set(calibrate.KINDS)
    for c in m["collectives"].values():
        assert c["alpha_s"] > 0 and c["bandwidth_Bps"] > 0
    hw = Hardware(**a1["hardware"])
    assert hw.transport == "gloo" and 0.0 <= hw.comm_overlap <= 1.0
    assert hw.collective_overhead_s >= 0.0


def _calibrate_job_per_host(rank, world, dirs):
    return _calibrate_job(rank, world, dirs[rank])


def test_ranks_per_host():
    assert calibrate._ranks_per_host(["a"]) == 0
    assert calibrate._ranks_per_host(["a", "a"]) == 0  # one host: one link
    assert calibrate._ranks_per_host(["a", "a", "b", "b"]) == 2
    assert calibrate._ranks_per_host(["a", "b", "a", "b"]) == 0  # not consecutive
    assert calibrate._ranks_per_host(["a", "b"]) == 0  # one rank per host: no intra link


def _two_hosts_job(rank, world, cache_dir):
    import os
    import socket
    import warnings

    os.environ[calibrate.CACHE_ENV] = cache_dir
    socket.gethostname = lambda: f"host{rank // 2}"  # ranks 0, 1 and 2, 3 share a "host"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile = calibrate.calibrated(force=True)
    # torch's deprecated collectives warn on every user's run
    return profile, [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


def test_two_hosts_measure_the_link_within_a_host(tmp_path):
    results = spawn(4, _two_hosts_job, str(tmp_path), timeout_s=120)
    assert [w for _, w in results] == [[]] * 4
    results = [profile for profile, _ in results]
    assert all(r == results[0] for r in results)
    hw = Hardware(**results[0]["hardware"])
    assert hw.gpus_per_node == 2
    assert hw.intra_node_alpha_s > 0 and hw.intra_node_bandwidth_Bps > 0
    assert set(results[0]["measured"]["collectives_intra_node"]) == set(calibrate.KINDS)


# ------------------------------------------------------------------ sizes and timers on a GPU
# (mocked: the logic that picks them runs on CPU)

GPU = torch.device("cuda", 0)


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda reporting an H100-like device: 50 MiB of L2, 79 GiB free."""
    import types

    props = types.SimpleNamespace(L2_cache_size=50 * 2**20, total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: props)
    monkeypatch.setattr(torch.accelerator, "get_memory_info",
                        lambda *a: (79 * 2**30, 80 * 2**30))
    return props


def test_bandwidth_buffer_is_past_the_l2(fake_gpu, monkeypatch):
    """CPU: 32 MiB as ever. GPU: at least 1 GiB and 8 times the L2, at most 1/8 of the free
    memory (two such buffers live at once)."""
    assert calibrate.stream_elements(torch.device("cpu")) * 4 == 32 * 2**20
    assert calibrate.stream_elements(GPU) * 4 == 2**30  # 8 x 50 MiB < 1 GiB
    fake_gpu.L2_cache_size = 256 * 2**20
    assert calibrate.stream_elements(GPU) * 4 == 2 * 2**30
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda *a: (4 * 2**30, 8 * 2**30))
    assert calibrate.stream_elements(GPU) * 4 == 2**29  # a small, busy device: 1/8 of free
    del fake_gpu.L2_cache_size  # a device that does not report its L2
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda *a: (79 * 2**30, 0))
    assert calibrate.stream_elements(GPU) * 4 == 2**30


@pytest.mark.parametrize("ws", [2, 8, 512])
def test_collective_sizes(ws):
    """CPU: 4 MiB per rank for every kind, as ever. GPU: the collective's buffer (gathered
    output, reduce-scatter / all-to-all input, all-reduce buffer) is 256 MiB at every world
    size: bandwidth-bound on NVLink and InfiniBand, never a whole device's memory."""
    for kind in calibrate.KINDS:
        assert calibrate.collective_elements(kind, ws, torch.device("cpu")) == 2**20
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert calibrate.collective_elements(kind, ws, GPU) * ws * 4 == 256 * 2**20
    assert calibrate.collective_elements("all_reduce", ws, GPU) * 4 == 256 * 2**20


def test_gpu_timing_uses_device_events_without_a_sync_per_call(monkeypatch):
    """On an accelerator: events around windows of back-to-back calls, one synchronisation
    per window (none per call); the median window's mean per call. CPU: wall clock."""
    log, clock = [], iter(range(10**6))

    class Event:
        def __init__(self, device=None, enable_timing=False):
            assert enable_timing and device == GPU

        def record(self, stream=None):
            self.t = next(clock)
            log.append("record")

        def synchronize(self):
            log.append("sync")

        def elapsed_time(self, end):
            return 1e3 * (end.t - self.t)  # ms, one "second" per clock tick

    def fn():
        next(clock)  # each call takes one tick
        log.append("call")

    monkeypatch.setattr(torch, "Event", Event)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: log.append("sync"))
    per_call = calibrate._time(fn, GPU, cpu_reps=5)
    reps, windows = calibrate._WINDOW_REPS, calibrate._WINDOWS
    assert per_call == pytest.approx((reps + 1) / reps)  # the end record's tick included
    assert log.count("sync") == windows + 1  # after the warm-up, then once per window
    assert log.count("call") == 1 + windows * (1 + reps)
    window = log[log.index("record"):]
    assert window[:reps + 3] == ["record"] + ["call"] * reps + ["record", "sync"]

    log.clear()
    monkeypatch.setattr(torch, "Event", None)  # CPU never touches events
    calibrate._time(fn, torch.device("cpu"), cpu_reps=5)
    assert log == ["call"] * 6


# ------------------------------------------------------------------ the run's compute dtype

def test_matmuls_are_timed_in_the_compute_dtype(tmp_path, monkeypatch):
    """Calibration times its matmul in the dtype the run computes in (training.
    mixed_precision_param), one cache entry per kind: a float32 run is not planned with a
    bf16 figure. Default: torch's default dtype, float32."""
    monkeypatch.setenv(calibrate.CACHE_ENV, str(tmp_path))
    timed = []
    real = calibrate.measure_compute

    def measure(device, dtype=None):
        timed.append(calibrate.compute_dtype(dtype))
        return real(device, dtype)

    monkeypatch.setattr(calibrate, "measure_compute", measure)
    monkeypatch.setattr(calibrate, "_CPU_STREAM_ELEMENTS", 2**16)  # the bandwidth: not here
    fp32 = calibrate.calibrated()
    bf16 = calibrate.calibrated(dtype="bfloat16")
    assert timed == [torch.float32, torch.bfloat16]
    assert fp32["measured"]["compute"]["matmul_kind"] == "float32"
    assert bf16["measured"]["compute"]["matmul_kind"] == "bfloat16"
    assert fp32["key"] != bf16["key"] and "-bfloat16-" in bf16["key"]
    assert calibrate.calibrated(dtype=torch.bfloat16) == bf16  # its own entry, read back
    assert calibrate.calibrated(dtype="float32") == fp32
    assert timed == [torch.float32, torch.bfloat16]
    with pytest.raises(ValueError, match="not a floating-point torch dtype"):
        calibrate.compute_dtype("int8")


def test_fp32_on_a_gpu_is_keyed_and_timed_as_what_it_runs_as(fake_gpu, monkeypatch):
    """float32 on an accelerator runs as TF32 where this process allows it: the cache key
    says which, so switching TF32 on measures again instead of reusing plain fp32's figure."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(calibrate, "_hosts", lambda group=None: ["host"])
    monkeypatch.setattr(calibrate, "fp32_matmul_uses_tf32", lambda: False)
    assert calibrate.matmul_kind("float32", GPU) == "float32"
    plain = calibrate.cache_key(device=GPU, dtype="float32")
    monkeypatch.setattr(calibrate, "fp32_matmul_uses_tf32", lambda: True)
    assert calibrate.matmul_kind("float32", GPU) == "tf32"
    assert calibrate.matmul_kind("float32", "cpu") == "float32"
    assert calibrate.matmul_kind(torch.bfloat16, GPU) == "bfloat16"
    tf32 = calibrate.cache_key(device=GPU, dtype="float32")
    assert "-float32-" in plain and "-tf32-" in tf32 and plain != tf32
    assert "-bfloat16-" in calibrate.cache_key(device=GPU, dtype="bfloat16")


def test_backends_and_the_trainer_pass_the_compute_dtype(monkeypatch):
    """make_backend(compute_dtype=...) reaches calibration; the trainer passes its
    training.mixed_precision_param, for bucketing backends (the ones with a cost model)."""
    from simplesharded import backends
    from simplesharded.trainer.config import load_config
    from simplesharded.trainer.recipe import _backend_options

    seen = []
    hw = get_hardware("h100-ib400")
    monkeypatch.setattr(calibrate, "calibrated_hardware",
                        lambda group=None, force=False, dtype=None: seen.append(dtype) or hw)
    backends.make_backend("aot_eager_autobucketing", compute_dtype="bfloat16")
    backends.make_backend("aot_eager_autobucketing")
    backends.make_backend("aot_eager_autobucketing", hardware="h100-ib400",
                          compute_dtype="bfloat16")  # a profile is taken as it is
    assert seen == ["bfloat16", None]
    cfg = load_config(None, ["--compile.backend", "inductor_autobucketing"])
    assert _backend_options(cfg.compile, None, "bfloat16")["compute_dtype"] == "bfloat16"
    cfg = load_config(None, ["--compile.backend", "inductor"])
    assert "compute_dtype" not in _backend_options(cfg.compile, None, "bfloat16")
