"""Report writers: Markdown tables, CSV, deletion / insertion curve plots and heatmap grids.

Every function takes plain data (row dicts, ``{name: tensor}`` mappings), so any caller - the leaderboard, the CLI -
can use them; :func:`write_report` is the one writer of a :class:`~attr_engine.evaluate.Leaderboard`'s files, for the
library (``<stem>.md``, ``.csv`` and two figures) and for ``attr-engine evaluate`` / ``demo`` (the same writers under
the CLI's names, plus ``results.json``). The leaderboard itself is data only: its presentation lives here, so this
module depends on ``evaluate`` and never the reverse.

- :func:`markdown_table` (rows -> str), :func:`write_markdown` (-> file)
- :func:`write_csv` (rows -> file)
- :func:`leaderboard_markdown` (leaderboard -> str), :func:`write_leaderboard_csv` (leaderboard -> file)
- :func:`plot_curves` (``{method: {"fractions", "deletion", "insertion"}}`` -> PNG)
- :func:`plot_heatmaps` (images + ``{method: maps}`` -> PNG grid)
- :func:`write_report` (leaderboard -> ``<stem>.md``, ``<stem>.csv``, ``<stem>_curves.png``, ``<stem>_maps.png``,
  optionally a results JSON; any file renamed or left out)

Figures are drawn with matplotlib's object API on an Agg canvas: nothing touches pyplot's global state or the
process-wide backend, and no display is needed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from attr_engine.tables import csv_text, markdown_table

if TYPE_CHECKING:
    from attr_engine.evaluate import Leaderboard

__all__ = [
    "REPORT_FILES",
    "leaderboard_markdown",
    "markdown_table",
    "plot_curves",
    "plot_heatmaps",
    "write_csv",
    "write_leaderboard_csv",
    "write_markdown",
    "write_report",
]


def write_markdown(text: str, path: str | os.PathLike[str]) -> Path:
    """Write Markdown text to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def write_csv(
    rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str], columns: Sequence[str] | None = None
) -> Path:
    """Write row dicts as CSV (:func:`~attr_engine.tables.csv_text`) to ``path`` (parents created); returns it."""
    text = csv_text(rows, columns)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8", newline="")
    return path


def leaderboard_markdown(board: Leaderboard, digits: int = 3) -> str:
    """A leaderboard as a Markdown table: :meth:`Leaderboard.to_markdown
    <attr_engine.evaluate.Leaderboard.to_markdown>`."""
    return board.to_markdown(digits)


def write_leaderboard_csv(board: Leaderboard, path: str | os.PathLike[str]) -> Path:
    """Write a leaderboard's rows as CSV (:meth:`Leaderboard.to_csv <attr_engine.evaluate.Leaderboard.to_csv>`);
    returns the path."""
    board.to_csv(path)
    return Path(path)


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def plot_curves(
    curves: Mapping[str, Mapping[str, torch.Tensor]], path: str | os.PathLike[str], *, title: str = ""
) -> Path:
    """Deletion and insertion curves, one colour per method, side by side; written as PNG.

    Args:
        curves: ``{method: {"fractions": (F,), "deletion": (F,), "insertion": (F,)}}`` (mean curves, the AHA
            protocol); both AUCs are shown in the legend. Drawn by :func:`attr_engine.visualize.plot_curves`.
        path: the PNG to write (parents created).
    """
    from attr_engine.visualize import plot_curves as draw

    return draw(curves, path, title=title)


def plot_heatmaps(
    images: torch.Tensor,
    maps: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    title: str = "",
    cmap: str | None = None,
    alpha: float = 0.7,
    row_labels: Sequence[str] | None = None,
) -> Path:
    """A grid with one row per image: the image, then each method's map over it, colour bars; written as PNG.

    Drawn by :func:`attr_engine.visualize.plot_maps` (signed maps diverging around zero, others sequential, each
    scaled to its 99th percentile).

    Args:
        images: (k, 3, H, W) in [0, 1].
        maps: ``{method: (k, H, W)}``.
        path: the PNG to write (parents created).
        row_labels: one label per image (class and probability).
    """
    from attr_engine.visualize import plot_maps

    return plot_maps(images, maps, path, title=title, cmap=cmap, alpha=alpha, row_labels=row_labels)


# The files write_report writes by default, by kind ("{stem}" filled in); None: not written unless named.
REPORT_FILES: dict[str, str | None] = {
    "markdown": "{stem}.md",
    "csv": "{stem}.csv",
    "curves": "{stem}_curves.png",
    "maps": "{stem}_maps.png",
    "results": None,
}


def write_report(
    board: Leaderboard,
    out_dir: str | os.PathLike[str],
    *,
    stem: str = "leaderboard",
    files: Mapping[str, str | None] | None = None,
    row_labels: Sequence[str] | None = None,
    record: Mapping[str, Any] | None = None,
) -> dict[str, Path]:
    """Write a leaderboard's table (Markdown, CSV), figures (curves, heatmap grid) and results into ``out_dir``.

    The one writer of a leaderboard's files: the library's reports and ``attr-engine evaluate`` / ``demo`` (which
    name them ``leaderboard.csv``, ``curves.png``, ``overlays.png``, ``results.json`` and write their own
    ``report.md`` around :func:`leaderboard_markdown`) all come from here.

    Args:
        board: the leaderboard (:func:`attr_engine.evaluate.evaluate`).
        out_dir: the directory (created if missing).
        stem: the stem of the default file names (:data:`REPORT_FILES`).
        files: file names by kind, replacing the defaults; None leaves a kind out. Kinds: ``"markdown"``
            (:func:`leaderboard_markdown`), ``"csv"`` (:func:`write_leaderboard_csv`), ``"curves"``
            (:func:`plot_curves` of the mean curves), ``"maps"`` (:func:`plot_heatmaps` of the kept images and
            every method's maps), ``"results"`` (JSON: ``record``, the table rows as ``"leaderboard"`` and the
            mean curves as lists as ``"curves"``; not written unless named).
        row_labels: one label per kept image in the maps figure (e.g. the predicted class and its probability).
        record: JSON-ready fields for the results file (setup, timings); ignored when it is not written.

    Returns:
        ``{kind: path}`` for the files written (figures only when the leaderboard holds curves / kept images).

    Raises:
        ValueError: an unknown kind in ``files``.
    """
    unknown = sorted(set(files or {}) - set(REPORT_FILES))
    if unknown:
        raise ValueError(f"unknown report file kind(s) {', '.join(unknown)}; kinds: {', '.join(REPORT_FILES)}")
    names = {kind: None if name is None else name.format(stem=stem) for kind, name in REPORT_FILES.items()}
    names.update(files or {})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    if names["markdown"]:
        written["markdown"] = write_markdown(leaderboard_markdown(board), out / names["markdown"])
    if names["csv"]:
        written["csv"] = write_leaderboard_csv(board, out / names["csv"])
    if names["curves"] and board.curves:
        written["curves"] = plot_curves(board.curves, out / names["curves"], title=board.title)
    if names["maps"] and board.images is not None and len(board.images) and board.maps:
        written["maps"] = plot_heatmaps(
            board.images, board.maps, out / names["maps"], title=board.title, row_labels=row_labels
        )
    if names["results"]:
        from attr_engine.checkpoint import save_json

        curves = {m: {k: v.tolist() for k, v in c.items()} for m, c in board.curves.items()}
        save_json({**(record or {}), "leaderboard": board.rows, "curves": curves}, out / names["results"])
        written["results"] = out / names["results"]
    return written
