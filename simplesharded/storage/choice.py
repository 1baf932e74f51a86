"""Which storage a model's parameters take: the names ``data_parallel(..., storage=...)`` and
``--parallelism.storage`` accept, what each takes, and the one call that lays a model's shards
out in it (:func:`pack`). Nothing outside this package tests a storage's name: the trainer
asks :func:`modes_taken`, ``data_parallel`` calls :func:`check_storage` and :func:`pack`.

- ``"param"``: one DTensor shard per parameter, read through the parameter's own gather
  (gather.py); the compiler's bucketing pass buckets the collectives.
- ``"ragged"``: each bucket's parameters in the ragged layout (ragged_shards.py), whose
  members are still the model's parameters (ragged_member.py); under ``fully_shard`` on one
  or two dp dims (two: the bucket is cut over their ranks as one) or ``hybrid_shard``.
- ``"auto"`` (the default of both ``data_parallel`` and the trainer): ``"ragged"`` where it
  takes the mode and mesh, else ``"param"`` (:func:`resolved`).
"""
from __future__ import annotations

import warnings

from simplesharded.storage.ragged_pack import pack_ragged

NOT_GIVEN = object()  # flat_buckets, storage's deprecated name, left out


def _shards_as_they_are(model, shards, scope, views, offload) -> None:
    """One shard per parameter: what layout.py made is the storage (on the compute device:
    :func:`check_offload` refuses another place)."""


# storage name -> (the modes it takes, the numbers of dp dims fully_shard takes it on (None:
# any), its packing)
_STORAGES = {
    "param": (("fully_shard", "hybrid_shard", "replicate"), None, _shards_as_they_are),
    "ragged": (("fully_shard", "hybrid_shard"), (1, 2), pack_ragged),
}
STORAGES = tuple(_STORAGES)
CHOICES = ("auto", *STORAGES)  # what a user may name


def modes_taken(storage: str) -> tuple[str, ...]:
    """The ``mode``s ``storage`` takes."""
    return _STORAGES[storage][0]


def _takes(storage: str, mode: str, dp_dims: int | None) -> bool:
    modes, fully_shard_dims, _ = _STORAGES[storage]
    return mode in modes and not (mode == "fully_shard" and fully_shard_dims is not None
                                  and dp_dims is not None and dp_dims not in fully_shard_dims)


def resolved(storage: str, mode: str, dp_dims: int | None = None,
             each_parameter: bool = False) -> str:
    """The storage ``storage`` names for ``mode`` over ``dp_dims`` data-parallel mesh dims
    (None: not known yet): ``"auto"`` is ragged buckets (the fewest copies, docs/zero_copy.md)
    wherever they take the mode and mesh, else one shard per parameter. ``each_parameter``:
    ``"auto"`` takes a storage that gathers each parameter on its own
    (:func:`gathers_each_parameter`)."""
    if storage != "auto":
        return storage
    if each_parameter:
        return "param"
    return "ragged" if _takes("ragged", mode, dp_dims) else "param"


def gathers_each_parameter(storage: str) -> bool:
    """Whether ``storage`` gathers each parameter with a collective of its own (a ragged
    bucket gathers its members in one buffer): what a pass that rewrites one parameter's
    gather needs (passes/float8_gather.py)."""
    return storage == "param"


def check_storage(storage: str, mode: str, dp_dims: int, mesh) -> None:
    """One line naming what ``storage`` does not take: ``mode``, or ``fully_shard`` over a
    number of data-parallel dims it does not take (on ``mesh``, named by its dim names or
    count)."""
    if not _takes(storage, mode, dp_dims):
        raise ValueError(f"storage={storage!r} takes mode='fully_shard' (on one or two "
                         f"data-parallel mesh dims) or 'hybrid_shard' (on two); got "
                         f"mode={mode!r} on mesh dims {mesh.mesh_dim_names or mesh.ndim}: "
                         f"use storage='param'")


def takes_offload(storage: str) -> bool:
    """Whether ``storage`` can live on the host (offload.py): ragged buckets, each one tensor
    that moves with its two copies; a per-parameter shard has no copy op yet."""
    return storage == "ragged"


def check_offload(offload: str, storage: str, mode: str) -> None:
    """One line naming what ``offload`` (offload.py) does not take: a storage other than
    ragged buckets, whose bucket is what moves to the host (``storage`` as resolved, under
    ``mode``)."""
    if offload != "none" and not takes_offload(storage):
        raise ValueError(f"offload={offload!r} takes storage='ragged' (or 'auto' where it is "
                         f"ragged: mode fully_shard or hybrid_shard); got storage={storage!r} "
                         f"under mode={mode!r}")


def pack(storage: str, model, shards: dict, scope, views: tuple,
         offload: tuple[str, bool] = ("none", True)) -> None:
    """Lay ``shards`` (id(original parameter) -> (shard, record), module order) out in
    ``storage``: a storage may replace a shard and its record (ragged buckets' members).
    ``views``: the model's sets of dp dims (layout.py's ``_DPView``), the same on every
    rank. ``offload``: (kind, pin_memory) of where the shards live between uses
    (offload.py)."""
    _STORAGES[storage][2](model, shards, scope, views, offload)


def chosen_storage(storage: str | None, flat_buckets) -> str:
    """``storage`` checked (None: ``"auto"``), or what ``flat_buckets``, its deprecated name,
    meant; ``"auto"`` is left for :func:`resolved`."""
    if flat_buckets is not NOT_GIVEN:
        if storage is not None:
            raise ValueError("data_parallel takes storage= or flat_buckets= (its deprecated "
                             "name), not both")
        if flat_buckets is True:
            raise ValueError("flat_buckets=True: flat storage is retired; use "
                             "storage='ragged' (zero-copy buckets, docs/zero_copy.md)")
        if not (flat_buckets is False or flat_buckets == "ragged"):
            raise ValueError(f"flat_buckets={flat_buckets!r} is not one of [False, 'ragged'] "
                             f"(deprecated: use storage=, one of {list(STORAGES)})")
        storage = "ragged" if flat_buckets == "ragged" else "param"
        # stacklevel 3: the line that called data_parallel
        warnings.warn(f"data_parallel(flat_buckets={flat_buckets!r}) is deprecated: use "
                      f"storage={storage!r}", DeprecationWarning, stacklevel=3)
    storage = "auto" if storage is None else storage
    if storage not in CHOICES:
        raise ValueError(f"storage={storage!r} is not one of {list(CHOICES)}")
    return storage


