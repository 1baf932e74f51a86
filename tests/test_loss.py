"""The chunked language-model loss (models/loss.py), single process.

- Chunked equals unchunked: the loss and every gradient, on a hand-built head and on the llama3
  debug model, with token counts the chunk counts do not divide and ignored labels; eager and
  compiled (aot_eager, whose backward graph must not take any chunk's logits), fp32 and bf16.
- Memory: on the debug model with a 128k vocabulary, the peak of live tensor bytes over
  forward + backward drops by more than the size of the fp32 logits.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from simplesharded.models.loss import AUTO_CHUNK_LOGITS, IGNORE_INDEX, lm_loss, num_chunks
from simplesharded.models import build_model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def test_num_chunks():
    assert num_chunks(1, 10, 1000) == 1 and num_chunks(4, 10, 1000) == 4
    assert num_chunks(64, 10, 1000) == 10  # at most one chunk per token
    # auto: the fewest chunks of at most 2**26 logits
    assert num_chunks(0, 512, 128256) == 1  # 65.7M logits
    assert num_chunks(0, 8192, 128256) == 16  # 1.05G logits: 16 chunks of 512 tokens
    assert num_chunks(0, 8192, 128256) * AUTO_CHUNK_LOGITS >= 8192 * 128256
    with pytest.raises(ValueError, match="must be >= 0"):
        num_chunks(-1, 10, 1000)


def _head_grads(hidden, head, labels, chunks, scale):
    h = hidden.clone().requires_grad_()
    head.zero_grad(set_to_none=True)
    loss = lm_loss(h, head, labels, chunks)
    (loss * scale).backward()
    return loss.detach(), h.grad, head.weight.grad.clone()


def test_chunked_equals_unchunked_hand_built():
    """101 tokens (prime: no chunk count divides it), 7 of them ignored."""
    torch.manual_seed(0)
    N, D, V = 101, 64, 1000
    head = torch.nn.Linear(D, V, bias=False)
    hidden = torch.randn(N, D)
    labels = torch.randint(0, V, (N,))
    labels[3:10] = IGNORE_INDEX
    want = _head_grads(hidden, head, labels, 1, 1.0)
    assert torch.equal(want[0], F.cross_entropy(head(hidden), labels, reduction="sum"))
    for chunks in (2, 4, 7):
        got = _head_grads(hidden, head, labels, chunks, 1.0)
        for what, g, w in zip(("loss", "grad hidden", "grad weight"), got, want):
            assert rel(g, w) <= 1e-6, (chunks, what, rel(g, w))
        with torch.no_grad():
            assert rel(lm_loss(hidden, head, labels, chunks), want[0]) <= 1e-6
    # An upstream gradient other than 1 (the trainer's 1/tokens) scales the saved gradients
    # after the matmuls instead of before, and one-token chunks (200 -> 101 chunks) take
    # matrix-vector kernels: other roundings, no larger than the unchunked loss's own
    # distance from float64, or the 1e-6 where that distance happens to be 0.
    head64 = torch.nn.Linear(D, V, bias=False, dtype=torch.float64)
    head64.weight.data.copy_(head.weight.data)
    exact = _head_grads(hidden.double(), head64, labels, 1, 1 / 7)
    one = _head_grads(hidden, head, labels, 1, 1 / 7)
    for chunks in (7, 200):
        got = _head_grads(hidden, head, labels, chunks, 1 / 7)
        for what, c, o, e in zip(("loss", "grad hidden", "grad weight"), got, one, exact):
            assert rel(c, e) <= max(2 * rel(o, e), 1e-6), (chunks, what, rel(c, e), rel(o, e))


def _model_grads(model, fn, tokens, labels, chunks):
    model.zero_grad(set_to_none=True)
    loss = fn(tokens, labels, loss_chunks=chunks)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _compiled_saved_shapes():
    """An aot_eager-like backend; the list fills with the shapes its backward graphs take
    (saved tensors and the loss's gradient)."""
    shapes: list[tuple[int, ...]] = []

    def bw_compiler(gm, example_inputs):
        shapes.extend(tuple(n.meta["val"].shape) for n in gm.graph.nodes
                      if n.op == "placeholder" and "val" in n.meta)
        return make_boxed_func(gm.forward)

    return shapes, aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                                bw_compiler=bw_compiler)


