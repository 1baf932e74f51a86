"""Blocks from the module tree (simplesharded/blocks.py) and what the compiled graphs make of them.

Detection is checked on hand-built trees (ModuleList, ModuleDict with non-numeric keys,
Sequential, nested stacks, blocks as plain attributes, a model without repeated blocks) and on
the zoo; the graphs of the GPT-shaped model (blocks in a ModuleDict under ``block_a``...,
output tied to the embedding) must bucket one all-gather per block like llama3's and gather
and reduce the tied weight once.
"""
import warnings

import pytest
import torch
from torch import nn

from simplesharded.blocks import block_of, find_blocks
from simplesharded.models import build_model


def fqns(model, blocks=None):
    return [f for f, _ in find_blocks(model, blocks)]


class MLP(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)


class Attn(nn.Module):  # q/k/v/o: repeated leaves of a plain module, never blocks
    def __init__(self, d=4):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))


class Layer(nn.Module):
    def __init__(self, d=4, experts=0):
        super().__init__()
        self.attn, self.mlp = Attn(d), MLP(d)
        if experts:
            self.experts = nn.ModuleList(MLP(d) for _ in range(experts))


class Stack(nn.Module):
    def __init__(self, n, container="list", experts=0):
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        layers = [Layer(experts=experts) for _ in range(n)]
        if container == "list":
            self.layers = nn.ModuleList(layers)
        elif container == "dict":
            self.layers = nn.ModuleDict({name: m for name, m in zip("xyzw", layers)})
        else:  # plain attributes
            for name, m in zip(("first", "second", "third"), layers):
                setattr(self, name, m)
        self.head = nn.Linear(4, 8)


def test_module_list_and_dict_without_digits():
    assert fqns(Stack(3)) == ["layers.0", "layers.1", "layers.2"]
    assert fqns(Stack(3, "dict")) == ["layers.x", "layers.y", "layers.z"]
    assert fqns(Stack(1)) == ["layers.0"]  # one composite layer in a list is still a block


def test_plain_attributes_when_no_container_qualifies():
    assert fqns(Stack(3, "attrs")) == ["first", "second", "third"]


def test_experts_stay_inside_their_block():
    assert fqns(Stack(2, experts=4)) == ["layers.0", "layers.1"]


def test_nested_stacks_are_all_found():
    class EncDec(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.decoder = Stack(2), Stack(3, "dict")

    assert fqns(EncDec()) == ["encoder.layers.0", "encoder.layers.1", "decoder.layers.x",
                              "decoder.layers.y", "decoder.layers.z"]


def test_sequential_takes_only_the_repeated_class():
    model = nn.Sequential(nn.Embedding(8, 4), Layer(), Layer(), nn.LayerNorm(4), nn.Linear(4, 8))
    assert fqns(model) == ["1", "2"]
    assert fqns(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))) == ["0", "2"]


