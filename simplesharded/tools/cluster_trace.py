"""Trace a config's training step at cluster scale on this CPU, and run backends' passes on it.

``fake_world(n)`` stands up a fake process group of n ranks (torch's "fake" backend: no
communication, this process is rank 0). ``trace`` builds the model on the meta device,
parallelizes it as the trainer does (trainer/recipe.py parallelize: tensor parallelism, activation
checkpointing, data_parallel) and captures rank 0's forward and backward graphs after
partitioning; the shards of the meta model are never written, so they take no memory.
``apply_backend_passes`` runs a backend's graph passes on copies of those graphs, and
``memory_report`` gives the per-rank static state and their peak, with backward's reduced
gradients counted once or, for an accumulating step, twice (host offload, which the trace
leaves out, is added by forecast.device_memory: offload_cost.py). ``python -m
simplesharded.tools.forecast`` reports on them; tests use them directly.
"""
from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@contextlib.contextmanager
def fake_world(world_size: int):
    """A fake process group of ``world_size`` ranks, this process being rank 0, for
    :func:`trace` and everything after it: the traced graphs name its groups, and the cost
    model resolves their ranks (which link a group uses) and mesh dims while it is alive, as
    the passes do in a real job at compile time."""
    # torch registers its "fake" backend (no communication) itself; no store needed.
    dist.init_process_group("fake", rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass
class Traced:
    fw: torch.fx.GraphModule
    bw: torch.fx.GraphModule
    # CPU seconds of this process (the machine may be shared) of the compile up to our graph
    # passes (dynamo, aot_autograd, partitioning), and of our joint-graph pass within it
    trace_s: float
    recompute_s: float
    local_numel: int  # elements of rank 0's parameter shards (over dp and tp)
    group_labels: dict  # {process-group name: mesh dim} of the traced mesh


def trace(cfg, local_batch: int, n_layers: int | None = None,
          keep_gathered_bytes: int | None = None, memory_cap_bytes: int | None = None) -> Traced:
    """fw/bw graphs (after reshard-after-forward tagging and partitioning, before bucketing)
    of rank 0 of a mesh with ``cfg``'s degrees (tp included) over the ranks of the current
    process group (run it inside :func:`fake_world`); ``local_batch`` sequences per
    data-parallel rank. ``n_layers`` builds the model with that many blocks instead of the
    flavor's; ``keep_gathered_bytes`` and ``memory_cap_bytes``: the plan's, which decide what
    reshard_after_forward="auto" keeps (passes/recompute.py)."""
    from simplesharded.mesh import build_mesh, group_labels
    from simplesharded.trainer import loss_chunks, parallelize, uses_loss_parallel

    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch.distributed.tensor.parallel import loss_parallel

    from simplesharded.backends import BackendOptions, pass_pipeline
    from simplesharded.passes.plans import BlockPlan

    cfg = copy.deepcopy(cfg)
    cfg.compile.enable = True  # the compiled step is what the passes plan
    # Host offload is modelled from the graphs without it (offload_cost.py): an offloaded
    # bucket's host shard is a real host tensor, even of a meta model
    cfg.parallelism.offload = "none"
    p, t = cfg.parallelism, cfg.training
    graphs: dict[str, torch.fx.GraphModule] = {}
    recompute_s = 0.0

    class _Captured(Exception):
        pass

    # Every backend's joint pass (recompute tagging), reading this plan's cap and keep budget.
    plan = BlockPlan(memory_cap_bytes=memory_cap_bytes, keep_gathered_bytes=keep_gathered_bytes)
    joint_passes = pass_pipeline("aot_eager", BackendOptions(plan=plan))

    def partition(joint, inputs, **kwargs):
        nonlocal recompute_s
        t = time.process_time()
        joint = joint_passes.run_joint(joint)
        recompute_s = time.process_time() - t
        # Only the graphs are wanted: stop right after partitioning (nothing runs on fakes).
        graphs["fw"], graphs["bw"] = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        raise _Captured

    capture = aot_autograd(fw_compiler=lambda gm, _: gm, partition_fn=partition)
    if not dist.is_initialized():
        raise RuntimeError("trace needs a process group: call it inside fake_world(n)")
    t0 = time.process_time()
    try:
        mesh = build_mesh(p.data_parallel_replicate_degree, p.data_parallel_shard_degree,
                          "cpu", p.tensor_parallel_degree, p.expert_parallel_degree,
                          p.context_parallel_degree)
        cfg.model.n_layers = n_layers or cfg.model.n_layers  # cfg is this call's copy
        model = cfg.model.build()
        # Not under FakeTensorMode: the mesh slicing in TP and data_parallel runs tensor ops
        # on the rank layout that fake tensors cannot (nonzero). The shards data_parallel
        # makes of a meta model are uninitialised (torch.empty: no page is touched), and
        # nothing runs: capture stops once the graphs are partitioned.
        step = parallelize(model, mesh, cfg, backend=capture)
        local_numel = sum(q.to_local().numel() for q in model.parameters())
        # a cp rank's head-tail chunks of each sequence (models/context_parallel.py)
        local_len = t.seq_len // p.context_parallel_degree
        tokens, labels = torch.randint(0, 256, (2, local_batch, local_len))
        # the trainer's step: the loss in the model's forward, in the loss-parallel context
        context = loss_parallel() if uses_loss_parallel(cfg) else contextlib.nullcontext()
        try:
            with context:
                step(tokens, labels, loss_chunks=loss_chunks(cfg))
        except Exception:
            if "bw" not in graphs:
                raise
    finally:
        torch._dynamo.reset()
    return Traced(graphs["fw"], graphs["bw"], time.process_time() - t0, recompute_s,
                  local_numel, group_labels(mesh))


def apply_backend_passes(traced: Traced, backend: str, hardware: str, cap_bytes: int | None,
                         **quantize):
    """Copies of the traced graphs with ``backend``'s graph passes applied (its pipeline:
    backends.pass_pipeline, under the built-in plan with cap ``cap_bytes``; on a gloo
    ``hardware`` profile its gloo lowerings apply to every group, which on the fake process
    group they would skip); for a backend without graph passes, the traced graphs themselves
    (to read, not to edit). ``quantize``: BackendOptions' quantize_gathers / quantize_grads
    (their passes then send, and the cost model counts, the quantized bytes and the
    (de)quantize ops). The joint pass ran in :func:`trace`; no agreement check is added
    (nothing here runs the graphs)."""
    from simplesharded.backends import BackendOptions, pass_pipeline
    from simplesharded.passes.annotations import has_float8_casts
    from simplesharded.passes.hardware import get_hardware
    from simplesharded.passes.lowering import LOWERED_BACKENDS
    from simplesharded.passes.pipeline import lazily_compiled

    gloo = get_hardware(hardware).transport == "gloo"
    pipeline = pass_pipeline(backend, BackendOptions(hardware=hardware, memory_cap_bytes=cap_bytes,
                                                     **quantize),
                             lower_on=None if gloo else LOWERED_BACKENDS)
    # a Float8Linear's weight cast (training.float8): its gathers are sent in float8 first,
    # as PassPipeline.run_graph does
    float8 = {id(gm): list(pipeline.float8) if has_float8_casts(gm) else []
              for gm in (traced.fw, traced.bw)}
    if not pipeline.graph and not any(float8.values()):
        return traced.fw, traced.bw
    # Copies of the graphs in lazy graph modules (dynamo's own kind): nothing here runs them,
    # so the passes' recompiles generate no code. Attributes stay shared: passes never
    # write them.
    copies = []
    for gm in (traced.fw, traced.bw):
        mine = lazily_compiled(gm, copy.deepcopy(gm.graph))
        for _, graph_pass in [*float8[id(gm)], *pipeline.graph]:
            graph_pass(mine)
        copies.append(mine)
    return tuple(copies)


@dataclass
class MemoryReport:
    params: int
    grads: int
    optimizer: int
    peak_activations: int  # fw/bw transient peak: gathered buffers + activations
    saved: int  # what forward hands to backward (saved_bytes), inside peak_activations
    # the peak when backward's reduced gradients live beside the static ones to its end, as
    # in every micro-batch of an accumulating step but the first (autograd adds them to the
    # shards' .grad once the compiled backward returns)
    peak_activations_accumulating: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.peak_activations


def static_memory(local_numel: int, optimizer: str, offload: str = "none"
                  ) -> tuple[int, int, int]:
    """Per-rank device bytes of (fp32 parameter shards, fp32 gradients, optimizer states) of
    a rank holding ``local_numel`` parameter elements (Traced.local_numel), under host
    ``offload`` (simplesharded/storage/offload.py): ``"optimizer"`` leaves on the device only
    the resident copy of the shard the gathers read, ``"params"`` nothing; the host holds
    the rest (:func:`host_memory`). The one place offload changes the static state."""
    states = {"AdamW": 2, "SGD": 1}.get(optimizer, 2)
    if offload == "params":
        return 0, 0, 0
    if offload == "optimizer":
        return 4 * local_numel, 0, 0
    return 4 * local_numel, 4 * local_numel, states * 4 * local_numel


def host_memory(local_numel: int, optimizer: str, offload: str) -> int:
    """Host bytes per rank of what ``offload`` keeps there: the shards, their gradients and
    the optimizer's state (none without offload)."""
    if offload == "none":
        return 0
    return sum(static_memory(local_numel, optimizer))


def saved_bytes(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> int:
    """Bytes forward hands to backward (backward's placeholders other than primals and
    tangents), each buffer once: the partitioner may save a collective's result and its
    ``wait_tensor`` both (expert parallelism's all-to-alls), or a tensor and a view of it.
    Forward's own inputs are not counted: a parameter shard saved for backward's re-gather
    (a ragged bucket's) is in static_memory already."""
    from simplesharded.passes.collectives import tensor_nbytes
    from simplesharded.passes.memory import distinct_bytes

    # backward's placeholders for saved values carry the names of the forward nodes
    forward = {n.name: n for n in fw.graph.nodes}
    saved = [n for n in bw.graph.nodes if n.op == "placeholder"
             and not n.name.startswith(("primals", "tangents"))]
    return distinct_bytes(fw, [forward[n.name] for n in saved if n.name in forward],
                          include_inputs=False) + \
        sum(tensor_nbytes(n) for n in saved if n.name not in forward)


def without_gradients(bw: torch.fx.GraphModule | torch.fx.Graph) -> torch.fx.Graph:
    """A copy of backward whose outputs, the parameters' gradients, are dropped: each is
    freed after its last use inside the graph. Their bytes are the gradients static_memory
    counts (or, under host offload, copied to the host at their reduction), so a peak of
    this copy counts them once. The copy's nodes keep their metadata (what
    passes/memory.py reads)."""
    graph = bw.graph if isinstance(bw, torch.fx.GraphModule) else bw
    copy_, env = torch.fx.Graph(), {}
    copy_.graph_copy(graph, env)
    copy_.output(None)
    return copy_


def memory_report(traced: Traced, optimizer: str, fw_bw=None) -> MemoryReport:
    """Per-rank device bytes without offload: static state (see static_memory) + the
    transient peak of the graphs: the forward's, or what forward saves for backward
    (saved_bytes) held throughout backward plus backward's own peak; without the gradients it
    outputs (:func:`without_gradients`: one micro-batch per step, whose gradients become the
    shards' ``.grad``, or offload's, which leave at their reduction) and with them (an
    accumulating step). forecast.device_memory picks one and adds offload's device bytes."""
    from simplesharded.passes.memory import peak_memory

    fw, bw = fw_bw or (traced.fw, traced.bw)
    params, grads, opt = static_memory(traced.local_numel, optimizer)
    fw_peak, _ = peak_memory(fw, include_inputs=False)
    saved = saved_bytes(fw, bw)
    bw_peak, _ = peak_memory(without_gradients(bw), include_inputs=False)
    bw_peak_outputs, _ = peak_memory(bw, include_inputs=False)
    return MemoryReport(params, grads, opt, int(max(fw_peak, saved + bw_peak)), int(saved),
                        int(max(fw_peak, saved + bw_peak_outputs)))
