#!/usr/bin/env bash
# Run the whole test suite (fast and multi-process). Extra args go to pytest, e.g. -m "not slow".
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# torch is stricter when CI is set (inductor refuses to fall back to an eager kernel for an op
# it could decompose): the same strictness here as on the CI machine, which sets it.
export CI="${CI:-1}"
set +e
# Test files run on parallel workers (pytest-xdist, one file per worker so that a file's shared
# spawn runs once): most tests compile on one core. SIMPLESHARDED_TEST_WORKERS=0 runs them in
# this process; a Python without xdist (SIMPLESHARDED_PYTHON) runs them serially too.
WORKERS=()
if [ "${SIMPLESHARDED_TEST_WORKERS:-auto}" != 0 ] && "$PY" -c "import xdist" 2>/dev/null; then
    # files in the order tests/conftest.py collects them (the costliest first), not by count
    WORKERS=(-n "${SIMPLESHARDED_TEST_WORKERS:-auto}" --dist loadfile --no-loadscope-reorder)
fi
"$PY" -m pytest -q -ra --durations=40 "${WORKERS[@]}" "$@"  # the slowest: the suite has a time budget
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "run_tests.sh: pytest collected no tests; refusing to pass" >&2
    exit 1
fi
exit "$rc"
