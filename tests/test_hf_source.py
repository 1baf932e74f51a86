"""Hugging Face models from a local directory (``--model.name hf --model.path DIR``,
models/hf_source.py, the shards filled by models/hf_loading.py).

Tiny models (one block; Llama, Qwen3 and Mixtral two) of four architectures are written here with random weights by
``save_pretrained(safe_serialization=True)`` (nothing is downloaded): Llama with tied
embeddings and a tokenizer.json, sharded over many files with an index; Qwen2 (attention
biases, a vocabulary of 301 so the embedding splits unevenly over 2 ranks) in one file;
GPT-2 (Conv1D layers, position embeddings, tied head), sharded; Mixtral (MoE), sharded, in
transformers' per-expert file layout, which the loader merges into the fused expert tensors.
Each of them trains 5 steps compiled (aot_eager_blockbucketing) on 2 ranks against an eager
1-process run. Each also exists as a config.json alone (``<arch>_init``): its weights come
from the model's own init, which must not depend on the world size. A larger Llama (``big``,
~40 MB in one file) is only loaded, to measure memory.

Why the losses of 2 ranks and 1 process must agree to 1e-5 (relative): the same weights (read
from the same files), the same global batches, the same math; only the summation order of the
gradient reduction (and of compiled versus eager kernels) differs.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from dist_utils import memo, spawn
from simplesharded.passes.torch_compat import CONTEXT_PARALLEL, EXPERT_PARALLEL, has
from test_train_e2e import read_losses, rel, run_many
from torch_range import needs_torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
STEPS = 5
# trained on 2 ranks from weight files, and initialised from config.json alone
ARCHS = ("llama", "qwen2", "gpt2", "mixtral")
TRAIN = ["--training.seq_len", "32", "--training.global_batch_size", "4",
         "--training.steps", str(STEPS), "--training.val_every", "0",
         "--no-metrics.progress_bar", "--lr_scheduler.warmup_steps", "2",
         "--lr_scheduler.decay_type", "constant", "--optimizer.lr", "3e-3"]


def _configs():
    from transformers import GPT2Config, LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config

    # One block each but Llama's two (bucketing across blocks, a tied embedding and head in
    # different buckets): every compiled case costs suite time.
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return {
        "llama": (LlamaConfig(vocab_size=300, tie_word_embeddings=True,
                              **{**small, "num_hidden_layers": 2}), "6KB"),
        "qwen2": (Qwen2Config(vocab_size=301, **small), None),
        # dropout off: a dropout mask is drawn per rank, so 2 ranks could not match 1
        "gpt2": (GPT2Config(vocab_size=300, n_embd=64, n_layer=1, n_head=4, n_positions=64,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0), "20KB"),
        # saved per expert (experts.N.w1/w2/w3, block_sparse_moe): transformers' on-disk
        # layout, which it fuses into experts.gate_up_proj / down_proj when loading
        # two blocks: pipeline parallel degree 2 cuts it too
        "mixtral": (MixtralConfig(vocab_size=300, num_local_experts=4, num_experts_per_tok=2,
                                  **{**small, "intermediate_size": 64,
                                     "num_hidden_layers": 2}), "20KB"),
        # tensor parallel degree 2: norms of each rank's heads (q_norm, k_norm), an untied
        # head split by vocabulary
        # and pipeline parallel degree 2: one block per stage
        "qwen3": (Qwen3Config(vocab_size=300, head_dim=16, tie_word_embeddings=False,
                              **{**small, "num_hidden_layers": 2}), None),
        # only loaded (peak memory): ~40 MB of weights in one file, no tensor over 2 MB
        "big": (LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024,
                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                            max_position_embeddings=64), None),
    }


def _write_tokenizer(path: Path, words: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def _with_config(src: Path, dst: Path, **changes) -> Path:
    """``dst``: the model directory ``src`` (its files linked) with ``changes`` made to its
    config.json."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **changes}))
    return dst


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict[str, Path]:
    """The model directories and a small text corpus of WORDS (``data``)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, (config, shard) in _configs().items():
        d = root / name
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(d, safe_serialization=True,
                              **({"max_shard_size": shard} if shard else {}))
        out[name] = d
        if name in ARCHS:
            config.save_pretrained(root / f"{name}_init")
            out[f"{name}_init"] = root / f"{name}_init"
    # Mixtral's weights with its balancing loss on (output_router_logits)
    out["mixtral_aux"] = _with_config(out["mixtral"], root / "mixtral_aux",
                                      output_router_logits=True, router_aux_loss_coef=0.02)
    _write_tokenizer(out["llama"] / "tokenizer.json", WORDS)
    g = torch.Generator().manual_seed(0)
    lines = [" ".join(WORDS[i] for i in torch.randint(len(WORDS), (40,), generator=g))
             for _ in range(200)]
    (root / "data.txt").write_text("\n".join(lines))
    out["data"] = root / "data.txt"
    return out


def test_fixture_layouts(zoo):
    """What the other tests rely on: llama/gpt2/mixtral sharded with an index, qwen2 and big
    one file, mixtral in the per-expert layout, the _init directories without weights."""
    for name in ("llama", "gpt2", "mixtral"):
        index = json.loads((zoo[name] / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 2, name
        if name == "mixtral":
            assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in index["weight_map"]
    for name in ("qwen2", "big"):
        assert not (zoo[name] / "model.safetensors.index.json").exists(), name
    for arch in ARCHS:
        assert not list(zoo[f"{arch}_init"].glob("*.safetensors")), arch


# arch → options of the 2-rank run (the 1-process reference is always eager)
RUNS = {arch: ["--compile.enable", "--compile.backend", "aot_eager_blockbucketing"]
        for arch in ARCHS}


# read at 2 ranks and compared with from_pretrained: tied, uneven, merged MoE experts
SLICED = ("llama", "qwen2", "mixtral")


def _trainer(path: Path, data: Path, dump: Path, world: int, extra: list[str]):
    from simplesharded.trainer.config import load_config
    from simplesharded.trainer import Trainer, check_static

    cfg = check_static(load_config(None, [
        "--job.config_file", str(ROOT / "configs" / "llama3_debug.toml"),
        "--model.name", "hf", "--model.path", str(path), "--training.dataset_path", str(data),
        "--job.dump_folder", str(dump), *TRAIN, *extra]), world)
    return Trainer(cfg, "cpu")


def _count_reads(counted: list[int]):
    """A safe_open that counts the bytes of every tensor it hands out."""
    import safetensors

    real = safetensors.safe_open

    class Counting:
        def __init__(self, *args, **kwargs):
            self._h = real(*args, **kwargs)

        def __enter__(self):
            self._h.__enter__()
            return self

        def __exit__(self, *exc):
            return self._h.__exit__(*exc)

        def keys(self):
            return self._h.keys()

        def get_tensor(self, name):
            t = self._h.get_tensor(name)
            counted[0] += t.numel() * t.element_size()
            return t

        def get_slice(self, name):
            sl = self._h.get_slice(name)

            class Slice:
                def get_shape(self):
                    return sl.get_shape()

                def __getitem__(self, index):
                    t = sl[index]
                    counted[0] += t.numel() * t.element_size()
                    return t
            return Slice()

    return real, Counting


def _sharded(path: str, world: int, storage: str = "param"):
    """The model of ``path`` on the meta device, sharded over ``world`` ranks, not yet filled."""
    from simplesharded.mesh import build_mesh
    from simplesharded.models import hf_source
    from simplesharded.sharding import data_parallel

    model = hf_source.build_hf_model(path)
    data_parallel(model, build_mesh(dp_replicate=1, dp_shard=world, device="cpu"),
                  storage=storage)
    return model


def _ragged_loaded(path: str, world: int) -> tuple[int, list[str]]:
    """Loaded into ragged buckets: how many buckets the model has, and the FQNs whose value
    (``state_dict()``, the members converted from their buckets) differs from what
    transformers' own from_pretrained loads."""
    from transformers import AutoModelForCausalLM

    from simplesharded.models import hf_loading
    from simplesharded.storage.ragged_shards import model_buckets

    model = _sharded(path, world, storage="ragged")
    assert hf_loading.materialize(model) == "loaded"
    buckets = len({id(b) for b in model_buckets(model)})
    ref = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).state_dict()
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
             for k, v in model.state_dict().items()}
    return buckets, [k for k, v in state.items() if k in ref and not torch.equal(v, ref[k])]


