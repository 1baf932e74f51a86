"""The public surface: backend registry errors, the report CLI's counts, and the README's
"use the passes in your own backend" example, on real traced graphs (fake process group)."""
import pytest
import torch

import simplesharded as ss
from simplesharded.tools.cluster_trace import fake_world
from simplesharded.passes.torch_compat import EXPERT_PARALLEL
from simplesharded.tools.report import main as report_main, trace_counts
from torch_range import needs_torch


def test_unknown_backend_lists_choices():
    with pytest.raises(ValueError, match=r"compile.backend='nope' is not one of \[.*"
                                         r"'aot_eager_autobucketing'.*'inductor_blockbucketing'"):
        ss.make_backend("nope")


def test_unknown_backend_option_is_an_error():
    with pytest.raises(ValueError, match="bucket_cap"):
        ss.make_backend("aot_eager_blockbucketing", bucket_cap=3)


def test_every_design_backend_name_is_registered():
    expected = {"eager", "aot_eager", "inductor"} | {
        f"{c}_{k}bucketing" for c in ("aot_eager", "inductor") for k in ("auto", "block", "upstream")}
    assert expected <= set(ss.BACKENDS)


def test_torch_backend_names_pass_through():
    assert ss.make_backend("aot_eager_decomp_partition") == "aot_eager_decomp_partition"


def test_block_bucketing_counts_on_llama3_debug(fake_pg):
    n_blocks = 4
    plain = trace_counts("llama3", "debug", "aot_eager", n_layers=n_blocks,
                         reshard_after_forward=True)
    block = trace_counts("llama3", "debug", "aot_eager_blockbucketing", n_layers=n_blocks,
                         reshard_after_forward=True)
    n_params = 2 + 9 * n_blocks + 1  # tok_embeddings, norm, output; 9 per block
    assert plain["fw"]["after"]["all_gather"] == n_params
    assert plain["bw"]["after"]["reduce_scatter"] == n_params
    # one bucket per block + embeddings (pre) + final norm/output (post)
    assert block["fw"]["after"]["all_gather"] == n_blocks + 2
    assert block["bw"]["after"]["reduce_scatter"] == n_blocks + 2
    # re-gathers in backward: every bucket except the embedding (its weight is not needed
    # to compute any gradient)
    assert block["bw"]["after"]["all_gather"] == n_blocks + 1
    assert block["fw"]["before"] == plain["fw"]["after"]


def test_auto_reshard_keeps_the_last_block_and_head(fake_pg):
    """reshard_after_forward="auto" (the default): plain and block backends keep the last
    block and norm/output gathered (backward needs them first); the autobucketing plan keeps
    every block whose bytes fit its budget (all of a debug model)."""
    n_blocks = 4
    plain = trace_counts("llama3", "debug", "aot_eager", n_layers=n_blocks)
    block = trace_counts("llama3", "debug", "aot_eager_blockbucketing", n_layers=n_blocks)
    auto = trace_counts("llama3", "debug", "aot_eager_autobucketing", n_layers=n_blocks)
    # re-gathered: the blocks but the last; never the embedding; not norm/output
    assert plain["bw"]["after"]["all_gather"] == 9 * (n_blocks - 1)
    assert block["bw"]["after"]["all_gather"] == n_blocks - 1
    assert auto["bw"]["after"]["all_gather"] == 0
    small = trace_counts("llama3", "debug", "aot_eager_autobucketing", n_layers=n_blocks,
                         memory_cap_bytes=1)  # budget 0: nothing kept, as reshard=True
    assert small["bw"]["after"]["all_gather"] >= 1
    assert small["bw"]["before"]["all_gather"] == 9 * n_blocks + 2


def test_auto_reshard_budget_keeps_trailing_blocks_that_fit(fake_pg):
    """A budget of exactly norm + output + the last block keeps those (backward runs them
    first) and re-gathers the other blocks; one byte less keeps only norm + output. The
    autobucketing plan's budget is a quarter of its cap (docs/memory_cap.md)."""
    from simplesharded.models import build_model

    n_blocks = 4
    sizes = {n: p.numel() * 4 for n, p in
             build_model("llama3", "debug", device="meta", n_layers=n_blocks).named_parameters()}
    head = sizes["norm.weight"] + sizes["output.weight"]
    last = sum(v for k, v in sizes.items() if k.startswith(f"layers.{n_blocks - 1}."))
    for budget, regathered in ((head + last, 9 * (n_blocks - 1)), (head + last - 1, 9 * n_blocks)):
        torch._dynamo.reset()
        counts = trace_counts("llama3", "debug", "aot_eager_autobucketing", n_layers=n_blocks,
                              memory_cap_bytes=4 * budget)
        assert counts["bw"]["before"]["all_gather"] == regathered, (budget, counts)


def test_reshard_after_forward_rejects_bad_values(fake_pg):
    with pytest.raises(ValueError, match=r"reshard_after_forward='sometimes' is not one of "
                                         r"\[True, False, 'auto'\]"):
        ss.data_parallel(torch.nn.Linear(2, 2), ss.build_mesh(1, -1, "cpu"),
                         reshard_after_forward="sometimes", storage="param")


