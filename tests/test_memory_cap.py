"""One memory cap (docs/memory_cap.md): ``memory_cap_bytes`` bounds every gathered byte alive in
the compiled graphs (gathered buffers, their copy-outs, parameters kept gathered for backward),
measured here by a liveness sweep over the graphs (memory.gathered_timeline), independent of
the accounting reordering does while it plans."""
from __future__ import annotations

import pytest
import torch

import pass_utils as pu
from simplesharded.passes.annotations import gathered_param
from simplesharded.passes.memory import gathered_timeline
from simplesharded.passes.plans import BlockPlan
from simplesharded.passes.reordering import reorder_for_overlap

DEBUG_CONFIG = "configs/llama3_debug.toml"


@pytest.mark.parametrize("storage", ["param", "ragged"])
@pytest.mark.parametrize("backend,blocks", [("aot_eager_blockbucketing", 4),
                                            ("aot_eager_blockbucketing", 2.5),
                                            ("aot_eager_autobucketing", 6)])
def test_gathered_bytes_stay_within_the_cap_with_kept_blocks(backend, blocks, storage):
    """llama3 debug (4 blocks, 2 fake ranks), cap = 4 blocks' bytes (auto: 6, its keep budget
    being a quarter of the cap): the plan keeps the last block and the head gathered for
    backward, prefetch happens, and the gathered bytes alive in the forward and backward
    graphs never exceed the cap. Without counting the kept parameters and copy-outs,
    reordering reached 1.25x this cap here. At 2.5 blocks' bytes the block plan's "last block
    and what follows" no longer fits beside one block copied out (2 blocks): only the head
    is kept. One shard per parameter: buckets copy out. Ragged buckets (the trainer's
    default): nothing is copied out, and a bucket is named by its first member (the last
    block's by its attention norm, the head's by the final norm)."""
    from simplesharded.tools import cluster_trace as dry_run
    from simplesharded.trainer.config import load_config
    from simplesharded.models import build_model

    sizes = {n: p.numel() * 4 for n, p in
             build_model("llama3", "debug", device="meta", n_layers=4).named_parameters()}
    block = sum(v for k, v in sizes.items() if k.startswith("layers.3."))
    cap = int(blocks * block)
    keep = cap // 4 if "auto" in backend else None  # the plan's own budget (AutoPlan: 1/4)
    cfg = load_config(DEBUG_CONFIG, ["--parallelism.storage", storage])
    with dry_run.fake_world(2):
        traced = dry_run.trace(cfg, 2, n_layers=4, keep_gathered_bytes=keep,
                               memory_cap_bytes=cap)
        fw, bw = dry_run.apply_backend_passes(traced, backend, "h100-ib400", cap)
    kept = [n for n in bw.graph.nodes if n.op == "placeholder" and gathered_param(n)]
    kept = {gathered_param(n) for n in kept}
    head, last = (("output.weight", "layers.3.attention.wq.weight") if storage == "param"
                  else ("norm.weight", "layers.3.attention_norm.weight"))
    assert head in kept, kept
    assert (last in kept) == (blocks != 2.5), kept
    copy_outs = [n for n in fw.graph.nodes
                 if n.target is torch.ops.aten.clone.default and gathered_param(n)]
    assert bool(copy_outs) == (storage == "param"), copy_outs
    assert pu.prefetch_depth(fw) >= 1
    if blocks != 2.5:  # there the backward's floor (a block copied out) leaves no room
        assert pu.prefetch_depth(bw) >= 1
    for which, gm in (("fw", fw), ("bw", bw)):
        peak = max(gathered_timeline(gm))
        # the cap is used: at least half of it (ragged auto's forward: exactly half)
        assert cap // 2 <= peak <= cap, (which, peak, cap)


def test_saved_gathered_weights_count_until_the_graph_ends():
    """A forward that saves every gathered weight for backward: each stays alive to the end,
    so all four are alive there whatever the order (the floor). A cap below the floor leaves
    no room to prefetch (counting them only to their last matmul, as reordering once did, a
    cap of two weights allowed prefetch); a cap at the floor does: issuing earlier never
    raises the total above what the end holds."""
    gm = pu.chain_graph(4, save_gathered=True)
    one = pu._nbytes(pu.starts(gm, pu.AG)[0])
    for cap, depths in ((3 * one, [0, 0, 0, 0]), (4 * one, [0, 1, 2, 2])):
        out = reorder_for_overlap(pu.fresh(gm), BlockPlan(memory_cap_bytes=cap))
        pu.check_waits_before_use(out)
        assert max(gathered_timeline(out)) == 4 * one
        assert [d for _, d in pu.prefetch_depths(out)] == depths, cap


def _with_offload_copies(gm):
    """``gm`` with each gather reading a copy of its shard on the compute device, as host
    offload's graphs do (simplesharded/storage/offload.py): ``to_compute`` and the wait that
    makes it ready, annotated ``ss_offload``, between the shard and the all-gather."""
    import simplesharded.storage.offload  # noqa: F401  (registers simplesharded::to_compute)

    copy_op = torch.ops.simplesharded.to_compute.default
    for start in pu.starts(gm, pu.AG):
        shard = start.args[0]
        with gm.graph.inserting_before(start):
            copy = gm.graph.call_function(copy_op, (shard, torch.device("cpu")))
            ready = gm.graph.call_function(pu.WAIT, (copy,))
        for node in (copy, ready):
            node.meta["val"] = shard.meta["val"]  # same shape, dtype and fake mode
            node.meta["custom"] = {**start.meta["custom"], "ss_offload": "to_compute"}
        start.replace_input_with(shard, ready)
    gm.recompile()
    return gm


def test_offload_copies_count_against_the_cap():
    """Host offload's copies of the shards (what a gather reads, on the compute device) are
    gathered bytes too: on 2 ranks a float32 copy is half its gathered buffer. A cap of two
    gathered buffers fits one prefetch without copies, none with them; a cap of two gathers
    and their copies fits one again, and the sweep sees every copy byte within it."""
    gm = pu.chain_graph(4)
    one = pu._nbytes(pu.starts(gm, pu.AG)[0])
    offloaded = _with_offload_copies(pu.fresh(gm))
    shard = one // 2
    assert max(gathered_timeline(offloaded)) == one + shard  # one at a time, unordered
    plain = reorder_for_overlap(pu.fresh(gm), BlockPlan(memory_cap_bytes=2 * one))
    assert [d for _, d in pu.prefetch_depths(plain)] == [0, 1, 1, 1]
    for cap, depths in ((2 * one, [0, 0, 0, 0]), (2 * (one + shard), [0, 1, 1, 1])):
        out = reorder_for_overlap(pu.fresh(offloaded), BlockPlan(memory_cap_bytes=cap))
        pu.check_waits_before_use(out)
        assert [d for _, d in pu.prefetch_depths(out)] == depths, cap
        assert max(gathered_timeline(out)) <= cap
        # each copy waited right before the start that reads it (offload_copies.py issues the
        # copies earlier only where the cap leaves room: tests/test_offload_copies.py)
        for start in pu.starts(out, pu.AG):
            assert start.prev.target is pu.WAIT and start.prev.args[0].target is \
                torch.ops.simplesharded.to_compute.default
