"""Where each parameter's shard lives: the dp × tp × ep placement maths of ``data_parallel``.

Each parameter becomes a DTensor shard on the whole mesh. A parameter that is already a
DTensor on a model-parallel dim of the mesh (``mesh["tp"]``, made by ``parallelize_module``;
or ``mesh["ep"]``, an expert weight split by expert parallelism, models/moe.py) keeps that
placement and is sharded further over the dp dims that remain for it.

Invariant: the model-parallel shard comes first and dp splits each shard (when both split
dim 0 torch calls this a strided shard, ``_StridedShard``), so gathering over the dp dims
alone gives back each rank's model-parallel shard, and the gather only ever talks to dp
ranks. The dp dims left to a parameter: all of them (``dp_replicate``, ``dp_shard``:
simplesharded/mesh.py ``dense_mesh``) for a plain or a TP parameter; for an expert weight on
``ep``, which borrows its ranks from dp_shard (dp_shard x cp under context parallelism),
``dp_replicate`` and ``efsdp``
(``expert_dp_mesh``). A plain parameter on a mesh with a tp dim is replicated over tp; a
parameter that is not an expert weight never sees the ep dim: ep is part of its dp_shard.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from simplesharded.mesh import (EFSDP_DIM, EP_DIM, NAMED_LAYOUTS, dim_size, ep_dim,
                                mesh_roles, tp_dim)
from simplesharded.storage.sharded_state import _GatherSpec, _MPLayout
from simplesharded.storage.uninitialised import uninitialised_like

MODES = ("replicate", "fully_shard", "hybrid_shard")


@dataclass(frozen=True)
class _DPView:
    """One set of dp dims a parameter is sharded over, and the mesh it lives on: the dense
    parameters' (all dp dims) or, on a mesh with an ep dim, the expert weights' (module doc)."""

    home: DeviceMesh  # the parameter's whole mesh: its dp dims first, then the others
    dp: DeviceMesh
    placements: tuple  # on dp, by mode
    spec: _GatherSpec

    @property
    def rest(self) -> tuple[str | None, ...]:
        """The home mesh's dims after the dp dims (tp, ep): none on a mesh read by position."""
        return mesh_roles(self.home).rest

    def placements_of(self, param: torch.Tensor) -> tuple:
        """``param``'s placements on dp: by mode, except a scalar's (no dim 0 to shard), which
        is replicated (all-reduced)."""
        return self.placements if param.dim() else (Replicate(),) * self.dp.ndim


def _mode_placements(mode: str, mesh: DeviceMesh) -> tuple:
    """Placements of a parameter on the data-parallel mesh ``mesh``."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {sorted(MODES)}")
    # Explicit three-way branch: one case per mode.
    if mode == "replicate":
        return (Replicate(),) * mesh.ndim
    if mode == "fully_shard":
        return (Shard(0),) * mesh.ndim
    if mesh.ndim != 2:
        raise ValueError(
            f"mode='hybrid_shard' needs a 2-D mesh of dp dims (dp_replicate, dp_shard); got "
            f"{mesh.ndim}-D {tuple(mesh.mesh.shape)}; build it with "
            f"init_mesh(dp_replicate=R, dp_shard=S) or init_device_mesh(device, (R, S))")
    return (Replicate(), Shard(0))


def _is_hybrid(placements: tuple) -> bool:
    """(Replicate, Shard(d)) on (dp_replicate, dp_shard or efsdp): HSDP's layout."""
    return (len(placements) == 2 and placements[0] == Replicate()
            and type(placements[1]) is Shard)


def _full_placements(dp_placements: tuple, mp_placement, mp_size: int,
                     rest: tuple[str, ...] = (), mp_dim: str | None = None) -> tuple:
    """Placements on a parameter's whole mesh (its dp dims, then the dims ``rest`` after them)
    of a parameter whose model-parallel placement on dim ``mp_dim`` is ``mp_placement``: the
    model-parallel shard first, dp then splits each shard, which on the same tensor dim is a
    strided shard in DTensor's left-to-right convention. Replicate on every other dim."""
    out = []
    for p in dp_placements:
        if (isinstance(p, Shard) and isinstance(mp_placement, Shard)
                and p.dim == mp_placement.dim):
            p = _StridedShard(p.dim, split_factor=mp_size)
        out.append(p)
    return (*out, *(mp_placement if d == mp_dim else Replicate() for d in rest))


