"""Training configuration: a strict dataclass tree loaded from TOML plus CLI overrides.

Precedence: dataclass defaults < TOML file < command line. Every key is `section.key`; an
unknown section or key, a value of the wrong type, or a value outside its allowed choices is
a ValueError that names the full key (and, for typos, suggests the closest valid key).

    cfg = load_config("configs/llama3_debug.toml", ["--training.steps", "5", "--compile.enable"])
    cfg = resolve(cfg, world_size=4)   # fill -1 degrees / batch sizes once the world is known

This file is the schema (each key's type, default, help text and choices) and the entry that
ties the jobs together: config_parse.py reads TOML and the command line into the tree,
config_checks.py refuses bad combinations (``validate``; ``resolve`` once the world size is
known), and load_config runs both. Neither imports this file, not even for types: they are
handed the tree (config_parse.py its class), so the schema can build on them.

`python -m simplesharded.trainer.config --job.config_file X [--json] [overrides...]` prints the
resolved config.
"""

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable

from simplesharded.storage.choice import resolved
from simplesharded.storage.offload import OFFLOADS
from simplesharded.trainer.config_checks import PIPELINE_SCHEDULES, validate
from simplesharded.trainer.config_parse import flatten, read, sections, set_key, type_name

# The floating-point dtypes a config may name (torch.<name>): mixed precision, export.
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _opt(default, help: str = "", choices: tuple[str, ...] | None = None):
    """A dataclass field whose help text and allowed choices live next to its default."""
    metadata = {"help": help, "choices": choices}
    if isinstance(default, list):  # each Config gets its own list
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


# The share of job.gpu_memory_gib the planner's predicted peak may take: the rest is for what
# its model leaves out (CUDA context, communicator buffers, allocator fragmentation).
MEMORY_HEADROOM = 0.9


@dataclass
class Job:
    config_file: str = _opt("", "TOML file the config was loaded from")
    dump_folder: str = _opt("./outputs", "root of all run outputs")
    description: str = _opt("", "free text")
    seed: int = _opt(0, "seed for model init and data order")
    # What a shipped config is sized for, stated where it can be checked: the test of the
    # shipped configs resolves each count and holds the planner's predicted peak per GPU to
    # MEMORY_HEADROOM of gpu_memory_gib. The trainer runs at any world size regardless.
    gpu_counts: list[int] = _opt(
        [], "GPU counts (world sizes) this config fits: at each the degrees and batch resolve "
        f"and the planner's predicted peak per GPU (python -m simplesharded.tools.forecast) stays within "
        f"{MEMORY_HEADROOM:.0%} of job.gpu_memory_gib; [] = not stated. CLI: 8,16,32")
    gpu_memory_gib: float = _opt(
        0.0, "memory of one GPU that job.gpu_counts assume, GiB as torch reports it (H100 "
        "80GB: 79); 0 = not stated")


@dataclass
class Model:
    name: str = _opt("llama3", "model family in the models registry")
    flavor: str = _opt("debug", "size preset of the family")
    tokenizer_path: str = _opt("", "tokenizer.json for `tokenizers`; '' = built-in byte tokenizer "
                               "(name 'hf': the model directory's tokenizer.json if it has one)")
    path: str = _opt("", "name 'hf': local directory with a Hugging Face config.json (and "
                     "optionally *.safetensors, tokenizer.json); never downloaded")
    n_layers: int = _opt(0, "blocks of the zoo model; 0 = the flavor's (fewer: a shallower "
                         "model of the same widths, for quick runs)")

    def overrides(self) -> dict:
        """What replaces the flavor's args (models.get_model_spec)."""
        return {"n_layers": self.n_layers} if self.n_layers else {}

    def spec(self):
        """(class, args) of the zoo model this names, at its depth; for name 'hf', the
        builder and args of the model in ``path`` (models/hf_source.py)."""
        if self.name == "hf":
            from simplesharded.models import hf_source
            return hf_source.build_hf_model, hf_source.read_args(self.path, self.n_layers)
        from simplesharded.models import get_model_spec
        return get_model_spec(self.name, self.flavor, **self.overrides())

    def build(self, device="meta"):
        """The model this names, at its depth, on ``device`` (name 'hf': on meta only, its
        weights read by the trainer)."""
        if self.name == "hf":
            from simplesharded.models import hf_source
            assert device == "meta", device
            return hf_source.build_hf_model(self.path, self.n_layers)
        from simplesharded.models import build_model
        return build_model(self.name, self.flavor, device=device, **self.overrides())

    def label(self) -> str:
        """The model as logs name it: ``hf:<path>``, or ``<name>/<flavor>``."""
        return f"hf:{self.path}" if self.name == "hf" else f"{self.name}/{self.flavor}"


