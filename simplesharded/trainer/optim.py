"""The optimizer over the shards, its learning-rate schedule and gradient clipping by the
global norm of sharded gradients."""
from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from simplesharded.trainer.config import Config


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


def implementation(cfg: Config) -> str:
    """``optimizer.implementation`` with ``auto`` resolved: fused where the step runs on the
    host (``parallelism.offload``), foreach elsewhere."""
    impl = cfg.optimizer.implementation
    if impl != "auto":
        return impl
    return "foreach" if cfg.parallelism.offload == "none" else "fused"


def build_optimizer(cfg: Config, params):
    o = cfg.optimizer
    impl = OPTIMIZER_IMPL[implementation(cfg)]
    if o.name == "SGD":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.beta1, weight_decay=o.weight_decay,
                               **impl)
    return torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                             weight_decay=o.weight_decay, **impl)


def grad_norm_and_clip(params, max_norm: float, pp_group=None) -> torch.Tensor:
    """Global L2 norm over sharded grads (a DTensor norm reduces across ranks), clipped.
    Gradients on different meshes (expert weights live on the ep mesh, the others on the
    dense one; DTensor computes on one mesh at a time) are normed per mesh, then combined.
    ``pp_group``: the pipeline's group, whose ranks hold the other stages' gradients: their
    squared norms are summed over it."""
    by_mesh: dict = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = [_total_norm([p.grad for p in group]) for group in by_mesh.values()] or [
        _total_norm([])]
    norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    if pp_group is not None:
        squared = norm.square()
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
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
