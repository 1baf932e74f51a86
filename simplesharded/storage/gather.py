"""Reading a sharded parameter: the gather on read and the reduction of its gradient.

``module.weight`` of a wrapped module is a property (:func:`_sharded_property`). Inside the
root's forward, or a submodule's called on its own (forward_scope.py), and in a backward's
recompute of either, it returns the parameter gathered over its
dp dims: under ``torch.compile`` a traced all-gather, whose gradient (a ``Partial`` placement)
autograd turns into a traced reduce-scatter (all-reduce for replicated mesh dims). Outside, it
returns what ``_parameters`` holds, as FSDP2's reads do: the sharded parameter (a DTensor, or a
ragged bucket's member), the leaf the optimizer steps, so a read makes no collective (one rank
may read alone), writes reach the shard (``model.init_weights()`` after sharding) and
``.grad`` is the shard's gradient; ``full_tensor()`` gathers it when every rank asks.

Invariant: every dp op a read issues is annotated with the parameter's FQN, dp groups,
reshard choice and block (passes/annotations.py), so the graph passes find the gathers and
reductions by annotation, never by graph shape; the model-parallel re-wrap stays outside the
annotation (TP's and EP's collectives are their modules' business). A parameter's gradient is
reduced over its own dp dims only. Traced, a read is one op (``simplesharded::gather_read``)
whose body is the eager read: the same aten ops in the graphs aot_autograd makes, at a fraction
of dynamo's time.
"""
from __future__ import annotations

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from simplesharded.storage.layout import _is_hybrid
from simplesharded.storage.prefetch import EagerPrefetch
from simplesharded.storage.ragged_shards import _in_backward
from simplesharded.passes.annotations import BLOCK_KEY, DP_GROUPS_KEY, PARAM_KEY, RESHARD_KEY
from simplesharded.storage.sharded_state import (EagerReshardProtocol, ShardedParam, read_record,
                                         sharded_state)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient (gloo has no AVG op: "avg" is sum × 1/dp).
    At scale 1 its backward is a view: the annotated op where a gradient enters its
    reduction, which a backward traced by dynamo is annotated from (passes/traced_backward.py).
    The backward runs under the read's annotation itself: a traced read's body is one op
    (_read_op), so its backward is traced by aot_autograd after the forward's annotation ended."""

    @staticmethod
    def forward(ctx, x, scale, annotation):
        ctx.scale, ctx.annotation = scale, annotation
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        with fx_traceback.annotate(ctx.annotation):
            return (grad * ctx.scale if ctx.scale != 1.0 else grad.view_as(grad)), None, None


def gather_param(shard: DTensor, param: ShardedParam) -> torch.Tensor:
    """Shard → full local tensor in param_dtype (the model-parallel DTensor when
    ``param.mp_layout`` is set); its gradient is reduced back onto the shard over the
    parameter's dp dims only. A parameter held gathered (simplesharded/storage/gather_once.py) is read
    from there: no collective, its gradient to the rank-local accumulator.

    All dp ops are annotated with the parameter FQN so graph passes can find them in the
    forward, joint and backward graphs without guessing from graph shape. The model-parallel
    re-wrap is outside the annotation: TP collectives (e.g. the all-reduce of a replicated
    norm weight's gradient under sequence parallelism) belong to TP, not to the dp passes.
    """
    spec, mp = param.spec, param.mp_layout
    held = _held(param)
    if held is not None:
        local = spec.grad_sync.route(held, param.fqn)
    else:
        local = _gathered(shard, param)
    if mp is not None:
        local = DTensor.from_local(local, mp.mesh, (mp.placement,), run_check=False,
                                   shape=mp.shape, stride=mp.stride)
    return local


def _held(param: ShardedParam) -> torch.Tensor | None:
    """The full tensor gathered once for several forwards (simplesharded/storage/gather_once.py), if
    any: its gradient reaches the accumulators only, so sync must be off."""
    sync = param.spec.grad_sync
    return sync.held_for(param.fqn) if sync is not None else None


