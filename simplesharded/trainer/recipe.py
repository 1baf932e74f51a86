"""The parallelization recipe, in its order: float8 linears (training.float8) → tensor
parallelism → expert parallelism → context parallelism → activation checkpointing →
data_parallel → torch.compile with our backend, per pipeline stage (:func:`parallelize`), and
what the step needs to know of it (loss chunks, loss parallelism, the pipeline's loss)."""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.fx.traceback as fx_traceback
from torch.distributed.tensor.parallel import parallelize_module

from simplesharded.backends import BACKENDS, BackendName, BackendOptions, make_backend
from simplesharded.blocks import find_blocks
from simplesharded.float8 import convert_to_float8
from simplesharded.mesh import cp_mesh, ep_dim, tp_dim
from simplesharded.models.context_parallel import apply_context_parallel
from simplesharded.models.loss import with_term
from simplesharded.passes.agreement import set_agreement_peers
from simplesharded.passes.annotations import AC_KEY, AC_TP_KEY
from simplesharded.passes.torch_compat import EXPERT_PARALLEL, needs
from simplesharded.sharding import MixedPrecisionPolicy, data_parallel
from simplesharded.trainer.config import Config
from simplesharded.trainer.config_checks import pipeline_stages


def apply_activation_checkpointing(model: torch.nn.Module, mode: str, every: int,
                                   compiled: bool = True, expert_parallel: bool = False,
                                   recompute_tp_outputs: bool = False) -> None:
    """Recompute block activations in backward (``full``: every block; ``selective``: every
    ``every``-th block). Blocks are the ones data_parallel buckets (simplesharded/blocks.py).
    FQNs stay unchanged.

    Compiled: the block is annotated and passes/recompute.py tags its ops in the joint graph
    (torch.utils.checkpoint's compiled form saves a DeviceMesh when DTensor parameters are
    gathered inside the region, which aot_autograd rejects), or, in a step graph
    (compile.scope=step), passes/step_recompute.py recomputes them; neither recomputes an
    all-to-all or a routing decision. Eager: torch.utils.checkpoint; with
    ``expert_parallel``, selectively: the all-to-alls' results and the top-k routing are
    saved from forward (:func:`_save_routing`), so the recomputation re-runs neither.
    ``recompute_tp_outputs`` (compiled): the block's tensor-parallel reduce-scatters run again
    in backward too (annotated ``ss_ac_tp``), where they are otherwise saved; eager
    checkpointing re-runs them anyway.
    """
    if mode == "none":
        return
    for i, (_, block) in enumerate(find_blocks(model)):
        if mode != "full" and i % every:
            continue
        if compiled:
            annotation = {AC_KEY: i, **({AC_TP_KEY: True} if recompute_tp_outputs else {})}
            block.forward = functools.partial(_annotated, block.forward, annotation)
        else:
            block.forward = functools.partial(
                _checkpointed, block.forward, context_fn=_save_routing if expert_parallel
                else None)


# Ops whose results eager activation checkpointing keeps from forward under expert
# parallelism: the token exchange (recomputing it would run it again, with every ep rank)
# and the routing choice.
_SAVED_UNDER_EP = (torch.ops._c10d_functional.all_to_all_single.default,
                   torch.ops.aten.topk.default)


def _save_routing():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return (CheckpointPolicy.MUST_SAVE if op in _SAVED_UNDER_EP
                else CheckpointPolicy.PREFER_RECOMPUTE)

    return create_selective_checkpoint_contexts(policy)


def _checkpointed(fn, *args, context_fn=None, **kwargs):
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **extra, **kwargs)


def _annotated(fn, annotation, *args, **kwargs):
    with fx_traceback.annotate(annotation):
        return fn(*args, **kwargs)


def not_a_router(model: torch.nn.Module):
    """training.float8's module filter: every Linear but a MoE layer's router (a Linear child
    of a module that holds ``experts``: models/moe.py's ``gate``, transformers' MoE blocks),
    whose scores choose the experts and stay in full precision."""
    routers = {id(child) for m in model.modules() if hasattr(m, "experts")
               for child in m.children() if isinstance(child, torch.nn.Linear)}
    return lambda fqn, module: id(module) not in routers


def loss_chunks(cfg: Config) -> int:
    """The model's ``loss_chunks`` (models/loss.py): the configured one, except under
    tensor parallelism, where chunking needs a plain output projection: there auto (0) means
    unchunked (config validation allows no other value)."""
    return 1 if cfg.parallelism.tensor_parallel_degree > 1 else cfg.training.loss_chunks


def uses_loss_parallel(cfg: Config) -> bool:
    p = cfg.parallelism
    return p.tensor_parallel_degree > 1 and p.enable_loss_parallel