def _read_slices(path: str, world: int) -> tuple[int, int, dict]:
    """Bytes this rank read through safetensors, the model's bytes, and the mismatches of
    its shards against the parameters transformers' own from_pretrained loads."""
    import safetensors
    from transformers import AutoModelForCausalLM

    from simplesharded.models import hf_loading

    counted = [0]
    real, counting = _count_reads(counted)
    safetensors.safe_open = counting  # hf_loading imports it when it reads
    try:
        model = _sharded(path, world)
        assert hf_loading.materialize(model) == "loaded"
    finally:
        safetensors.safe_open = real
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    ref = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).state_dict()
    bad = {fqn: "differs" for fqn, p in model.named_parameters()
           if not torch.equal(p.full_tensor(), ref[fqn])}
    for fqn, b in model.named_buffers():  # RoPE frequencies: computed, in no file
        if not torch.isfinite(b).all():
            bad[fqn] = "not finite"
    return counted[0], total, bad


@contextlib.contextmanager
def _peak_rss():
    """Yields a list that receives, on exit, the bytes by which this process's resident set
    grew at its highest within the block (Linux: the high-water mark VmHWM, reset on entry
    through /proc/self/clear_refs), or None where that cannot be reset."""
    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) << 10 for ln in f if ln.startswith(key))

    out: list = []
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before = status("VmRSS:")
    except OSError:
        before = None
    yield out
    out.append(None if before is None else status("VmHWM:") - before)


def _load_peak(path: str, world: int) -> tuple[int | None, int, int]:
    """(peak growth of this rank's resident memory while it fills its shards from the files,
    the model's bytes, this rank's shard bytes)."""
    from simplesharded.models import hf_loading

    model = _sharded(path, world)
    with _peak_rss() as peak:
        assert hf_loading.materialize(model) == "loaded"
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return peak[0], total, shard


def _initialised(path: str, world: int) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, in full, of the model of ``path``'s config.json
    initialised (seed 0) on this rank's shards."""
    from simplesharded.models import hf_loading

    model = _sharded(path, world)
    assert hf_loading.materialize(model, seed=0) == "initialised"
    out = {fqn: p.full_tensor() for fqn, p in model.named_parameters()}
    return {**out, **dict(model.named_buffers())}


