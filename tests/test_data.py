import json
import os

import pytest
import torch

from simplesharded.trainer.config import Config
from simplesharded.trainer.data import (ByteTokenizer, DistributedTokenLoader, build_data, files_corpus,
                                load_corpus, load_tokenizer, stdlib_corpus)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo, wörld ✓\n\tdef f(): pass"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id == 256 and ids[-1] == tok.eos_id == 257
    assert max(ids[1:-1]) < 256 and tok.vocab_size == 259 and tok.pad_id == 258
    assert tok.decode(ids) == text
    assert tok.encode_tensor(text, bos=True, eos=True).tolist() == ids
    assert tok.encode_tensor("").tolist() == [] and tok.decode([]) == ""


def test_load_tokenizer(tmp_path):
    assert isinstance(load_tokenizer(""), ByteTokenizer)
    with pytest.raises(ValueError, match="model.tokenizer_path"):
        load_tokenizer(str(tmp_path / "missing.json"))
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="pip install tokenizers"):
            load_tokenizer(str(path))
    else:
        with pytest.raises(ValueError, match="model.tokenizer_path"):
            load_tokenizer(str(path))


@pytest.fixture(scope="module")
def stdlib():
    return stdlib_corpus(max_bytes=4 << 20)  # a prefix keeps the test fast


def test_stdlib_corpus(stdlib):
    train, val = stdlib.documents("train"), stdlib.documents("validation")
    assert train and val and not set(train) & set(val)
    assert all(k.endswith(".py") and "site-packages" not in k for k in train + val)
    assert len(val) < len(train) / 10
    t, v = stdlib.tokens("train"), stdlib.tokens("val")
    assert t.dtype == torch.int32 and t.numel() > 1_000_000 and v.numel() > 10_000
    assert ByteTokenizer().decode(t[:2000]).count("\n") > 10
    # Deterministic: a fresh corpus assigns the same files.
    again = stdlib_corpus(max_bytes=4 << 20)
    assert again.documents("validation") == val


def arange_loader(n_samples=37, seq_len=4, **kw):
    # Token values encode positions, so a window's first token / seq_len is its sample index.
    return DistributedTokenLoader(torch.arange(n_samples * seq_len + 1), seq_len, **kw)


def sample_ids(inputs, seq_len=4):
    return (inputs[:, 0] // seq_len).tolist()


def global_stream(world, local_bs, steps, state=None, **kw):
    """The sample stream in global-position order (rank r holds positions r, r+W, ...)."""
    loaders = [arange_loader(local_batch_size=local_bs, dp_rank=r, dp_world=world, **kw)
               for r in range(world)]
    for ld in loaders:
        if state is not None:
            ld.load_state_dict(state)
    out = []
    for _ in range(steps):
        per_rank = [sample_ids(next(ld)[0]) for ld in loaders]
        out += [per_rank[r][j] for j in range(local_bs) for r in range(world)]
    return out, loaders[0].state_dict()


def test_loader_batches():
    ld = arange_loader(local_batch_size=3, seed=1)
    x, y = next(ld)
    assert x.shape == y.shape == (3, 4) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y[:, -1], x[:, -1] + 1)


def test_loader_ranks_disjoint_and_cover_epoch():
    stream, _ = global_stream(world=4, local_bs=3, steps=3, seed=5)  # 36 of 37 samples
    assert len(set(stream)) == len(stream) == 36
    per_rank = [set(sample_ids(next(arange_loader(local_batch_size=3, dp_rank=r, dp_world=4,
                                                  seed=5))[0])) for r in range(4)]
    assert all(not a & b for i, a in enumerate(per_rank) for b in per_rank[i + 1:])


def test_loader_deterministic_and_infinite():
    a, _ = global_stream(2, 4, 20, seed=3)  # 160 samples: > 4 epochs of 37
    b, _ = global_stream(2, 4, 20, seed=3)
    c, _ = global_stream(2, 4, 20, seed=4)
    assert a == b and a != c
    assert sorted(a[:37]) == list(range(37)) and sorted(a[37:74]) == list(range(37))
    assert a[:37] != a[37:74]  # a new permutation per epoch
    plain, _ = global_stream(1, 5, 2, shuffle=False)
    assert plain == list(range(10))