def apply_tensor_parallel(model: torch.nn.Module, mesh, sequence_parallel: bool,
                          loss_parallel: bool = False) -> None:
    """Torch TP with the model's own styles on ``mesh["tp"]`` (nothing when the mesh has no tp
    dim): the first step of :func:`parallelize`, shared with the benchmark's TP peers."""
    if tp_dim(mesh):
        styles = model.tp_styles(sequence_parallel, loss_parallel)
        # a pipeline stage lacks the other stages' modules (None in its tree)
        present = {fqn for fqn, _ in model.named_modules()}
        parallelize_module(model, mesh[tp_dim(mesh)],
                           {k: v for k, v in styles.items() if k in present})


def apply_expert_parallel(model: torch.nn.Module, mesh) -> None:
    """The model's expert-parallel styles (models/moe.py ``ep_styles``) on ``mesh["ep"]``
    (nothing when the mesh has no ep dim). A torch without expert parallelism
    (passes/torch_compat.py) is refused in one line."""
    if ep_dim(mesh):
        needs(EXPERT_PARALLEL)
        parallelize_module(model, mesh[ep_dim(mesh)], model.ep_styles())


class _ScopedCalls:
    """A compiled model whose calls run under ``contexts`` (factories of dynamo config
    patches, e.g. models/ep_dispatch.py ``ep_compile_config``): the settings hold for its compiles
    and recompiles, which happen inside its calls, and never leak into other compiles."""

    def __init__(self, compiled, *contexts):
        self.compiled, self.contexts = compiled, contexts

    def __call__(self, *args, **kwargs):
        with contextlib.ExitStack() as stack:
            for context in self.contexts:
                stack.enter_context(context())
            return self.compiled(*args, **kwargs)


def parallelize(model: torch.nn.Module, mesh, cfg: Config, backend=None, observer=None,
                loss_fn=None):
    """float8 → TP → EP → CP → activation checkpointing → data_parallel → compile, in that
    order, on the model or, under pipeline parallelism, on each of this rank's stages; returns
    the callable a step runs (the compiled model, or the model itself), or the
    :class:`~simplesharded.pipeline.pipelining.Pipeline` of this rank's stages (``loss_fn``: the loss
    its last stage computes from the logits and the labels, :func:`pipeline_loss`).
    ``backend``: a torch.compile backend used instead of the configured one (``python -m
    simplesharded.tools.forecast`` captures the graphs with its own, so it traces what the
    trainer compiles). ``observer``: handed to the configured backend (``make_backend``),
    which shows it every graph our passes produce (the GPU smoke compares them with
    inductor's code)."""
    p, t, c = cfg.parallelism, cfg.training, cfg.compile
    pp = p.pipeline_parallel_degree
    pdt, rdt = getattr(torch, t.mixed_precision_param), getattr(torch, t.mixed_precision_reduce)
    mp = MixedPrecisionPolicy(pdt, rdt) if (pdt, rdt) != (torch.float32, torch.float32) else None

    def prepare(part: torch.nn.Module):
        if t.float8:  # first, on plain Linears (torchtitan's order too)
            convert_to_float8(part, not_a_router(part))
        apply_tensor_parallel(part, mesh, p.enable_sequence_parallel, uses_loss_parallel(cfg))
        apply_expert_parallel(part, mesh)
        cp = cp_mesh(mesh)  # mesh["cp"], or under EP the ep mesh's cp sibling
        if cp is not None:  # the model's attention over sequences split on it
            apply_context_parallel(part, cp)
        apply_activation_checkpointing(part, cfg.activation_checkpoint.mode,
                                       cfg.activation_checkpoint.selective_every,
                                       compiled=c.enable, expert_parallel=bool(ep_dim(mesh)),
                                       recompute_tp_outputs=(
                                           cfg.activation_checkpoint.recompute_tp_outputs))
        # Explicit: the trainer's own default is "sum" (data_parallel's is "avg"), with every
        # rank's loss divided by the global token count (train_step), so the reduced gradient
        # is the exact global mean whatever the ranks' token counts.
        data_parallel(part, mesh, p.mode, mp_policy=mp, reshard_after_forward=p.reshard,
                      grad_reduction=t.grad_reduction, storage=cfg.dp_storage(),
                      offload=p.offload)
        if not c.enable:
            return part
        return _compiled(part, mesh, cfg, backend, observer, pipeline_stages(p) // pp)

    if pp == 1:
        set_agreement_peers(None)  # one model: every rank compiles the same graphs
        return prepare(model)
    from simplesharded.pipeline.pipelining import pipeline

    # What one micro-batch is at each stage boundary: tokens in, hidden states between
    # stages, logits out (in the gathered parameters' dtype), so no forward runs to find out;
    # under context parallelism this rank's head-tail chunks of each sequence. Beside the
    # hidden states and the logits, what the model's stages carry (its stage_carry(): a
    # Hugging Face MoE's balancing sums), if any.
    mb, a = p.pipeline_parallel_microbatch_size, model.args
    act = pdt if mp is not None else torch.float32
    tokens = t.seq_len // p.context_parallel_degree
    hidden = torch.empty(mb, tokens, getattr(a, "hidden_size", a.dim), dtype=act, device="meta")
    output = torch.empty(mb, tokens, a.vocab_size, dtype=act, device="meta")
    carry = stage_carry(model)
    if carry is not None:
        hidden, output = (hidden, carry), (output, carry)
    return pipeline(
        model, mesh, schedule=p.pipeline_parallel_schedule,
        n_microbatches=t.local_batch_size // mb, loss_fn=loss_fn, prepare=prepare,
        microbatch=torch.empty(mb, tokens, dtype=torch.long, device="meta"),
        hidden=hidden, output=output,
        n_stages=pipeline_stages(p), layers_per_stage=p.pipeline_parallel_layers_per_stage or None,
        policy=p.pipeline_fsdp_policy, memory_cap_mb=c.memory_cap_mb, param_dtype=pdt)


def stage_carry(model: torch.nn.Module | None) -> torch.Tensor | None:
    """What ``model``'s pipeline stages pass on beside the hidden states (meta), if anything:
    its ``stage_carry()`` (a Hugging Face MoE's balancing sums), else None."""
    return getattr(model, "stage_carry", lambda: None)()


def pipeline_loss(denominator: float, model: torch.nn.Module | None = None):
    """The pipeline's loss on its last stage: the logits' summed cross-entropy (in fp32)
    divided by ``denominator`` (the trainer's: the global token count under grad_reduction
    "sum"), so the schedule's summed micro-batch gradients are one process's. Where
    ``model``'s stages carry something beside the logits (its ``stage_carry()``), the last
    stage's output is ``(logits, carried)`` and ``model.carried_loss(carried, labels)``, a sum
    over tokens too, is added before the division."""
    carried_loss = model.carried_loss if stage_carry(model) is not None else None

    def loss_fn(output, labels: torch.Tensor) -> torch.Tensor:
        logits = output[0] if carried_loss is not None else output
        loss = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, -2), labels.flatten(), reduction="sum")
        if carried_loss is not None:
            loss = with_term(loss, carried_loss(output[1], labels))
        return loss / denominator

    return loss_fn


