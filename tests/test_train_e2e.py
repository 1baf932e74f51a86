"""End-to-end tests of the trainer CLI (`python -m simplesharded.trainer`, under torchrun).

Every test launches the real command line in fresh processes (gloo ranks on CPU) and reads
`<dump_folder>/metrics.jsonl` for the losses. Runs are kept tiny (seq_len 32, global batch 4)
so one launch of the debug model costs ~5-25 s on 2 cores.

Loss comparisons and why they must hold:
- Same global batch, same data, same world size ⇒ the same floating-point program: a
  checkpoint resume reproduces the uninterrupted losses exactly (≤ 1e-6 rel).
- Same global batch at another data-parallel layout (HSDP 2×2 vs fully_shard 2, or a
  checkpoint resharded onto 1 or 4 ranks) ⇒ the same math with another summation order:
  ≤ 1e-5 rel (HSDP) / 1e-4 rel (resharded resume, two Adam steps in).
- The e2e runs use a constant lr after a 15-step warmup, so the lr of step k does not depend
  on training.steps: a 10-step run that is stopped and resumed to 20 must equal a 20-step run.

Helpers here are also used by test_reliability.py.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The runs use this test's own python and its torchrun: run_tests.sh's venv, whichever torch
# (SIMPLESHARDED_VENV), as run_train.sh's launches below do; another venv's torch initialises
# and trains the same seed differently
_BIN = Path(sys.executable).parent
PYTHON = sys.executable
TORCHRUN = str(_BIN / "torchrun") if (_BIN / "torchrun").exists() else shutil.which("torchrun")
LLAMA = "configs/llama3_debug.toml"
DEEPSEEK = "configs/deepseek_v3_debug.toml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
       "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
for _k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(_k, None)  # the single-process runs must not think they are under torchrun

# Small and fast: 2 blocks (what a launch compiles and runs scales with them; no test here
# depends on their number), no validation, no progress bar (it writes to stderr).
SMALL = ["--training.seq_len", "32", "--training.global_batch_size", "4",
         "--training.val_every", "0", "--no-metrics.progress_bar", "--model.n_layers", "2"]
# lr(step) independent of training.steps (see module docstring).
CONST_LR = ["--lr_scheduler.warmup_steps", "15", "--lr_scheduler.decay_type", "constant"]
COMMON = SMALL + CONST_LR


# ---------------------------------------------------------------------------- processes

def train_cmd(nproc: int | None, *args: str, config: str = LLAMA,
              torchrun_args: tuple[str, ...] = ()) -> list[str]:
    """nproc=None: plain `python -m simplesharded.trainer` (a 1-process group, no torchrun)."""
    tail = ["-m", "simplesharded.trainer", "--job.config_file", config, *args]
    if nproc is None:
        return [PYTHON, *tail]
    return [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", *torchrun_args, *tail]


def _children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out.setdefault(ppid, []).append(int(d))
    return out


def descendants(pid: int) -> list[int]:
    """All live descendants of pid (torchrun puts its workers in new sessions, so killing
    torchrun's process group would not reach them)."""
    children, out, todo = _children_map(), [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a still-running process we started and every process it started, by pid."""
    if proc.poll() is not None:
        return  # exited and reaped: its pid may belong to someone else by now
    pids = descendants(proc.pid)
    for pid in [proc.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


class Result:
    def __init__(self, cmd, returncode, stdout, stderr):
        self.cmd, self.returncode, self.stdout, self.stderr = cmd, returncode, stdout, stderr

    def __repr__(self):
        return (f"Result(rc={self.returncode}, cmd={' '.join(self.cmd)}\n--- stdout ---\n"
                f"{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-6000:]})")

    def error_lines(self) -> list[str]:
        return [ln for ln in self.stderr.splitlines() if ln.startswith("error: ")]


def start(cmd: list[str], workdir: Path,
          env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path, Path]:
    """Start cmd (in the repo root) with stdout/stderr going to files (no pipe deadlocks);
    `env` adds to the test environment ENV."""
    workdir.mkdir(parents=True, exist_ok=True)
    fd, out = tempfile.mkstemp(prefix="out-", suffix=".log", dir=workdir)
    os.close(fd)
    err = Path(str(out).replace("out-", "err-"))
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**ENV, **(env or {})}, stdout=open(out, "w"), stderr=open(err, "w"),
                            stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, Path(out), err


def run_many(cmds: list[list[str]], workdir: Path, timeout: float = 240) -> list[Result]:
    """Run commands concurrently; every process tree is killed if it outlives the timeout."""
    started = [start(c, workdir) for c in cmds]
    deadline = time.monotonic() + timeout
    timed_out = set()
    try:
        for i, (proc, _, _) in enumerate(started):
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out.add(i)
    finally:
        for proc, _, _ in started:
            kill_tree(proc)
    results = [Result(c, p.returncode, o.read_text(), e.read_text())
               for c, (p, o, e) in zip(cmds, started)]
    for i in timed_out:
        results[i].stderr += f"\n[test] timed out after {timeout} s and was killed"
    return results


def run(cmd: list[str], workdir: Path, timeout: float = 240) -> Result:
    return run_many([cmd], workdir, timeout)[0]


def run_ok(cmd: list[str], workdir: Path, timeout: float = 240) -> Result:
    r = run(cmd, workdir, timeout)
    assert r.returncode == 0, r
    return r


# ---------------------------------------------------------------------------- outputs

def read_losses(dump: Path) -> dict[int, float]:
    """step → loss from metrics.jsonl; a step logged twice (a resumed run appends) keeps the
    last record."""
    out = {}
    with open(dump / "metrics.jsonl") as fh:
        for line in fh:
            if line.strip():
                rec = json.loads(line)
                out[rec["step"]] = rec["loss"]
    return out


def read_records(dump: Path) -> list[dict]:
    with open(dump / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def assert_close(got: dict[int, float], want: dict[int, float], steps, tol: float, what: str):
    bad = [(s, got.get(s), want[s]) for s in steps
           if s not in got or not rel(got[s], want[s]) <= tol]
    assert not bad, f"{what}: (step, got, want) beyond rel {tol}: {bad}"


def step_dirs(folder: Path) -> list[str]:
    return sorted((p.name for p in folder.iterdir()), key=lambda n: (len(n), n)) \
        if folder.is_dir() else []


def copy_checkpoint(src_dump: Path, step: int, dst_dump: Path, name: str | None = None) -> Path:
    dst = dst_dump / "checkpoint" / (name or f"step-{step}")
    shutil.copytree(src_dump / "checkpoint" / f"step-{step}", dst)
    return dst


# ---------------------------------------------------------------------------- fixtures

def drop_checkpoints(root: Path) -> None:
    """Checkpoints are ~60 MB each here; pytest keeps the last 3 runs' tmp dirs."""
    for p in list(root.rglob("checkpoint")):
        shutil.rmtree(p, ignore_errors=True)


@pytest.fixture(autouse=True)
def _drop_checkpoints_after(tmp_path):
    yield
    drop_checkpoints(tmp_path)


@pytest.fixture(scope="module")
def eager2(tmp_path_factory):
    """Reference: 2 ranks, eager, 20 steps, checkpoints every 5 steps, keep the newest 3."""
    dump = tmp_path_factory.mktemp("eager2")
    r = run_ok(train_cmd(2, *COMMON, "--training.steps", "20", "--checkpoint.enable",
                         "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "3",
                         "--job.dump_folder", str(dump)), dump)
    losses = read_losses(dump)
    assert sorted(losses) == list(range(1, 21)), r
    assert all(math.isfinite(v) for v in losses.values()), losses
    yield dump, losses
    drop_checkpoints(dump)


# ---------------------------------------------------------------------------- training runs

@pytest.mark.slow
def test_loss_falls_compiled_blockbucketing_alias(tmp_path, eager2):
    """12 steps of llama3 debug on 2 ranks, compiled through the `model_backend_override`
    alias with block bucketing and the loss in 3 chunks of tokens (64 per rank: uneven
    chunks): the loss falls clearly, validation loss falls, and the first steps equal the
    eager run's, whose loss is unchunked (loss_chunks auto = 1 at this size): aot_eager +
    bucketing reorders collectives only, and the chunked loss has the unchunked gradient."""
    _, ref = eager2
    r = run_ok(train_cmd(2, *COMMON, "--training.steps", "12", "--training.val_every", "4",
                         "--compile.enable", "--compile.model_backend_override",
                         "aot_eager_blockbucketing", "--training.loss_chunks", "3",
                         "--job.dump_folder", str(tmp_path)),
               tmp_path)
    assert "compile=aot_eager_blockbucketing" in r.stdout, r
    recs = read_records(tmp_path)
    losses = [x["loss"] for x in recs]
    assert [x["step"] for x in recs] == list(range(1, 13)), r
    assert all(math.isfinite(v) for v in losses), losses
    last5 = sum(losses[-5:]) / 5
    assert last5 < 0.75 * losses[0], f"loss did not fall: first {losses[0]}, last 5 {losses[-5:]}"
    val = [x["val_loss"] for x in recs if "val_loss" in x]
    assert len(val) == 3 and val[2] < val[0], val
    for key in ("grad_norm", "lr", "tps", "tokens_per_s_global"):
        assert all(key in x for x in recs), recs[0]
    assert_close(read_losses(tmp_path), ref, range(1, 4), 1e-5, "compiled vs eager")


@pytest.mark.slow
def test_deepseek_v3_compiled_autobucketing(tmp_path):
    """CONFIG_FILE=deepseek_v3_debug (MoE) with --compile.enable and the cost-model bucketing
    backend given explicitly (also its TOML default; llama3 runs block bucketing above, so
    each bucketing backend is compiled once per suite)."""
    r = run_ok(train_cmd(2, *SMALL, "--training.steps", "3", "--compile.enable",
                         "--compile.backend", "aot_eager_autobucketing",
                         "--job.dump_folder", str(tmp_path), config=DEEPSEEK), tmp_path)
    assert "deepseek_v3/debug" in r.stdout and "compile=aot_eager_autobucketing" in r.stdout, r
    losses = read_losses(tmp_path)
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(v) for v in losses.values()), r
    assert losses[3] < losses[1], losses


@pytest.mark.slow
def test_hsdp_matches_fully_shard(tmp_path, eager2):
    """4 ranks as 2 replicas × 2 shards see the same global batch as 2 fully_shard ranks."""
    _, ref = eager2
    r = run_ok(train_cmd(4, *COMMON, "--training.steps", "3",
                         "--parallelism.data_parallel_replicate_degree", "2",
                         "--parallelism.data_parallel_shard_degree", "2",
                         "--job.dump_folder", str(tmp_path)), tmp_path)
    assert "mode=hybrid_shard mesh=dp_replicate=2,dp_shard=2" in r.stdout, r
    assert_close(read_losses(tmp_path), ref, range(1, 4), 1e-5, "HSDP vs fully_shard")


@pytest.mark.slow
def test_initial_model_independent_of_world_size(tmp_path, eager2):
    """Same seed, same global batch: step 1 (initial weights, no update yet) must not depend
    on how many ranks the parameters are sharded over."""
    _, ref = eager2
    run_ok(train_cmd(None, *COMMON, "--training.steps", "1",
                     "--job.dump_folder", str(tmp_path)), tmp_path)
    assert_close(read_losses(tmp_path), ref, [1], 1e-5, "1 rank vs 2 ranks, step 1")


# ---------------------------------------------------------------------------- checkpoints

@pytest.mark.slow
def test_checkpoint_stop_resume_and_retention(tmp_path, eager2):
    """10 steps, stop, resume to 20 == 20 straight (exactly); keep_latest_k keeps the newest K."""
    ref_dump, ref = eager2
    assert step_dirs(ref_dump / "checkpoint") == ["step-10", "step-15", "step-20"]
    first = run_ok(train_cmd(2, *COMMON, "--training.steps", "10", "--checkpoint.enable",
                             "--checkpoint.interval", "5", "--job.dump_folder", str(tmp_path)),
                   tmp_path)
    assert "resumed" not in first.stdout, first
    # keep_latest_k = 2 from the TOML
    assert step_dirs(tmp_path / "checkpoint") == ["step-5", "step-10"]
    second = run_ok(train_cmd(2, *COMMON, "--training.steps", "20", "--checkpoint.enable",
                              "--checkpoint.interval", "5", "--job.dump_folder", str(tmp_path)),
                    tmp_path)
    assert "[checkpoint] resumed from step 10" in second.stdout, second
    assert step_dirs(tmp_path / "checkpoint") == ["step-15", "step-20"]
    steps = [x["step"] for x in read_records(tmp_path)]
    assert steps == list(range(1, 21)), steps  # the resumed run appends 11..20
    assert_close(read_losses(tmp_path), ref, range(1, 21), 1e-6, "stop+resume vs straight")


@pytest.mark.slow
def test_async_checkpoints_resume_exactly(tmp_path, eager2):
    """checkpoint.async_mode async, 10 steps saving every 5: training goes on while each save
    is written, and both saves are committed (the last one before the run ends). Resumed
    from step 5 alone (the save written while steps 6-10 ran), steps 6-12 are the
    uninterrupted run's, exactly."""
    _, ref = eager2
    first = tmp_path / "first"
    run_ok(train_cmd(2, *COMMON, "--training.steps", "10", "--checkpoint.enable",
                     "--checkpoint.interval", "5", "--checkpoint.async_mode", "async",
                     "--job.dump_folder", str(first)), first)
    assert step_dirs(first / "checkpoint") == ["step-5", "step-10"]
    assert_close(read_losses(first), ref, range(1, 11), 1e-6, "async saves vs none")
    second = tmp_path / "second"
    copy_checkpoint(first, 5, second)
    r = run_ok(train_cmd(2, *COMMON, "--training.steps", "12", "--checkpoint.enable",
                         "--checkpoint.interval", "100", "--checkpoint.async_mode", "async",
                         "--job.dump_folder", str(second)), second)
    assert "[checkpoint] resumed from step 5" in r.stdout, r
    assert_close(read_losses(second), ref, range(6, 13), 1e-6, "resumed from the async step 5")
    assert step_dirs(second / "checkpoint") == ["step-5", "step-12"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 4])