def test_no_repeated_blocks():
    class Single(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.body, self.head = nn.Embedding(8, 4), Layer(), nn.Linear(4, 8)

    assert fqns(Single()) == []
    assert fqns(nn.Linear(3, 3)) == []
    assert block_of(Single()) == {}


def test_zoo():
    assert fqns(build_model("llama3", "debug")) == [f"layers.{i}" for i in range(6)]
    assert fqns(build_model("deepseek_v3", "debug"))[0] == "layers.0"
    assert fqns(build_model("gpt", "debug")) == [f"blocks.block_{c}" for c in "abcd"]


def test_user_named_blocks():
    model = Stack(2)
    assert fqns(model, [Layer]) == ["layers.0", "layers.1"]
    assert fqns(model, ["Layer"]) == ["layers.0", "layers.1"]  # a class name
    assert fqns(model, [r"layers\.\d+\.mlp"]) == ["layers.0.mlp", "layers.1.mlp"]
    assert fqns(model, [MLP]) == ["layers.0.mlp", "layers.1.mlp"]  # outermost match only
    assert block_of(model, [Layer])["layers.1.attn.q"] == "layers.1"
    with pytest.raises(ValueError, match=r"blocks=\['Nope'\] match no module of Stack"):
        find_blocks(model, ["Nope"])
    with pytest.raises(ValueError, match="is not a module class"):
        find_blocks(model, [3])


def test_same_blocks_once_wrapped():
    """data_parallel gives every module holding parameters a class of its own: the blocks
    found afterwards (init_sharded asks then) are the ones found before, by class or name."""
    from pass_utils import fake_world

    import simplesharded as ss

    model = nn.Sequential(nn.Linear(4, 4), Layer(), Layer(), nn.Linear(4, 4))
    before = fqns(model)
    with fake_world(2) as mesh:
        ss.data_parallel(model, mesh, storage="param")
        assert fqns(model) == before == ["0", "1", "2", "3"]
        assert fqns(model, ["Linear"]) == ["0", "1.attn.q", "1.attn.k", "1.attn.v", "1.attn.o",
                                           "1.mlp.up", "1.mlp.down", "2.attn.q", "2.attn.k",
                                           "2.attn.v", "2.attn.o", "2.mlp.up", "2.mlp.down", "3"]


# ------------------------------------------------------------------- graphs (fake process group)


@pytest.fixture
def counts():
    from simplesharded.tools.report import trace_counts
    from pass_utils import fake_world

    def run(model, backend, **kw):
        with fake_world(2):
            return trace_counts(model, "debug", backend, **kw)
    return run


def test_gpt_blockbucketing_one_gather_per_block(counts):
    """ModuleDict blocks under non-numeric keys bucket like llama3's layers.N: one all-gather
    per block in forward plus the parameters before (embeddings) and after (final norm)."""
    n_blocks = 4
    c = counts("gpt", "aot_eager_blockbucketing")
    assert c["fw"]["after"]["all_gather"] == n_blocks + 2
    assert c["bw"]["after"]["reduce_scatter"] == n_blocks + 2


def test_gpt_tied_weight_gathered_and_reduced_once(counts):
    """52 distinct parameters (4 blocks of 12, wte/wpe, ln_f; the head is wte): one gather and
    one reduction each, the tied weight included."""
    model = build_model("gpt", "debug")
    n_params = len(list(model.parameters()))
    assert n_params == 4 * 12 + 4
    c = counts("gpt", "aot_eager")
    assert c["fw"]["before"]["all_gather"] == n_params
    assert c["bw"]["before"]["reduce_scatter"] == n_params


def _no_block_warnings(n_layers: int) -> tuple[list[str], int]:
    """BlockPlan on a chain of ``n_layers`` 2048 x 2048 fp32 gathers (16 MiB each) whose
    parameters carry no block: its warnings and the all-gathers left."""
    from pass_utils import chain_graph

    from simplesharded.passes.bucketing import bucket_collectives
    from simplesharded.passes.plans import BlockPlan

    gm = chain_graph(n_layers, rows=2048)
    for node in gm.graph.nodes:
        (node.meta.get("custom") or {}).pop("ss_block", None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        bucket_collectives(gm, BlockPlan())
    gathers = sum(1 for n in gm.graph.nodes
                  if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default)
    return [str(w.message) for w in seen if "found no blocks" in str(w.message)], gathers


def test_no_blocks_in_a_large_model_warns():
    """No block found: one bucket, and above 64 MiB one warning naming its size."""
    assert _no_block_warnings(3) == ([], 1)  # 48 MiB: silent
    msgs, gathers = _no_block_warnings(5)
    assert gathers == 1 and len(msgs) == 1 and "80 MiB" in msgs[0], msgs


# ------------------------------------------------------------ runtime counts (2 gloo ranks)


def _runtime_counts(rank, world):
    """Collectives rank 0's gloo backend ran, by event name, for forward alone and for forward
    + backward of one compiled step (after a warm-up step), per backend."""
    import collections

    from torch.profiler import ProfilerActivity, profile

    import simplesharded as ss

    def gloo_events(fn):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        return dict(collections.Counter(e.name for e in prof.events()
                                        if e.name.startswith("gloo:")))

    out = {}
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(rank))
    for backend in ("aot_eager", "aot_eager_blockbucketing"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = ss.data_parallel(build_model("gpt", "debug", device="cpu"),
                                 ss.init_mesh(dp_shard=-1, device="cpu"), storage="param")
        cm = torch.compile(model, backend=ss.make_backend(backend), fullgraph=True)
        cm(x).sum().backward()
        out[backend] = {"fw": gloo_events(lambda: cm(x)),
                        "step": gloo_events(lambda: cm(x).sum().backward())}
    return out


@pytest.mark.slow
def test_runtime_counts_on_gpt():
    """Counted by the profiler at runtime, not read from graphs: block bucketing issues one
    all-gather per block bucket in forward (4 blocks + embeddings + final norm), and the
    unbucketed step gathers each of the 52 parameters once in forward and reduces each once
    (gloo runs a reduce-scatter as an all-reduce), the tied embedding/head weight included."""
    from dist_utils import spawn

    counts = spawn(2, _runtime_counts)[0]
    plain, block = counts["aot_eager"], counts["aot_eager_blockbucketing"]
    assert plain["fw"] == {"gloo:all_gather": 52}, plain
    assert plain["step"]["gloo:all_reduce"] == 52, plain
    fw_gathers = sum(n for name, n in block["fw"].items() if "all_gather" in name)
    assert fw_gathers == 4 + 2 and set(block["fw"]) <= {"gloo:all_gather",
                                                       "gloo:all_gather_into_tensor_coalesced",
                                                       "gloo:allgather_coalesced"}, block


def test_no_gathered_parameter_escapes_the_graph():
    """The once-per-forward gather cache lives inside the traced forward: the graph dynamo
    captures returns the model output only, not the gathered parameters (as outputs they would
    all be alive at once at the end of forward: the whole model gathered)."""
    import toy
    from pass_utils import fake_world

    import simplesharded as ss

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with fake_world(2) as mesh:
        model = ss.data_parallel(toy.make_model(tied=True), mesh, storage="param")
        torch._dynamo.reset()
        torch.compile(model, backend=capture, fullgraph=True)(torch.randn(5, toy.D_IN))
        torch._dynamo.reset()
    (out,) = [n for n in graphs[0].graph.nodes if n.op == "output"]
    assert len(out.args[0]) == 1, out.args
