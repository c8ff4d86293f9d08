"""The package's own structure: every module imports the others at its top, and the imports
between them form no circle (a module can be read, and changed, after those it imports)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import gradhooks

ROOT = Path(gradhooks.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, node: ast.ImportFrom) -> list[str]:
    """The gradhooks modules a ``from ... import ...`` in ``path`` names."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    if node.level:
        base = package[: len(package) - node.level + 1]
    elif node.module and node.module.split(".")[0] == "gradhooks":
        base = []
    else:
        return []
    stem = ".".join([*base, *(node.module.split(".") if node.module else [])])
    found = []
    for alias in node.names:
        candidate = f"{stem}.{alias.name}"
        is_module = (ROOT.parent / candidate.replace(".", "/")).with_suffix(".py").exists() or (
            ROOT.parent / candidate.replace(".", "/") / "__init__.py"
        ).exists()
        found.append(candidate if is_module else stem)
    return found


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    """Each module's top-level gradhooks imports, and the imports found inside functions."""
    graph: dict[str, set[str]] = {}
    inside: list[str] = []
    for path in sorted(ROOT.rglob("*.py")):
        name = _module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = set()
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                graph[name].update(m for m in _imported(path, node) if m != name)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and _imported(path, node):
                    inside.append(f"{name}.{fn.name} (line {node.lineno})")
    return graph, inside


def test_no_import_inside_a_function():
    _, inside = _graph()
    assert not inside, f"gradhooks modules imported inside functions: {inside}"


def test_the_imports_form_no_circle():
    graph, _ = _graph()
    for name in graph:  # a package's __init__ imports its modules: not an edge back
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".") and m in graph}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(name) :], name]))
        if name in done:
            return
        for m in sorted(graph[name]):
            visit(m, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_the_scan_sees_a_circle_and_an_inner_import(tmp_path, monkeypatch):
    """The scan itself: a package whose two modules import each other, one inside a function."""
    pkg = tmp_path / "gradhooks"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from .a import f\n")
    (pkg / "c.py").write_text("from . import a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    graph, inside = _graph()
    assert graph["gradhooks.a"] == {"gradhooks.b"}
    assert graph["gradhooks.c"] == {"gradhooks.a"}
    assert inside == ["gradhooks.b.f (line 2)"]
    (pkg / "b.py").write_text("from .a import g\n")
    try:
        test_the_imports_form_no_circle()
    except AssertionError as e:
        assert "gradhooks.a -> gradhooks.b -> gradhooks.a" in str(e)
    else:
        raise AssertionError("the circle a -> b -> a was not found")


def _reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules ``start`` imports, directly or through others (a module imported also
    imports its parent packages)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        name = todo.pop()
        for m in graph.get(name, ()):
            parts = m.split(".")
            for k in range(2, len(parts) + 1):
                parent = ".".join(parts[:k])
                if parent not in seen and parent in graph:
                    seen.add(parent)
                    todo.append(parent)
    return seen


def test_tracking_imports_nothing_from_the_engine():
    """The batch tracker is read, and tested, without the engine: no module of
    ``gradhooks.tracking`` imports ``gradhooks.engine``, directly or through another module."""
    graph, _ = _graph()
    tracking = [
        m for m in graph if m == "gradhooks.tracking" or m.startswith("gradhooks.tracking.")
    ]
    assert len(tracking) > 5, tracking
    for name in tracking:
        bad = sorted(
            m for m in _reached(graph, name) if m.split(".")[:2] == ["gradhooks", "engine"]
        )
        assert not bad, f"{name} imports {bad}"


def test_the_engine_check_sees_an_engine_import(tmp_path, monkeypatch):
    """The check itself: a tracking module that reaches the engine through another module."""
    pkg = tmp_path / "gradhooks"
    for d in ("", "tracking", "engine", "other"):
        (pkg / d).mkdir(parents=True, exist_ok=True)
        (pkg / d / "__init__.py").write_text("")
    for i in range(5):
        (pkg / "tracking" / f"m{i}.py").write_text("")
    (pkg / "tracking" / "m0.py").write_text("from ..other.helper import f\n")
    (pkg / "other" / "helper.py").write_text("from ..engine.handle import g\n")
    (pkg / "engine" / "handle.py").write_text("def g():\n    pass\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    try:
        test_tracking_imports_nothing_from_the_engine()
    except AssertionError as e:
        assert (
            "gradhooks.tracking.m0 imports ['gradhooks.engine', 'gradhooks.engine.handle']"
            in str(e)
        )
    else:
        raise AssertionError("the import of the engine through gradhooks.other was not found")
