"""The benchmark CLIs: ratio arithmetic and target verdicts, argument errors, and real (tiny)
runs of `python -m simplesharded.tools.bench`, `python -m simplesharded.tools.bench_collectives` and
`python -m simplesharded.tools.bench_passes`."""
import json
import re
import statistics
import sys

import pytest
import torch

from simplesharded.tools import (bench, bench_collectives, bench_passes, bench_run, bench_table,
                                 bench_variants)
from simplesharded.passes.torch_compat import CONTEXT_PARALLEL
from torch_range import needs_torch

# glibc's malloc defaults in the ranks, so that they fork from the test worker's fork server
# (started without the caching tunables: tests/conftest.py) instead of starting fresh
# interpreters (the default's ranks would be spawned here: tests/test_forkserver.py)
FORKED = ("--host-malloc", "system")


def _run(variant, ms):
    return bench_run.RunResult(variant, step_s=[ms / 1e3] * 3, first_step_s=ms / 1e3 + 1.0,
                               collectives_per_step=4, peak_mem_mb=100.0, step_mem_mb=60.0,
                               main_cpu_s=0.9 * ms / 1e3, other_cpu_s=0.05)


def test_summarize_ratios_and_targets():
    results = {"fsdp2_eager": [_run("fsdp2_eager", 1500)],
               "compute_floor": [_run("compute_floor", 1000)],
               "compute_floor_concurrent": [_run("compute_floor_concurrent", 1100)],
               "ss_aot_eager_autobucketing": [_run("ss_aot_eager_autobucketing", 1140),
                                              _run("ss_aot_eager_autobucketing", 1160)],
               "ss_aot_eager_upstreambucketing": [_run("ss_aot_eager_upstreambucketing", 1300)]}
    rows = {r["variant"]: r for r in bench_table.summarize(results, bench_variants.BenchArgs())}
    auto = rows["ss_aot_eager_autobucketing"]
    assert auto["step_ms"] == pytest.approx(1150)  # median over repetitions
    assert auto["x_fsdp2_eager"] == pytest.approx(1150 / 1500)
    assert auto["x_compute_floor"] == pytest.approx(1.15)
    assert auto["x_compute_floor_concurrent"] == pytest.approx(1150 / 1100)
    assert auto["compile_s"] == pytest.approx(2.14 - 1.15)  # first step of rep 1 − median
    verdicts = bench_table.targets(list(rows.values()))
    assert "MISS ss_aot_eager_autobucketing / fsdp2_eager = 0.77 (target ≤ 0.7)" in verdicts
    assert "PASS ss_aot_eager_autobucketing / compute_floor = 1.15 (target ≤ 1.15)" in verdicts
    table = bench_table.format_table(list(rows.values()), bench_variants.BenchArgs())
    assert ("| ss_aot_eager_autobucketing | 1150 | 0.77 | 1.15 | 1.05 | 4 | 0.0 | 1.0 | 100 | 60 | "
            "– | 1035 + 50 |") in table


def test_ratios_pair_each_repetition_with_its_own_reference():
    """A × column is the median of each repetition's ratio when both variants ran every
    repetition: the floor's drift between repetitions cancels. A ratio of the overall medians
    would read 1200 / 1200 here."""
    floor = [_run("compute_floor", ms) for ms in (1000, 1300, 1200)]
    ddp = [_run("ddp", ms) for ms in (1100, 1430, 1200)]  # 1.10, 1.10, 1.00
    rows = {r["variant"]: r for r in bench_table.summarize(
        {"compute_floor": floor, "ddp": ddp}, bench_variants.BenchArgs())}
    assert rows["ddp"]["step_ms"] == pytest.approx(1200)
    assert rows["ddp"]["x_compute_floor"] == pytest.approx(1.10)
    # a repetition that failed leaves nothing to pair: the ratio of the medians
    ddp[1] = bench_run.RunResult("ddp", error="rank 1 died")
    rows = {r["variant"]: r for r in bench_table.summarize(
        {"compute_floor": floor, "ddp": ddp}, bench_variants.BenchArgs())}
    assert rows["ddp"]["x_compute_floor"] == pytest.approx(statistics.median([1100, 1200])
                                                           / 1200)