def test_checkpoint_reshards_on_load(tmp_path, eager2, nproc):
    """A 2-rank checkpoint (step 10) resumes on 1 rank and on 4 ranks; same global batch and
    data ⇒ steps 11-12 match the 2-rank continuation."""
    ref_dump, ref = eager2
    copy_checkpoint(ref_dump, 10, tmp_path)
    r = run_ok(train_cmd(None if nproc == 1 else nproc, *COMMON, "--training.steps", "12",
                         "--checkpoint.enable", "--checkpoint.interval", "100",
                         "--job.dump_folder", str(tmp_path)), tmp_path)
    assert f"world={nproc}" in r.stdout and "resumed from step 10" in r.stdout, r
    got = read_losses(tmp_path)
    assert sorted(got) == [11, 12], r
    assert_close(got, ref, [11, 12], 1e-4, f"{nproc}-rank resume vs 2-rank")
    # the end-of-run save at the new world size is loadable layout-wise (committed, not .tmp)
    assert step_dirs(tmp_path / "checkpoint") == ["step-10", "step-12"]


def test_ragged_buckets_resume_from_and_into_per_parameter_checkpoints(tmp_path, eager2):
    """parallelism.storage=ragged: the 2-rank per-parameter checkpoint (step 10) resumes
    into ragged buckets, whose steps 11-12 are the uninterrupted run's (the same sums: eager
    ragged buckets train bit for bit as without); their step-12 checkpoint is keyed per
    parameter, optimizer state included, and resumes on 1 rank without them (step 13)."""
    import torch.distributed.checkpoint as dcp

    ref_dump, ref = eager2
    copy_checkpoint(ref_dump, 10, tmp_path / "ragged")
    r = run_ok(train_cmd(2, *COMMON, "--parallelism.storage", "ragged", "--training.steps",
                         "12", "--checkpoint.enable", "--checkpoint.interval", "100",
                         "--job.dump_folder", str(tmp_path / "ragged")), tmp_path)
    assert "storage=ragged" in r.stdout and "resumed from step 10" in r.stdout, r
    got = read_losses(tmp_path / "ragged")
    assert sorted(got) == [11, 12], r
    assert_close(got, ref, [11, 12], 1e-6, "ragged resume vs per-parameter run")
    saved = dcp.FileSystemReader(str(tmp_path / "ragged" / "checkpoint" / "step-12"))
    keys = list(saved.read_metadata().state_dict_metadata)
    assert not [k for k in keys if "_ragged" in k]
    assert "optimizer.state.layers.0.attention.wq.weight.exp_avg" in keys
    copy_checkpoint(tmp_path / "ragged", 12, tmp_path / "plain")
    r = run_ok(train_cmd(None, *COMMON, "--training.steps", "13", "--checkpoint.enable",
                         "--checkpoint.interval", "100", "--job.dump_folder",
                         str(tmp_path / "plain")), tmp_path)
    assert "resumed from step 12" in r.stdout, r
    got = read_losses(tmp_path / "plain")
    assert sorted(got) == [13], r
    assert_close(got, ref, [13], 1e-4, "1-rank resume of the ragged checkpoint")


