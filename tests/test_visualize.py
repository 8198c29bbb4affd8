"""The picture style: signed maps diverge around zero, others are sequential; robust scaling; NaN uncoloured."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from attr_engine.visualize import map_style, overlay, plot_curves, plot_maps, save_overlay


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
