"""The sharding frontend: ``data_parallel(model, mesh, mode=...)``, ``disable_gather`` and
``MixedPrecisionPolicy``.

Each parameter is replaced, under the same name, by a DTensor shard on the whole mesh
(simplesharded/storage/layout.py). The owning module's class is swapped for a subclass with one
property per parameter name, so ``module.weight`` inside the root's ``forward`` returns the
parameter gathered over its data-parallel dims and outside it the shard, as FSDP2's reads
(simplesharded/storage/gather.py); ``_parameters`` holds the shards, so ``named_parameters()``
and ``state_dict()`` keep their keys and never gather.
The root's forward, and the forward of a submodule called on its own outside it, opens the
model's gather scope and, uncompiled, eager resharding (simplesharded/storage/forward_scope.py).

Invariant: a module is wrapped at most once; wrapping changes its class and its parameters,
and everything else it records about the module goes into that module's one state object
(simplesharded/storage/sharded_state.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate

from simplesharded.ac_wrappers import compile_checkpoint_wrappers
from simplesharded.blocks import BlockSpec, block_of
from simplesharded.fsdp2_methods import ROOT_METHODS, UNIT_METHODS
from simplesharded.storage.forward_scope import call_forward, cast_floats, root_forward
from simplesharded.storage.gather import _GatherScope, _sharded_property
from simplesharded.storage.grad_sync import _GradSync
from simplesharded.storage.choice import (NOT_GIVEN, check_offload, check_storage,
                                          chosen_storage, pack, resolved)
from simplesharded.storage.offload import check_host_group, offload_choice
from simplesharded.storage.ragged_shards import members_as_shards, refresh_resident
from simplesharded.storage.layout import _DPView, _mode_placements, _shard_param
from simplesharded.mesh import EP_DIM, dense_mesh, ep_dim, expert_dp_mesh, stage_mesh
from simplesharded.mesh import dp_mesh as _dp_mesh
from simplesharded.storage.sharded_state import (ShardedModuleState, ShardedParam, _GatherSpec,
                                         attach_sharded_state, sharded_state, swap_class)
from simplesharded.shims import gloo_gather
from simplesharded.storage.uninitialised import InitCheck, uninitialised_like

GRAD_REDUCTIONS = ("sum", "avg")
RESHARD_CHOICES = (True, False, "auto")
# Config/CLI spelling of reshard_after_forward (config.py, simplesharded/tools/report.py) → data_parallel's.
RESHARD_BY_NAME = {"always": True, "never": False, "auto": "auto"}


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``param_dtype``: dtype of the gathered parameter (the all-gather runs in it).
    ``reduce_dtype``: dtype the gradient is reduced in before it lands on the fp32 shard.
    ``output_dtype``: dtype the root's floating-point outputs are cast to (FSDP2's knob: e.g.
    fp32 logits for the loss from a bf16 model). ``None`` keeps what the model produced (for
    the first two: the parameter's own dtype)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True  # cast floating-point inputs of the root to param_dtype


def _check_device(model: nn.Module, mesh: DeviceMesh) -> None:
    for fqn, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.device.type not in ("meta", mesh.device_type):
            raise ValueError(
                f"{fqn} is on device {t.device.type!r} but the mesh is on {mesh.device_type!r}; "
                f"move the model to {mesh.device_type!r} or build it on 'meta'")


def data_parallel(model: nn.Module, mesh: DeviceMesh, mode: str = "fully_shard",
                  mp_policy: MixedPrecisionPolicy | None = None,
                  reshard_after_forward: bool | str = "auto",
                  grad_reduction: str = "avg",
                  blocks: Sequence[BlockSpec] | None = None,
                  storage: str | None = None, *, flat_buckets=NOT_GIVEN,
                  offload="none") -> nn.Module:
    """Shard ``model`` in place over ``mesh`` and return it.

    mode: ``replicate`` (DDP-like), ``fully_shard`` (FSDP/ZeRO-3) or ``hybrid_shard``
    (replicate over mesh dim 0, shard over dim 1; needs a 2-D mesh of dp dims).
    mesh: from :func:`simplesharded.mesh.build_mesh`; its tp and ep dims are for parameters
    that are DTensors there already (simplesharded/storage/layout.py): apply TP / expert parallelism
    first. Or a mesh built elsewhere (``init_device_mesh``, unnamed or not) of data-parallel
    dims only: 1-D shards over it, 2-D is (replicate, shard) for ``hybrid_shard``
    (mesh.mesh_roles).
    reshard_after_forward: ``True`` frees every gathered parameter after forward and
    re-gathers it in backward (ZeRO-3); ``False`` keeps them all until backward (ZeRO-2 memory
    for parameters); ``"auto"`` lets the compiled plan decide per block: the plain and
    block-bucketing backends keep the last block and what follows it (backward needs them
    first, as torchtitan's and FSDP2's defaults do), the autobucketing backends keep trailing
    blocks while their bytes fit the plan's memory budget (passes/recompute.py).
    Uncompiled, the same choice holds for what autograd saves for backward: ``True`` re-gathers
    each saved parameter in backward, ``False`` keeps them, ``"auto"`` keeps those read in
    the last block (in module order) and after it (``_EagerReshard``).
    grad_reduction: ``avg`` (default; the mean over the data-parallel ranks, as DDP and FSDP2:
    gradients are pre-divided by the data-parallel size, then summed) or ``sum`` (normalise
    the loss by the global token count yourself, as the trainer does).
    blocks: which modules are the model's blocks (one bucket each under
    ``*_blockbucketing``, the units of ``"auto"``): None finds them in the module tree
    (simplesharded/blocks.py); or module classes, class names or module-FQN regexes.
    storage: ``"auto"`` (None: the default), ``"ragged"`` or ``"param"``. ``"auto"`` is
    ``"ragged"`` wherever it takes ``mode`` and the mesh, else ``"param"``
    (simplesharded/storage/choice.py). ``"param"``: one DTensor shard per
    parameter. ``"ragged"``: each bucket (a block's parameters; those before the first block;
    those after the last) in the ragged layout (simplesharded/storage/ragged_shards.py,
    docs/zero_copy.md): every gathered parameter is a view of its bucket's gathered buffer, so
    a gather copies nothing in or out. The parameters are still the model's own, under their
    names and global shapes (FSDP2's contract: param groups, per-parameter learning rates,
    freezing after wrapping, torch's ``clip_grad_norm_``): each a DTensor whose local tensor
    is this rank's run of it, a view of its bucket (simplesharded/storage/ragged_member.py);
    ``state_dict()`` gives them as ``"param"`` does. It takes ``fully_shard`` on a mesh of one
    dp dim or two (a bucket is then cut over their ranks flattened row-major, the order of the
    members' nested ``(Shard(0), Shard(0))``, and gathered and reduce-scattered over one group
    of all of them) or ``hybrid_shard`` on two (the gradient's all-reduce over the replicas
    follows the bucket's reduce-scatter), with or without tp and ep dims (a block's TP shards,
    its parameters replicated over tp and its expert weights are separate buckets); another
    mode: a ValueError. Tied parameters, and those frozen before wrapping, stay on their own.
    offload: where the shards live between uses (simplesharded/storage/offload.py):
    ``"none"`` (the compute device, the mesh's device type); ``"optimizer"`` (ZeRO-Offload:
    gradients reduced on the device, then copied to the host, where the parameters the
    optimizer steps and its state live; a resident copy on the device, refreshed before each
    forward, is what the gathers read); ``"params"`` (the shards, their gradients and the
    optimizer's state on the host, pinned for an accelerator; each gather reads a copy made
    right before it, each reduced gradient is copied back). FSDP2's ``CPUOffloadPolicy`` is
    ``"params"`` (with its ``pin_memory``), its base ``OffloadPolicy`` and ``None``
    ``"none"``. It takes ragged buckets (``storage`` ragged or auto where that is ragged);
    tied parameters and those frozen before wrapping, which stay out of buckets, stay on the
    device.
    ``flat_buckets``: storage's former name, deprecated: ``False`` is ``"param"``, ``"ragged"``
    is ``"ragged"``; ``True`` (flat buffers) is retired, a ValueError.
    A parameter read more than once in one forward of ``model`` (tied weights, a module called
    twice) is gathered once; its gradient is summed locally and reduced once (eager: tied
    weights only, so an uncompiled gather never outlives its block).
    A model on the meta device gets uninitialised shards on the mesh's device: initialise them
    with :func:`simplesharded.init_sharded` (simplesharded/storage/init.py), which gives the same
    values at any world size and layout.
    On a gloo mesh (and only there), the first call gives torch's functional all-gather a CPU
    kernel that runs gloo's plain all-gather (simplesharded/shims/gloo_gather.py: torch's own
    runs a coalesced one that can corrupt the heap), for every CPU gather in the process,
    compiled or not; ``gloo_gather.uninstall()`` gives torch's kernel back.
    A mesh with a pp dim (``init_mesh(pp=N)``): ``model`` is this rank's pipeline stage, sharded
    over this rank's dp dims only, on the mesh without pp (mesh.stage_mesh).
    """
    mesh = stage_mesh(mesh)
    dense = dense_mesh(mesh)
    dp = _dp_mesh(dense)
    placements = _mode_placements(mode, dp)
    if not (isinstance(reshard_after_forward, bool) or reshard_after_forward == "auto"):
        raise ValueError(f"reshard_after_forward={reshard_after_forward!r} is not one of "
                         f"{list(RESHARD_CHOICES)}")
    storage = resolved(chosen_storage(storage, flat_buckets), mode, dp.ndim)
    check_storage(storage, mode, dp.ndim, mesh)
    offload = offload_choice(offload)
    check_offload(offload[0], storage, mode)
    check_host_group(offload[0], mesh)
    if grad_reduction not in GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduction={grad_reduction!r} is not one of {sorted(GRAD_REDUCTIONS)}")
    _check_unwrapped(model)
    _check_device(model, mesh)
    from_meta = any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
    init_check = InitCheck(mesh) if from_meta else None
    if any(dist.get_backend(dp.get_group(i)) == "gloo" for i in range(dp.ndim)):
        gloo_gather.install()  # gloo's plain all-gather, not its racy coalesced one
    mp_policy = mp_policy or MixedPrecisionPolicy()
    spec = _GatherSpec(
        replicate=(Replicate(),) * dp.ndim, grad_placements=(Partial(),) * dp.ndim,
        param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype,
        grad_scale=1.0 / dp.size() if grad_reduction == "avg" else 1.0,
        reshard_after_forward=reshard_after_forward, hybrid=mode == "hybrid_shard",
        dp_mesh=dp if dp is not dense else None,
        dp_groups=tuple(dp.get_group(i).group_name for i in range(dp.ndim)),
        grad_sync=_GradSync())
    views = {None: _DPView(dense, dp, placements, spec)}
    if ep_dim(mesh):
        # Expert weights: the dp dims EP left them. Their gradient is still the sum over all
        # dp ranks' tokens (EP's all-to-all brings them), so "avg" scales by 1/dp as above.
        edp = expert_dp_mesh(mesh)
        views[EP_DIM] = _DPView(mesh, edp, _mode_placements(mode, edp), dataclasses.replace(
            spec, replicate=(Replicate(),) * edp.ndim, grad_placements=(Partial(),) * edp.ndim,
            dp_mesh=edp, dp_groups=tuple(edp.get_group(i).group_name for i in range(edp.ndim))))

    block_of_module = block_of(model, blocks)  # module → its block, blocks in module order
    scope = _GatherScope(reshard_after_forward,
                         last_block=next(reversed(block_of_module.values()), None))
    # id(original param) → its one shard and record: tied parameters share both (the FQN and
    # block of the first owner, as named_parameters() reports it)
    shards: dict[int, tuple[nn.Parameter, ShardedParam]] = {}
    owners = []  # (module name, module, its parameter names), in module order
    # what a submodule called on its own casts its inputs to, as the root's pre-hook does (and
    # its outputs to, as the root's forward does)
    input_dtype = mp_policy.param_dtype if mp_policy.cast_forward_inputs else None
    for mod_name, module in list(model.named_modules()):
        names = [n for n, p in module._parameters.items() if p is not None]
        # a module holding none, itself or below it, neither reads nor calls a sharded one
        if module is not model and next(module.parameters(), None) is None:
            continue
        owners.append((mod_name, module, names))
        for name in names:
            param = module._parameters[name]
            if id(param) not in shards:
                fqn = f"{mod_name}.{name}" if mod_name else name
                shard, layout, param_spec = _shard_param(param, mesh, views, fqn)
                shards[id(param)] = (
                    nn.Parameter(shard, requires_grad=param.requires_grad),
                    ShardedParam(fqn, param_spec, layout, block_of_module.get(mod_name)))
            else:
                scope.tied.add(shards[id(param)][1].fqn)
    pack(storage, model, shards, scope, tuple(views.values()), offload)
    for mod_name, module, names in owners:
        records = {}
        for name in names:
            module._parameters[name], records[name] = shards[id(module._parameters[name])]
        attach_sharded_state(module, ShardedModuleState(
            params=records, scope=scope, grad_sync=spec.grad_sync,
            original_class=type(module), read_block=block_of_module.get(mod_name),
            root=module is model))
        _swap_class(module, names, input_dtype, mp_policy.output_dtype, init_check)
    _scope_root_forward(model, mp_policy.output_dtype, init_check)
    compile_checkpoint_wrappers(model)
    if offload[0] == "optimizer":
        model.register_forward_pre_hook(refresh_resident)
    for module in model.modules():  # buffers are replicated plain tensors on the mesh device
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device.type != mesh.device_type:
                module._buffers[name] = uninitialised_like(buf, mesh.device_type)
    if mp_policy.param_dtype is not None and mp_policy.cast_forward_inputs:
        model.register_forward_pre_hook(_input_caster(mp_policy.param_dtype), with_kwargs=True)
    return model


def _check_unwrapped(model: nn.Module) -> None:
    """One line for a model, or a module of it, that ``data_parallel`` wrapped already: FSDP2's
    habit of one ``fully_shard`` per layer, then the root's, is one call here."""
    wrapped = next(((n, m) for n, m in model.named_modules() if sharded_state(m) is not None),
                   None)
    if wrapped is None:
        return
    name, module = wrapped
    if not name:
        raise ValueError("model is already wrapped by data_parallel; wrap it once")
    cls = sharded_state(module).original_class.__name__
    raise ValueError(f"{name} ({cls}) is already wrapped by data_parallel: call it once, on "
                     f"the root, with a model not yet wrapped. FSDP2's fully_shard per layer "
                     f"and then the root is data_parallel(model, mesh, blocks=[{cls}]) here "
                     f"(blocks are found without it too): each block gathers and reduces as "
                     f"one unit")


