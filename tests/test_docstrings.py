"""Docstrings state what the code does and why: no docstring of ``attr_engine`` or ``attr_engine_kernels`` (the
folders attr_engine/ and kernels/) longer than 30 lines (a public class's Args / Attributes / Examples sections
aside), and no measurements, experiment histories or issue numbers in docstrings or CLI help texts (those live in
benches/README.md and docs/ with their commands)."""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("attr_engine", "kernels")
MAX_LINES = 30
# Sections of a public class's docstring that may run longer (one line per argument or field).
EXEMPT_SECTIONS = ("Args:", "Arguments:", "Attributes:", "Example:", "Examples:")

_UNIT = r"(?:ns|us|µs|ms|s|sec|min|h|%|x|KB|MB|GB|KiB|MiB|GiB)"
MEASUREMENTS = {
    # "12.4 s against 3.7 s", "2.7 ms vs 0.3 ms": a timing compared with another.
    "comparison": re.compile(rf"\d+(?:\.\d+)?\s?{_UNIT}(?![A-Za-z])[^.\n]{{0,30}}?\b(?:against|versus|vs\.?)\s+~?\d"),
    # "measured 13-20 % faster", "measured: 1 min 10 s": a figure attributed to a measurement.
    "measured figure": re.compile(
        rf"\bmeasured\b(?:[^.\n]|\.(?=\d)){{0,80}}?\d+(?:\.\d+)?\s?{_UNIT}(?![A-Za-z])", re.IGNORECASE
    ),
    # "1 min 10 s on 2 busy cores": a run time on a machine.
    "run time": re.compile(
        r"\d+(?:\.\d+)?\s?(?:ms|s|min|minutes|h|hours)\b[^.\n]{0,30}\bon\s+\d+\s+(?:\w+\s+){0,2}cores?\b"
    ),
    # "some 20x faster", "3.3x slower".
    "speed-up": re.compile(r"\d+(?:\.\d+)?\s?x\s+(?:faster|slower)\b", re.IGNORECASE),
    "history": re.compile(r"\b(?:tried earlier|was tried|previous design|earlier design)\b", re.IGNORECASE),
    "issue number": re.compile(r"\bissue #\d+", re.IGNORECASE),
}


def measurements(text: str) -> list[str]:
    """The measurement-like phrases of ``text``, each as ``"kind: match"``."""
    return [f"{kind}: {m.group(0)}" for kind, rx in MEASUREMENTS.items() for m in rx.finditer(text)]


def counted_lines(doc: str, public_class: bool) -> int:
    """Lines of a cleaned docstring, without the exempt sections of a public class."""
    lines = doc.splitlines()
    if not public_class:
        return len(lines)
    count, in_section = 0, False
    for line in lines:
        stripped = line.strip()
        if stripped in EXEMPT_SECTIONS and not line.startswith(" "):
            in_section = True
            continue
        if in_section and stripped and not line.startswith(" "):
            in_section = False  # the next unindented line ends the section
        count += not in_section
    return count


def _modules() -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def _docstrings(path: Path) -> Iterator[tuple[str, str, bool]]:
    """(where, cleaned docstring, is a public class) of the module and of every class and function in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    rel = path.relative_to(ROOT)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                name = getattr(node, "name", "<module>")
                where = f"{rel}:{getattr(node, 'lineno', 1)} {name}"
                yield where, doc, isinstance(node, ast.ClassDef) and not name.startswith("_")


def _help_texts(path: Path) -> Iterator[tuple[str, str]]:
    """(where, text) of every constant ``help=`` / ``description=`` / ``epilog=`` keyword in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg in ("help", "description", "epilog"):
                    parts = [n.value for n in ast.walk(kw.value) if isinstance(n, ast.Constant)]
                    text = "".join(p for p in parts if isinstance(p, str))
                    if text:
                        yield f"{path.relative_to(ROOT)}:{node.lineno} {kw.arg}=", text


def test_no_docstring_is_longer_than_30_lines() -> None:
    long = [
        f"{where}: {n} lines"
        for path in _modules()
        for where, doc, public_class in _docstrings(path)
        if (n := counted_lines(doc, public_class)) > MAX_LINES
    ]
    assert not long, "docstrings over 30 lines (move notes to docs/ or benches/README.md):\n" + "\n".join(long)


def test_no_measurements_in_docstrings() -> None:
    found = [
        f"{where}: {hit}" for path in _modules() for where, doc, _ in _docstrings(path) for hit in measurements(doc)
    ]
    assert not found, "measurements belong in benches/README.md:\n" + "\n".join(found)


def test_no_timings_in_cli_help() -> None:
    found = [
        f"{where} {text!r}"
        for path in sorted((ROOT / "attr_engine" / "cli").rglob("*.py"))
        for where, text in _help_texts(path)
        if measurements(text)
    ]
    assert not found, "CLI help texts carry no timings:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "text",
    [
        "(measured 12.4 s against 3.7 s on one thread)",
        "2.7 ms against 0.3 ms per call",
        "a float32 K was measured 13-20 % faster",
        "is some 20x faster on the CPU",
        "Min-max normalising, tried earlier, was too soft",
        "From the prototype of issue #13",
        "a smaller run (measured: 1 min 10 s on 2 busy cores)",
        " Measured on 2 CPU cores shared with other jobs: 3.5 to 9 minutes, --quick 1 min 10 s.",
        "the quick demo takes 1 min 10 s on 2 busy cores",
    ],
)
def test_the_checker_flags_measurements(text: str) -> None:
    assert measurements(text)


@pytest.mark.parametrize(
    "text",
    [
        "The cost is measured against anchors in [0, 1], so scores of order one make tau meaningful",
        "x: (B, C, H, W) images; masks (B, S, g, g); 7 taps at sigma 1.0",
        "n_iters: Sinkhorn iterations (30). [official]",
        "1e-7 at spread 1, ~1e-3 at spread 1e6",
        "the 2 x S classifier passes per image",
        "how long a batch waits for more instances (10 ms)",
    ],
)
def test_the_checker_passes_facts(text: str) -> None:
    assert not measurements(text)


def test_public_class_sections_are_exempt_and_nothing_else() -> None:
    doc = inspect.cleandoc(
        """Summary.

        Args:
            a: one.
            b: two.

        Returns:
            something.
        """
    )
    assert counted_lines(doc, public_class=True) == 4  # summary, blank, "Returns:" and its line
    assert counted_lines(doc, public_class=False) == len(doc.splitlines())
