"""run_train.sh's rank environment (simplesharded/shims/launch_env.py): what each device's ranks get,
that a variable the user set wins; its launcher (simplesharded/trainer/launch.py): the
preflight, then torchrun in-process with that environment."""
import os

from simplesharded.shims.host_malloc import TUNABLES, caching_env
from simplesharded.shims.launch_env import ALLOC_CONF, SHARE_STORE, allocator_env, launch_env


def test_cpu_ranks_get_the_caching_malloc_a_core_share_and_their_own_restart_store():
    env = launch_env("cpu", 2, environ={}, cores=8)
    assert env == {"OMP_NUM_THREADS": "4", TUNABLES: caching_env({})[TUNABLES],
                   SHARE_STORE: "1"}


def test_gpu_ranks_get_expandable_segments_and_no_second_store():
    env = launch_env("cuda", 8, environ={}, cores=64)
    assert env == {"OMP_NUM_THREADS": "8", ALLOC_CONF[0]: "expandable_segments:True"}
    assert SHARE_STORE not in env and TUNABLES not in env


def test_what_the_user_set_wins():
    for name in ALLOC_CONF:  # either spelling of the allocator's settings
        assert ALLOC_CONF[0] not in launch_env("cuda", 1, environ={name: "x"}, cores=4)
    env = launch_env("cpu", 2, environ={"OMP_NUM_THREADS": "1", SHARE_STORE: "0"}, cores=8)
    assert "OMP_NUM_THREADS" not in env and SHARE_STORE not in env
    assert launch_env("cpu", 4, environ={}, cores=2)["OMP_NUM_THREADS"] == "1"


def test_every_launcher_of_accelerator_ranks_sets_expandable_segments(monkeypatch):
    """The bench's ranks start as run_train.sh's do: expandable segments on an accelerator,
    unless the user set the allocator's configuration (either name); nothing on CPU."""
    from simplesharded.tools.bench_run import _rank_environment
    from simplesharded.tools.bench_variants import BenchArgs

    assert allocator_env("cuda", environ={}) == {ALLOC_CONF[0]: "expandable_segments:True"}
    assert allocator_env("cuda", environ={ALLOC_CONF[1]: "x"}) == {}
    assert allocator_env("cpu", environ={}) == {}
    for name in ALLOC_CONF:
        monkeypatch.delenv(name, raising=False)
    with _rank_environment(BenchArgs(device="cuda")):
        assert os.environ[ALLOC_CONF[0]] == "expandable_segments:True"
    assert ALLOC_CONF[0] not in os.environ  # as it was
    monkeypatch.setenv(ALLOC_CONF[1], "expandable_segments:False")
    with _rank_environment(BenchArgs(device="cuda")):
        assert ALLOC_CONF[0] not in os.environ


def test_processes_per_node():
    from simplesharded.trainer.launch import CPU_PROCESSES, processes_per_node

    assert processes_per_node("cpu", {}) == CPU_PROCESSES == 2
    assert processes_per_node("cpu", {"NGPU": "3"}) == 3
    assert processes_per_node("cuda", {"NGPU": "8"}) == 8


def test_launcher_checks_once_then_runs_torchrun_in_process(monkeypatch, capsys):
    """run_train.sh's one Python start: a config error is one line and exit 2 with no rank
    started; otherwise torchrun runs here with NGPU's processes, the trainer's arguments and
    the ranks' environment (the caching malloc, the preflight marked done)."""
    import torch.distributed.run

    from simplesharded.trainer import launch
    from simplesharded.trainer.config_parse import PREFLIGHT_DONE

    started = []
    monkeypatch.setattr(torch.distributed.run, "main",
                        lambda args: started.append((args, dict(os.environ))))
    for name in ("NGPU", "NNODES", TUNABLES, SHARE_STORE, PREFLIGHT_DONE, "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    # the launcher sets the ranks' environment in this process: restored after the test
    monkeypatch.setattr(os, "environ", dict(os.environ))
    # 2 processes x 2 nodes: a shard degree of 3 does not divide the world of 4
    monkeypatch.setenv("NNODES", "2")
    assert launch.main(["--standalone", "--", "--parallelism.data_parallel_shard_degree",
                        "3"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "4" in err[0], err
    assert not started and PREFLIGHT_DONE not in os.environ
    monkeypatch.setenv("NNODES", "1")
    assert launch.main(["--standalone", "--max-restarts", "1", "--", "--training.steps",
                        "2"]) == 0
    (args, env), = started
    assert args == ["--standalone", "--max-restarts", "1", "--nproc_per_node=2", "-m",
                    "simplesharded.trainer", "--training.steps", "2"]
    assert env[PREFLIGHT_DONE] == "1" and env[SHARE_STORE] == "1"
    assert env[TUNABLES] == caching_env({})[TUNABLES]


def test_a_stop_on_one_rank_is_its_code_when_the_agent_stops_the_others(monkeypatch, capsys,
                                                                         tmp_path):
    """Rank 0 stops on an error of the run's own (exit 2) while rank 1 is still running, so
    torchrun's agent stops rank 1 with SIGTERM: the launch still ends with 2 and the one error
    line, not torchrun's report. A crash, or an outside signal with no stop, stays torchrun's."""
    import logging
    import signal

    import torch.distributed.run

    from simplesharded.trainer import launch
    from simplesharded.trainer.cli import EXIT_CONFIG

    rank = tmp_path / "rank.py"
    rank.write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '0':\n"
        "    path = os.path.join(os.environ['SIMPLESHARDED_ERROR_DIR'], 'rank0')\n"
        "    open(path, 'w').write('error: checkpoint.load_step=5: not there\\n')\n"
        f"    sys.exit({EXIT_CONFIG})\n"
        "time.sleep(120)\n")
    real = torch.distributed.run.main
    # the launcher's torchrun arguments, with the trainer replaced by the script above
    monkeypatch.setattr(torch.distributed.run, "main",
                        lambda args: real([*args[:args.index("-m")], str(rank)]))
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setenv("NGPU", "2")
    # what torchrun's agent logs (its handler writes to the stderr of before the capture)
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    agent = logging.getLogger(launch.AGENT_LOGGER)
    agent.addHandler(handler)
    try:
        assert launch.main(["--standalone", "--"]) == EXIT_CONFIG
    finally:
        agent.removeHandler(handler)
    err = capsys.readouterr().err
    assert err.count("error: checkpoint.load_step=5: not there") == 1, err
    assert "Traceback" not in err, err
    # neither the exit code's line nor rank 1's stop, which rank 0's error caused
    assert not [m for m in logged if "failed (exitcode" in m or "closing signal" in m], logged

    stops = {2, 3}
    assert launch.stopped_on_purpose([2, -signal.SIGTERM], stops) == 2
    assert launch.stopped_on_purpose([2, 2, -signal.SIGKILL], stops) == 2
    assert launch.stopped_on_purpose([-signal.SIGTERM, -signal.SIGSEGV], stops) is None
    assert launch.stopped_on_purpose([2, 1], stops) is None  # a crash beside the stop
    assert launch.stopped_on_purpose([-signal.SIGTERM], stops) is None  # killed from outside
