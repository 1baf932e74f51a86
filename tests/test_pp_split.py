"""Cutting a model into pipeline stages (simplesharded/pipeline/stage_split.py), in one process: the
FQNs a stage keeps, which modules it holds (embedding first, norm and head last), uneven and
given splits, the stages chained equal the whole model, the merged view's keys, where the stages
live (torch's own placement), and the models that cannot be staged."""
from __future__ import annotations

import pytest
import torch

from simplesharded.pipeline.stage_split import (cut_stages, even_split, merged_view, plan_stages,
                                       stage_to_rank, stages_of_rank)

LLAMA = dict(dim=64, n_layers=6, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32)


def _model(name="llama3", device="cpu", **kw):
    from simplesharded.models import build_model

    torch.manual_seed(0)
    args = {**LLAMA, **kw} if name == "llama3" else kw
    return build_model(name, "debug", device=device, **args)


def test_even_split_gives_the_earlier_stages_one_more():
    assert even_split(6, 2) == [3, 3]
    assert even_split(6, 4) == [2, 2, 1, 1]
    assert even_split(7, 3) == [3, 2, 2]


@pytest.mark.parametrize("n,split,blocks", [
    (2, None, [["0", "1", "2"], ["3", "4", "5"]]),
    (4, None, [["0", "1"], ["2", "3"], ["4"], ["5"]]),
    (3, [1, 2, 3], [["0"], ["1", "2"], ["3", "4", "5"]]),
    (3, [4, 1, 1], [["0", "1", "2", "3"], ["4"], ["5"]]),
])
def test_stages_keep_their_blocks_and_the_model_names(n, split, blocks):
    model = _model()
    stages = cut_stages(model, n, layers_per_stage=split)
    assert [i for i, _ in stages] == list(range(n))
    names = {k for k, _ in model.named_parameters()}
    seen = set()
    for (i, stage), mine in zip(stages, blocks):
        assert list(stage.layers.keys()) == mine
        assert (stage.tok_embeddings is not None) == (i == 0)
        assert (stage.norm is not None) == (stage.output is not None) == (i == n - 1)
        keys = {k for k, _ in stage.named_parameters()}
        assert keys <= names and not keys & seen  # the model's FQNs, each in one stage
        seen |= keys
        for k in keys:
            assert torch.equal(stage.get_parameter(k), model.get_parameter(k))
        assert type(stage) is type(model) and stage.args == model.args
    assert seen == names


@pytest.mark.parametrize("name,kw", [("llama3", {}),
                                     ("deepseek_v3", dict(dim=64, n_layers=3, n_heads=4,
                                                          n_kv_heads=2, vocab_size=64,
                                                          moe_hidden_dim=32))])
def test_stages_chained_compute_the_model(name, kw):
    """Tokens into the first stage, hidden states between, logits out of the last."""
    model = _model(name, **kw)
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        want = model(x)
        for n in (2, 3):
            h = x
            for _, stage in cut_stages(model, n):
                h = stage(h)
            assert torch.equal(h, want), (name, n)


def test_cutting_copies_only_the_stage():
    """The model is left whole; a stage holds its own tensors (copies), never the others'."""
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    (_, last), = cut_stages(model, 2, stage_ids=[1])
    assert {k: v for k, v in model.state_dict().items()}.keys() == before.keys()
    assert model.tok_embeddings is not None and len(model.layers) == 6
    assert last.get_parameter("output.weight") is not model.output.weight
    assert sum(p.numel() for p in last.parameters()) < sum(p.numel() for p in model.parameters())


def test_meta_stages_initialise_to_the_model_values():
    """init_sharded seeds each group by its name, which a stage keeps: a stage cut from the
    meta model and initialised holds the whole model's values."""
    from simplesharded.storage.init import init_sharded

    full = _model(device="meta")
    full.to_empty(device="cpu")
    init_sharded(full, seed=3)
    for _, stage in cut_stages(_model(device="meta"), 3):
        stage.to_empty(device="cpu")
        init_sharded(stage, seed=3)
        for k, v in stage.state_dict().items():
            assert torch.equal(v, full.state_dict()[k]), k


def test_merged_view_holds_a_ranks_stages_under_the_model_names():
    model = _model()
    stages = cut_stages(model, 4, stage_ids=[0, 2])  # rank 0 of an interleaved pp 2
    view = merged_view([s for _, s in stages])
    expected = [k for k in model.state_dict()
                if k.startswith(("tok_embeddings.", "layers.0.", "layers.1.", "layers.4."))]
    assert list(view.state_dict()) == expected
    ids = {id(p) for _, s in stages for p in s.parameters()}
    assert {id(p) for p in view.parameters()} == ids


@pytest.mark.parametrize("pp,n", [(2, 2), (2, 4), (4, 8), (3, 6), (2, 6)])
@pytest.mark.parametrize("style", ["loop", "v"])
def test_stage_placement_is_torchs(pp, n, style):
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    torchs = generate_stage_to_rank_mapping(pp, n, style)
    assert stage_to_rank(n, pp, style) == [torchs[s] for s in range(n)]
    assert sorted(s for r in range(pp) for s in stages_of_rank(r, n, pp, style)) == list(range(n))


def test_zbv_puts_the_first_and_last_stage_on_rank_0():
    assert stages_of_rank(0, 4, 2, "v") == [0, 3]
    assert stages_of_rank(1, 4, 2, "v") == [1, 2]


@pytest.mark.parametrize("n,split,match", [
    (7, None, "7 pipeline stages but Llama3 has 6 blocks: every stage needs at least one"),
    (2, [3, 2], r"layers per stage \[3, 2\] do not give 2 stages"),
    (3, [3, 3, 0], r"layers per stage \[3, 3, 0\] do not give 3 stages of at least one block"),
])
def test_bad_splits(n, split, match):
    with pytest.raises(ValueError, match=match):
        plan_stages(_model(device="meta"), n, split)


def test_models_that_cannot_be_staged():
    with pytest.raises(ValueError, match=r"GPT cannot be staged: parameter 'wte.weight' "
                                         r"\(stage 0\) is tied to 'head.weight' \(stage 1\)"):
        plan_stages(_model("gpt", device="meta"), 2)
    plan_stages(_model("gpt", device="meta"), 1)  # one stage holds both

    class Between(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(2, 2))] * 1)
            self.mid = torch.nn.Linear(2, 2)
            self.b = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(2, 2))])

    with pytest.raises(ValueError, match=r"module 'mid' holds parameters between blocks"):
        plan_stages(Between(), 2)
    with pytest.raises(ValueError, match="no blocks found"):
        plan_stages(torch.nn.Linear(2, 2), 1)
