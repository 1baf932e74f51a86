"""Pipeline parallelism over ``data_parallel`` stages: torch.distributed.pipelining's stages and
schedules, with FSDP across a stage's micro-batches.

``pipeline(model, mesh, ...)`` is the whole of it for one rank: it cuts ``model`` into stages
(simplesharded/pipeline/stage_split.py), hands each of this rank's stages to ``prepare`` (tensor / expert
parallelism, activation checkpointing, ``data_parallel``, compile: the trainer's recipe), and
returns a :class:`Pipeline` whose ``step(inputs, labels)`` runs one schedule step.
``pipeline_stage(...)`` wraps one stage module (simplesharded/pipeline/stage_split.py cut it; it is a
``data_parallel`` root, compiled or not) in a :class:`ShardedStage`, torch's ``PipelineStage``
with the data-parallel behaviour torch leaves to its ``*_maybe_with_nosync`` and
``perform_reduce_grad`` hooks (which know only DDP and FSDP2); ``build_schedule(...)`` makes
the named schedule over a rank's stages, with ``scale_grads=False``: the loss function divides
by the global token count itself, so the summed micro-batch gradients are the one-process
gradients.

FSDP across micro-batches, ``policy``:

- ``"every_microbatch"``: each micro-batch's forward gathers (compiled: inside its graph) and
  its backward reduces, as without a pipeline. Gradients stay sharded.
- ``"reduce_once"``: every forward runs with gradient sync off (simplesharded/storage/grad_sync.py),
  so backwards sum full-size gradients on the rank, and after the stage's last backward the
  schedule's reduction point (``perform_reduce_grad``) reduces them once
  (simplesharded/storage/deferred_reduce.py): one collective per stage and step instead of one per
  micro-batch and bucket. Not "sync on for the last micro-batch": under 1F1B the last
  forward runs before earlier micro-batches' backwards, when the sums are not yet complete.
  Memory: the stage's gradients unsharded between its first backward and the reduction.
  Every rank decides alike: the setting is the policy's, never a rank's state.
- ``"gather_once"``: reduce_once's backwards and reduction, and the stage's first forward of a
  step all-gathers its parameters once (simplesharded/storage/gather_once.py: one collective per
  bucket of like-sharded parameters) and keeps them, so no micro-batch gathers; they are
  released at the reduction point. Traffic: one gather and one reduction per stage and step,
  whatever the number of micro-batches. Memory: the stage's parameters and gradients
  unsharded through the step. (Gathering once but reducing every micro-batch is not offered:
  held parameters have no autograd path back to the shards.)

Zero-bubble schedules split a backward into the inputs' part (I) and the weights' part (W).
Eager, W runs autograd on the leaves that receive the weights' gradients: the shards with sync
on, the rank-local accumulators (grad_sync.py) with sync off. Compiled, a stage's forward is
one autograd node that computes both parts at once: I runs the full backward and W has nothing
left to do (the schedule still orders the stages' work; only the I/W overlap is lost); so does
an eager stage whose output is a view (tensor parallelism's gathered output).

Only the ranks holding the same stages compile the same collectives, so the rank-agreement
check (passes/agreement.py) compares each rank with those (:func:`pipeline_peers`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
from torch.distributed.pipelining._backward import (stage_backward, stage_backward_input,
                                                    stage_backward_weight)
from torch.distributed.pipelining.schedules import (BACKWARD_INPUT, BACKWARD_WEIGHT,
                                                    FULL_BACKWARD)

from simplesharded.storage.deferred_reduce import reduce_accumulated
from simplesharded.storage.gather_once import gather_held, release_held
from simplesharded.storage.grad_sync import set_requires_gradient_sync
from simplesharded.mesh import PP_DIM, dim_size, stage_mesh
from simplesharded.passes.agreement import set_agreement_peers
from simplesharded.pipeline.stage_split import cut_stages, merged_view, stages_of_rank

# Schedule name (the trainer's parallelism.pipeline_parallel_schedule) → (torch class, where
# its stages live: stage_split.stage_to_rank's style).
SCHEDULES = {"1F1B": (Schedule1F1B, "loop"), "Interleaved1F1B": (ScheduleInterleaved1F1B, "loop"),
             "InterleavedZeroBubble": (ScheduleInterleavedZeroBubble, "loop"),
             "ZBVZeroBubble": (ScheduleZBVZeroBubble, "v")}
POLICIES = ("every_microbatch", "reduce_once", "gather_once")
AUTO = "auto"  # pipeline()'s policy chosen per stage by auto_policy
DEFERRED = ("reduce_once", "gather_once")  # the policies whose backwards accumulate on the rank


class ShardedStage(PipelineStage):
    """A ``PipelineStage`` whose module is a ``data_parallel`` root (module doc). ``run``: the
    callable a forward calls (the compiled module, or the root itself)."""

    def __init__(self, root: nn.Module, run: Callable, stage_index: int, num_stages: int,
                 device: torch.device, group, policy: str, compiled: bool,
                 input_args, output_args):
        if policy not in POLICIES:
            raise ValueError(f"pipeline FSDP policy={policy!r} is not one of {list(POLICIES)}")
        super().__init__(root, stage_index, num_stages, device, input_args=input_args,
                         output_args=output_args, group=group)
        self.root, self.run, self.policy, self.compiled = root, run, policy, compiled
        self.reductions = 0  # collectives issued by the deferred reductions (tests, logs)
        self.gathers = 0  # collectives issued by gather_once's gathers (tests, logs)
        self.holding = False

    def forward_maybe_with_nosync(self, *args, **kwargs):
        if self.policy in DEFERRED and torch.is_grad_enabled():
            set_requires_gradient_sync(self.root, False)
            if self.policy == "gather_once" and not self.holding:  # the step's first forward
                self.gathers += gather_held(self.root)
                self.holding = True
        return self.run(*args, **kwargs)

    def _grad_leaves(self) -> list[torch.Tensor]:
        """Where the weights' gradients land: the shards, or with sync off the accumulators."""
        from simplesharded.storage.sharded_state import sharded_state

        sync = sharded_state(self.root).grad_sync
        if sync.sync:
            return [p for p in self.root.parameters() if p.requires_grad]
        return list(sync.acc.values())

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward=False):
        if backward_type == "weight":
            if not bwd_kwargs["param_groups"]:  # the input backward did it all (module doc)
                return (), None
            return stage_backward_weight(self._grad_leaves(), bwd_kwargs["param_groups"]), None
        outputs, grads = bwd_kwargs["stage_output"], bwd_kwargs["output_grads"]
        # torch's input backward frees the outputs' graph with an in-place detach, which a
        # view (a tensor-parallel stage's gathered output) does not allow: such a stage runs
        # its whole backward there, as a compiled one does
        views = any(isinstance(t, torch.Tensor) and t._is_view()
                    for t in (outputs if isinstance(outputs, (tuple, list)) else [outputs]))
        if backward_type == "input" and not self.compiled and not views:
            return stage_backward_input(outputs, grads, bwd_kwargs["input_values"],
                                        iter(self._grad_leaves()))
        if grads is None and isinstance(outputs, (tuple, list)):
            outputs = outputs[0]  # the last stage's loss, which the input path wrapped
        result = stage_backward(outputs, grads, bwd_kwargs["input_values"])
        return result, ([] if backward_type == "input" else None)

    def _get_init_p2p_neighbors_ops(self) -> list:
        # torch 2.11's schedules warm the pp group up by sending to each neighbour stage (2.12
        # on: a vote this method takes no part in), the V's middle stages' neighbour on this
        # very rank too; gloo has no pair to itself ("Pair is not connected"), and a stage on
        # this rank needs no warm-up
        return [op for op in super()._get_init_p2p_neighbors_ops()
                if op.group_peer != self.group_rank]

    def perform_reduce_grad(self, grad_scale_factor: int):
        if self.policy in DEFERRED:
            self.reductions += reduce_accumulated(self.root)
        if self.holding:
            release_held(self.root)
            self.holding = False
        if grad_scale_factor != 1:
            self.scale_grads(grad_scale_factor)


