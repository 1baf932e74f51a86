"""The training loop: :class:`Trainer` builds the mesh, data, model (meta device →
parallelize → initialise the shards), optimizer and schedule from a resolved config, and
runs steps with gradient accumulation, clipping, validation, DCP checkpoints, metrics and
profiling. Under pipeline parallelism a step is the pipeline schedule's
(:meth:`Trainer.pipeline_step`) and the model is this rank's stages."""
from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from simplesharded.storage.grad_sync import set_requires_gradient_sync
from simplesharded.storage.init import init_sharded
from simplesharded.mesh import PP_DIM, build_mesh, ep_dim
from simplesharded.models import hf_loading, hf_source
from simplesharded.trainer import checkpoint as ckpt
from simplesharded.trainer.config import Config
from simplesharded.trainer.data import build_data
from simplesharded.trainer.metrics import (MetricsLogger, format_record, memory_stats, peak_flops,
                                          reset_peak_memory, throughput)
from simplesharded.trainer.optim import build_optimizer, grad_norm_and_clip, lr_lambda
from simplesharded.trainer.preflight import HF
from simplesharded.pipeline.pipelining import Pipeline
from simplesharded.trainer.recipe import (loss_chunks, parallelize, pipeline_loss,
                                          uses_loss_parallel)


class NonFiniteError(RuntimeError):
    pass


def local_loss(t: torch.Tensor) -> torch.Tensor:
    """A loss-parallel loss is a DTensor replicated over tp: its local value is the loss."""
    return t.to_local() if isinstance(t, DTensor) else t


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
    return ValueError(f"compile.fullgraph=true: the forward of {cfg.model.label()} "
                      f"graph-breaks{where}: "
                      f"{what}; rerun with --no-compile.fullgraph to compile the pieces "
                      f"between breaks (each is bucketed on its own)")


