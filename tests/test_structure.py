"""The project's layers, checked from its source: fast, single process.

* ``import simplesharded`` (the library) loads no trainer or tool module, checked in a fresh
  interpreter, and loads a bounded number of project modules.
* The import graph, read with ``ast`` from every file pyproject.toml installs (its package-dir
  mapping gives the module names: passes/ is simplesharded.passes, models/ simplesharded.models),
  nothing imported. Every import counts, at module level or inside a function (a lazy import
  still ties the two modules together), ``importlib.import_module("<name>")`` too;
  ``from X import Y`` where Y is a submodule is an edge to X.Y. The graph has no cycle, counting
  imports under ``if TYPE_CHECKING:`` (they never run, but the importer's code still names
  the imported module's), and:
  - passes/ imports only passes/ (it is usable in any compiler pipeline), torch and the
    standard library;
  - models/ imports only the library, passes/ and models/, never the trainer or the tools;
  - the library (simplesharded/*.py) and its platform shims (simplesharded/shims/) import
    neither the trainer nor the tools.
  - the per-parameter record (simplesharded/storage/sharded_state.py), which every storage module
    reads, imports no project module: it is the bottom of the library.
* Nothing outside simplesharded/storage/ branches on which storage a parameter has: no
  condition outside it reads a record's ``ragged`` slot, names a storage class or compares
  with a storage's name (read with ``ast``; a hand-written module shows each kind is caught).
A rule the code breaks today is an ``xfail(strict=True)`` case naming the edge, so the fix
turns it into a failure that asks to drop the mark.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PKG = "simplesharded"


# ------------------------------------------------------------------ reading the source


def package_folders(root: Path) -> dict[str, Path]:
    """Package name → folder, for every package pyproject.toml installs."""
    with open(root / "pyproject.toml", "rb") as f:
        setup = tomllib.load(f)["tool"]["setuptools"]
    package_dir = setup.get("package-dir", {})

    def folder(package: str) -> Path:
        # as setuptools resolves it: the nearest listed ancestor's folder, then the rest of
        # the dotted name as subfolders
        parts = package.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in package_dir:
                return root.joinpath(package_dir[".".join(parts[:i])], *parts[i:])
        return root.joinpath(*parts)

    return {package: folder(package) for package in setup["packages"]}


def module_files(root: Path) -> dict[str, Path]:
    """Module name → file, for every .py file of every package pyproject.toml installs."""
    files = {}
    for package, folder in package_folders(root).items():
        for path in sorted(folder.glob("*.py")):
            files[package if path.name == "__init__.py" else f"{package}.{path.stem}"] = path
    return files


def _type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """The nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): never run."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (getattr(node.test, "id", None) == "TYPE_CHECKING"
                                         or getattr(node.test, "attr", None) == "TYPE_CHECKING"):
            out.update(n for stmt in node.body for n in ast.walk(stmt))
    return out


def imports_of(module: str, path: Path,
               modules: set[str]) -> tuple[set[str], set[str], set[str]]:
    """(project modules, those of them imported for type checking only, top-level names of
    other modules) that ``module``'s source imports, anywhere in the file."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]

    def owner(name: str) -> str | None:  # the project module that defines a dotted name
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in modules:
                return ".".join(parts[:i])
        return None

    tree = ast.parse(path.read_text(), str(path))
    typing_only = _type_checking_only(tree)
    names = []  # (dotted name, type checking only)
    for node in ast.walk(tree):
        found = []
        if isinstance(node, ast.Import):
            found = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append(sub if sub in modules else source)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found = [node.args[0].value]
        names += [(name, node in typing_only) for name in found]
    runtime, typing, other = set(), set(), set()
    for name, type_only in names:
        target = owner(name)
        if target is None:
            other.add(name.split(".")[0])
        elif target != module:
            (typing if type_only else runtime).add(target)
    return runtime | typing, typing - runtime, other


@dataclasses.dataclass
class Imports:
    edges: dict[str, set[str]]  # module → the project modules it imports
    runtime: dict[str, set[str]]  # the same less imports for type checking only
    other: dict[str, set[str]]  # module → the top-level names of other modules it imports


def import_graph(root: Path) -> Imports:
    files = module_files(root)
    graph = Imports({}, {}, {})
    for module, path in files.items():
        edges, typing, graph.other[module] = imports_of(module, path, set(files))
        graph.edges[module], graph.runtime[module] = edges, edges - typing
    return graph


@functools.cache
def project_graph():
    return import_graph(ROOT)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):  # recursion depth is bounded by the number of modules (about a hundred)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def layer(module: str) -> str:
    """library, passes, models, trainer, tools or shims."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("passes", "models", "trainer", "tools", "shims"):
        return parts[1]
    return "library"


