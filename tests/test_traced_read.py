"""A traced parameter read is one op in dynamo's graph (simplesharded/storage/gather.py): one
``simplesharded::gather_read`` node per parameter and no collective of its own there; the
aot_autograd graphs hold its body, one annotated all-gather per parameter in forward and one
annotated reduce-scatter per parameter in backward; a copied model's reads find their own
records (fake process group of 2)."""
import copy

import torch

import simplesharded as ss
from simplesharded.passes.annotations import PARAM_KEY, annotations

READ = torch.ops.simplesharded.gather_read  # dynamo records the overload packet
C10D = torch.ops._c10d_functional


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
    return ss.data_parallel(model, ss.build_mesh(1, -1, "cpu"), storage="param")


def _compile_and_run(model):
    """(dynamo graph's call targets, aot graphs by kind, loss)."""
    graphs = {}

    def observe(kind, stage, gm):
        graphs[kind] = gm

    inner = ss.make_backend("aot_eager", observer=observe)

    def backend(gm, example_inputs):
        graphs["dynamo"] = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        return inner(gm, example_inputs)

    loss = torch.compile(model, backend=backend, fullgraph=True)(torch.ones(2, 4)).sum()
    loss.backward()
    return graphs, loss.item()


def _annotated(gm, target):
    return [annotations(n).get(PARAM_KEY) for n in gm.graph.nodes if n.target is target]


def test_one_op_per_read_and_its_body_in_the_aot_graphs(fake_pg):
    model = _model()
    names = {n for n, _ in model.named_parameters()}
    graphs, _ = _compile_and_run(model)
    dynamo = graphs["dynamo"]
    assert dynamo.count(READ) == len(names) == 4
    assert not [t for t in dynamo if "c10d" in str(t) or "redistribute" in str(t)], dynamo
    assert set(_annotated(graphs["fw"], C10D.all_gather_into_tensor.default)) == names
    assert len(_annotated(graphs["fw"], C10D.all_gather_into_tensor.default)) == 4
    assert sorted(_annotated(graphs["bw"], C10D.reduce_scatter_tensor.default)) == sorted(names)


def test_a_copied_model_reads_its_own_shards(fake_pg):
    model = _model()
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for p in copied.parameters():
            p.mul_(2)
    (_, ours), (_, theirs) = _compile_and_run(model), _compile_and_run(copied)
    assert theirs != ours
    torch._dynamo.reset()
    assert _compile_and_run(model)[1] == ours