# ---------------------------------------------------------------------------- config errors

def _one_error_line(r: Result, *needles: str) -> str:
    assert r.returncode == 2, r
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert "Traceback" not in r.stderr + r.stdout, r
    return lines[0]


@pytest.mark.slow
def test_config_errors_exit_2_with_one_line(tmp_path):
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text('[training]\nsteps = "3"\nseq_lne = 64\n')
    typo_toml = tmp_path / "typo.toml"
    typo_toml.write_text("[trainig]\nsteps = 3\n")
    cases = {
        "unknown key": (["--training.stepz", "3"],
                        ["'training.stepz'", "did you mean 'training.steps'"]),
        "unknown key in toml": (["--job.config_file", str(typo_toml)],
                                ["trainig", str(typo_toml), "did you mean"]),
        "wrong type": (["--training.steps", "abc"], ["training.steps", "int", "'abc'"]),
        "wrong type in toml": (["--job.config_file", str(bad_toml)],
                               ["training.steps", "int", "'3'"]),
        "unknown backend": (["--compile.backend", "aot_eagr"],
                            ["compile.backend='aot_eagr'", "'aot_eager_autobucketing'",
                             "'inductor_blockbucketing'"]),
        "batch not divisible": (["--training.global_batch_size", "3",
                                 "--training.gradient_accumulation_steps", "2"],
                                ["training.global_batch_size=3", "divisible"]),
        "seq_len above max": (["--training.seq_len", "100000"],
                              ["training.seq_len=100000", "2048"]),
        "missing dataset": (["--training.dataset_path", str(tmp_path / "nope.txt")],
                            ["training.dataset_path", "nope.txt"]),
        "unknown model": (["--model.name", "llama4"], ["model.name='llama4'", "'llama3'"]),
        "unknown flavor": (["--model.flavor", "huge"], ["model.flavor='huge'", "'debug'"]),
    }
    cmds = [train_cmd(None, "--job.dump_folder", str(tmp_path / "out"), *args)
            for args, _ in cases.values()]
    results = run_many(cmds, tmp_path, timeout=180)
    for (name, (_, needles)), r in zip(cases.items(), results):
        try:
            _one_error_line(r, *needles)
        except AssertionError as e:
            raise AssertionError(f"case {name!r}: {e}") from None
    assert not (tmp_path / "out").exists()  # nothing ran: no dump folder


