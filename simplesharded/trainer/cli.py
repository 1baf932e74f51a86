"""``python -m simplesharded.trainer`` (normally via ./run_train.sh / torchrun): load and check
the config, start the process group, train. Errors in the configuration exit with code 2 and
one line. ``--help`` lists every key; ``--check-only`` runs only the checks (run_train.sh's
preflight, with WORLD_SIZE set to the number of processes torchrun would start).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from simplesharded.mesh import cp_dim, cp_mesh, init_distributed
from simplesharded.trainer.config import help_text, load_config
from simplesharded.trainer.loop import NonFiniteError, Trainer
from simplesharded.trainer.preflight import check_packages, check_static, check_torch

EXIT_CONFIG, EXIT_NONFINITE = 2, 3
# Set by run_train.sh's launcher (launch.py) for the ranks it starts: a folder where each rank
# writes its error line, which the launcher prints once per different line.
ERROR_DIR = "SIMPLESHARDED_ERROR_DIR"


def _quantized_text(cfg) -> str:
    """The launch line's words on quantized gathers and gradient reductions (only those on)."""
    c = cfg.compile
    return "".join(f" {key}={getattr(c, key)}" for key in ("quantize_gathers", "quantize_grads")
                   if getattr(c, key) != "none")


def _offload_text(cfg) -> str:
    """The launch line's words on host offload (only when on)."""
    offload = cfg.parallelism.offload
    return "" if offload == "none" else f" offload={offload}"


def _mesh_text(mesh) -> str:
    """``pp=2,dp_shard=2``: the degrees by name (a user's unnamed mesh by position); an ep
    mesh's cp sibling after it (simplesharded/mesh.py)."""
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    text = ",".join(f"{n}={d}" for n, d in zip(names, mesh.mesh.shape))
    cp = cp_mesh(mesh) if mesh.mesh_dim_names else None
    if cp is not None and not cp_dim(mesh):
        text += f" (cp={cp.size()} beside ep, both over dp_shard x cp)"
    return text


def _pipeline_text(cfg, pipeline) -> str:
    """With pp: the schedule and rank 0's stages' FSDP policies (``auto`` resolves per stage)."""
    if pipeline is None:
        return ""
    policies = ",".join(s.policy for s in pipeline.stages)
    return f" pp_schedule={cfg.parallelism.pipeline_parallel_schedule} policies(rank0)={policies}"


def _error(e: Exception) -> None:
    """One ``error:`` line in one write: every rank of a job shares the launcher's stderr, and
    print's separate write of the newline let two ranks' lines run together. Under
    run_train.sh's launcher the line goes to a file of this rank's in the launcher's
    directory instead (:data:`ERROR_DIR`), which prints each different line once."""
    line = f"error: {e}\n"
    folder = os.environ.get(ERROR_DIR)
    if folder:
        with open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}"), "a") as fh:
            fh.write(line)
        return
    sys.stderr.write(line)
    sys.stderr.flush()


def make_deterministic(device: str) -> None:
    """torch's deterministic algorithms (``training.deterministic``). On CUDA, cuBLAS needs a
    fixed workspace for them, which it reads from the environment when its handle is created:
    set before the first matmul (a value the user set wins), else that matmul raises."""
    if device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def _checked(argv: list[str], world_size: int):
    """The config of ``argv`` checked for ``world_size`` ranks, or None once its error is
    printed (one line)."""
    try:
        cfg = check_static(load_config(None, argv), world_size)
        check_packages(cfg)
        check_torch(cfg)
        return cfg
    except ValueError as e:
        _error(e)
        return None


def preflight(argv: list[str], world_size: int) -> int:
    """run_train.sh's preflight (simplesharded/trainer/launch.py, ``--check-only``): the
    trainer's checks once, in one process, before torchrun starts any rank (otherwise every
    rank prints the error, then torchrun a traceback). The exit code."""
    if _checked(argv, world_size) is None:
        return EXIT_CONFIG
    from simplesharded.passes.torch_compat import outside_range

    warning = outside_range()  # a warning: a release outside the range may still work
    if warning is not None:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text("python -m simplesharded.trainer | ./run_train.sh [--section.key VALUE ...]"))
        return 0
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if "--check-only" in argv:
        return preflight([a for a in argv if a != "--check-only"], world_size)
    cfg = _checked(argv, world_size)
    if cfg is None:
        return EXIT_CONFIG
    code = 0
    try:
        device = init_distributed(host=cfg.parallelism.offload != "none")
        if cfg.training.deterministic:
            make_deterministic(device)
        trainer = Trainer(cfg, device)
        if trainer.rank == 0:
            model = cfg.model.label()
            if cfg.model.n_layers:
                model += f" n_layers={cfg.model.n_layers}"
            print(f"[simplesharded] {model} world={trainer.world} "
                  f"mode={cfg.parallelism.mode} mesh={_mesh_text(trainer.mesh)} "
                  f"compile={cfg.compile.backend if cfg.compile.enable else 'off'}"
                  f"{_quantized_text(cfg)}"
                  f"{' scope=step' if trainer.whole_step is not None else ''}"
                  f" storage={cfg.dp_storage()}"
                  f"{_offload_text(cfg)}"
                  f"{_pipeline_text(cfg, trainer.pipeline)}", flush=True)
        trainer.run()
    except ValueError as e:
        _error(e)
        code = EXIT_CONFIG
    except NonFiniteError as e:
        _error(e)
        code = EXIT_NONFINITE
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return code