@dataclass
class Optimizer:
    name: str = _opt("AdamW", "optimizer", ("AdamW", "SGD"))
    lr: float = _opt(3e-4, "peak learning rate")
    beta1: float = _opt(0.9, "AdamW beta1 (SGD: momentum)")
    beta2: float = _opt(0.95, "AdamW beta2")
    eps: float = _opt(1e-8, "AdamW eps")
    weight_decay: float = _opt(0.1, "decoupled weight decay")
    implementation: str = _opt(
        "auto", "update kernels: for-loop (ops per parameter: with DTensor shards, hundreds "
        "of dispatches a step), foreach (ops over all tensors at once, torchtitan's default), "
        "fused (one kernel), auto (fused where the step runs on the host, under "
        "parallelism.offload: one pass over host memory where foreach makes one per op; else "
        "foreach)", ("auto", "for-loop", "foreach", "fused"))


@dataclass
class LRScheduler:
    warmup_steps: int = _opt(10, "linear warmup steps")
    decay_type: str = _opt("cosine", "decay after warmup", ("cosine", "linear", "constant"))
    min_lr_ratio: float = _opt(0.1, "final lr as a fraction of optimizer.lr")


@dataclass
class Training:
    global_batch_size: int = _opt(8, "sequences per optimizer step, all ranks and micro-batches")
    local_batch_size: int = _opt(
        -1, "sequences per rank per micro-batch; -1 = global // (dp * gradient_accumulation_steps)")
    seq_len: int = _opt(256, "tokens per sequence")
    steps: int = _opt(30, "optimizer steps")
    max_norm: float = _opt(1.0, "gradient clipping norm; 0 disables clipping")
    clip_norm: str = _opt(
        "current", "with compile.scope=step, the norm clipping divides by: current (this "
        "step's, as clip_grad_norm_) or previous (the last step's; the first step is not "
        "clipped), which lets each parameter's update run as soon as its gradient is reduced",
        ("current", "previous"))
    gradient_accumulation_steps: int = _opt(1, "micro-batches per optimizer step")
    gradient_sync: str = _opt(
        "every_microbatch", "with gradient_accumulation_steps > 1: every_microbatch reduces "
        "each micro-batch's gradients (they stay sharded); last_microbatch reduces once per "
        "step, the earlier micro-batches' gradients held unsharded on every rank meanwhile "
        "(the whole model's gradients at full size: DDP's/FSDP2's no_sync)",
        ("every_microbatch", "last_microbatch"))
    dataset: str = _opt("stdlib", "built-in corpus; ignored when dataset_path is set")
    dataset_path: str = _opt("", ".txt/.jsonl file or a directory of them; overrides dataset")
    mixed_precision_param: str = _opt(
        "float32", "dtype of gathered params in compute", DTYPE_NAMES)
    mixed_precision_reduce: str = _opt(
        "float32", "dtype of gradient reduction", DTYPE_NAMES)
    grad_reduction: str = _opt(
        "sum", "sum: loss normalised by global token count; avg: mean over ranks", ("avg", "sum"))
    loss_chunks: int = _opt(
        0, "cross-entropy in N chunks of a micro-batch's tokens, so the full fp32 logits never "
        "exist at once; 0 = auto (chunks of at most 2**26 logits, 256 MiB in fp32), 1 = "
        "unchunked; with tensor parallelism 0 or 1 only")
    val_every: int = _opt(0, "validate every N steps; 0 = off")
    val_steps: int = _opt(4, "batches per validation")
    on_nonfinite: str = _opt("stop", "action on a NaN/inf loss or grad norm", ("skip", "stop"))
    deterministic: bool = _opt(False, "torch.use_deterministic_algorithms")
    float8: bool = _opt(
        False, "the Linears inside the model's blocks whose dims are multiples of 16 (not a MoE "
        "router) become Float8Linear (simplesharded/float8.py: matmuls in float8, tensorwise scaling; weights, "
        "gradients and optimizer stay as they are), before any parallelism; compiled, their "
        "weights are gathered in float8 (passes/float8_gather.py) and parallelism.storage auto "
        "takes param; uncompiled they train in float8 and gather in full precision")


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = _opt(1, "replicas (outer mesh dim, HSDP)")
    data_parallel_shard_degree: int = _opt(-1, "shards per replica; -1 = fill the world")
    tensor_parallel_degree: int = _opt(1, "tensor-parallel degree (innermost mesh dim: ranks "
                                          "of one node); 1 = no tensor parallelism")
    expert_parallel_degree: int = _opt(1, "expert-parallel degree: a MoE model's routed experts "
                                          "split over this many ranks borrowed from "
                                          "data_parallel_shard_degree (which it must divide; "
                                          "tokens dispatched by all-to-all); 1 = off")
    context_parallel_degree: int = _opt(1, "context-parallel degree: each sequence split over "
                                           "this many ranks (a mesh dim between the dp dims "
                                           "and tp; head-tail chunks, K/V all-gathered in "
                                           "attention); parameters are sharded over dp_shard "
                                           "x cp; 1 = off")
    enable_sequence_parallel: bool = _opt(True, "with tensor parallelism, shard activations "
                                                "between blocks on the sequence dim")
    enable_loss_parallel: bool = _opt(True, "with tensor parallelism, compute the loss on "
                                            "vocabulary-sharded logits (no full logits)")
    # Natural default: when the mode is not given explicitly and the replicate degree is > 1,
    # load_config picks hybrid_shard (shard degree != 1: both mesh dims are used) or replicate
    # (shard degree == 1: plain DDP). An explicit mode is never changed, only validated.
    mode: str = _opt("fully_shard", "data parallel mode",
                     ("fully_shard", "hybrid_shard", "replicate"))
    reshard_after_forward: str = _opt(
        "auto", "free gathered params after forward and re-gather in backward: always, never, "
        "or auto (the compile plan decides per block; see data_parallel)",
        ("auto", "always", "never"))
    storage: str = _opt(
        "auto", "where the parameters' shards live: ragged = each bucket in the ragged layout, "
        "every gathered parameter a view of its bucket's gather (no copy-in or copy-out; FSDP "
        "and HSDP, with or without TP, EP, CP and PP); param = one DTensor shard per "
        "parameter; auto = ragged wherever it takes the mode (data_parallel's default too), "
        "else param. Checkpoints are the same "
        "either way (see docs/zero_copy.md)", ("auto", "param", "ragged"))
    offload: str = _opt(
        "none", "where the shards live between uses: none = the compute device; optimizer = "
        "gradients reduced on the device, then copied to the host, where the optimizer steps "
        "(the parameters and its state live there; a resident copy on the device is what "
        "the gathers read, refreshed before each forward); params = shards, gradients and "
        "optimizer state on the host, each gather's shard copied to the device right before "
        "it (FSDP2's CPUOffloadPolicy). Needs ragged buckets (storage auto or ragged; see "
        "data_parallel)", OFFLOADS)
    pipeline_parallel_degree: int = _opt(
        1, "pipeline stages over this many rank groups (outermost mesh dim, pp); the other "
        "degrees fill world / pp ranks; 1 = no pipeline")
    pipeline_parallel_schedule: str = _opt(
        "1F1B", "torch.distributed.pipelining schedule: 1F1B (one stage per rank), "
        "Interleaved1F1B and InterleavedZeroBubble (several stages per rank, 2 unless "
        "pipeline_parallel_layers_per_stage says), ZBVZeroBubble (2 stages per rank, V-shaped)",
        tuple(PIPELINE_SCHEDULES))
    pipeline_parallel_microbatch_size: int = _opt(
        1, "sequences per pipeline micro-batch: each schedule step splits a rank's "
        "local_batch_size into local_batch_size / this many micro-batches")
    pipeline_parallel_layers_per_stage: list[int] = _opt(
        [], "blocks of each stage, first to last (their count is the number of stages); [] = "
        "the blocks split evenly (the earlier stages one more) over the schedule's stages. "
        "CLI: 3,3,2,2")
    pipeline_fsdp_policy: str = _opt(
        "auto", "FSDP across a stage's micro-batches: every_microbatch (each forward gathers, "
        "each backward reduces: parameters and gradients stay sharded), reduce_once (backwards "
        "sum full-size gradients on the rank, one reduction per stage per step: the stage's "
        "gradients unsharded meanwhile), gather_once (reduce_once, and one gather per stage "
        "per step: its parameters unsharded too), or auto (per stage: gather_once when its "
        "parameters fit compile.memory_cap_mb, else reduce_once; see "
        "simplesharded/pipeline/pipelining.py: auto_policy)",
        ("auto", "every_microbatch", "reduce_once", "gather_once"))

    @property
    def dp_storage(self) -> str:
        """The storage data_parallel takes (simplesharded/storage/choice.py: resolved)."""
        return resolved(self.storage, self.mode)

    @property
    def reshard(self) -> bool | str:
        """The value data_parallel takes."""
        from simplesharded.sharding import RESHARD_BY_NAME

        return RESHARD_BY_NAME[self.reshard_after_forward]