def _job(rank: int, world: int, dirs: dict[str, Path], dump: str) -> dict:
    """Every arch's STEPS losses through the trainer's own Trainer (one process per rank for
    all of them: the suite has a time budget), and at 2 ranks the slice reads, the init from
    config.json alone and, first (a fresh process), the peak memory of loading ``big``."""
    out = {}
    if world > 1:
        out["peak"] = _load_peak(str(dirs["big"]), world)
    for arch, extra in RUNS.items():
        trainer = _trainer(dirs[arch], dirs["data"], Path(dump) / arch, world,
                           extra if world > 1 else [])
        out[arch] = [trainer.train_step()["loss"] for _ in range(STEPS)]
        torch._dynamo.reset()
    out["init"] = {arch: _initialised(str(dirs[f"{arch}_init"]), world) for arch in ARCHS}
    if world > 1 and has(CONTEXT_PARALLEL):
        # context parallel degree 2 (dp 1): the same sequences, each split over the 2 ranks
        trainer = _trainer(dirs["llama"], dirs["data"], Path(dump) / "llama_cp2", world,
                           [*RUNS["llama"], "--parallelism.context_parallel_degree", "2"])
        out["llama_cp2"] = [trainer.train_step()["loss"] for _ in range(STEPS)]
        torch._dynamo.reset()
        trainer = _trainer(dirs["mixtral_aux"], dirs["data"], Path(dump) / "mixtral_aux_cp2",
                           world, [*RUNS["mixtral"], "--parallelism.context_parallel_degree", "2"])
        out["mixtral_aux_cp2"] = [trainer.train_step()["loss"] for _ in range(STEPS)]
        torch._dynamo.reset()
    # tensor parallel degree 2 (dp 1), compiled, against one eager process
    tp = ([*RUNS["llama"], "--parallelism.tensor_parallel_degree", "2"] if world > 1 else [])
    trainer = _trainer(dirs["qwen3"], dirs["data"], Path(dump) / "qwen3", world, tp)
    out["qwen3"] = [trainer.train_step()["loss"] for _ in range(STEPS)]
    torch._dynamo.reset()
    if world > 1:  # pipeline parallel degree 2 (dp 1), eager: a block per stage
        trainer = _trainer(dirs["qwen3"], dirs["data"], Path(dump) / "qwen3_pp2", world,
                           ["--parallelism.pipeline_parallel_degree", "2"])
        out["qwen3_pp2"] = [trainer.train_step()["loss"] for _ in range(STEPS)]
        trainer = _trainer(dirs["mixtral_aux"], dirs["data"], Path(dump) / "mixtral_aux_pp2",
                           world, ["--parallelism.pipeline_parallel_degree", "2"])
        out["mixtral_aux_pp2"] = [trainer.train_step()["loss"] for _ in range(STEPS)]
        trainer = _trainer(dirs["mixtral_aux"], dirs["data"], Path(dump) / "mixtral_tp2",
                           world, [*RUNS["mixtral"], "--parallelism.tensor_parallel_degree", "2"])
        out["mixtral_aux_tp2"] = [trainer.train_step()["loss"] for _ in range(STEPS)]
        torch._dynamo.reset()
        if has(EXPERT_PARALLEL):
            out.update(_expert_parallel(dirs, Path(dump), world))
    if world > 1:
        out["slices"] = {arch: _read_slices(str(dirs[arch]), world) for arch in SLICED}
        out["ragged"] = {arch: _ragged_loaded(str(dirs[arch]), world)
                         for arch in ("llama", "mixtral")}
    else:  # one process: the world-2 job has more to do
        out["graph_break"] = _graph_break(dirs, Path(dump) / "gb", world)
        trainer = _trainer(dirs["mixtral_aux"], dirs["data"], Path(dump) / "aux", world, [])
        out["mixtral_aux"] = [trainer.train_step()["loss"] for _ in range(STEPS)]
        # a forward per sequence, as the pipeline's micro-batches of one sequence each
        trainer = _trainer(dirs["mixtral_aux"], dirs["data"], Path(dump) / "aux_acc", world,
                           ["--training.gradient_accumulation_steps", "4"])
        out["mixtral_aux_acc4"] = [trainer.train_step()["loss"] for _ in range(STEPS)]
    return out


def _expert_parallel(dirs: dict[str, Path], dump: Path, world: int) -> dict:
    """Mixtral at expert parallel degree 2 (dp 1), compiled: its losses, each rank's share of
    an experts weight, and the all-to-alls of the first forward and backward graphs."""
    graphs = dump / "mixtral_ep2_graphs"
    trainer = _trainer(dirs["mixtral"], dirs["data"], dump / "mixtral_ep2", world,
                       [*RUNS["mixtral"], "--parallelism.expert_parallel_degree", "2",
                        "--compile.dump_graphs", str(graphs)])
    losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
    torch._dynamo.reset()
    w = trainer.model.get_submodule("model.layers.0.mlp.experts").gate_up_proj
    calls = {kind: sum(f.read_text().count("_c10d_functional.all_to_all_single.default(")
                       for f in graphs.glob(f"*_{kind}_input.txt")) for kind in ("fw", "bw")}
    mine = slice(2 * torch.distributed.get_rank(), 2 * torch.distributed.get_rank() + 2)
    return {"mixtral_ep2": losses, "mixtral_ep2_all_to_alls": calls,
            "mixtral_ep2_local": (tuple(w.shape), w.to_local().numel(), torch.equal(
                w.to_local().flatten(), w.full_tensor()[mine].flatten()))}


