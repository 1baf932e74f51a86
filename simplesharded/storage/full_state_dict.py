"""Full state dicts into ragged members: torch's ``set_model_state_dict`` and
``set_optimizer_state_dict`` with ``StateDictOptions(full_state_dict=True)`` (and
``broadcast_from_rank0=True``), FSDP2's way of loading a full checkpoint, on ragged buckets.

Torch cuts each full tensor to the local part of a DTensor like the model's (a parameter, or
an optimizer state laid out as one) by that DTensor's placements. A ragged member says
``Shard(0)`` but holds a run of the flattened tensor (ragged_member.py), so torch's cut is the
wrong part and, copied into the run, the wrong shape. :func:`install` wraps torch's two
functions that make that cut, ``_state_dict_utils._distribute_tensors`` (after a broadcast)
and ``_distribute_state_dict`` (every rank given the full dict), so a member's entry becomes
a member holding its own run of the full tensor (:meth:`RaggedMember.run_from`, no collective);
every other tensor goes to torch's own code as before. The model's ``load_state_dict`` then
copies runs laid out as its members straight into their buckets (ragged_shards.py:
``_load_members``).

Installed by ``data_parallel`` when it packs ragged buckets (once per process); on a torch
without either function the load fails as it would without this module.
"""
from __future__ import annotations

import torch

from simplesharded.storage.ragged_member import RaggedMember

_ORIGINAL: dict = {}


def _member_of(member: RaggedMember, full: torch.Tensor, key: str) -> RaggedMember:
    """A new member laid out as ``member``, holding its run of ``full``."""
    if tuple(full.shape) != tuple(member.shape):
        raise ValueError(f"{key}: the full state dict's tensor has shape {tuple(full.shape)}, "
                         f"the model's is {tuple(member.shape)}")
    run = member.run_from(full.detach()).to(device=member.device, dtype=member.dtype)
    return RaggedMember.make(run, member._spec, member.runs, member.cut)


def _distribute_tensors(local_state_dict, keys, device, pg=None):
    """torch's, with each (ragged member, full tensor) pair made a member holding its run of
    the full tensor (the load then copies it into place once; torch's own copies into the
    local tensor here and the load copies it again)."""
    rest = []
    for key in keys:
        entry = local_state_dict.get(key)
        if isinstance(entry, tuple) and isinstance(entry[0], RaggedMember):
            local_state_dict[key] = _member_of(entry[0], entry[1], key)
        else:
            rest.append(key)
    _ORIGINAL["_distribute_tensors"](local_state_dict, rest, device, pg)


def _distribute_state_dict(full_state_dict, local_state_dict, device, pg=None):
    """torch's, with each ragged member's entry a member holding its run of the full
    tensor."""
    mine = {k: v for k, v in local_state_dict.items()
            if isinstance(v, RaggedMember) and torch.is_tensor(full_state_dict.get(k))
            and full_state_dict[k].dim() > 0}
    rest = {k: v for k, v in full_state_dict.items() if k not in mine}
    _ORIGINAL["_distribute_state_dict"](rest, local_state_dict, device, pg)
    for key, member in mine.items():
        local_state_dict[key] = _member_of(member, full_state_dict[key], key)


def install() -> None:
    """Wrap torch's two functions (idempotent)."""
    if _ORIGINAL:
        return
    from torch.distributed import _state_dict_utils as utils
    from torch.distributed.checkpoint import state_dict as dsd

    if not (hasattr(utils, "_distribute_tensors") and hasattr(dsd, "_distribute_state_dict")):
        return
    _ORIGINAL["_distribute_tensors"] = utils._distribute_tensors
    _ORIGINAL["_distribute_state_dict"] = dsd._distribute_state_dict
    utils._distribute_tensors = _distribute_tensors
    dsd._distribute_state_dict = _distribute_state_dict
