"""What each variant of ``python -m simplesharded.tools.bench`` runs: the variants (our
backends as ``ss_<backend>``, and the baselines: FSDP2 eager and compiled, DDP, the compute
floors), the defaults with and without TP, the setting every variant shares (``BenchArgs``),
the ranks a variant takes and the model and optimizer it builds, TP-parallelized and then
wrapped or compiled its way (``prepare``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

BASELINES = ("fsdp2_eager", "fsdp2_compiled", "ddp", "ddp_inductor", "compute_floor",
             "compute_floor_inductor", "compute_floor_concurrent",
             "compute_floor_concurrent_compiled")
# ddp_inductor: DDP compiled by inductor the way torch documents it, torch.compile over the
# DDP module (dynamo splits the graph at DDP's buckets so each bucket's all-reduce overlaps the
# rest of backward). The yardstick of the inductor variants, as ddp is of the others: what the
# simplest data parallelism with the same kernels costs on the machine.
# compute_floor: one process alone on the machine (the definition); with --tp, one tp
# group alone (tp ranks on one dp rank's batch): compute plus TP's own collectives, no dp.
# compute_floor_concurrent: every rank runs the floor's step at the same time, with no
# data-parallel communication at all: what the ranks' compute (and TP) costs while they share
# cores, caches and memory bandwidth, i.e. the floor any data-parallel variant on this machine
# can reach. With --tp on 2 cores this is the floor that matters: 2×tp ranks share the cores.
# compute_floor_concurrent_compiled: the same under torch's plain aot_eager. The floor of our
# compiled variants under TP: eager TP pays DTensor's per-op dispatch (sharding propagation in
# Python), which compiling traces away. Without TP the eager floor is the lower one (aot_eager
# runs a decomposed graph: ~20% more main-thread CPU on debug llama3), so it is not a default.
# compute_floor_inductor: compute_floor compiled by inductor (fullgraph). Inductor fuses
# kernels that eager runs one by one, so an inductor variant can beat the eager floor without
# communicating any faster: ss_inductor_* and fsdp2_compiled (inductor per block) are also
# measured against this floor (bench_table.py: ratio_applies). In the default set without TP.
NO_TP_FORM = ("ddp", "ddp_inductor")  # DDP does not take TP DTensor parameters
# With --tp the default set is the 2-D recipe's peers only: 4 ranks on 2 cores compiling a
# TP graph take ~2 min per compiled variant (debug llama3), so the unbucketed ss_aot_eager,
# compiled FSDP2 and the inductor backends are left for --variants to name.
TP_DEFAULT = ("compute_floor", "compute_floor_concurrent", "compute_floor_concurrent_compiled",
              "fsdp2_eager", "ss_aot_eager_blockbucketing", "ss_aot_eager_autobucketing")
# With --cp the floors are one dp rank's cp (x tp) group, splitting its sequences as every
# variant does. FSDP2 and DDP are left out: neither knows the cp ranks are data parallel for
# the parameters (they would need their own dp_shard x cp mesh), and the inductor floor's CP
# graph is not tested.
NO_CP_FORM = ("ddp", "ddp_inductor", "fsdp2_eager", "fsdp2_compiled", "compute_floor_inductor")
CP_DEFAULT = ("compute_floor", "ss_aot_eager_blockbucketing", "ss_aot_eager_autobucketing")
# The step-graph variants in the default set (without TP or CP, which compile_step does not
# take yet): our two bucketing backends.
STEP_DEFAULT = ("ss_step_aot_eager_blockbucketing", "ss_step_aot_eager_autobucketing")


# ss_step_<backend>: the whole step (forward to optimizer update) as one graph,
# simplesharded.compile_step, under any compiler (aot_eager or inductor).
STEP_PREFIX = "ss_step_"
# ss_ragged_<backend>: data_parallel(..., storage="ragged"), each bucket in the ragged
# layout (simplesharded/storage/ragged_shards.py); for the backends that bucket, and uncompiled
# (ss_ragged_eager: a bucket is one gather without any pass). RAGGED_DEFAULT in the default
# set, the others named with --variants.
RAGGED_PREFIX = "ss_ragged_"
# ss_step_ragged_<backend>: the whole step in one graph over ragged buckets (not default).
STEP_RAGGED_PREFIX = "ss_step_ragged_"
# In the default set: what the trainer runs by default (ragged buckets), uncompiled and under
# its default backend.
RAGGED_DEFAULT = ("ss_ragged_eager", "ss_ragged_aot_eager_autobucketing")


# <variant>+qw_int8 (or +qw_fp8): one of our compiled, not step, variants with its parameter
# all-gathers quantized (make_backend's quantize_gathers); +qg_int8 (or +qg_bf16): its gradient
# reductions quantized (quantize_grads); both may follow one variant, e.g.
# ss_ragged_aot_eager_autobucketing+qw_int8+qg_int8. They compute another step than the rest:
# their losses stand beside the others' instead of in the parity check (bench_table.py).
QUANT_SUFFIXES = {"qw_int8": ("quantize_gathers", "int8"), "qw_fp8": ("quantize_gathers", "fp8"),
                  "qg_int8": ("quantize_grads", "int8"), "qg_bf16": ("quantize_grads", "bf16")}


def split_quantized(variant: str) -> tuple[str, dict[str, str]]:
    """(the variant without its quantization suffixes, make_backend's options for them); a
    one-line ValueError for a suffix that is not one, or two of one option."""
    base, *suffixes = variant.split("+")
    opts: dict[str, str] = {}
    for suffix in suffixes:
        if suffix not in QUANT_SUFFIXES:
            raise ValueError(f"variant {variant!r}: +{suffix} is not one of "
                             f"{['+' + k for k in QUANT_SUFFIXES]}")
        key, value = QUANT_SUFFIXES[suffix]
        if key in opts:
            raise ValueError(f"variant {variant!r}: two {key} suffixes")
        opts[key] = value
    return base, opts


def check_variant(variant: str) -> str | None:
    """Why ``variant`` is not one the bench runs (one line), or None."""
    try:
        base, opts = split_quantized(variant)
    except ValueError as e:
        return str(e)
    if base not in all_variants():
        return f"{base!r} is not one of {all_variants()}"
    backend = ss_backend(base)
    if opts and (backend is None or backend.compiler == "eager" or is_step_variant(base)):
        return (f"{variant!r}: quantization suffixes take one of our compiled variants "
                f"(ss_[ragged_]<aot_eager|inductor backend>), not {base!r}")
    return None


def is_quantized(variant: str) -> bool:
    return "+" in variant


def ss_backend(variant: str):
    """The backend (BackendName) of an ``ss_[step_][ragged_]<backend>[+<quantization>]``
    variant; None for a baseline."""
    from simplesharded.backends import BACKENDS, BackendName

    variant = variant.split("+")[0]
    for prefix in (STEP_RAGGED_PREFIX, STEP_PREFIX, RAGGED_PREFIX, "ss_"):  # longest first
        if variant.startswith(prefix):
            name = variant[len(prefix):]
            return BackendName.parse(name) if name in BACKENDS else None
    return None


def is_step_variant(variant: str) -> bool:
    return variant.startswith(STEP_PREFIX) and ss_backend(variant) is not None


def is_ragged_variant(variant: str) -> bool:
    return (variant.startswith((RAGGED_PREFIX, STEP_RAGGED_PREFIX))
            and ss_backend(variant) is not None)


def storage_of(variant: str) -> str:
    """What a variant passes data_parallel as ``storage``."""
    return "ragged" if is_ragged_variant(variant) else "param"


def all_variants() -> list[str]:
    from simplesharded.backends import BACKENDS, BackendName
    return (list(BASELINES) + [f"ss_{name}" for name in BACKENDS]
            + [f"{STEP_PREFIX}{name}" for name in BACKENDS
               if BackendName.parse(name).compiler != "eager"]
            + [f"{prefix}{name}" for prefix in (RAGGED_PREFIX, STEP_RAGGED_PREFIX)
               for name in BACKENDS if BackendName.parse(name).ours]
            + [f"{RAGGED_PREFIX}eager"])  # uncompiled, each bucket one gather


def default_variants(tp: int, cp: int = 1) -> list[str]:
    """Without TP every variant but the aot_eager floor (see BASELINES: it is not the floor;
    the inductor floor is in); with TP the 2-D recipe's peers (TP_DEFAULT); with CP the floor
    and our bucketing backends (CP_DEFAULT)."""
    if cp > 1:
        return list(CP_DEFAULT)
    if tp > 1:
        return list(TP_DEFAULT)
    return [v for v in all_variants() if v != "compute_floor_concurrent_compiled"
            and (not is_step_variant(v) or v in STEP_DEFAULT)
            and (not is_ragged_variant(v) or v in RAGGED_DEFAULT)]


@dataclass
class BenchArgs:
    model: str = "llama3"
    flavor: str = "small"
    n_layers: int | None = None  # override the flavor's depth (tiny runs, tests)
    world_size: int = 2  # ranks in all (dp × cp × tp)
    tp: int = 1
    cp: int = 1  # context parallel: each sequence split over cp ranks (head-tail chunks)
    sequence_parallel: bool = True  # with tp > 1, as the trainer's enable_sequence_parallel
    loss_parallel: bool = True  # with tp > 1, as the trainer's enable_loss_parallel
    global_batch: int = 8
    seq_len: int = 256
    warmup: int = 3
    steps: int = 20
    seed: int = 0
    optimizer_impl: str = "foreach"  # AdamW kernels for every variant (as the trainer's default)
    profile_dir: str = ""  # when set: torch.profiler trace + op table per rank of one more step
    device: str = "cpu"  # or an accelerator type ("cuda"): one device per rank
    host_malloc: str = "caching"  # CPU ranks' malloc: "caching" (host_malloc.py) or "system"

    @property
    def dp(self) -> int:
        return self.world_size // (self.cp * self.tp)


def _build(args: BenchArgs, device: str):
    from simplesharded.models import build_model
    torch.manual_seed(args.seed)
    depth = {"n_layers": args.n_layers} if args.n_layers else {}
    return build_model(args.model, args.flavor, device=device, **depth)


def world_of(variant: str, args: BenchArgs) -> int:
    """Ranks a variant runs on: the floors are one dp rank's worth (1 rank, or its cp x tp
    group)."""
    floor = variant in ("compute_floor", "compute_floor_inductor")
    return args.cp * args.tp if floor else args.world_size


def loss_parallel_on(args: BenchArgs) -> bool:
    return args.tp > 1 and args.loss_parallel


def prepare(variant: str, args: BenchArgs, mesh, loss_fn):
    """The model (TP-parallelized when the mesh has a tp dim, its attention split over the cp
    dim when it has one, as the trainer's recipe orders them, then wrapped/compiled for the
    variant), its optimizer, and for a step variant the compiled step
    (``step(x, y) -> loss`` from ``loss_fn(model, x, y)``; None otherwise)."""
    from simplesharded.mesh import cp_dim, dp_mesh
    from simplesharded.models.context_parallel import apply_context_parallel
    from simplesharded.trainer import OPTIMIZER_IMPL, apply_tensor_parallel
    model = _build(args, "cpu").to(args.device)  # initialised on CPU: the same weights anywhere
    apply_tensor_parallel(model, mesh, args.sequence_parallel, loss_parallel_on(args))
    if cp_dim(mesh):
        apply_context_parallel(model, mesh[cp_dim(mesh)])
    if variant.startswith("compute_floor"):
        # torch's own backends: no pass of ours in a floor
        if variant.endswith("_compiled"):
            model = torch.compile(model, backend="aot_eager", fullgraph=True)
        elif variant.endswith("_inductor"):
            model = torch.compile(model, backend="inductor", fullgraph=True)
    elif variant in ("ddp", "ddp_inductor"):
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
        if variant == "ddp_inductor":
            model = torch.compile(model, backend="inductor")
    elif variant.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard
        from simplesharded.blocks import find_blocks
        for _, block in find_blocks(model):
            if variant == "fsdp2_compiled":
                block.compile()  # per-block compile, as torchtitan does for FSDP2
            fully_shard(block, mesh=dp_mesh(mesh))
        fully_shard(model, mesh=dp_mesh(mesh))
    else:
        from simplesharded import data_parallel, make_backend
        backend = ss_backend(variant)
        data_parallel(model, mesh, "fully_shard", storage=storage_of(variant))
        if is_step_variant(variant):
            from simplesharded import compile_step
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            return model, opt, compile_step(model, opt, loss_fn, backend=str(backend))
        if backend.compiler != "eager":
            model = torch.compile(model, backend=make_backend(
                str(backend), **split_quantized(variant)[1]), fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **OPTIMIZER_IMPL[args.optimizer_impl])
    return model, opt, None
