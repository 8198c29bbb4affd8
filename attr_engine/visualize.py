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
every method its own colour and draw insertion against the fraction of pixels inserted. A training run's validation
curve (:func:`plot_validation_curve`, what ``train-aha --val-fraction`` writes) shows the score per step, the best
one marked, with the training loss on a second axis.

One input's picture (:func:`save_map_figure`, what ``attr-engine explain --png`` writes) is the same style on its
own: the overlay (optionally the image beside it), a colour bar in the map's own values and a one-line caption
(method, class, probability), at a display size (:func:`display_size`): the short side scaled up to at least
256 px, the whole picture's long side at most 2048 px. Both the image and the map are resized to that size
bilinearly (antialiased when shrinking; the map's NaN border by nearest neighbour, so it stays sharp and
uncoloured); the colours are scaled on the map at its own resolution.

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

__all__ = [
    "FIGURE_LAYOUTS",
    "FigureLayout",
    "MapStyle",
    "display_size",
    "figure_caption",
    "figure_layout",
    "map_style",
    "overlay",
    "plot_curves",
    "plot_maps",
    "plot_validation_curve",
    "save_map_figure",
    "save_overlay",
]

SIGNED_CMAP = "RdBu_r"
POSITIVE_CMAP = "inferno"
DEFAULT_ALPHA = 0.7
PERCENTILE = 99.0
# The per-input picture (save_map_figure): panel sizes, and the layouts it draws.
DISPLAY_MIN_SIDE = 256
DISPLAY_MAX_SIDE = 2048
FIGURE_LAYOUTS = ("overlay", "side-by-side")
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


def _check_picture(image: torch.Tensor, amap: torch.Tensor, alpha: float) -> None:
    """An image ``(3, H, W)``, its map ``(H, W)`` of the same size and an opacity in [0, 1], or a ValueError."""
    if image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"image must be (3, H, W), got shape {tuple(image.shape)}")
    if amap.shape != image.shape[1:]:
        raise ValueError(f"map {tuple(amap.shape)} and image {tuple(image.shape[1:])} differ in size")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")


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
    _check_picture(image, amap, alpha)
    return _blend(image, amap, map_style(amap, signed=signed, cmap=cmap), alpha)


def _blend(image: torch.Tensor, amap: Any, style: MapStyle, alpha: float) -> np.ndarray:
    """``(H, W, 3)`` uint8: ``amap (H, W)`` coloured by ``style`` over ``image (3, H, W)`` in [0, 1]."""
    import numpy as np

    rgb = image.detach().float().clamp(0, 1).permute(1, 2, 0).cpu().numpy()
    rgba = _rgba(amap, style, alpha)
    a = rgba[..., 3:]
    return np.round(255 * ((1 - a) * rgb + a * rgba[..., :3])).astype(np.uint8)


def save_overlay(image: torch.Tensor, amap: torch.Tensor, path: str | os.PathLike[str], **style: Any) -> None:
    """Write :func:`overlay` of ``image (3, H, W)`` and ``amap (H, W)`` as a PNG, atomically."""
    from PIL import Image

    from attr_engine.atomic import atomic_write

    buffer = io.BytesIO()
    Image.fromarray(overlay(image, amap, **style)).save(buffer, format="PNG")
    with atomic_write(path, "wb") as f:
        f.write(buffer.getvalue())


