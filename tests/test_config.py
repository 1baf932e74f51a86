import glob
import json
import os
import re

import pytest

from simplesharded.trainer.config import Config, help_text, load_config, main
from simplesharded.trainer.config_checks import resolve, validate
from simplesharded.trainer.config_parse import parse_cli
from simplesharded.trainer.config_parse import tomllib  # tomli before Python 3.11

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.toml")))
# The backend names (simplesharded/backends.py); passed explicitly so these tests do not depend on the compiler stack.
BACKENDS = [f"{c}{s}" for c in ("aot_eager", "inductor")
            for s in ("", "_autobucketing", "_blockbucketing", "_upstreambucketing")] + ["eager"]


def load(path=None, argv=None):
    return load_config(path, argv, backends=BACKENDS)


def write(tmp_path, text, name="c.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_defaults():
    cfg = load()
    assert cfg == Config()
    assert cfg.training.grad_reduction == "sum" and cfg.parallelism.mode == "fully_shard"
    assert cfg.compile.backend == "aot_eager_autobucketing"
    assert set(cfg.to_dict()) == {
        "job", "model", "optimizer", "lr_scheduler", "training", "parallelism", "compile",
        "activation_checkpoint", "checkpoint", "metrics", "profiling"}


def test_shipped_configs_exist():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"llama3_debug.toml", "llama3_small.toml", "llama3_8b.toml", "llama3_70b.toml",
            "llama3_405b.toml", "deepseek_v3_debug.toml", "deepseek_v3_16b.toml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_config_loads(path):
    cfg = load(path)
    assert cfg.job.config_file == path
    # Both ways of naming the file give the same config.
    assert load(None, ["--job.config_file", path]) == cfg


def test_debug_config_values():
    cfg = load(os.path.join(ROOT, "configs", "llama3_debug.toml"))
    t = cfg.training
    assert (cfg.model.name, cfg.model.flavor) == ("llama3", "debug")
    assert (t.global_batch_size, t.seq_len, t.steps) == (8, 128, 30)
    assert cfg.lr_scheduler.warmup_steps == 5 and cfg.optimizer.lr == 1e-3
    assert cfg.metrics.log_freq == 1
    assert resolve(cfg, 2).training.local_batch_size == 4


def test_cli_overrides(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n")
    cfg = load(path, ["--training.steps", "3", "--optimizer.lr=1e-2", "--compile.enable",
                      "--no-metrics.progress_bar", "--training.local_batch_size", "-1",
                      "--job.description", "a b"])
    assert cfg.training.steps == 3 and cfg.training.seq_len == 64  # CLI beats file
    assert cfg.optimizer.lr == 1e-2
    assert cfg.compile.enable is True and cfg.metrics.progress_bar is False
    assert cfg.job.description == "a b"


def test_cli_bool_forms():
    assert load(None, ["--compile.enable=true"]).compile.enable is True
    assert load(None, ["--compile.enable", "0"]).compile.enable is False
    assert load(None, ["--compile.enable", "--training.steps", "2"]).compile.enable is True
    assert load(None, ["--compile.enable=False"]).compile.enable is False
    # ints from the CLI are accepted for float fields
    assert load(None, ["--optimizer.lr", "1"]).optimizer.lr == 1.0
    with pytest.raises(ValueError, match="compile.enable expects bool"):
        load(None, ["--compile.enable=yes please"])
    with pytest.raises(ValueError, match="--no-"):
        load(None, ["--no-training.steps"])
    with pytest.raises(ValueError, match="expects a value"):
        load(None, ["--training.steps"])
    with pytest.raises(ValueError, match="unexpected"):
        load(None, ["training.steps", "3"])


def test_parse_cli_keeps_order():
    argv = ["--training.steps", "3", "--training.steps=4", "--compile.enable"]
    assert parse_cli(argv, Config) == [
        ("training.steps", "3"), ("training.steps", "4"), ("compile.enable", True)]


@pytest.mark.parametrize("argv,key,suggestion", [
    (["--training.seqlen", "3"], "training.seqlen", "training.seq_len"),
    (["--trainig.steps", "3"], "trainig.steps", "training.steps"),
    (["--compile.enabled"], "compile.enabled", "compile.enable"),
])
def test_unknown_cli_key(argv, key, suggestion):
    with pytest.raises(ValueError) as e:
        load(None, argv)
    assert repr(key) in str(e.value) and repr(suggestion) in str(e.value)


def test_unknown_toml_key_and_section(tmp_path):
    with pytest.raises(ValueError, match=r"'training.global_batchsize'.*'training.global_batch_"):
        load(write(tmp_path, "[training]\nglobal_batchsize = 4\n"))
    with pytest.raises(ValueError, match=r"'optimiser.lr'.*'optimizer.lr'"):
        load(write(tmp_path, "[optimiser]\nlr = 0.1\n"))
    with pytest.raises(ValueError, match=r"'steps'.*'training.steps'"):
        load(write(tmp_path, "steps = 3\n"))
    with pytest.raises(ValueError, match="must be a table"):
        load(write(tmp_path, "training = 3\n"))


def test_wrong_types(tmp_path):
    with pytest.raises(ValueError, match=r"training.steps expects int, got '10' \(str\)"):
        load(write(tmp_path, '[training]\nsteps = "10"\n'))
    with pytest.raises(ValueError, match=r"training.steps expects int, got True \(bool\)"):
        load(write(tmp_path, "[training]\nsteps = true\n"))
    with pytest.raises(ValueError, match=r"training.steps expects int, got 2.5"):
        load(write(tmp_path, "[training]\nsteps = 2.5\n"))
    with pytest.raises(ValueError, match="compile.enable expects bool"):
        load(write(tmp_path, '[compile]\nenable = "true"\n'))
    with pytest.raises(ValueError, match="optimizer.lr expects float"):
        load(None, ["--optimizer.lr", "fast"])
    cfg = load(write(tmp_path, "[optimizer]\nlr = 1\n"))  # int accepted for float
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)


def test_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="not valid TOML"):
        load(write(tmp_path, "[training\n"))
    with pytest.raises(ValueError, match="job.config_file"):
        load(str(tmp_path / "nope.toml"))


