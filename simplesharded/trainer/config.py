"""Training configuration: a strict dataclass tree loaded from TOML plus CLI overrides.

Precedence: dataclass defaults < TOML file < command line. Every key is `section.key`; an
unknown section or key, a value of the wrong type, or a value outside its allowed choices is
a ValueError that names the full key (and, for typos, suggests the closest valid key).

    cfg = load_config("configs/llama3_debug.toml", ["--training.steps", "5", "--compile.enable"])
    cfg = resolve(cfg, world_size=4)   # fill -1 degrees / batch sizes once the world is known

`python -m simplesharded.trainer.config --job.config_file X [--json] [overrides...]` prints the
resolved config.
"""

import copy
import dataclasses
import difflib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, packaged, before Python 3.11
    import tomli as tomllib


# The floating-point dtypes a config may name (torch.<name>): mixed precision, export.
DTYPE_NAMES = ("float32", "bfloat16", "float16")

# parallelism.pipeline_parallel_schedule → (stages per pp rank by default, whether that number
# is fixed). simplesharded/pipelining.py maps the names to torch's schedule classes.
PIPELINE_SCHEDULES = {"1F1B": (1, True), "Interleaved1F1B": (2, False),
                      "InterleavedZeroBubble": (2, False), "ZBVZeroBubble": (2, True)}


def pipeline_stages(p: "Parallelism") -> int:
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


@dataclass
class Optimizer:
    name: str = _opt("AdamW", "optimizer", ("AdamW", "SGD"))
    lr: float = _opt(3e-4, "peak learning rate")
    beta1: float = _opt(0.9, "AdamW beta1 (SGD: momentum)")
    beta2: float = _opt(0.95, "AdamW beta2")
    eps: float = _opt(1e-8, "AdamW eps")
    weight_decay: float = _opt(0.1, "decoupled weight decay")
    implementation: str = _opt(
        "foreach", "update kernels: for-loop (ops per parameter: with DTensor shards, hundreds "
        "of dispatches a step), foreach (ops over all tensors at once, torchtitan's default), "
        "fused (one kernel)", ("for-loop", "foreach", "fused"))


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
        "parameter; auto = ragged, or param under mode replicate. Checkpoints are the same "
        "either way (see docs/zero_copy.md)", ("auto", "param", "ragged"))
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
        "simplesharded/pipelining.py: auto_policy)",
        ("auto", "every_microbatch", "reduce_once", "gather_once"))

    @property
    def dp_storage(self) -> str:
        """The storage data_parallel takes; auto: ragged buckets (the fewest copies,
        docs/zero_copy.md) wherever the mode takes them."""
        if self.storage == "auto":
            return "param" if self.mode == "replicate" else "ragged"
        return self.storage

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


@dataclass
class ActivationCheckpoint:
    mode: str = _opt("none", "activation checkpointing", ("full", "none", "selective"))
    selective_every: int = _opt(2, "selective: checkpoint every Nth block")


@dataclass
class Checkpoint:
    enable: bool = _opt(False, "save/load DCP checkpoints")
    folder: str = _opt("checkpoint", "relative to job.dump_folder")
    interval: int = _opt(10, "save every N steps")
    keep_latest_k: int = _opt(2, "checkpoints kept; 0 = keep all")
    load_step: int = _opt(-1, "-1 = latest available, 0 = do not load, N = step N")


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
        for key, value in _flatten(data, source):
            _set(cfg, key, value, source, from_cli=False)
        return cfg


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v)  # JSON string escapes are valid TOML basic strings


# ---------------------------------------------------------------------------- key lookup

def _sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(Config)}


def all_keys() -> list[str]:
    """Every valid `section.key`, in declaration order."""
    return [f"{s}.{f.name}" for s, cls in _sections().items() for f in dataclasses.fields(cls)]


def _suggest(key: str) -> str:
    keys = all_keys()
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if not close:  # e.g. `steps` at top level, or a section typo far from the real one
        leaf = key.rsplit(".", 1)[-1]
        leaves = {k.rsplit(".", 1)[1]: k for k in reversed(keys)}
        close = [leaves[m] for m in difflib.get_close_matches(leaf, list(leaves), n=1)]
    return f"; did you mean {close[0]!r}?" if close else ""


