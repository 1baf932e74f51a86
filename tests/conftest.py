"""Session-wide test environment: one calibration cache for every test and every process the
tests start (simplesharded/calibration.py measures once per world size, then reads it), one
inductor cache for every spawned rank of every pytest worker (the caller's
TORCHINDUCTOR_CACHE_DIR when set, so in-process compiles share it too: a kernel is compiled
once per run, not once per worker), one forkserver per worker started before any test, the
costliest test files first, and the support modules (tests/support/) importable by their
plain names, here and in spawned ranks (torch.multiprocessing's spawn hands its children the
parent's sys.path)."""
import os
import shutil
import sys
import tempfile

import pytest

_SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")
if _SUPPORT not in sys.path:
    sys.path.insert(0, _SUPPORT)

# Made by the first process to import this file (pytest's, or xdist's controller) and
# inherited by the workers it starts; removed by the process that made it.
_MADE = []
for _var, _prefix, _default in (("SIMPLESHARDED_CACHE_DIR", "ss_calibration_", None),
                                ("SIMPLESHARDED_TEST_INDUCTOR_CACHE", "ss_inductor_cache_",
                                 os.environ.get("TORCHINDUCTOR_CACHE_DIR"))):
    if _var not in os.environ:
        os.environ[_var] = _default or tempfile.mkdtemp(prefix=_prefix)
        if not _default:
            _MADE.append(os.environ[_var])


@pytest.fixture(scope="session", autouse=True)
def _forkserver():
    """This worker's forkserver, started before any test can start it with other settings
    (dist_utils.start_forkserver)."""
    from dist_utils import start_forkserver

    start_forkserver()


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


def pytest_collection_modifyitems(config, items):
    """The costliest test files first (tests/support/file_costs.py): run_tests.sh's workers
    take files in this order, so no long file starts last beside an idle worker."""
    from file_costs import costliest_first, load

    items[:] = costliest_first(items, load())


def pytest_unconfigure(config):
    for d in _MADE:
        shutil.rmtree(d, ignore_errors=True)
