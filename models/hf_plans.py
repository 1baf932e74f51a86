"""transformers' parallelism plans as a config states them (``base_model_tp_plan``,
``base_model_ep_plan``: module patterns under the base model, ``*`` for a block's index): which
modules a pattern names. Read by models/hf_tensor_parallel.py and models/hf_expert_parallel.py.
"""
from __future__ import annotations

import re
from collections.abc import Iterable


def plan_matches(pattern: str, names: Iterable[str]) -> list[str]:
    """Those of ``names`` (module names under the base model) that ``pattern`` names
    (``layers.*.mlp.experts``: ``*`` is a block's index)."""
    regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
    return [n for n in names if regex.fullmatch(n)]