def _graph_break(dirs: dict[str, Path], dump: Path, world: int) -> tuple[str, list[float]]:
    """Qwen2 (one block) with a graph break before its loss: the error of a fullgraph compile, and the
    loss of a step compiled without fullgraph. (A break deeper in the model costs much more
    compile time, every enclosing frame being traced again; the suite has a time budget.)"""
    from simplesharded.models import hf_source

    loss = hf_source.lm_loss

    def breaking(*args, **kwargs):
        torch._dynamo.graph_break()
        return loss(*args, **kwargs)

    hf_source.lm_loss = breaking
    compiled = ["--compile.enable", "--compile.backend", "aot_eager"]
    try:
        trainer = _trainer(dirs["qwen2"], dirs["data"], dump, world, compiled)
        try:
            trainer.train_step()
            error = ""
        except ValueError as e:
            error = str(e)
        torch._dynamo.reset()
        trainer = _trainer(dirs["qwen2"], dirs["data"], dump, world,
                           [*compiled, "--no-compile.fullgraph"])
        losses = [trainer.train_step()["loss"]]
    finally:
        hf_source.lm_loss = loss
        torch._dynamo.reset()
    return error, losses


@memo
def _results(world: int, dirs: tuple) -> dict:
    import tempfile
    with tempfile.TemporaryDirectory() as dump:
        return spawn(world, _job, dict(dirs), dump)


def _losses_match(zoo, one: str, two: str, what: str) -> list[float]:
    """The 2-rank run ``two`` gives the 1-process run ``one``'s STEPS losses to 1e-5 (relative);
    the 1-process losses."""
    dirs = tuple(sorted(zoo.items()))
    want, got = _results(1, dirs)[0][one], _results(2, dirs)[0][two]
    bad = [(s + 1, g, w) for s, (g, w) in enumerate(zip(got, want)) if not rel(g, w) <= 1e-5]
    assert len(got) == STEPS and not bad, f"(step, {what}, 1 process) beyond 1e-5 rel: {bad}"
    return want


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(RUNS))
def test_two_ranks_match_one_process(zoo, arch):
    want = _losses_match(zoo, arch, arch, f"{arch}, 2 ranks")
    assert want[-1] < want[0], want  # it trains


@needs_torch(CONTEXT_PARALLEL)
@pytest.mark.slow
def test_llama_at_context_parallel_2_matches_one_process(zoo):
    """transformers' Llama trained by the trainer at context parallel degree 2, compiled (its
    attention through the attention interface: models/hf_context_parallel.py), gives the
    losses of one process on whole sequences."""
    _losses_match(zoo, "llama", "llama_cp2", "cp 2")


@needs_torch(CONTEXT_PARALLEL)
@pytest.mark.slow
def test_mixtral_balancing_loss_at_context_parallel_2_matches_one_process(zoo):
    """transformers' Mixtral with its balancing loss at context parallel degree 2, compiled:
    each rank routes chunks of the sequences, and the loss is of whole sequences, as one
    process has it (every cp rank's router rows gathered before transformers' loss reads
    them; per-chunk losses differ): the losses of one process."""
    _losses_match(zoo, "mixtral_aux", "mixtral_aux_cp2", "cp 2")


@pytest.mark.slow
def test_qwen3_at_tensor_parallel_2_matches_one_process(zoo):
    """transformers' Qwen3 trained by the trainer at tensor parallel degree 2, compiled, with
    transformers' own plan as torch's styles and sequence parallelism (the trainer's default;
    models/hf_tensor_parallel.py: attention and MLP split, the residual stream and its norms
    on sequence shards, the per-head norms' gradients summed over tp, embedding and head
    split by vocabulary, loss parallelism): the losses of one process."""
    want = _losses_match(zoo, "qwen3", "qwen3", "tp 2")
    assert want[-1] < want[0], want


@needs_torch(EXPERT_PARALLEL)
@pytest.mark.slow
def test_mixtral_at_expert_parallel_2_matches_one_process(zoo):
    """transformers' Mixtral at expert parallel degree 2, compiled: each rank holds half the
    experts of each layer (those of its files, read by expert), each layer's routed rows go
    to their experts' rank and back by all-to-all (models/hf_expert_parallel.py: three in a
    layer's forward, two in its backward), and the losses are one process's."""
    _losses_match(zoo, "mixtral", "mixtral_ep2", "ep 2")
    ranks = _results(2, tuple(sorted(zoo.items())))
    assert ranks[0]["mixtral_ep2_all_to_alls"] == {"fw": 6, "bw": 4}  # two MoE layers
    # [4 experts, 2 * 64, 64]: experts 0-1 on rank 0, 2-3 on rank 1
    assert [r["mixtral_ep2_local"] for r in ranks] == [((4, 128, 64), 2 * 128 * 64, True)] * 2


@pytest.mark.slow
def test_mixtral_at_tensor_parallel_2_matches_one_process(zoo):
    """transformers' Mixtral with its balancing loss at tensor parallel degree 2, compiled,
    with sequence and loss parallelism: attention split by heads, each MoE layer whole on
    every tp rank (its input gathered, its output cut to the rank's tokens;
    models/hf_tensor_parallel.py), the balancing loss added to the loss-parallel loss: the
    losses of one process."""
    _losses_match(zoo, "mixtral_aux", "mixtral_aux_tp2", "tp 2")


