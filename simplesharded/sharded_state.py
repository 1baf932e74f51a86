"""What ``data_parallel`` leaves on a module: one frozen record per sharded parameter, held in
one state object per module, stored under one attribute and read only through
:func:`sharded_state`.

Invariant: a module has a state iff ``data_parallel`` wrapped it (a module owning parameters,
or the root); the per-parameter records never change after wrapping, and the only mutable
per-module setting is ``gather_enabled`` (``disable_gather``). Everything else that changes
(the gathers of one forward, gradient sync) lives in objects shared by the whole model, which
the state points to.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from torch import nn

if TYPE_CHECKING:
    from simplesharded.gather import _GatherScope
    from simplesharded.grad_sync import _GradSync
    from simplesharded.ragged_shards import RaggedSlot
    from simplesharded.layout import _GatherSpec, _MPLayout

_ATTR = "_simplesharded_state"


@dataclass(frozen=True)
class ShardedParam:
    """One sharded parameter: what a read of it needs to gather it. Tied parameters share
    one record (the FQN and block of the first owner, as ``named_parameters()`` reports)."""

    fqn: str
    spec: _GatherSpec  # its dp dims, dtypes, gradient scaling and reshard choice
    mp_layout: _MPLayout | None  # set when it is a TP or EP DTensor to its module
    block: str | None  # its first owner's block (blocks.py), for the graph annotation
    ragged: RaggedSlot | None = None  # its ragged bucket (storage="ragged")

    def __post_init__(self):
        _RECORDS[self.read_key] = self

    def __setstate__(self, state: dict) -> None:  # a copied or unpickled record registers too
        for k, v in state.items():
            object.__setattr__(self, k, v)
        _RECORDS[self.read_key] = self

    @property
    def read_key(self) -> str:
        """The name a traced read passes its op (gather.py) to find this record by."""
        return f"{self.fqn}@{id(self):x}"


# Every live record by read_key: a traced read's op takes a string, not the record. Registered
# when a record is made (a registration during a trace would apply only after it).
_RECORDS: weakref.WeakValueDictionary[str, ShardedParam] = weakref.WeakValueDictionary()


def read_record(key: str) -> ShardedParam:
    return _RECORDS[key]


@dataclass(eq=False)
class ShardedModuleState:
    """One wrapped module's sharding: its parameters' records and the model-wide objects."""

    params: dict[str, ShardedParam]  # this module's own parameters by attribute name
    scope: _GatherScope  # the model's gathers of one forward, shared by all its modules
    grad_sync: _GradSync  # the model's set_requires_gradient_sync state, shared
    original_class: type  # the class before data_parallel subclassed it (blocks.py)
    read_block: str | None  # the block this module is in (eager "auto": _EagerReshard)
    root: bool = False  # the model data_parallel was called on
    gather_enabled: bool = True  # False inside disable_gather: reads return the shard


def sharded_state(module: nn.Module) -> ShardedModuleState | None:
    """``module``'s sharding state, or None for a module ``data_parallel`` did not wrap."""
    return getattr(module, _ATTR, None)


def attach_sharded_state(module: nn.Module, state: ShardedModuleState) -> None:
    setattr(module, _ATTR, state)


def sharded_params(model: nn.Module) -> Iterator[tuple[ShardedParam, nn.Parameter]]:
    """(record, shard) of every sharded parameter of ``model``, in module order (a tied
    parameter once per module that holds it; a slot set to None skipped)."""
    for module in model.modules():
        state = sharded_state(module)
        if state is None:
            continue
        for name, record in state.params.items():
            shard = module._parameters[name]
            if shard is not None:
                yield record, shard
