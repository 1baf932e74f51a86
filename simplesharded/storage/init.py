"""Initialise a sharded model so that its full parameters do not depend on how it is sharded.

``init_sharded(model, init_fn, seed)`` runs a model's own init (e.g. ``init_weights``) on a
model whose parameters are ``data_parallel`` shards (a model built on the meta device),
possibly also split by tensor or expert parallelism (strided shards included), and leaves on
every rank its slice of the same full parameters whatever the world size, the mesh's shape
and the tp / ep degrees. A plain, unsharded model gives the same values (its "slice" is the
whole tensor), so a one-process reference is ``init_sharded`` on the model built normally.

How, one group of tensors at a time: a group is a block (simplesharded/blocks.py) or, outside
every block, one module's own parameters and buffers (the embedding, the head, the root's
RoPE table). For a group, its parameters become full-size temporaries on the init device and
every other parameter and buffer of the model a meta tensor of the same shape, then the init
runs (``init_fn`` on each module of ``modules`` whose subtree holds a tensor of the group),
then each rank copies its region of every temporary the init wrote into its shard. Writes to
the meta stand-ins cost nothing and are dropped. Extra memory: one group's full parameters
(the largest block, or the largest module outside the blocks: an embedding).

Randomness: before each group's run the init device's default generator (and the CPU's) is
seeded from ``seed`` and the group's name, and the caller's generator states are restored
afterwards. One stream per group rather than one stream through the whole model in a fixed
order: a random op on a meta stand-in draws nothing, so in a single stream the position of a
group's draws would depend on which groups were real during the run; per group, its values
depend only on (seed, its name, the init code): not on the world size or the mesh (the
temporaries are full-size), nor on the other groups (a model with one more layer keeps the
others' values). The price: the values are not those of ``torch.manual_seed(seed);
model.init_weights()`` on a whole model.

Values do depend on the device type the draws run on: CPU and CUDA generators are different
algorithms (and their kernels may round differently). ``device="cpu"`` gives a GPU run the
CPU's values exactly, at CPU speed.
"""
from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from simplesharded.blocks import BlockSpec, block_of