# ---------------------------------------------------------------- the reader itself


def test_reader_finds_every_kind_of_import(tmp_path):
    """On a small tree with the project's package-dir mapping: relative and absolute imports,
    a submodule named by ``from X import Y``, a name from a package's __init__, an import
    inside a function and one by ``importlib.import_module`` are all edges; the standard
    library and torch are not project modules. An import under ``if TYPE_CHECKING:`` is an
    edge too, told apart from a run-time one, and closes a cycle of its own."""
    (tmp_path / "pyproject.toml").write_text(textwrap.dedent("""
        [tool.setuptools]
        packages = ["pkg", "pkg.sub", "pkg.ext"]
        [tool.setuptools.package-dir]
        "pkg" = "pkg"
        "pkg.ext" = "ext"
    """))
    sources = {
        "pkg/__init__.py": "from pkg.a import f\n",
        "pkg/a.py": "import os\nfrom . import b\nfrom pkg.sub import thing\n",
        "pkg/b.py": "def g():\n    from pkg.ext import c\n",
        "pkg/sub/__init__.py": "thing = 1\n",
        "pkg/sub/d.py": "from ..a import f\nimport pkg.ext.c\nfrom . import e\n",
        "ext/__init__.py": "",
        "ext/c.py": ("import importlib\nimport torch.fx\n"
                     "def h():\n    return importlib.import_module('pkg.a')\n"),
        "pkg/sub/e.py": ("from typing import TYPE_CHECKING\nimport pkg.b\n"
                         "if TYPE_CHECKING:\n    from pkg.sub import d\n    import pkg.b\n"),
    }
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path)
    assert graph.edges == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b", "pkg.sub"},
                           "pkg.b": {"pkg.ext.c"}, "pkg.sub": set(),
                           "pkg.sub.d": {"pkg.a", "pkg.ext.c", "pkg.sub.e"},
                           "pkg.sub.e": {"pkg.b", "pkg.sub.d"},
                           "pkg.ext": set(), "pkg.ext.c": {"pkg.a"}}
    # pkg.b is imported at run time as well
    assert graph.runtime == {**graph.edges, "pkg.sub.e": {"pkg.b"}}
    assert graph.other["pkg.a"] == {"os"} and graph.other["pkg.ext.c"] == {"importlib", "torch"}
    # e -> d is type only: it closes the cycle with d only when type-only imports count
    assert cycles(graph.runtime) == [["pkg.a", "pkg.b", "pkg.ext.c"]]
    assert cycles(graph.edges) == [["pkg.a", "pkg.b", "pkg.ext.c"], ["pkg.sub.d", "pkg.sub.e"]]


def test_the_graph_covers_every_layer():
    """The mapping finds each installed package's files (a wrong folder would leave a layer
    empty and its rules vacuous)."""
    edges = project_graph().edges
    layers = {layer(m) for m in edges}
    assert layers == {"library", "passes", "models", "trainer", "tools", "shims"}, layers
    for package in (PKG, f"{PKG}.passes", f"{PKG}.models", f"{PKG}.trainer", f"{PKG}.tools",
                    f"{PKG}.shims"):
        assert package in edges, package
        assert any(m.startswith(package + ".") for m in edges), f"{package} has no modules"


