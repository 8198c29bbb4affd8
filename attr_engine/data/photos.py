"""Real photographs for benchmarks: labelled crops of the sample photographs scikit-image ships in its wheel.

The embedded :class:`~attr_engine.data.ShapesDataset` is drawn by our own code: filled shapes on which attribution
is easy to judge and easy to overfit to. This dataset is made of real pixels - photographs, scans and micrographs
that ``scikit-image`` (PyPI ``scikit-image``) carries inside its wheel, so it loads offline - with their thin
strokes, texture, blur, JPEG artefacts and clutter. Nothing in an image is drawn by this module: an item is a square
crop of one photograph, resized, possibly mirrored, greyed or re-lit.

**Labels.** The label of a crop is the photograph it was cut from (:data:`PHOTO_CLASSES`: the astronaut portrait,
the cat, the coffee cup, the rocket on its pad, the motorcycle, the cameraman, the coins, a scanned book page, a
retinal fundus photograph, an immunohistochemistry micrograph, a brick wall and grass). To name the class a
classifier has to recognise the content of a part of the scene it may never have seen: faces and a space suit,
fur, a cup's rim, scanned glyphs, vessels, stained nuclei, or a texture.

**Held-out regions, not just held-out crops.** Each photograph is split along its longer side: crops of the
``"train"`` split lie in the first 70 %, crops of the ``"test"`` split in the last 30 %, so no test pixel was ever
seen in training. Crops are 20-35 % of the photograph's shorter side and never below 64 source pixels (the retina's
reach 423 px): every image has a native resolution of at least 64 px, whatever ``img_size`` it is resized to.

**Variation.** Horizontal mirroring (p = 0.5), grey conversion of colour photographs (p = 0.2, so that colour alone
does not separate the five grey photographs from the seven colour ones), brightness and contrast jitter of +-15 %.

There are no object masks (the crops are of whole scenes): use this set for the perturbation metrics (deletion /
insertion, infidelity, ...), and :class:`~attr_engine.data.ShapesDataset` for localisation. Item ``i`` depends
only on ``(seed, split, i)`` and its class is ``i % 12``, so sets are balanced, reproducible and independent of the
order items are read in.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from attr_engine._optional import optional_import
from attr_engine_kernels.validate import check_int_at_least

__all__ = ["PHOTO_CLASSES", "PhotoCropsDataset", "write_photo_folder"]

# Class name -> the scikit-image loader (``skimage.data.<name>``) of its photograph. Drawings (logo, colour wheel,
# phantom, chessboard, horse silhouette) are left out: only photographs, scans and micrographs.
PHOTO_CLASSES: tuple[str, ...] = (
    "astronaut",
    "cat",
    "coffee",
    "rocket",
    "motorcycle",
    "cameraman",
    "coins",
    "page",
    "retina",
    "micrograph",
    "brick",
    "grass",
)
_LOADERS = {
    "astronaut": "astronaut",
    "cat": "chelsea",
    "coffee": "coffee",
    "rocket": "rocket",
    "motorcycle": "stereo_motorcycle",  # (left, right, disparity): the left view
    "cameraman": "camera",
    "coins": "coins",
    "page": "page",
    "retina": "retina",
    "micrograph": "immunohistochemistry",
    "brick": "brick",
    "grass": "grass",
}
SPLITS: tuple[str, ...] = ("train", "test")
TRAIN_SHARE = 0.7  # of the longer side; the rest is the test region
MIN_CROP = 64  # source pixels
CROP_RANGE = (0.20, 0.35)  # of the shorter side
GREY_P, JITTER = 0.2, 0.15


def _skimage_data() -> ModuleType:
    """``skimage.data``, imported on first use (scikit-image is an optional dependency)."""
    return optional_import(
        "skimage.data", "the photo dataset needs scikit-image: pip install 'attr-engine[photos]' (or scikit-image)"
    )


@cache
def _photo(name: str) -> torch.Tensor:
    """The photograph of class ``name`` as a float (3, H, W) tensor in [0, 1] (grey ones repeated to RGB)."""
    image = getattr(_skimage_data(), _LOADERS[name])()
    if isinstance(image, tuple):
        image = image[0]
    array = np.asarray(image)
    if array.ndim == 2:
        array = np.repeat(array[..., None], 3, axis=2)
    return torch.from_numpy(np.ascontiguousarray(array[..., :3])).permute(2, 0, 1).float().div_(255.0)


def _region(h: int, w: int, split: str) -> tuple[int, int, int, int]:
    """``(top, left, height, width)`` of ``split``'s part of an ``h x w`` photograph (cut along the longer side)."""
    if w >= h:
        cut = round(TRAIN_SHARE * w)
        return (0, 0, h, cut) if split == "train" else (0, cut, h, w - cut)
    cut = round(TRAIN_SHARE * h)
    return (0, 0, cut, w) if split == "train" else (cut, 0, h - cut, w)


def crop_range(h: int, w: int) -> tuple[int, int]:
    """Smallest and largest crop side (source pixels) for an ``h x w`` photograph: 20-35 % of the shorter side,
    at least :data:`MIN_CROP`, at most the test region's extent (so both splits draw the same sizes)."""
    short, test_extent = min(h, w), max(h, w) - round(TRAIN_SHARE * max(h, w))
    hi = min(max(MIN_CROP, round(CROP_RANGE[1] * short)), test_extent)
    lo = min(max(MIN_CROP, round(CROP_RANGE[0] * short)), hi)
    return lo, hi