def test_step_peak_bytes_counts_state_gradients_and_activations():
    """One process, no group: the CPU measurement is what the rank holds between steps plus the
    step's highest running total of live allocations (torch.profiler's memory events)."""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(512, 256)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).sum().backward()
        opt.step()

    step()  # the optimizer state exists from here on
    params = sum(p.numel() * 4 for p in model.parameters())
    assert bench_run._resident_bytes(model, opt) == 3 * params + 8 * 4  # + 8 AdamW step counters
    peak, held, *_ = bench_run._step_peak_bytes(step, model, opt, "cpu")
    assert held == 3 * params + 8 * 4
    activations = 4 * x.numel() * 4  # the outputs of the first three layers, kept for backward
    # at least: state, all gradients, and the saved activations at the end of forward
    assert peak >= 3 * params + activations
    assert peak >= 4 * params
    # at most: everything at once, with room for the optimizer's foreach temporaries
    assert peak <= 3 * params + params + activations + 2 * params, (peak, params, activations)


def test_step_variants_name_our_compiled_backends():
    """ss_step_<backend>: compile_step with that backend, aot_eager or inductor (eager compiles
    nothing); the two aot_eager bucketing ones are in the default set without TP."""
    assert str(bench_variants.ss_backend("ss_step_aot_eager_blockbucketing")) == \
        "aot_eager_blockbucketing"
    assert bench_variants.is_step_variant("ss_step_aot_eager_autobucketing")
    assert not bench_variants.is_step_variant("ss_aot_eager_autobucketing")
    steps = [v for v in bench_variants.all_variants() if bench_variants.is_step_variant(v)]
    assert steps and not [v for v in steps if bench_variants.ss_backend(v).compiler == "eager"]
    assert set(bench_variants.STEP_DEFAULT) <= set(bench_variants.default_variants(1))
    assert not set(steps) & set(bench_variants.default_variants(2))
    # the step graph over ragged buckets: named, not in a default set
    ragged = "ss_step_ragged_aot_eager_blockbucketing"
    assert ragged in bench_variants.all_variants() and bench_variants.is_step_variant(ragged)
    assert str(bench_variants.ss_backend(ragged)) == "aot_eager_blockbucketing"
    assert bench_variants.storage_of(ragged) == "ragged"
    assert bench_variants.storage_of("ss_ragged_aot_eager_autobucketing") == "ragged"
    assert bench_variants.storage_of("ss_step_aot_eager_autobucketing") == "param"
    # flat storage is retired: no variant names it
    assert not [v for v in bench_variants.all_variants() if "flat" in v]
    # the trainer's defaults (ragged buckets, uncompiled and autobucketing) are in the default
    # set; the other ragged variants are named
    ragged_in = {v for v in bench_variants.all_variants() if bench_variants.is_ragged_variant(v)}
    assert ragged_in & set(bench_variants.default_variants(1)) == {
        "ss_ragged_eager", "ss_ragged_aot_eager_autobucketing"}
    assert not ragged_in & set(bench_variants.default_variants(2))


