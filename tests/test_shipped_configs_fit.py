"""Every shipped config fits the GPUs it states (job.gpu_counts, job.gpu_memory_gib) by the
planner's memory model: fp32 shards, gradients and optimizer state plus the compiled step's
peak of gathered buffers and activations (python -m simplesharded.tools.forecast), at most
MEMORY_HEADROOM of one GPU's memory.

Checked at the smallest stated count only: with the local batch derived from the global one
(test_config.py checks that every stated count resolves, with -1), fewer GPUs hold more of
the batch and more of the model each, so the smallest count is the tightest; tracing every
count would take minutes per config. Deep models are extrapolated from traces of 4 and 6
blocks as `plan` does (one trace per core)."""
import glob
import os

import pytest

from simplesharded.trainer.config import MEMORY_HEADROOM, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.toml")))


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_config_fits_its_smallest_gpu_count(path):
    from simplesharded.tools import forecast as plan
    from simplesharded.trainer import check_static
    from simplesharded.trainer.preflight import check_torch

    cfg = load_config(path, ["--training.dataset_path", ""])
    n = cfg.job.gpu_counts[0]
    cfg = check_static(cfg, n)
    try:
        check_torch(cfg)
    except ValueError as refused:  # a feature this torch lacks: the trainer's own line
        pytest.skip(str(refused))
    name = plan.forecast_backend(cfg.compile.backend)
    # the H100 profile: what the auto plan sizes its buckets and keep budget by
    peak = plan.predicted_peak_bytes(cfg, n, [name], "h100-ib400", full_trace_layers=8)[name]
    room = MEMORY_HEADROOM * cfg.job.gpu_memory_gib * 2**30
    print(f"{os.path.basename(path)}: {n} GPUs, backend {name}: {peak / 2**30:.1f} GiB per GPU "
          f"of {room / 2**30:.1f}")
    assert peak <= room, (f"{os.path.basename(path)} at {n} GPUs: the planner predicts "
                          f"{peak / 2**30:.1f} GiB per GPU, above {MEMORY_HEADROOM:.0%} of "
                          f"job.gpu_memory_gib={cfg.job.gpu_memory_gib:g}")


def test_forecast_backend():
    from simplesharded.tools.forecast import forecast_backend

    assert forecast_backend("inductor_autobucketing") == "aot_eager_autobucketing"
    assert forecast_backend("aot_eager_blockbucketing") == "aot_eager_blockbucketing"
    assert forecast_backend("inductor") == forecast_backend("eager") == "aot_eager"
    with pytest.raises(ValueError, match=r"compile.backend='inductor_upstreambucketing' is not "
                                         r"forecast here"):
        forecast_backend("inductor_upstreambucketing")


def test_plan_reports_the_config_claim():
    """`plan`'s line on the config's own claim: the world size among job.gpu_counts or not,
    the peak within MEMORY_HEADROOM of job.gpu_memory_gib or above it."""
    from simplesharded.tools.forecast import _stated_fit

    cfg = load_config(None, ["--job.gpu_counts", "8,16", "--job.gpu_memory_gib", "80"])
    assert _stated_fit(cfg, 8, 70 * 2**30).endswith(
        "world size 8 is one of them; this peak, 70.0 GiB, is within 90% of it (72.0 GiB)")
    assert "world size 32 is not one of them; this peak, 73.0 GiB, is ABOVE 90% of it" in \
        _stated_fit(cfg, 32, 73 * 2**30)
    assert _stated_fit(load_config(None, []), 8, 1) == "the config states no job.gpu_counts"
