"""``python -m simplesharded.train`` (normally via ./run_train.sh / torchrun).

meta-device model → tensor parallelism → expert parallelism → activation checkpointing →
data_parallel → torch.compile(our backend) (all in :func:`parallelize`) → AdamW on shards, warmup + decay, clipping over sharded grads, accumulation, validation,
DCP checkpoints, metrics. Errors in the configuration exit with code 2 and one line.
``--help`` lists every key; ``--check-only`` runs only those checks (run_train.sh's
preflight, with WORLD_SIZE set to the number of processes torchrun would start).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.fx.traceback as fx_traceback
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from simplesharded import checkpoint as ckpt
from simplesharded.backends import make_backend
from simplesharded.config import Config, help_text, load_config, resolve
from simplesharded.data import build_data, load_tokenizer
from simplesharded.grad_sync import set_requires_gradient_sync
from simplesharded.mesh import build_mesh, ep_dim, init_distributed, tp_dim
from simplesharded.metrics import (MetricsLogger, format_record, memory_stats, peak_flops,
                                   reset_peak_memory, throughput)
from simplesharded.models import build_model, get_model_spec, hf_source
from simplesharded.blocks import find_blocks
from simplesharded.init import init_sharded
from simplesharded.passes.annotations import AC_KEY
from simplesharded.sharding import MixedPrecisionPolicy, data_parallel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXIT_CONFIG, EXIT_NONFINITE = 2, 3
HF = "hf"  # model.name of a Hugging Face model read from model.path (models/hf_source.py)


class NonFiniteError(RuntimeError):
    pass


def check_static(cfg: Config, world_size: int) -> Config:
    """Everything that can be checked before any process-group work; returns resolved cfg."""
    cfg = resolve(cfg, world_size)
    if cfg.model.name == HF:
        args = _check_hf(cfg)
    else:
        args = _check_zoo(cfg)
    what = (f"model.path={cfg.model.path!r}" if cfg.model.name == HF
            else f"model {cfg.model.name}/{cfg.model.flavor}")
    if cfg.training.seq_len > args.max_seq_len:
        raise ValueError(f"training.seq_len={cfg.training.seq_len} is above the maximum "
                         f"{args.max_seq_len} of {what}")
    path = cfg.training.dataset_path
    if path and not os.access(path, os.R_OK):
        raise ValueError(f"training.dataset_path={path!r} does not exist or is not readable")
    if cfg.parallelism.mode == "hybrid_shard" and cfg.parallelism.data_parallel_replicate_degree < 2:
        raise ValueError("parallelism.mode='hybrid_shard' needs "
                         "data_parallel_replicate_degree >= 2 (a 2-D mesh)")
    tp = cfg.parallelism.tensor_parallel_degree
    if tp > 1:
        try:
            args.check_tp(tp)
        except ValueError as e:
            raise ValueError(f"parallelism.{e} ({what})") from None
        if cfg.parallelism.enable_sequence_parallel and cfg.training.seq_len % tp:
            raise ValueError(f"parallelism.tensor_parallel_degree={tp} does not divide "
                             f"training.seq_len={cfg.training.seq_len} (sequence parallelism "
                             f"splits the sequence; or --no-parallelism.enable_sequence_parallel)")
    ep = cfg.parallelism.expert_parallel_degree
    if ep > 1:
        what = f"model {cfg.model.name}/{cfg.model.flavor}"
        if not hasattr(args, "check_ep"):
            raise ValueError(f"parallelism.expert_parallel_degree={ep} needs a model with "
                             f"routed experts (deepseek_v3); {what} has none")
        try:
            args.check_ep(ep)
        except ValueError as e:
            raise ValueError(f"parallelism.{e} of {what}") from None
    return cfg


def _check_zoo(cfg: Config):
    from simplesharded.models import MODELS

    if cfg.model.name not in MODELS:  # the trainer's choices: the zoo and HF
        raise ValueError(f"model.name={cfg.model.name!r} is not one of {sorted([*MODELS, HF])}")
    cls, args = get_model_spec(cfg.model.name, cfg.model.flavor)
    if not hasattr(cls, "num_flops_per_token"):  # the trainer's model protocol (zoo models)
        trainable = sorted(n for n, (c, _) in MODELS.items() if hasattr(c, "num_flops_per_token"))
        raise ValueError(f"model.name={cfg.model.name!r} is not trainable here yet (bench it with "
                         f"python -m simplesharded.bench --model {cfg.model.name}); the "
                         f"trainer takes {trainable + [HF]}")
    return args


def _check_hf(cfg: Config):
    """model.name='hf': the directory, its config and its tokenizer, read without torch
    models. Without model.tokenizer_path the directory's tokenizer.json is used (set here, in
    the resolved config every rank trains with)."""
    args = hf_source.read_args(cfg.model.path)
    hf_source.check_weights(cfg.model.path)
    if not cfg.model.tokenizer_path:
        cfg.model.tokenizer_path = hf_source.hf_tokenizer_path(cfg.model.path)
    if cfg.model.tokenizer_path:
        vocab = load_tokenizer(cfg.model.tokenizer_path).vocab_size
        if vocab > args.vocab_size:
            raise ValueError(f"model.tokenizer_path={cfg.model.tokenizer_path!r}: vocabulary "
                             f"{vocab} is larger than vocab_size {args.vocab_size} of "
                             f"model.path={cfg.model.path!r}")
    return args


def apply_activation_checkpointing(model: torch.nn.Module, mode: str, every: int,
                                   compiled: bool = True, expert_parallel: bool = False) -> None:
    """Recompute block activations in backward (``full``: every block; ``selective``: every
    ``every``-th block). Blocks are the ones data_parallel buckets (simplesharded/blocks.py).
    FQNs stay unchanged.

    Compiled: the block is annotated and passes/recompute.py tags its ops in the joint graph
    (torch.utils.checkpoint's compiled form saves a DeviceMesh when DTensor parameters are
    gathered inside the region, which aot_autograd rejects); it never recomputes an
    all-to-all or a routing decision. Eager: torch.utils.checkpoint; with
    ``expert_parallel``, selectively: the all-to-alls' results and the top-k routing are
    saved from forward (:func:`_save_routing`), so the recomputation re-runs neither.
    """
    if mode == "none":
        return
    for i, (_, block) in enumerate(find_blocks(model)):
        if mode == "full" or i % every == 0:
            wrap = _annotated if compiled else functools.partial(
                _checkpointed, context_fn=_save_routing if expert_parallel else None)
            block.forward = functools.partial(wrap, block.forward, i)


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


def _checkpointed(fn, index, *args, context_fn=None, **kwargs):
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **extra, **kwargs)


def _annotated(fn, index, *args, **kwargs):
    with fx_traceback.annotate({AC_KEY: index}):
        return fn(*args, **kwargs)


def lr_lambda(cfg: Config):
    s, total = cfg.lr_scheduler, cfg.training.steps

    def f(step: int) -> float:  # step counts optimizer steps already taken
        if step < s.warmup_steps:
            return (step + 1) / (s.warmup_steps + 1)
        if s.decay_type == "constant":
            return 1.0
        progress = min(1.0, (step - s.warmup_steps) / max(1, total - s.warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if s.decay_type == "cosine" else 1 - progress
        return s.min_lr_ratio + (1 - s.min_lr_ratio) * decay

    return f


# optimizer.implementation → torch.optim keyword arguments
OPTIMIZER_IMPL = {"for-loop": {"foreach": False}, "foreach": {"foreach": True},
                  "fused": {"fused": True}}


def build_optimizer(cfg: Config, params):
    o = cfg.optimizer
    impl = OPTIMIZER_IMPL[o.implementation]
    if o.name == "SGD":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.beta1, weight_decay=o.weight_decay,
                               **impl)
    return torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                             weight_decay=o.weight_decay, **impl)


def grad_norm_and_clip(params, max_norm: float) -> torch.Tensor:
    """Global L2 norm over sharded grads (a DTensor norm reduces across ranks), clipped.
    Gradients on different meshes (expert weights live on the ep mesh, the others on the
    dense one; DTensor computes on one mesh at a time) are normed per mesh, then combined."""
    by_mesh: dict = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = [_total_norm([p.grad for p in group]) for group in by_mesh.values()] or [
        _total_norm([])]
    norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    if max_norm > 0:
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm


def _total_norm(grads) -> torch.Tensor:
    # On a dp x tp mesh DTensor reduces the norm's partial over each mesh dim in turn and logs
    # that one collective over a flattened mesh would be faster: true, and irrelevant for one
    # scalar a step, so the advice is not printed by every rank.
    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    try:
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    finally:
        redistribute_log.setLevel(level)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def local_loss(t: torch.Tensor) -> torch.Tensor:
    """A loss-parallel loss is a DTensor replicated over tp: its local value is the loss."""
    return t.to_local() if isinstance(t, DTensor) else t


def loss_chunks(cfg: Config) -> int:
    """The model's ``loss_chunks`` (simplesharded/loss.py): the configured one, except under
    tensor parallelism, where chunking needs a plain output projection: there auto (0) means
    unchunked (config validation allows no other value)."""
    return 1 if cfg.parallelism.tensor_parallel_degree > 1 else cfg.training.loss_chunks


def uses_loss_parallel(cfg: Config) -> bool:
    p = cfg.parallelism
    return p.tensor_parallel_degree > 1 and p.enable_loss_parallel


def apply_tensor_parallel(model: torch.nn.Module, mesh, sequence_parallel: bool,
                          loss_parallel: bool = False) -> None:
    """Torch TP with the model's own plan on ``mesh["tp"]`` (nothing when the mesh has no tp
    dim): the first step of :func:`parallelize`, shared with the benchmark's TP peers."""
    if tp_dim(mesh):
        parallelize_module(model, mesh[tp_dim(mesh)],
                           model.tp_plan(sequence_parallel, loss_parallel))


