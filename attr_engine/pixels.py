"""The image pipeline without PyTorch: a file decoded, the classifier's crop, and a map drawn back on the image.

What a server needs that runs an exported model (onnxruntime) and must not import torch: :func:`decode_image`
(file -> PIL image), :class:`DataConfig` / :func:`crop_geometry` (where the classifier's input lies in an image:
timm's evaluation resize and centre crop), :func:`crop_image` (that resize and crop, in PIL), and numpy twins of
:mod:`attr_engine.imageops`' tensor functions: :func:`image_array` (``pil_to_tensor``), :func:`preprocess_array`
(``preprocess``) and :func:`image_frame_array` (``to_image_frame``). :mod:`attr_engine.imageops` imports the
geometry from here, so there is one definition of the crop for both.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from attr_engine.guards import check_crop_pct

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

__all__ = [
    "CROP_MODES",
    "INTERPOLATIONS",
    "NONFINITE_MAP",
    "CropGeometry",
    "DataConfig",
    "crop_geometry",
    "crop_image",
    "decode_image",
    "image_array",
    "image_frame_array",
    "preprocess_array",
]

INTERPOLATIONS: tuple[str, ...] = ("nearest", "bilinear", "bicubic", "box", "hamming", "lanczos")
CROP_MODES: tuple[str, ...] = ("center", "squash")
# An image's error when its map is not finite: one wording for every engine, with or without torch.
NONFINITE_MAP = "the map has NaN or infinite values"

# Single-channel modes PIL cannot convert to 8-bit RGB without clipping, and the value that maps to 1.0.
_HIGH_DEPTH_SCALE = {"I;16": 65535.0, "I;16L": 65535.0, "I;16B": 65535.0, "I;16N": 65535.0, "I": 65535.0, "F": 1.0}


@dataclass(frozen=True)
class DataConfig:
    """How a classifier's input is cut from an image (timm's evaluation transform).

    Attributes:
        input_size: ``(H, W)`` of the classifier's input.
        crop_pct: fraction of the resized image the centre crop keeps: the image is resized to
            ``floor(H / crop_pct)`` (shorter side, ``"center"``) before the ``H x W`` crop; 1.0 keeps the whole
            shorter side.
        interpolation: PIL resampling filter name (``"bicubic"``, ``"bilinear"``, ``"nearest"``, ...).
        crop_mode: ``"center"`` (aspect ratio kept, the longer side cropped) or ``"squash"`` (each side resized to
            ``size / crop_pct``, aspect ratio not kept, then centre-cropped).
    """

    input_size: tuple[int, int]
    crop_pct: float = 1.0
    interpolation: str = "bicubic"
    crop_mode: str = "center"

    def __post_init__(self) -> None:
        h, w = self.input_size
        if min(h, w) < 1:
            raise ValueError(f"input_size must be positive, got {self.input_size}")
        check_crop_pct(self.crop_pct)
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {', '.join(INTERPOLATIONS)}, got {self.interpolation!r}")
        if self.crop_mode not in CROP_MODES:
            raise ValueError(f"crop_mode must be one of {', '.join(CROP_MODES)}, got {self.crop_mode!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, e.g. for a settings record; :meth:`from_dict` reads it back."""
        return {"input_size": list(self.input_size), "crop_pct": self.crop_pct,
                "interpolation": self.interpolation, "crop_mode": self.crop_mode}  # fmt: skip

    @classmethod
    def from_dict(cls, record: Any) -> DataConfig:
        """The config a :meth:`to_dict` record holds (e.g. an exported model's metadata).

        Raises:
            ValueError: a record that is no such mapping, or holds values the config refuses.
        """
        keys = {"input_size", "crop_pct", "interpolation", "crop_mode"}
        if not isinstance(record, dict) or set(record) != keys:
            raise ValueError(f"a preprocessing record must hold exactly {', '.join(sorted(keys))}")
        size = record["input_size"]
        if not (isinstance(size, list) and len(size) == 2 and all(type(v) is int for v in size)):
            raise ValueError(f"input_size must be [H, W] integers, got {size!r}")
        crop_pct = record["crop_pct"]
        if isinstance(crop_pct, bool) or not isinstance(crop_pct, int | float):
            raise ValueError(f"crop_pct must be a number, got {crop_pct!r}")
        return cls((size[0], size[1]), float(crop_pct), str(record["interpolation"]), str(record["crop_mode"]))


