"""Names the pinned torch (2.13) has and an older one spells differently or lacks, in one place.

The project is tested on torch 2.13 only. These fallbacks let an older torch (the one a GPU
machine's image ships, say) run the same code for the GPU smoke: each one gives the older
release's equivalent, or does nothing where only an optimisation is lost. A torch upgrade
deletes this file's fallbacks.
"""
from __future__ import annotations

import torch
from torch.torch_version import TorchVersion

# Features that need the pinned release: an older torch refuses them in one line (needs()).
STEP_GRAPH = "compile_step (dynamo tracing torch.autograd.grad in the step)"


def needs(feature: str, version: str = "2.13") -> None:
    """Raise one line naming ``feature`` when this torch is older than ``version``."""
    if TorchVersion(torch.__version__) < version:
        raise RuntimeError(f"{feature} needs torch >= {version}; this is {torch.__version__}")


try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # before 2.13: the same non-guarding hint under its older name
    from torch.fx.experimental.symbolic_shapes import size_hint as optimization_hint


def override_optimization_hint(value, hint: int) -> None:
    """Tell the compiler the size a data-dependent value will usually have (cost model and
    memory estimates). Older releases have no such hint: their estimates use a fallback."""
    override = getattr(torch._dynamo, "override_optimization_hint", None)
    if override is not None:
        override(value, hint)


__all__ = ["STEP_GRAPH", "needs", "optimization_hint", "override_optimization_hint"]