@dataclass
class Compile:
    enable: bool = _opt(False, "torch.compile the model")
    backend: str = _opt("aot_eager_autobucketing", "name in simplesharded.backends.BACKENDS")
    model_backend_override: str = _opt("", "alias of backend; if set it wins")
    fullgraph: bool = _opt(True, "compile the model's forward as one graph; a graph break is "
                           "then an error naming it. false: the pieces between breaks are "
                           "compiled (and bucketed) one by one")
    memory_cap_mb: float = _opt(0.0, "most MiB of gathered parameters alive at once (kept ones and "
                                "copy-outs included); 0 = plan default")
    dump_graphs: str = _opt("", "directory to write FX graphs before/after passes")
    scope: str = _opt("model", "what one compiled graph holds: the model (its forward, and "
                      "its backward) or the whole step (forward, loss, backward, clipping and the "
                      "optimizer's step: simplesharded.compile_step)", ("model", "step"))
    hardware: str = _opt("calibrated", "cost-model numbers: 'calibrated' (measured at start-up, "
                         "cached; python -m simplesharded.tools.calibrate), a calibration .json "
                         "file, or a profile name")
    quantize_gathers: str = _opt("none", "parameter all-gathers sent as int8 or float8 (e4m3fn) "
                                 "blocks of 256 elements with one fp32 scale each, "
                                 "dequantized after the wait; weights, optimizer and "
                                 "gradients stay full precision (passes/quantized_gather.py)",
                                 ("none", "int8", "fp8"))
    quantize_grads: str = _opt("none", "gradient reduce-scatters sent as int8 blocks of 256 "
                               "elements with one fp32 scale each through an all-to-all and "
                               "summed in fp32 by their owner, or reduce-scattered in bf16 "
                               "(fp32 gradients); weights and optimizer stay as they are "
                               "(passes/quantized_reduce.py)", ("none", "int8", "bf16"))


