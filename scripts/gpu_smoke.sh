#!/usr/bin/env bash
# GPU smoke test (scripts/gpu_smoke.py): every backend vs the uncompiled run, the bench's
# compute floor and calibration on this machine's GPU; a CPU dry run with gloo when there is
# none, or with --cpu. Other arguments go to gpu_smoke.py (--backends, --checks).
#
# Meant for a fresh machine with python3 and torch but no internet and no .venv: the project
# is not installed there, so this working tree is made importable through a temporary tree of
# links (simplesharded/ with passes/ and models/ as its subpackages, as pyproject.toml maps
# them). Python: $PYTHON, else this checkout's .venv, else python3.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
LINKS="$(mktemp -d)"
trap 'rm -rf "$LINKS"' EXIT
mkdir "$LINKS/simplesharded"
ln -s "$ROOT"/simplesharded/*.py "$LINKS/simplesharded/"
ln -s "$ROOT/passes" "$LINKS/simplesharded/passes"
ln -s "$ROOT/models" "$LINKS/simplesharded/models"
export PYTHONPATH="$LINKS${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import torch' || { echo "gpu_smoke: $PY has no torch" >&2; exit 2; }
"$PY" "$ROOT/scripts/gpu_smoke.py" "$@"