def _expert_dp_placements(placements: tuple, local_shape: torch.Size, efsdp: int) -> tuple:
    """An expert weight's dp placements: its local experts [E/ep, ...] are sharded on dim 0
    when efsdp divides their number, else on dim 1, so no rank's gather pads a whole expert
    (with fewer local experts than efsdp ranks, or a remainder, dim 0 would)."""
    if local_shape[0] % efsdp == 0 or len(local_shape) < 2:
        return placements
    return tuple(Shard(1) if p == Shard(0) else p for p in placements)


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(int(size), 1)
    return tuple(reversed(stride))


def _to_shard(t: torch.Tensor, mesh: DeviceMesh, placements: tuple) -> DTensor:
    """Each rank keeps only its own chunk (no communication: every rank holds the same full
    tensor by construction, or the tensor is on meta and is materialised uninitialised here:
    simplesharded/storage/uninitialised.py)."""
    if t.is_meta:
        meta_dt = distribute_tensor(t, mesh, placements, src_data_rank=None)
        local = uninitialised_like(meta_dt.to_local(), mesh.device_type)
        return DTensor.from_local(local, mesh, placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return distribute_tensor(t.detach(), mesh, placements, src_data_rank=None)


def _shard_param(param: torch.Tensor, mesh: DeviceMesh, views: dict[str | None, _DPView],
                 fqn: str) -> tuple[DTensor, _MPLayout | None, _GatherSpec]:
    """The whole-mesh shard of one parameter, its model-parallel layout if it is a TP or EP
    DTensor, and its gather spec."""
    if not isinstance(param, DTensor):
        view = views[None]
        placements = view.placements_of(param)
        return (_to_shard(param, view.home, _full_placements(placements, None, 1, view.rest)),
                None, view.spec)
    names = [n for n in (tp_dim(mesh), ep_dim(mesh)) if n]
    if not names:
        raise ValueError(
            f"parameter {fqn!r} is a DTensor (tensor or expert parallel) but the mesh given to "
            f"data_parallel has dims {mesh_roles(mesh).names}; TP/EP need dims named "
            f"{NAMED_LAYOUTS}: build the mesh with simplesharded.init_mesh(..., tp=T, ep=E)")
    name = param.device_mesh.mesh_dim_names[0] if param.device_mesh.mesh_dim_names else None
    if (param.device_mesh.ndim != 1 or name not in names
            or not torch.equal(param.device_mesh.mesh, mesh[name].mesh)):
        raise ValueError(
            f"parameter {fqn!r} is a DTensor on mesh {param.device_mesh} but data_parallel can "
            f"only shard plain parameters or TP/EP DTensors on mesh['tp'] / mesh['ep'] of the "
            f"mesh it is given ({mesh}); apply parallelize_module(model, mesh['tp'], plan) "
            f"with that mesh")
    placement = param.placements[0]
    if not isinstance(placement, (Shard, Replicate)) or isinstance(placement, _StridedShard):
        raise ValueError(f"parameter {fqn!r} has placement {placement} on {name}; "
                         f"data_parallel supports Shard(d) and Replicate() there")
    view = views[EP_DIM if name == EP_DIM else None]
    local = param.detach().to_local()
    dp_placements = view.placements_of(param)
    if name == EP_DIM:
        dp_placements = _expert_dp_placements(dp_placements, local.shape, dim_size(mesh, EFSDP_DIM))
    placements = _full_placements(dp_placements, placement, param.device_mesh.size(),
                                  view.rest, name)
    dp_local = distribute_tensor(local, view.dp, dp_placements, src_data_rank=None).to_local()
    if local.is_meta:
        dp_local = uninitialised_like(dp_local, mesh.device_type)
    shard = DTensor.from_local(dp_local, view.home, placements, run_check=False,
                               shape=param.shape, stride=param.stride())
    return shard, _MPLayout(param.device_mesh, placement, dp_placements, local.shape,
                            _contiguous_stride(local.shape), param.shape,
                            param.stride()), view.spec
