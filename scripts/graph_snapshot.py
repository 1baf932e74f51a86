"""Snapshot every backend's graphs, to show a refactor changed none of them.

    python scripts/graph_snapshot.py write DIR      # dump_graphs of each case, and its counts
    python scripts/graph_snapshot.py compare OLD NEW

Cases: llama3 debug on 2 ranks, with TP (dp 2 × tp 2), with HSDP (2 × 2), and deepseek_v3
debug with EP 2 on 4 ranks; backends aot_eager, aot_eager_blockbucketing and
aot_eager_autobucketing; each traced on a fake process group (``tools/report.py``), one
process per case. ``compare`` matches the graphs by (graph, pass) and ignores the source
locations in the dumps' comments (moving code changes those, not the graph); a pass that
exists on one side only is listed, not compared.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

CASES = {"llama3": dict(model_name="llama3", flavor="debug", world_size=2),
         "tp": dict(model_name="llama3", flavor="debug", world_size=4, tp=2),
         "hsdp": dict(model_name="llama3", flavor="debug", world_size=4, mode="hybrid_shard"),
         "ep": dict(model_name="deepseek_v3", flavor="debug", world_size=4, ep=2)}
BACKENDS = ("aot_eager", "aot_eager_blockbucketing", "aot_eager_autobucketing")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the checkout, installed or not
    sys.path.insert(0, ROOT)
_LOCATION = re.compile(r" File: \S+:\d+ in \w+, code: .*")


def _one(out: str, case: str, backend: str) -> None:
    from simplesharded.tools.cluster_trace import fake_world
    from simplesharded.tools.report import trace_counts

    kw = CASES[case]
    folder = os.path.join(out, f"{case}_{backend}")
    with fake_world(kw["world_size"]):
        counts = trace_counts(backend=backend, dump_graphs=folder, **kw)
    with open(folder + ".counts", "w") as f:
        f.write(repr(sorted((k, sorted(v.items())) for k, v in counts.items())))


def write(out: str) -> int:
    failed = 0
    for case in CASES:
        for backend in BACKENDS:  # a process each: one compile's state never meets another's
            p = subprocess.run([sys.executable, __file__, "_one", out, case, backend],
                               capture_output=True, text=True)
            if p.returncode:
                failed += 1
                print(f"{case} {backend}: failed\n{p.stderr[-2000:]}", file=sys.stderr)
    return 1 if failed else 0


def _stages(folder: str) -> dict:
    out = {}
    for name in sorted(os.listdir(folder)):
        m = re.match(r"\d+_(\w+?)_(\w+)\.txt$", name)
        with open(os.path.join(folder, name)) as f:
            out.setdefault((m.group(1), m.group(2)), []).append(_LOCATION.sub("", f.read()))
    return out


def compare(old: str, new: str) -> int:
    differ = 0
    for entry in sorted(os.listdir(old)):
        a, b = os.path.join(old, entry), os.path.join(new, entry)
        if entry.endswith(".counts"):
            same = open(a).read() == open(b).read()
            print(f"{entry}: {'same counts' if same else 'COUNTS DIFFER'}")
            differ += not same
            continue
        sa, sb = _stages(a), _stages(b)
        changed = sorted(k for k in sa.keys() & sb.keys() if sa[k] != sb[k])
        only = sorted({s for _, s in sa.keys() ^ sb.keys()})
        print(f"{entry}: {'GRAPHS DIFFER at ' + str(changed) if changed else 'same graphs'}"
              + (f"; passes on one side only: {only}" if only else ""))
        differ += bool(changed)
    return 1 if differ else 0


if __name__ == "__main__":
    verb, *args = sys.argv[1:] or ["--help"]
    if verb == "write" and len(args) == 1:
        sys.exit(write(args[0]))
    if verb == "compare" and len(args) == 2:
        sys.exit(compare(*args))
    if verb == "_one":
        _one(*args)
        sys.exit(0)
    print(__doc__, file=sys.stderr)
    sys.exit(2)
