"""Which modules of a model are its blocks (the repeated layers), read from the module tree.

Bucketing (one bucket per block), the ``reshard="auto"`` units and activation checkpointing
all ask :func:`find_blocks`; :func:`~simplesharded.sharding.data_parallel` writes each
parameter's block into the graph annotations (``BLOCK_KEY``) so the compiler passes see the
same answer. Names need no digits: a ``ModuleDict`` under ``"attn_a"``, ``"attn_b"`` is as much
a stack as ``layers.0``, ``layers.1``.

Detection, walking the tree from the root and never descending into a block:
  * a ``ModuleList``/``ModuleDict`` whose parameter-holding children are all composite
    modules, or repeat one class, is a stack: each of those children is a block;
  * a ``Sequential``: its children of a class that occurs at least twice are blocks (an
    embedding or a head in the same ``Sequential`` is not);
  * only when no container qualifies anywhere: any module with two or more composite children
    of one class (blocks held as plain attributes).
So an attention's ``q``/``k``/``v`` Linears (leaves of a plain module) are never blocks, and
MoE experts inside a block stay inside it.

Users can name blocks instead (like FSDP2's per-module wrapping): a module class, a class
name, or a regular expression that matches a module FQN in full.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Iterable, Sequence, Union

from torch import nn

from simplesharded.storage.sharded_state import sharded_state

BlockSpec = Union[type, str]
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def find_blocks(model: nn.Module, blocks: Sequence[BlockSpec] | None = None
                ) -> list[tuple[str, nn.Module]]:
    """``(fqn, module)`` of every block of ``model`` in module-tree order (outermost matches
    only). ``blocks``: None detects (see module doc); otherwise classes, class names or FQN
    regexes; an entry that matches no module is a ``ValueError`` naming it."""
    if blocks is None:
        found = list(_detect(model, "", containers_only=True))
        return found or list(_detect(model, "", containers_only=False))
    return _named(model, list(blocks))


def block_of(model: nn.Module, blocks: Sequence[BlockSpec] | None = None) -> dict[str, str]:
    """Module FQN → FQN of the block containing it, for every module inside a block."""
    out = {}
    for fqn, block in find_blocks(model, blocks):
        for sub, _ in block.named_modules():
            out[f"{fqn}.{sub}" if sub else fqn] = fqn
    return out


def _cls(m: nn.Module) -> type:
    """``m``'s own class: data_parallel gives each module holding parameters a subclass of
    its own, which must not change the answer once a model is wrapped."""
    state = sharded_state(m)
    return state.original_class if state is not None else type(m)


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def _composite(m: nn.Module) -> bool:
    return any(_has_params(c) for c in m.children())


def _members(m: nn.Module, containers_only: bool) -> list[str]:
    """Names of ``m``'s children that are blocks when ``m`` is a stack, else []."""
    kids = [(n, c) for n, c in m.named_children() if _has_params(c)]
    counts = Counter(_cls(c) for _, c in kids)
    repeated = [n for n, c in kids if counts[_cls(c)] >= 2]
    if isinstance(m, _CONTAINERS):
        if kids and (repeated or all(_composite(c) for _, c in kids)):
            return [n for n, _ in kids]
        return []
    if isinstance(m, nn.Sequential):
        return repeated
    if containers_only:
        return []
    return [n for n, c in kids if counts[_cls(c)] >= 2 and _composite(c)]


def _detect(m: nn.Module, prefix: str, containers_only: bool) -> Iterable[tuple[str, nn.Module]]:
    members = set(_members(m, containers_only))
    for name, child in m.named_children():
        fqn = f"{prefix}.{name}" if prefix else name
        if name in members:
            yield fqn, child
        else:
            yield from _detect(child, fqn, containers_only)


def _named(model: nn.Module, specs: list[BlockSpec]) -> list[tuple[str, nn.Module]]:
    names = {_cls(m).__name__ for m in model.modules()}
    for spec in specs:
        if not isinstance(spec, (type, str)):
            raise ValueError(f"blocks entry {spec!r} is not a module class, class name or FQN "
                             f"regex")

    def matches(spec, fqn, module) -> bool:
        if isinstance(spec, type):
            return isinstance(module, spec)
        if spec in names:
            return _cls(module).__name__ == spec
        return re.fullmatch(spec, fqn) is not None

    out, hit = [], set()
    inside: list[str] = []  # fqn prefixes of blocks already taken (outermost wins)
    for fqn, module in model.named_modules():
        if not fqn or any(fqn.startswith(p + ".") for p in inside):
            continue
        for i, spec in enumerate(specs):
            if matches(spec, fqn, module):
                out.append((fqn, module))
                inside.append(fqn)
                hit.add(i)
                break
    missing = [specs[i] for i in range(len(specs)) if i not in hit]
    if missing:
        shown = [s.__name__ if isinstance(s, type) else s for s in missing]
        raise ValueError(f"blocks={shown} match no module of {type(model).__name__}; give module "
                         f"classes, class names or regexes matching module FQNs in full")
    return out
