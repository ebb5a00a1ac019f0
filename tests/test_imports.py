"""The mtprobe package's imports go one way: no cycle among its modules, no module imports the package
root, and an import inside a function (a deferred import) is there only for an optional dependency or
with a reason listed here.

The import graph is built from the source with ``ast``: every ``import`` and ``from ... import``,
at module level or inside a function. ``from pkg import name`` is an edge to ``pkg.name`` when that is
a module (the compiled ``mtprobe._C`` is one, but no node of the graph: it imports nothing of ours),
else to ``pkg``. Importing ``a.b.c`` also runs the package ``a.b``: an edge to it too, except from
``a.b``'s own modules (a module's implicit import of its parent package is not an edge) and except
for the root package, which every submodule import runs first.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "mtprobe"
ROOT = "mtprobe"
COMPILED = {"mtprobe._C"}  # extension modules: importable, but no source and no imports of their own

# Deferred imports of third-party modules that are not install requirements (pyproject's test extra):
# importing them at module level would make them required.
OPTIONAL = {
    "matplotlib": "Spec-Bench's plots only; the test extra installs it",
    "shortuuid": "Spec-Bench's own answer ids when installed, else uuid4",
    "vllm": "the proposer's platform check, inside vLLM's worker only (build/vllm-env; not a requirement)",
}
# Deferred imports of anything else, (importing module, imported module) -> why it is deferred.
DEFERRED: dict[tuple[str, str], str] = {}


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package in ``root`` by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imported(node: ast.Import | ast.ImportFrom, package: str, known: set[str]) -> list[str]:
    """The dotted names ``node`` imports: ``import a.b`` -> ``a.b``; ``from a import b`` -> ``a.b`` when
    that is a module of ``known``, else ``a``; relative imports resolved against ``package``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    names = [f"{source}.{alias.name}" for alias in node.names]
    return [n for n in names if n in known] + ([source] if any(n not in known for n in names) else [])


def _module_of(name: str, mods: set[str]) -> str | None:
    """The most specific module of ``mods`` that ``name`` (a module or a name in one) lies in."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _targets(name: str, importer: str, mods: set[str]) -> set[str]:
    """The graph nodes that importing ``name`` from ``importer`` runs: its module and the packages above
    it, less the root, ``importer`` and ``importer``'s own packages."""
    module = _module_of(name, mods)
    if module is None:
        return set()
    parts = module.split(".")
    chain = {".".join(parts[:i]) for i in range(2, len(parts) + 1)}  # mtprobe.a, mtprobe.a.b, ...
    own = {importer} | {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 1)}
    return {m for m in chain if m in mods and m not in own and m != ROOT} | (
        {ROOT} if module == ROOT and importer != ROOT else set()
    )