def _colour_bar(fig: Any, cax: Any, lo: float, hi: float, cmap: str, orientation: str) -> Any:
    """A colour bar of ``cmap`` from ``lo`` to ``hi`` in the axes ``cax`` (the demo's grid and the per-input
    picture draw theirs with this one helper); returns matplotlib's Colorbar for ticks and label."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    return fig.colorbar(ScalarMappable(Normalize(lo, hi), colormaps[cmap]), cax=cax, orientation=orientation)


Box = tuple[int, int, int, int]


@dataclass(frozen=True)
class FigureLayout:
    """The pixel geometry of one :func:`save_map_figure` picture.

    Boxes are ``(left, top, width, height)`` in pixels from the picture's top-left corner. ``panels`` holds the
    picture panels left to right (``side-by-side``: the image, then the overlay; ``overlay``: the overlay alone),
    all of the display size; ``colour_bar`` is the bar itself (its tick labels lie to its right), ``caption`` the
    band under the panels that holds the caption line. ``scale`` multiplies font sizes and margins (1 for panels
    up to 400 px on their short side, growing to 2.5), so the text stays readable on large pictures.
    """

    width: int
    height: int
    panels: tuple[Box, ...]
    colour_bar: Box
    caption: Box
    scale: float


def _scale(ph: int, pw: int) -> float:
    return min(2.5, max(1.0, min(ph, pw) / 400))


def _geometry(ph: int, pw: int, n: int) -> FigureLayout:
    """The layout around ``n`` panels of ``(ph, pw)`` pixels (the margins follow :func:`_scale` of the panel)."""
    s = _scale(ph, pw)
    pad, bar_w, bar_room, cap_h = round(10 * s), round(14 * s), round(80 * s), round(30 * s)
    panels = tuple((pad + i * (pw + pad), pad, pw, ph) for i in range(n))
    bar_left = pad + n * pw + n * pad
    width = bar_left + bar_w + bar_room
    height = pad + ph + cap_h
    return FigureLayout(width, height, panels, (bar_left, pad, bar_w, ph), (0, pad + ph, width, cap_h), s)


def figure_layout(
    h: int,
    w: int,
    *,
    layout: str = "overlay",
    min_side: int = DISPLAY_MIN_SIDE,
    max_side: int = DISPLAY_MAX_SIDE,
) -> FigureLayout:
    """Where everything of an ``(h, w)`` input's picture goes (:class:`FigureLayout`).

    The panels show the input scaled by one factor: up so that their short side is at least ``min_side`` (a 64 px
    image is drawn at 256 px), never down for that; and down so that no side of the whole picture (panels, colour
    bar, caption) exceeds ``max_side``, which wins over ``min_side`` (an extreme panorama gets a thin picture).
    Inputs within both bounds are drawn pixel for pixel.
    """
    if layout not in FIGURE_LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(FIGURE_LAYOUTS)}, got {layout!r}")
    if h < 1 or w < 1 or min_side < 1 or max_side < 1:
        raise ValueError(f"sizes must be >= 1, got h={h}, w={w}, min_side={min_side}, max_side={max_side}")
    n = 2 if layout == "side-by-side" else 1

    def at(k: float) -> FigureLayout:
        return _geometry(max(1, int(h * k + 1e-9)), max(1, int(w * k + 1e-9)), n)

    def fits(geo: FigureLayout) -> bool:
        return max(geo.width, geo.height) <= max_side

    k = max(1.0, min_side / min(h, w))
    if fits(at(k)):
        return at(k)
    # The margins grow with the panel (the font scale), so the largest panel that fits is found by bisection.
    lo, hi = 0.0, k
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(at(mid)) else (lo, mid)
    return at(lo)


def display_size(h: int, w: int, **bounds: Any) -> tuple[int, int]:
    """The ``(h', w')`` an ``(h, w)`` input is drawn at in its picture (:func:`figure_layout`'s rule)."""
    box = figure_layout(h, w, **bounds).panels[0]
    return box[3], box[2]


def figure_caption(method: str, target: int, probability: float | None = None, class_name: str | None = None) -> str:
    """The picture's one line: ``"gradient · cat (class 3) · p = 0.87"``; ``"class 3"`` when no name is known,
    no probability when none is given (``None`` or NaN). ``p`` is the classifier's softmax probability of the
    explained class."""
    import math

    parts = [method, f"{class_name} (class {target})" if class_name else f"class {target}"]
    if probability is not None and math.isfinite(probability):
        parts.append(f"p = {probability:.2f}" if probability >= 0.01 else f"p = {probability:.1e}")
    return " · ".join(parts)


def _resized(image: torch.Tensor, amap: torch.Tensor, size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``image (3, H, W)`` and ``amap (H, W)`` at ``size``: bilinear, antialiased when shrinking (PIL's filter,
    whose result does not depend on the number of threads: the pictures are reproducible byte for byte).

    The map is resized as a normalised convolution (values and the known-pixel mask resized alike, then divided),
    so the NaN border neither bleeds into the map nor shifts it; the border itself is resized by nearest neighbour
    and stays NaN.
    """
    import numpy as np
    import torch
    from PIL import Image

    image, amap = image.detach().float().cpu(), amap.detach().float().cpu()
    if tuple(amap.shape) == size:
        return image, amap
    box = (size[1], size[0])  # PIL's (width, height)

    def resize(plane: np.ndarray, how: Image.Resampling = Image.Resampling.BILINEAR) -> np.ndarray:
        return np.asarray(Image.fromarray(np.ascontiguousarray(plane, dtype=np.float32)).resize(box, how))

    a = amap.numpy()
    known = np.isfinite(a)
    weight = resize(known.astype(np.float32))
    values = resize(np.where(known, a, 0.0)) / np.maximum(weight, 1e-12)
    border = resize(known.astype(np.float32), Image.Resampling.NEAREST) < 0.5
    values[border | (weight <= 0)] = np.nan
    shown = np.stack([resize(channel) for channel in image.numpy()])
    return torch.from_numpy(shown).clamp_(0, 1), torch.from_numpy(values.astype(np.float32))


def save_map_figure(
    image: torch.Tensor,
    amap: torch.Tensor,
    path: str | os.PathLike[str],
    *,
    caption: str = "",
    layout: str = "overlay",
    cmap: str | None = None,
    alpha: float = DEFAULT_ALPHA,
    signed: bool | None = None,
    min_side: int = DISPLAY_MIN_SIDE,
    max_side: int = DISPLAY_MAX_SIDE,
) -> Path:
    """One input's picture, the demo's style on its own: overlay, colour bar, caption; written as a compressed PNG.

    The colours (:func:`map_style`: signed maps centred at zero, others sequential, scaled to the 99th percentile)
    are decided on the map at its own resolution, and the colour bar is labelled in the map's own values. Image
    and map are then resized to the display size (:func:`figure_layout`, :func:`_resized`); NaN pixels (the border
    a crop cut away) stay uncoloured: the image shows there as it is.

    Args:
        image: ``(3, H, W)`` in [0, 1], the picture the map belongs to.
        amap: ``(H, W)`` map, any scale; NaN pixels get no colour.
        path: the PNG to write (atomically, parents created).
        caption: the line under the picture (:func:`figure_caption`).
        layout: ``"overlay"`` or ``"side-by-side"`` (the image, then the overlay).
        cmap, alpha, signed: as for :func:`overlay`.
        min_side, max_side: the display size bounds of :func:`figure_layout`.
    """
    _check_picture(image, amap, alpha)
    style = map_style(amap, signed=signed, cmap=cmap)
    geo = figure_layout(*amap.shape, layout=layout, min_side=min_side, max_side=max_side)
    shown, shown_map = _resized(image, amap, (geo.panels[0][3], geo.panels[0][2]))
    pictures = [_blend(shown, shown_map, style, alpha)]
    if layout == "side-by-side":
        pictures.insert(0, (shown.permute(1, 2, 0).numpy() * 255).round().astype("uint8"))
    fig = _figure(geo.width / 100, geo.height / 100, dpi=100)
    for (left, top, _, ph), picture in zip(geo.panels, pictures, strict=True):
        fig.figimage(picture, xo=left, yo=geo.height - top - ph, origin="upper")  # pixel for pixel, no resampling
    _draw_bar(fig, geo, style)
    _draw_caption(fig, geo, caption)
    return _save_rgb(fig, path)


def _fraction(geo: FigureLayout, box: Box) -> tuple[float, float, float, float]:
    """A pixel box as matplotlib's figure fractions ``(left, bottom, width, height)``."""
    left, top, w, h = box
    return left / geo.width, 1 - (top + h) / geo.height, w / geo.width, h / geo.height


def _draw_bar(fig: Any, geo: FigureLayout, style: MapStyle) -> None:
    """The vertical colour bar beside the overlay, ticked in the map's values at its low end, middle and top."""
    s = geo.scale
    cb = _colour_bar(fig, fig.add_axes(_fraction(geo, geo.colour_bar)), style.vmin, style.vmax, style.cmap, "vertical")
    middle = 0.0 if style.signed else (style.vmin + style.vmax) / 2
    ticks = [style.vmin, middle, style.vmax]
    cb.set_ticks(ticks, labels=["0" if t == 0 else f"{t:.2g}" for t in ticks])
    cb.set_label("signed: + for, − against (±p99)" if style.signed else "map value (top: p99)", fontsize=8 * s)
    cb.ax.tick_params(labelsize=8 * s, length=2 * s, width=0.8 * s)
    cb.outline.set_linewidth(0.8 * s)


def _draw_caption(fig: Any, geo: FigureLayout, caption: str) -> None:
    """The caption, left in its band, its font shrunk (to 6 pt at least) when the line is wider than the picture."""
    if not caption:
        return
    _, top, width, h = geo.caption
    pad = geo.panels[0][0]
    text = fig.text(pad / geo.width, 1 - (top + h / 2) / geo.height, caption, fontsize=11 * geo.scale,
                    ha="left", va="center")  # fmt: skip
    room = width - 2 * pad
    wide = text.get_window_extent(renderer=fig.canvas.get_renderer()).width
    if wide > room:
        text.set_fontsize(max(6.0, 11 * geo.scale * room / wide))


def _save_rgb(fig: Any, path: str | os.PathLike[str]) -> Path:
    """Render ``fig`` and write it as an RGB PNG at zlib level 6, atomically: no alpha channel and no metadata that
    names the matplotlib version. (Level 9 takes twice as long, 1.6 s more on a 2048 px picture, for 0.5 % fewer
    bytes.)"""
    import numpy as np
    from PIL import Image

    from attr_engine.atomic import atomic_write

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.canvas.draw()
    rgb = np.asarray(fig.canvas.buffer_rgba())[..., :3]
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(rgb)).save(buffer, format="PNG", compress_level=6)
    with atomic_write(path, "wb") as f:
        f.write(buffer.getvalue())
    return path


def _figure(width: float, height: float, dpi: int = 110) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str | os.PathLike[str]) -> Path:
    from attr_engine.atomic import atomic_write

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
        cb = _colour_bar(fig, cax, -1.0 if style.signed else 0.0, 1.0, style.cmap, "horizontal")
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