@pytest.mark.slow
def test_mixtral_at_pipeline_parallel_2_matches_one_process(zoo):
    """transformers' Mixtral (a MoE) with its balancing loss cut into 2 pipeline stages, a
    block each, 4 micro-batches of a sequence: the first stage passes its router sums on
    beside the hidden states, the last adds the loss from every block's sums
    (models/hf_balance.py). The balancing loss is each micro-batch's, as under gradient
    accumulation: the losses are those of one process accumulating over 4 forwards
    (transformers' loss function on every block's logits), which differ from one forward's."""
    want = _losses_match(zoo, "mixtral_aux_acc4", "mixtral_aux_pp2", "pp 2")
    whole = _results(1, tuple(sorted(zoo.items())))[0]["mixtral_aux"]
    assert max(rel(a, b) for a, b in zip(want, whole)) > 1e-5  # the comparison can tell


@pytest.mark.slow
def test_qwen3_at_pipeline_parallel_2_matches_one_process(zoo):
    """transformers' Qwen3 cut into 2 pipeline stages by the trainer (stage_split.py: the
    final norm an identity on the first stage, hidden states passed as inputs_embeds to the
    second): the losses of one process."""
    _losses_match(zoo, "qwen3", "qwen3_pp2", "pp 2")


def test_pipeline_refusals_name_what_stops_it(tmp_path):
    """Before any rank starts: a family whose forward would not run a stage unchanged,
    blocks of different attention types, a head tied to the embedding; a MoE with its
    balancing loss is cut (``test_mixtral_at_pipeline_parallel_2...``)."""
    from transformers import Gemma3TextConfig, LlamaConfig, MixtralConfig, Qwen2Config

    from simplesharded.models.hf_source import check_pipeline

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2)
    cases = [(Gemma3TextConfig(**small), r"model_type 'gemma3_text'\) is not cut into "
                                         r"pipeline stages here"),
             (Qwen2Config(use_sliding_window=True, max_window_layers=2, **small),
              r"its blocks' attention differs \(layer_types \['full_attention', "
              r"'sliding_attention'\]\)"),
             (LlamaConfig(tie_word_embeddings=True, **small), r"tie_word_embeddings=true ties "
                                                              r"the head to the embedding")]
    for i, (config, says) in enumerate(cases):
        config.save_pretrained(tmp_path / str(i))
        with pytest.raises(ValueError, match=says):
            check_pipeline(str(tmp_path / str(i)))
    LlamaConfig(**small).save_pretrained(tmp_path / "ok")
    check_pipeline(str(tmp_path / "ok"))
    MixtralConfig(output_router_logits=True, **small).save_pretrained(tmp_path / "moe")
    check_pipeline(str(tmp_path / "moe"))


def _tp_gradients(rank: int, world: int, dirs: dict) -> dict:
    """The worst relative gradient difference, parameter by parameter, of transformers'
    models at tp 2 (our styles on a plain model, no data_parallel) against the same model
    whole, for an untied Qwen3 (norms of heads) and a tied Llama, with and without sequence
    parallelism."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import AutoModelForCausalLM

    from simplesharded.models.hf_tensor_parallel import tp_styles

    mesh = init_device_mesh("cpu", (world,))
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    out = {}
    for arch in ("qwen3", "llama"):
        for sp in (True, False):
            ref = AutoModelForCausalLM.from_pretrained(dirs[arch], attn_implementation="sdpa")
            model = copy.deepcopy(ref)
            parallelize_module(model, mesh, tp_styles(model, sp, loss_parallel=False))
            ref(input_ids=ids, labels=ids).loss.backward()
            model(input_ids=ids, labels=ids).loss.backward()
            worst = 0.0
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                worst = max(worst, ((g - q.grad).abs().max() / q.grad.abs().max()).item())
            out[(arch, sp)] = worst
    dist.barrier()
    return out


@pytest.mark.slow
def test_tensor_parallel_gradients_are_the_whole_models(zoo):
    results = spawn(2, _tp_gradients, {k: str(v) for k, v in zoo.items()})
    for rank, worst in enumerate(results):
        assert sorted(worst) == [("llama", False), ("llama", True), ("qwen3", False),
                                 ("qwen3", True)]
        assert all(w <= 1e-5 for w in worst.values()), (rank, worst)


def test_tensor_parallel_refusals_name_what_stops_it():
    """Before any rank starts: a plan style not translated, a size the degree does not
    divide, a model without a plan; the vocabulary need not split when the head is tied, nor
    a MoE's experts (its MoE layers run whole on every tp rank)."""
    from transformers import GlmConfig, GPT2Config, MixtralConfig, Qwen2Config

    from simplesharded.models.hf_tensor_parallel import check_tp

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2)
    check_tp(Qwen2Config(vocab_size=301, tie_word_embeddings=True, **small), 2)
    with pytest.raises(ValueError, match=r"^tensor_parallel_degree=2 does not divide "
                                         r"vocab_size=301$"):
        check_tp(Qwen2Config(vocab_size=301, tie_word_embeddings=False, **small), 2)
    with pytest.raises(ValueError, match=r"^tensor_parallel_degree=4 does not divide "
                                         r"num_key_value_heads=2$"):
        check_tp(Qwen2Config(vocab_size=300, **small), 4)
    check_tp(MixtralConfig(vocab_size=300, **small), 2)  # its MoE layers whole on each rank
    with pytest.raises(ValueError, match=r"GlmConfig's plan splits "
                                         r"layers\.\*\.mlp\.gate_up_proj as "
                                         r"'colwise_gather_output', which is not translated"):
        check_tp(GlmConfig(vocab_size=300, **small), 2)
    with pytest.raises(ValueError, match=r"GPT2Config has no tensor-parallel plan"):
        check_tp(GPT2Config(), 2)


