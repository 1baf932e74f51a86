#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py, its checks in scripts/gpu_checks.py): what a first run on
# this machine's accelerator executes, check by check, in at most --budget seconds (480 by
# default), and one results file (markdown: --out, default $OUT/<date>_<commit>.md when $OUT
# is set, else benchmarks/gpu/<date>_<commit>.md). Without an accelerator, or with --cpu, the
# same checks run on CPU (gloo, fake process groups), what needs an accelerator saying SKIP and
# why. Other arguments: --checks, --jobs, --backends, --storages, --cases, --timeout (--help).
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
"$PY" -c 'import torch' || { echo "gpu_check: $PY has no torch" >&2; exit 2; }
exec "$PY" "$ROOT/scripts/gpu_check.py" "$@"
