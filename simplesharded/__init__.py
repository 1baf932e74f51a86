"""simplesharded: compiler-based fully sharded data parallel for PyTorch."""
import os as _os

# In a source checkout passes/ and models/ sit beside this package (pyproject.toml installs
# them as simplesharded.passes / .models): with the checkout's root on this package's path
# they import the same way uninstalled, so `python -m simplesharded.<tool>` run from the root
# of a checkout finds its own passes, not another install's.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if (not _os.path.isdir(_os.path.join(__path__[0], "passes"))
        and _os.path.isfile(_os.path.join(_checkout, "passes", "__init__.py"))):
    __path__.append(_checkout)

from simplesharded.backends import BACKENDS, make_backend  # noqa: E402
from simplesharded.storage.grad_sync import no_gradient_sync, set_requires_gradient_sync  # noqa: E402
from simplesharded.storage.init import init_sharded  # noqa: E402
from simplesharded.mesh import (build_mesh, init_distributed, init_mesh,  # noqa: E402
                                resolve_degrees)
from simplesharded.storage.ragged_shards import (optim_state_by_bucket,  # noqa: E402
                                         optim_state_by_member)
from simplesharded.sharding import (MixedPrecisionPolicy, data_parallel,  # noqa: E402
                                    disable_gather)

__all__ = ["BACKENDS", "make_backend", "build_mesh", "init_distributed", "init_mesh",
           "resolve_degrees", "MixedPrecisionPolicy", "data_parallel", "disable_gather",
           "compile_step", "init_sharded", "no_gradient_sync", "set_requires_gradient_sync",
           "optim_state_by_member", "optim_state_by_bucket"]


def __getattr__(name):
    # compile_step's three modules load on first use: `import simplesharded` stays small.
    if name == "compile_step":
        from simplesharded.step import compile_step
        return compile_step
    raise AttributeError(f"module 'simplesharded' has no attribute {name!r}")