@pytest.mark.slow
@pytest.mark.parametrize("arch", SLICED)
def test_each_rank_reads_only_its_slices(zoo, arch):
    results = [r["slices"][arch] for r in _results(2, tuple(sorted(zoo.items())))]
    for rank, (read, total, bad) in enumerate(results):
        assert not bad, (rank, bad)
        # 1/world of every tensor, give or take one row of an uneven split (qwen2's 301)
        assert abs(read - total / 2) <= 0.01 * total, (rank, read, total)
    assert sum(r for r, _, _ in results) == results[0][1]  # every byte read exactly once


@pytest.mark.slow
def test_ragged_buckets_load_the_files_as_transformers_does(zoo):
    """storage="ragged": the weights load into the buckets' members by name (llama; and
    mixtral, whose experts are merged from the files' per-expert tensors)."""
    for rank, r in enumerate(_results(2, tuple(sorted(zoo.items())))):
        for arch, (buckets, bad) in r["ragged"].items():
            assert buckets > 0 and not bad, (rank, arch, buckets, bad)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_init_from_config_is_world_size_independent(zoo, arch):
    """From config.json alone: the parameters and buffers initialised on 2 ranks' shards
    equal, bit for bit, those of one process (same seed)."""
    dirs = tuple(sorted(zoo.items()))
    want, got = _results(1, dirs)[0]["init"][arch], _results(2, dirs)[0]["init"][arch]
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, [(k, got[k].flatten()[:6], want[k].flatten()[:6]) for k in bad[:2]]
    # the model's own init ran (not torch.empty's leftovers): norms are ones, matrices random
    assert got["model.norm.weight" if arch != "gpt2" else "transformer.ln_f.weight"].eq(1).all()
    assert all(0 < v.std() < 1 for v in got.values() if v.dim() == 2), arch


@pytest.mark.slow
def test_loading_peak_memory_is_below_the_model(zoo):
    """Each of 2 ranks loading ``big`` (~40 MB in one file, tensors of at most 2 MB) as the
    first thing its process does. Sharding already wrote its shards (NaN until initialised:
    simplesharded/storage/uninitialised.py), so while it loads, its resident memory grows by the
    file's pages of the one parameter it is reading (models/hf_loading.py _OneFile): more
    than nothing (the measure sees them) and less than half its shards, never its whole half
    of the file nor the whole model."""
    for rank, r in enumerate(_results(2, tuple(sorted(zoo.items())))):
        peak, total, shard = r["peak"]
        if peak is None:
            pytest.skip("/proc/self/clear_refs cannot reset the resident high-water mark")
        assert abs(shard - total / 2) <= 4096, (rank, shard, total)
        assert 0 < peak < shard / 2, (rank, peak, shard, total)


@pytest.mark.slow
def test_graph_break_is_one_clear_error_and_flag_compiles_around_it(zoo):
    dirs = tuple(sorted(zoo.items()))
    error, losses = _results(1, dirs)[0]["graph_break"]
    assert error.startswith(f"compile.fullgraph=true: the forward of hf:{zoo['qwen2']} "
                            f"graph-breaks at {__file__}:"), error
    assert "in breaking (torch._dynamo.graph_break()): Call to `torch._dynamo.graph_break()`" \
        in error, error
    assert "\n" not in error and "--no-compile.fullgraph" in error, error
    want = _results(1, dirs)[0]["qwen2"][:1]
    assert all(rel(g, w) <= 1e-5 for g, w in zip(losses, want)), (losses, want)


