"""The torch releases simplesharded runs on, and what each feature needs of them: one table.

The supported range is ``SUPPORTED`` (pyproject.toml's pin says the same). The default install
(scripts/bootstrap.sh) is ``DEFAULT``, whose CPU wheel this project's machines have; the fast
tests also run on the oldest and the newest supported release (docs/torch_internals.md, "Torch
versions"). Inside the range most of the code is the same on every release; what is not:

- ``FEATURES``: a feature that needs a newer torch than the range's oldest is one row (its
  name as a user asks for it, the oldest release it runs on, the one-line reason). ``needs``
  refuses it in one line naming the feature, the installed torch and the one it needs; the
  trainer's config validation (``trainer/config_checks.py``) refuses it the same way before
  any rank starts, and a test that needs it skips with ``refusal``'s line.
- Names a release spells differently or lacks, below: each one gives the older release's
  equivalent, or does nothing where only an optimisation is lost.

docs/torch_internals.md lists every version-dependent path and points here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.torch_version import TorchVersion

# Oldest supported release and the first one outside the range (pyproject.toml's pin).
SUPPORTED = ("2.11", "2.16")
# What scripts/bootstrap.sh installs by default: a CPU wheel lies on this project's machines.
DEFAULT = "2.13"


@dataclass(frozen=True)
class Feature:
    """One row: ``name`` as a user asks for it, the oldest torch it runs on, and why."""
    name: str
    minimum: str
    reason: str


STEP_GRAPH = Feature(
    "compile_step (compile.scope='step')", "2.13",
    "dynamo before 2.13 fails an assertion tracing torch.autograd.grad into the step graph")

CONTEXT_PARALLEL = Feature(
    "context parallelism (parallelism.context_parallel_degree > 1)", "2.13",
    "its K/V gather is torch.distributed._functional_collectives.all_gather_single_autograd, "
    "new in 2.13")

EXPERT_PARALLEL = Feature(
    "expert parallelism (parallelism.expert_parallel_degree > 1)", "2.13",
    "compiling its token exchange needs torch._dynamo.override_optimization_hint, new in 2.13, "
    "for the all-to-all's data-dependent sizes")

FEATURES = (STEP_GRAPH, CONTEXT_PARALLEL, EXPERT_PARALLEL)


def installed() -> TorchVersion:
    """The running torch's version (the one thing the table compares; tests replace it)."""
    return TorchVersion(torch.__version__)


def refusal(feature: Feature) -> str | None:
    """The one line that refuses ``feature`` on this torch, or None when it runs here."""
    version = installed()
    if version >= feature.minimum:
        return None
    return (f"{feature.name} needs torch >= {feature.minimum}; this is torch {version} "
            f"({feature.reason})")


def has(feature: Feature) -> bool:
    """Whether ``feature`` runs on this torch."""
    return refusal(feature) is None


class TorchTooOld(RuntimeError):
    """A feature's row says this torch is older than the one it needs."""


def needs(feature: Feature) -> None:
    """Raise :class:`TorchTooOld` with :func:`refusal`'s line when this torch lacks ``feature``."""
    line = refusal(feature)
    if line is not None:
        raise TorchTooOld(line)


def outside_range() -> str | None:
    """One line when this torch is outside ``SUPPORTED``, else None (a warning, not a refusal:
    a release outside the range may work, untested)."""
    low, high = SUPPORTED
    version = installed()
    if low <= version < high:
        return None
    return f"torch {version} is outside the supported range >={low},<{high} (untested)"


# ------------------------------------------------------------- names that differ by release

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # before 2.12: the same non-guarding hint under its older name
    from torch.fx.experimental.symbolic_shapes import size_hint as optimization_hint


def dtensor_subclass_dispatch() -> bool:
    """Whether DTensor's dispatch calls a DTensor subclass's own ``__torch_dispatch__`` (2.12
    on); before, its C++ path computes the subclass's ops as a DTensor's, and a subclass that
    must see them (storage/ragged_member.py) overrides ``__torch_function__`` instead."""
    return TorchVersion(torch.__version__) >= "2.12"


def eager_backend() -> str:
    """The torch backend our ``eager`` names: dynamo's ``eager`` (the captured graph run as it
    is), except before 2.12, where under it an autograd.Function whose forward returns a
    functional collective's waited result gets a zero gradient (seen on 2.11.0: a ragged
    bucket's gather); ``aot_eager`` there, which runs no pass of ours either."""
    return "eager" if TorchVersion(torch.__version__) >= "2.12" else "aot_eager"


def override_optimization_hint(value, hint: int) -> None:
    """Tell the compiler the size a data-dependent value will usually have (cost model and
    memory estimates). Releases before 2.13 have no such hint, and a compiled graph whose
    collective has such a size fails in the passes' cost model there: expert parallelism, its
    one user, needs 2.13 (``EXPERT_PARALLEL``); this does nothing on older releases."""
    override = getattr(torch._dynamo, "override_optimization_hint", None)
    if override is not None:
        override(value, hint)


__all__ = ["CONTEXT_PARALLEL", "DEFAULT", "EXPERT_PARALLEL", "FEATURES", "Feature",
           "STEP_GRAPH", "SUPPORTED", "TorchTooOld", "dtensor_subclass_dispatch",
           "eager_backend", "has", "installed", "needs", "optimization_hint", "outside_range",
           "override_optimization_hint", "refusal"]
