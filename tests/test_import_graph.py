"""The import graph of the packages, read from their source: no module of attr_engine imports itself back through
others (issue #11: aha/model <-> aha/trainer; the registry and the methods), kernels imports nothing of
attr_engine, and the library imports nothing of the command line (issue #22: the floors run kernels <- library <-
cli). Imports inside functions count (a lazy import is still a dependency); those under TYPE_CHECKING count for
the layering, not for the run-time circles.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _modules(package: str, root: Path = REPO) -> dict[str, Path]:
    found = {}
    for path in (root / package).rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(name: str, path: Path, known: dict[str, Path], *, type_checking: bool = False) -> set[str]:
    """The modules of ``known`` that ``name`` imports anywhere outside ``if TYPE_CHECKING:`` blocks (also inside
    them with ``type_checking``: a type-only import is still an arrow in the layering)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    todo: list[ast.AST] = list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if _is_type_checking(node) and not type_checking:
            todo.extend(getattr(node, "orelse", []))
            continue
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known)
        todo.extend(ast.iter_child_nodes(node))
    resolved = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        # A submodule needs its parent package initialised first, which Python does for it: not an edge back.
        if target and target != name and not name.startswith(f"{target}."):
            resolved.add(target)
    return resolved


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_of_attr_engine_imports_itself_back() -> None:
    known = _modules("attr_engine")
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    assert "attr_engine.aha.trainer" in graph["attr_engine.aha.model"]  # the checker sees real edges
    assert "attr_engine.aha.persistence" in graph["attr_engine.aha.trainer"]
    assert _cycles(graph) == []


def test_the_checker_finds_a_circle_through_a_lazy_import(tmp_path) -> None:
    pkg = tmp_path / "attr_engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from attr_engine.b import g\nfrom attr_engine import c\n")
    (pkg / "b.py").write_text("def g():\n    from attr_engine import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from attr_engine import a\n")
    known = _modules("attr_engine", tmp_path)
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    assert _cycles(graph) == [["attr_engine.a", "attr_engine.b"]]


def test_kernels_import_nothing_of_attr_engine() -> None:
    both = {**_modules("kernels"), **_modules("attr_engine")}
    for name, path in _modules("kernels").items():
        assert not any(m.startswith("attr_engine") for m in _imports(name, path, both)), name


def _is_cli(module: str) -> bool:
    return module == "attr_engine.cli" or module.startswith("attr_engine.cli.")


def test_the_library_imports_nothing_of_the_command_line() -> None:
    """cli/ is the top floor: the job layer, the engines (ray.py) and every other module stand below it, type-only
    imports included. ``python -m attr_engine`` (``__main__``) is the program's entry, the one way in."""
    known = _modules("attr_engine")
    assert any(_is_cli(m) for m in _imports("attr_engine.__main__", known["attr_engine.__main__"], known))
    for name, path in sorted(known.items()):
        if _is_cli(name) or name == "attr_engine.__main__":
            continue
        upward = sorted(m for m in _imports(name, path, known, type_checking=True) if _is_cli(m))
        assert not upward, f"{name} imports {upward} from the command line"


def test_no_circle_even_through_type_only_imports() -> None:
    known = _modules("attr_engine")
    graph = {name: _imports(name, path, known, type_checking=True) for name, path in known.items()}
    assert _cycles(graph) == []


def test_the_checker_sees_a_type_only_import_of_the_command_line(tmp_path) -> None:
    pkg = tmp_path / "attr_engine"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cli" / "__init__.py").write_text("")
    (pkg / "engine.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from attr_engine.cli import x\n"
    )
    known = _modules("attr_engine", tmp_path)
    assert _imports("attr_engine.engine", pkg / "engine.py", known) == set()
    assert _imports("attr_engine.engine", pkg / "engine.py", known, type_checking=True) == {"attr_engine.cli"}
