"""The outputs of a job: map files and pictures written atomically, the journal, and what is already done.

One :class:`OutputWriter` turns either engine's results into files: maps (``.npy`` / ``.safetensors``, float32 or
float16, or none), per-input pictures (:func:`attr_engine.visualize.save_map_figure`), then a journal line per
finished input (``OUT/_manifest/rank<R>-of-<N>.jsonl``: the output and the settings digest), and the recorded
settings (``explain.json``) once the first map exists. :func:`read_journal` and :func:`valid_output` decide what a
rerun may skip.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from attr_engine.jobs.inputs import Item, ItemResult
from attr_engine.jobs.job import SETTINGS_FILE

if TYPE_CHECKING:
    import torch

__all__ = [
    "JOURNAL_SUFFIX",
    "MANIFEST_DIR",
    "Journal",
    "OutputWriter",
    "read_journal",
    "remove_stale_temporaries",
    "valid_output",
]

MANIFEST_DIR = "_manifest"
JOURNAL_SUFFIX = ".jsonl"


def read_journal(out: Path) -> dict[str, str]:
    """``{map output: settings digest}`` from every journal under ``out`` (the newest entry per output wins).

    A torn last line (a kill during the append) or a malformed one is ignored: its output is simply redone.
    """
    return Journal(out).refresh()


class Journal:
    """Every journal under ``out``, read incrementally: :meth:`refresh` reads only what was appended since the last
    call (by this process or another job writing into the same directory), so checking an item before it is
    computed costs the new lines, not the whole file."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self._offsets: dict[Path, int] = {}
        self._newest: dict[str, tuple[int, str]] = {}

    def refresh(self) -> dict[str, str]:
        """``{map output: settings digest}`` as the journals stand now."""
        for path in sorted((self.out / MANIFEST_DIR).glob(f"*{JOURNAL_SUFFIX}")):
            start = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(start)
                    data = f.read()
            except OSError:
                continue
            complete = data.rfind(b"\n") + 1  # a line still being written is read next time
            self._offsets[path] = start + complete
            for line in data[:complete].splitlines():
                self._take(line)
        return {key: digest for key, (_, digest) in self._newest.items()}

    def _take(self, line: bytes) -> None:
        try:
            entry = json.loads(line)
            key, digest, stamp = entry["output"], entry["digest"], int(entry["time_ns"])
        except (ValueError, KeyError, TypeError):
            return
        if isinstance(key, str) and isinstance(digest, str) and stamp >= self._newest.get(key, (-1, ""))[0]:
            self._newest[key] = (stamp, digest)


def valid_output(path: Path, fmt: str, shape: tuple[int, int] | None = None, dtype: str = "float32") -> bool:
    """Whether ``path`` reads back as a complete 2-D map of ``dtype`` (``fmt`` ``"npy"`` / ``"safetensors"``) - of
    ``shape`` when given (maps in an image's frame take that image's size) - or a complete PNG (``"png"``, and
    ``"none"``: a pictures-only run's one output is its picture)."""

    def fits(got: tuple[int, ...]) -> bool:
        return len(got) == 2 and (shape is None or got == tuple(shape))

    import numpy as np

    if not path.is_file():
        return False
    try:
        if fmt == "npy":
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
            return fits(arr.shape) and arr.dtype == np.dtype(dtype)
        if fmt == "safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                if "map" not in f.keys():
                    return False
                stored = f.get_slice("map")
                return fits(tuple(stored.get_shape())) and stored.get_dtype() == _SAFETENSORS_DTYPES[dtype]
        from PIL import Image

        with Image.open(path) as im:
            im.verify()  # reads every chunk and checks its CRC: a truncated or damaged file fails
        return True
    except Exception:  # any failure to read it back means "not a usable output"
        return False


_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16"}


def remove_stale_temporaries(out: Path, items: list[Item], rank: int, world: int) -> int:
    """Delete temporaries a killed run left for this process's outputs (never another live process's)."""
    from attr_engine.atomic import TMP_SUFFIX, stale_temporaries

    mine = {out / item.map_file for item in items} | {out / item.png_file for item in items}
    mine.add(out / MANIFEST_DIR / f"rank{rank}-of-{world}.json")
    if world == 1:
        mine.add(out / SETTINGS_FILE)  # with other processes about, one of them may be writing it right now
    removed = 0
    for tmp in stale_temporaries(out):
        # .<target name>.<8 hex digits>.tmp -> <target name>
        target = tmp.with_name(tmp.name[1 : -len(TMP_SUFFIX)].rsplit(".", 1)[0])
        if target in mine:
            tmp.unlink(missing_ok=True)
            removed += 1
    return removed


