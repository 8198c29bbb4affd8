"""Maps in the original image's frame: the classifier's preprocessing (timm's eval transform) and its inverse."""

from __future__ import annotations

import numpy as np
import pytest
import timm
import timm.data
import torch
from PIL import Image

import attr_engine
from attr_engine.imageops import DataConfig, crop_geometry, data_config, preprocess, to_image_frame


def _photo(h: int, w: int, box: tuple[int, int, int, int]) -> tuple[Image.Image, np.ndarray]:
    """A dark noisy image with a white rectangle ``box = (top, left, bottom, right)``, and its object mask."""
    rng = np.random.default_rng(0)
    rgb = (rng.random((h, w, 3)) * 60).astype(np.uint8)
    top, left, bottom, right = box
    rgb[top:bottom, left:right] = 255
    mask = np.zeros((h, w), dtype=bool)
    mask[top:bottom, left:right] = True
    return Image.fromarray(rgb), mask


@pytest.mark.parametrize("size", [(300, 451), (451, 300), (224, 224), (97, 130)])
@pytest.mark.parametrize("crop_pct", [1.0, 0.95, 0.875])
def test_preprocess_is_timms_eval_transform(size, crop_pct):
    img, _ = _photo(*size, (10, 10, 40, 40))
    timm_t = timm.data.create_transform(
        input_size=(3, 64, 64), crop_pct=crop_pct, interpolation="bicubic", mean=(0, 0, 0), std=(1, 1, 1)
    )
    ours = preprocess(img, DataConfig((64, 64), crop_pct, "bicubic"))
    assert ours.shape == (3, 64, 64)
    assert torch.allclose(ours, timm_t(img), atol=1 / 255)


@pytest.mark.parametrize("crop_pct", [1.0, 0.9])
def test_an_object_lands_where_it_is_after_resize_crop_and_back(crop_pct):
    # A wide photo (the crop cuts its left and right) with the object right of centre.
    img, mask = _photo(120, 200, (40, 110, 80, 150))
    config = DataConfig((32, 32), crop_pct, "bilinear")
    x = preprocess(img, config)
    # A perfect "map" on the classifier's input: the object's brightness there.
    amap = x.mean(0)
    back = to_image_frame(amap, img, config).numpy()
    assert back.shape == mask.shape
    geo = crop_geometry((120, 200), config)
    # The cropped-away border is NaN; the kept middle is finite.
    cols = np.isfinite(back[60])  # the middle row: finite exactly where the crop kept the column
    keep = (np.arange(200) + 0.5) * geo.resized[1] / 200 - geo.left
    assert np.array_equal(cols, (keep >= 0) & (keep <= 32))
    assert not cols[:5].any() and not cols[-5:].any()
    rows = np.isfinite(back).any(axis=1)
    assert rows.all() == (crop_pct == 1.0)  # the top and bottom rows are cut only by crop_pct < 1
    assert rows[60]
    # The bright part of the map back on the photo is the object (intersection over union of the masks).
    found = np.nan_to_num(back, nan=0.0) > 0.5
    iou = (found & mask).sum() / (found | mask).sum()
    assert iou > 0.8, iou


def test_to_image_frame_batched_and_checked():
    config = DataConfig((16, 16), 1.0)
    maps = torch.rand(3, 16, 16)
    out = to_image_frame(maps, (16, 24), config)
    assert out.shape == (3, 16, 24)
    assert torch.allclose(out[:, :, 4:20], maps, atol=1e-6)  # same scale: the middle is the map itself
    assert out[:, :, :4].isnan().all() and out[:, :, 20:].isnan().all()
    with pytest.raises(ValueError, match="amap must be"):
        to_image_frame(torch.rand(8, 8), (16, 16), config)
    assert attr_engine.to_image_frame is to_image_frame


def test_data_config_reads_timms_crop_and_the_classifiers_size():
    from attr_engine.classifier import Classifier

    resnet = timm.create_model("resnet18", pretrained=False, num_classes=2)
    timm_cfg = timm.data.resolve_model_data_config(resnet)
    assert data_config(resnet) == DataConfig((224, 224), 0.95, timm_cfg["interpolation"])
    vit = Classifier(timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=2, img_size=32,
                                       patch_size=8, depth=1), input_size=(3, 32, 32))  # fmt: skip
    cfg = data_config(vit)
    assert cfg.input_size == (32, 32) and cfg.crop_pct == 0.9 and cfg.interpolation == "bicubic"
    assert data_config(vit, crop_pct=1.0, img_size=48).crop_pct == 1.0
