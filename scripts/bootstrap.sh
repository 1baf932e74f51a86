# Sourced by run_train.sh and run_tests.sh: pick the Python that runs the project, as $PY.
#
# Default: .venv, created and installed (editable, with dev extras) on first use, with torch
# as SIMPLESHARDED_TORCH says (default torch==2.13.*: the release whose CPU wheel this
# project's machines have; pyproject.toml allows every supported release, >=2.11,<2.16, and
# passes/torch_compat.py's table says what needs a newer one). A stamp file records the
# pyproject.toml and the torch it was installed from, so a changed dependency list re-installs
# and an unchanged one costs nothing. Nodes that share the checkout (srun on a shared file
# system) take a lock, so one installs and the others wait for it.
#
# SIMPLESHARDED_VENV=DIR (relative to the checkout, or absolute) with SIMPLESHARDED_TORCH=SPEC:
# another venv with another torch, made and kept the same way, e.g. the fast tests on the
# oldest supported torch (docs/torch_internals.md, "Torch versions"):
#   SIMPLESHARDED_VENV=.venv-torch2.11 SIMPLESHARDED_TORCH='torch==2.11.*' \
#       ./run_tests.sh -m "not slow"
# Once made, SIMPLESHARDED_VENV alone keeps it on its torch (the stamp names it).
#
# SIMPLESHARDED_PYTHON=/path/to/python: use that interpreter as it is (a cluster's own
# environment, or a machine with no package index): nothing is created or installed; it needs
# torch, and the checkout is importable from its root without an install (a torch outside the
# supported range is a warning).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${SIMPLESHARDED_PYTHON:-}" ]; then
    PY="$(command -v "$SIMPLESHARDED_PYTHON" || true)"
    "${PY:-false}" - "$ROOT/passes/torch_compat.py" <<'PYEOF' || { echo "error: SIMPLESHARDED_PYTHON=$SIMPLESHARDED_PYTHON cannot import torch" >&2; exit 2; }
import importlib.util
import sys

import torch  # noqa: F401 (the error above when it is missing)

spec = importlib.util.spec_from_file_location("torch_compat", sys.argv[1])
table = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = table  # a dataclass in it looks its module up there
spec.loader.exec_module(table)
if table.outside_range():
    print(f"[bootstrap] warning: {table.outside_range()}", file=sys.stderr)
PYEOF
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
    VENV="${SIMPLESHARDED_VENV:-.venv}"
    case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
    VENV="${VENV%/}"
    STAMP="$VENV/.simplesharded-installed"
    # Without SIMPLESHARDED_TORCH, the torch the venv was made with: a venv made for another
    # torch stays on it (SIMPLESHARDED_VENV=.venv-torch2.11 ./run_train.sh trains on 2.11)
    MADE_WITH="$( { [ -f "$STAMP" ] && sed -n 's/^# installed with: //p' "$STAMP"; } || true)"
    TORCH_SPEC="${SIMPLESHARDED_TORCH:-${MADE_WITH:-torch==2.13.*}}"
    _ss_stamp() { cat "$ROOT/pyproject.toml"; echo "# installed with: $TORCH_SPEC"; }
    _ss_current() { [ -f "$STAMP" ] && [ "$(_ss_stamp)" = "$(cat "$STAMP")" ]; }
    _ss_install() {
        if [ ! -x "$VENV/bin/python" ]; then
            echo "[bootstrap] creating $VENV" >&2
            "${PYTHON:-python3}" -m venv "$VENV"
        fi
        if ! _ss_current; then
            echo "[bootstrap] installing simplesharded (editable) with dev extras and" \
                 "$TORCH_SPEC into $VENV" >&2
            "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
                -e "$ROOT[dev]" "$TORCH_SPEC"
            _ss_stamp > "$STAMP"
        fi
    }
    if ! _ss_current; then
        if command -v flock >/dev/null; then
            exec 9>"$VENV.lock"
            flock 9
            _ss_install
            flock -u 9
            exec 9>&-
        else
            _ss_install
        fi
    fi
    PY="$VENV/bin/python"
fi
export PATH="$(dirname "$PY"):$PATH"
