"""The language-model loss, computed in the model's forward so that it is traced (and compiled)
together with the model: the output projection's gather stays in the one graph.

``lm_loss(hidden, head, labels, chunks)`` is the summed cross-entropy of ``head(hidden)``
against ``labels``. With ``chunks`` > 1 the tokens are split into that many chunks and the
full-vocabulary logits never exist at once: each chunk's logits are computed, turned into that
chunk's loss and its gradients with respect to the hidden states and the projection weight,
and freed. Only those gradients are kept for backward (the size of the hidden states and of
the weight), so backward recomputes nothing and the result is the unchunked gradient
(summation order aside). In mixed precision the chunk's logits come out of the matmul in the
weight's dtype and the softmax and loss run in fp32, as for the unchunked loss; the weight's
gradient is accumulated over chunks in fp32.

``chunks``: 0 = auto (the fewest chunks whose logits have at most :data:`AUTO_CHUNK_LOGITS`
elements each, i.e. 256 MiB in fp32), 1 = unchunked, N = N chunks (at most one per token).
Chunking needs a plain output projection without bias: a tensor-parallel one (its weight a
DTensor) takes 1 only (the trainer passes 1 under tensor parallelism; with loss parallelism
no rank holds full logits anyway), else a resolved count > 1 is a ValueError.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

IGNORE_INDEX = -100  # F.cross_entropy's default: labels with this value add no loss
AUTO_CHUNK_LOGITS = 2**26  # logits per chunk under chunks=0 (auto): 256 MiB in fp32


def num_chunks(chunks: int, tokens: int, vocab: int) -> int:
    """How many chunks ``lm_loss`` splits ``tokens`` tokens into (see the module doc)."""
    if chunks < 0:
        raise ValueError(f"loss chunks={chunks} must be >= 0 (0 = auto, 1 = unchunked)")
    if chunks == 0:
        chunks = math.ceil(tokens * vocab / AUTO_CHUNK_LOGITS)
    return max(1, min(chunks, tokens))


def with_term(loss: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
    """``loss + term`` for a plain ``term`` (an auxiliary loss): under loss parallelism the
    loss is a DTensor every tp rank holds whole, and the term joins it replicated."""
    if isinstance(loss, DTensor):
        term = DTensor.from_local(term, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim,
                                  run_check=False)
    return loss + term


def lm_loss(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, chunks: int = 0,
            ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Summed cross-entropy (fp32 scalar) of ``head(hidden)`` [..., V] against ``labels`` [...]
    in ``chunks`` chunks of tokens (0 = auto). ``head`` is the model's output ``Linear``; its
    weight is read once (under data_parallel: gathered once)."""
    n = num_chunks(chunks, labels.numel(), head.out_features)
    if n == 1:  # the module call: tensor parallelism's hooks run (loss parallel: DTensor logits)
        return F.cross_entropy(head(hidden).float().flatten(0, -2), labels.flatten(),
                               reduction="sum", ignore_index=ignore_index)
    if head.bias is not None:
        raise ValueError(f"loss chunks={chunks}: an output projection with a bias is not "
                         f"supported; use 1")
    weight = head.weight
    if isinstance(weight, DTensor) or isinstance(hidden, DTensor):
        raise ValueError(f"loss chunks={chunks} (resolved to {n}): chunking needs a plain output "
                         f"projection, not a tensor-parallel one; use 1")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedCrossEntropy.apply(hidden, weight, labels, n, ignore_index)
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for h, y in zip(hidden.tensor_split(n), labels.tensor_split(n)):
        loss = loss + F.cross_entropy(F.linear(h, weight).float(), y, reduction="sum",
                                      ignore_index=ignore_index)
    return loss


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Forward: the loss, chunk by chunk, and with it the gradients of the loss (for an upstream
    gradient of 1) with respect to hidden [N, D] and weight [V, D]; only those are saved.
    Backward: the saved gradients times the upstream gradient (a scalar)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunks, ignore_index):
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_h = []
        for h, y in zip(hidden.tensor_split(chunks), labels.tensor_split(chunks)):
            logp = torch.log_softmax(F.linear(h, weight).float(), dim=-1)  # [n, V] fp32
            loss = loss + F.nll_loss(logp, y, reduction="sum", ignore_index=ignore_index)
            # d loss / d logits = softmax - one_hot(label); zero on ignored tokens
            valid = (y != ignore_index)[:, None]
            target = torch.where(valid, y[:, None], 0)
            g = logp.exp_().scatter_add_(1, target, -torch.ones_like(target, dtype=logp.dtype))
            g = g.mul_(valid).to(h.dtype)
            del logp
            grad_h.append(g @ weight)
            if g.dtype == grad_w.dtype:
                grad_w.addmm_(g.t(), h)
            else:  # each chunk's product in the weight's dtype, summed in fp32
                grad_w.add_(g.t() @ h)
        ctx.save_for_backward(torch.cat(grad_h), grad_w.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, grad_w * grad_loss, None, None, None
