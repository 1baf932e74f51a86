"""Session-wide test environment: one calibration cache for every test and every process the
tests start (simplesharded/calibration.py measures once per world size, then reads it), and the
support modules (tests/support/) importable by their plain names, here and in spawned ranks
(torch.multiprocessing's spawn hands its children the parent's sys.path)."""
import os
import shutil
import sys
import tempfile

_SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")
if _SUPPORT not in sys.path:
    sys.path.insert(0, _SUPPORT)

_CACHE = tempfile.mkdtemp(prefix="ss_calibration_")
os.environ.setdefault("SIMPLESHARDED_CACHE_DIR", _CACHE)


def pytest_unconfigure(config):
    shutil.rmtree(_CACHE, ignore_errors=True)
