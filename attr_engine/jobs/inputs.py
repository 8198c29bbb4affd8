"""The inputs of a job: every image under a folder, a file or an ImageFolder tree, and where its outputs go.

Each image's outputs mirror its path under the output directory (:func:`list_inputs`); :class:`ItemResult` is one
input's outcome, the same from every engine. Decoding happens in the engines, one image at a time, so a file that
cannot be read becomes that input's error and the job goes on.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["Item", "ItemResult", "list_inputs"]


@dataclass(frozen=True)
class Item:
    """One input image and where its outputs go (paths relative to the output directory)."""

    path: Path
    name: str
    label: int
    map_file: Path
    png_file: Path


def list_inputs(src: Path, fmt: str) -> list[Item]:
    """Every input image under ``src`` in a stable order.

    Output names mirror the input tree with the image suffix replaced; inputs that would collide (``a.png`` and
    ``a.jpg`` in one folder) keep their suffix in the name instead (``a.png.npy``), and one warning says so, naming
    the first few. With ``fmt="none"`` (pictures only) an item's ``map_file`` is its ``png_file``: the one output
    the journal and the manifest name.
    """
    from attr_engine.data import ImageFolderDataset

    if src.is_dir():
        # Images next to class folders are explained too (label -1): nothing under the input is silently dropped.
        reader = ImageFolderDataset(src, include_unclassified=True)
        rel = [(p.relative_to(src), label) for p, label in reader.samples]
    else:
        if not src.is_file():  # a device (a link to /dev/zero), a pipe: nothing an image can be read from
            raise ValueError(f"cannot read {src}: not a regular file")
        # A one-file "folder": the reader lists the parent (cheaply, nothing decoded) and is pointed at the file.
        reader = ImageFolderDataset(src.parent, extensions=(src.suffix or ".",), include_unclassified=True)
        reader.samples = [(src, -1)]
        rel = [(Path(src.name), -1)]
    stems = Counter(r.with_suffix("") for r, _ in rel)
    items = []
    for (r, label), (path, _) in zip(rel, reader.samples, strict=True):
        base = r.with_suffix("") if stems[r.with_suffix("")] == 1 else r
        png = Path(f"{base.as_posix()}.overlay.png")
        items.append(Item(path, r.as_posix(), label, png if fmt == "none" else Path(f"{base.as_posix()}.{fmt}"), png))
    shared = [r.as_posix() for r, _ in rel if stems[r.with_suffix("")] > 1]
    if shared:
        shown = ", ".join(shared[:4]) + (f" and {len(shared) - 4} more" if len(shared) > 4 else "")
        warnings.warn(
            f"{len(shared)} inputs share their name with another image in their folder ({shown}): their outputs keep "
            f"the image's suffix ({shared[0]}.{'overlay.png' if fmt == 'none' else fmt})",
            stacklevel=2,
        )
    return items


@dataclass
class ItemResult:
    """One input's outcome: its map in the output frame and the overlay's picture, or why it has none.

    ``error`` is ``None``, why the image could not be read, or :data:`attr_engine.explainer.NONFINITE_MAP` when the
    method's map had NaN or infinite values (:attr:`failed`: the input was good, the method was not).
    ``probability`` is the classifier's softmax probability of ``target`` (NaN when unknown), for the caption.
    """

    item: Item
    map: torch.Tensor | None = None
    shown: torch.Tensor | None = None
    target: int = -1
    error: str | None = None
    probability: float = float("nan")

    @property
    def failed(self) -> bool:
        from attr_engine.explainer import NONFINITE_MAP

        return self.error == NONFINITE_MAP