def test_every_package_folder_is_installed():
    """A folder with an __init__.py inside an installed package is itself listed in
    pyproject.toml's packages: an unlisted one is left out of a wheel, and out of this graph."""
    folders = package_folders(ROOT)
    listed = {path.resolve() for path in folders.values()}
    unlisted = sorted(str(init.parent.relative_to(ROOT)) for path in folders.values()
                      for init in path.glob("*/__init__.py") if init.parent.resolve() not in listed)
    assert not unlisted, unlisted


# ------------------------------------------------------------------------- the rules


def test_no_import_cycle():
    """Type-only imports count: a module named by one below it could not be understood, or
    split, without the one that names it."""
    graph = project_graph()
    edges = graph.edges
    found = cycles(edges)
    detail = ["; ".join(f"{a} -> {b}" + ("" if b in graph.runtime[a] else " (type only)")
                        for a in c for b in sorted(edges[a]) if b in c)
              for c in found]
    assert not found, "import cycles:\n" + "\n".join(detail)


def test_the_record_is_the_bottom():
    """The per-parameter record imports no project module, type-only imports included: the
    model-wide objects it points to are typed by Protocols beside it (sharded_state.py)."""
    graph = project_graph()
    record = f"{PKG}.storage.sharded_state"
    assert graph.edges[record] == set(), sorted(
        f"{b}" + ("" if b in graph.runtime[record] else " (type only)")
        for b in graph.edges[record])


STORAGE_PACKAGE = f"{PKG}.storage"
STORAGE_CLASSES = {"RaggedMember", "RaggedShards", "RaggedSlot", "RaggedLayout"}
STORAGE_NAMES = {"param", "ragged"}  # simplesharded/storage/choice.py: STORAGES


