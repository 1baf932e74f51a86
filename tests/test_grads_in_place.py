"""passes/grads_in_place.py on hand-built graphs (make_fx, fake values): a ragged bucket's
gradient cat becomes one buffer its pieces' producers write into (``out=``), its gaps
zeroed in place, and a piece no producer can write copied (also one whose ``out=`` form has
no fake kernel); bitwise the cat's result. A cat that is not a ragged bucket's, or whose
producers are read by anything else, is left as it is."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from simplesharded.passes.annotations import RAGGED_KEY
from simplesharded.passes.grads_in_place import write_grads_in_place

aten = torch.ops.aten


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(3, 5, generator=g), torch.randn(5, 4, generator=g),
            torch.randn(6, 4, generator=g), torch.randn(2, 2, generator=g))


def bucket_grad(a, b, x, leaf):
    """A bucket's backward cat: a weight gradient (mm, transposed twice as aot_autograd leaves
    a linear's), a gap, a norm's gradient (sum), another gap, a graph input (no producer)."""
    w = torch.mm(a, b).t().t()
    norm = x.sum(0, keepdim=True)
    return torch.cat([w.reshape(-1), torch.zeros(4), norm.view(-1), torch.zeros(3),
                      leaf.view(-1)]) * 2


def _graph(fn, ragged=True):
    gm = make_fx(fn, tracing_mode="fake")(*_inputs())
    if ragged:
        for n in gm.graph.find_nodes(op="call_function", target=aten.cat.default):
            n.meta["custom"] = {RAGGED_KEY: "blocks.0/float32"}
    return gm


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_producers_write_into_the_buffer_bitwise():
    gm = write_grads_in_place(_graph(bucket_grad))
    gm.graph.lint()
    targets = _targets(gm)
    assert aten.cat.default not in targets
    assert targets.count(aten.empty.memory_format) == 1
    assert aten.mm.out in targets and aten.sum.IntList_out in targets
    assert aten.mm.default not in targets and aten.sum.dim_IntList not in targets
    assert targets.count(aten.zero_.default) == 2
    assert targets.count(aten.copy_.default) == 1  # the graph input: nothing writes it
    assert torch.equal(gm(*_inputs()), bucket_grad(*_inputs()))
    assert _targets(write_grads_in_place(gm)) == targets  # a second run changes nothing


def test_a_cat_that_is_not_a_ragged_buckets_is_left_alone():
    gm = write_grads_in_place(_graph(bucket_grad, ragged=False))
    assert aten.cat.default in _targets(gm) and aten.mm.out not in _targets(gm)


def test_a_producer_read_elsewhere_keeps_the_cat():
    def shared(a, b, x, leaf):
        w = torch.mm(a, b)
        return torch.cat([w.reshape(-1), leaf.view(-1)]), w.sum()

    gm = write_grads_in_place(_graph(shared))
    gm.graph.lint()
    assert aten.cat.default in _targets(gm) and aten.mm.out not in _targets(gm)
    assert all(torch.equal(o, r) for o, r in zip(gm(*_inputs()), shared(*_inputs())))


def test_elements_in_another_order_are_copied_into_the_buffer_once():
    """t(mm) flattened holds the elements in another order than mm wrote them: the mm keeps
    its own output and the reshape's copy (a clone) writes into the buffer instead."""
    def transposed(a, b, x, leaf):
        return torch.cat([torch.mm(a, b).t().reshape(-1), leaf.view(-1)])

    gm = write_grads_in_place(_graph(transposed))
    gm.graph.lint()
    targets = _targets(gm)
    assert aten.cat.default not in targets and aten.clone.out in targets
    assert aten.mm.default in targets and aten.mm.out not in targets
    assert torch.equal(gm(*_inputs()), transposed(*_inputs()))


def test_a_producer_whose_out_form_has_no_fake_kernel_is_copied(caplog):
    """An embedding's gradient (``embedding_dense_backward``) has an ``out=`` kernel but no
    fake one: its piece is copied, the mm's still written in place, and no error is logged
    (compiling a model with an embedding in a ragged bucket failed on it)."""
    def with_embedding(a, b, x, leaf):
        ids = torch.tensor([1, 0, 1, 5, 2, 0])
        emb = aten.embedding_dense_backward(x, ids, 7, -1, False)
        return torch.cat([torch.mm(a, b).reshape(-1), emb.view(-1), leaf.view(-1)])

    gm = write_grads_in_place(_graph(with_embedding))
    gm.graph.lint()
    targets = _targets(gm)
    assert aten.cat.default not in targets and aten.mm.out in targets
    assert aten.embedding_dense_backward.default in targets
    assert aten.embedding_dense_backward.out not in targets
    assert targets.count(aten.copy_.default) == 2  # the embedding's gradient, the graph input
    assert torch.equal(gm(*_inputs()), with_embedding(*_inputs()))
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_a_bucket_of_embeddings_compiles_and_matches_eager():
    """A module of two embeddings and a norm (BERT's input layer: one ragged bucket) under
    aot_eager_autobucketing, one rank: its gradients equal the uncompiled model's."""
    import simplesharded as ss
    from dist_utils import world_of_one

    class Embeddings(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.words, self.positions = torch.nn.Embedding(11, 8), torch.nn.Embedding(6, 8)
            self.norm = torch.nn.LayerNorm(8)

        def forward(self, ids):
            return self.norm(self.words(ids) + self.positions(torch.arange(ids.shape[1])))

    def grads(compiled: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(Embeddings(), torch.nn.Linear(8, 3))
        with world_of_one() as mesh:
            model = ss.data_parallel(model, mesh)
            run = torch.compile(model, backend="aot_eager_autobucketing") if compiled else model
            run(torch.tensor([[1, 4, 4, 10, 0, 3]])).square().sum().backward()
            return {n: p.grad.full_tensor() for n, p in model.named_parameters()}

    eager, compiled = grads(False), grads(True)
    assert eager.keys() == compiled.keys() and "0.words.weight" in eager
    assert all(torch.equal(compiled[n], eager[n]) for n in eager)