def apply_expert_parallel(model: torch.nn.Module, mesh) -> None:
    """The model's expert-parallel plan (models/moe.py ``ep_plan``) on ``mesh["ep"]``
    (nothing when the mesh has no ep dim)."""
    if ep_dim(mesh):
        parallelize_module(model, mesh[ep_dim(mesh)], model.ep_plan())


class _EPCompiled:
    """A compiled expert-parallel model, called under ``ep_compile_config()`` (models/moe.py:
    dynamo captures the dispatch's split sizes; scoped to these calls, never global)."""

    def __init__(self, compiled):
        self.compiled = compiled

    def __call__(self, *args, **kwargs):
        from simplesharded.models.moe import ep_compile_config

        with ep_compile_config():
            return self.compiled(*args, **kwargs)


def parallelize(model: torch.nn.Module, mesh, cfg: Config, backend=None, observer=None):
    """TP → EP → activation checkpointing → data_parallel → compile, in that order; returns
    the callable a step runs (the compiled model, or the model itself). ``backend``: a
    torch.compile backend used instead of the configured one (``python -m simplesharded.plan``
    captures the graphs with its own, so it traces what the trainer compiles). ``observer``:
    handed to the configured backend (``make_backend``), which shows it every graph our
    passes produce (the GPU smoke compares them with inductor's code)."""
    p, t, c = cfg.parallelism, cfg.training, cfg.compile
    apply_tensor_parallel(model, mesh, p.enable_sequence_parallel, uses_loss_parallel(cfg))
    apply_expert_parallel(model, mesh)
    apply_activation_checkpointing(model, cfg.activation_checkpoint.mode,
                                   cfg.activation_checkpoint.selective_every,
                                   compiled=c.enable, expert_parallel=bool(ep_dim(mesh)))
    pdt, rdt = DTYPES[t.mixed_precision_param], DTYPES[t.mixed_precision_reduce]
    mp = MixedPrecisionPolicy(pdt, rdt) if (pdt, rdt) != (torch.float32, torch.float32) else None
    # Explicit: the trainer's own default is "sum" (data_parallel's is "avg"), with every
    # rank's loss divided by the global token count (train_step), so the reduced gradient is
    # the exact global mean whatever the ranks' token counts.
    data_parallel(model, mesh, p.mode, mp_policy=mp, reshard_after_forward=p.reshard,
                  grad_reduction=t.grad_reduction)
    if not c.enable:
        return model
    scoped = _EPCompiled if ep_dim(mesh) else (lambda compiled: compiled)
    if backend is not None:
        return scoped(torch.compile(model, backend=backend, fullgraph=True))
    opts = {"dump_graphs": c.dump_graphs or None, "observer": observer}
    if "bucketing" in c.backend:
        opts["memory_cap_bytes"] = int(c.memory_cap_mb * 2**20) or None
        opts["hardware"] = c.hardware
    if not c.fullgraph:
        # A break inside a block makes each block's frame a compile of its own, and each
        # block's modules have classes of their own (data_parallel's class swap): one
        # recompile per block, which torch's default limit (8) would cut short, leaving the
        # later blocks uncompiled.
        limit = len(find_blocks(model)) + 8
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    return scoped(torch.compile(model, backend=make_backend(c.backend, **opts),
                                fullgraph=c.fullgraph))


