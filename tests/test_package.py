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