def _field(key: str, source: str) -> dataclasses.Field:
    section, _, name = key.partition(".")
    cls = _sections().get(section)
    fields = {f.name: f for f in dataclasses.fields(cls)} if cls else {}
    if name not in fields:
        raise ValueError(f"unknown config key {key!r} ({source}){_suggest(key)}")
    return fields[name]


def _flatten(data: dict[str, Any], source: str) -> Iterable[tuple[str, Any]]:
    for section, body in data.items():
        if not isinstance(body, dict):
            if section in _sections():
                raise ValueError(f"{section} must be a table ([{section}]) ({source})")
            _field(section, source)  # a bare top-level key is always unknown: raises
        for name, value in body.items():
            yield f"{section}.{name}", value


# ---------------------------------------------------------------------------- value coercion

_TRUE, _FALSE = ("true", "1"), ("false", "0")


def _coerce(key: str, typ: type, value: Any, from_cli: bool) -> Any:
    def bad():
        return ValueError(f"{key} expects {_type_name(typ)}, got {value!r} "
                          f"({type(value).__name__})")

    if typ == list[int]:
        if from_cli and isinstance(value, str):  # "8,16,32" or "[8, 16, 32]"
            body = value.strip().removeprefix("[").removesuffix("]")
            try:
                return [int(v) for v in body.split(",") if v.strip()]
            except ValueError:
                raise bad() from None
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                           for v in value):
            return list(value)
        raise bad()
    if from_cli and isinstance(value, str):  # CLI values are strings: parse by field type
        if typ is bool:
            if value.lower() in _TRUE + _FALSE:
                return value.lower() in _TRUE
            raise bad()
        if typ in (int, float):
            try:
                return typ(value)
            except ValueError:
                raise bad() from None
        return value
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(value, typ):
        return value
    raise bad()


def _type_name(typ) -> str:
    return "list of int" if typ == list[int] else typ.__name__


def _set(cfg: Config, key: str, value: Any, source: str, from_cli: bool) -> None:
    if key == FLAT_BUCKETS_KEY:
        key, value = "parallelism.storage", _storage_of_flat_buckets(value, from_cli)
    f = _field(key, source)
    section = getattr(cfg, key.partition(".")[0])
    setattr(section, f.name, _coerce(key, f.type, value, from_cli))


# parallelism.storage's name until flat storage was retired: still read, with one line
# naming the new key. A TOML boolean or a bare command-line flag as before.
FLAT_BUCKETS_KEY = "parallelism.flat_buckets"
_STORAGE_OF_FLAT_BUCKETS = {"false": "param", "ragged": "ragged", "auto": "auto"}


def _storage_of_flat_buckets(value: Any, from_cli: bool) -> str:
    """parallelism.storage's value for a value of the deprecated parallelism.flat_buckets."""
    word = str(value).lower()
    if isinstance(value, bool) or (from_cli and word in _TRUE + _FALSE):
        word = "true" if word in _TRUE else "false"
    if word == "true":
        raise ValueError("parallelism.flat_buckets=true: flat storage is retired; use "
                         "--parallelism.storage ragged (zero-copy buckets, docs/zero_copy.md)")
    if not isinstance(value, (bool, str)) or word not in _STORAGE_OF_FLAT_BUCKETS:
        raise ValueError(f"parallelism.flat_buckets={value!r} is not one of "
                         f"{sorted(_STORAGE_OF_FLAT_BUCKETS)} (deprecated: use "
                         f"parallelism.storage)")
    storage = _STORAGE_OF_FLAT_BUCKETS[word]
    if os.environ.get("RANK", "0") == "0":  # once per job, not once per rank
        print(f"[simplesharded] parallelism.flat_buckets is deprecated: use "
              f"--parallelism.storage {storage}", file=sys.stderr, flush=True)
    return storage


