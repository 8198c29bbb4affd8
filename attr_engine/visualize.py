"""One heat-map overlay per image, rendered without a figure: what ``attr-engine explain --png`` writes at scale.

The rendering matches :func:`attr_engine.report.plot_heatmaps` (each map scaled to [0, 1] from its own minimum to
maximum, the ``jet`` colour map at 55 % over the image), so a batch overlay reads like the report's grids; it is
blended directly in numpy at image resolution, which costs a fraction of a matplotlib figure per image. Multi-method
grids and curves are in :mod:`attr_engine.report`.
"""

from __future__ import annotations

import io
import os

import numpy as np
import torch
from PIL import Image

from attr_engine.checkpoint import atomic_write

__all__ = ["overlay", "save_overlay"]

_ALPHA = 0.55
_CMAP = "jet"


def overlay(image: torch.Tensor, amap: torch.Tensor) -> np.ndarray:
    """Blend an attribution map over its image.

    Args:
        image: ``(3, H, W)`` in [0, 1].
        amap: ``(H, W)`` map, any scale (a constant map shows as the lowest colour).

    Returns:
        ``(H, W, 3)`` uint8 RGB.
    """
    from matplotlib import colormaps

    if image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"image must be (3, H, W), got shape {tuple(image.shape)}")
    if amap.shape != image.shape[1:]:
        raise ValueError(f"map {tuple(amap.shape)} and image {tuple(image.shape[1:])} differ in size")
    rgb = image.detach().float().clamp(0, 1).permute(1, 2, 0).cpu().numpy()
    a = amap.detach().float().cpu()
    known = torch.isfinite(a)  # NaN: pixels the classifier's crop never saw
    lo, hi = (a[known].min(), a[known].max()) if known.any() else (torch.tensor(0.0), torch.tensor(1.0))
    a = ((a - lo) / (hi - lo).clamp_min(1e-12)).nan_to_num(0.0).numpy()
    heat = colormaps[_CMAP](a)[..., :3]
    alpha = _ALPHA * known.numpy()[..., None]  # no colour where the map has no value
    return np.round(255 * ((1 - alpha) * rgb + alpha * heat)).astype(np.uint8)


def save_overlay(image: torch.Tensor, amap: torch.Tensor, path: str | os.PathLike[str]) -> None:
    """Write :func:`overlay` of ``image (3, H, W)`` and ``amap (H, W)`` as a PNG, atomically."""
    buffer = io.BytesIO()
    Image.fromarray(overlay(image, amap)).save(buffer, format="PNG")
    with atomic_write(path, "wb") as f:
        f.write(buffer.getvalue())