def graph_break_error(e: Exception, cfg: Config) -> ValueError:
    """A graph break under compile.fullgraph as one line: what breaks and where (the
    innermost frame of the model's code), and the flag that compiles around it."""
    what = (str(e).strip().splitlines() or [type(e).__name__])[0]
    frame = getattr(e, "innermost_user_frame_summary", None)
    stack = getattr(e, "real_stack", None)
    if frame is None and stack:
        frame = stack[-1]
    where = f" at {frame.filename}:{frame.lineno} in {frame.name}" if frame else ""
    if frame is not None and frame.line:
        where += f" ({frame.line.strip()})"
    model = cfg.model.path if cfg.model.name == HF else f"{cfg.model.name}/{cfg.model.flavor}"
    return ValueError(f"compile.fullgraph=true: the forward of {model} graph-breaks{where}: "
                      f"{what}; rerun with --no-compile.fullgraph to compile the pieces "
                      f"between breaks (each is bucketed on its own)")


class Trainer:
    def __init__(self, cfg: Config, device: str, observer=None):
        self.cfg, self.device = cfg, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        p, t = cfg.parallelism, cfg.training
        self.mesh = build_mesh(p.data_parallel_replicate_degree, p.data_parallel_shard_degree,
                               device, p.tensor_parallel_degree, p.expert_parallel_degree)
        # tp is the innermost mesh dim: the tp ranks of one dp rank are consecutive and read
        # the same batch.
        self.tp = p.tensor_parallel_degree
        self.loss_parallel = uses_loss_parallel(cfg)
        self.loss_chunks = loss_chunks(cfg)
        torch.manual_seed(cfg.job.seed)
        self.data = build_data(cfg, self.rank // self.tp, self.world // self.tp)
        hf = cfg.model.name == HF
        if hf:
            model = hf_source.build_hf_model(cfg.model.path)
        else:
            model = build_model(cfg.model.name, cfg.model.flavor, device="meta")
        if self.data.tokenizer.vocab_size > model.args.vocab_size:
            raise ValueError(f"model.tokenizer_path: vocabulary {self.data.tokenizer.vocab_size} "
                             f"does not fit the model's vocab_size {model.args.vocab_size}")
        self.step_fn = parallelize(model, self.mesh, cfg, observer=observer)
        if hf:
            how = hf_source.materialize(model, cfg.job.seed)
            tok = cfg.model.tokenizer_path or "built-in bytes"
            self._print(f"[simplesharded] model.path={cfg.model.path!r}: weights {how}, "
                        f"tokenizer {tok}")
        else:
            # Each rank fills only its shards, on the mesh's device, with its slice of the
            # same full values at any world size and tp / ep degree (simplesharded/init.py).
            init_sharded(model, seed=cfg.job.seed)
        self.model = model
        self.params = [q for q in model.parameters() if q.requires_grad]
        self.optimizer = build_optimizer(cfg, self.params)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.tokens_per_step = t.global_batch_size * t.seq_len
        self.flops_per_token = model.num_flops_per_token(t.seq_len)
        self.peak = peak_flops(device, cfg.metrics.peak_tflops, t.mixed_precision_param)
        self.ckpt_folder = os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder)
        self.step = 0

    # ------------------------------------------------------------------ steps
    def forward_loss(self, fn, inputs, labels):
        """Summed cross-entropy of ``fn`` (the compiled step or the model) on one micro-batch,
        computed in the model's forward: compiled, the loss and the output projection's gather
        are in the model's graph, and with ``training.loss_chunks`` != 1 the full fp32 logits
        never exist at once (simplesharded/loss.py). Under loss parallelism the logits are a
        DTensor sharded on the vocabulary over tp: torch's loss_parallel computes the same
        log-softmax with the max and the sum of exponentials all-reduced over tp (no rank
        materialises full logits)."""
        try:
            return fn(inputs.to(self.device), labels.to(self.device),
                      loss_chunks=self.loss_chunks)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:
            if fn is self.model or not self.cfg.compile.fullgraph:
                raise
            raise graph_break_error(e, self.cfg) from None

    def _loss_context(self):
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def train_step(self) -> dict[str, float]:
        t = self.cfg.training
        self.optimizer.zero_grad(set_to_none=True)
        local_tokens = t.local_batch_size * t.seq_len * t.gradient_accumulation_steps
        # sum: every rank divides by the global token count and gradients are summed, so the
        # result is the exact global mean; avg: local mean, gradients averaged over ranks.
        denom = self.tokens_per_step if t.grad_reduction == "sum" else local_tokens
        loss_sum = torch.zeros((), device=self.device)
        n = t.gradient_accumulation_steps
        # last_microbatch: the earlier micro-batches' backwards only accumulate locally, the
        # last one reduces the sum once (simplesharded/grad_sync.py); every rank toggles alike.
        sync_last = n > 1 and t.gradient_sync == "last_microbatch"
        for i in range(n):
            if sync_last:
                set_requires_gradient_sync(self.model, i == n - 1)
            inputs, labels = next(self.data.train)
            with self._loss_context():  # backward too: the loss's own backward is parallel
                loss = self.forward_loss(self.step_fn, inputs, labels)
                (loss / denom).backward()
            loss_sum += local_loss(loss.detach())
        norm = grad_norm_and_clip(self.params, t.max_norm)
        dist.all_reduce(loss_sum)  # every tp rank of a dp rank holds the same loss
        loss = (loss_sum / (self.tokens_per_step * self.tp)).item()
        norm = norm.item()
        if not (math.isfinite(loss) and math.isfinite(norm)):
            if t.on_nonfinite == "stop":
                raise NonFiniteError(f"non-finite loss={loss} or grad_norm={norm} at step "
                                     f"{self.step + 1}; training stopped, checkpoints untouched")
            self.optimizer.zero_grad(set_to_none=True)
            self._print(f"step {self.step + 1}: non-finite loss/grad norm, step skipped")
        else:
            self.optimizer.step()
            if hasattr(self.model, "update_expert_bias"):
                self.model.update_expert_bias()
        self.scheduler.step()
        return {"loss": loss, "grad_norm": norm}

    @torch.no_grad()
    def validate(self) -> float:
        loader = self.data.validation
        loader.reset()
        total = torch.zeros((), device=self.device)
        for _ in range(self.cfg.training.val_steps):
            inputs, labels = next(loader)
            with self._loss_context():
                total += local_loss(self.forward_loss(self.model, inputs, labels))
        dist.all_reduce(total)
        n = (self.cfg.training.val_steps * loader.global_batch_size * self.cfg.training.seq_len
             * self.tp)
        return (total / n).item()

    # ------------------------------------------------------------------ loop
    def maybe_load(self) -> None:
        c = self.cfg.checkpoint
        if not c.enable or c.load_step == 0:
            return
        if c.load_step == -1 and not ckpt.complete_steps(self.ckpt_folder):
            return
        state = ckpt.load(self.ckpt_folder, c.load_step, self.model, self.optimizer,
                          self.data.train.state_dict())
        self.data.train.load_state_dict(state["loader"])
        torch.set_rng_state(state["rng"])
        self.step = int(state["step"])
        for _ in range(self.step):
            self.scheduler.step()
        self._print(f"[checkpoint] resumed from step {self.step}")

    def run(self) -> list[float]:
        cfg, losses = self.cfg, []
        self.maybe_load()
        logger = MetricsLogger(cfg.job.dump_folder, enabled=self.rank == 0,
                               save_jsonl=cfg.metrics.save_jsonl,
                               tensorboard=cfg.metrics.enable_tensorboard)
        bar = None
        if self.rank == 0 and cfg.metrics.progress_bar:
            from tqdm import tqdm
            bar = tqdm(total=cfg.training.steps, initial=self.step, desc="train", unit="step",
                       dynamic_ncols=True, file=sys.stderr)
        profiler = self._profiler()
        with profiler or contextlib.nullcontext():
            while self.step < cfg.training.steps:
                t0 = time.perf_counter()
                record = self.train_step()
                self.step += 1
                dt = time.perf_counter() - t0
                losses.append(record["loss"])
                record.update(lr=self.scheduler.get_last_lr()[0], step_s=dt,
                              **throughput(self.tokens_per_step, dt, self.world,
                                           self.flops_per_token, self.peak),
                              **memory_stats(self.device))
                if len(losses) == 1:  # later records: the steady step's peak, not compile's
                    reset_peak_memory(self.device)
                if cfg.training.val_every and self.step % cfg.training.val_every == 0:
                    record["val_loss"] = self.validate()
                if self.step % cfg.metrics.log_freq == 0 or self.step == cfg.training.steps:
                    logger.log(self.step, record)
                    line = format_record(self.step, record)
                    if "val_loss" in record:
                        line += f"  val {record['val_loss']:.4f}"
                    self._print(line, bar)
                if bar:
                    bar.update(1)
                if cfg.checkpoint.enable and (self.step % cfg.checkpoint.interval == 0
                                              or self.step == cfg.training.steps):
                    ckpt.save(self.ckpt_folder, self.step, self.model, self.optimizer,
                              self.data.train.state_dict(), cfg.checkpoint.keep_latest_k,
                              ckpt.model_meta(self.model, cfg.model.name, cfg.model.flavor))
                if profiler:
                    profiler.step()
        if bar:
            bar.close()
        logger.close()
        return losses

    def _profiler(self):
        p = self.cfg.profiling
        if not p.enable_profiling:
            return None
        folder = os.path.join(self.cfg.job.dump_folder, p.save_traces_folder)

        def on_trace(prof):
            os.makedirs(folder, exist_ok=True)
            prof.export_chrome_trace(os.path.join(folder, f"step{self.step}_rank{self.rank}.json"))

        return torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=max(0, p.profile_freq - 2), warmup=1, active=1),
            on_trace_ready=on_trace)

    def _print(self, line: str, bar=None) -> None:
        if self.rank != 0:
            return
        if bar is not None:
            bar.write(line)
        else:
            print(line, flush=True)