def _flag(key: str, following: str | None) -> bool | None:
    """None: ``--key`` is not a flag (it needs a value). Else whether it takes ``following``
    (the next argument) as its value: a bool word (``--flag true``), or any value of a
    switch (its choice, checked later); otherwise the bare flag means True."""
    switch = key == FLAT_BUCKETS_KEY  # a choice of words, or a bare flag (true)
    if not switch and _field(key, "command line").type is not bool:
        return None
    if following is None:
        return False
    return following.lower() in _TRUE + _FALSE or (switch and not following.startswith("--"))


def parse_cli(argv: list[str]) -> list[tuple[str, Any]]:
    """`--s.k v`, `--s.k=v`, bare `--s.k` / `--no-s.k` for bools → [(key, value)] in order.

    Values stay strings (bools from bare flags are real bools); _coerce parses them.
    """
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--") or len(arg) == 2:
            raise ValueError(f"unexpected command-line argument {arg!r}; expected --section.key")
        body = arg[2:]
        if body.startswith("no-"):
            key = body[3:]
            if "=" in key or _flag(key, None) is None:
                raise ValueError(f"{arg!r}: --no- applies only to a bool key without a value")
            out.append((key, False))
            continue
        key, eq, value = body.partition("=")
        if eq:
            out.append((key, value))
        elif _flag(key, None) is not None:
            if _flag(key, argv[i] if i < len(argv) else None):
                out.append((key, argv[i]))
                i += 1
            else:
                out.append((key, True))
        elif i < len(argv) and not argv[i].startswith("--"):
            out.append((key, argv[i]))
            i += 1
        else:
            raise ValueError(f"{arg!r} expects a value")
    return out


# ---------------------------------------------------------------------------- loading