def import_edges(root: Path) -> dict[str, dict[str, list[int]]]:
    """Module -> {module it imports -> the lines}, over every import statement of the package."""
    mods = modules(root)
    known = set(mods) | COMPILED
    edges: dict[str, dict[str, list[int]]] = {name: {} for name in mods}
    for name, path in mods.items():
        package = _package_of(name, path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for imported in _imported(node, package, known):
                if imported in COMPILED:
                    continue
                for target in _targets(imported, name, set(mods)):
                    edges[name].setdefault(target, []).append(node.lineno)
    return edges


def find_cycle(edges: dict[str, dict[str, list[int]]]) -> list[str] | None:
    """A cycle of the graph as ``[a, b, ..., a]``, or None: depth-first search, in sorted order."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def deferred_imports(root: Path) -> list[tuple[str, str, int]]:
    """(module, imported module, line) of every import inside a function of the package: an mtprobe
    module as a graph node, anything else by its top-level name."""
    mods = modules(root)
    known = set(mods) | COMPILED
    found = []
    for name, path in mods.items():
        package = _package_of(name, path)
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        nodes = {
            id(n): n for f in functions for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))
        }
        for node in nodes.values():
            for imported in _imported(node, package, known):
                module = _module_of(imported, known) if imported.startswith(f"{ROOT}.") else None
                found.append((name, module or imported.split(".")[0], node.lineno))
    return sorted(found)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


# --- the checks can fail ---------------------------------------------------------------------------


def test_the_graph_builder_finds_a_cycle_and_only_real_edges(tmp_path: Path) -> None:
    pkg = _write(
        tmp_path / "mtprobe",
        {
            "__init__.py": "from mtprobe import a, _C\n",
            "a.py": "import json\nfrom mtprobe.sub.c import thing\n",
            "sub/__init__.py": "from .c import thing\n",
            "sub/c.py": "from mtprobe import _C\nfrom .. import b\n",
            "b.py": "def late():\n    from mtprobe import a\n    import scipy.stats\n",
            "d.py": "from mtprobe import __version__\n",
        },
    )
    edges = import_edges(pkg)
    assert edges["mtprobe"] == {"mtprobe.a": [1]}  # _C is no node; the root may import submodules
    assert edges["mtprobe.a"] == {"mtprobe.sub": [2], "mtprobe.sub.c": [2]}  # the package it runs too
    assert edges["mtprobe.sub"] == {"mtprobe.sub.c": [1]}  # relative; the parent package is no edge
    assert edges["mtprobe.sub.c"] == {"mtprobe.b": [2]}  # `from .. import b`: the module b
    assert edges["mtprobe.d"] == {"mtprobe": [1]}  # a name of the root: an edge to the root
    assert find_cycle(edges) == ["mtprobe.a", "mtprobe.sub", "mtprobe.sub.c", "mtprobe.b", "mtprobe.a"]
    assert deferred_imports(pkg) == [("mtprobe.b", "mtprobe.a", 2), ("mtprobe.b", "scipy", 3)]
    del edges["mtprobe.b"]["mtprobe.a"]
    assert find_cycle(edges) is None


# --- the package ---------------------------------------------------------------------------------


def test_no_import_cycle() -> None:
    edges = import_edges(PACKAGE)
    assert len(edges) > 50 and sum(map(len, edges.values())) > 100  # the builder saw the package
    cycle = find_cycle(edges)
    assert cycle is None, (
        "import cycle: "
        + " -> ".join(f"{a} (line {edges[a][b][0]})" for a, b in zip(cycle, cycle[1:], strict=False))
        + f" -> {cycle[-1]}"
    )


def test_no_module_imports_the_package_root() -> None:
    # The root imports its submodules to re-export their names; a submodule reaches a name through the
    # submodule that defines it, never through the root.
    importers = {m: e[ROOT] for m, e in import_edges(PACKAGE).items() if ROOT in e}
    assert not importers, f"modules that import the package root {ROOT!r} (module: lines): {importers}"


def test_deferred_imports_have_a_reason() -> None:
    found = deferred_imports(PACKAGE)
    unexplained = [
        f"{module} line {line}: {imported}"
        for module, imported, line in found
        if imported not in OPTIONAL and (module, imported) not in DEFERRED
    ]
    assert not unexplained, (
        "imports inside functions without a reason; import at module level, or list an optional "
        "dependency in OPTIONAL or the import in DEFERRED with why: " + "; ".join(unexplained)
    )
    used = {(module, imported) for module, imported, _ in found}
    stale = sorted(set(DEFERRED) - used) + sorted(set(OPTIONAL) - {imported for _, imported in used})
    assert not stale, f"reasons for deferred imports that no longer exist (remove them): {stale}"


# --- the floors ------------------------------------------------------------------------------------

# The package's floors, lowest first (CONTRIBUTING.md, "Layout"): a module imports its own floor and
# those below it, never one above. The deepest prefix that names a module decides its floor.
FLOORS: dict[str, int] = {
    # 1: what everything needs, importing nothing above it
    "mtprobe._jsonl": 1,
    "mtprobe._env": 1,
    "mtprobe.registry": 1,
    "mtprobe.identity": 1,
    "mtprobe.state": 1,
    "mtprobe.ops": 1,
    "mtprobe.tree_attention": 1,
    "mtprobe.models": 1,
    "mtprobe.data": 1,
    "mtprobe.reference": 1,
    "mtprobe.analysis": 1,
    # 2: the CPU's kernels and routes; 3: the target model as the loop sees it
    "mtprobe.cpu": 2,
    "mtprobe.target_model": 3,
    # 4: what drafters are made of; 5: the drafters, one module a method; 6: the decode path
    "mtprobe.heads": 4,
    "mtprobe.topology": 4,
    "mtprobe.drafters": 5,
    "mtprobe.decode": 6,
    # 7: the offline builders, the Spec-Bench harness, the drafters inside vLLM; 8: the programs; 9: the
    # package's face
    "mtprobe.offline": 7,
    "mtprobe.specbench": 7,
    "mtprobe.vllm": 7,
    "mtprobe.cli": 8,
    "mtprobe.__main__": 8,
    "mtprobe": 9,
}
# Modules of floor 1 that import nothing of the package at all (the extension aside).
ALONE = ("mtprobe.identity", "mtprobe.state", "mtprobe.registry", "mtprobe.models", "mtprobe._env")


def floor_of(module: str) -> int | None:
    name = module
    while name:
        if name in FLOORS:
            return FLOORS[name]
        name = name.rpartition(".")[0]
    return None


def upward_imports(edges: dict[str, dict[str, list[int]]]) -> list[str]:
    """Every edge from a lower floor to a higher one, as ``a (floor) -> b (floor): lines``."""
    found = []
    for a, targets in sorted(edges.items()):
        for b, lines in sorted(targets.items()):
            if floor_of(a) is not None and floor_of(b) is not None and floor_of(b) > floor_of(a):
                found.append(f"{a} ({floor_of(a)}) -> {b} ({floor_of(b)}): lines {lines}")
    return found


def test_the_floor_check_finds_an_import_that_points_up() -> None:
    edges = {
        "mtprobe.cpu.machine": {"mtprobe.target_model.adapter": [3]},
        "mtprobe.decode.generate": {"mtprobe.cpu": [1]},
    }
    assert upward_imports(edges) == ["mtprobe.cpu.machine (2) -> mtprobe.target_model.adapter (3): lines [3]"]


def test_every_module_has_a_floor_and_imports_point_down() -> None:
    edges = import_edges(PACKAGE)
    unplaced = sorted(m for m in edges if floor_of(m) is None)
    assert not unplaced, f"modules on no floor (add their package to FLOORS): {unplaced}"
    up = upward_imports(edges)
    assert not up, "imports that point up a floor:\n" + "\n".join(up)


def test_the_lowest_modules_import_nothing_of_the_package() -> None:
    edges = import_edges(PACKAGE)
    for module in ALONE:
        own = {m for m in edges if m == module or m.startswith(module + ".")}
        outside = {b for a in own for b in edges[a] if b not in own}
        assert not outside, f"{module} imports {sorted(outside)}; it must import nothing of mtprobe"


def test_no_module_is_over_600_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert not long, f"modules over 600 lines (split them by concept): {long}"


def test_no_method_configuration_is_tested_outside_the_drafters() -> None:
    # What a method adds to the shared path is on its registration (mtprobe.registry.Method's hooks and
    # flags); the decode path, the harness and the programs never ask a configuration's class.
    configs = (
        "PlainConfig|ProbeConfig|PromptLookupConfig|StandConfig|LookaheadConfig|HybridConfig|DraftModelConfig"
        "|EntMTPConfig|HeadsConfig|AutoConfig|GreedyConfig|HFPromptLookupConfig"
    )
    pattern = re.compile(r"isinstance\([^)]*\b(" + configs + r")\b")
    found = [
        f"{p.relative_to(PACKAGE)}:{i}"
        for p in PACKAGE.rglob("*.py")
        if "drafters" not in p.relative_to(PACKAGE).parts
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, f"isinstance tests of a method's configuration outside mtprobe/drafters/: {found}"