@pytest.mark.slow
def test_degrees_not_matching_world(tmp_path):
    r = run(train_cmd(2, "--parallelism.data_parallel_shard_degree", "3",
                      "--job.dump_folder", str(tmp_path / "out")), tmp_path, timeout=120)
    assert r.returncode != 0, r
    want = ("error: parallelism.data_parallel_shard_degree=3 does not equal the world size 2")
    assert want in r.error_lines(), r
    assert "exitcode  : 2" in r.stderr, r  # torchrun's report of the worker's exit code
    assert "[simplesharded]" not in r.stdout, r  # failed before building anything


# ---------------------------------------------------------------------------- FSDP x TP

@pytest.fixture(scope="module")
def tp2_compiled(tmp_path_factory):
    """README's command: `NGPU=4 ./run_train.sh --parallelism.tensor_parallel_degree 2
    --compile.enable` (the config's aot_eager_autobucketing), 10 steps, checkpoints at steps 5
    and 10. One run for the two tests below: a compiled 4-rank launch is the costliest here."""
    dump = tmp_path_factory.mktemp("tp2")
    r = run(run_train_sh({"NGPU": "4"}, *COMMON, "--parallelism.tensor_parallel_degree", "2",
                         "--compile.enable", "--training.steps", "10", "--checkpoint.enable",
                         "--checkpoint.interval", "5", "--job.dump_folder", str(dump)),
            dump, timeout=480)
    yield dump, r
    drop_checkpoints(dump)