def test_copied_bytes_counts_each_copy_once():
    """The outermost copy ops of a profiled region, each once (clone's inner copy_ and
    split_with_sizes_copy's inner clones are not counted again), casts apart, and the copies
    of another thread apart (gloo's worker threads copy too)."""
    import types

    import torch
    from torch.profiler import ProfilerActivity, profile

    a, b = torch.randn(64, 64), torch.randn(32, 64)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                 record_shapes=True) as prof:
        c = torch.cat([a, b])  # 96 x 64 fp32 each
        d = c.clone()
        d.copy_(c)
        torch.split_with_sizes_copy(c, [64, 32])
        c.to(torch.bfloat16)  # a cast: half the bytes
        c.t().contiguous()  # a copy made by contiguous()'s clone
        c + 1  # not a copy
    one = 96 * 64 * 4
    events = list(prof.events())
    copied, cast, other = bench_run.copied_bytes(events)
    # an op's allocations as the profiler records them: the output, give or take a few bytes
    assert abs(cast - one // 2) <= 64 and abs(copied - (5 * one + one // 2)) <= 64, \
        (copied, cast)
    assert other == 0
    # a copy_ of another thread, as gloo's worker runs it: apart (the profiler records
    # torch's own threads, not a Python thread started inside it, hence made up here)
    worker = types.SimpleNamespace(name="aten::copy_", cpu_parent=None, thread=-1,
                                   input_shapes=[[96, 64], [96, 64]], input_dtypes=[],
                                   cpu_memory_usage=0)
    assert bench_run.copied_bytes(events + [worker]) == (copied + one, cast, one)
    # a gloo worker's 12 MB buffer charged to a 4-element cast the compute thread had open
    # (seen with two gloo ranks): the cast counts what it can write, not the buffer
    small_cast = types.SimpleNamespace(name="aten::_to_copy", cpu_parent=None,
                                       thread=events[0].thread, input_shapes=[[4], [], []],
                                       input_dtypes=["double", "Scalar", ""],
                                       cpu_memory_usage=12587024)
    assert bench_run.copied_bytes(events + [small_cast]) == (copied + 64, cast + 64, 0)


def test_inductor_floor_ratio_only_for_inductor_variants():
    """× floor inductor: for variants whose compute inductor compiles (ss_inductor_*, FSDP2's
    per-block compile, compiled DDP, the floor itself); "–" elsewhere, where the other columns
    still hold."""
    results = {v: [_run(v, ms)] for v, ms in [
        ("compute_floor", 1000), ("compute_floor_inductor", 800), ("fsdp2_compiled", 1200),
        ("ddp", 1080), ("ddp_inductor", 880),
        ("ss_inductor_blockbucketing", 1000), ("ss_aot_eager_blockbucketing", 1100)]}
    rows = {r["variant"]: r for r in bench_table.summarize(results, bench_variants.BenchArgs())}
    assert rows["ss_inductor_blockbucketing"]["x_compute_floor_inductor"] == pytest.approx(1.25)
    assert rows["fsdp2_compiled"]["x_compute_floor_inductor"] == pytest.approx(1.5)
    assert rows["ddp_inductor"]["x_compute_floor_inductor"] == pytest.approx(1.1)
    assert "x_compute_floor_inductor" not in rows["ddp"]
    assert rows["compute_floor_inductor"]["x_compute_floor_inductor"] == pytest.approx(1.0)
    assert "x_compute_floor_inductor" not in rows["ss_aot_eager_blockbucketing"]
    assert "x_compute_floor_inductor" not in rows["compute_floor"]
    for row in rows.values():  # the eager floor's column is unchanged: every variant has it
        assert row["x_compute_floor"] == pytest.approx(row["step_ms"] / 1000)
    table = bench_table.format_table(list(rows.values()), bench_variants.BenchArgs())
    assert "| variant | step ms | × compute_floor | × floor inductor | collectives/step |" in table
    assert "| ss_aot_eager_blockbucketing | 1100 | 1.10 | – | 4 |" in table
    assert "| ss_inductor_blockbucketing | 1000 | 1.00 | 1.25 | 4 |" in table
    # in the default set without TP (the inductor variants' floor), not in the 2-D one
    assert "compute_floor_inductor" in bench_variants.default_variants(1)
    assert "compute_floor_inductor" not in bench_variants.default_variants(2)
    assert "ddp_inductor" in bench_variants.default_variants(1)  # the inductor rows' yardstick


def test_thread_cpu_accounting_sees_other_threads():
    """The table's CPU column: a busy helper thread shows up as "other", not as "main"."""
    import threading
    import time

    main0, other0 = bench_run._thread_cpu_s()
    spun, release = threading.Event(), threading.Event()

    def spin():
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        spun.set()
        release.wait()  # stay alive: a finished thread leaves /proc/self/task

    t = threading.Thread(target=spin)
    t.start()
    spun.wait()
    main1, other1 = bench_run._thread_cpu_s()
    release.set()
    t.join()
    assert other1 - other0 >= 0.1
    assert main1 - main0 < 0.2


def test_failed_variant_is_reported_not_hidden():
    bad = bench_run.RunResult("ddp", error="RuntimeError: boom")
    rows = bench_table.summarize({"ddp": [bad]}, bench_variants.BenchArgs())
    assert rows == [{"variant": "ddp", "error": "RuntimeError: boom"}]
    table = bench_table.format_table(rows, bench_variants.BenchArgs())
    assert "failed: RuntimeError: boom" in table


def test_unknown_variant_is_an_error(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--variants", "fsdp3"])
    assert "--variants ['fsdp3']: 'fsdp3' is not one of" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_bench_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bench.main(["--flavor", "debug", "--n-layers", "2", "--seq-len", "32", "--warmup",
                       "1", "--steps", "2", "--reps", "1", *FORKED, "--json", str(out),
                       "--variants",
                       "compute_floor",
                       "ss_aot_eager_blockbucketing", "ss_ragged_aot_eager_blockbucketing",
                       "ss_ragged_aot_eager_blockbucketing+qw_int8+qg_int8"]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert not any("error" in r for r in rows.values()), rows
    assert rows["compute_floor"]["collectives_per_step"] == 0
    # debug llama3 at 2 blocks, counted at runtime from gloo's events: forward gathers
    # embeddings + 2 blocks + head (4), backward re-gathers block 0 (the last block and the
    # head stay gathered: reshard_after_forward="auto"), 4 reductions
    assert rows["ss_aot_eager_blockbucketing"]["collectives_per_step"] == 4 + 1 + 4
    # bytes the step copies: the buckets' copy-in and copy-out add to the floor's; fp32, so no
    # parameter is cast (a few KB of index casts are)
    assert rows["ss_aot_eager_blockbucketing"]["copied_mb"] > rows["compute_floor"]["copied_mb"]
    assert rows["ss_aot_eager_blockbucketing"]["cast_mb"] < 0.01
    # peak tensor memory per rank, measured, and the planner's prediction for the same step
    # (it does not model the loss, computed outside the compiled model, nor the optimizer's
    # temporaries): debug llama3 at 2 blocks has 1.8M parameters, ~14 MB of fp32 state per rank
    block = rows["ss_aot_eager_blockbucketing"]
    assert 14 < block["peak_mem_mb"] < 200 and rows["compute_floor"]["peak_mem_mb"] > 14
    assert 0.75 < block["planned_mb"] / block["peak_mem_mb"] < 1.33, block
    # the same for ragged buckets (the planner traces the step at that storage): same
    # collectives, no bucket copies on the compute thread
    ragged = rows["ss_ragged_aot_eager_blockbucketing"]
    assert ragged["collectives_per_step"] == 4 + 1 + 4
    assert ragged["copied_mb"] - ragged["copied_other_mb"] == pytest.approx(
        rows["compute_floor"]["copied_mb"], abs=0.05)
    assert 0.75 < ragged["planned_mb"] / ragged["peak_mem_mb"] < 1.33, ragged
    assert "planned_mb" not in rows["compute_floor"]
    # bytes into the collectives: none for the floor; int8 gathers and reductions (payload
    # and one fp32 scale per 256 elements, padded blocks) about a quarter of fp32's
    quantized = rows["ss_ragged_aot_eager_blockbucketing+qw_int8+qg_int8"]
    assert rows["compute_floor"]["wire_mb"] == 0 and ragged["wire_mb"] > 1
    assert rows["ss_aot_eager_blockbucketing"]["wire_mb"] == pytest.approx(ragged["wire_mb"],
                                                                           rel=0.05)
    assert 0.25 < quantized["wire_mb"] / ragged["wire_mb"] < 0.3, (quantized, ragged)
    assert quantized["collectives_per_step"] == 2 * ragged["collectives_per_step"]
    printed = capsys.readouterr().out
    assert "| ss_aot_eager_blockbucketing |" in printed
    assert "quantized, not compared: ss_ragged_aot_eager_blockbucketing+qw_int8+qg_int8" in printed


def test_quantized_variants_stand_beside_the_parity_check():
    """A quantized variant computes another step: its losses take no part in the parity
    check (which still fails on an unquantized variant that differs); its largest relative
    difference from the first run is said on the same line."""
    def run(variant, *losses):
        return [bench_run.RunResult(variant, [1.0], losses=list(losses))]

    runs = {"ss_aot_eager": run("ss_aot_eager", 6.0, 5.9),
            "ss_aot_eager+qw_int8": run("ss_aot_eager+qw_int8", 6.01, 5.95),
            "ss_aot_eager+qw_int8+qg_int8": run("ss_aot_eager+qw_int8+qg_int8", 6.0, 5.8)}
    ok, line = bench_table.parity(bench_table.summarize(runs, bench_variants.BenchArgs()))
    assert ok, line
    assert line.endswith("; quantized, not compared: ss_aot_eager+qw_int8 8.5e-03 (step 2), "
                         "ss_aot_eager+qw_int8+qg_int8 1.7e-02 (step 2)"), line
    runs["ss_aot_eager_blockbucketing"] = run("ss_aot_eager_blockbucketing", 6.01, 5.9)
    ok, line = bench_table.parity(bench_table.summarize(runs, bench_variants.BenchArgs()))
    assert not ok and "ss_aot_eager_blockbucketing 6.010000 vs ss_aot_eager" in line, line
    assert bench_variants.split_quantized("ss_ragged_aot_eager_autobucketing+qw_fp8+qg_bf16") \
        == ("ss_ragged_aot_eager_autobucketing", {"quantize_gathers": "fp8",
                                                  "quantize_grads": "bf16"})
    assert str(bench_variants.ss_backend("ss_ragged_inductor_blockbucketing+qw_int8")) == \
        "inductor_blockbucketing"
    assert bench_variants.storage_of("ss_ragged_aot_eager_blockbucketing+qg_int8") == "ragged"


def test_wire_bytes_reads_gloos_records():
    """The bytes of the inputs of gloo's collectives, by element type; other events ignored;
    an element type the table does not know is an error naming it."""
    events = [{"name": "gloo:all_gather", "args": {"Input type": ["float"],
                                                   "Input Dims": [[10, 3]]}},
              {"name": "gloo:all_to_all", "args": {"Input type": ["signed char"],
                                                   "Input Dims": [[8]]}},
              {"name": "gloo:all_reduce", "args": {"Input type": ["c10::BFloat16"],
                                                   "Input Dims": [[7]]}},
              {"name": "aten::mm", "args": {"Input type": ["float"], "Input Dims": [[99]]}},
              {"name": "[memory]", "args": {"Bytes": 4}}]
    assert bench_run.wire_bytes(events) == 4 * 30 + 8 + 2 * 7
    with pytest.raises(ValueError, match="gloo:all_gather: element type 'c10::Float4'"):
        bench_run.wire_bytes([{"name": "gloo:all_gather",
                               "args": {"Input type": ["c10::Float4"], "Input Dims": [[2]]}}])


def test_parity_names_the_variant_that_computed_something_else():
    def run(variant, *losses):
        return [bench_run.RunResult(variant, [1.0], losses=list(losses))]

    # the floors train on one dp rank's batch: their step 2 is not compared
    runs = {"compute_floor": run("compute_floor", 6.0, 5.0),
            "fsdp2_eager": run("fsdp2_eager", 6.0003, 5.9),
            "ss_aot_eager": run("ss_aot_eager", 6.0, 5.9)}
    rows = bench_table.summarize(runs, bench_variants.BenchArgs())
    ok, line = bench_table.parity(rows)
    assert ok, line
    assert line == ("parity (rtol 0.0001): step 1: 3 runs agree with compute_floor (6.000000) "
                    "within 5.0e-05; step 2 (no floors): 2 runs agree with fsdp2_eager "
                    "(5.900000) within 0.0e+00")
    runs["ss_aot_eager"] = run("ss_aot_eager", 6.01, 5.8)
    ok, line = bench_table.parity(bench_table.summarize(runs, bench_variants.BenchArgs()))
    assert not ok
    assert line == ("PARITY MISMATCH (rtol 0.0001): step 1: ss_aot_eager 6.010000 vs "
                    "compute_floor 6.000000; step 2: ss_aot_eager 5.800000 vs fsdp2_eager "
                    "5.900000")
    # a reference that did not run has no column (not a ratio of 0)
    table = bench_table.format_table(rows, bench_variants.BenchArgs())
    assert "| step ms | × fsdp2_eager | × compute_floor | collectives/step |" in table
    assert ("| fsdp2_eager | 1000 | 1.00 | 1.00 | 0 | 0.0 | 0.0 | 0 | 0 | – | 0 + 0 | 0 | 0 + 0 (0) | "
            "6.000300 | 5.900000 |"
            in table)


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt3"], "--model 'gpt3' is not one of ["),
    (["--model", "hf_llama", "--flavor", "8B"], "--flavor '8B' is not one of ['debug', 'small'] "
                                                "(--model hf_llama)"),
    (["--model", "hf_llama", "--tp", "2"], "tensor_parallel_degree=2: hf_llama has no "
                                           "tensor-parallel styles"),
    (["--tp", "2", "--variants", "ddp"], "--variants ['ddp'] have no tensor-parallel form"),
    (["--tp", "2", "--variants", "ss_step_aot_eager_blockbucketing"],
     "--variants ['ss_step_aot_eager_blockbucketing'] have no tensor-parallel form"),
    (["--tp", "2", "--world-size", "6"], "--global-batch 8 is not divisible by the "
                                         "data-parallel degree 3"),
    (["--tp", "2", "--world-size", "3"], "--tp 2 does not divide --world-size 3"),
    (["--tp", "3", "--flavor", "debug"], "tensor_parallel_degree=3 does not divide n_heads=16"),
    (["--tp", "2", "--seq-len", "33"], "--tp 2 does not divide --seq-len 33"),
    (["--tp", "0"], "argument --tp: 0 is not a positive integer"),
    (["--device", "nodevice"], "--device nodevice: this machine's accelerator is "),
    (["--cp", "2", "--variants", "fsdp2_eager"], "--variants ['fsdp2_eager'] have no "
                                                 "context-parallel form here"),
    (["--cp", "2", "--tp", "2", "--world-size", "6"], "--cp 2 × --tp 2 does not divide "
                                                      "--world-size 6"),
    (["--cp", "4", "--seq-len", "36"], "--seq-len 36 does not split into 2 × --cp 4 equal "
                                       "chunks"),
    (["--cp", "2", "--model", "gpt"], "--cp 2: this model's attention does not run under "
                                      "context parallelism"),
    (["--variants", "ss_aot_eager_blockbucketing+qw_int4"],
     "--variants ['ss_aot_eager_blockbucketing+qw_int4']: variant "
     "'ss_aot_eager_blockbucketing+qw_int4': +qw_int4 is not one of ['+qw_int8', '+qw_fp8', "
     "'+qg_int8', '+qg_bf16']"),
    (["--variants", "ddp+qw_int8"], "--variants ['ddp+qw_int8']: 'ddp+qw_int8': quantization "
                                    "suffixes take one of our compiled variants"),
    (["--variants", "ss_ragged_eager+qg_int8"], "--variants ['ss_ragged_eager+qg_int8']: "
                                                "'ss_ragged_eager+qg_int8': quantization "
                                                "suffixes take one of our compiled variants"),
    (["--variants", "ss_aot_eager+qw_int8+qw_fp8"],
     "--variants ['ss_aot_eager+qw_int8+qw_fp8']: variant 'ss_aot_eager+qw_int8+qw_fp8': two "
     "quantize_gathers suffixes"),
])
def test_bad_tp_flags_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert f"error: {message}" in capsys.readouterr().err.strip().splitlines()[-1]


def test_hf_llama_without_transformers_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as when it is not installed
    with pytest.raises(SystemExit):
        bench.main(["--model", "hf_llama"])
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: model hf_llama needs transformers: pip install 'simplesharded[hf]' "
        "(--model hf_llama --flavor small --tp 1)")


@pytest.mark.slow
def test_tiny_hf_llama_bench_runs_end_to_end(tmp_path, capsys):
    """A model we did not write (transformers' LlamaForCausalLM) under FSDP2 and our compiled
    frontend, on the floor's first-step loss (main() returns 1 when the losses disagree)."""
    out = tmp_path / "r.json"
    variants = ["compute_floor", "ss_aot_eager_blockbucketing", "fsdp2_eager"]
    assert bench.main(["--model", "hf_llama", "--flavor", "debug", "--n-layers", "2",
                       "--seq-len", "32", "--warmup", "1", "--steps", "2", "--reps", "1",
                       "--no-predict-memory", *FORKED, "--json", str(out),
                       "--variants", *variants]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == variants and not any("error" in r for r in rows.values()), rows
    # two blocks (model.layers.0/1): forward gathers embeddings + 2 blocks + head (4),
    # backward re-gathers block 0 (the last block and the head stay gathered), 4 reductions
    assert rows["ss_aot_eager_blockbucketing"]["collectives_per_step"] == 4 + 1 + 4
    # FSDP2 wraps what find_blocks found: root + 2 blocks gather in forward (3), the blocks
    # re-gather in backward (2; the root stays gathered), 3 reduce-scatters
    assert rows["fsdp2_eager"]["collectives_per_step"] == 3 + 2 + 3
    printed = capsys.readouterr().out
    assert "hf_llama/debug (2 layers), 2 ranks" in printed
    assert ("parity (rtol 0.0001): step 1: 3 runs agree with compute_floor" in printed
            and "step 2 (no floors): 2 runs agree" in printed)
    for name in variants:
        assert f"| {name} |" in printed


@pytest.mark.slow
def test_tiny_tp_bench_runs_end_to_end(tmp_path, capsys):
    """dp 2 × tp 2 (4 ranks), one block: FSDP2 + torch TP, ours and the tp floor side by side,
    on the same first-step loss (main() returns 1 when the losses disagree)."""
    out = tmp_path / "r.json"
    variants = ["compute_floor", "fsdp2_eager", "ss_aot_eager_autobucketing"]
    # the planner's prediction is test_tiny_bench_runs_end_to_end's (test_plan_tp.py plans TP)
    assert bench.main(["--tp", "2", "--flavor", "debug", "--n-layers", "1", "--seq-len", "16",
                       "--warmup", "1", "--steps", "1", "--reps", "1", "--no-predict-memory",
                       *FORKED, "--json", str(out), "--variants", *variants]) == 0
    report = json.loads(out.read_text())
    assert (report["args"]["world_size"], report["args"]["tp"]) == (4, 2)
    rows = {r["variant"]: r for r in report["rows"]}
    assert list(rows) == variants
    for name, row in rows.items():
        assert "error" not in row, row
        for ref in ("fsdp2_eager", "compute_floor"):
            assert 0 < row[f"x_{ref}"] < float("inf"), (name, ref, row)
    for step in range(2):  # the floor trains on one dp rank's batch: step 1 only
        losses = [run[step] for name, row in rows.items() for run in row["losses"]
                  if step == 0 or name != "compute_floor"]
        assert max(losses) - min(losses) <= 1e-4 * abs(losses[0]), (step, rows)
    # the floor is a tp group: TP's own collectives, none of dp's
    assert 0 < rows["compute_floor"]["collectives_per_step"]
    printed = capsys.readouterr().out
    assert "4 ranks = dp 2 × tp 2" in printed
    assert "parity (rtol 0.0001): step 1: 3 runs agree" in printed
    for name in variants:
        assert f"| {name} |" in printed


@pytest.mark.slow
def test_bench_collectives_forms_agree(capfd):
    # the worker raises if all-to-all + adds or the in-place all-reduce differ from gloo's RS,
    # or the coalesced gather or the gather into a given buffer from the flat one, or the
    # ragged gather's views from the bucket they were cut from
    assert bench_collectives.main(["--reps", "2"]) == 0
    out = capfd.readouterr().out  # printed by the spawned rank 0
    for form in ("reduce_scatter", "all_to_all_add", "all_reduce_inplace", "all_gather_flat",
                 "all_gather_out", "all_gather_coalesced", "all_gather_ragged"):
        assert f"| {form} |" in out
    assert "all_gather_out / all_gather_flat CPU:" in out
    assert "all_gather_coalesced / all_gather_flat CPU:" in out
    assert "all_gather_ragged / all_gather_flat CPU:" in out


def test_bench_passes_times_every_pass_of_both_backends(capsys):
    from pathlib import Path

    config = Path(__file__).resolve().parent.parent / "configs" / "llama3_debug.toml"
    assert bench_passes.main(["--config", str(config), "--world-size", "2", "--n-layers", "2",
                              "--hardware", "local"]) == 0
    out = capsys.readouterr().out
    for name in bench_passes.BACKENDS:
        for kind in ("fw", "bw"):
            assert re.search(rf"\| {name} \| {kind} \|( [0-9.]+ \|){{5}}", out), out
        assert re.search(rf"{name}: our passes [0-9.]+ s of a [0-9.]+ CPU s compile", out), out


def test_one_rank_per_accelerator(monkeypatch, capsys):
    """On an accelerator the bench starts one rank per device by default and refuses more
    ranks than devices (two NCCL ranks cannot share a GPU); the device calls are mocked."""
    class _Cuda:
        type = "cuda"

    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: _Cuda())
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    with pytest.raises(SystemExit):
        bench.main(["--device", "cuda", "--world-size", "2", "--variants", "ddp"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--world-size 2" in err and "1 cuda device(s)" in err, err
    ran = []
    monkeypatch.setattr(bench, "run_variant", lambda v, args: ran.append(args.world_size)
                        or bench_run.RunResult(v, error="stopped by the test"))
    bench.main(["--device", "cuda", "--variants", "ddp", "--reps", "1",
                "--global-batch", "2", "--no-predict-memory"])
    assert ran == [1]


@pytest.mark.slow
@needs_torch(CONTEXT_PARALLEL)
def test_tiny_cp_bench_runs_end_to_end(tmp_path, capsys):
    """cp 2 on 2 ranks (dp 1), one block: the floor is the cp group itself, whose only
    collectives are the K/V gather forward and its reduce-scatter backward; ours adds the
    parameters' over dp_shard x cp; both on the same first-step loss."""
    out = tmp_path / "r.json"
    variants = ["compute_floor", "ss_aot_eager_blockbucketing"]
    assert bench.main(["--cp", "2", "--world-size", "2", "--flavor", "debug", "--n-layers", "1",
                       "--seq-len", "32", "--warmup", "1", "--steps", "1", "--reps", "1",
                       "--no-predict-memory", *FORKED, "--json", str(out),
                       "--variants", *variants]) == 0
    report = json.loads(out.read_text())
    assert (report["args"]["world_size"], report["args"]["cp"]) == (2, 2)
    rows = {r["variant"]: r for r in report["rows"]}
    assert not any("error" in r for r in rows.values()), rows
    assert rows["compute_floor"]["collectives_per_step"] == 2  # one block: gather + its grad
    assert rows["ss_aot_eager_blockbucketing"]["collectives_per_step"] > 2
    for row in rows.values():
        assert 0 < row["step_mem_mb"] <= row["peak_mem_mb"], row
    printed = capsys.readouterr().out
    assert "2 ranks = dp 1 × cp 2" in printed
    assert "parity (rtol 0.0001): step 1: 2 runs agree" in printed
