"""Users' own images: an ImageFolder-style loader returning RGB tensors in [0, 1].

Two layouts are understood:

- ``root/<class_name>/**/<image>``: one label per subfolder, in sorted folder order (images directly in ``root``
  have no class: they are left out, as in torchvision's ImageFolder, with one warning saying how many, or kept
  with label ``-1`` when ``include_unclassified=True``, as ``attr-engine explain`` does);
- ``root/<image>`` with no class subfolders: a flat folder of images to explain, every label ``-1``.

Links to directories are followed, but every real directory is entered once, through its real path first: a link
to ``.`` or to a parent, or a second link to one folder, lists no image twice.
"""

from __future__ import annotations

import os
import warnings
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset

from attr_engine.guards import check_crop_pct
from attr_engine.imageops import DataConfig, decode_image, pil_to_tensor, preprocess
from attr_engine_kernels.validate import check_int_at_least

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["IMAGE_EXTENSIONS", "ImageFolderDataset"]

IMAGE_EXTENSIONS: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")


def _dir_key(path: Path) -> tuple[int, int] | None:
    """The identity of the directory ``path`` leads to, links followed (None: it cannot be read)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _is_image(path: Path, exts: tuple[str, ...]) -> bool:
    return path.suffix.lower() in exts and not path.name.startswith(".") and path.is_file()


def _images_in(folder: Path, exts: tuple[str, ...]) -> list[Path]:
    """The images directly in ``folder``, sorted."""
    return sorted(p for p in folder.iterdir() if _is_image(p, exts))


def _images_under(tops: list[Path], exts: tuple[str, ...], *, claimed: set[tuple[int, int] | None]) -> list[list[Path]]:
    """The images under each folder of ``tops``, sorted, with every real directory entered once.

    Links to directories are followed, but only into a directory no other path has reached: a link to ``.`` or to
    a parent (a loop), or a second way into a folder already listed, would otherwise list its images twice (or
    forever). Real paths come first - every real folder is walked before any link is followed, a class folder
    that is a link included - so a link never takes a folder's images away from the class they are really in.
    ``claimed`` holds directories listed elsewhere (the root); it gains every directory entered here.
    """
    found: list[list[Path]] = [[] for _ in tops]
    links: deque[tuple[int, Path]] = deque()  # (top, link to a directory): followed once no real path is left
    real: deque[tuple[int, Path]] = deque()
    for i, top in enumerate(tops):
        (links if top.is_symlink() else real).append((i, top))

    def enter(i: int, folder: Path) -> None:
        key = _dir_key(folder)
        if key is None or key in claimed:
            return
        claimed.add(key)
        try:
            entries = sorted(folder.iterdir())
        except OSError:  # an unreadable folder holds no images we can read (as rglob skipped it)
            return
        for path in entries:
            try:
                is_dir = path.is_dir()
            except OSError:
                continue
            if is_dir:
                (links if path.is_symlink() else real).append((i, path))
            elif _is_image(path, exts):
                found[i].append(path)

    while real or links:
        i, folder = real.popleft() if real else links.popleft()
        enter(i, folder)
    return [sorted(paths) for paths in found]


class ImageFolderDataset(Dataset):
    """Images from a folder tree, as ``(image (3, H, W) float32 in [0, 1], label int)``.

    Args:
        root: dataset folder (layouts in the module docstring).
        img_size: ``None`` keeps each image's size; an int resizes the shorter side to ``floor(img_size /
            crop_pct)`` (bicubic) and centre-crops ``img_size x img_size`` (timm's evaluation transform): the
            :func:`~attr_engine.imageops.preprocess` of ``self.config``, the very pixels ``attr-engine explain``
            gives a classifier of that input size and ``crop_pct``.
        crop_pct: fraction of the resized image kept by the centre crop (1.0: resize the shorter side straight to
            ``img_size``); ignored when ``img_size`` is None.
        extensions: file suffixes (case-insensitive) treated as images.
        skip_unreadable: decode every image up front and drop those that fail, listing them in ``self.skipped``
            (and in one warning). Costs one full decode per file at construction. When False, a bad file raises
            ValueError naming it at the time it is loaded.
        include_unclassified: in the class layout, keep the images directly in ``root`` with label ``-1`` (listed
            first) instead of leaving them out with a warning.

    Attributes:
        samples: ``[(path, label), ...]`` in a stable, sorted order.
        class_names: subfolder names (empty for a flat folder).
        skipped: ``[(path, reason), ...]`` for files dropped by ``skip_unreadable``.
        unclassified: images directly in ``root`` of a class layout (left out unless ``include_unclassified``).
        config: the resize and crop (``DataConfig((img_size, img_size), crop_pct, "bicubic")``), None without
            ``img_size``.

    Images are read by :func:`~attr_engine.imageops.decode_image` (EXIF-rotated, converted to RGB with alpha
    dropped and greyscale replicated; 8-bit values map 0..255 to [0, 1], 16-bit greyscale 0..65535, float images
    are read as [0, 1] intensities) and made tensors by :func:`~attr_engine.imageops.pil_to_tensor`: the one
    pipeline ``explain`` uses too.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        img_size: int | None = None,
        crop_pct: float = 1.0,
        extensions: Sequence[str] = IMAGE_EXTENSIONS,
        skip_unreadable: bool = False,
        include_unclassified: bool = False,
    ) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"image folder not found: {self.root}")
        if img_size is not None:
            check_int_at_least(img_size, "img_size", 1)
        check_crop_pct(crop_pct)
        self.img_size = img_size
        self.crop_pct = float(crop_pct)
        self.config = None if img_size is None else DataConfig((img_size, img_size), self.crop_pct, "bicubic")
        exts = tuple(e.lower() if e.startswith(".") else f".{e.lower()}" for e in extensions)

        candidates = sorted(d for d in self.root.iterdir() if d.is_dir() and not d.name.startswith("."))
        # The root is listed (its own images) before any folder under it: a link back to it is no class.
        per_class = _images_under(candidates, exts, claimed={_dir_key(self.root)})
        classes = [(d, found) for d, found in zip(candidates, per_class, strict=True) if found]
        self.unclassified: list[Path] = []
        if classes:
            self.class_names: tuple[str, ...] = tuple(d.name for d, _ in classes)
            samples = [(p, label) for label, (_, found) in enumerate(classes) for p in found]
            self.unclassified = _images_in(self.root, exts)
            if include_unclassified:
                samples = [(p, -1) for p in self.unclassified] + samples
            elif self.unclassified:
                warnings.warn(
                    f"{len(self.unclassified)} image(s) directly in {self.root} are in no class folder and are left "
                    f"out (the class layout is root/<class>/<image>)",
                    stacklevel=2,
                )
        else:
            self.class_names = ()
            samples = [(p, -1) for p in _images_in(self.root, exts)]
        if not samples:
            raise ValueError(f"no images with extensions {exts} found in {self.root}")

        self.skipped: list[tuple[Path, str]] = []
        if skip_unreadable:
            kept = []
            for path, label in samples:
                try:
                    decode_image(path)
                except ValueError as err:
                    self.skipped.append((path, str(err.__cause__ or err)))
                else:
                    kept.append((path, label))
            if self.skipped:
                listed = ", ".join(str(p) for p, _ in self.skipped[:5])
                more = f" and {len(self.skipped) - 5} more" if len(self.skipped) > 5 else ""
                warnings.warn(f"skipped {len(self.skipped)} unreadable image(s): {listed}{more}", stacklevel=2)
            if not kept:
                raise ValueError(f"every image in {self.root} is unreadable")
            samples = kept
        self.samples: list[tuple[Path, int]] = samples

    @property
    def num_classes(self) -> int:
        """Number of class subfolders (0 for a flat folder)."""
        return len(self.class_names)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """Sample ``index`` as ``(image (3, H, W) float32 in [0, 1], label)``; ``H = W = img_size`` when set.

        Raises:
            ValueError: the file cannot be read (the message names it).
        """
        path, label = self.samples[index]
        img = decode_image(path)
        return (pil_to_tensor(img) if self.config is None else preprocess(img, self.config)), label

    @staticmethod
    def _decode(path: Path) -> Image.Image:
        """Deprecated: use :func:`attr_engine.imageops.decode_image`, which this only calls.

        Kept for the callers of the old private name (``explain``'s local and Ray engines) until they move to the
        public one. It does not warn: ``explain`` prints library warnings on stderr, whose bytes are pinned.
        """
        return decode_image(path)