def _gathered(shard: DTensor, param: ShardedParam) -> torch.Tensor:
    """The dp all-gather of gather_param, annotated, with its gradient's reduction."""
    annotation = _annotation(param)
    # Traced, the read is one op (see _READ_LIB); eager, its body runs as it is.
    local = (torch.ops.simplesharded.gather_read(shard, param.read_key)
             if torch.compiler.is_compiling() else _read(shard, param, annotation))
    if param.spec.grad_sync is not None:
        # Outside the op: it reads and pops the model's pending gradients (Python state that
        # an op, whose body runs once more per trace, must not touch).
        with fx_traceback.annotate(annotation):
            local = param.spec.grad_sync.route(local, param.fqn)
    return local


def _annotation(param: ShardedParam) -> dict:
    spec = param.spec
    annotation = {PARAM_KEY: param.fqn, DP_GROUPS_KEY: spec.dp_groups,
                  RESHARD_KEY: spec.reshard_after_forward}
    if param.block is not None:
        annotation[BLOCK_KEY] = param.block
    return annotation


def _read(shard: DTensor, param: ShardedParam, annotation: dict) -> torch.Tensor:
    """The annotated gather of the parameter's ``shard`` over the dp dims, with the reduction
    of its gradient."""
    spec = param.spec
    with fx_traceback.annotate(annotation):
        if spec.dp_mesh is not None:
            # The dp part of the shard as a DTensor on the dp dims only: its global tensor is
            # this rank's model-parallel shard (or the whole parameter when it is replicated
            # over tp). Without other dims the shard already is that.
            shard = param.dp_view(shard).wrap(shard.to_local())
        # "avg" scales the gradient once it is reduced, on the shard (1/dp of the elements),
        # except when it is reduced in float16, whose sum over ranks could overflow first.
        pre_scale = spec.scales_before_reduction(shard.dtype)
        if spec.grad_scale != 1.0 and not pre_scale:
            scaled = _ScaleGrad.apply(shard.to_local(), spec.grad_scale, annotation)
            shard = DTensor.from_local(scaled, shard.device_mesh, shard.placements, run_check=False,
                                       shape=shard.shape, stride=shard.stride())
        hybrid = spec.hybrid and _is_hybrid(shard.placements)
        if hybrid:
            shard = _reduce_replicas_after_scatter(shard)
        full = shard.redistribute(placements=spec.replicate, forward_dtype=spec.param_dtype,
                                  backward_dtype=spec.reduce_dtype)
        # Hybrid: the gradient is still partial over replicas here; the all-reduce over them
        # happens on the shard (see _reduce_replicas_after_scatter), not on the full tensor.
        grad_placements = (Replicate(), Partial()) if hybrid else spec.grad_placements
        local = full.to_local(grad_placements=grad_placements)
        # Always applied (an identity at scale 1): its backward op is where the gradient
        # enters the reduction, and carries this annotation into a backward traced by
        # dynamo, where the reduction is found by it (passes/traced_backward.py).
        return _ScaleGrad.apply(local, spec.grad_scale if pre_scale else 1.0, annotation)


# A traced read is one op whose body (_read) runs at the autograd level
# (CompositeImplicitAutograd): dynamo records one node and runs the body on fake tensors,
# instead of interpreting DTensor's Python op by op (about half of dynamo's time in a first
# compile of a sharded model: scripts/compile_cost.py), and aot_autograd traces the body into
# the same aten ops, annotations and autograd as an eager read. The string names the
# parameter's record (sharded_state.ShardedParam.read_key); records are registered when made.
_READ_LIB = torch.library.Library("simplesharded", "DEF")
_READ_LIB.define("gather_read(Tensor shard, str param) -> Tensor")


def _read_op(shard: DTensor, key: str) -> torch.Tensor:
    param = read_record(key)
    return _read(shard, param, _annotation(param))


_READ_LIB.impl("gather_read", _read_op, "CompositeImplicitAutograd")