def plot_validation_curve(
    curve: Sequence[Mapping[str, Any]], path: str | os.PathLike[str], *, best_step: int | None = None, title: str = ""
) -> Path:
    """A training run's validation composite (insertion AUC - deletion AUC) per step, the best score marked, and
    the mean training loss between scores on a second axis; written as PNG.

    Args:
        curve: one record per score with ``step``, ``composite`` and ``loss`` (None before the first step), as
            :class:`attr_engine.aha.validation.EarlyStopping` keeps them.
        path: the PNG to write (atomically, parents created).
        best_step: the step whose weights training kept (marked; None: not marked).
    """
    from matplotlib import colormaps
    from matplotlib.ticker import MaxNLocator

    if not curve:
        raise ValueError("curve is empty")
    steps = [int(p["step"]) for p in curve]
    composite = [float(p["composite"]) for p in curve]
    blue, grey = colormaps["tab10"](0), (0.45, 0.45, 0.45)
    fig = _figure(6.4, 3.8)
    ax = fig.subplots()
    ax.plot(steps, composite, color=blue, marker="o", markersize=3.5, linewidth=1.8, label="validation composite")
    if best_step is not None and best_step in steps:
        best = composite[steps.index(best_step)]
        ax.plot([best_step], [best], marker="*", markersize=13, color="#d62728", linestyle="none",
                label=f"kept: step {best_step} ({best:.3f})")  # fmt: skip
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimiser step", fontsize=10)
    ax.set_ylabel("insertion AUC - deletion AUC (hard)", fontsize=10, color=blue)
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=9)
    losses = [(s, float(p["loss"])) for s, p in zip(steps, curve, strict=True) if p.get("loss") is not None]
    handles, labels = ax.get_legend_handles_labels()
    if losses:
        twin = ax.twinx()
        (line,) = twin.plot([s for s, _ in losses], [v for _, v in losses], color=grey, linestyle="--",
                            linewidth=1.2)  # fmt: skip
        twin.set_ylabel("training loss (mean since previous score)", fontsize=9, color=grey)
        twin.tick_params(labelsize=8, colors=grey)
        handles, labels = [*handles, line], [*labels, "training loss"]
    # Above the axes, where no line of either axis can run under it.
    ax.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return _save(fig, path)
