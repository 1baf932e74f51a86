"""``Plan``: the one interface between a plan and the passes. Every plan implements it, and the
passes that take a plan read nothing else from it.

  assign(gm, collectives)   bucketing.py: a bucket key per collective (None: leave it alone);
                            collectives with the same key become one collective
  memory_cap_bytes          reordering.py and recompute.py: bytes of gathered parameters alive
                            at once, kept ones and copy-outs included (docs/memory_cap.md);
                            None: what the graph needs without prefetch plus its largest
                            gathered buffer
  keep_gathered_bytes       recompute.py: budget of reshard_after_forward="auto" parameters
                            kept gathered from forward to backward, held to the cap less twice
                            the largest block; None: keep the last block and what follows it
  reshard_after_forward     recompute.py: True / False overrides every parameter's own
                            setting; None: as data_parallel annotated it

The built-in plans are plans.BlockPlan and plans.AutoPlan; a frozen dataclass with these
four members is a plan of your own (``make_backend(name, plan=...)``).
"""
from __future__ import annotations

from typing import Hashable, Protocol, runtime_checkable

from torch import fx

from .collectives import Collective


@runtime_checkable
class Plan(Protocol):
    @property
    def memory_cap_bytes(self) -> int | None: ...

    @property
    def keep_gathered_bytes(self) -> int | None: ...

    @property
    def reshard_after_forward(self) -> bool | None: ...

    def assign(self, gm: fx.GraphModule, collectives: list[Collective]
               ) -> list[Hashable | None]: ...
