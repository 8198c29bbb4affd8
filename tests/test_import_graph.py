"""The import graph of the packages, read from their source: no module of attr_engine imports itself back through
others (issue #11: aha/model <-> aha/trainer; the registry and the methods), kernels imports nothing of
attr_engine, and the library imports nothing of the command line (issue #22: the floors run kernels <- library <-
cli). Imports inside functions count (a lazy import is still a dependency); those under TYPE_CHECKING count for
the layering, not for the run-time circles.

Two more rules (issue #32):

- **Floors run one way**: kernels -> classifier, data, imageops (and the other foundations) -> explainer, metrics ->
  aha, pullback, baselines -> evaluate, report, jobs -> engines (ray, serving) -> cli. A module imports only from
  its own floor or below, never from a floor above, not even for types.
- **Private stays private**: a ``_private`` module is imported only from inside the package that holds it, and a
  ``_private`` name defined in a module is imported by no other module (the shared internals of one package live in
  a private module of that package, e.g. ``attr_engine_kernels._tl_helpers``). What another package needs is public
  (``attr_engine_kernels.validate``, ``attr_engine.metrics.curves``).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# Import name -> source folder (pyproject.toml maps the kernels' package under kernels/).
FOLDERS = {"attr_engine_kernels": "kernels/attr_engine_kernels", "attr_engine": "attr_engine"}


def _modules(package: str, root: Path = REPO) -> dict[str, Path]:
    found = {}
    folder = root / FOLDERS[package]
    for path in folder.rglob("*.py"):
        parts = (package, *path.relative_to(folder).with_suffix("").parts)
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
    both = {**_modules("attr_engine_kernels"), **_modules("attr_engine")}
    for name, path in _modules("attr_engine_kernels").items():
        assert not any(m == "attr_engine" or m.startswith("attr_engine.") for m in _imports(name, path, both)), name


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


# The first dotted component under attr_engine names a module's floor (the package __init__ re-exports, unfloored).
FLOORS: dict[str, int] = {
    **dict.fromkeys(
        [
            "_optional",
            "_training",
            "artifact",
            "artifact_precision",
            "atomic",
            "checkpoint",
            "claims",
            "classifier",
            "classifier_training",
            "data",
            "distributed",
            "guards",
            "imageops",
            "model_sources",
            "pixels",
            "tables",
            "visualize",
        ],
        1,
    ),
    **dict.fromkeys(["explainer", "metrics", "adapters"], 2),
    **dict.fromkeys(["aha", "pullback", "baselines"], 3),
    **dict.fromkeys(["evaluate", "report", "jobs"], 4),
    **dict.fromkeys(["ray", "serving", "serve", "export"], 5),
    **dict.fromkeys(["cli", "__main__"], 6),
}


def floor(module: str) -> int | None:
    """The floor of an ``attr_engine`` module (0 for kernels), ``None`` for the package itself."""
    if module == "attr_engine_kernels" or module.startswith("attr_engine_kernels."):
        return 0
    parts = module.split(".")
    if len(parts) == 1:
        return None
    if parts[1] not in FLOORS:
        raise AssertionError(f"{module} has no floor: add {parts[1]!r} to FLOORS in {Path(__file__).name}")
    return FLOORS[parts[1]]


def upward_imports(root: Path) -> list[str]:
    known = {**_modules("attr_engine_kernels", root), **_modules("attr_engine", root)}
    found = []
    for name, path in sorted(known.items()):
        mine = floor(name)
        if mine is None:
            continue
        for target in sorted(_imports(name, path, known, type_checking=True)):
            theirs = floor(target)
            if theirs is not None and theirs > mine:
                found.append(f"{name} (floor {mine}) imports {target} (floor {theirs})")
    return found


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _imported_names(name: str, path: Path) -> list[tuple[str, str | None]]:
    """``(module, name or None)`` for every import of ``path`` (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    pairs: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            pairs.extend((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            pairs.extend((base, alias.name) for alias in node.names)
    return pairs


def private_imports(root: Path, importers: tuple[str, ...] = ("attr_engine", "attr_engine_kernels")) -> list[str]:
    known = {**_modules("attr_engine_kernels", root), **_modules("attr_engine", root)}
    found = []
    for name, path in sorted(known.items()):
        if not name.startswith(importers):
            continue
        for module, symbol in _imported_names(name, path):
            if not module.startswith(("attr_engine", "attr_engine_kernels")):
                continue
            dotted = module.split(".") + ([symbol] if symbol and f"{module}.{symbol}" in known else [])
            for i, part in enumerate(dotted):
                owner = ".".join(dotted[:i])
                if _private(part) and not (name == owner or name.startswith(f"{owner}.")):
                    found.append(f"{name} imports the private module {'.'.join(dotted[: i + 1])}")
            if symbol is None or f"{module}.{symbol}" in known or not _private(symbol) or name == module:
                continue
            # A private module's _names are its package's shared internals; any other module's are its own.
            if not any(_private(part) for part in module.split(".")):
                found.append(f"{name} imports the private name {module}.{symbol}")
    return found


def test_no_module_imports_from_a_floor_above() -> None:
    assert upward_imports(REPO) == []


def test_no_module_imports_a_private_name_of_another() -> None:
    assert private_imports(REPO) == []


def test_the_checkers_see_what_they_forbid(tmp_path) -> None:
    pkg = tmp_path / "attr_engine"
    for sub in ("metrics", "baselines"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    ops = tmp_path / "kernels" / "attr_engine_kernels"
    ops.mkdir(parents=True)
    (ops / "__init__.py").write_text("")
    (ops / "_helpers.py").write_text("_pid = 1\n")
    # inside its package: fine
    (ops / "op.py").write_text("from attr_engine_kernels._helpers import _pid\n")
    (pkg / "explainer.py").write_text("_KEEP = object()\n")
    (pkg / "metrics" / "_curves.py").write_text("def f(): pass\n")
    (pkg / "metrics" / "faithfulness.py").write_text("from attr_engine.metrics._curves import f\n")  # fine
    (pkg / "adapters.py").write_text("from attr_engine.explainer import _KEEP\n")
    (pkg / "baselines" / "mda.py").write_text(
        "def g():\n    from attr_engine.metrics import _curves\n    from attr_engine_kernels._helpers import _pid\n"
        "    from attr_engine.evaluate import x\n"
    )
    (pkg / "evaluate.py").write_text("x = 1\n")
    assert private_imports(tmp_path) == [
        "attr_engine.adapters imports the private name attr_engine.explainer._KEEP",
        "attr_engine.baselines.mda imports the private module attr_engine.metrics._curves",
        "attr_engine.baselines.mda imports the private module attr_engine_kernels._helpers",
    ]
    assert upward_imports(tmp_path) == [
        "attr_engine.baselines.mda (floor 3) imports attr_engine.evaluate (floor 4)",
    ]


def test_the_guards_import_only_the_standard_library() -> None:
    """attr_engine.guards holds the checks a command runs before torch is imported: it may import nothing else."""
    import sys

    path = REPO / "attr_engine" / "guards.py"
    imported = {name.split(".")[0] for name, _ in _imported_names("attr_engine.guards", path)}
    assert imported - {"__future__"} <= set(sys.stdlib_module_names), imported
