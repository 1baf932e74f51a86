"""The order test files start in on run_tests.sh's workers: the costliest first.

pytest-xdist hands each worker one file at a time (``--dist loadfile``) in the order it gets
them; a multi-process file of a few minutes that starts last leaves the other worker idle
until it ends. Starting the costliest files first (longest-processing-time first) ends both
workers close together. The costs are seconds per file measured by an earlier suite run,
in tests/file_costs.json; a file it does not list (new) costs 0 and keeps its place among
those. A stale table only makes the suite slower, never wrong.

    python tests/support/file_costs.py JUNIT.xml   # rewrite tests/file_costs.json

from a run of ``./run_tests.sh --junitxml=JUNIT.xml``.
"""
from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COSTS = os.path.join(TESTS, "file_costs.json")


def load() -> dict[str, float]:
    """{file name under tests/: seconds}; empty when the table is missing."""
    try:
        with open(COSTS) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def costliest_first(items: list, costs: dict[str, float]) -> list:
    """``items`` (pytest items) grouped by file, the files by cost descending, each file's
    items in their order; stable for files of equal cost."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(os.path.basename(str(item.path)), []).append(item)
    order = sorted(files, key=lambda name: -costs.get(name, 0.0))
    return [item for name in order for item in files[name]]


def from_junit(path: str) -> dict[str, float]:
    """Seconds per test file of a junit XML report (setup, call and teardown together)."""
    costs: dict[str, float] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        name = next((f"{part}.py" for part in module if part.startswith("test_")), None)
        if name:
            costs[name] = costs.get(name, 0.0) + float(case.get("time", 0.0))
    return {name: round(s, 1) for name, s in sorted(costs.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    table = from_junit(sys.argv[1])
    with open(COSTS, "w") as f:
        json.dump(table, f, indent=0)
        f.write("\n")
    print(f"{COSTS}: {len(table)} files, {sum(table.values()):.0f} s in all")
