"""Validation of a training config: the cross-key checks that refuse a bad combination with
one ValueError naming the keys, and the pipeline schedules' rules they rest on.

Invariant: nothing here changes a value the user gave. ``validate`` (run by load_config)
needs only the config; ``resolve`` needs the world size, and fills the -1 degrees and the
derived local batch size it checks, on a copy. Neither needs a process group or the model
(those checks are preflight.py's). The config is config.py's ``Config`` tree, handed in: this
module does not import it, not even for types, so the schema can build on the schedules here.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Iterable

from simplesharded.storage.choice import (gathers_each_parameter, modes_taken, resolved,
                                          takes_offload)
from simplesharded.trainer.config_parse import sections

# Stand-ins for config.py's Config and its parallelism section (not imported: see above).
_Config = _Parallelism = Any


# parallelism.pipeline_parallel_schedule → (stages per pp rank by default, whether that number
# is fixed). simplesharded/pipeline/pipelining.py maps the names to torch's schedule classes.
PIPELINE_SCHEDULES = {"1F1B": (1, True), "Interleaved1F1B": (2, False),
                      "InterleavedZeroBubble": (2, False), "ZBVZeroBubble": (2, True)}


def pipeline_stages(p: _Parallelism) -> int:
    """How many pipeline stages the config asks for (all pp ranks together)."""
    if p.pipeline_parallel_layers_per_stage:
        return len(p.pipeline_parallel_layers_per_stage)
    return p.pipeline_parallel_degree * PIPELINE_SCHEDULES[p.pipeline_parallel_schedule][0]


def pipeline_microbatches_needed(schedule: str, pp: int, stages: int) -> tuple[int, int]:
    """(least number of micro-batches, what the number must be a multiple of) for a schedule
    step: a 1F1B pipeline fills with one micro-batch per stage; the interleaved schedules run
    in rounds of pp micro-batches; ZBV's V needs one per stage."""
    if schedule == "1F1B":
        return pp, 1
    if schedule == "ZBVZeroBubble":
        return stages, 1
    return pp, pp


def _check_hardware(spec: str) -> None:
    from simplesharded.passes.hardware import HARDWARE

    if spec == "calibrated" or spec in HARDWARE:
        return
    if spec.endswith(".json"):
        from simplesharded.passes.hardware import get_hardware

        try:
            get_hardware(spec)
        except ValueError as e:
            raise ValueError(f"compile.{e}") from None
        return
    raise ValueError(f"compile.hardware={spec!r} is not 'calibrated', a calibration .json file "
                     f"or one of {sorted(HARDWARE)}")