@dataclass(frozen=True)
class CropGeometry:
    """Where the classifier's input lies in an image: resized to ``resized`` ``(h, w)``, then the ``size`` crop at
    ``(top, left)`` of the resized image. All in pixels."""

    image_size: tuple[int, int]
    resized: tuple[int, int]
    top: int
    left: int
    size: tuple[int, int]


def crop_geometry(image_size: tuple[int, int], config: DataConfig) -> CropGeometry:
    """The resize and crop :func:`crop_image` applies to an image of ``(height, width)`` (timm / torchvision
    arithmetic: ``floor(size / crop_pct)``, the longer side truncated, the crop offset rounded)."""
    h0, w0 = (int(v) for v in image_size)
    if min(h0, w0) < 1:
        raise ValueError(f"image size must be positive, got {image_size}")
    h, w = config.input_size
    scale_h, scale_w = math.floor(h / config.crop_pct), math.floor(w / config.crop_pct)
    if config.crop_mode == "squash" or scale_h != scale_w:
        hr, wr = scale_h, scale_w
    else:
        short = scale_h
        if h0 <= w0:
            hr, wr = short, int(short * w0 / h0)
        else:
            hr, wr = int(short * h0 / w0), short
    hr, wr = max(hr, h), max(wr, w)
    return CropGeometry((h0, w0), (hr, wr), round((hr - h) / 2.0), round((wr - w) / 2.0), (h, w))


def decode_image(source: str | os.PathLike[str] | IO[bytes]) -> Image.Image:
    """Fully decode an image file to an RGB PIL image, or a mode-``F`` greyscale one in [0, 1] for high bit depths.

    The reader of every image the package loads from disk (``explain``, its Ray engine, the image-folder dataset)
    and of every image a server is sent. The image is EXIF-rotated (a phone photo comes out the way it is viewed)
    and converted to RGB: palette and greyscale replicated, alpha dropped. 16-bit greyscale (PIL modes ``I;16*``,
    and ``I`` as PIL opens 16-bit PNG / TIFF) maps 0..65535 to [0, 1] and 32-bit float (mode ``F``, e.g. float
    TIFF) is read as [0, 1] intensities, both clipped to [0, 1] and returned as mode ``F``: ``convert("RGB")``
    would clip them at 255 and turn the image white. :func:`image_array` (and ``imageops.pil_to_tensor``) turn
    either kind into ``(3, H, W)`` float32.

    Args:
        source: a path, or a binary file object open for reading (e.g. ``io.BytesIO`` of a file's bytes).

    Returns:
        A loaded PIL image (no file handle kept open), mode ``RGB`` or ``F``, ``(width, height)`` as displayed.

    Raises:
        ValueError: the file cannot be read or is no image PIL knows; the message names ``source`` (a file object
            by its ``name`` when it has one) and the error PIL gave is its ``__cause__``.
    """
    import numpy as np
    from PIL import Image, ImageOps

    try:
        with Image.open(source) as im:
            im.load()
            im = ImageOps.exif_transpose(im)
            scale = _HIGH_DEPTH_SCALE.get(im.mode)
            if scale is not None:
                values = np.asarray(im, dtype=np.float32) / scale
                return Image.fromarray(np.clip(values, 0.0, 1.0).astype(np.float32))  # mode F
            return im.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        # PIL reports truncated or foreign files as OSError / UnidentifiedImageError (an OSError) / SyntaxError.
        name = source if isinstance(source, str | os.PathLike) else getattr(source, "name", source)
        raise ValueError(f"cannot read image {name}: {err}") from err


def crop_image(img: Image.Image, config: DataConfig) -> Image.Image:
    """The classifier's input cut from a PIL image, still a PIL image: resized and centre-cropped as
    :func:`crop_geometry` says, with PIL's plain filter (no ``reducing_gap`` shortcut: the pixels timm's transform
    would give). ``(W, H)`` of the result is ``config.input_size`` reversed."""
    from PIL import Image

    geo = crop_geometry((img.height, img.width), config)
    resample = getattr(Image.Resampling, config.interpolation.upper())
    hr, wr = geo.resized
    if (hr, wr) != (img.height, img.width):
        img = img.resize((wr, hr), resample)
    h, w = geo.size
    return img.crop((geo.left, geo.top, geo.left + w, geo.top + h))


