"""Ranks agree on every compiled graph's collective sequence (passes/agreement.py).

* Unit: the fingerprint describes a hand-built graph's collectives in order, the check node
  goes first, a graph without collectives is untouched, and ``first_difference`` names each
  rank's first differing collective.
* Uneven shards (7-row parameters) + bf16 mixed precision + autobucketing, on 2 and 4 ranks:
  every rank compiles the same sequence (the check passes and the fingerprints are equal).
* Then 2 gloo ranks configured to bucket differently (different ``bucket_patterns``): every
  rank ends within seconds with one error naming both ranks' first differing collective,
  before any collective ran (without the check, rank 0 died of SIGABRT in gloo).
* Every other multi-rank compiled test runs the check too (it is the pipeline's last stage).
"""
from __future__ import annotations

import json
import time

import pytest
import torch

import toy_blocks
from dist_utils import RankError, spawn
from pass_utils import chain_graph

from simplesharded.passes.agreement import (first_difference, fingerprint,
                                            insert_agreement_check)

AGREE_OP = torch.ops.simplesharded.agree.default


def test_fingerprint_and_check_node_on_a_hand_built_graph():
    gm = chain_graph(3)
    lines = fingerprint(gm.graph)
    assert len(lines) == sum(n.target in (torch.ops._c10d_functional.all_gather_into_tensor.default,)
                             for n in gm.graph.nodes) == 3
    assert all(line.startswith("all_gather_into_tensor(") for _, line, _ in lines)
    assert all(skel == lines[0][0] for skel, _, _ in lines)
    insert_agreement_check(gm)
    insert_agreement_check(gm)  # idempotent: one check, first after the placeholders
    checks = [n for n in gm.graph.nodes if n.target is AGREE_OP]
    assert len(checks) == 1
    non_placeholders = [n for n in gm.graph.nodes if n.op != "placeholder"]
    assert non_placeholders[0] is checks[0]
    assert json.loads(checks[0].args[0]) == lines


def test_graph_without_collectives_is_untouched():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.ops.aten.relu.default, (x,)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    before = str(gm.graph)
    insert_agreement_check(gm)
    assert str(gm.graph) == before


def _entry(op, shape, ranks, dim="dp_shard"):
    return [f"{op}(torch.float32, group={dim})",
            f"{op}(torch.float32{shape}, 2, group={dim})", list(ranks)]


def test_first_difference_names_each_rank():
    a = [_entry("all_gather_into_tensor", [8], (0, 1, 2))] * 3
    b = a[:1] + [_entry("all_reduce", [8], (0, 1, 2))] + a[2:]
    assert first_difference([a, a, a]) is None
    msg = first_difference([a, b, a[:2]])
    assert "collective #1: rank 0 all_gather_into_tensor(torch.float32[8]" in msg
    assert "rank 1 all_reduce(torch.float32[8]" in msg
    assert "collective #2: rank 0" in msg and "rank 2 <end of graph>" in msg


def test_groups_of_one_mesh_dim_may_move_different_sizes():
    """Uneven shards all-reduced over dp_replicate: ranks 0, 2 (shard 0) move 2 elements,
    ranks 1, 3 (shard 1) move 1. Only members of one group must match."""
    seqs = [[_entry("all_reduce", [2 - r % 2], (r % 2, r % 2 + 2), "dp_replicate")]
            for r in range(4)]
    assert first_difference(seqs) is None
    seqs[2] = [_entry("all_reduce", [1], (0, 2), "dp_replicate")]
    msg = first_difference(seqs)
    assert msg and "collective #0: rank 0 all_reduce(torch.float32[2]" in msg
    assert "rank 2 all_reduce(torch.float32[1]" in msg


def _compile_step(rank, world, backend, mp=False, arrived=None, **options):
    """One forward+backward of ToyBlocks compiled with ``backend``; returns the fingerprints
    the checks compared, in order. ``arrived``: a list that gets the time this rank reached
    each check."""
    import simplesharded as ss
    from simplesharded.mesh import build_mesh
    from simplesharded.passes import agreement

    mesh = build_mesh(dp_replicate=1, dp_shard=world, device="cpu")
    policy = ss.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                     reduce_dtype=torch.float32) if mp else None
    torch._dynamo.reset()
    model = ss.data_parallel(toy_blocks.make_model(), mesh, "fully_shard", mp_policy=policy, storage="param")
    compiled = torch.compile(model, fullgraph=True, backend=ss.make_backend(backend, **options))
    seen, arrived = [], arrived if arrived is not None else []
    compare = agreement.compare

    def recording(fp, seq, timeout_s=None):
        seen.append(fp)
        arrived.append(time.time())  # wall clock: the ranks share this machine's
        return compare(fp, seq, timeout_s)

    agreement.compare = recording
    try:
        tokens, targets = toy_blocks.batch(rank, 0)
        out = compiled(tokens)
        toy_blocks.loss_fn(out, targets, targets.numel()).backward()
    finally:
        agreement.compare = compare
    return seen


def _agree_then_mismatch_job(rank, world):
    """First one plan (must agree), then plans that differ per rank (must fail fast)."""
    same = _compile_step(rank, world, "aot_eager_autobucketing", mp=True)
    # the match names the bucket: one bucket per block on rank 0, all blocks in one on rank 1
    patterns = ("layers\\.[0-9]+",) if rank == 0 else ("layers",)
    arrived: list[float] = []
    try:
        _compile_step(rank, world, "aot_eager_blockbucketing", arrived=arrived,
                      bucket_patterns=patterns)
    except RuntimeError as e:
        return same, str(e), arrived[0], time.time()
    return same, None, arrived[0] if arrived else None, time.time()


def _check_one_plan(fingerprints: list[list[str]]) -> None:
    assert len(fingerprints[0]) == 2  # forward and backward each checked once
    assert all(fp == fingerprints[0] for fp in fingerprints)
    assert all(json.loads(fp) for fp in fingerprints[0])


def test_two_ranks_agree_on_uneven_bf16_and_fail_fast_on_different_plans():
    # gloo timeout well above any compile-time skew between the ranks on a loaded machine:
    # what is measured is the time from the last rank reaching the check to the error
    results = spawn(2, _agree_then_mismatch_job, timeout_s=300)
    _check_one_plan([r[0] for r in results])
    last_arrival = max(r[2] for r in results)
    for _, msg, _, raised in results:
        assert msg is not None, "the mismatch was not detected"
        assert "ranks compiled different collective sequences" in msg
        assert "collective #" in msg and "rank 0 " in msg and "rank 1 " in msg
        assert raised - last_arrival < 60  # seconds once every rank is there: no hang
    assert results[0][1] == results[1][1]  # both ranks say the same thing


def _uneven_bf16_auto_job(rank, world):
    return _compile_step(rank, world, "aot_eager_autobucketing", mp=True)


def test_four_ranks_uneven_bf16_autobucketing_compile_one_plan():
    _check_one_plan(spawn(4, _uneven_bf16_auto_job, timeout_s=300))