def validate(cfg: _Config, backends: Iterable[str] | None = None) -> None:
    """Value-level checks that need no process group. Raises ValueError on the first problem."""
    for section, cls in sections(type(cfg)).items():
        obj = getattr(cfg, section)
        for f in dataclasses.fields(cls):
            v, choices = getattr(obj, f.name), f.metadata.get("choices")
            if choices and v not in choices:
                raise ValueError(f"{section}.{f.name}={v!r} is not one of {sorted(choices)}")

    def get(key: str) -> Any:
        section, name = key.split(".")
        return getattr(getattr(cfg, section), name)

    def need(ok: bool, key: str, what: str):
        if not ok:
            raise ValueError(f"{key}={get(key)!r} must be {what}")

    t, o, s, p = cfg.training, cfg.optimizer, cfg.lr_scheduler, cfg.parallelism
    for key in ("training.global_batch_size", "training.seq_len", "training.steps",
                "training.gradient_accumulation_steps", "training.val_steps",
                "parallelism.data_parallel_replicate_degree", "parallelism.tensor_parallel_degree",
                "parallelism.expert_parallel_degree", "parallelism.context_parallel_degree",
                "parallelism.pipeline_parallel_degree",
                "parallelism.pipeline_parallel_microbatch_size",
                "activation_checkpoint.selective_every", "checkpoint.interval",
                "metrics.log_freq", "profiling.profile_freq"):
        need(get(key) >= 1, key, ">= 1")
    for key in ("training.max_norm", "training.val_every", "optimizer.weight_decay",
                "lr_scheduler.warmup_steps", "compile.memory_cap_mb", "checkpoint.keep_latest_k",
                "metrics.peak_tflops"):
        need(get(key) >= 0, key, ">= 0")
    need(t.local_batch_size == -1 or t.local_batch_size >= 1, "training.local_batch_size",
         "-1 (derived) or >= 1")
    need(p.data_parallel_shard_degree == -1 or p.data_parallel_shard_degree >= 1,
         "parallelism.data_parallel_shard_degree", "-1 (fill the world) or >= 1")
    need(cfg.checkpoint.load_step >= -1, "checkpoint.load_step", ">= -1")
    counts = cfg.job.gpu_counts
    need(all(n >= 1 for n in counts) and counts == sorted(set(counts)), "job.gpu_counts",
         "GPU counts >= 1 in increasing order, e.g. [8, 16, 32]")
    need(cfg.job.gpu_memory_gib >= 0, "job.gpu_memory_gib", ">= 0")
    need(not counts or cfg.job.gpu_memory_gib > 0, "job.gpu_memory_gib",
         "> 0 (the memory of one GPU) when job.gpu_counts is set")
    need(t.loss_chunks >= 0, "training.loss_chunks",
         ">= 0 (0 = auto, 1 = unchunked, N = chunks of tokens)")
    need(t.loss_chunks <= 1 or p.tensor_parallel_degree == 1, "training.loss_chunks",
         "0 (auto) or 1 with parallelism.tensor_parallel_degree > 1 (chunking needs a plain, "
         "not a tensor-parallel, output projection)")
    need(o.lr > 0, "optimizer.lr", "> 0")
    need(o.eps > 0, "optimizer.eps", "> 0")
    need(0 <= o.beta1 < 1, "optimizer.beta1", "in [0, 1)")
    need(0 <= o.beta2 < 1, "optimizer.beta2", "in [0, 1)")
    need(0 <= s.min_lr_ratio <= 1, "lr_scheduler.min_lr_ratio", "in [0, 1]")
    need(not (p.mode == "fully_shard" and p.data_parallel_replicate_degree > 1),
         "parallelism.mode",
         "hybrid_shard (or replicate) when data_parallel_replicate_degree > 1")
    need(not (p.mode == "replicate" and p.data_parallel_replicate_degree > 1
              and p.data_parallel_shard_degree != 1), "parallelism.mode",
         "hybrid_shard when both data parallel degrees are > 1")

    if p.mode == "hybrid_shard" and p.data_parallel_replicate_degree < 2:
        raise ValueError("parallelism.mode='hybrid_shard' needs "
                         "data_parallel_replicate_degree >= 2 (a 2-D mesh)")
    tp, cp = p.tensor_parallel_degree, p.context_parallel_degree
    if cp > 1 and t.seq_len % (2 * cp):
        raise ValueError(f"parallelism.context_parallel_degree={cp}: training.seq_len="
                         f"{t.seq_len} does not split into 2 * {cp} = {2 * cp} equal chunks "
                         f"(each cp rank holds a head and a tail chunk of every sequence)")
    if tp > 1 and p.enable_sequence_parallel and (t.seq_len // cp) % tp:
        where = f" / context_parallel_degree={cp} = {t.seq_len // cp}" if cp > 1 else ""
        raise ValueError(f"parallelism.tensor_parallel_degree={tp} does not divide "
                         f"training.seq_len={t.seq_len}{where} (sequence parallelism splits the "
                         f"sequence; or --no-parallelism.enable_sequence_parallel)")
    _check_pipeline(cfg)
    _check_storage(cfg)
    if cfg.compile.scope == "step":
        _check_step_scope(cfg)
    elif t.clip_norm != "current":
        raise ValueError(f"training.clip_norm={t.clip_norm!r} needs compile.scope='step' "
                         f"(got {cfg.compile.scope!r}): the split step clips with this step's "
                         f"norm")
    _check_float8(cfg)
    _check_offload(cfg)
    _check_tp_recompute(cfg)
    for key in ("quantize_gathers", "quantize_grads"):
        value = getattr(cfg.compile, key)
        if value != "none" and not cfg.compile.enable:
            raise ValueError(f"compile.{key}={value!r} needs compile.enable (the quantizing "
                             f"pass rewrites the compiled graph)")
    _check_hardware(cfg.compile.hardware)
    _check_backend(cfg.compile.backend, backends)


def _check_pipeline(cfg: _Config) -> None:
    """The pipeline keys' rules that need neither the world size nor the model."""
    p = cfg.parallelism
    pp, split, name = (p.pipeline_parallel_degree, p.pipeline_parallel_layers_per_stage,
                       p.pipeline_parallel_schedule)
    if any(n < 1 for n in split):
        raise ValueError(f"parallelism.pipeline_parallel_layers_per_stage={split} must give "
                         f"every stage at least one block")
    if pp == 1:
        return
    stages = pipeline_stages(p)
    per_rank, fixed = PIPELINE_SCHEDULES[name]
    if stages % pp or (fixed and stages != per_rank * pp):
        want = f"{per_rank * pp}" if fixed else f"a multiple of {pp}"
        raise ValueError(f"parallelism.pipeline_parallel_layers_per_stage={split} gives "
                         f"{stages} stages; schedule {name} on pipeline_parallel_degree={pp} "
                         f"runs {want}")


def _check_storage(cfg: _Config) -> None:
    """A storage named explicitly takes the modes its package says it takes
    (simplesharded/storage/choice.py); ragged buckets take fully_shard and hybrid_shard, with
    or without tensor, expert, context and pipeline parallelism. What it does not take is one
    error naming the setting."""
    p = cfg.parallelism
    modes = modes_taken(p.dp_storage)
    if p.mode not in modes:
        raise ValueError(f"parallelism.storage={p.storage!r} needs parallelism.mode "
                         f"{' or '.join(repr(m) for m in modes)}, got {p.mode!r} "
                         f"(or set storage=param)")


def _check_float8(cfg: _Config) -> None:
    """training.float8 with what it does not take: one error naming the other key."""
    t, p, c = cfg.training, cfg.parallelism, cfg.compile
    if not t.float8:
        return
    if c.quantize_gathers != "none":
        raise ValueError(f"training.float8 and compile.quantize_gathers={c.quantize_gathers!r} "
                         f"both quantize the weights' gathers: set one")
    if c.enable and not gathers_each_parameter(resolved(p.storage, p.mode,
                                                         each_parameter=True)):
        raise ValueError(f"training.float8 gathers each weight in float8, and "
                         f"parallelism.storage={p.storage!r} gathers a block as one buffer: "
                         f"set storage param or auto")


def _check_offload(cfg: _Config) -> None:
    """parallelism.offload with what it does not take yet: one error naming the other key.
    The host holds ragged buckets (simplesharded/storage/offload.py)."""
    p, c = cfg.parallelism, cfg.compile
    if p.offload == "none":
        return
    head = f"parallelism.offload={p.offload!r}"
    if not takes_offload(cfg.dp_storage()):
        raise ValueError(f"{head} moves ragged buckets to the host: it needs "
                         f"parallelism.storage 'auto' or 'ragged' with mode 'fully_shard' or "
                         f"'hybrid_shard' (and no training.float8 under compile); got storage="
                         f"{p.storage!r}, mode={p.mode!r}")
    if c.scope == "step":
        raise ValueError(f"{head} does not take compile.scope='step' (the step graph updates "
                         f"the shards on the compute device)")


def _check_tp_recompute(cfg: _Config) -> None:
    """activation_checkpoint.recompute_tp_outputs acts on checkpointed blocks' TP
    reduce-scatters in a joint graph (passes/recompute.py): where there are none, or the step
    graph saves every collective (passes/step_recompute.py), it is one error line."""
    a = cfg.activation_checkpoint
    if not a.recompute_tp_outputs:
        return
    for key, value, ok in (("activation_checkpoint.mode", a.mode, a.mode != "none"),
                           ("parallelism.tensor_parallel_degree",
                            cfg.parallelism.tensor_parallel_degree,
                            cfg.parallelism.tensor_parallel_degree > 1),
                           ("compile.scope", cfg.compile.scope, cfg.compile.scope == "model")):
        if not ok:
            raise ValueError(f"activation_checkpoint.recompute_tp_outputs needs "
                             f"activation_checkpoint.mode full or selective, "
                             f"parallelism.tensor_parallel_degree > 1 and "
                             f"compile.scope='model'; got {key}={value!r}")


def _check_step_scope(cfg: _Config) -> None:
    """compile.scope=step compiles simplesharded.compile_step: what it does not do yet is one
    error naming the setting."""
    t, p, c = cfg.training, cfg.parallelism, cfg.compile
    unsupported = [
        ("compile.enable", c.enable, True),
        ("training.gradient_sync", t.gradient_sync, "every_microbatch"),
        ("parallelism.pipeline_parallel_degree", p.pipeline_parallel_degree, 1),
        ("compile.fullgraph", c.fullgraph, True)]
    for key, value, ok in unsupported:
        if value != ok:
            raise ValueError(f"compile.scope='step' needs {key}={ok!r}, got {value!r}")
    if not c.backend.startswith(("aot_eager", "inductor")):
        raise ValueError(f"compile.scope='step' needs an aot_eager* or inductor* backend "
                         f"(its passes run there), got compile.backend={c.backend!r}")


def _check_backend(name: str, backends: Iterable[str] | None) -> None:
    """``name`` must be one of ``backends``; by default one of the registry's, or a name
    torch itself registers (make_backend passes those through)."""
    # Lazy: the registry imports torch and the passes.
    from simplesharded.backends import BACKENDS, is_torch_backend

    known = BACKENDS if backends is None else tuple(backends)
    if name in known or (backends is None and is_torch_backend(name)):
        return
    raise ValueError(f"compile.backend={name!r} is not one of {sorted(known)}")


def resolve(cfg: _Config, world_size: int) -> _Config:
    """Return a copy with the -1 degrees and local_batch_size filled for `world_size` ranks.

    Batch rule: global_batch_size = local_batch_size * dp * gradient_accumulation_steps, where
    dp = world_size / (pipeline_parallel_degree * context_parallel_degree *
    tensor_parallel_degree) (the cp and tp ranks of one dp rank share its batch; so do the
    stages of one pipeline). Under pipeline parallelism a rank's local batch is split into
    local_batch_size / pipeline_parallel_microbatch_size micro-batches per schedule step.
    """
    from simplesharded.mesh import resolve_degrees

    cfg = copy.deepcopy(cfg)
    p, t = cfg.parallelism, cfg.training
    degrees = resolve_degrees(world_size, p.data_parallel_replicate_degree,
                              p.data_parallel_shard_degree, p.tensor_parallel_degree,
                              p.expert_parallel_degree, p.context_parallel_degree,
                              names=tuple(f"parallelism.{k}_degree" for k in (
                                  "data_parallel_replicate", "data_parallel_shard",
                                  "tensor_parallel", "expert_parallel", "context_parallel")),
                              pp=p.pipeline_parallel_degree,
                              pp_name="parallelism.pipeline_parallel_degree")
    p.data_parallel_shard_degree = degrees.shard
    dp = degrees.dp
    per_step = dp * t.gradient_accumulation_steps
    if t.local_batch_size == -1:
        if t.global_batch_size % per_step:
            raise ValueError(f"training.global_batch_size={t.global_batch_size} is not divisible"
                             f" by dp ({dp}) * gradient_accumulation_steps "
                             f"({t.gradient_accumulation_steps})")
        t.local_batch_size = t.global_batch_size // per_step
    elif t.local_batch_size * per_step != t.global_batch_size:
        raise ValueError(f"training.global_batch_size={t.global_batch_size} != local_batch_size "
                         f"({t.local_batch_size}) * dp ({dp}) * "
                         f"gradient_accumulation_steps ({t.gradient_accumulation_steps})")
    if p.pipeline_parallel_degree > 1:
        _check_microbatches(p, t.local_batch_size)
    return cfg


def _check_microbatches(p: _Parallelism, local_batch: int) -> None:
    """A schedule step splits a rank's local batch into micro-batches: evenly, and into as
    many as the schedule needs."""
    mb, pp, name = (p.pipeline_parallel_microbatch_size, p.pipeline_parallel_degree,
                    p.pipeline_parallel_schedule)
    if local_batch % mb:
        raise ValueError(f"parallelism.pipeline_parallel_microbatch_size={mb} does not divide "
                         f"training.local_batch_size={local_batch}")
    n = local_batch // mb
    least, multiple = pipeline_microbatches_needed(name, pp, pipeline_stages(p))
    if n < least or n % multiple:
        rule = f"at least {least}" + (f" and a multiple of {multiple}" if multiple > 1 else "")
        raise ValueError(f"schedule {name} with pipeline_parallel_degree={pp} needs {rule} "
                         f"micro-batches per step; training.local_batch_size={local_batch} / "
                         f"parallelism.pipeline_parallel_microbatch_size={mb} gives {n} (raise "
                         f"the global batch or lower the micro-batch size)")