def make_deterministic(device: str) -> None:
    """torch's deterministic algorithms (``training.deterministic``). On CUDA, cuBLAS needs a
    fixed workspace for them, which it reads from the environment when its handle is created:
    set before the first matmul (a value the user set wins), else that matmul raises."""
    if device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text("python -m simplesharded.train | ./run_train.sh [--section.key VALUE ...]"))
        return 0
    # --check-only: run_train.sh's preflight. The same checks once, in one process, before
    # torchrun starts any rank (otherwise every rank prints the error, then torchrun a traceback).
    check_only = "--check-only" in argv
    argv = [a for a in argv if a != "--check-only"]
    try:
        cfg = load_config(None, argv)
        cfg = check_static(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if check_only:
        return 0
    code = 0
    try:
        device = init_distributed()
        if cfg.training.deterministic:
            make_deterministic(device)
        trainer = Trainer(cfg, device)
        if trainer.rank == 0:
            model = (f"hf:{cfg.model.path}" if cfg.model.name == HF
                     else f"{cfg.model.name}/{cfg.model.flavor}")
            print(f"[simplesharded] {model} world={trainer.world} "
                  f"mode={cfg.parallelism.mode} mesh={tuple(trainer.mesh.mesh.shape)} "
                  f"compile={cfg.compile.backend if cfg.compile.enable else 'off'}", flush=True)
        trainer.run()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        code = EXIT_CONFIG
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        code = EXIT_NONFINITE
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
