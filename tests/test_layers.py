"""The packages' import structure, read from the source: imports run one way between packages
(graphs <- capture, solvers <- planner), solvers never import torch, and no module imports itself back through
others (an import inside a function counts: it is a dependency all the same)."""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

from tests.conftest import ROOT

PACKAGES = ("graphs", "capture", "solvers", "planner")
# what each package may import from the project
ALLOWED = {
    "graphs": set(),
    "capture": {"graphs"},
    "solvers": {"graphs"},
    "planner": {"graphs", "capture", "solvers"},
}
PROJECT = set(PACKAGES) | {"harness", "examples", "scripts", "tests"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in the file (a `from pkg import mod` names the module)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            if t.split(".")[0] in PROJECT:
                out.add(t)
    return out


def _graph() -> nx.DiGraph:
    mods = _modules()
    known = set(mods)
    g = nx.DiGraph()
    for name, path in mods.items():
        g.add_node(name)
        for t in _imports(name, path, known):
            g.add_edge(name, t)
    return g


def test_packages_import_one_way():
    bad = [(a, b) for a, b in _graph().edges
           if b.split(".")[0] != a.split(".")[0] and b.split(".")[0] not in ALLOWED[a.split(".")[0]]]
    assert not bad, f"imports against the direction graphs <- capture, solvers <- planner: {bad}"


def test_no_import_circle_between_modules():
    g = _graph()
    # a package's __init__ naming its own modules (lazily) is not a circle of the modules themselves
    g.remove_edges_from([(a, b) for a, b in list(g.edges) if a in PACKAGES and b.startswith(a + ".")])
    cycles = list(nx.simple_cycles(g))
    assert not cycles, f"import circles: {cycles[:5]}"


def test_solvers_never_import_torch():
    for path in sorted((ROOT / "solvers").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "torch" for n in names), f"{path} imports torch"


def test_the_check_sees_a_circle(tmp_path):
    """The circle finder reads function-level imports too (a check that cannot fail proves nothing)."""
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from planner import b\n")
    assert _imports("planner.a", a, {"planner.b"}) == {"planner.b"}
