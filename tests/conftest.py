"""Session-wide test environment: one calibration cache for every test and every process the
tests start (simplesharded/calibration.py measures once per world size, then reads it)."""
import os
import shutil
import tempfile

_CACHE = tempfile.mkdtemp(prefix="ss_calibration_")
os.environ.setdefault("SIMPLESHARDED_CACHE_DIR", _CACHE)


def pytest_unconfigure(config):
    shutil.rmtree(_CACHE, ignore_errors=True)
