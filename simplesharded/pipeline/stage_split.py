"""Cutting a model into pipeline stages at block boundaries.

A stage is the model itself, pruned: a copy that keeps only its own blocks (simplesharded/blocks.py
finds them) and, outside the blocks, what the pipeline needs where it is: the first stage the
modules before the first block (the embedding), the last stage those after the last block
(the final norm and the output head). Everything pruned is set to ``None`` in its parent (a
block is removed from its container's ``_modules``, so the remaining keys stay as they were).
So a stage's parameter names are the model's: ``layers.3.attention.wq.weight`` stays
``layers.3.attention.wq.weight``, a checkpoint keyed by FQN holds every stage's tensors under
the names a one-stage run uses, and ``init_sharded`` seeds each group by the same name, giving
a stage the values the whole model would have.

The model's forward must accept a stage's input: tokens where it has its embedding, hidden
states otherwise, and return hidden states where it has no output head (the zoo models do:
``tok_embeddings is None`` / ``output is None``). A model whose forward calls a module after
the blocks unconditionally names what stands in for it where it was cut
(``model.stage_stand_in(fqn)``: a Hugging Face model's final norm becomes an identity).
Parameters and buffers of the root itself stay on every stage (a RoPE table); a
parameter-holding module between two blocks, or a parameter tied across stages (GPT's
embedding and head), cannot be staged: a ``ValueError`` names it.

Which stages a pp rank holds: "loop" puts stage ``s`` on rank ``s % pp`` (1F1B, the
interleaved schedules), "v" folds the second half back (ZBV: rank ``r`` holds ``r`` and
``2 pp - 1 - r``), as torch's schedules place them.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

from torch import nn

from simplesharded.blocks import BlockSpec, find_blocks
from simplesharded.storage.ragged_shards import share_owned_buckets


@dataclass(frozen=True)
class StagePlan:
    """One stage: its index, its blocks' FQNs (in model order), and the modules outside the
    blocks it keeps."""

    index: int
    blocks: tuple[str, ...]
    outside: tuple[str, ...]

    @property
    def first_block(self) -> str:
        return self.blocks[0]


def even_split(n_blocks: int, n_stages: int) -> list[int]:
    """Blocks per stage, as even as it gets: the earlier stages take one more."""
    base, extra = divmod(n_blocks, n_stages)
    return [base + (i < extra) for i in range(n_stages)]


def stage_to_rank(n_stages: int, pp: int, style: str = "loop") -> list[int]:
    """The pp rank of each stage (module doc)."""
    if n_stages % pp:
        raise ValueError(f"{n_stages} stages do not split evenly over {pp} pipeline ranks")
    if style == "loop":
        return [s % pp for s in range(n_stages)]
    if style == "v":
        return [s % pp if (s // pp) % 2 == 0 else pp - 1 - s % pp for s in range(n_stages)]
    raise ValueError(f"stage placement style={style!r} is not 'loop' or 'v'")


def stages_of_rank(pp_rank: int, n_stages: int, pp: int, style: str = "loop") -> list[int]:
    """The stages ``pp_rank`` holds, in stage order."""
    return [s for s, r in enumerate(stage_to_rank(n_stages, pp, style)) if r == pp_rank]


def plan_stages(model: nn.Module, n_stages: int, layers_per_stage: Sequence[int] | None = None,
                blocks: Sequence[BlockSpec] | None = None) -> list[StagePlan]:
    """Which blocks and outside modules each of ``n_stages`` stages holds. ``layers_per_stage``:
    blocks per stage (default :func:`even_split`). ValueError for a model that cannot be cut
    so (module doc), more stages than blocks, or a split that does not add up."""
    found = [fqn for fqn, _ in find_blocks(model, blocks)]
    name = type(model).__name__
    if not found:
        raise ValueError(f"{name} cannot be staged: no blocks found (simplesharded/blocks.py)")
    if n_stages > len(found):
        raise ValueError(f"{n_stages} pipeline stages but {name} has {len(found)} blocks: every "
                         f"stage needs at least one")
    counts = list(layers_per_stage) if layers_per_stage else even_split(len(found), n_stages)
    if len(counts) != n_stages or sum(counts) != len(found) or min(counts) < 1:
        raise ValueError(f"layers per stage {counts} do not give {n_stages} stages of at least "
                         f"one block each summing to the {len(found)} blocks of {name}")
    head, tail = _outside_modules(model, found)
    plans, start = [], 0
    for i, n in enumerate(counts):
        outside = (head if i == 0 else ()) + (tail if i == n_stages - 1 else ())
        plans.append(StagePlan(i, tuple(found[start:start + n]), outside))
        start += n
    _check_ties(model, plans)
    return plans


def _outside_modules(model: nn.Module, found: list[str]) -> tuple[tuple[str, ...], ...]:
    """The parameter-holding modules outside the blocks: (those before the first block, those
    after the last), in module order."""
    block_set = set(found)
    head, tail, seen_block, after_last = [], [], 0, False
    name = type(model).__name__
    for fqn, module in model.named_modules():
        if fqn in block_set:
            seen_block += 1
            after_last = seen_block == len(found)
            continue
        if any(fqn.startswith(b + ".") for b in block_set):
            continue
        if not any(p is not None for p in module._parameters.values()):
            continue
        if fqn == "":
            raise ValueError(f"{name} cannot be staged: its root holds parameters "
                             f"{sorted(module._parameters)} that no stage can own alone")
        if seen_block == 0:
            head.append(fqn)
        elif after_last:
            tail.append(fqn)
        else:
            raise ValueError(f"{name} cannot be staged: module {fqn!r} holds parameters "
                             f"between blocks")
    return tuple(head), tuple(tail)


def _owned_params(model: nn.Module, plan: StagePlan) -> dict[int, str]:
    """id → FQN of the parameters a stage holds."""
    out = {}
    for prefix in plan.blocks + plan.outside:
        module = model.get_submodule(prefix)
        for name, p in module.named_parameters(remove_duplicate=False):
            full = f"{prefix}.{name}"
            if prefix in plan.outside and "." in name:
                continue  # an outside module's own parameters only: its children are elsewhere
            out.setdefault(id(p), full)
    return out


def _check_ties(model: nn.Module, plans: list[StagePlan]) -> None:
    owner: dict[int, tuple[int, str]] = {}
    for plan in plans:
        for pid, fqn in _owned_params(model, plan).items():
            if pid in owner and owner[pid][0] != plan.index:
                stage, other = owner[pid]
                raise ValueError(f"{type(model).__name__} cannot be staged: parameter {other!r} "
                                 f"(stage {stage}) is tied to {fqn!r} (stage {plan.index}); "
                                 f"pipeline stages cannot share a parameter")
            owner.setdefault(pid, (plan.index, fqn))


def cut_stage(model: nn.Module, plan: StagePlan, all_blocks: Sequence[str],
              outside: Sequence[str]) -> nn.Module:
    """A copy of ``model`` that holds only ``plan``'s blocks and outside modules
    (``all_blocks`` and ``outside``: every stage's). The dropped modules are never copied, so
    a stage of a model with storage costs its own parameters only."""
    drop = [fqn for fqn in all_blocks if fqn not in plan.blocks]
    drop += [fqn for fqn in outside if fqn not in plan.outside]
    # the outermost only: a module inside a dropped one goes with it
    drop = [f for f in drop if not any(f.startswith(d + ".") for d in drop)]
    memo = {id(model.get_submodule(fqn)): None for fqn in drop}
    stage = copy.deepcopy(model, memo)
    for fqn in drop:
        parent_name, _, child = fqn.rpartition(".")
        parent = stage.get_submodule(parent_name)
        if fqn in all_blocks:
            del parent._modules[child]  # the other keys keep their names: FQNs unchanged
        else:
            stand_in = getattr(model, "stage_stand_in", lambda _: None)(fqn)
            setattr(parent, child, stand_in)
    return stage


def cut_stages(model: nn.Module, n_stages: int, stage_ids: Sequence[int] | None = None,
               layers_per_stage: Sequence[int] | None = None,
               blocks: Sequence[BlockSpec] | None = None) -> list[tuple[int, nn.Module]]:
    """``(index, stage module)`` for each of ``stage_ids`` (default: all) of ``model`` cut into
    ``n_stages`` stages (:func:`plan_stages`, :func:`cut_stage`). ``model`` is left as it was;
    build it on the meta device and each stage is cheap to cut."""
    plans = plan_stages(model, n_stages, layers_per_stage, blocks)
    all_blocks = [b for p in plans for b in p.blocks]
    outside = [m for p in plans for m in p.outside]
    ids = range(n_stages) if stage_ids is None else stage_ids
    return [(i, cut_stage(model, plans[i], all_blocks, outside)) for i in ids]


def merged_view(stages: Sequence[nn.Module]) -> nn.Module:
    """One module holding the given stages' modules under their own names: what a rank's
    stages are together (the optimizer's parameters, a checkpoint's keys: the model's FQNs).
    Containers of blocks are merged; its forward is not meant to be called."""
    view = nn.Module()
    for stage in stages:
        _merge(view, stage)
    return view


def _merge(dst: nn.Module, src: nn.Module) -> None:
    share_owned_buckets(dst, src)  # a stage root's ragged buckets convert in the view too
    for name, p in src._parameters.items():
        if p is None:
            continue
        if dst._parameters.setdefault(name, p) is not p:
            # two stages' own parameters under one name: the view would drop one of them
            raise ValueError(f"pipeline stages on one rank both hold a parameter named "
                             f"{name!r}; they cannot share a merged view")
    for name, b in src._buffers.items():
        if b is not None and name not in src._non_persistent_buffers_set:
            dst._buffers.setdefault(name, b)
    for name, child in src._modules.items():
        if child is None or _holds_nothing(child) and dst._modules.get(name) is not None:
            continue  # a stage's stand-in for what another stage holds adds nothing
        if dst._modules.get(name) is None or _holds_nothing(dst._modules[name]):
            # a container of blocks gets its own merged copy; any other module is shared
            if any(c is not None for c in child._modules.values()) and not child._parameters:
                dst._modules[name] = nn.Module()
                _merge(dst._modules[name], child)
            else:
                dst._modules[name] = child
        elif dst._modules[name] is not child:
            _merge(dst._modules[name], child)


def _holds_nothing(module: nn.Module) -> bool:
    """No parameter in ``module`` or below (a stage's stand-in, ``stage_stand_in``): the view
    takes another stage's module in its place rather than merging into it, which would give
    the stand-in that stage's parameters."""
    return next(module.parameters(), None) is None