@pytest.mark.slow
def test_tp_compiled_loss_curve_matches_dp_only(tp2_compiled, eager2):
    """The README's TP command passes run_train.sh's preflight, trains under torchrun on a
    (dp 2, tp 2) mesh, and gives the same per-step losses as the eager data-parallel run
    (2 ranks, same global batch, same seed): 10 steps within 1e-4 relative. The reference
    runs eager: eager dp is the plainer program to hold compiled TP against."""
    dump, r = tp2_compiled
    assert r.returncode == 0, r
    assert "[simplesharded] llama3/debug n_layers=2 world=4 mode=fully_shard mesh=dp_shard=2,tp=2 " \
           "compile=aot_eager_autobucketing" in r.stdout, r
    tp = read_losses(dump)
    assert sorted(tp) == list(range(1, 11)), r
    assert_close(tp, eager2[1], range(1, 11), 1e-4, "tp 2 x dp 2 vs dp 2")


@pytest.mark.slow
def test_tp_checkpoint_resumes_on_other_layouts(tmp_path, tp2_compiled):
    """The step-5 checkpoint of the dp 2 x tp 2 run above (its strided-shard DTensors)
    resumes at dp 4 x tp 1 and at dp 1 x tp 2 on 2 ranks, the latter into ragged buckets
    (their members converted from the TP shards, optimizer state included): DCP reshards by
    global offsets, so the next loss (computed from the loaded parameters) equals the
    uninterrupted run's, and the step after it (one Adam update from the loaded optimizer
    state) too."""
    ref, r = tp2_compiled
    assert r.returncode == 0, r
    want = read_losses(ref)
    assert sorted(want) == list(range(1, 11))
    layouts = {"dp4tp1": (4, "1", "param"), "dp1tp2": (2, "2", "ragged")}
    cmds = []
    for name, (nproc, tp, storage) in layouts.items():
        copy_checkpoint(ref, 5, tmp_path / name)
        cmds.append(train_cmd(nproc, *COMMON, "--parallelism.tensor_parallel_degree", tp,
                              "--parallelism.storage", storage,
                              "--training.steps", "7", "--checkpoint.enable",
                              "--checkpoint.interval", "100",
                              "--job.dump_folder", str(tmp_path / name)))
    for name, r in zip(layouts, [run_ok(c, tmp_path) for c in cmds]):
        assert "resumed from step 5" in r.stdout, r
        got = read_losses(tmp_path / name)
        assert sorted(got) == [6, 7], (name, r)
        assert_close(got, want, [6], 1e-5, f"{name}: next loss after resume")
        assert_close(got, want, [7], 1e-4, f"{name}: one step later")
    # the ragged run's own checkpoint is keyed per parameter, as the one it resumed from
    import torch.distributed.checkpoint as dcp

    keys = set(dcp.FileSystemReader(str(tmp_path / "dp1tp2" / "checkpoint" / "step-7"))
               .read_metadata().state_dict_metadata)
    assert keys == set(dcp.FileSystemReader(str(ref / "checkpoint" / "step-5"))
                       .read_metadata().state_dict_metadata)