@pytest.mark.slow
def test_cli_trains_from_directory(zoo, tmp_path, monkeypatch):
    """The README's command, once: `NGPU=2 ./run_train.sh --model.name hf --model.path DIR
    --compile.enable`, the directory's tokenizer, 8 steps: the loss falls. Its checkpoint
    exports (simplesharded/trainer/export.py) in files of at most 40 KB, one checkpoint read per file
    and its metadata read once, to a directory transformers loads whose logits on a fixed
    batch equal the checkpointed model's (≤ 1e-5 rel), under the original names."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from simplesharded.trainer.export import export
    from test_train_e2e import run_train_sh

    r = run_many([run_train_sh({"NGPU": "2"}, "--model.name", "hf", "--model.path",
                               str(zoo["llama"]), "--compile.enable", "--training.dataset_path",
                               str(zoo["data"]), "--job.dump_folder", str(tmp_path), *TRAIN,
                               "--training.steps", "8", "--checkpoint.enable",
                               "--checkpoint.interval", "8")], tmp_path, timeout=300)[0]
    assert r.returncode == 0, r
    assert f"weights loaded, tokenizer {zoo['llama'] / 'tokenizer.json'}" in r.stdout, r
    losses = read_losses(tmp_path)
    assert sorted(losses) == list(range(1, 9)), r
    assert losses[8] < 0.9 * losses[1], losses

    calls = {"load": 0, "metadata": 0}

    def counted(fn, key):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(dcp, "load", counted(dcp.load, "load"))
    monkeypatch.setattr(dcp.FileSystemReader, "read_metadata",
                        counted(dcp.FileSystemReader.read_metadata, "metadata"))
    written = export(str(tmp_path / "checkpoint"), 8, str(tmp_path / "exported"),
                     max_shard_bytes=40_000)
    monkeypatch.undo()
    files = [f for f in written if f.endswith(".safetensors")]
    assert len(files) > 2 and calls == {"load": len(files), "metadata": 1}, (files, calls)
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", local_files_only=True)
    trained = AutoModelForCausalLM.from_pretrained(zoo["llama"], local_files_only=True)
    state = {"model": trained.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "checkpoint" / "step-8"), no_dist=True)
    trained.load_state_dict(state["model"])
    assert sorted(after.state_dict()) == sorted(trained.state_dict())
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = trained(tokens).logits, after(tokens).logits
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5


# ---------------------------------------------------------------------------- errors, FLOPs

def _check(*argv: str):
    from simplesharded.trainer.config import load_config
    from simplesharded.trainer import check_static

    return check_static(load_config(None, ["--job.config_file", "configs/llama3_debug.toml",
                                           "--training.seq_len", "32", *argv]), 2)


def test_hub_id_is_one_clear_line(capsys, monkeypatch):
    from simplesharded.trainer import main

    monkeypatch.chdir(ROOT)
    code = main(["--check-only", "--job.config_file", "configs/llama3_debug.toml",
                 "--model.name", "hf", "--model.path", "meta-llama/Llama-3.2-1B"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: model.path='meta-llama/Llama-3.2-1B' is not a local "
                             "directory (a hub id?"), err


def test_bad_paths_name_the_key(tmp_path, zoo):
    with pytest.raises(ValueError, match=r"model.path='' must be a local directory"):
        _check("--model.name", "hf")
    with pytest.raises(ValueError, match=r"model.path='.*' has no config.json"):
        _check("--model.name", "hf", "--model.path", str(tmp_path))
    with pytest.raises(ValueError, match=r"training.seq_len=128 is above the maximum 64 of "
                                         r"model.path="):
        _check("--model.name", "hf", "--model.path", str(zoo["qwen2"]),
               "--training.seq_len", "128")


def test_unknown_name_and_tensor_parallel_are_one_line(zoo):
    with pytest.raises(ValueError, match=r"^model.name='hff' is not one of \[.*'hf'"):
        _check("--model.name", "hff")
    tp = ["--parallelism.tensor_parallel_degree", "2"]
    with pytest.raises(ValueError, match=r"^parallelism.tensor_parallel_degree=2 does not divide "
                                         r"vocab_size=301 \(model.path='.*qwen2'\)$"):
        _check("--model.name", "hf", "--model.path", str(zoo["qwen2"]), *tp)
    _check("--model.name", "hf", "--model.path", str(zoo["llama"]), *tp)  # tied: vocab whole


def test_weights_that_would_not_load_are_one_line(tmp_path, zoo):
    """Weights only as pytorch_model.bin (read as none: random init) and an index naming a
    missing file: refused before training, one line each."""
    pt = tmp_path / "pt"
    pt.mkdir()
    (pt / "config.json").symlink_to(zoo["qwen2"] / "config.json")
    (pt / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"model.path='.*pt' holds weights as "
                                         r"'pytorch_model.bin' but none as \*.safetensors"):
        _check("--model.name", "hf", "--model.path", str(pt))
    (pt / "model.safetensors").symlink_to(zoo["qwen2"] / "model.safetensors")
    _check("--model.name", "hf", "--model.path", str(pt))  # both formats: safetensors read
    part = tmp_path / "part"
    part.mkdir()
    files = sorted(zoo["llama"].iterdir())
    gone = next(f.name for f in files if f.name.endswith(".safetensors"))
    for f in files:
        if f.name != gone:
            (part / f.name).symlink_to(f)
    with pytest.raises(ValueError, match=rf"model.path='.*part': model.safetensors.index.json "
                                         rf"names 1 file\(s\) that are not there, e.g. "
                                         rf"'{gone}'"):
        _check("--model.name", "hf", "--model.path", str(part))


def test_logit_post_processing_is_refused(tmp_path):
    from transformers import Gemma2Config

    Gemma2Config(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=64).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model.path='.*': config.json sets "
                                         r"final_logit_softcapping=30.0, a transformation"):
        _check("--model.name", "hf", "--model.path", str(tmp_path))


def test_tokenizer_from_directory_and_too_large(tmp_path, zoo):
    cfg = _check("--model.name", "hf", "--model.path", str(zoo["llama"]))
    assert cfg.model.tokenizer_path == str(zoo["llama"] / "tokenizer.json")
    big = tmp_path / "big.json"
    _write_tokenizer(big, [f"w{i}" for i in range(400)])
    with pytest.raises(ValueError, match=r"model.tokenizer_path='.*big.json': vocabulary 403 "
                                         r"is larger than vocab_size 300 of model.path="):
        _check("--model.name", "hf", "--model.path", str(zoo["llama"]),
               "--model.tokenizer_path", str(big))


def test_weights_of_another_config_are_an_error(tmp_path, zoo):
    """config.json and safetensors that disagree: one line naming the tensor."""
    from simplesharded.models import hf_loading, hf_source

    d = _with_config(zoo["llama"], tmp_path / "mixed", vocab_size=320)
    model = hf_source.build_hf_model(str(d))
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives the tied head a parameter of its own
    with pytest.raises(ValueError, match=r"tensor 'model.embed_tokens.weight' has shape "
                                         r"\(300, 64\) in the safetensors files but"):
        hf_loading.materialize(model)


@pytest.mark.parametrize("arch", ARCHS)
def test_flops_per_token(zoo, arch):
    """6 * non-embedding parameters + 12 * layers * width * seq_len (models/hf_source.py)."""
    from simplesharded.models import hf_source

    model = hf_source.build_hf_model(str(zoo[arch]))
    params = {n: p.numel() for n, p in model.named_parameters()}  # tied: counted once
    emb = {"llama": [],  # tied: the embedding is the head's weight, compute
           "qwen2": ["model.embed_tokens.weight"],
           "gpt2": ["transformer.wpe.weight"],  # wte is tied to the head
           "mixtral": ["model.embed_tokens.weight"]}[arch]
    n = sum(v for k, v in params.items() if k not in emb)
    if arch == "mixtral":  # 2 of 4 experts run per token
        n -= sum(v for k, v in params.items() if ".experts." in k) / 2
    layers = 2 if arch in ("llama", "mixtral") else 1
    assert model.num_flops_per_token(32) == int(6 * n + 12 * layers * 64 * 32)


def test_the_forecast_plans_a_hugging_face_model(zoo, tmp_path, capsys):
    """``python -m simplesharded.tools.forecast`` on a config naming a model directory: the
    model is built from its config.json (no weights read) and planned at tp 2 as the trainer
    would run it, its parameters counted as transformers' model has them."""
    from transformers import AutoModelForCausalLM

    from simplesharded.tools import forecast

    config = tmp_path / "hf.toml"
    config.write_text(f'[model]\nname = "hf"\npath = "{zoo["qwen3"]}"\n'
                      f'[parallelism]\ntensor_parallel_degree = 2\n'
                      f'enable_sequence_parallel = false\n[training]\nseq_len = 32\n')
    forecast.main(["--config", str(config), "--world-size", "4", "--backends", "aot_eager"])
    out = capsys.readouterr().out
    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(zoo["qwen3"]).parameters())
    assert f"hf:{zoo['qwen3']} ({n / 1e6:.1f}M params, 2 blocks) on 4 ranks" in out, out
    assert "(mesh dp_shard 2 × tp 2)" in out and "| aot_eager | tp |" in out, out