def test_the_root_has_fsdp2s_gradient_sync_method(fake_pg):
    """``model.set_requires_gradient_sync(flag)`` as on an FSDP2 root (through a compiled
    wrapper too): the same setting as ``ss.set_requires_gradient_sync``; ``recurse=False``
    (per module in FSDP2) is one line (tests/test_grad_sync.py trains with it)."""
    from simplesharded.storage.sharded_state import root_state

    model = ss.data_parallel(torch.nn.Linear(4, 4), ss.build_mesh(1, -1, "cpu"))
    sync = root_state(model)[1].grad_sync
    compiled = torch.compile(model)
    for target, flag in ((model, False), (model, True), (compiled, False), (compiled, True)):
        target.set_requires_gradient_sync(flag)
        assert sync.sync is flag
    with pytest.raises(ValueError, match=r"^set_requires_gradient_sync\(recurse=False\): "
                                         r"gradient sync is one setting .*; use recurse=True$"):
        model.set_requires_gradient_sync(False, recurse=False)


def test_no_regather_without_reshard(fake_pg):
    counts = trace_counts("llama3", "debug", "aot_eager_blockbucketing",
                          reshard_after_forward=False, n_layers=2)
    assert counts["bw"]["after"]["all_gather"] == 0


def test_report_cli_prints_before_and_after(capsys):
    assert report_main(["--backends", "aot_eager_blockbucketing", "--n-layers", "2",
                        "--reshard", "always"]) == 0
    out = capsys.readouterr().out
    # 2 + 9*2 + 1 = 21 parameters → 2 blocks + pre + post
    assert "aot_eager_blockbucketing" in out and "21→4" in out


@needs_torch(EXPERT_PARALLEL)
def test_report_cli_shows_expert_parallel_all_to_alls(capsys):
    """--ep 2 on 4 ranks (efsdp 2 x ep 2): the MoE layer's all-to-alls on the ep group, 3 in
    forward (counts, tokens out, results back) and the 2 token exchanges' gradients in
    backward, never bucketed; the expert weights' gathers on efsdp, one bucket; a model
    without experts is refused in one line."""
    assert report_main(["--model", "deepseek_v3", "--world-size", "4", "--ep", "2",
                        "--n-layers", "2", "--backends", "aot_eager_blockbucketing"]) == 0
    rows = {line.split()[1]: line.split()[2:] for line in capsys.readouterr().out.splitlines()
            if line.startswith("aot_eager_blockbucketing")}
    assert set(rows) == {"dp_shard", "efsdp", "ep"}
    # columns: fw AG RS AR A2A, bw AG RS AR A2A, total
    assert rows["ep"] == ["0→0"] * 3 + ["3→3"] + ["0→0"] * 3 + ["2→2", "5→5"]
    assert rows["efsdp"][0] == "3→1" and rows["efsdp"][3] == rows["dp_shard"][3] == "0→0"
    assert report_main(["--ep", "2", "--n-layers", "2"]) == 2
    assert capsys.readouterr().out.strip() == (
        "error: --ep 2 needs a model with routed experts (deepseek_v3), not llama3")


def test_readme_custom_backend_example(fake_pg):
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    from simplesharded.models import build_model
    from simplesharded.passes import (BlockPlan, bucket_collectives, count_collectives,
                                      pad_replica_all_reduces, reorder_for_overlap,
                                      tag_gathers_for_recompute)

    seen = []
    plan = BlockPlan(memory_cap_bytes=None)

    def compiler(gm, example_inputs):
        gm = pad_replica_all_reduces(gm)
        gm = reorder_for_overlap(bucket_collectives(gm, plan), plan)
        seen.append(count_collectives(gm))
        return make_boxed_func(gm.forward)

    def partition(joint, inputs, **kw):
        joint = tag_gathers_for_recompute(joint, plan)
        return min_cut_rematerialization_partition(joint, inputs, **kw)

    my_backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler, partition_fn=partition)
    mesh = ss.build_mesh(1, -1, "cpu")
    model = build_model("llama3", "debug", device="meta", n_layers=2)
    ss.data_parallel(model, mesh, "fully_shard", storage="param")
    with ss.disable_gather(model):
        model.init_weights(buffer_device=torch.device("cpu"))
    compiled = torch.compile(model, backend=my_backend, fullgraph=True)
    compiled(torch.randint(0, 256, (1, 16))).sum().backward()
    fw, bw = seen
    assert fw["all_gather"] == 2 + 2 and bw["reduce_scatter"] == 2 + 2


def test_hybrid_block_bucketing_merges_all_reduces():
    """HSDP: the per-bucket reduce-scatters and replica all-reduces are both merged."""
    with fake_world(4):
        try:
            counts = trace_counts("llama3", "debug", "aot_eager_blockbucketing", world_size=4,
                                  mode="hybrid_shard", n_layers=2)
        finally:
            torch._dynamo.reset()
    assert counts["bw"]["before"]["all_reduce"] == 2 + 9 * 2 + 1
    assert counts["bw"]["after"]["all_reduce"] == 2 + 2
    assert counts["bw"]["after"]["reduce_scatter"] == 2 + 2