@dataclass
class ActivationCheckpoint:
    mode: str = _opt("none", "activation checkpointing", ("full", "none", "selective"))
    selective_every: int = _opt(2, "selective: checkpoint every Nth block")
    recompute_tp_outputs: bool = _opt(False, "compiled: also run a checkpointed block's "
                                      "tensor-parallel reduce-scatters again in backward "
                                      "instead of saving their outputs (less memory, one more "
                                      "reduce-scatter each; torchtitan's full AC and eager AC "
                                      "do); needs tensor_parallel_degree > 1 and "
                                      "compile.scope='model'")


@dataclass
class Checkpoint:
    enable: bool = _opt(False, "save/load DCP checkpoints")
    folder: str = _opt("checkpoint", "relative to job.dump_folder")
    interval: int = _opt(10, "save every N steps")
    keep_latest_k: int = _opt(2, "checkpoints kept; 0 = keep all")
    load_step: int = _opt(-1, "-1 = latest available, 0 = do not load, N = step N")
    async_mode: str = _opt("disabled", "async: a save copies the state and returns, DCP "
                           "writes it from a thread while training goes on, committed at the "
                           "next save or the run's end (torchtitan's key)",
                           ("async", "disabled"))


@dataclass
class Metrics:
    log_freq: int = _opt(1, "log every N steps")
    enable_tensorboard: bool = _opt(False, "write TensorBoard events")
    save_jsonl: bool = _opt(True, "write metrics.jsonl in the dump folder")
    peak_tflops: float = _opt(0.0, "per-device peak TFLOP/s for MFU; 0 = the published dense "
                              "peak of a known GPU in training.mixed_precision_param's dtype "
                              "(simplesharded/trainer/device_peaks.py; unknown: no MFU)")
    progress_bar: bool = _opt(True, "show a progress bar on rank 0")


