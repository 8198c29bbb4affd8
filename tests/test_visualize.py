"""The picture style: signed maps diverge around zero, others are sequential; robust scaling; NaN uncoloured; the
per-input picture (size rules, colour bar, caption, NaN border), read back from the written PNG."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from attr_engine.visualize import (
    DISPLAY_MAX_SIDE,
    DISPLAY_MIN_SIDE,
    display_size,
    figure_caption,
    figure_layout,
    map_style,
    overlay,
    plot_curves,
    plot_maps,
    save_map_figure,
    save_overlay,
)


def test_signed_and_non_negative_maps_get_their_own_colour_maps():
    signed = torch.linspace(-1, 1, 100).reshape(10, 10)
    style = map_style(signed)
    assert style.signed and style.cmap == "RdBu_r" and style.vmin == -style.vmax
    positive = torch.rand(10, 10)
    assert not map_style(positive).signed and map_style(positive).cmap == "inferno"
    assert map_style(positive, cmap="viridis").cmap == "viridis"


def test_one_hot_pixel_does_not_wash_out_the_rest():
    amap = torch.rand(50, 50)
    amap[0, 0] = 1e6
    assert map_style(amap).vmax < 2.0  # the 99th percentile, not the maximum


def test_nan_pixels_stay_the_image_and_zero_evidence_is_transparent(tmp_path):
    image = torch.full((3, 8, 8), 0.5)
    amap = torch.zeros(8, 8)
    amap[4:, 4:] = 1.0
    amap[:, 0] = float("nan")
    rgb = overlay(image, amap)
    assert (rgb[:, 0] == 128).all() and (rgb[0, 1] == 128).all()  # NaN column and zero-valued pixels: the image
    assert (rgb[6, 6] != 128).any()
    save_overlay(image, amap, tmp_path / "o.png", alpha=0.5)
    assert Image.open(tmp_path / "o.png").size == (8, 8)


def test_grid_and_curves_are_written(tmp_path):
    images = torch.rand(2, 3, 16, 16)
    maps = {"signed": torch.randn(2, 16, 16), "positive": torch.rand(2, 16, 16)}
    out = plot_maps(images, maps, tmp_path / "grid.png", row_labels=["a, p = 0.90", "b, p = 0.40"])
    assert np.asarray(Image.open(out)).shape[2] in (3, 4)
    f = torch.linspace(0, 1, 11)
    curves = {f"m{i}": {"fractions": f, "deletion": 1 - f, "insertion": 1 - f} for i in range(12)}
    assert plot_curves(curves, tmp_path / "curves.png").is_file()


# ---------------------------------------------------------------------------------------------------------------
# The per-input picture (explain --png)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["overlay", "side-by-side"])
def test_small_inputs_are_scaled_up_and_large_ones_capped(layout):
    # A 64 px image is drawn at 256 px on its short side, the aspect kept.
    assert display_size(64, 80, layout=layout) == (256, 320)
    # Within both bounds: pixel for pixel.
    assert display_size(300, 400, layout=layout) == (300, 400)
    # A 24-megapixel photo: no side of the whole picture beyond 2048 px, the panel as large as that allows.
    geo = figure_layout(4000, 6000, layout=layout)
    assert max(geo.width, geo.height) <= DISPLAY_MAX_SIDE
    assert max(geo.width, geo.height) >= DISPLAY_MAX_SIDE - 2
    ph, pw = geo.panels[0][3], geo.panels[0][2]
    assert abs(pw / ph - 1.5) < 0.01 and ph >= DISPLAY_MIN_SIDE
    # The cap wins over the minimum: an extreme panorama gets a thin picture, not one 25 600 px wide.
    thin = figure_layout(20, 2000, layout=layout, max_side=1024)
    assert max(thin.width, thin.height) <= 1024
    assert figure_layout(64, 64, layout=layout, max_side=4096).panels[0][2] == 256


def _grey_with_nan_border() -> tuple[torch.Tensor, torch.Tensor]:
    """A uniform grey (3, 40, 60) image and a signed (40, 60) map whose 8 left and right columns are NaN."""
    image = torch.full((3, 40, 60), 0.5)
    yy, xx = torch.meshgrid(torch.arange(40.0), torch.arange(60.0), indexing="ij")
    amap = torch.sin(xx / 6) * (yy - 20)
    amap[:, :8] = float("nan")
    amap[:, -8:] = float("nan")
    return image, amap


def _lut_index(pixels: np.ndarray, cmap: str) -> np.ndarray:
    """For (N, 3) uint8 pixels, the index of the nearest of the colour map's 256 colours."""
    from matplotlib import colormaps

    lut = (colormaps[cmap](np.linspace(0, 1, 256))[:, :3] * 255).astype(np.float32)
    return np.argmin(((pixels[:, None, :].astype(np.float32) - lut[None]) ** 2).sum(-1), axis=1)


