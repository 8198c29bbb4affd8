"""Small image operations: blur and perturbation references (methods, metrics), and the classifier's preprocessing.

The preprocessing half answers two questions for a user's photo of any size: what tensor does the classifier see
(:func:`preprocess`: timm's evaluation transform - resize the shorter side to ``input / crop_pct``, centre-crop the
input size, with the model's interpolation), and where on the photo does a map computed on that tensor lie
(:func:`to_image_frame`: the inverse geometry, the cropped-away border ``NaN``). :func:`data_config` reads the
settings from a timm model's pretrained config.

It is the one image pipeline: :func:`decode_image` (file -> PIL image), :func:`crop_geometry` / :func:`preprocess`
(resize and crop) and :func:`pil_to_tensor` serve ``explain`` (both engines) and
:class:`~attr_engine.data.ImageFolderDataset` (training, evaluation) alike, so a classifier is trained and explained
on the same pixels of a file. ``attr_engine.data`` imports this module, never the reverse.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from attr_engine.guards import check_crop_pct
from kernels.validate import check_tensor

if TYPE_CHECKING:
    from PIL import Image

__all__ = [
    "REFERENCES",
    "CropGeometry",
    "DataConfig",
    "crop_geometry",
    "data_config",
    "decode_image",
    "gaussian_blur",
    "pil_to_tensor",
    "prepare_input",
    "preprocess",
    "reference_image",
    "resolve_reference",
    "scaled_blur",
    "to_image_frame",
]

REFERENCES: tuple[str, ...] = ("black", "mean", "blur")


def gaussian_blur(x: torch.Tensor, kernel_size: int, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur with reflect padding.

    Args:
        x: (B, C, H, W) images.
        kernel_size: odd window size; clipped to the image so reflect padding stays valid.
        sigma: standard deviation in pixels (> 0).

    Returns:
        (B, C, H, W) blurred images, same dtype.
    """
    if x.ndim != 4:
        raise ValueError(f"x must be (B, C, H, W), got shape {tuple(x.shape)}")
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be a positive odd int, got {kernel_size}")
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    channels, height, width = x.shape[1:]
    # Reflect padding needs pad < size; a window larger than the image adds nothing a smaller one would not.
    half = min(kernel_size // 2, height - 1, width - 1)
    offsets = torch.arange(-half, half + 1, dtype=torch.float32, device=x.device)
    weights = torch.exp(-0.5 * (offsets / sigma) ** 2)
    weights = (weights / weights.sum()).to(x.dtype)
    out = F.pad(x, (half, half, half, half), mode="reflect")
    out = F.conv2d(out, weights.view(1, 1, 1, -1).expand(channels, 1, 1, -1), groups=channels)
    return F.conv2d(out, weights.view(1, 1, -1, 1).expand(channels, 1, -1, 1), groups=channels)


def reference_image(
    x: torch.Tensor, kind: str, mean: torch.Tensor | None = None, *, blur_kernel: int = 37, blur_sigma: float = 37.0
) -> torch.Tensor:
    """The image that perturbations blend towards.

    Args:
        x: (B, C, H, W) images in [0, 1].
        kind: "black" (zeros), "mean" (the per-channel ``mean`` colour, e.g. the classifier's normalisation mean,
            which is zero in normalised space) or "blur" (a strong Gaussian blur of ``x``).
        mean: (C,) or broadcastable to (1, C, 1, 1); required for "mean".

    Returns:
        (B, C, H, W); "black" and "mean" are expanded views (no copy).
    """
    if kind == "black":
        return torch.zeros((), dtype=x.dtype, device=x.device).expand_as(x)
    if kind == "mean":
        if mean is None:
            raise ValueError("reference 'mean' needs the mean colour")
        return mean.to(dtype=x.dtype, device=x.device).reshape(1, -1, 1, 1).expand_as(x)
    if kind == "blur":
        return gaussian_blur(x, blur_kernel, blur_sigma)
    raise ValueError(f"unknown reference {kind!r}; expected one of {', '.join(REFERENCES)} or a tensor")


def scaled_blur(size: int) -> tuple[int, float]:
    """The strong-blur reference scaled to an image side: kernel 37, sigma 37 at 224 px, proportionally elsewhere."""
    kernel = max(3, round(37 * size / 224) | 1)
    return kernel, float(kernel)


def resolve_reference(
    reference: str | torch.Tensor, x: torch.Tensor, mean: torch.Tensor | None, *, name: str = "reference"
) -> torch.Tensor:
    """The reference image for each of ``x``'s images, from a name or a tensor (metrics and methods alike).

    Args:
        reference: ``"black"``, ``"mean"`` (the per-channel ``mean`` colour), ``"blur"`` (the strong blur AHA
            trains with: :func:`scaled_blur` of the image side), or a finite float tensor (3, H, W), (1, 3, H, W)
            or (B, 3, H, W) matching ``x``.
        x: (B, C, H, W) images in [0, 1].
        mean: the mean colour (C,), e.g. a classifier's ``norm_mean``; needed for ``"mean"`` only.
        name: the argument's name in error messages.

    Returns:
        (B, C, H, W) on ``x``'s device and dtype; named references and broadcast tensors are expanded views.

    Raises:
        ValueError: an unknown name, or a tensor of the wrong shape or dtype or with NaN / inf values.
    """
    if isinstance(reference, torch.Tensor):
        ref = check_tensor(reference, name, finite=True)
        if ref.ndim == 3:
            ref = ref.unsqueeze(0)
        if ref.ndim != 4 or ref.shape[1:] != x.shape[1:] or ref.shape[0] not in (1, x.shape[0]):
            # The shape only: a tensor's values are no use in an error message.
            raise ValueError(
                f"{name} must be (B, 3, H, W), (1, 3, H, W) or (3, H, W) matching x {tuple(x.shape)}, "
                f"got shape {tuple(reference.shape)}"
            )
        return ref.to(device=x.device, dtype=x.dtype).expand_as(x)
    if not isinstance(reference, str) or reference not in REFERENCES:
        raise ValueError(f"unknown {name} {reference!r}; expected one of {', '.join(REFERENCES)} or a tensor")
    # The strong blur scales with the image side exactly as in AHA training (kernel 37, sigma 37 at 224 px).
    kernel, sigma = scaled_blur(min(x.shape[-2:]))
    return reference_image(x, reference, mean, blur_kernel=kernel, blur_sigma=sigma)


# ---------------------------------------------------------------------------------------------------------------
# The classifier's preprocessing and its inverse
# ---------------------------------------------------------------------------------------------------------------

# Single-channel modes PIL cannot convert to 8-bit RGB without clipping, and the value that maps to 1.0.
_HIGH_DEPTH_SCALE = {"I;16": 65535.0, "I;16L": 65535.0, "I;16B": 65535.0, "I;16N": 65535.0, "I": 65535.0, "F": 1.0}

_INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "box", "hamming", "lanczos")
_CROP_MODES = ("center", "squash")


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
        if self.interpolation not in _INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {', '.join(_INTERPOLATIONS)}, got {self.interpolation!r}")
        if self.crop_mode not in _CROP_MODES:
            raise ValueError(f"crop_mode must be one of {', '.join(_CROP_MODES)}, got {self.crop_mode!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, e.g. for a settings record."""
        return {"input_size": list(self.input_size), "crop_pct": self.crop_pct,
                "interpolation": self.interpolation, "crop_mode": self.crop_mode}  # fmt: skip


def data_config(
    classifier: Any,
    *,
    img_size: int | None = None,
    crop_pct: float | None = None,
    interpolation: str | None = None,
) -> DataConfig:
    """The preprocessing of ``classifier`` (a :class:`~attr_engine.classifier.Classifier` or a timm model).

    The crop percentage, interpolation and crop mode come from timm's data config of the model (0.95 for most
    ResNets / ConvNeXts, 0.9 for ViTs); the input size is ``img_size``, else the classifier's recorded input size,
    else timm's. Keyword arguments override what the model says (a classifier trained on full frames, as
    ``train-classifier`` does, wants ``crop_pct=1.0``).
    """
    import timm.data

    model = getattr(classifier, "model", classifier)
    cfg: dict[str, Any] = {}
    if getattr(model, "pretrained_cfg", None) is not None:
        cfg = timm.data.resolve_model_data_config(model)
    size = cfg.get("input_size", (3, 224, 224))[1:]
    recorded = getattr(classifier, "input_size", None)
    if img_size is not None:
        size = (img_size, img_size)
    elif recorded is not None:
        size = tuple(recorded[1:])
    interp = interpolation or cfg.get("interpolation", "bicubic")
    mode = cfg.get("crop_mode", "center")
    return DataConfig(
        input_size=(int(size[0]), int(size[1])),
        crop_pct=float(crop_pct if crop_pct is not None else cfg.get("crop_pct", 1.0)),
        interpolation=interp if interp in _INTERPOLATIONS else "bicubic",  # timm's "random" is a training mode
        crop_mode=mode if mode in _CROP_MODES else "center",
    )


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
    """The resize and crop :func:`preprocess` applies to an image of ``(height, width)`` (timm / torchvision
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

    The reader of every image the package loads from disk (``explain``, its Ray engine, the image-folder dataset).
    The image is EXIF-rotated (a phone photo comes out the way it is viewed) and converted to RGB: palette and
    greyscale replicated, alpha dropped. 16-bit greyscale (PIL modes ``I;16*``, and ``I`` as PIL opens 16-bit
    PNG / TIFF) maps 0..65535 to [0, 1] and 32-bit float (mode ``F``, e.g. float TIFF) is read as [0, 1]
    intensities, both clipped to [0, 1] and returned as mode ``F``: ``convert("RGB")`` would clip them at 255 and
    turn the image white. :func:`pil_to_tensor` turns either kind into ``(3, H, W)`` float32.

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


def pil_to_tensor(img: Image.Image) -> torch.Tensor:
    """A PIL image (RGB, or mode ``F`` greyscale in [0, 1], as :func:`decode_image` returns) as ``(3, H, W)``
    float32 in [0, 1]: 8-bit values divided by 255, a mode-``F`` image clipped to [0, 1] (a bicubic resize may
    overshoot) and replicated to three channels. Other modes are converted to RGB first."""
    import numpy as np

    if img.mode == "F":  # high bit depth, already in [0, 1]; bicubic may overshoot: clip
        grey = torch.from_numpy(np.asarray(img, dtype=np.float32).copy()).clamp_(0.0, 1.0)
        return grey[None].expand(3, -1, -1).contiguous()
    array = np.asarray(img.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float().div_(255.0)


def preprocess(img: Image.Image, config: DataConfig) -> torch.Tensor:
    """The classifier's input cut from a PIL image: resize, centre-crop (:func:`crop_geometry`).

    ``explain`` and :class:`~attr_engine.data.ImageFolderDataset` with an ``img_size`` both cut their images here,
    so a file gives the classifier the same tensor in training as when it is explained. The resize is PIL's plain
    filter (no ``reducing_gap`` shortcut): the pixels timm's transform would give.

    Returns:
        ``(3, H, W)`` float32 in [0, 1], ``(H, W) = config.input_size``.
    """
    from PIL import Image

    geo = crop_geometry((img.height, img.width), config)
    resample = getattr(Image.Resampling, config.interpolation.upper())
    hr, wr = geo.resized
    if (hr, wr) != (img.height, img.width):
        img = img.resize((wr, hr), resample)
    h, w = geo.size
    return pil_to_tensor(img.crop((geo.left, geo.top, geo.left + w, geo.top + h)))


def prepare_input(
    img: Image.Image, config: DataConfig, keep_original: bool = False
) -> tuple[torch.Tensor, tuple[int, int], torch.Tensor | None]:
    """A decoded PIL image as the classifier sees it, with what is needed to draw its map back on it.

    Both engines of ``attr-engine explain`` (the local loop and :mod:`attr_engine.ray`'s actors) cut their inputs
    here, so they feed the classifier the same pixels.

    Returns:
        ``x (3, H, W)`` (:func:`preprocess`), the image's ``(h, w)``, and with ``keep_original`` the image itself as
        ``(3, h, w)`` uint8 for overlays (uint8 because a batch of 12-megapixel photos in float32 is gigabytes),
        else None.
    """
    original = pil_to_tensor(img).mul_(255).round_().to(torch.uint8) if keep_original else None
    return preprocess(img, config), (img.height, img.width), original


def to_image_frame(amap: torch.Tensor, image: Any, config: DataConfig) -> torch.Tensor:
    """A map computed on the classifier's input, drawn back on the original image it was cut from.

    Every pixel of the original image takes the (bilinearly interpolated) map value at the point the resize and
    crop moved it to; pixels the crop cut away have no value and are ``NaN``.

    Args:
        amap: ``(H, W)`` or ``(B, H, W)`` map at ``config.input_size``.
        image: the original image: a PIL image, a ``(C, h, w)`` tensor / array, or its ``(h, w)`` size.
        config: the preprocessing that produced the classifier's input (:func:`data_config`).

    Returns:
        ``(h, w)`` or ``(B, h, w)`` float32 on ``amap``'s device, ``NaN`` outside the crop.
    """
    if hasattr(image, "height") and hasattr(image, "width") and not hasattr(image, "shape"):
        size = (int(image.height), int(image.width))
    elif hasattr(image, "shape"):
        size = (int(image.shape[-2]), int(image.shape[-1]))
    else:
        size = (int(image[0]), int(image[1]))
    if amap.ndim not in (2, 3) or tuple(amap.shape[-2:]) != tuple(config.input_size):
        raise ValueError(f"amap must be (H, W) or (B, H, W) with (H, W) = {config.input_size}, got {tuple(amap.shape)}")
    batched = amap.ndim == 3
    m = (amap if batched else amap[None]).float()[:, None]
    geo = crop_geometry(size, config)
    (h0, w0), (hr, wr), (h, w) = size, geo.resized, geo.size
    # Pixel centres of the original, in the crop's pixel coordinates (continuous, 0 .. w at the crop's edges).
    xs = (torch.arange(w0, device=m.device, dtype=torch.float32) + 0.5) * (wr / w0) - geo.left
    ys = (torch.arange(h0, device=m.device, dtype=torch.float32) + 0.5) * (hr / h0) - geo.top
    grid = torch.stack(torch.meshgrid(2 * xs / w - 1, 2 * ys / h - 1, indexing="xy"), dim=-1)
    out = F.grid_sample(m, grid.expand(m.shape[0], -1, -1, -1), mode="bilinear", padding_mode="border",
                        align_corners=False)[:, 0]  # fmt: skip
    inside = ((ys >= 0) & (ys <= h))[:, None] & ((xs >= 0) & (xs <= w))[None, :]
    out = out.masked_fill(~inside, float("nan"))
    return out if batched else out[0]