def local_box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """``t``'s local tensor and, for a DTensor, which region of the global tensor it holds
    (a strided shard, TP's rows split again by dp, is a contiguous range of rows too)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(t, DTensor):
        return t, tuple(slice(0, s) for s in t.shape)
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), tuple(slice(o, o + s) for o, s in zip(offset, shape))


def group_seed(seed: int, group: str) -> int:
    """The generator seed of ``group`` (a module FQN, "" for the root): a stable hash, the
    same in every process (Python's own ``hash`` of a string is salted per process)."""
    digest = hashlib.blake2b(f"{seed}/{group}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass
class _Tensor:
    """One parameter or buffer of the model (tied ones once), and where it is held."""

    value: torch.Tensor  # the shard (a parameter) or the buffer itself
    is_param: bool
    fqn: str
    group: str
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)
    meta: torch.Tensor | None = None  # its stand-in during the other groups' runs

    def slots(self, module: nn.Module) -> dict:
        return module._parameters if self.is_param else module._buffers

    def place(self, t: torch.Tensor) -> None:
        for module, name in self.owners:
            self.slots(module)[name] = t

    def current(self, placed: torch.Tensor) -> torch.Tensor:
        """What the init left: an owner's new tensor if it assigned one, else ``placed``."""
        for module, name in self.owners:
            now = self.slots(module)[name]
            if now is not placed:
                return now
        return placed


def _collect(model: nn.Module, blocks) -> tuple[list[_Tensor], dict[int, set[str]]]:
    """The model's tensors by group, and for each module (by id) the groups of the tensors
    in its subtree."""
    block = block_of(model, blocks)
    tensors: dict[int, _Tensor] = {}
    under: dict[int, set[str]] = {}
    for fqn, module in model.named_modules():
        group = block.get(fqn, fqn)
        for is_param, slots in ((True, module._parameters), (False, module._buffers)):
            for name, t in slots.items():
                if t is None:
                    continue
                full = f"{fqn}.{name}" if fqn else name
                entry = tensors.setdefault(id(t), _Tensor(t, is_param, full, group))
                entry.owners.append((module, name))
                # every ancestor's subtree holds it too
                parts = fqn.split(".") if fqn else []
                for i in range(len(parts) + 1):
                    owner = model.get_submodule(".".join(parts[:i]))
                    under.setdefault(id(owner), set()).add(entry.group)
    return list(tensors.values()), under


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _init_device(tensors: list[_Tensor]) -> torch.device:
    """Where the shards live: the first parameter's (else buffer's) local tensor's device."""
    first = next((t for t in tensors if t.is_param), tensors[0] if tensors else None)
    return _local(first.value).device if first is not None else torch.device("cpu")


def _check_materialised(tensors: list[_Tensor]) -> None:
    for t in sorted(tensors, key=lambda t: not t.is_param):  # a parameter names it best
        if _local(t.value).is_meta:
            kind = "parameter" if t.is_param else "buffer"
            raise ValueError(f"{kind} {t.fqn!r} is on the meta device: shard the model with "
                             f"data_parallel first (it materialises empty shards), or give it "
                             f"storage with model.to_empty(device=...)")


@contextlib.contextmanager
def _seeding(device: torch.device):
    """Restores the CPU's and ``device``'s generator states on exit; yields a function that
    seeds both."""
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            yield torch.random.default_generator.manual_seed
        return
    module = torch.get_device_module(device.type)
    index = device.index if device.index is not None else module.current_device()
    generators = getattr(module, "default_generators", None)

    def seed_both(s: int) -> None:
        torch.random.default_generator.manual_seed(s)
        if generators is not None:
            generators[index].manual_seed(s)
        else:
            module.manual_seed(s)

    with torch.random.fork_rng(devices=[index], device_type=device.type):
        yield seed_both


def init_sharded(model: nn.Module, init_fn: Callable[[nn.Module], None] | None = None,
                 seed: int = 0, *, modules: Iterable[nn.Module] | None = None,
                 device: torch.device | str | None = None,
                 blocks: Sequence[BlockSpec] | None = None) -> None:
    """Initialise ``model`` in place, group by group on full-size temporaries (module doc).

    init_fn: called as ``init_fn(module)``; it writes the parameters and buffers of
    ``module``'s subtree in place (``torch.nn.init``) or assigns new tensors of the same
    shapes. Default: ``module.init_weights()`` (the zoo's models).
    seed: the same seed gives the same full values at any world size and sharding.
    modules: the modules ``init_fn`` is called on, in this order; default ``[model]`` (a
    whole-model init, run once per group). A per-module init (transformers'
    ``_init_weights``) passes every module, children first: each is called in the runs of
    the groups its subtree holds, so a module inside a block runs once.
    device: where the temporaries live and the random draws run; default the shards' device
    (the mesh's). ``"cpu"`` gives the same values on any device.
    blocks: the model's blocks as ``data_parallel(blocks=...)`` takes them (None: found in
    the module tree); they decide the groups, hence the seeds.

    Parameters are DTensor shards (``data_parallel``, after TP / EP or not) or plain tensors
    with storage; buffers stay plain tensors where they are. A parameter no init wrote keeps
    its shard's contents. Nothing is communicated: every rank computes every group in full
    and keeps its region (ragged buckets aside: their members are converted to per-parameter
    shards for the init and back, one all-to-all each way per bucket).
    """
    from simplesharded.storage.ragged_shards import members_as_shards

    # ragged buckets: their members as per-parameter shards for the init's length
    with members_as_shards(model):
        _init_shards(model, init_fn, seed, modules, device, blocks)


def _init_shards(model, init_fn, seed, modules, device, blocks) -> None:
    from simplesharded.sharding import disable_gather

    tensors, under = _collect(model, blocks)
    _check_materialised(tensors)
    targets = list(modules) if modules is not None else [model]
    if init_fn is None:
        missing = [m for m in targets if not callable(getattr(m, "init_weights", None))]
        if missing:
            raise ValueError(f"init_sharded: {type(missing[0]).__name__} has no init_weights(); "
                             f"pass init_fn")
        init_fn = _call_init_weights
    device = torch.device(device) if device is not None else _init_device(tensors)
    groups = list(dict.fromkeys(t.group for t in tensors))  # model order (any order works)
    for t in tensors:
        t.meta = torch.empty(t.value.shape, dtype=_local(t.value).dtype, device="meta")
        if t.is_param:
            t.meta = nn.Parameter(t.meta, requires_grad=False)
    try:
        with disable_gather(model), torch.no_grad(), _seeding(device) as seed_all:
            for group in groups:
                calls = [m for m in targets if group in under.get(id(m), ())]
                if calls:
                    seed_all(group_seed(seed, group))
                    _run_group(group, tensors, calls, init_fn, device)
    finally:
        for t in tensors:
            t.place(t.value)
            t.meta = None


def _call_init_weights(module: nn.Module) -> None:
    module.init_weights()


def _run_group(group: str, tensors: list[_Tensor], calls: list[nn.Module],
               init_fn: Callable[[nn.Module], None], device: torch.device) -> None:
    """One group: its tensors real (parameters as full-size temporaries), every other one a
    meta stand-in, ``init_fn`` on ``calls``; then the written parameters' regions into the
    shards and the buffers' new values in place."""
    mine: list[tuple[_Tensor, torch.Tensor, int]] = []  # (tensor, what the init got, version)
    for t in tensors:
        if t.group != group:
            t.place(t.meta)
            continue
        if t.is_param:
            placed = nn.Parameter(torch.empty(t.value.shape, dtype=_local(t.value).dtype,
                                              device=device), requires_grad=False)
        else:
            placed = t.value if t.value.device == device else t.value.to(device)
        t.place(placed)
        mine.append((t, placed, placed._version))
    for module in calls:
        init_fn(module)
    for t, placed, version in mine:
        now = t.current(placed)
        if now is placed and now._version == version:
            continue  # not written by this init
        if now.shape != t.value.shape:
            raise ValueError(f"init_fn replaced {t.fqn!r} {tuple(t.value.shape)} by a tensor of "
                             f"shape {tuple(now.shape)}")
        if t.is_param:
            local, box = local_box(t.value)
            if local.numel():
                local.copy_(now.detach()[box])
        elif now is not t.value:
            # a new tensor (or a copy made on another device): it becomes the buffer
            t.value = now.detach().to(t.value.device)
    for t in tensors:  # the group's parameters back to their shards before the next group
        t.place(t.value)


__all__ = ["init_sharded", "group_seed", "local_box"]