class Trainer:
    def __init__(self, cfg: Config, device: str, observer=None):
        self.cfg, self.device = cfg, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        p, t = cfg.parallelism, cfg.training
        self.mesh = build_mesh(p.data_parallel_replicate_degree, p.data_parallel_shard_degree,
                               device, p.tensor_parallel_degree, p.expert_parallel_degree,
                               p.context_parallel_degree, p.pipeline_parallel_degree)
        # tp is the innermost mesh dim, cp the next: the cp x tp ranks of one dp rank are
        # consecutive and read the same batch (each cp rank keeps its chunks of it); pp the
        # outermost: the stages of one dp rank read the same batch too (the first stage its
        # inputs, the last its labels).
        self.tp, self.cp = p.tensor_parallel_degree, p.context_parallel_degree
        self.loss_parallel = uses_loss_parallel(cfg)
        self.loss_chunks = loss_chunks(cfg)
        torch.manual_seed(cfg.job.seed)
        shared = self.tp * self.cp
        per_stage = self.world // p.pipeline_parallel_degree
        self.data = build_data(cfg, (self.rank % per_stage) // shared, per_stage // shared,
                               cp_rank=self.rank // self.tp % self.cp)
        hf = cfg.model.name == HF
        if hf:
            model = hf_source.build_hf_model(cfg.model.path)
        else:
            model = cfg.model.build()
        if self.data.tokenizer.vocab_size > model.args.vocab_size:
            raise ValueError(f"model.tokenizer_path: vocabulary {self.data.tokenizer.vocab_size} "
                             f"does not fit the model's vocab_size {model.args.vocab_size}")
        self.step_fn = parallelize(model, self.mesh, cfg, observer=observer,
                                   loss_fn=pipeline_loss(self._denominator(), model))
        self.pipeline = self.step_fn if isinstance(self.step_fn, Pipeline) else None
        # Each rank fills only its shards (or its stages'), on the mesh's device: a Hugging
        # Face model's from its files (or its init), by name; a zoo model's with its slice of
        # the same full values at any world size and tp / ep degree (storage/init.py).
        parts = self.pipeline.modules if self.pipeline is not None else [model]
        for part in parts:
            if hf:
                how = hf_loading.materialize(part, cfg.job.seed)
            else:
                init_sharded(part, seed=cfg.job.seed)
        if hf:
            tok = cfg.model.tokenizer_path or "built-in bytes"
            self._print(f"[simplesharded] model.path={cfg.model.path!r}: weights {how}, "
                        f"tokenizer {tok}")
        if self.pipeline is not None:
            self.model_info = model  # the whole model (meta): what a checkpoint says it is
            model = self.pipeline.model  # this rank's stages, under the model's names
        self.model = model
        if self.pipeline is None:
            self.model_info = model
        self.params = [q for q in model.parameters() if q.requires_grad]
        self.optimizer = build_optimizer(cfg, self.params)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.tokens_per_step = t.global_batch_size * t.seq_len
        self.flops_per_token = self.model_info.num_flops_per_token(t.seq_len)
        # compile.scope=step: forward to optimizer step in one graph (simplesharded/step/__init__.py)
        self.whole_step = self._compile_step(observer) if (
            cfg.compile.enable and cfg.compile.scope == "step") else None
        self.peak = peak_flops(device, cfg.metrics.peak_tflops, t.mixed_precision_param)
        self.ckpt_folder = os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder)
        # every rank makes the async saver's group here, at once (checkpoint.py AsyncSaver)
        self.saver = (ckpt.AsyncSaver() if cfg.checkpoint.enable
                      and cfg.checkpoint.async_mode == "async" else None)
        self.step = 0

    # ------------------------------------------------------------------ steps
    def forward_loss(self, fn, inputs, labels):
        """Summed cross-entropy of ``fn`` (the compiled step or the model) on one micro-batch,
        computed in the model's forward: compiled, the loss and the output projection's gather
        are in the model's graph, and with ``training.loss_chunks`` != 1 the full fp32 logits
        never exist at once (models/loss.py). Under loss parallelism the logits are a
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

    def _denominator(self) -> int:
        """What a rank divides its summed loss by. sum: the global token count, gradients are
        summed, so the result is the exact global mean; avg: its local token count, gradients
        averaged over ranks."""
        t = self.cfg.training
        if t.grad_reduction == "sum":  # called before tokens_per_step is set
            return t.global_batch_size * t.seq_len
        # a cp rank holds seq_len / cp tokens of each sequence; the loss sums over all ranks'
        # tokens count each once (the cp ranks' are disjoint), tp's tp times
        return t.local_batch_size * t.seq_len // self.cp * t.gradient_accumulation_steps

    def _compile_step(self, observer):
        from simplesharded.step import compile_step
        from simplesharded.trainer.recipe import _ScopedCalls, _backend_options

        c, t, denom = self.cfg.compile, self.cfg.training, self._denominator()

        def loss_fn(model, inputs, labels):
            return model(inputs, labels, loss_chunks=self.loss_chunks) / denom

        step = compile_step(self.model, self.optimizer, loss_fn, backend=c.backend,
                            max_norm=t.max_norm if t.max_norm > 0 else None,
                            clip_norm=t.clip_norm,
                            accumulation_steps=t.gradient_accumulation_steps,
                            with_grad_norm=True, skip_nonfinite=t.on_nonfinite == "skip",
                            **_backend_options(c, observer, t.mixed_precision_param))
        if ep_dim(self.mesh):  # the token exchange's split sizes: as the compiled model's
            from simplesharded.models.ep_dispatch import ep_compile_config
            return _ScopedCalls(step, ep_compile_config)
        return step

    def _train_whole_step(self) -> dict[str, float]:
        """One step of compile.scope=step: the graph has taken the optimizer's step when it
        returns. A non-finite loss or norm stops training after it under
        training.on_nonfinite=stop; under skip the graph took the update only if both were
        finite on every rank (compile_step's skip_nonfinite), and says whether it did."""
        # The step's micro-batches in one batch: the graph splits it again (compile_step)
        micro = [next(self.data.train)
                 for _ in range(self.cfg.training.gradient_accumulation_steps)]
        inputs, labels = (torch.cat(parts) for parts in zip(*micro))
        with self._loss_context():  # the loss's backward is in the graph too
            scaled, norm, *taken = self.whole_step(inputs.to(self.device),
                                                   labels.to(self.device))
        loss_sum = local_loss(scaled) * self._denominator()
        dist.all_reduce(loss_sum)
        loss = (loss_sum / (self.tokens_per_step * self.tp)).item()
        norm = norm.item()
        # under skip the graph's own decision, the same on every rank (not re-derived here)
        updated = taken[0].item() if taken else math.isfinite(loss) and math.isfinite(norm)
        if not updated:
            if not taken:
                raise NonFiniteError(f"non-finite loss={loss} or grad_norm={norm} at step "
                                     f"{self.step + 1}; training stopped, checkpoints untouched")
            self._print(f"step {self.step + 1}: non-finite loss/grad norm, step skipped")
        elif hasattr(self.model, "update_expert_bias"):
            self.model.update_expert_bias()
        with warnings.catch_warnings():
            # The graph took the optimizer's step; torch's scheduler, which watches calls to
            # optimizer.step(), would warn at every step that it has not seen one.
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()`"),
                                    UserWarning)
            self.scheduler.step()
        return {"loss": loss, "grad_norm": norm}

    def accumulation_steps(self) -> torch.Tensor:
        """Forward and backward of each micro-batch of one optimizer step: the summed loss of
        this rank's batch."""
        t = self.cfg.training
        denom = self._denominator()
        loss_sum = torch.zeros((), device=self.device)
        n = t.gradient_accumulation_steps
        # last_microbatch: the earlier micro-batches' backwards only accumulate locally, the
        # last one reduces the sum once (simplesharded/storage/grad_sync.py); every rank toggles alike.
        sync_last = n > 1 and t.gradient_sync == "last_microbatch"
        for i in range(n):
            if sync_last:
                set_requires_gradient_sync(self.model, i == n - 1)
            inputs, labels = next(self.data.train)
            with self._loss_context():  # backward too: the loss's own backward is parallel
                loss = self.forward_loss(self.step_fn, inputs, labels)
                (loss / denom).backward()
            loss_sum += local_loss(loss.detach())
        return loss_sum

    def pipeline_step(self) -> torch.Tensor:
        """The micro-batches of one optimizer step through the pipeline schedule: the summed
        loss of this rank's batch where its last stage lives (zero elsewhere). Each schedule
        step splits one accumulation step's batch into the schedule's micro-batches."""
        loss_sum = torch.zeros((), device=self.device)
        for _ in range(self.cfg.training.gradient_accumulation_steps):
            inputs, labels = next(self.data.train)
            with self._loss_context():  # the last stage's loss and its backward
                losses = self.pipeline.step(inputs.to(self.device), labels.to(self.device))
            loss_sum += self._pipeline_loss_sum(losses)
        return loss_sum

    def _pipeline_loss_sum(self, losses) -> torch.Tensor | float:
        """The schedule's per-micro-batch losses (each / the denominator) back to a sum; 0 on
        a rank without the last stage (``losses`` None)."""
        if not losses:
            return 0.0
        return torch.stack([local_loss(x.detach()) for x in losses]).sum() * self._denominator()

    def train_step(self) -> dict[str, float]:
        if self.whole_step is not None:
            return self._train_whole_step()
        t = self.cfg.training
        self.optimizer.zero_grad(set_to_none=True)
        pp_group = None
        if self.pipeline is not None:
            loss_sum = self.pipeline_step()
            pp_group = self.mesh.get_group(PP_DIM)  # each stage's gradients on its ranks
        else:
            loss_sum = self.accumulation_steps()
        norm = grad_norm_and_clip(self.params, t.max_norm, pp_group)
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
            if self.pipeline is not None:
                self.pipeline.update_expert_bias()
            elif hasattr(self.model, "update_expert_bias"):
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
            if self.pipeline is not None:
                with self._loss_context():
                    losses = self.pipeline.evaluate(inputs.to(self.device),
                                                    labels.to(self.device))
                total += self._pipeline_loss_sum(losses)
                continue
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
                try:
                    record = self.train_step()
                except NonFiniteError:  # every rank alike: the last good save still commits
                    if self.saver:
                        self.saver.wait()
                    raise
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
                    (self.saver.save if self.saver else ckpt.save)(
                        self.ckpt_folder, self.step, self.model, self.optimizer,
                        self.data.train.state_dict(), cfg.checkpoint.keep_latest_k,
                        ckpt.model_meta(self.model_info, cfg.model.name, cfg.model.flavor))
                if profiler:
                    profiler.step()
        if self.saver:
            self.saver.wait()  # the last save, committed before the run ends
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