def _reduce_replicas_after_scatter(shard: DTensor) -> DTensor:
    """Identity in forward. In backward the gradient arrives reduce-scattered over dp_shard but
    still partial over dp_replicate; re-labelling it (Partial, Shard(0)) makes autograd
    all-reduce it over the replicas at shard size: HSDP's reduce-scatter-then-all-reduce, which
    moves 1/dp_shard of the bytes of DTensor's default all-reduce-then-reduce-scatter."""
    if not torch.is_grad_enabled():  # no backward (eager resharding's re-gather inside one)
        return shard
    # The no-op redistribute is where the all-reduce lands: its backward brings the gradient
    # (labelled Partial over replicas by to_local below) back to (Replicate, Shard(0)).
    same = shard.redistribute(placements=shard.placements)
    local = same.to_local(grad_placements=(Partial(), shard.placements[1]))
    return DTensor.from_local(local, shard.device_mesh, shard.placements, run_check=False,
                              shape=shard.shape, stride=shard.stride())


def regather(module: nn.Module, name: str) -> torch.Tensor:
    """A fresh gather of ``module``'s sharded parameter ``name``, bypassing the forward's
    cache (eager resharding's re-gather in backward)."""
    return gather_param(module._parameters[name], sharded_state(module).params[name])


class _GatherScope:
    """Parameters gathered during one forward of the wrapped root (or of a submodule called on
    its own: forward_scope.py), by FQN: a parameter read twice (tied weights, a module called
    twice) is gathered once, and autograd sums its gradients at full size before the one
    reduction. Inactive outside such a forward: a read in a backward (activation
    checkpointing's recompute) gathers on its own, a read elsewhere is the shard.

    One dict for the model's life, emptied at both ends of the forward: under torch.compile
    the traced forward then ends with the dict as it began (empty), so no gathered tensor
    escapes the graph as an output (a fresh dict per forward would be rebuilt after the graph
    from its outputs: every gathered parameter alive at once)."""

    def __init__(self, reshard_after_forward: bool | str = "auto",
                 last_block: str | None = None):
        self.active = False
        self.traced = False  # opened inside a traced frame (forward_scope.py)
        self.gathered: dict = {}
        # ragged bucket name → its gathered members' views (ragged_shards.py)
        self.bucket_views: dict = {}
        self.eager_bucket: str | None = None  # uncompiled: the ragged bucket cached there
        # uncompiled, in a backward outside the forward (activation checkpointing's recompute):
        # (name, shard version, views) of the ragged bucket gathered last (ragged_shards.py)
        self.backward_views: tuple | None = None
        self.tied: set[str] = set()  # FQNs of parameters held by more than one module
        self.reshard_after_forward = reshard_after_forward
        self.last_block = last_block  # the last block in module order (blocks.py), if any
        # eager_reshard.py's _EagerReshard, set during an uncompiled forward with grad
        self.eager: EagerReshardProtocol | None = None
        self.prefetch = EagerPrefetch()  # uncompiled forwards' gathers issued ahead
        self.last_eager: EagerReshardProtocol | None = None  # the last forward's, until the next

    def drop_backward_views(self) -> None:
        self.backward_views = None


def _reads_gathered(scope) -> bool:
    """Whether a read gathers: inside a forward that opened the scope (forward_scope.py;
    compiled, the traced forward) or in a backward (torch.utils.checkpoint's recompute of part
    of it)."""
    return scope.active or torch.compiler.is_compiling() or _in_backward()


def _sharded_property(name: str) -> property:
    def get(self):
        state = sharded_state(self)
        param, shard, scope = state.params.get(name), self._parameters[name], state.scope
        if (param is None or shard is None or not state.gather_enabled
                or not _reads_gathered(scope)):
            return shard
        if param.ragged is not None:
            return param.ragged.read()  # a view of its bucket's gather (ragged_shards.py)
        fqn = param.fqn
        # Compiled, the graph decides what stays alive, so every read is cached. Eager, a
        # cached gather would outlive its block (and defeat torch.utils.checkpoint there):
        # only tied parameters, whose full tensor two modules need anyway, are cached.
        cache = scope.active and (fqn in scope.tied or torch.compiler.is_compiling())
        if cache and fqn in scope.gathered:
            full = scope.gathered[fqn]
        else:
            full = gather_param(shard, param)
        if cache:
            scope.gathered[fqn] = full
        # a held tensor stays gathered across forwards: nothing for eager resharding to free
        if (scope.eager is not None and not torch.compiler.is_compiling()
                and _held(param) is None):
            scope.eager.note(self, name, full)
        return full

    return property(get, doc=f"{name}: gathered in forward, the shard outside (simplesharded)")