def load_config(path: str | None = None, argv: list[str] | None = None, *,
                backends: Iterable[str] | None = None) -> Config:
    """Defaults < TOML at `path` (or `--job.config_file` in argv, which wins) < argv overrides.

    `backends` is passed to validate(); None means simplesharded.backends.BACKENDS.
    """
    overrides = parse_cli(list(argv or []))
    for key, value in overrides:
        if key == "job.config_file":
            path = value
    cfg, explicit = Config(), set()
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as e:
            raise ValueError(f"job.config_file={path!r} cannot be read: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"job.config_file={path!r} is not valid TOML: {e}") from None
        for key, value in _flatten(data, f"in {path}"):
            _set(cfg, key, value, f"in {path}", from_cli=False)
            explicit.add(key)
    for key, value in overrides:
        _set(cfg, key, value, "on the command line", from_cli=True)
        explicit.add(key)
    if {FLAT_BUCKETS_KEY, "parallelism.storage"} <= explicit:
        raise ValueError("parallelism.flat_buckets and parallelism.storage are both set: "
                         "flat_buckets is storage's deprecated name, keep storage only")
    cfg.job.config_file = path or ""
    if cfg.compile.model_backend_override:
        cfg.compile.backend = cfg.compile.model_backend_override
    p = cfg.parallelism
    if "parallelism.mode" not in explicit and p.data_parallel_replicate_degree > 1:
        p.mode = "replicate" if p.data_parallel_shard_degree == 1 else "hybrid_shard"
    validate(cfg, backends)
    return cfg


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


def validate(cfg: Config, backends: Iterable[str] | None = None) -> None:
    """Value-level checks that need no process group. Raises ValueError on the first problem."""
    for section, cls in _sections().items():
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
    if cp > 1 and p.pipeline_parallel_degree > 1:
        raise ValueError(f"parallelism.context_parallel_degree={cp} with "
                         f"pipeline_parallel_degree={p.pipeline_parallel_degree}: pipeline "
                         f"parallelism together with context parallelism is not supported "
                         f"yet; set one of them to 1")
    if cp > 1 and p.expert_parallel_degree > 1:
        raise ValueError(f"parallelism.context_parallel_degree={cp} with "
                         f"expert_parallel_degree={p.expert_parallel_degree}: expert "
                         f"parallelism together with context parallelism is not supported "
                         f"yet; set one of them to 1")
    if tp > 1 and p.enable_sequence_parallel and (t.seq_len // cp) % tp:
        where = f" / context_parallel_degree={cp} = {t.seq_len // cp}" if cp > 1 else ""
        raise ValueError(f"parallelism.tensor_parallel_degree={tp} does not divide "
                         f"training.seq_len={t.seq_len}{where} (sequence parallelism splits the "
                         f"sequence; or --no-parallelism.enable_sequence_parallel)")
    _check_pipeline(cfg)
    _check_ragged(cfg)
    if cfg.compile.scope == "step":
        _check_step_scope(cfg)
    elif t.clip_norm != "current":
        raise ValueError(f"training.clip_norm={t.clip_norm!r} needs compile.scope='step' "
                         f"(got {cfg.compile.scope!r}): the split step clips with this step's "
                         f"norm")
    _check_hardware(cfg.compile.hardware)
    _check_backend(cfg.compile.backend, backends)


def _check_pipeline(cfg: Config) -> None:
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


def _check_ragged(cfg: Config) -> None:
    """storage=ragged (simplesharded/ragged_shards.py) takes fully_shard and hybrid_shard,
    with or without tensor, expert, context and pipeline parallelism: what it does not take is
    one error naming the setting."""
    p = cfg.parallelism
    if p.storage == "ragged" and p.mode == "replicate":
        raise ValueError("parallelism.storage='ragged' needs parallelism.mode 'fully_shard' "
                         "or 'hybrid_shard', got 'replicate' (or set storage=param)")


def _check_step_scope(cfg: Config) -> None:
    """compile.scope=step compiles simplesharded.compile_step: what it does not do yet is one
    error naming the setting."""
    t, p, c = cfg.training, cfg.parallelism, cfg.compile
    unsupported = [
        ("compile.enable", c.enable, True), ("optimizer.name", cfg.optimizer.name, "AdamW"),
        ("training.gradient_sync", t.gradient_sync, "every_microbatch"),
        ("training.on_nonfinite", t.on_nonfinite, "stop"),
        ("parallelism.context_parallel_degree", p.context_parallel_degree, 1),
        ("parallelism.pipeline_parallel_degree", p.pipeline_parallel_degree, 1),
        ("activation_checkpoint.mode", cfg.activation_checkpoint.mode, "none"),
        ("compile.fullgraph", c.fullgraph, True)]
    for key, value, ok in unsupported:
        if value != ok:
            raise ValueError(f"compile.scope='step' needs {key}={ok!r}, got {value!r}")
    if not c.backend.startswith(("aot_eager", "inductor")):
        raise ValueError(f"compile.scope='step' needs an aot_eager* or inductor* backend "
                         f"(its passes run there), got compile.backend={c.backend!r}")
    from simplesharded.passes.torch_compat import STEP_GRAPH, needs
    try:
        needs(STEP_GRAPH)
    except RuntimeError as e:
        raise ValueError(f"compile.scope='step': {e}") from None


def _check_backend(name: str, backends: Iterable[str] | None) -> None:
    """``name`` must be one of ``backends``; by default one of the registry's, or a name
    torch itself registers (make_backend passes those through)."""
    # Lazy: the registry imports torch and the passes.
    from simplesharded.backends import BACKENDS, is_torch_backend

    known = BACKENDS if backends is None else tuple(backends)
    if name in known or (backends is None and is_torch_backend(name)):
        return
    raise ValueError(f"compile.backend={name!r} is not one of {sorted(known)}")


def resolve(cfg: Config, world_size: int) -> Config:
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


def _check_microbatches(p: Parallelism, local_batch: int) -> None:
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


def help_text(usage: str = "python -m simplesharded.trainer.config [--json] [--section.key VALUE ...]"
              ) -> str:
    """Every key with its type, default, help and choices (the trainer's --help shows it too)."""
    lines = [f"usage: {usage}", ""]
    for section, cls in _sections().items():
        for f in dataclasses.fields(cls):
            choices = f.metadata.get("choices")
            extra = f" one of {sorted(choices)}" if choices else ""
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            lines.append(f"  --{section}.{f.name} ({_type_name(f.type)}, default {default!r})"
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