@pytest.mark.parametrize("signed", [True, False])
def test_picture_has_a_monotone_colour_bar_a_caption_and_an_uncoloured_nan_border(tmp_path, signed):
    image, amap = _grey_with_nan_border()
    if not signed:
        amap = amap.abs()
    path = save_map_figure(image, amap, tmp_path / "p.png", caption=figure_caption("gradient", 3, 0.87, "cat"))
    geo = figure_layout(40, 60)
    png = np.asarray(Image.open(path).convert("RGB"))
    assert png.shape == (geo.height, geo.width, 3) and Image.open(path).size == (geo.width, geo.height)
    assert geo.panels[0][2:] == (384, 256)  # 40 px short side -> 256 px, 60 -> 384

    # The colour bar: down its middle column the colours run through the colour map, top (p99) to bottom.
    left, top, width, height = geo.colour_bar
    column = png[top + 2 : top + height - 2, left + width // 2]
    index = _lut_index(column, "RdBu_r" if signed else "inferno")
    assert (np.diff(index) <= 0).all(), index
    assert index[0] >= 250 and index[-1] <= 5

    # The caption band holds text (dark pixels on white); a picture without caption leaves it blank. (Left of
    # the colour bar: its lowest tick label may reach into the band.)
    _, ctop, _, cheight = geo.caption
    band = png[ctop : ctop + cheight, : left - 2]
    assert (band.min(axis=-1) < 128).sum() > 100
    blank = np.asarray(Image.open(save_map_figure(image, amap, tmp_path / "b.png")).convert("RGB"))
    assert (blank[ctop : ctop + cheight, : left - 2] == 255).all()

    # The NaN border (8 of 60 columns each side, 51 of 384 displayed) is the image itself: plain grey, no colour.
    pl, pt, pw, ph = geo.panels[0]
    panel = png[pt : pt + ph, pl : pl + pw].astype(int)
    assert (np.abs(panel[:, :48] - 128) <= 1).all() and (np.abs(panel[:, -48:] - 128) <= 1).all()
    assert (np.abs(panel[:, 60:-60] - 128) > 10).any()  # the map itself is coloured


def test_side_by_side_shows_the_image_beside_the_overlay(tmp_path):
    image, amap = _grey_with_nan_border()
    path = save_map_figure(image, amap, tmp_path / "s.png", layout="side-by-side", caption="x")
    geo = figure_layout(40, 60, layout="side-by-side")
    png = np.asarray(Image.open(path).convert("RGB")).astype(int)
    assert png.shape[:2] == (geo.height, geo.width) and len(geo.panels) == 2
    (il, it, iw, ih), (ol, ot, ow, oh) = geo.panels
    assert (np.abs(png[it : it + ih, il : il + iw] - 128) <= 1).all()  # the image: grey everywhere
    assert (np.abs(png[ot : ot + oh, ol : ol + ow] - 128) > 10).any()  # the overlay: coloured


def test_large_maps_are_drawn_at_the_capped_size(tmp_path):
    image = torch.rand(3, 1200, 3000)
    amap = torch.randn(1200, 3000)
    path = save_map_figure(image, amap, tmp_path / "big.png", max_side=1024)
    with Image.open(path) as im:
        assert max(im.size) <= 1024 and im.size == (figure_layout(1200, 3000, max_side=1024).width,
                                                   figure_layout(1200, 3000, max_side=1024).height)  # fmt: skip


def test_caption_names_the_class_only_when_known():
    assert figure_caption("gradient", 3, 0.8712, "cat") == "gradient · cat (class 3) · p = 0.87"
    assert figure_caption("saliency", 3, 0.004) == "saliency · class 3 · p = 4.0e-03"
    assert figure_caption("rise", 0, float("nan")) == "rise · class 0"
