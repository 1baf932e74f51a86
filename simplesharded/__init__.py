"""simplesharded: compiler-based fully sharded data parallel for PyTorch."""
from simplesharded.backends import BACKENDS, make_backend
from simplesharded.grad_sync import no_gradient_sync, set_requires_gradient_sync
from simplesharded.mesh import build_mesh, init_distributed, init_mesh, resolve_degrees
from simplesharded.sharding import MixedPrecisionPolicy, data_parallel, disable_gather

__all__ = ["BACKENDS", "make_backend", "build_mesh", "init_distributed", "init_mesh",
           "resolve_degrees", "MixedPrecisionPolicy", "data_parallel", "disable_gather",
           "no_gradient_sync", "set_requires_gradient_sync"]