def test_a_shallower_copy_keeps_the_per_block_layer_types():
    """The planner traces a model 4 and 6 blocks deep (models/hf_source.py _at_depth): a
    config listing a type per block (Gemma 3's sliding and full attention) gets as many."""
    from transformers import Gemma3TextConfig

    from simplesharded.models.hf_source import _at_depth

    config = Gemma3TextConfig(num_hidden_layers=8, sliding_window_pattern=3)
    types = list(config.layer_types)
    shallow = _at_depth(config, 4)
    assert shallow.num_hidden_layers == 4 and shallow.layer_types == types[:4]


@pytest.mark.parametrize("compiled", [False, True])
def test_a_moe_asking_for_its_balancing_loss_gets_transformers_loss(tmp_path, compiled):
    """A Mixtral whose config sets output_router_logits: the trainer's forward gives, per
    token, transformers' own loss (cross-entropy plus router_aux_loss_coef times its
    load-balancing loss), also compiled with fullgraph (transformers' own collection of the
    router logits would break the graph)."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    from simplesharded.models import hf_source

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=300, hidden_size=64, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2,
                           output_router_logits=True, router_aux_loss_coef=0.05)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path)
    ours = hf_source.build_hf_model(str(tmp_path))
    ours.to_empty(device="cpu")
    ours.load_state_dict(ref.state_dict())
    for name, buf in ref.named_buffers():  # RoPE's, not in the state dict
        ours.get_buffer(name).copy_(buf)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    want = ref(input_ids=ids, labels=ids)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)  # shifted, as the loader
    run = torch.compile(ours, backend="aot_eager", fullgraph=True) if compiled else ours
    got = run(ids, labels) / (labels != -100).sum()
    torch._dynamo.reset()
    assert 0.05 * want.aux_loss > 1e-2  # the balancing loss is there to see
    assert abs(got.item() - want.loss.item()) <= 1e-5, (got, want.loss)
    assert ours._router_record.logits is None  # nothing kept after the forward


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_a_balancing_loss_from_stage_sums_is_transformers_loss(family):
    """For every MoE family the pipeline cuts: the balancing loss from the sums two stages
    pass on (models/hf_balance.py: the first stage's blocks', then the second's added) is the
    loss of the family's own function on every block's router logits, and so is its gradient
    with respect to each block's logits."""
    import importlib
    from types import SimpleNamespace

    from simplesharded.models import hf_balance

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    experts, k = 8, 2
    model = SimpleNamespace(num_experts=experts, num_experts_per_tok=k,
                            config=SimpleNamespace(router_aux_loss_coef=0.03),
                            _balance=module.load_balancing_loss_func)
    g = torch.Generator().manual_seed(3)
    logits = [torch.randn(24, experts, generator=g, dtype=torch.float64).requires_grad_()
              for _ in range(3)]
    labels = torch.randint(0, 10, (2, 12), generator=g)
    labels[0, :3] = -100  # not counted as tokens
    want = hf_balance.whole_model_loss(model, tuple(logits), labels)
    cpu = torch.device("cpu")
    sums = hf_balance.stage_sums(model, tuple(logits[:1]), None, cpu)  # the first stage
    dense = hf_balance.stage_sums(model, (), sums, cpu)  # a stage of dense blocks only
    assert torch.equal(dense, sums)
    got = hf_balance.loss_from_sums(
        model, hf_balance.stage_sums(model, tuple(logits[1:]), dense, cpu), labels)
    assert sums.shape == hf_balance.sums_like(model).shape
    assert want.item() > 0 and abs(got.item() - want.item()) <= 1e-6 * want.item(), (got, want)
    want_grads = torch.autograd.grad(want, logits)
    got_grads = torch.autograd.grad(got, logits)
    for a, b in zip(got_grads, want_grads):
        assert torch.allclose(a, b.to(a.dtype), rtol=1e-5, atol=1e-9), (a - b).abs().max()