@contextlib.contextmanager
def _backward_actions_skipped(schedule):
    """Within: the backward actions of a runtime schedule (the interleaved and V ones) only
    consume the (empty) gradient receives posted for them. Its ``eval`` still walks them, and
    for a V's two stages on one rank it hands the later stage's input gradient to the earlier
    one, which fails when there is none (no backward in eval)."""
    table = getattr(schedule, "_comp_type_to_function_map", None)
    if table is None:
        yield
        return
    saved = dict(table)
    for kind in (FULL_BACKWARD, BACKWARD_INPUT):
        schedule.register_custom_function(kind, _take_grad_receives)
    schedule.register_custom_function(BACKWARD_WEIGHT, _nothing)
    try:
        yield
    finally:
        table.clear()
        table.update(saved)


def _nothing(action, ctx) -> None:
    return None


def _take_grad_receives(action, ctx) -> None:
    works = ctx.schedule_ref.bwd_recv_ops.pop((action.stage_index, action.microbatch_index), [])
    for work in works:
        work.wait()


def pipeline_peers(mesh) -> list[int]:
    """The global ranks holding this rank's stages: its coordinate on every dim but pp."""
    return sorted(int(r) for r in stage_mesh(mesh).mesh.flatten().tolist())


def pipeline_stage(root: nn.Module, run: Callable, stage_index: int, num_stages: int, mesh,
                   policy: str = "reduce_once", compiled: bool = False,
                   input_args=None, output_args=None) -> ShardedStage:
    """One stage of the pipeline on ``mesh`` (with a pp dim: ``init_mesh(pp=N)``), over its pp
    group. ``input_args`` / ``output_args``: tensors (meta will do), or tuples of them,
    shaped as one micro-batch's input and output (what a stage receives and sends), so no
    forward runs to find them; floating-point ones carry gradients. Sets the rank-agreement
    peers (module doc)."""
    names = mesh.mesh_dim_names or ()
    if PP_DIM not in names:
        raise ValueError(f"pipeline_stage needs a mesh with a {PP_DIM!r} dim (init_mesh(pp=N)); "
                         f"got dims {names}")
    set_agreement_peers(pipeline_peers(mesh))
    input_args, output_args = _example(input_args), _example(output_args)
    device = torch.device(mesh.device_type, torch.accelerator.current_device_index()) \
        if mesh.device_type != "cpu" else torch.device("cpu")
    return ShardedStage(root, run, stage_index, num_stages, device, mesh[PP_DIM].get_group(),
                        policy, compiled, input_args, output_args)


