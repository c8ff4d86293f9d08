"""The package's own structure: every module imports the others at its top, and the imports
between them form no circle (a module can be read, and changed, after those it imports)."""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

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


@functools.cache
def _parsed(text: str, filename: str) -> ast.Module:
    """``text`` parsed, once for the scans below (which only read the tree)."""
    return ast.parse(text, filename)


def _graph(typing: bool = False) -> tuple[dict[str, set[str]], list[str]]:
    """Each module's top-level gradhooks imports (with ``typing``, also those under
    ``if TYPE_CHECKING:``), and the imports found inside functions."""
    graph: dict[str, set[str]] = {}
    inside: list[str] = []
    for path in sorted(ROOT.rglob("*.py")):
        name = _module_name(path)
        tree = _parsed(path.read_text(), str(path))
        graph[name] = set()
        top = list(tree.body)
        if typing:
            for node in tree.body:
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    top.extend(node.body)
        for node in top:
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
    _assert_no_circle(_graph()[0])


def test_the_engine_imports_form_no_circle_even_for_types():
    """Inside ``gradhooks.engine`` not even the imports made for type hints alone form a circle:
    each part of the engine names only the parts it calls (a ``Protocol`` where a part calls
    one that imports it)."""
    graph, _ = _graph(typing=True)
    _assert_no_circle({n: ms for n, ms in graph.items() if n.startswith("gradhooks.engine")})


def _assert_no_circle(graph: dict[str, set[str]]) -> None:
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


# names under which code outside the engine holds a handle or the engine (a Tracker's
# ``self.engine``, a workflow's ``hooks``/``h``)
_HANDLE_NAMES = {"hooks", "h", "handle", "engine"}


def _private_uses(root: Path) -> list[str]:
    """``<handle>._<name>`` (``hooks._params``, ``self.engine._nested()``) in the modules
    outside ``gradhooks/engine/``: each place, as ``path:line: text``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if (root / "engine") in path.parents:
            continue
        tree = _parsed(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")):
                continue
            if node.attr.startswith("__"):
                continue
            holder = node.value
            name = holder.id if isinstance(holder, ast.Name) else getattr(holder, "attr", None)
            if name in _HANDLE_NAMES:
                where = path.relative_to(root.parent)
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_outside_the_engine_touches_its_private_members():
    """The workflows (DP, K-FAC, Jacobians, distributed), the autograd-hacks layer and the
    tracker reach a handle through its public API, ``gradhooks.engine.api.engine_of`` and
    ``gradhooks.tracking.link.EngineLink``, never through its private members."""
    found = _private_uses(ROOT)
    assert not found, "private members of a handle used outside gradhooks/engine/:\n" + "\n".join(
        found
    )


def test_the_private_use_scan_sees_one(tmp_path):
    pkg = tmp_path / "gradhooks"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "engine" / "handle.py").write_text("hooks._params\n")  # (the engine's own: allowed)
    (pkg / "dp.py").write_text("def f(hooks, x):\n    x._y\n    return hooks._written\n")
    (pkg / "t.py").write_text("class T:\n    def f(self):\n        self.engine._nested()\n")
    assert _private_uses(pkg) == [
        "gradhooks/dp.py:3: hooks._written",
        "gradhooks/t.py:3: self.engine._nested",
    ]


def test_the_scan_sees_an_import_for_types(tmp_path, monkeypatch):
    pkg = tmp_path / "gradhooks"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "a.py").write_text("from .b import f\n")
    (pkg / "engine" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import g\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    assert _graph()[0]["gradhooks.engine.b"] == set()
    assert _graph(typing=True)[0]["gradhooks.engine.b"] == {"gradhooks.engine.a"}
    try:
        test_the_engine_imports_form_no_circle_even_for_types()
    except AssertionError as e:
        assert "gradhooks.engine.a -> gradhooks.engine.b -> gradhooks.engine.a" in str(e)
    else:
        raise AssertionError("the circle a -> b -> a (for types) was not found")


def test_the_bench_imports_form_no_circle():
    """``bench/``'s modules, also counting imports made inside functions."""
    bench = ROOT.parent / "bench"
    if not bench.is_dir():
        pytest.skip("bench/ is not beside the installed package")
    graph: dict[str, set[str]] = {}
    for path in sorted(bench.glob("*.py")):
        graph[path.stem] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = [node.module] if node.module else [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench"):
                rest = node.module.split(".")[1:]
                names = rest[:1] if rest else [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name.split(".")[1] for a in node.names if a.name.startswith("bench.")]
            else:
                continue
            graph[path.stem].update(n.split(".")[0] for n in names if n.split(".")[0] != path.stem)
    _assert_no_circle(graph)


def test_hooks_on_an_unsharded_model_leave_distributed_tensors_unimported():
    """A model can hold FSDP2's sharded parameters only where ``torch.distributed.tensor`` was
    imported: ``add_hooks`` does not import it itself (about half a second at every start), and
    a step of the hooked model does not either."""
    import subprocess

    script = (
        "import sys, torch, gradhooks\n"
        "assert 'torch.distributed.tensor' not in sys.modules, 'imported by torch or gradhooks'\n"
        "m = torch.nn.Linear(3, 2)\n"
        "with gradhooks.add_hooks(m):\n"
        "    m(torch.randn(4, 3)).sum().backward()\n"
        "assert m.weight.grad1.shape == (4, 2, 3)\n"
        "print(sorted(n for n in ('torch.distributed.tensor', 'torch.distributed.fsdp') "
        "if n in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
        cwd=ROOT.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


_CONFLICT = ("<" * 7 + " ", ">" * 7 + " ")


def test_no_file_holds_a_merge_conflict_marker():
    """A merge whose conflict was committed as it stood leaves its markers in the text (a
    docstring keeps both sides and still imports): no line of the package, its tests, bench
    or documents starts with one."""
    repo = ROOT.parent
    paths = [p for d in ("gradhooks", "tests", "bench", "docs") for p in (repo / d).rglob("*")]
    paths += [repo / n for n in ("README.md", "CHANGELOG.md", "setup.cfg", "pyproject.toml")]
    found = []
    for path in paths:
        if path.suffix not in (".py", ".md", ".cfg", ".toml") or not path.is_file():
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if line.startswith(_CONFLICT) or line == "=" * 7:
                found.append(f"{path.relative_to(repo)}:{i}")
    assert not found, f"merge-conflict markers: {found}"


def _defined_twice(path: Path) -> list[str]:
    """The names a module's top level binds by ``def`` or ``class`` more than once."""
    seen: set[str] = set()
    twice = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name in seen:
                twice.append(f"{path.name}: {node.name} (line {node.lineno})")
            seen.add(node.name)
    return twice


def test_no_module_defines_a_function_or_class_twice():
    """A second ``def`` of a name at a module's top level replaces the first for every caller,
    also those above it: two sets of tests merged into one file, each with its own helper of
    the same name, would run one set against the other's helper (an operation sweep whose
    every run then failed and counted as nothing to check). Linters let it pass where the
    first is used before the second is defined."""
    repo = ROOT.parent
    paths = [p for d in ("gradhooks", "tests", "bench") for p in (repo / d).rglob("*.py")]
    found = [entry for path in paths for entry in _defined_twice(path)]
    assert not found, f"defined twice: {found}"


def test_the_twice_defined_scan_sees_one(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "def f():\n    return g()\n\n\ndef g():\n    return 1\n\n\ndef g():\n    return 2\n"
    )
    assert _defined_twice(module) == ["m.py: g (line 9)"]
