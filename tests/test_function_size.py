"""A budget that keeps functions readable: no function or method of attr_engine is longer than 80 lines, its
docstring not counted (issue #22: `run_explain` had grown to 183 lines holding both engines). A function that
needs more is split where its steps are."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUDGET = 80


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the end of the function."""
    body = node.body
    has_doc = (
        isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    )
    first = body[1] if has_doc and len(body) > 1 else body[0]
    assert node.end_lineno is not None
    return node.end_lineno - first.lineno + 1


def _long_functions(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _body_lines(node) > BUDGET:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({_body_lines(node)} lines)")
    return found


def test_no_function_of_the_library_is_over_the_budget() -> None:
    assert _long_functions(REPO / "attr_engine") == []


def test_the_budget_counts_code_not_docstrings(tmp_path) -> None:
    doc = '    """' + "\n".join(["text"] * 100) + '"""\n'
    code = "".join(f"    x{i} = {i}\n" for i in range(BUDGET + 1))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"def documented():\n{doc}    return 1\n\ndef long():\n{code}")
    assert [entry.split()[1] for entry in _long_functions(tmp_path / "pkg")] == ["long"]
