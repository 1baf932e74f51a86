# Sourced by run_train.sh and run_tests.sh: pick the Python that runs the project, as $PY.
#
# Default: .venv, created and installed (editable, with dev extras) on first use. A stamp file
# records the pyproject.toml it was installed from, so a changed dependency list re-installs
# and an unchanged one costs nothing. Nodes that share the checkout (srun on a shared file
# system) take a lock, so one installs and the others wait for it.
#
# SIMPLESHARDED_PYTHON=/path/to/python: use that interpreter as it is (a cluster's own
# environment, or a machine with no package index): nothing is created or installed; it needs
# torch, and the checkout is importable from its root without an install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${SIMPLESHARDED_PYTHON:-}" ]; then
    PY="$(command -v "$SIMPLESHARDED_PYTHON" || true)"
    "${PY:-false}" - <<'PYEOF' || { echo "error: SIMPLESHARDED_PYTHON=$SIMPLESHARDED_PYTHON cannot import torch" >&2; exit 2; }
import sys
import torch
v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
if not (2, 13) <= v < (2, 14):
    print(f"[bootstrap] warning: torch {torch.__version__} is outside the tested range "
          f">=2.13,<2.14", file=sys.stderr)
PYEOF
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
    VENV="$ROOT/.venv"
    STAMP="$VENV/.simplesharded-installed"
    _ss_install() {
        if [ ! -x "$VENV/bin/python" ]; then
            echo "[bootstrap] creating $VENV" >&2
            "${PYTHON:-python3}" -m venv "$VENV"
        fi
        if [ ! -f "$STAMP" ] || ! cmp -s "$ROOT/pyproject.toml" "$STAMP"; then
            echo "[bootstrap] installing simplesharded (editable) with dev extras" >&2
            "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT[dev]"
            cp "$ROOT/pyproject.toml" "$STAMP"
        fi
    }
    if [ ! -f "$STAMP" ] || ! cmp -s "$ROOT/pyproject.toml" "$STAMP"; then
        if command -v flock >/dev/null; then
            exec 9>"$ROOT/.venv.lock"
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
