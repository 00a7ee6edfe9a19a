"""The packages' import structure, read from the source: imports run one way between packages
(graphs <- capture, solvers <- planner) and between planner's layers (execution <- core <- whole, inplace <- tools),
solvers never import torch, no module imports itself back through others (an import inside a function counts: it
is a dependency all the same), and an import of the project inside a function is one of a short list, each with
its reason."""
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
# planner's layers, lowest first: what each may import of planner (graphs, capture and solvers are below them all)
PLANNER_LAYERS = {
    "planner.execution": set(),
    "planner.core": {"planner.execution"},
    "planner.whole": {"planner.core", "planner.execution"},
    "planner.inplace": {"planner.core", "planner.execution"},
    "planner.compiled": {"planner.core", "planner.execution"},
    "planner.tools": {"planner.whole", "planner.inplace", "planner.compiled", "planner.core", "planner.execution"},
}
# (module, function, imported module) -> why the import is inside the function
FUNCTION_LEVEL_IMPORTS = {
    ("planner.tools.cli", "cmd_plan", "planner.whole.api"): "`python -m planner solve` starts without torch",
    ("planner.tools.cli", "cmd_fit", "planner.whole.api"): "`python -m planner solve` starts without torch",
    ("planner.tools.cli", "cmd_fit", "planner.tools.fit"): "`python -m planner solve` starts without torch",
    ("planner.tools.cli", "cmd_fit", "planner.core.progress"): "`python -m planner solve` starts without torch",
    ("planner.tools.cli", "cmd_curve", "planner.tools.curve"): "`python -m planner solve` starts without torch",
    ("planner.tools.cli", "cmd_curve", "planner.core.progress"): "`python -m planner solve` starts without torch",
    ("planner.tools.cli", "cmd_show", "planner.core.plan_type"): "`python -m planner solve` starts without torch",
    ("planner.tools.cli", "cmd_min_budget", "solvers.bounds.min_budget"): "each command imports only what it runs",
}


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


def _layer(module: str) -> str | None:
    return next((layer for layer in PLANNER_LAYERS if module == layer or module.startswith(layer + ".")), None)


def test_planner_layers_import_downwards():
    bad = []
    for a, b in _graph().edges:
        la, lb = _layer(a), _layer(b)
        if la is not None and b.startswith("planner") and lb != la and lb not in PLANNER_LAYERS[la]:
            bad.append((a, b))
    assert not bad, f"imports against planner's layers (execution <- core <- whole, inplace <- tools): {bad}"
    assert all(_layer(m) is not None for m in _modules() if m.startswith("planner.") and m != "planner.__main__"), \
        "a planner module outside the layers"


def _function_level_imports(name: str, path: Path, known: set[str]) -> set[tuple[str, str, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            out |= {(name, fn.name, m) for m in mods if m.split(".")[0] in PROJECT}
    return out


def test_function_level_imports_of_the_project_are_listed_with_a_reason():
    mods = _modules()
    found = set()
    for name, path in mods.items():
        if name.split(".")[0] in PACKAGES:
            found |= _function_level_imports(name, path, set(mods))
    unlisted = sorted(found - set(FUNCTION_LEVEL_IMPORTS))
    assert not unlisted, f"imports inside functions (move them to the top, or list them with their reason): {unlisted}"
    assert not set(FUNCTION_LEVEL_IMPORTS) - found, "listed imports that are no longer there"


def test_the_layer_check_sees_an_upward_import(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from planner.whole.api import plan\n")
    imports = _imports("planner.execution.a", a, {"planner.whole.api"})
    assert imports == {"planner.whole.api"} and _layer("planner.whole.api") not in PLANNER_LAYERS["planner.execution"]
    found = _function_level_imports("planner.execution.a", a, set())
    assert found == {("planner.execution.a", "f", "planner.whole.api")}
