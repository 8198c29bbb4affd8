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

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import Dataset

from kernels._validate import check_int_at_least, check_positive

__all__ = ["IMAGE_EXTENSIONS", "ImageFolderDataset"]

# Single-channel modes PIL cannot convert to 8-bit RGB without clipping, and the value that maps to 1.0.
_HIGH_DEPTH_SCALE = {"I;16": 65535.0, "I;16L": 65535.0, "I;16B": 65535.0, "I;16N": 65535.0, "I": 65535.0, "F": 1.0}

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
        img_size: ``None`` keeps each image's size; an int resizes the shorter side to ``img_size / crop_pct``
            and centre-crops ``img_size x img_size`` (the usual evaluation transform).
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

    Images are decoded with PIL, EXIF-rotated, and converted to RGB (alpha dropped, greyscale replicated). 8-bit
    images map 0..255 to [0, 1]; 16-bit greyscale (PIL modes ``I;16*``, and ``I`` as PIL opens 16-bit PNG/TIFF)
    maps 0..65535 to [0, 1]; 32-bit float images (mode ``F``, e.g. float TIFF) are read as [0, 1] intensities and
    clipped to that range. (``convert("RGB")`` would clip 16-bit values at 255 and turn the image white.)
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
        if not check_positive(crop_pct, "crop_pct") <= 1.0:
            raise ValueError(f"crop_pct must be in (0, 1], got {crop_pct!r}")
        self.img_size = img_size
        self.crop_pct = float(crop_pct)
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
                    self._decode(path)
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
        path, label = self.samples[index]
        img = self._decode(path)
        if self.img_size is not None:
            img = self._resize_crop(img, self.img_size)
        if img.mode == "F":  # high bit depth, already scaled to [0, 1] by _decode; bicubic may overshoot: clip
            grey = torch.from_numpy(np.asarray(img, dtype=np.float32).copy()).clamp_(0.0, 1.0)
            return grey[None].expand(3, -1, -1).contiguous(), label
        array = np.asarray(img, dtype=np.uint8)
        image = torch.from_numpy(array.copy()).permute(2, 0, 1).float().div_(255.0)
        return image, label

    @staticmethod
    def _decode(path: Path) -> Image.Image:
        """Fully decode ``path`` to an RGB PIL image, or a mode-``F`` greyscale one in [0, 1] for high bit depths.

        Any failure becomes a ValueError naming the file.
        """
        try:
            with Image.open(path) as im:
                im.load()
                im = ImageOps.exif_transpose(im)
                scale = _HIGH_DEPTH_SCALE.get(im.mode)
                if scale is not None:
                    values = np.asarray(im, dtype=np.float32) / scale
                    return Image.fromarray(np.clip(values, 0.0, 1.0).astype(np.float32))  # mode F
                return im.convert("RGB")
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
            # PIL reports truncated or foreign files as OSError / UnidentifiedImageError (an OSError) / SyntaxError.
            raise ValueError(f"cannot read image {path}: {err}") from err

    def _resize_crop(self, img: Image.Image, size: int) -> Image.Image:
        w, h = img.size
        short = max(size, round(size / self.crop_pct))
        scale = short / min(w, h)
        new_w, new_h = max(size, round(w * scale)), max(size, round(h * scale))
        img = img.resize((new_w, new_h), Image.Resampling.BICUBIC, reducing_gap=3.0)
        left, top = (new_w - size) // 2, (new_h - size) // 2
        return img.crop((left, top, left + size, top + size))