class PhotoCropsDataset(Dataset):
    """Labelled crops of scikit-image's sample photographs (see the module doc): items ``(image, label)``.

    Args:
        n: number of items; item ``i`` has label ``i % len(classes)``.
        split: ``"train"`` (crops from the first 70 % of each photograph) or ``"test"`` (the last 30 %).
        img_size: side every crop is resized to (antialiased bilinear).
        seed: item ``i`` depends only on ``(seed, split, i)``.
        classes: a subset of :data:`PHOTO_CLASSES`, in label order (default: all twelve).

    Items: ``image: (3, img_size, img_size)`` float32 in [0, 1], ``label``: int.
    """

    def __init__(
        self,
        n: int,
        *,
        split: str = "train",
        img_size: int = 64,
        seed: int = 0,
        classes: Sequence[str] | None = None,
    ) -> None:
        self.n = check_int_at_least(n, "n", 1)
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.split, self.img_size, self.seed = split, check_int_at_least(img_size, "img_size", 8), int(seed)
        self.class_names = tuple(PHOTO_CLASSES if classes is None else classes)
        unknown = [c for c in self.class_names if c not in _LOADERS]
        if unknown or not self.class_names or len(set(self.class_names)) != len(self.class_names):
            raise ValueError(f"classes must be distinct names from {PHOTO_CLASSES}, got {list(self.class_names)}")
        _skimage_data()  # fail at construction, not at the first item, without scikit-image

    def __len__(self) -> int:
        return self.n

    def box(self, i: int) -> tuple[str, int, int, int]:
        """``(class name, top, left, side)`` of item ``i``'s crop in its photograph (source pixels)."""
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} out of range for a dataset of {self.n} items")
        name = self.class_names[i % len(self.class_names)]
        _, h, w = _photo(name).shape
        gen = self._generator(i)
        lo, hi = crop_range(h, w)
        side = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        top0, left0, rh, rw = _region(h, w, self.split)
        top = top0 + int(torch.randint(0, rh - side + 1, (1,), generator=gen))
        left = left0 + int(torch.randint(0, rw - side + 1, (1,), generator=gen))
        return name, top, left, side

    def _generator(self, i: int) -> torch.Generator:
        # SeedSequence, not hash(): str hashes change between processes (PYTHONHASHSEED).
        state = np.random.SeedSequence([self.seed, SPLITS.index(self.split), i]).generate_state(1, np.uint64)
        return torch.Generator().manual_seed(int(state[0]) >> 1)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        name, top, left, side = self.box(i)
        crop = _photo(name)[None, :, top : top + side, left : left + side]
        x = F.interpolate(crop, size=(self.img_size, self.img_size), mode="bilinear", antialias=True)[0]
        # A second stream for the variation, so that the crop does not shift when the variation rule changes.
        gen = self._generator(i)
        gen.manual_seed(gen.initial_seed() ^ 0x5DEECE66D)
        return _vary(x, gen, grey_allowed=name not in _GREY), i % len(self.class_names)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All items stacked: ``(x: (n, 3, S, S), labels: (n,))``."""
        items = [self[i] for i in range(self.n)]
        return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


# Grey-scale photographs (repeated to RGB): grey conversion would change nothing.
_GREY = frozenset({"cameraman", "coins", "page", "brick", "grass"})


def _vary(x: torch.Tensor, gen: torch.Generator, *, grey_allowed: bool) -> torch.Tensor:
    """Mirror (p 0.5), grey (p :data:`GREY_P`, colour photographs only), brightness and contrast jitter.

    ``x: (3, S, S)`` in [0, 1]; draws from ``gen`` in a fixed order so an item does not depend on its neighbours.
    """
    draws = torch.rand(4, generator=gen)
    if draws[0] < 0.5:
        x = x.flip(-1)
    if grey_allowed and draws[1] < GREY_P:
        x = (0.299 * x[0] + 0.587 * x[1] + 0.114 * x[2]).expand(3, -1, -1)
    brightness = 1 + JITTER * (2 * float(draws[2]) - 1)
    contrast = 1 + JITTER * (2 * float(draws[3]) - 1)
    mean = x.mean()
    return ((x - mean) * contrast + mean * brightness).clamp(0, 1).contiguous()


def write_photo_folder(
    root: str | Path, *, n_train: int = 2400, n_test: int = 240, img_size: int = 128, seed: int = 0
) -> dict[str, int]:
    """Write both splits as ImageFolder trees, ``root/train/<class>/<i>.png`` and ``root/test/<class>/<i>.png``,
    for ``attr-engine train-classifier --data root/train`` and ``explain`` / ``evaluate``.

    Images are written at ``img_size`` (default 128, so runs at 64 px and at 128 px read the same files).

    Returns:
        ``{split: images written}``.
    """
    from PIL import Image

    counts = {}
    for split, n in (("train", n_train), ("test", n_test)):
        data = PhotoCropsDataset(n, split=split, img_size=img_size, seed=seed)
        for i in range(n):
            x, label = data[i]
            folder = Path(root) / split / data.class_names[label]
            folder.mkdir(parents=True, exist_ok=True)
            pixels = (x.permute(1, 2, 0).numpy() * 255.0).round().astype(np.uint8)
            path = folder / f"{i:05d}.png"
            temporary = path.with_name(f".{path.name}.tmp")
            Image.fromarray(pixels).save(temporary, format="PNG")
            os.replace(temporary, path)  # a killed run leaves no truncated image under a real name
        counts[split] = n
    return counts