def _compiled(model: torch.nn.Module, mesh, cfg: Config, backend, observer,
              stages_per_rank: int = 1):
    """``model`` under torch.compile with the configured backend (or ``backend``), in the
    dynamo settings it needs. ``stages_per_rank``: pipeline stages this rank compiles."""
    c = cfg.compile
    contexts = []
    dynamic = None
    if stages_per_rank > 1:
        # Stages of one model run one forward's code: each is a cache entry of its own (a
        # recompile, to dynamo), and a second stage's other input (hidden states, not tokens)
        # would make dynamo compile sizes as symbols, split over tp into expressions that
        # differ per rank. Static sizes, and room for every stage's entries (train, eval).
        dynamic = False
        limit = max(torch._dynamo.config.recompile_limit, 4 * stages_per_rank + 8)
        contexts.append(functools.partial(torch._dynamo.config.patch, recompile_limit=limit))
    if ep_dim(mesh):
        from simplesharded.models.ep_dispatch import ep_compile_config

        contexts.append(ep_compile_config)
    if backend is not None:  # the caller's own: it captures the whole step as one graph
        compiled = torch.compile(model, backend=backend, fullgraph=True)
    else:
        if not c.fullgraph:
            # A break inside a block makes each block's frame a compile of its own, and each
            # block's modules have classes of their own (data_parallel's class swap): one
            # recompile per block, which torch's default limit (8) would cut short, leaving
            # the later blocks uncompiled.
            limit = max(torch._dynamo.config.recompile_limit, len(find_blocks(model)) + 8)
            contexts.append(functools.partial(torch._dynamo.config.patch,
                                              recompile_limit=limit))
        backend = make_backend(c.backend, **_backend_options(
            c, observer, cfg.training.mixed_precision_param))
        compiled = torch.compile(model, backend=backend, fullgraph=c.fullgraph, dynamic=dynamic)
    return _ScopedCalls(compiled, *contexts) if contexts else compiled


def quantize_options(c) -> dict:
    """The compile section's quantizations that are on, as make_backend takes them (the
    planner's graphs get the same)."""
    return {key: getattr(c, key) for key in BackendOptions.QUANTIZERS
            if getattr(c, key) != "none"}


def _backend_options(c, observer, compute_dtype: str) -> dict:
    """make_backend's options from the compile section: quantized gathers and gradient
    reductions for any backend; the memory cap and the cost model (its matmuls timed in
    ``compute_dtype``, training.mixed_precision_param) only for backends that bucket (a plain
    backend's recompute pass keeps its default cap)."""
    # make_backend refuses a quantization, in one line, where no pass runs
    opts = {"dump_graphs": c.dump_graphs or None, "observer": observer, **quantize_options(c)}
    if c.backend in BACKENDS and BackendName.parse(c.backend).bucketing != "none":
        opts["memory_cap_bytes"] = int(c.memory_cap_mb * 2**20) or None
        opts["hardware"] = c.hardware
        opts["compute_dtype"] = compute_dtype
    return opts