# ---------------------------------------------------------------------------- run_train.sh

RUN_TRAIN = str(ROOT / "run_train.sh")


def run_train_sh(env: dict[str, str], *args: str) -> list[str]:
    """`env … ./run_train.sh args` with NGPU/NNODES/MASTER_ADDR only as `env` says."""
    sets = [f"{k}={v}" for k, v in env.items()]
    return ["env", "-u", "NGPU", "-u", "NNODES", "-u", "MASTER_ADDR", *sets, RUN_TRAIN, *args]


def _own_stderr(r: Result) -> Result:
    """r without bootstrap's lines (printed only when it (re)installs the venv)."""
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("[bootstrap] ")]
    return Result(r.cmd, r.returncode, r.stdout, "\n".join(lines))


def test_run_train_sh_config_errors_before_torchrun(tmp_path):
    """The README's command reports a config or degree error once, as one line and exit 2,
    before torchrun starts: no per-rank copies, no ChildFailedError traceback, no dump folder."""
    dump = ["--job.dump_folder", str(tmp_path / "out")]
    cases = {
        "unknown key": ({}, ["--training.stepz", "3"],
                        ["'training.stepz'", "did you mean 'training.steps'?"]),
        "shard degree vs world": ({"NGPU": "2"}, ["--parallelism.data_parallel_shard_degree", "3"],
                                  ["parallelism.data_parallel_shard_degree=3", "world size 2"]),
        "tp degree vs world": ({"NGPU": "4"}, ["--parallelism.tensor_parallel_degree", "8"],
                               ["parallelism.tensor_parallel_degree=8", "world size 4"]),
        "tp degree vs sequence": ({"NGPU": "4"}, ["--parallelism.tensor_parallel_degree", "3"],
                                  ["parallelism.tensor_parallel_degree=3 does not divide "
                                   "training.seq_len=128"]),
        # the world is NGPU x NNODES: checked on each node before the rendezvous
        "world spans nodes": ({"NGPU": "2", "NNODES": "2", "MASTER_ADDR": "127.0.0.1"},
                              ["--parallelism.data_parallel_shard_degree", "2"],
                              ["parallelism.data_parallel_shard_degree=2", "world size 4"]),
        "NGPU not a number": ({"NGPU": "two"}, [], ["NGPU='two'", "positive integer"]),
        "loss chunks": ({}, ["--training.loss_chunks", "-2"],
                        ["training.loss_chunks=-2", ">= 0 (0 = auto, 1 = unchunked"]),
        "ep degree vs dp_shard": ({"NGPU": "4"}, ["--parallelism.expert_parallel_degree", "3"],
                                  ["parallelism.expert_parallel_degree=3 does not divide "
                                   "parallelism.data_parallel_shard_degree=4"]),
        "ep without experts": ({"NGPU": "2"}, ["--parallelism.expert_parallel_degree", "2"],
                               ["parallelism.expert_parallel_degree=2 needs a model with "
                                "routed experts", "llama3/debug"]),
    }
    cmds = [run_train_sh(env, *args, *dump) for env, args, _ in cases.values()]
    results = run_many(cmds, tmp_path, timeout=180)
    for (name, (_, _, needles)), r in zip(cases.items(), results):
        r = _own_stderr(r)
        try:
            assert r.returncode == 2, r
            assert len(r.stderr.splitlines()) == 1, r  # exactly one line, blank ones included
            _one_error_line(r, *needles)
            assert "ChildFailedError" not in r.stderr and r.stdout == "", r
        except AssertionError as e:
            raise AssertionError(f"case {name!r}: {e}") from None
    assert not (tmp_path / "out").exists()


