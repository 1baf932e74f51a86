#!/bin/bash
# Run one pytest node id N times in a row while K busy loops compete for the CPU; stop at the
# first failure. For flaky multi-rank tests (a race that shows only under load, as gloo's heap
# corruption did:
# benchmarks/history/journal.md#issue-13-item-7-the-heap-corruption-found-and-no-longer-triggered):
#   scripts/repeat_under_load.sh 20 2 tests/test_bench.py::test_tiny_bench_runs_end_to_end
# Prints one line per run (seconds, 1-minute load average) and "N of N passed" or the failure.
set -u
n=${1:?runs}; k=${2:?busy loops}; node=${3:?pytest node id}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
loops=()
for _ in $(seq "$k"); do python3 -c "while True: pass" & loops+=($!); done
trap 'kill "${loops[@]}" 2>/dev/null' EXIT
for i in $(seq "$n"); do
    t0=$(date +%s)
    if ! .venv/bin/python -m pytest -x -q -p no:cacheprovider "$node" > /tmp/repeat_under_load.$$.log 2>&1; then
        tail -40 /tmp/repeat_under_load.$$.log
        echo "run $i FAILED after $((i - 1)) passes in a row"
        exit 1
    fi
    echo "run $i passed in $(( $(date +%s) - t0 )) s, load $(cut -d' ' -f1 /proc/loadavg)"
done
rm -f /tmp/repeat_under_load.$$.log
echo "$n of $n passed in a row with $k busy loops"