def test_loader_resume_same_world():
    full, _ = global_stream(2, 3, 12, seed=7)
    head, state = global_stream(2, 3, 5, seed=7)
    assert state["consumed_samples"] == 30 and (state["epoch"], state["index"]) == (0, 30)
    tail, _ = global_stream(2, 3, 7, state=state, seed=7)
    assert head + tail == full


@pytest.mark.parametrize("world,local_bs", [(4, 3), (3, 1), (1, 7)])
def test_loader_resume_other_world(world, local_bs):
    full, _ = global_stream(2, 3, 40, seed=9)
    head, state = global_stream(2, 3, 5, seed=9)
    tail, _ = global_stream(world, local_bs, 60 // (world * local_bs), state=state, seed=9)
    n = len(tail)
    assert head + tail == full[:30 + n]  # continues the global stream: no repeat, no skip


def test_loader_state_mismatch():
    state = arange_loader(local_batch_size=2, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        arange_loader(local_batch_size=2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len"):
        arange_loader(local_batch_size=2, seed=1, seq_len=8).load_state_dict(state)


def test_loader_errors():
    with pytest.raises(ValueError, match="seq_len"):
        DistributedTokenLoader(torch.arange(5), 8, 1)
    with pytest.raises(ValueError, match="dp_rank"):
        DistributedTokenLoader(torch.arange(50), 4, 1, dp_rank=2, dp_world=2)


def test_loader_from_corpus_validation(stdlib):
    val = DistributedTokenLoader(stdlib, 64, 2, split="validation", shuffle=False)
    first = next(val)[0]
    val.reset()
    assert torch.equal(next(val)[0], first)
    x = first[0]
    assert torch.equal(x, stdlib.tokens("validation")[:64].long())


def test_txt_jsonl_and_directory(tmp_path):
    (tmp_path / "a.txt").write_text("alpha " * 500)
    rows = [{"text": f"row {i} " * 20} for i in range(200)]
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "ignored.csv").write_text("x")

    txt = files_corpus(str(tmp_path / "a.txt"))
    assert txt.split_by == "tail"  # one document: validation is the stream's tail
    assert txt.tokens("train").numel() + txt.tokens("validation").numel() == 3000 + 2

    jl = load_corpus("stdlib", str(tmp_path / "sub" / "b.jsonl"))
    docs = jl.documents("train") + jl.documents("validation")
    assert len(docs) == 200 and docs[0] == "b.jsonl:1" and jl.split_by == "document"

    both = load_corpus("stdlib", str(tmp_path))
    keys = both.documents("train") + both.documents("validation")
    assert "a.txt" in keys and os.path.join("sub", "b.jsonl:1") in keys
    assert not any(k.startswith("ignored") for k in keys)
    x, y = next(DistributedTokenLoader(both, 16, 2))
    assert x.shape == (2, 16)


def test_dataset_path_errors(tmp_path):
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(ValueError, match=r"training.dataset_path=.*nope.txt"):
        load_corpus("stdlib", missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="training.dataset_path.*contains no"):
        load_corpus("stdlib", str(tmp_path / "empty"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_corpus("stdlib", str(tmp_path / "bad.jsonl")).tokens()
    with pytest.raises(ValueError, match="training.dataset="):
        load_corpus("wikipedia")


def test_build_data(tmp_path):
    (tmp_path / "d.txt").write_text("some text " * 400)
    cfg = Config()
    cfg.training.dataset_path = str(tmp_path / "d.txt")
    cfg.training.seq_len, cfg.training.val_every = 8, 5
    data = build_data(cfg, dp_rank=1, dp_world=2)
    assert data.train.local_batch_size == 4 and data.validation is not None
    assert next(data.train)[0].shape == (4, 8)
    assert data.tokenizer.vocab_size == 259