@dataclass
class Profiling:
    enable_profiling: bool = _opt(False, "torch.profiler traces")
    save_traces_folder: str = _opt("profile_traces", "relative to job.dump_folder")
    profile_freq: int = _opt(10, "profile every N steps")


@dataclass
class Config:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    compile: Compile = field(default_factory=Compile)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def dp_storage(self) -> str:
        """The storage data_parallel takes: ``parallelism.dp_storage``, except that under
        ``training.float8`` with compile, ``auto`` takes one shard per parameter (a ragged
        bucket is gathered as one buffer, which passes/float8_gather.py cannot cast)."""
        p = self.parallelism
        return resolved(p.storage, p.mode,
                        each_parameter=self.training.float8 and self.compile.enable)

    def to_toml(self) -> str:
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
            lines.append("")
        return "\n".join(lines)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "dict") -> "Config":
        """Strictly build a Config from {section: {key: value}} (as TOML parses it)."""
        cfg = cls()
        for key, value in flatten(cls, data, source):
            set_key(cfg, key, value, source, from_cli=False)
        return cfg


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v)  # JSON string escapes are valid TOML basic strings


# ---------------------------------------------------------------------------- loading

def load_config(path: str | None = None, argv: list[str] | None = None, *,
                backends: Iterable[str] | None = None) -> Config:
    """Defaults < TOML at `path` (or `--job.config_file` in argv, which wins) < argv overrides.

    `backends` is passed to validate(); None means simplesharded.backends.BACKENDS.
    """
    cfg, explicit = read(Config, path, list(argv or []))
    if cfg.compile.model_backend_override:
        cfg.compile.backend = cfg.compile.model_backend_override
    p = cfg.parallelism
    if "parallelism.mode" not in explicit and p.data_parallel_replicate_degree > 1:
        p.mode = "replicate" if p.data_parallel_shard_degree == 1 else "hybrid_shard"
    validate(cfg, backends)
    return cfg


def help_text(usage: str = "python -m simplesharded.trainer.config [--json] [--section.key VALUE ...]"
              ) -> str:
    """Every key with its type, default, help and choices (the trainer's --help shows it too)."""
    lines = [f"usage: {usage}", ""]
    for section, cls in sections(Config).items():
        for f in dataclasses.fields(cls):
            choices = f.metadata.get("choices")
            extra = f" one of {sorted(choices)}" if choices else ""
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            lines.append(f"  --{section}.{f.name} ({type_name(f.type)}, default {default!r})"
                         f"  {f.metadata.get('help', '')}{extra}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    try:
        cfg = load_config(None, argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(cfg.to_dict(), indent=2) if as_json else cfg.to_toml())
    return 0


if __name__ == "__main__":
    sys.exit(main())