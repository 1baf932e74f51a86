"""Tests of a feature that needs a newer torch than the oldest supported one skip on an older
torch with the one line passes/torch_compat.py's table gives (feature, installed, needed)."""
from __future__ import annotations

import pytest

from simplesharded.passes.torch_compat import Feature, refusal


def needs_torch(feature: Feature) -> pytest.MarkDecorator:
    """``@needs_torch(STEP_GRAPH)``: skip the test where this torch lacks ``feature``."""
    line = refusal(feature)
    return pytest.mark.skipif(line is not None, reason=line or "")