class OutputWriter:
    """Writes one input's outputs (map, picture) atomically, then its journal line: the same for both engines.

    Args:
        out: the output directory.
        settings: :func:`~attr_engine.jobs.job_settings` (recorded in ``explain.json`` once the first map exists);
            ``digest``: its :func:`~attr_engine.jobs.settings_digest`, written on every journal line.
        journal: the open journal file (``OUT/_manifest/rank<R>-of-<N>.jsonl``).
        fmt: map format (:data:`FORMATS`; ``"none"``: no map file, the picture alone); ``map_dtype``: the map's
            stored dtype (:data:`MAP_DTYPES`).
        png: also the per-input picture (:func:`attr_engine.visualize.save_map_figure`); ``cmap`` / ``alpha``: its
            colours, ``layout`` (``"overlay"`` / ``"side-by-side"``) and ``max_side``: its arrangement and size.
        class_names: ``{class id: name}`` for the captions, where the names are known to be the classifier's
            (the caption says ``class 3`` otherwise).
    """

    def __init__(
        self,
        out: Path,
        settings: dict[str, Any],
        journal: IO[str],
        *,
        digest: str,
        fmt: str,
        png: bool,
        cmap: str | None = None,
        alpha: float = 0.7,
        map_dtype: str = "float32",
        layout: str = "overlay",
        max_side: int = 2048,
        class_names: Mapping[int, str] | None = None,
    ) -> None:
        if fmt == "none" and not png:
            raise ValueError("format 'none' writes pictures only: it needs png=True")
        self.out, self.settings, self.journal = out, settings, journal
        self.fmt, self.png, self.cmap, self.alpha = fmt, png, cmap, alpha
        self.map_dtype, self.layout, self.max_side = map_dtype, layout, max_side
        self.class_names = dict(class_names or {})
        self.digest = digest
        self.written: list[dict[str, Any]] = []
        self.recorded = False

    def write(self, result: ItemResult) -> None:
        """``result.map``: the map in its output frame, ``(h, w)`` (image) or ``(H, W)`` (model); ``result.shown``:
        the ``(3, ., .)`` float picture in [0, 1] its overlay is drawn on (needed with ``png``)."""
        from attr_engine.checkpoint import save_json

        item, amap = result.item, result.map
        assert amap is not None  # only results with a map are written
        if self.fmt != "none":
            meta = {"input": item.name, "method": self.settings["method"], "target": str(result.target)}
            if self.settings["frame"] == "image":
                meta["frame"] = "image"
            _write_map(_stored(amap.contiguous(), self.map_dtype, item.name), self.out / item.map_file, self.fmt, meta)
        if self.png:
            self._picture(result)
        # One line per finished input, after its files are in place: a kill before it redoes the input.
        line = {"output": item.map_file.as_posix(), "digest": self.digest, "time_ns": time.time_ns()}
        self.journal.write(json.dumps(line) + "\n")
        self.journal.flush()
        if not self.recorded:
            # Recorded once a map exists: a run that fails before leaves nothing to block a rerun.
            save_json(self.settings, self.out / SETTINGS_FILE)
            self.recorded = True
        self.written.append({"input": item.name, "output": item.map_file.as_posix(), "target": result.target})

    def _picture(self, result: ItemResult) -> None:
        """The input's picture: overlay, colour bar and the caption (method, class, probability)."""
        from attr_engine.visualize import figure_caption, save_map_figure

        assert result.shown is not None and result.map is not None  # the engines return the shown image with png
        name = self.class_names.get(result.target)
        caption = figure_caption(self.settings["method"], result.target, result.probability, name)
        save_map_figure(
            result.shown, result.map, self.out / result.item.png_file, caption=caption, layout=self.layout,
            cmap=self.cmap, alpha=self.alpha, max_side=self.max_side,
        )  # fmt: skip


def _stored(amap: torch.Tensor, dtype: str, name: str) -> torch.Tensor:
    """``amap (h, w)`` float32 as it is stored: itself, or float16 (NaN stays NaN); a map whose finite values
    overflow float16 is refused rather than stored as infinities."""
    import torch

    if dtype == "float32":
        return amap
    half = amap.half()
    if not torch.equal(torch.isfinite(half), torch.isfinite(amap)):
        big = float(amap[torch.isfinite(amap)].abs().max())
        raise ValueError(f"{name}: map values up to {big:.3g} exceed float16's range (65504): use --map-dtype float32")
    return half


def _write_map(amap: torch.Tensor, path: Path, fmt: str, meta: dict[str, str]) -> None:
    import numpy as np

    from attr_engine.atomic import atomic_write
    from attr_engine.checkpoint import save_safetensors

    if fmt == "npy":
        with atomic_write(path, "wb") as f:
            np.save(f, amap.numpy())
    else:
        save_safetensors({"map": amap}, path, meta)