def image_array(img: Image.Image) -> np.ndarray:
    """A PIL image (RGB, or mode ``F`` greyscale in [0, 1], as :func:`decode_image` returns) as ``(3, H, W)``
    float32 in [0, 1]: 8-bit values divided by 255, a mode-``F`` image clipped to [0, 1] (a bicubic resize may
    overshoot) and replicated to three channels. Other modes are converted to RGB first."""
    import numpy as np

    if img.mode == "F":
        grey = np.clip(np.asarray(img, dtype=np.float32), 0.0, 1.0)
        return np.ascontiguousarray(np.broadcast_to(grey, (3, *grey.shape)))
    array = np.asarray(img.convert("RGB"), dtype=np.uint8)
    return np.ascontiguousarray(array.transpose(2, 0, 1)).astype(np.float32) / np.float32(255.0)


def preprocess_array(img: Image.Image, config: DataConfig) -> np.ndarray:
    """The classifier's input cut from a PIL image as ``(3, H, W)`` float32 in [0, 1], ``(H, W) =
    config.input_size``: :func:`crop_image`, then :func:`image_array` (``imageops.preprocess`` without torch)."""
    return image_array(crop_image(img, config))


def image_frame_array(amap: np.ndarray, image_size: tuple[int, int], config: DataConfig) -> np.ndarray:
    """A map computed on the classifier's input, drawn back on the ``(h, w)`` image it was cut from
    (``imageops.to_image_frame`` without torch).

    Every pixel of the image takes the bilinearly interpolated map value at the point the resize and crop moved it
    to (``grid_sample``'s arithmetic: pixel centres, the border value repeated past the last centre); pixels the
    crop cut away are ``NaN``.

    Args:
        amap: ``(H, W)`` or ``(B, H, W)`` at ``config.input_size``.
        image_size: the original image's ``(h, w)``.
        config: the preprocessing that produced the classifier's input.

    Returns:
        ``(h, w)`` or ``(B, h, w)`` float32, ``NaN`` outside the crop.
    """
    import numpy as np

    if amap.ndim not in (2, 3) or tuple(amap.shape[-2:]) != tuple(config.input_size):
        raise ValueError(f"amap must be (H, W) or (B, H, W) with (H, W) = {config.input_size}, got {amap.shape}")
    geo = crop_geometry(image_size, config)
    (h0, w0), (hr, wr), (h, w) = geo.image_size, geo.resized, geo.size
    # Pixel centres of the original in the crop's pixel coordinates, in float32 as the torch version computes
    # them, so both put the crop's edge (the NaN border) on the same pixels.
    xs = (np.arange(w0, dtype=np.float32) + np.float32(0.5)) * np.float32(wr / w0) - np.float32(geo.left)
    ys = (np.arange(h0, dtype=np.float32) + np.float32(0.5)) * np.float32(hr / h0) - np.float32(geo.top)
    x0, x1, wx = _bilinear(xs, w)
    y0, y1, wy = _bilinear(ys, h)
    m = (amap if amap.ndim == 3 else amap[None]).astype(np.float64)
    rows = m[:, y0, :] * (1 - wy)[:, None] + m[:, y1, :] * wy[:, None]
    out = (rows[:, :, x0] * (1 - wx) + rows[:, :, x1] * wx).astype(np.float32)
    inside = ((ys >= 0) & (ys <= h))[:, None] & ((xs >= 0) & (xs <= w))[None, :]
    out[:, ~inside] = np.nan
    return out if amap.ndim == 3 else out[0]


def _bilinear(coords: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For float32 positions ``coords`` (continuous, 0 .. size at the edges) on an axis of ``size`` pixels: the two
    pixel indices each interpolates between and the second one's weight, clamped to the border pixels. The index is
    computed in float32 through ``grid_sample``'s normalised coordinate, as the torch version rounds it."""
    import numpy as np

    one, two, n = np.float32(1), np.float32(2), np.float32(size)
    normalised = two * coords / n - one
    index = np.clip(((normalised + one) * n - one) / two, 0, size - 1).astype(np.float64)
    low = np.floor(index).astype(np.intp)
    return low, np.minimum(low + 1, size - 1), index - low