def test_enum_errors():
    with pytest.raises(ValueError) as e:
        load(None, ["--training.grad_reduction", "mean"])
    assert str(e.value) == "training.grad_reduction='mean' is not one of ['avg', 'sum']"
    with pytest.raises(ValueError, match=r"optimizer.name='adam' is not one of \['AdamW', 'SGD'\]"):
        load(None, ["--optimizer.name", "adam"])
    with pytest.raises(ValueError, match="activation_checkpoint.mode='some'"):
        load(None, ["--activation_checkpoint.mode", "some"])


def test_value_checks():
    for argv, key in [(["--training.steps", "0"], "training.steps"),
                      (["--optimizer.lr", "-1"], "optimizer.lr"),
                      (["--training.local_batch_size", "0"], "training.local_batch_size"),
                      (["--lr_scheduler.min_lr_ratio", "2"], "lr_scheduler.min_lr_ratio"),
                      (["--parallelism.data_parallel_shard_degree", "-2"],
                       "parallelism.data_parallel_shard_degree")]:
        with pytest.raises(ValueError, match=key):
            load(None, argv)


def test_loss_chunks_values():
    """training.loss_chunks: 0 = auto (default), 1 = unchunked, N = chunks; under tensor
    parallelism 0 or 1 only."""
    assert Config().training.loss_chunks == 0
    assert load(None, ["--training.loss_chunks", "8"]).training.loss_chunks == 8
    with pytest.raises(ValueError) as e:
        load(None, ["--training.loss_chunks", "-1"])
    assert str(e.value) == ("training.loss_chunks=-1 must be >= 0 (0 = auto, 1 = unchunked, "
                            "N = chunks of tokens)")
    with pytest.raises(ValueError, match=r"training.loss_chunks expects int, got 'auto'"):
        load(None, ["--training.loss_chunks", "auto"])
    tp = ["--parallelism.tensor_parallel_degree", "2"]
    for ok in ("0", "1"):
        load(None, [*tp, "--training.loss_chunks", ok])
    with pytest.raises(ValueError, match=r"training.loss_chunks=4 must be 0 \(auto\) or 1 with "
                                         r"parallelism.tensor_parallel_degree > 1"):
        load(None, [*tp, "--training.loss_chunks", "4"])


