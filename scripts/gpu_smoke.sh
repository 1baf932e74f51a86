#!/usr/bin/env bash
# GPU smoke test (scripts/gpu_smoke.py): what a first run on this machine's accelerator
# executes, check by check; a CPU dry run with gloo when there is none, or with --cpu. Other
# arguments go to gpu_smoke.py (--checks, --backends, --cases).
#
# Meant for a fresh machine with python3 and torch and nothing else: the project is not
# installed there; the checkout is importable from its root as it is (simplesharded/__init__.py
# puts passes/ and models/ in place). Python: $PYTHON, else this checkout's .venv, else python3.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import torch' || { echo "gpu_smoke: $PY has no torch" >&2; exit 2; }
exec "$PY" "$ROOT/scripts/gpu_smoke.py" "$@"