def storage_branches(source: str) -> list[tuple[int, str]]:
    """(line, what) of every condition in ``source`` that tests which storage something has:
    the test of an ``if``, conditional expression, ``while``, ``assert`` or comprehension
    filter reading an attribute ``ragged``, naming a storage class, or comparing with a
    storage's name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        tests = [node.test] if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)) \
            else list(node.ifs) if isinstance(node, ast.comprehension) else []
        for test in tests:
            for n in ast.walk(test):
                if isinstance(n, ast.Attribute) and n.attr == "ragged":
                    found.append((test.lineno, "reads .ragged"))
                elif isinstance(n, ast.Name) and n.id in STORAGE_CLASSES:
                    found.append((test.lineno, f"names {n.id}"))
                elif isinstance(n, ast.Compare) and any(
                        isinstance(c, ast.Constant) and c.value in STORAGE_NAMES
                        for c in ast.walk(n)):
                    found.append((test.lineno, "compares with a storage's name"))
    return found


def test_storage_branches_are_found():
    source = textwrap.dedent("""
        if record.ragged is not None: pass
        x = a if isinstance(t, RaggedMember) else b
        assert storage == "ragged"
        ys = [p for p in ps if p.storage in ("param",)]
        if mode == "replicate": pass
    """)
    assert sorted(storage_branches(source)) == [
        (2, "reads .ragged"), (3, "names RaggedMember"), (4, "compares with a storage's name"),
        (5, "compares with a storage's name")]


def test_nothing_outside_the_storage_package_branches_on_storage():
    from simplesharded.storage.choice import STORAGES

    assert set(STORAGES) == STORAGE_NAMES
    outside = {m: p for m, p in module_files(ROOT).items()
               if not (m == STORAGE_PACKAGE or m.startswith(STORAGE_PACKAGE + "."))}
    assert f"{PKG}.sharding" in outside and f"{PKG}.step" in outside
    found = [f"{m}:{line}: {what}" for m, path in sorted(outside.items())
             for line, what in storage_branches(path.read_text())]
    assert found == []


# (name, which modules, the layers they may import, the layers they must not): exactly one of
# the last two is given
RULES = [
    ("passes import only passes", "passes", {"passes"}, None),
    ("models import only the library, passes and models", "models",
     {"library", "passes", "models"}, None),
    ("the library imports neither trainer nor tools", "library", None, {"trainer", "tools"}),
    ("the shims import neither trainer nor tools", "shims", None, {"trainer", "tools"}),
]
# A rule broken today: (source module, imported module) → why. Each is an xfail(strict=True)
# case of its own, and the rule's main case skips it.
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {}


def _breaks(rule, source: str, target: str) -> bool:
    _, source_layer, allowed, forbidden = rule
    if layer(source) != source_layer:
        return False
    return layer(target) not in allowed if allowed is not None else layer(target) in forbidden


def _rule_cases():
    for rule in RULES:
        yield pytest.param(rule, None, id=rule[0].replace(" ", "_"))
        for edge, why in KNOWN_VIOLATIONS.items():
            if _breaks(rule, *edge):
                yield pytest.param(rule, edge, id=" -> ".join(edge),
                                   marks=pytest.mark.xfail(strict=True, reason=why))


@pytest.mark.parametrize("rule,edge", list(_rule_cases()))
def test_layer_rule(rule, edge):
    edges = project_graph().edges
    if edge is not None:
        assert edge[1] not in edges.get(edge[0], ()), f"{rule[0]}: {edge[0]} -> {edge[1]}"
        return
    broken = [f"{a} -> {b}" for a in sorted(edges) for b in sorted(edges[a])
              if _breaks(rule, a, b) and (a, b) not in KNOWN_VIOLATIONS]
    assert not broken, f"{rule[0]}:\n" + "\n".join(broken)


def test_passes_import_only_torch_and_the_standard_library():
    """Outside the project: torch (functorch ships inside torch's wheel) and the standard
    library, nothing a compiler pipeline would have to install besides torch."""
    other = project_graph().other
    allowed = set(sys.stdlib_module_names) | {"torch", "functorch"}
    broken = [f"{m} -> {name}" for m in sorted(other) if layer(m) == "passes"
              for name in sorted(other[m] - allowed)]
    assert not broken, "\n".join(broken)


# ------------------------------------------------------------------ what importing loads

# Measured when written: 26 project modules (the library's 7, passes' 17 through backends'
# pipeline, shims and shims.gloo_gather); 34 once the step graph's passes came (regather,
# in-place update, cross-step note); 36 with room for a module split; 38 with the ragged
# layout and its bucket storage; 39 with the pass that writes gradients into their buckets;
# 40 with the check that a meta-built model was initialised; 41 with torch's checkpoint
# wrapper compiled as our recompute regions; 44 with reordering's jobs in files of their own
# (the gathered-byte spans, context parallelism's overlap, what moves with a wait); 43 once
# flat bucket storage was retired; 44 with the DTensor of a ragged bucket's members; 47 with
# the storage modules in a package of their own (its __init__, the storage choice, ragged
# packing); 48 with host offload (storage/offload.py); 49 with the forwards that open the
# gather scope, the root's and a submodule's called on its own (storage/forward_scope.py); 50
# with FSDP2's methods on the root and its units (fsdp2_methods.py); 51 with the eager
# prefetch (storage/prefetch.py); 52 with the pass that issues host offload's copies ahead
# (passes/offload_copies.py).
# The models (7 modules) or the trainer (11) loaded as well would break it.
MAX_LIBRARY_MODULES = 52


def test_import_simplesharded_loads_no_trainer_or_tool(record_property):
    code = ("import json, sys, simplesharded\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('simplesharded'))))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, timeout=300)
    assert p.returncode == 0, p.stderr
    loaded = json.loads(p.stdout.strip().splitlines()[-1])
    record_property("simplesharded_modules", len(loaded))
    print(f"import simplesharded loads {len(loaded)} project modules: {loaded}")
    assert not [m for m in loaded if layer(m) in ("trainer", "tools")], loaded
    assert len(loaded) <= MAX_LIBRARY_MODULES, loaded