def test_expert_parallel_degree_checks():
    """parallelism.expert_parallel_degree: >= 1, divides the (resolved) shard degree; the
    model must have routed experts it divides (train.check_static)."""
    from simplesharded.trainer import check_static

    ep = ["--parallelism.expert_parallel_degree"]
    assert Config().parallelism.expert_parallel_degree == 1
    assert resolve(load(None, [*ep, "2"]), 4).parallelism.expert_parallel_degree == 2
    with pytest.raises(ValueError, match=r"parallelism.expert_parallel_degree=0 must be >= 1"):
        load(None, [*ep, "0"])
    with pytest.raises(ValueError) as e:
        resolve(load(None, [*ep, "3"]), 4)
    assert str(e.value) == ("parallelism.expert_parallel_degree=3 does not divide "
                            "parallelism.data_parallel_shard_degree=4 (expert parallelism "
                            "borrows its ranks from the data-parallel shards)")
    deepseek = ["--job.config_file", os.path.join(ROOT, "configs", "deepseek_v3_debug.toml"),
                "--training.global_batch_size", "6"]
    with pytest.raises(ValueError) as e:
        check_static(load(None, [*deepseek, *ep, "3"]), 6)
    assert str(e.value) == ("parallelism.expert_parallel_degree=3 does not divide "
                            "n_routed_experts=8 of model deepseek_v3/debug")
    with pytest.raises(ValueError, match=r"expert_parallel_degree=2 needs a model with routed "
                                         r"experts \(deepseek_v3\); model llama3/debug has none"):
        check_static(load(None, [*ep, "2"]), 2)


def test_expert_parallel_degree_with_a_hugging_face_model(tmp_path):
    """A Hugging Face MoE takes expert parallelism through transformers' own plan
    (models/hf_expert_parallel.py); a degree that does not divide its experts, or a dense
    model, is one line naming the path."""
    transformers = pytest.importorskip("transformers")
    from simplesharded.trainer import check_static

    small = dict(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2)
    transformers.MixtralConfig(num_local_experts=4, **small).save_pretrained(tmp_path / "moe")
    transformers.LlamaConfig(**small).save_pretrained(tmp_path / "dense")

    def check(path, ep, world):
        return check_static(load(None, ["--model.name", "hf", "--model.path", str(path),
                                        "--training.global_batch_size", str(2 * world),
                                        "--parallelism.expert_parallel_degree", str(ep)]),
                            world)

    assert check(tmp_path / "moe", 2, 2).parallelism.expert_parallel_degree == 2
    with pytest.raises(ValueError) as e:
        check(tmp_path / "moe", 3, 3)
    assert str(e.value) == ("parallelism.expert_parallel_degree=3 does not divide "
                            f"MixtralConfig's number of experts (4) (model.path="
                            f"'{tmp_path / 'moe'}')")
    with pytest.raises(ValueError) as e:
        check(tmp_path / "dense", 2, 2)
    assert str(e.value) == ("parallelism.expert_parallel_degree=2: LlamaConfig has no "
                            "expert-parallel plan (base_model_ep_plan naming "
                            "'ep_dispatch_experts' modules) in transformers (use 1) "
                            f"(model.path='{tmp_path / 'dense'}')")


