"""scripts/bootstrap.sh on nodes that share one checkout (srun on a shared file system): the
first installs into .venv, the others wait for it and install nothing. The venv's python is a
stand-in that logs the install and takes a second, so the test runs no pip."""
import os
import shutil
import subprocess
import textwrap

import pytest

from simplesharded.passes.torch_compat import DEFAULT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_concurrent_bootstraps_install_once(tmp_path):
    if shutil.which("flock") is None:
        pytest.skip("no flock on this machine: the bootstrap installs without a lock")
    (tmp_path / "scripts").mkdir()
    shutil.copy(os.path.join(ROOT, "scripts", "bootstrap.sh"), tmp_path / "scripts")
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path)
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    log = tmp_path / "installs.log"
    python.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        echo "start $$" >> {log}; sleep 1; echo "end $$" >> {log}
        """))
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("SIMPLESHARDED_PYTHON", "SIMPLESHARDED_VENV", "SIMPLESHARDED_TORCH")}
    cmd = ["bash", "-c", f"source {tmp_path}/scripts/bootstrap.sh && echo ok"]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 and out.strip() == "ok" for p, (out, _) in zip(procs, outs)), outs
    lines = log.read_text().split()
    assert lines[0::2] == ["start", "end"], lines  # one install, whole, by one node
    assert (tmp_path / ".venv" / ".simplesharded-installed").exists()


def test_a_given_python_is_taken_as_it_is():
    """SIMPLESHARDED_PYTHON (a GPU image's interpreter, nothing installed): the bootstrap
    reads the torch range from passes/torch_compat.py with that python and installs nothing."""
    import sys

    env = {**os.environ, "SIMPLESHARDED_PYTHON": sys.executable}
    p = subprocess.run(["bash", "-c", f"source {ROOT}/scripts/bootstrap.sh && echo \"$PY\""],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == shutil.which(sys.executable), (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr


def test_a_venv_keeps_the_torch_it_was_made_with(tmp_path):
    """SIMPLESHARDED_VENV alone (no SIMPLESHARDED_TORCH) keeps a venv made for another torch on
    it: unchanged, nothing installs; after pyproject.toml changes, the re-install asks for the
    stamp's torch, not the default. A new venv takes the default."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(os.path.join(ROOT, "scripts", "bootstrap.sh"), tmp_path / "scripts")
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path)
    log = tmp_path / "installs.log"
    for name in ("old", "new"):
        python = tmp_path / name / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text(f'#!/usr/bin/env bash\necho "{name} $*" >> {log}\n')
        python.chmod(0o755)
    pyproject = (tmp_path / "pyproject.toml").read_text()
    (tmp_path / "old" / ".simplesharded-installed").write_text(
        pyproject + "# installed with: torch==2.11.*\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("SIMPLESHARDED_PYTHON", "SIMPLESHARDED_VENV", "SIMPLESHARDED_TORCH")}

    def bootstrap(venv: str) -> None:
        p = subprocess.run(["bash", "-c", f"source {tmp_path}/scripts/bootstrap.sh"],
                           env={**env, "SIMPLESHARDED_VENV": venv}, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0, p.stderr

    bootstrap("old")
    assert not log.exists()  # current: nothing installed
    (tmp_path / "pyproject.toml").write_text(pyproject + "\n# a changed dependency list\n")
    bootstrap("old")
    bootstrap("new")
    installs = log.read_text().splitlines()
    assert len(installs) == 2 and installs[0].startswith("old ") and \
        installs[1].startswith("new "), installs
    assert installs[0].endswith(" torch==2.11.*"), installs
    assert installs[1].endswith(f" torch=={DEFAULT}.*"), installs
    assert (tmp_path / "old" / ".simplesharded-installed").read_text().endswith(
        "# installed with: torch==2.11.*\n")
