"""Plain-text tables of row dicts: Markdown (best value per column in bold) and CSV.

The one table writer of the package: :class:`~attr_engine.evaluate.Leaderboard` (``to_markdown`` / ``to_csv``),
the report files and the command line's reports all format their rows here. It imports nothing of attr_engine,
so the leaderboard can carry its own writers while :mod:`attr_engine.report` stays the floor above it.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["csv_text", "format_cell", "markdown_table"]

_ARROWS = {"lower": "↓", "higher": "↑"}


def format_cell(value: Any, digits: int) -> str:
    """``value`` as a table cell: floats with ``digits`` decimals (``digits`` significant digits when very large
    or small), ``nan`` for NaN, anything else as ``str``."""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value != 0 and (abs(value) >= 10 ** (digits + 2) or abs(value) < 10**-digits):
            return f"{value:.{digits}g}"
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str] | None = None,
    *,
    directions: Mapping[str, str] | None = None,
    digits: int = 3,
    bold_best: bool = True,
    title: str = "",
) -> str:
    """A Markdown table of row dicts.

    Args:
        rows: one mapping per table row.
        columns: column order; None takes the keys of the first row.
        directions: ``{column: "lower" | "higher"}``; such columns get an arrow in the header and, with
            ``bold_best``, their best finite value in bold (ties all bold).
        digits: decimals for floats (very large or small values use ``digits`` significant digits).
        title: an optional line above the table.

    Returns:
        The table as a string ending in a newline.
    """
    if not rows:
        raise ValueError("rows is empty")
    columns = list(columns or rows[0].keys())
    directions = dict(directions or {})
    best: dict[str, float] = {}
    for col in columns:
        if col in directions and bold_best:
            values = [float(r[col]) for r in rows if isinstance(r.get(col), int | float) and math.isfinite(r[col])]
            if values:
                best[col] = min(values) if directions[col] == "lower" else max(values)
    header = [f"{c} {_ARROWS[directions[c]]}" if c in directions else c for c in columns]
    lines = [f"**{title}**\n"] if title else []
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c, "")
            text = format_cell(v, digits)
            if (
                c in best
                and isinstance(v, int | float)
                and math.isfinite(v)
                and format_cell(float(v), digits) == format_cell(best[c], digits)
            ):
                text = f"**{text}**"
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def csv_text(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Row dicts as CSV text: a header, then one line per row, floats at full precision, missing cells empty."""
    if not rows:
        raise ValueError("rows is empty")
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=list(columns or rows[0].keys()), extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()