def test_model_n_layers():
    """model.n_layers builds the zoo model with that many blocks (0: the flavor's); the
    planner and the pipeline split read the same depth; negative, or with a Hugging Face
    model, one error naming the key."""
    from simplesharded.tools.forecast import _meta_params
    from simplesharded.trainer import check_static

    cfg = check_static(load(None, ["--model.n_layers", "2"]), 2)
    assert cfg.model.overrides() == {"n_layers": 2} and Config().model.overrides() == {}
    assert cfg.model.spec()[1].n_layers == 2 and Config().model.spec()[1].n_layers > 2
    shallow = {n for n, _ in cfg.model.build().named_parameters()}
    assert {n.split(".")[1] for n in shallow if n.startswith("layers.")} == {"0", "1"}
    assert len(_meta_params(cfg)) == len(shallow)
    with pytest.raises(ValueError, match=r"^model.n_layers=-1: a zoo model's number of blocks"):
        check_static(load(None, ["--model.n_layers", "-1"]), 1)
    with pytest.raises(ValueError, match=r"^model.n_layers=2: .*a Hugging Face model's is its "
                                         r"config.json's"):
        check_static(load(None, ["--model.name", "hf", "--model.path", "/x",
                                 "--model.n_layers", "2"]), 1)


def test_backend_check_and_alias():
    with pytest.raises(ValueError, match=r"compile.backend='aot_eagr' is not one of \["):
        load(None, ["--compile.backend", "aot_eagr"])
    cfg = load(None, ["--compile.model_backend_override", "inductor_blockbucketing"])
    assert cfg.compile.backend == "inductor_blockbucketing"
    cfg = load(None, ["--compile.backend", "eager", "--compile.model_backend_override", "inductor"])
    assert cfg.compile.backend == "inductor"
    with pytest.raises(ValueError, match="compile.backend='nope'"):
        load(None, ["--compile.model_backend_override", "nope"])
    validate(Config(), backends=["aot_eager_autobucketing"])


def test_mode_natural_default():
    cfg = load(None, ["--parallelism.data_parallel_replicate_degree", "2"])
    assert cfg.parallelism.mode == "hybrid_shard"
    cfg = load(None, ["--parallelism.data_parallel_replicate_degree", "2",
                      "--parallelism.data_parallel_shard_degree", "1"])
    assert cfg.parallelism.mode == "replicate"
    # An explicit but inconsistent mode is an error rather than silently changed.
    with pytest.raises(ValueError, match="parallelism.mode='fully_shard'"):
        load(None, ["--parallelism.data_parallel_replicate_degree", "2",
                    "--parallelism.mode", "fully_shard"])
    cfg = load(None, ["--parallelism.mode", "replicate"])
    assert cfg.parallelism.mode == "replicate"


def test_resolve():
    cfg = resolve(load(None, ["--training.global_batch_size", "16",
                              "--training.gradient_accumulation_steps", "2"]), 4)
    assert cfg.parallelism.data_parallel_shard_degree == 4
    assert cfg.training.local_batch_size == 2
    hsdp = resolve(load(None, ["--parallelism.data_parallel_replicate_degree", "2"]), 4)
    assert hsdp.parallelism.data_parallel_shard_degree == 2
    with pytest.raises(ValueError, match="global_batch_size"):
        resolve(load(None, ["--training.global_batch_size", "6"]), 4)
    with pytest.raises(ValueError, match="global_batch_size"):
        resolve(load(None, ["--training.local_batch_size", "3"]), 2)
    with pytest.raises(ValueError, match="world size 4"):
        resolve(load(None, ["--parallelism.data_parallel_shard_degree", "3"]), 4)
    assert Config().training.local_batch_size == -1  # resolve copies


def test_toml_round_trip():
    cfg = load(None, ["--job.description", 'quote " and \\ back', "--optimizer.eps", "1e-12"])
    assert Config.from_dict(tomllib.loads(cfg.to_toml())) == cfg


