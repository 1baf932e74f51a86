#!/usr/bin/env bash
# Run the whole test suite (fast and multi-process). Extra args go to pytest, e.g. -m "not slow".
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
set +e
"$PY" -m pytest -q -ra --durations=40 "$@"  # the slowest tests: the suite has a time budget
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "run_tests.sh: pytest collected no tests; refusing to pass" >&2
    exit 1
fi
exit "$rc"