def test_chunked_model_equals_unchunked_eager_and_compiled():
    """llama3 debug (1 block): 3 x 37 = 111 tokens in 4 chunks. Compiled, the backward graph
    takes no chunk's logits ([n, vocab]): only the gradients the forward computed."""
    torch.manual_seed(0)
    model = build_model("llama3", "debug", device="cpu", n_layers=1)
    V, D = model.args.vocab_size, model.args.dim
    tokens, labels = torch.randint(0, V, (3, 37)), torch.randint(0, V, (3, 37))
    labels[0, :5] = IGNORE_INDEX
    loss1, grads1 = _model_grads(model, model, tokens, labels, 1)
    loss4, grads4 = _model_grads(model, model, tokens, labels, 4)
    assert rel(loss4, loss1) <= 1e-6
    for name in grads1:
        assert rel(grads4[name], grads1[name]) <= 1e-6, (name, rel(grads4[name], grads1[name]))
    with torch.no_grad():
        assert rel(model(tokens, labels, loss_chunks=4), loss1) <= 1e-6

    shapes, backend = _compiled_saved_shapes()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    try:
        loss_c, grads_c = _model_grads(model, compiled, tokens, labels, 4)
    finally:
        torch._dynamo.reset()
    assert rel(loss_c, loss1) <= 1e-6
    for name in grads1:
        assert rel(grads_c[name], grads1[name]) <= 1e-6, (name, rel(grads_c[name], grads1[name]))
    assert (V, D) in shapes, shapes  # the output weight's gradient, computed in forward
    assert not [s for s in shapes if s and s[-1] == V], shapes  # no logits saved

    # bf16 parameters (the loss in fp32): the same up to bf16 rounding of the gradients
    model = model.to(torch.bfloat16)
    loss1, grads1 = _model_grads(model, model, tokens, labels, 1)
    loss4, grads4 = _model_grads(model, model, tokens, labels, 4)
    assert loss4.dtype == torch.float32 and rel(loss4, loss1) <= 1e-6
    for name in grads1:
        assert grads4[name].dtype == torch.bfloat16
        assert rel(grads4[name], grads1[name]) <= 2 ** -6, (name, rel(grads4[name], grads1[name]))


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages that ops create while the mode is active and that are
    still referenced: views and in-place results share an input's storage and add nothing;
    storages that existed before (parameters) are not counted."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for ptr, (ref, nbytes) in list(self.live.items()):
            if ref.expired():
                del self.live[ptr]
                self.now -= nbytes
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr and ptr not in inputs and ptr not in self.live:
                    self.live[ptr] = (StorageWeakRef(storage), storage.nbytes())
                    self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        return out


def test_chunked_loss_peak_memory_128k_vocab():
    """llama3 debug (1 block) with Llama 3's 128256-token vocabulary, 2 x 192 tokens: the
    unchunked loss holds the fp32 logits, their log-softmax and its gradient (3 x 188 MiB);
    8 chunks hold the output weight's gradient from forward and a chunk's logits at a time."""
    V = 128256
    model = build_model("llama3", "debug", device="meta", n_layers=1, vocab_size=V)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():  # cheaper than init_weights' truncated normals on 2 x 33M weights
        for p in model.parameters():
            p.uniform_(-0.05, 0.05)
    model.freqs_cis = model._freqs_cis()
    tokens, labels = torch.randint(0, V, (2, 192)), torch.randint(0, V, (2, 192))
    logits_bytes = tokens.numel() * V * 4
    peaks, losses = {}, {}
    for chunks in (1, 8):
        model.zero_grad(set_to_none=True)
        with LiveTensorBytes() as mode:
            loss = model(tokens, labels, loss_chunks=chunks)
            loss.backward()
        peaks[chunks], losses[chunks] = mode.peak, loss.item()
    assert abs(losses[8] - losses[1]) <= 1e-6 * abs(losses[1])
    assert peaks[8] <= peaks[1] - logits_bytes, (
        f"peak MiB: unchunked {peaks[1] / 2**20:.0f}, 8 chunks {peaks[8] / 2**20:.0f}; "
        f"logits {logits_bytes / 2**20:.0f}")
