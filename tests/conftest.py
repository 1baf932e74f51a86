"""Session-wide test environment: one calibration cache for every test and every process the
tests start (simplesharded/calibration.py measures once per world size, then reads it), and the
support modules (tests/support/) importable by their plain names, here and in spawned ranks
(torch.multiprocessing's spawn hands its children the parent's sys.path)."""
import os
import shutil
import sys
import tempfile

import pytest

_SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")
if _SUPPORT not in sys.path:
    sys.path.insert(0, _SUPPORT)

_CACHE = tempfile.mkdtemp(prefix="ss_calibration_")
os.environ.setdefault("SIMPLESHARDED_CACHE_DIR", _CACHE)


FAKE_WORLD = 4  # ranks of the fake_world fixture's process group


@pytest.fixture(scope="module")
def fake_world():
    """A fake process group of FAKE_WORLD ranks, this process rank 0 (no communication), for
    the tests of one module; a test that finds another group still up fails at once."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "another test left a process group initialised"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=FAKE_WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fake_pg():
    """A fake process group of 2 ranks for one test, dynamo's caches reset before and after:
    an entry left by an earlier test would make the next compile of a new input shape a
    dynamic-shape recompile."""
    import torch

    from simplesharded.tools.cluster_trace import fake_world as fake_world_of

    torch._dynamo.reset()
    with fake_world_of(2):
        yield
        torch._dynamo.reset()


def pytest_unconfigure(config):
    shutil.rmtree(_CACHE, ignore_errors=True)