def test_main_prints(capsys):
    path = os.path.join(ROOT, "configs", "llama3_debug.toml")
    assert main(["--json", "--job.config_file", path, "--compile.backend", "eager",
                 "--training.steps", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["training"]["steps"] == 2 and out["job"]["config_file"] == path
    assert main(["--training.stepz", "2"]) == 2
    assert "training.steps" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "--training.grad_reduction" in capsys.readouterr().out


def test_backend_check_reads_the_registry():
    """Without ``backends``: the registry's names, and names torch registers (make_backend
    passes those through); anything else lists the registry's."""
    assert load_config(None, ["--compile.backend", "inductor_upstreambucketing"])
    assert load_config(None, ["--compile.backend", "aot_eager_decomp_partition"])
    with pytest.raises(ValueError, match=r"compile.backend='anything' is not one of \[.*"
                                         r"'inductor_upstreambucketing'\]"):
        load_config(None, ["--compile.backend", "anything"])


def test_rules_about_the_config_alone_are_checked_at_load():
    """Rules that need no model: hybrid_shard needs a replicate degree, sequence parallelism a
    sequence length the tp degree divides."""
    with pytest.raises(ValueError, match=r"parallelism.mode='hybrid_shard' needs "
                                         r"data_parallel_replicate_degree >= 2"):
        load(None, ["--parallelism.mode", "hybrid_shard"])
    tp = ["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "33"]
    with pytest.raises(ValueError, match=r"tensor_parallel_degree=2 does not divide "
                                         r"training.seq_len=33"):
        load(None, tp)
    assert load(None, [*tp, "--no-parallelism.enable_sequence_parallel"])


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_config_names_a_registered_model(path):
    models = pytest.importorskip("simplesharded.models")
    cfg = load(path)
    assert cfg.model.flavor in models.MODELS[cfg.model.name][1]


def test_optimizer_implementation_reaches_torch():
    """optimizer.implementation: bad values are named; each choice becomes torch's kwarg."""
    import torch

    from simplesharded.trainer import build_optimizer

    with pytest.raises(ValueError, match=r"optimizer.implementation='loop' is not one of"):
        load(None, ["--optimizer.implementation", "loop"])
    params = [torch.nn.Parameter(torch.zeros(3))]
    # auto: foreach on the device, fused where the step runs on the host
    for offload, key in [("none", "foreach"), ("params", "fused"), ("optimizer", "fused")]:
        cfg = load(None, ["--parallelism.offload", offload])
        assert cfg.optimizer.implementation == "auto"
        assert build_optimizer(cfg, params).defaults[key] is True, offload
    for impl, key in [("for-loop", "foreach"), ("foreach", "foreach"), ("fused", "fused")]:
        for name in ("AdamW", "SGD"):
            cfg = load(None, ["--optimizer.implementation", impl, "--optimizer.name", name])
            opt = build_optimizer(cfg, params)
            assert opt.defaults[key] is (impl != "for-loop"), (impl, name, opt.defaults)


def test_train_check_only(monkeypatch, capsys):
    """`python -m simplesharded.trainer --check-only` (run_train.sh's preflight): the trainer's
    static checks for WORLD_SIZE ranks, then exit without touching a process group."""
    import torch.distributed as dist

    from simplesharded.trainer import main as train_main

    path = os.path.join(ROOT, "configs", "llama3_debug.toml")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train_main(["--check-only", "--job.config_file", path]) == 0
    assert not dist.is_initialized()
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("WORLD_SIZE", "3")  # global batch 8 does not split over 3 ranks
    assert train_main(["--job.config_file", path, "--check-only"]) == 2
    assert capsys.readouterr().err == ("error: training.global_batch_size=8 is not divisible by "
                                       "dp (3) * gradient_accumulation_steps (1)\n")
    assert train_main(["--check-only", "--help"]) == 0
    assert "--training.steps (int" in capsys.readouterr().out
    monkeypatch.setenv("WORLD_SIZE", "2")  # a bench-only zoo model: one line, not a traceback
    assert train_main(["--check-only", "--job.config_file", path, "--model.name", "hf_llama"]) == 2
    assert capsys.readouterr().err.startswith("error: model.name='hf_llama' is not trainable "
                                              "here yet")
    assert train_main(["--check-only", "--job.config_file", path, "--model.name", "gpt"]) == 0


def test_gradient_sync_choices():
    """training.gradient_sync: every_microbatch by default (gradients stay sharded); a bad
    value is one error naming the key and the choices."""
    assert Config().training.gradient_sync == "every_microbatch"
    cfg = load(None, ["--training.gradient_sync", "last_microbatch",
                      "--training.gradient_accumulation_steps", "4"])
    assert cfg.training.gradient_sync == "last_microbatch"
    with pytest.raises(ValueError) as e:
        load(None, ["--training.gradient_sync", "last"])
    assert str(e.value) == ("training.gradient_sync='last' is not one of ['every_microbatch', "
                            "'last_microbatch']")


def test_storage_key(tmp_path):
    """parallelism.storage: param, ragged, or auto (the default): data_parallel gets its
    storage; auto is ragged, or param where the mode is replicate (given, or resolved from the
    degrees). A bad value is one line listing the choices."""
    def storage(path=None, argv=None):
        p = load(path, argv).parallelism
        return p.storage, p.dp_storage

    assert storage() == ("auto", "ragged")
    assert storage(None, ["--parallelism.mode", "hybrid_shard",
                          "--parallelism.data_parallel_replicate_degree", "2"]) == (
        "auto", "ragged")
    assert storage(None, ["--parallelism.mode", "replicate"]) == ("auto", "param")
    assert storage(None, ["--parallelism.data_parallel_replicate_degree", "2",
                          "--parallelism.data_parallel_shard_degree", "1"]) == ("auto", "param")
    assert storage(None, ["--parallelism.storage", "param"]) == ("param", "param")
    assert storage(None, ["--parallelism.storage=ragged"]) == ("ragged", "ragged")
    assert storage(write(tmp_path, "[parallelism]\nstorage = 'param'\n")) == ("param", "param")
    with pytest.raises(ValueError) as e:
        load(None, ["--parallelism.storage", "flat"])
    assert str(e.value) == ("parallelism.storage='flat' is not one of ['auto', 'param', "
                            "'ragged']")
    with pytest.raises(ValueError, match="storage expects str, got True"):
        load(write(tmp_path, "[parallelism]\nstorage = true\n"))


DEPRECATED = "[simplesharded] parallelism.flat_buckets is deprecated: use --parallelism.storage"


def test_flat_buckets_is_storage_deprecated(tmp_path, capsys):
    """The old key still works for one release, in TOML and on the command line (a TOML
    boolean or a bare flag as before): false is param, ragged and auto are themselves, each
    with one printed line naming the new key. true, flat storage, is retired: one line."""
    def storage(path=None, argv=None):
        p = load(path, argv).parallelism
        return p.storage, capsys.readouterr().err

    for path, argv, want in [
            (write(tmp_path, "[parallelism]\nflat_buckets = false\n", "f.toml"), None, "param"),
            (write(tmp_path, "[parallelism]\nflat_buckets = 'ragged'\n", "r.toml"), None,
             "ragged"),
            (None, ["--parallelism.flat_buckets", "ragged"], "ragged"),
            (None, ["--parallelism.flat_buckets", "auto"], "auto"),
            (None, ["--parallelism.flat_buckets=0"], "param"),
            (None, ["--no-parallelism.flat_buckets", "--training.steps", "2"], "param")]:
        assert storage(path, argv) == (want, f"{DEPRECATED} {want}\n"), (path, argv)
    assert "flat_buckets" not in load(None, ["--parallelism.flat_buckets", "false"]).to_toml()
    retired = ("parallelism.flat_buckets=true: flat storage is retired; use "
               "--parallelism.storage ragged (zero-copy buckets, docs/zero_copy.md)")
    for path, argv in [(write(tmp_path, "[parallelism]\nflat_buckets = true\n"), None),
                       (None, ["--parallelism.flat_buckets"]),
                       (None, ["--parallelism.flat_buckets", "--training.steps", "2"]),
                       (None, ["--parallelism.flat_buckets", "true"])]:
        with pytest.raises(ValueError) as e:
            load(path, argv)
        assert str(e.value) == retired, (path, argv)
    with pytest.raises(ValueError) as e:
        load(None, ["--parallelism.flat_buckets", "raged"])
    assert str(e.value) == ("parallelism.flat_buckets='raged' is not one of ['auto', 'false', "
                            "'ragged'] (deprecated: use parallelism.storage)")
    with pytest.raises(ValueError, match=r"^parallelism.flat_buckets=1 is not one of"):
        load(write(tmp_path, "[parallelism]\nflat_buckets = 1\n"))


def test_flat_buckets_warning_once_per_job(monkeypatch, capsys):
    """The deprecation line is printed by rank 0 only, and not by the ranks run_train.sh
    starts after its preflight printed it (SIMPLESHARDED_PREFLIGHT_DONE)."""
    from simplesharded.trainer.config_parse import PREFLIGHT_DONE

    argv = ["--parallelism.flat_buckets", "ragged"]
    for env, printed in (({"RANK": "1"}, ""), ({"RANK": "0", PREFLIGHT_DONE: "1"}, ""),
                         ({"RANK": "0"}, f"{DEPRECATED} ragged\n")):
        monkeypatch.delenv(PREFLIGHT_DONE, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert load(None, argv).parallelism.storage == "ragged"
        assert capsys.readouterr().err == printed, env
    # the launcher sets it for the ranks: tests/test_launch_env.py


def test_storage_and_flat_buckets_together_are_one_error(tmp_path):
    both = ("parallelism.flat_buckets and parallelism.storage are both set: flat_buckets is "
            "storage's deprecated name, keep storage only")
    for path, argv in [
            (None, ["--parallelism.storage", "ragged", "--parallelism.flat_buckets", "ragged"]),
            (write(tmp_path, "[parallelism]\nflat_buckets = 'ragged'\n"),
             ["--parallelism.storage", "param"])]:
        with pytest.raises(ValueError) as e:
            load(path, argv)
        assert str(e.value) == both


def test_ragged_buckets_refuse_replicate_in_one_error():
    argv = ["--parallelism.mode", "replicate"]
    with pytest.raises(ValueError) as e:
        load(None, ["--parallelism.storage", "ragged", *argv])
    assert str(e.value) == (
        "parallelism.storage='ragged' needs parallelism.mode 'fully_shard' or "
        "'hybrid_shard', got 'replicate' (or set storage=param)")
    load(None, ["--parallelism.storage", "param", *argv])


def test_ragged_buckets_take_hsdp_tp_ep_cp_pp_last_microbatch_sync_and_the_step_scope():
    cfg = load(None, ["--parallelism.storage", "ragged",
                      "--parallelism.tensor_parallel_degree", "2",
                      "--parallelism.expert_parallel_degree", "2"])
    assert cfg.parallelism.tensor_parallel_degree == cfg.parallelism.expert_parallel_degree == 2
    cfg = load(None, ["--parallelism.storage", "ragged",
                      "--parallelism.context_parallel_degree", "2"])
    assert cfg.parallelism.context_parallel_degree == 2
    assert cfg.parallelism.dp_storage == "ragged"
    cfg = load(None, ["--parallelism.storage", "ragged",
                      "--parallelism.data_parallel_replicate_degree", "2",
                      "--training.gradient_accumulation_steps", "2",
                      "--training.gradient_sync", "last_microbatch"])
    assert cfg.parallelism.mode == "hybrid_shard" and cfg.parallelism.dp_storage == "ragged"
    cfg = load(None, ["--parallelism.storage", "ragged", "--compile.enable",
                      "--compile.scope", "step"])
    assert cfg.compile.scope == "step" and cfg.parallelism.dp_storage == "ragged"
    cfg = load(None, ["--parallelism.storage", "ragged",
                      "--parallelism.pipeline_parallel_degree", "2"])
    assert cfg.parallelism.pipeline_parallel_degree == 2


def test_gpu_counts_key():
    """job.gpu_counts / job.gpu_memory_gib: a list of increasing counts (TOML list, or
    "8,16" / "[8, 16]" on the command line) and the memory it assumes; bad values are one
    line naming the key."""
    cfg = load(None, ["--job.gpu_counts", "8,16,32", "--job.gpu_memory_gib", "79"])
    assert cfg.job.gpu_counts == [8, 16, 32] and cfg.job.gpu_memory_gib == 79.0
    assert load(None, ["--job.gpu_counts", "[8, 16]", "--job.gpu_memory_gib", "79"]
                ).job.gpu_counts == [8, 16]
    assert Config().job.gpu_counts == [] and Config().job.gpu_counts is not Config().job.gpu_counts
    assert Config.from_dict(tomllib.loads(cfg.to_toml())) == cfg
    for argv, message in [
        (["--job.gpu_counts", "8,x"], "job.gpu_counts expects list of int, got '8,x' (str)"),
        (["--job.gpu_counts", "16,8", "--job.gpu_memory_gib", "79"],
         "job.gpu_counts=[16, 8] must be GPU counts >= 1 in increasing order, e.g. [8, 16, 32]"),
        (["--job.gpu_counts", "0,8", "--job.gpu_memory_gib", "79"],
         "job.gpu_counts=[0, 8] must be GPU counts >= 1 in increasing order, e.g. [8, 16, 32]"),
        (["--job.gpu_counts", "8"],
         "job.gpu_memory_gib=0.0 must be > 0 (the memory of one GPU) when job.gpu_counts is set"),
    ]:
        with pytest.raises(ValueError) as e:
            load(None, argv)
        assert str(e.value) == message
    with pytest.raises(ValueError, match=r"job.gpu_counts expects list of int, got \[8, 'x'\]"):
        Config.from_dict({"job": {"gpu_counts": [8, "x"]}})
    assert "--job.gpu_counts (list of int, default [])" in help_text()


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_config_states_the_gpu_counts_it_fits(path):
    """Every shipped config states its GPU counts and the GPU memory they assume, and its
    degrees and batch resolve at each count (the trainer's static checks). With several
    counts the local batch is derived (global / (dp x micro-batches)), so the smallest count
    holds the most per GPU: the planner's memory check (test_shipped_configs_fit.py) checks
    that one."""
    from simplesharded.trainer import check_static

    cfg = load(path)
    counts = cfg.job.gpu_counts
    assert counts and cfg.job.gpu_memory_gib > 0, "state job.gpu_counts and job.gpu_memory_gib"
    cfg.training.dataset_path = ""
    for n in counts:
        check_static(cfg, n)
    if len(counts) > 1:
        assert cfg.training.local_batch_size == -1


def test_recompute_tp_outputs_needs_checkpointed_tp_blocks_in_a_joint_graph():
    """activation_checkpoint.recompute_tp_outputs where it has nothing to act on (no
    checkpointing, no TP, the step graph, which saves every collective) is one line."""
    from simplesharded.trainer import check_static

    base = ["--activation_checkpoint.recompute_tp_outputs", "--training.global_batch_size", "4"]
    ok = check_static(load(None, [*base, "--activation_checkpoint.mode", "full",
                                  "--parallelism.tensor_parallel_degree", "2"]), 4)
    assert ok.activation_checkpoint.recompute_tp_outputs
    for extra, bad in ((["--parallelism.tensor_parallel_degree", "2"],
                        "activation_checkpoint.mode='none'"),
                       (["--activation_checkpoint.mode", "full"],
                        "parallelism.tensor_parallel_degree=1"),
                       (["--activation_checkpoint.mode", "full",
                         "--parallelism.tensor_parallel_degree", "2", "--compile.enable",
                         "--compile.scope", "step"], "compile.scope='step'")):
        with pytest.raises(ValueError, match="^activation_checkpoint.recompute_tp_outputs needs "
                                             ".*; got " + re.escape(bad) + "$"):
            check_static(load(None, [*base, *extra]), 4)