def _example(args):
    """``args`` (a tensor, a tuple of them, or None) as meta tensors whose floating-point ones
    require grad: activations carry gradients back, and torch derives the gradient buffers
    from these flags."""
    if args is None:
        return None
    if isinstance(args, tuple):
        return tuple(_example(t) for t in args)
    return torch.empty_like(args, device="meta").requires_grad_(args.is_floating_point())


def build_schedule(name: str, stages: Sequence[ShardedStage], n_microbatches: int,
                   loss_fn: Callable):
    """The schedule ``name`` (:data:`SCHEDULES`) over this rank's ``stages``; gradients are not
    scaled by the number of micro-batches (module doc)."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule {name!r} is not one of {sorted(SCHEDULES)}")
    cls = SCHEDULES[name][0]
    if cls is Schedule1F1B:
        if len(stages) != 1:
            raise ValueError(f"schedule 1F1B runs one stage per rank; got {len(stages)}")
        return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(list(stages), n_microbatches, loss_fn=loss_fn, scale_grads=False)


@dataclass
class Pipeline:
    """This rank's part of a pipeline: its stage modules (``data_parallel`` roots, in stage
    order), their :class:`ShardedStage` s, the schedule over them, and ``model``, one module
    holding the stages' modules under the model's own names (the optimizer's parameters, a
    checkpoint's keys: stage_split.merged_view)."""

    modules: list[nn.Module]
    stages: list[ShardedStage]
    schedule: object
    model: nn.Module
    peer_group: object  # the process group of pipeline_peers: every rank of these stages

    @property
    def has_first(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def has_last(self) -> bool:
        return any(s.is_last for s in self.stages)

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor] | None:
        """One schedule step on this rank's batch (split into the schedule's micro-batches on
        dim 0): forwards, the loss on the last stage, backwards, the policy's reductions.
        Every rank of a pp group calls it; the first stage reads ``inputs``, the last
        ``labels``. Returns each micro-batch's loss where the last stage lives, else None."""
        return self._run(self.schedule.step, inputs, labels)

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor] | None:
        """As :meth:`step`, forwards only (the schedule's ``eval``): validation."""
        with _backward_actions_skipped(self.schedule):
            return self._run(self.schedule.eval, inputs, labels)

    def _run(self, schedule_call, inputs, labels) -> list[torch.Tensor] | None:
        """``schedule_call`` with the inputs on the first stage and the labels on the last."""
        losses = [] if self.has_last else None
        # contiguous: torch 2.11's stages check a micro-batch's strides against the example's,
        # and a window cut from a longer batch (tokens[:, :-1]) has the longer row's stride
        schedule_call(*((inputs.contiguous(),) if self.has_first else ()),
                      target=labels if self.has_last else None, losses=losses)
        return losses

    def update_expert_bias(self) -> None:
        """The MoE stages' load-balancing bias update (models/moe.py), with each stage's expert
        counts summed over the ranks of that stage only."""
        for module in self.modules:
            if hasattr(module, "update_expert_bias"):
                module.update_expert_bias(group=self.peer_group)

    @property
    def reductions(self) -> int:
        """Collectives the deferred reductions issued so far, over this rank's stages."""
        return sum(s.reductions for s in self.stages)

    @property
    def gathers(self) -> int:
        """Collectives the gather-once gathers issued so far, over this rank's stages."""
        return sum(s.gathers for s in self.stages)