def _input_caster(dtype: torch.dtype):
    def cast(module, args, kwargs):
        return cast_floats(dtype, args), cast_floats(dtype, kwargs)

    return cast


def _swap_class(module: nn.Module, names: list[str], input_dtype: torch.dtype | None,
                output_dtype: torch.dtype | None, init_check: InitCheck | None) -> None:
    """Give ``module`` a subclass of its class: a property per sharded parameter in ``names``
    (gather.py) and, below the root, a forward that gathers when the module is called on its
    own (forward_scope.py), casting its floating-point inputs to ``input_dtype`` and its
    outputs to ``output_dtype`` (each if set) and checking a meta-built model's shards were
    initialised (``init_check``); and FSDP2's per-unit methods
    (fsdp2_methods.py)."""
    cls = module.__class__
    attrs: dict = {n: _sharded_property(n) for n in names}
    if not sharded_state(module).root and cls.forward is not nn.Module.forward:
        # (a ModuleList has none)
        attrs["forward"] = call_forward(cls.forward, input_dtype, output_dtype, init_check)
    if not attrs:
        return
    attrs.update(_fsdp2_methods(cls, UNIT_METHODS))
    swap_class(module, f"Sharded{cls.__name__}" if names else cls.__name__, attrs)


def _scope_root_forward(model: nn.Module, output_dtype: torch.dtype | None = None,
                        init_check: InitCheck | None = None) -> None:
    """Make ``model.forward`` the root's (forward_scope.py), with FSDP2's methods
    (fsdp2_methods.py)."""
    cls = model.__class__
    swap_class(model, cls.__name__, {
        "forward": root_forward(cls.forward, output_dtype, init_check),
        **_fsdp2_methods(cls, ROOT_METHODS)})


def _fsdp2_methods(cls: type, methods: dict) -> dict:
    """FSDP2's methods the class does not define itself (a model's own method wins)."""
    return {name: fn for name, fn in methods.items() if getattr(cls, name, fn) is fn}


@contextlib.contextmanager
def disable_gather(model: nn.Module) -> Iterator[nn.Module]:
    """Within this context, reading a parameter of ``model`` returns its DTensor shard in
    forward too (outside forward a read always does), and a ragged bucket's members are
    per-parameter ``Shard(0)`` DTensors, written back into the bucket at the end
    (ragged_shards.members_as_shards: every rank enters it together): for code that writes
    ``Shard(0)`` chunks (``distribute_tensor``'s, a loader's), which a member's run is not."""
    states = [s for s in map(sharded_state, model.modules()) if s is not None]
    previous = [s.gather_enabled for s in states]
    for s in states:
        s.gather_enabled = False
    try:
        with members_as_shards(model):
            yield model
    finally:
        for s, prev in zip(states, previous):
            s.gather_enabled = prev
