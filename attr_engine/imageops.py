"""Small image operations shared by the methods and the metrics: blur and perturbation references."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