def test_run_train_sh_an_error_in_the_ranks_is_their_line_and_code(tmp_path):
    """An error only the ranks can find (here a checkpoint step that is not there, read when
    they load) ends the README's command with the ranks' exit code, 2, and their error line
    once, without torchrun's traceback and failure table (simplesharded/trainer/launch.py)."""
    r = _own_stderr(run(run_train_sh({"NGPU": "2"}, *SMALL, "--checkpoint.enable",
                                      "--checkpoint.load_step", "5", "--job.dump_folder",
                                      str(tmp_path / "out")), tmp_path, timeout=180))
    assert r.returncode == 2, r
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert errors == [  # once, not once per rank
        f"error: checkpoint.load_step=5: no complete checkpoint at "
        f"'{tmp_path / 'out' / 'checkpoint' / 'step-5'}'; available steps: []"], r
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr, r
    assert "failed (exitcode" not in r.stderr, r  # torchrun's own line for that code


def test_run_train_sh_help(tmp_path):
    """--help prints every key once and exits 0 (the preflight must not reject it)."""
    r = _own_stderr(run(run_train_sh({"NGPU": "2"}, "--help"), tmp_path, timeout=120))
    assert r.returncode == 0 and r.stderr == "", r
    assert r.stdout.startswith("usage: ") and "--training.steps (int, default 30)" in r.stdout, r
    assert r.stdout.count("usage: ") == 1, r  # once: from run_train.sh, not from each rank
    assert "[simplesharded]" not in r.stdout, r  # no training started