def pipeline(model: nn.Module, mesh, *, schedule: str, n_microbatches: int, loss_fn: Callable,
             prepare: Callable[[nn.Module], Callable], microbatch: torch.Tensor,
             hidden: torch.Tensor, output: torch.Tensor, n_stages: int | None = None,
             layers_per_stage: Sequence[int] | None = None, policy: str = "reduce_once",
             memory_cap_mb: float = 0.0, param_dtype: torch.dtype = torch.float32) -> Pipeline:
    """This rank's stages of ``model`` (built on the meta device, or with storage) on ``mesh``
    (with a pp dim), and the schedule ``schedule`` over them.

    prepare: called on each of this rank's stage modules, in stage order; it must make the
    stage a ``data_parallel`` root on ``mesh`` and return what a forward calls (the stage, or
    its compiled form). microbatch, hidden, output: tensors (meta will do) shaped as one
    micro-batch of the first stage's input, of what stages pass on, and of the last stage's
    output (fed to ``loss_fn(output, labels)``). n_stages: default one per pp rank for 1F1B,
    two for the others; layers_per_stage: blocks per stage (default an even split). policy:
    one of :data:`POLICIES` for every stage, or ``"auto"``: :func:`auto_policy` per stage, from
    ``memory_cap_mb`` and ``param_dtype``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {sorted(SCHEDULES)}")
    pp = dim_size(mesh, PP_DIM)
    n_stages = n_stages or pp * (1 if schedule == "1F1B" else 2)
    ids = stages_of_rank(mesh.get_local_rank(PP_DIM), n_stages, pp, SCHEDULES[schedule][1])
    modules, stages = [], []
    for i, module in cut_stages(model, n_stages, ids, layers_per_stage):
        mine = auto_policy(module, memory_cap_mb, param_dtype) if policy == AUTO else policy
        run = prepare(module)
        stages.append(pipeline_stage(
            module, run, i, n_stages, mesh, mine, compiled=run is not module,
            input_args=microbatch if i == 0 else hidden,
            output_args=output if i == n_stages - 1 else hidden))
        modules.append(module)
    return Pipeline(modules, stages, build_schedule(schedule, stages, n_microbatches, loss_fn),
                    merged_view(modules), _peer_group(mesh))


def auto_policy(stage: nn.Module, memory_cap_mb: float, param_dtype: torch.dtype) -> str:
    """The policy ``"auto"`` gives a stage (before sharding: its parameters at full size):
    :func:`auto_policy_of` its parameter count."""
    return auto_policy_of(sum(p.numel() for p in stage.parameters()), memory_cap_mb,
                          param_dtype)


def auto_policy_of(numel: int, memory_cap_mb: float, param_dtype: torch.dtype) -> str:
    """``"auto"``'s rule for a stage of ``numel`` parameters (at full size; the planner asks
    too, simplesharded/tools/pp_forecast.py): ``gather_once`` when they, gathered in
    ``param_dtype``, fit the memory cap (``compile.memory_cap_mb``: gathered bytes alive at
    once, which gather_once keeps for the whole step), else ``reduce_once``; ``reduce_once`` too
    without a cap (0), which gives no room to judge by. Every rank of a stage decides alike
    (the same modules, the same cap)."""
    held = numel * torch.empty((), dtype=param_dtype, device="meta").element_size()
    if memory_cap_mb > 0 and held <= memory_cap_mb * 2**20:
        return "gather_once"
    return "reduce_once"


def _peer_group(mesh):
    """A process group of :func:`pipeline_peers` (made on every rank: one per pp coordinate)."""
    peers = stage_mesh(mesh)
    if peers.ndim == 1:
        return peers.get_group()
    pp = dim_size(mesh, PP_DIM)
    everyone = mesh.mesh.reshape(pp, -1).tolist()
    mine, _ = dist.new_subgroups_by_enumeration(everyone)
    return mine


__all__ = ["Pipeline", "pipeline", "ShardedStage", "pipeline_stage", "build_schedule",
           "pipeline_peers", "auto_policy", "auto_policy_of", "SCHEDULES", "POLICIES"]
