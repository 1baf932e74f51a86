"""``python -m simplesharded.trainer.launch [torchrun options] -- [trainer arguments]``:
run_train.sh's one Python start before the ranks.

It decides the number of processes per node (``NGPU``, else the accelerator count, else 2 CPU
processes) and the ranks' environment (simplesharded/shims/launch_env.py), runs the preflight
once (the trainer's checks against ``NGPU × NNODES``: a config or degree error is one
``error:`` line and exit 2 before any rank starts, where every rank would print it and torchrun
add a traceback), then runs torchrun in this process with ``--nproc_per_node`` and
``-m simplesharded.trainer``; a rank that stops on an error of the run's own (a checkpoint
that does not load, a non-finite loss: exit 2 or 3) ends the launch with its code, without
torchrun's traceback, and the ranks' ``error:`` lines printed once each (every rank finds the
same error: the ranks write their lines to files, :data:`~simplesharded.trainer.cli.ERROR_DIR`,
and the launch prints each different line once). One start instead of three (the environment, the
preflight, torchrun's): a 3-step debug run on 2 CPU ranks took 7.1 s instead of 10.5.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile

from simplesharded.shims.launch_env import launch_env
from simplesharded.trainer.config_parse import PREFLIGHT_DONE

CPU_PROCESSES = 2  # per node, without an accelerator


def processes_per_node(device: str, environ: dict[str, str] | None = None) -> int:
    """``NGPU`` when set (run_train.sh has checked it is a positive integer), else one process
    per accelerator, else :data:`CPU_PROCESSES`."""
    environ = os.environ if environ is None else environ
    if environ.get("NGPU"):
        return int(environ["NGPU"])
    if device == "cpu":
        return CPU_PROCESSES
    import torch
    return torch.accelerator.device_count()


def main(argv: list[str] | None = None) -> int:
    from simplesharded.mesh import device_type
    from simplesharded.trainer.cli import preflight

    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--")  # run_train.sh always passes it
    torchrun_args, trainer_args = argv[:split], argv[split + 1:]
    device = device_type()
    nproc = processes_per_node(device)
    world = nproc * int(os.environ.get("NNODES", "1"))
    code = preflight(trainer_args, world)
    if code:
        return code
    # the ranks' environment (a variable already set wins); the preflight printed the config's
    # warnings (a deprecated key), so the ranks do not again
    os.environ.update(launch_env(device, nproc))
    os.environ[PREFLIGHT_DONE] = "1"
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from simplesharded.trainer.cli import ERROR_DIR, EXIT_CONFIG, EXIT_NONFINITE

    stops = {EXIT_CONFIG, EXIT_NONFINITE}  # the codes ranks exit with on purpose
    agent_log = logging.getLogger(AGENT_LOGGER)
    with tempfile.TemporaryDirectory(prefix="simplesharded-errors-") as errors:
        quiet = _QuietStops(stops, errors)
        agent_log.addFilter(quiet)
        os.environ[ERROR_DIR] = errors
        try:
            torchrun([*torchrun_args, f"--nproc_per_node={nproc}", "-m",
                      "simplesharded.trainer", *trainer_args])
        except ChildFailedError as e:
            _print_errors(errors)
            code = stopped_on_purpose([f.exitcode for f in e.failures.values()], stops)
            if code is not None:
                # The ranks stopped on purpose: exit with their code, without torchrun's
                # traceback and failure table under their line.
                return code
            raise  # a crash or a signal: torchrun's report says which rank and how
        finally:
            os.environ.pop(ERROR_DIR, None)
            agent_log.removeFilter(quiet)
    return 0


# what torchrun's agent stops the other ranks with once one has exited (SIGKILL after a timeout)
_AGENT_STOPS = {-signal.SIGTERM, -signal.SIGKILL}


def stopped_on_purpose(exitcodes: list[int], stops: set[int]) -> int | None:
    """The code to exit with when the ranks' failures are a stop of the run's own: at least one
    rank exited with a code in ``stops``, and every other either did too or was stopped by the
    agent because of it (a rank still finding the same error when the first one exited).
    ``None`` for a crash or an outside signal: torchrun's report is then the one to see."""
    own = [c for c in exitcodes if c in stops]
    if own and all(c in stops or c in _AGENT_STOPS for c in exitcodes):
        return max(own)
    return None


# torchrun's agent logs a rank's exit code on this logger (docs/torch_internals.md)
AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"


class _QuietStops(logging.Filter):
    """Drops torchrun's "failed (exitcode: N) ..." line for the ``codes`` the ranks stop with
    on purpose, and its "Sending process ... closing signal" lines once a rank has written its
    error line to ``folder`` (:data:`~simplesharded.trainer.cli.ERROR_DIR`: the others are
    stopped because of it): that ``error:`` line says why, and is the one a user should
    see."""

    def __init__(self, codes: set[int], folder: str):
        super().__init__()
        self.codes, self.folder = codes, folder

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if msg.startswith("failed (exitcode:"):
            return not (record.args and record.args[0] in self.codes)
        return not (msg.startswith("Sending process") and os.listdir(self.folder))


def _print_errors(folder: str) -> None:
    """The ranks' error lines (one file per rank), each different line once, in rank order."""
    lines: dict[str, None] = {}
    for name in sorted(os.listdir(folder), key=lambda n: int(n.removeprefix("rank"))):
        with open(os.path.join(folder, name)) as fh:
            lines.update(dict.fromkeys(fh.read().splitlines()))
    if lines:
        sys.stderr.write("".join(f"{line}\n" for line in lines))
        sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
