"""Pictures of attribution maps, one style everywhere: ``explain --png``, the demo / evaluate reports, the README.

How a map is coloured (:func:`map_style`):

- a **signed** map (Semantic Pullback, integrated gradients, gradient x input: evidence for and against) on a
  diverging colour map centred at zero (``RdBu_r``: red for, blue against, white for nothing), scaled
  symmetrically to the 99th percentile of ``|map|``;
- a **non-negative** map (AHA, Grad-CAM, saliency) on a sequential colour map (``inferno``) from 0 to its 99th
  percentile.

Percentile rather than min-max scaling keeps one hot pixel from washing out the rest, and a sparse map from looking
blank. Over an image the colour's opacity grows with ``|value|`` (up to ``alpha``), so pixels the map gives nothing
stay visible as the image; NaN pixels (outside the classifier's crop, see :func:`attr_engine.imageops.to_image_frame`)
get no colour. Grids carry a colour bar per method and a label per row (class and probability); curve plots give
every method its own colour and draw insertion against the fraction of pixels inserted.

Figures use matplotlib's object API on an Agg canvas: no pyplot state, no display needed.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["MapStyle", "map_style", "overlay", "plot_curves", "plot_maps", "save_overlay"]

SIGNED_CMAP = "RdBu_r"
POSITIVE_CMAP = "inferno"
DEFAULT_ALPHA = 0.7
PERCENTILE = 99.0
# A map counts as signed when its negative tail holds at least this share of its positive tail's magnitude.
_SIGNED_SHARE = 0.05


@dataclass(frozen=True)
class MapStyle:
    """How one map is coloured: values in ``[vmin, vmax]`` on ``cmap``; ``signed`` maps have ``vmin = -vmax``."""

    signed: bool
    vmin: float
    vmax: float
    cmap: str


def _finite(amap: Any) -> np.ndarray:
    import numpy as np

    a = amap.detach().float().cpu().numpy() if hasattr(amap, "detach") else np.asarray(amap, dtype=np.float32)
    return a[np.isfinite(a)]


def map_style(amap: Any, *, signed: bool | None = None, cmap: str | None = None) -> MapStyle:
    """The colouring of ``amap`` ((H, W) tensor or array; NaN ignored): signed or not, robust range, colour map.

    ``signed=None`` decides from the values (a negative tail worth 5 % of the positive one); ``cmap=None`` takes
    ``RdBu_r`` for signed maps, ``inferno`` for non-negative ones.
    """
    import numpy as np

    a = _finite(amap)
    if a.size == 0:
        a = np.zeros(1, dtype=np.float32)
    lo, hi = np.percentile(a, 100 - PERCENTILE), np.percentile(a, PERCENTILE)
    if signed is None:
        signed = bool(lo < 0 and -lo >= _SIGNED_SHARE * max(hi, 0.0)) or bool(hi <= 0 < -lo)
    if signed:
        v = float(np.percentile(np.abs(a), PERCENTILE)) or float(np.abs(a).max()) or 1.0
        return MapStyle(True, -v, v, cmap or SIGNED_CMAP)
    # Non-negative (or shifted) maps from their low end; a map that is all one value shows as nothing.
    base = 0.0 if a.min() >= 0 else float(lo)
    top = float(hi) if hi > base else float(a.max())
    return MapStyle(False, base, top if top > base else base + 1.0, cmap or POSITIVE_CMAP)


def _rgba(amap: Any, style: MapStyle, alpha: float) -> np.ndarray:
    """(H, W, 4) float colours of a map, opacity ``alpha * |normalised value|`` and 0 at NaN."""
    import numpy as np
    from matplotlib import colormaps

    a = amap.detach().float().cpu().numpy() if hasattr(amap, "detach") else np.asarray(amap, dtype=np.float32)
    known = np.isfinite(a)
    t = np.clip((np.nan_to_num(a, nan=style.vmin) - style.vmin) / (style.vmax - style.vmin), 0.0, 1.0)
    rgba = colormaps[style.cmap](t)
    strength = np.abs(2 * t - 1) if style.signed else t
    rgba[..., 3] = alpha * np.sqrt(strength) * known  # sqrt: faint evidence is still seen
    return rgba


def overlay(
    image: torch.Tensor,
    amap: torch.Tensor,
    *,
    cmap: str | None = None,
    alpha: float = DEFAULT_ALPHA,
    signed: bool | None = None,
) -> np.ndarray:
    """Blend an attribution map over its image (the style of the module docstring).

    Args:
        image: ``(3, H, W)`` in [0, 1].
        amap: ``(H, W)`` map, any scale; NaN pixels get no colour.
        cmap, alpha, signed: see :func:`map_style`; ``alpha`` is the opacity of the strongest values.

    Returns:
        ``(H, W, 3)`` uint8 RGB.
    """
    import numpy as np

    if image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"image must be (3, H, W), got shape {tuple(image.shape)}")
    if amap.shape != image.shape[1:]:
        raise ValueError(f"map {tuple(amap.shape)} and image {tuple(image.shape[1:])} differ in size")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    rgb = image.detach().float().clamp(0, 1).permute(1, 2, 0).cpu().numpy()
    rgba = _rgba(amap, map_style(amap, signed=signed, cmap=cmap), alpha)
    a = rgba[..., 3:]
    return np.round(255 * ((1 - a) * rgb + a * rgba[..., :3])).astype(np.uint8)


def save_overlay(image: torch.Tensor, amap: torch.Tensor, path: str | os.PathLike[str], **style: Any) -> None:
    """Write :func:`overlay` of ``image (3, H, W)`` and ``amap (H, W)`` as a PNG, atomically."""
    from PIL import Image

    from attr_engine.checkpoint import atomic_write

    buffer = io.BytesIO()
    Image.fromarray(overlay(image, amap, **style)).save(buffer, format="PNG")
    with atomic_write(path, "wb") as f:
        f.write(buffer.getvalue())


def _figure(width: float, height: float, dpi: int = 110) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str | os.PathLike[str]) -> Path:
    from attr_engine.checkpoint import atomic_write

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    with atomic_write(path, "wb") as f:
        f.write(buffer.getvalue())
    return path


def plot_maps(
    images: torch.Tensor,
    maps: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    row_labels: Sequence[str] | None = None,
    title: str = "",
    cmap: str | None = None,
    alpha: float = DEFAULT_ALPHA,
) -> Path:
    """A grid, one row per image: the image, then each method's map over it, a colour bar under each method.

    Each method's maps share one style (signed or not, decided over all its maps) and each map is scaled to its
    own 99th percentile, so the grid compares *where* methods point; the colour bar reads in that per-map unit.

    Args:
        images: ``(k, 3, H, W)`` in [0, 1].
        maps: ``{method: (>= k, H, W)}``; NaN pixels get no colour.
        path: the PNG to write (atomically, parents created).
        row_labels: one line per image, e.g. ``"circle, p = 0.97"``.
    """
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be (k, 3, H, W), got {tuple(images.shape)}")
    if not maps:
        raise ValueError("maps is empty")
    k = images.shape[0]
    for name, m in maps.items():
        if m.shape[0] < k or m.shape[-2:] != images.shape[-2:]:
            raise ValueError(f"maps[{name!r}] must be (>= {k}, H, W) like the images, got {tuple(m.shape)}")
    if row_labels is not None and len(row_labels) < k:
        raise ValueError(f"row_labels needs {k} entries, got {len(row_labels)}")
    cols = 1 + len(maps)
    cell = 1.9
    fig = _figure(cell * cols + 0.3, cell * k + 1.0 + (0.35 if title else 0.0))
    grid = fig.add_gridspec(k + 1, cols, height_ratios=[*([1.0] * k), 0.09], hspace=0.12, wspace=0.08)
    styles = {name: map_style(m[:k], cmap=cmap) for name, m in maps.items()}
    for i in range(k):
        img = images[i].float().clamp(0, 1).permute(1, 2, 0).cpu().numpy()
        ax = fig.add_subplot(grid[i, 0])
        ax.imshow(img)
        ax.set_xticks([])
        ax.set_yticks([])
        if row_labels is not None:
            ax.set_ylabel(row_labels[i], fontsize=10)
        if i == 0:
            ax.set_title("image", fontsize=11)
        for j, (name, m) in enumerate(maps.items(), start=1):
            one = map_style(m[i], signed=styles[name].signed, cmap=styles[name].cmap)
            ax = fig.add_subplot(grid[i, j])
            ax.imshow(img)
            ax.imshow(_rgba(m[i], one, alpha))
            ax.set_axis_off()
            if i == 0:
                ax.set_title(name, fontsize=11)
    for j, style in enumerate(styles.values(), start=1):
        cax = fig.add_subplot(grid[k, j])
        lo = -1.0 if style.signed else 0.0
        bar = ScalarMappable(Normalize(lo, 1.0), colormaps[style.cmap])
        cb = fig.colorbar(bar, cax=cax, orientation="horizontal")
        # Three ticks near the bar's ends, so the labels of neighbouring bars never touch.
        if style.signed:
            cb.set_ticks([-0.9, 0.0, 0.9], labels=["against", "0", "for"])
            cb.set_label("signed, ±p99 of each map", fontsize=8)
        else:
            cb.set_ticks([0.05, 0.5, 0.95], labels=["0", "0.5", "p99"])
            cb.set_label("0 … p99 of each map", fontsize=8)
        cb.ax.tick_params(labelsize=8, length=2)
        # The end labels grow inwards from their ticks, so long ones ("against") stay over their own bar.
        ends = cb.ax.get_xticklabels()
        ends[0].set_horizontalalignment("left")
        ends[-1].set_horizontalalignment("right")
    fig.add_subplot(grid[k, 0]).set_axis_off()
    if title:
        fig.suptitle(title, fontsize=12)
    fig.subplots_adjust(left=0.06, right=0.99, top=0.93 if title else 0.95, bottom=0.08)
    return _save(fig, path)


def plot_curves(
    curves: Mapping[str, Mapping[str, torch.Tensor]],
    path: str | os.PathLike[str],
    *,
    title: str = "",
    insertion_removes_least: bool = True,
) -> Path:
    """Mean deletion and insertion curves, one colour per method, side by side; written as PNG.

    Args:
        curves: ``{method: {"fractions": (F,), "deletion": (F,), "insertion": (F,)}}``.
        path: the PNG to write (atomically, parents created).
        insertion_removes_least: the insertion curve was measured as deletion of the least important pixels
            first (the AHA protocol): at fraction ``f`` removed, the ``1 - f`` most important pixels are in place,
            so it is drawn against ``1 - f``, the fraction inserted. False: ``fractions`` already count inserted
            pixels (the RISE protocol). The AUCs are the same either way.
    """
    import torch
    from matplotlib import colormaps

    if not curves:
        raise ValueError("curves is empty")
    # tab10 gives ten clearly different colours; more methods continue on tab20's light shades with dashes.
    tab10, tab20 = colormaps["tab10"], colormaps["tab20"]
    fig = _figure(12.0, 4.6)
    axes = fig.subplots(1, 2)
    handles = []
    for i, (method, c) in enumerate(curves.items()):
        frac = c["fractions"].float().cpu()
        style = (
            {"color": tab10(i), "linestyle": "-"} if i < 10 else {"color": tab20(2 * (i % 10) + 1), "linestyle": "--"}
        )
        aucs = []
        for ax, key in zip(axes, ("deletion", "insertion"), strict=True):
            y = c[key].float().cpu()
            xs = 1 - frac if key == "insertion" and insertion_removes_least else frac
            (line,) = ax.plot(xs.numpy(), y.numpy(), linewidth=2.0, **style)
            aucs.append(float(torch.trapezoid(y, frac)))
        handles.append((line, f"{method}   del {aucs[0]:.3f} · ins {aucs[1]:.3f}"))
    labels = {"deletion": "fraction of pixels removed, most important first",
              "insertion": "fraction of pixels inserted, most important first"}  # fmt: skip
    for ax, key, better in zip(axes, ("deletion", "insertion"), ("lower", "higher"), strict=True):
        ax.set_title(f"{key} ({better} AUC is better)", fontsize=12)
        ax.set_xlabel(labels[key], fontsize=10)
        ax.set_ylabel("probability of the explained class", fontsize=10)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.02)
        ax.tick_params(labelsize=9)
        ax.grid(alpha=0.3)
    fig.legend([h for h, _ in handles], [label for _, label in handles], loc="lower center",
               ncol=min(3, len(handles)), fontsize=10, frameon=False)  # fmt: skip
    if title:
        fig.suptitle(title, fontsize=12)
    rows = -(-len(handles) // 3)
    fig.tight_layout(rect=(0, 0.07 * rows + 0.02, 1, 1))
    return _save(fig, path)
