"""Maps in the original image's frame: the classifier's preprocessing (timm's eval transform) and its inverse; the
image reader (decode_image) every path shares."""

from __future__ import annotations

import io

import numpy as np
import pytest
import timm
import timm.data
import torch
from PIL import Image

import attr_engine
from attr_engine.imageops import (
    DataConfig,
    crop_geometry,
    data_config,
    decode_image,
    pil_to_tensor,
    preprocess,
    to_image_frame,
)


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


# ---------------------------------------------------------------------------------------------------------------
# decode_image: the one reader of image files (explain, its Ray engine, ImageFolderDataset)
# ---------------------------------------------------------------------------------------------------------------


def test_decode_image_reads_16_bit_and_float_greyscale_into_the_unit_range(tmp_path):
    grey16 = (np.arange(12 * 20, dtype=np.uint16).reshape(12, 20) * 273).astype(np.uint16)
    Image.fromarray(grey16).save(tmp_path / "a16.png")
    assert Image.open(tmp_path / "a16.png").mode.startswith("I")  # what 16-bit PNGs open as
    grey_f = np.linspace(-0.5, 1.5, 12 * 20, dtype=np.float32).reshape(12, 20)  # out of range on both sides
    Image.fromarray(grey_f).save(tmp_path / "b.tif")
    for source, want in ((tmp_path / "a16.png", grey16 / 65535.0), (tmp_path / "b.tif", np.clip(grey_f, 0, 1))):
        img = decode_image(source)
        assert img.mode == "F" and img.size == (20, 12)
        np.testing.assert_allclose(np.asarray(img), want, atol=1e-6)
        x = pil_to_tensor(img)
        assert x.shape == (3, 12, 20) and x.dtype == torch.float32 and torch.equal(x[0], x[2])
    # A binary file object reads as its path does.
    with open(tmp_path / "a16.png", "rb") as f:
        assert np.array_equal(np.asarray(decode_image(f)), np.asarray(decode_image(tmp_path / "a16.png")))
    data = io.BytesIO((tmp_path / "a16.png").read_bytes())
    assert np.array_equal(np.asarray(decode_image(data)), np.asarray(decode_image(str(tmp_path / "a16.png"))))


def test_decode_image_makes_palette_alpha_and_grey_images_rgb(tmp_path):
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (9, 14, 3), dtype=np.uint8)
    Image.fromarray(rgb).quantize(colors=5).save(tmp_path / "p.png", transparency=0)  # palette, one colour clear
    Image.fromarray(rgb).convert("P").save(tmp_path / "p.gif")
    Image.fromarray(np.dstack([rgb, rgb[..., :1]])).save(tmp_path / "rgba.png")
    Image.fromarray(rgb[..., 0]).save(tmp_path / "l.png")
    for name in ("p.png", "p.gif", "rgba.png", "l.png"):
        img = decode_image(tmp_path / name)
        assert img.mode == "RGB" and img.size == (14, 9), name
        with Image.open(tmp_path / name) as raw:
            assert np.array_equal(np.asarray(img), np.asarray(raw.convert("RGB"))), name  # alpha dropped, not mixed
    assert np.array_equal(np.asarray(decode_image(tmp_path / "rgba.png")), rgb)


@pytest.mark.parametrize(("orientation", "turn"), [(3, 2), (6, -1), (8, 1)])
def test_decode_image_applies_the_exif_orientation(tmp_path, orientation, turn):
    """A phone photo comes out the way it is viewed: orientation 6 is "rotate 90 clockwise to view"."""
    rgb = np.random.default_rng(1).integers(0, 256, (10, 16, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(rgb).save(tmp_path / "o.png", exif=exif)
    img = decode_image(tmp_path / "o.png")
    assert np.array_equal(np.asarray(img), np.rot90(rgb, k=turn))


def test_decode_image_names_the_file_it_cannot_read(tmp_path):
    Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(tmp_path / "whole.png")
    (tmp_path / "cut.png").write_bytes((tmp_path / "whole.png").read_bytes()[:60])  # truncated
    (tmp_path / "text.jpg").write_text("not an image")
    for name in ("cut.png", "text.jpg", "missing.png"):
        with pytest.raises(ValueError, match=rf"^cannot read image .*{name.replace('.', '[.]')}: ") as info:
            decode_image(tmp_path / name)
        assert isinstance(info.value.__cause__, OSError | SyntaxError)  # PIL's own error, for callers that want it
    with open(tmp_path / "text.jpg", "rb") as f, pytest.raises(ValueError, match=r"cannot read image .*text[.]jpg"):
        decode_image(f)  # a file object by its name
    with pytest.raises(ValueError, match="cannot read image"):
        decode_image(io.BytesIO(b"junk"))


# ---------------------------------------------------------------------------------------------------------------
# attr_engine.pixels: the same pipeline without torch (a server of an exported file), against the torch oracle
# ---------------------------------------------------------------------------------------------------------------


def _modes(rgb: np.ndarray) -> dict[str, Image.Image]:
    """One photo as decode_image returns it: RGB, and mode F (16-bit greyscale read into [0, 1])."""
    grey = rgb.mean(axis=2).astype(np.float32) / 255
    return {"RGB": Image.fromarray(rgb), "F": Image.fromarray(grey)}


@pytest.mark.parametrize("size", [(61, 90), (90, 61), (32, 32), (20, 47)])
@pytest.mark.parametrize(
    "config",
    [
        DataConfig((32, 32), 1.0, "bicubic"),
        DataConfig((32, 32), 0.875, "bilinear"),
        DataConfig((24, 40), 0.9, "bicubic", "squash"),
        DataConfig((32, 32), 0.95, "nearest"),
    ],
    ids=["whole", "crop-bilinear", "squash", "nearest"],
)
def test_the_numpy_preprocessing_is_preprocess(size, config):
    from attr_engine.pixels import preprocess_array

    rgb = np.random.default_rng(3).integers(0, 256, (*size, 3), dtype=np.uint8)
    for mode, img in _modes(rgb).items():
        ours = preprocess_array(img, config)
        oracle = preprocess(img, config).numpy()
        assert ours.dtype == np.float32 and ours.shape == (3, *config.input_size), mode
        np.testing.assert_array_equal(ours, oracle, err_msg=mode)


@pytest.mark.parametrize("image_size", [(61, 90), (90, 61), (32, 32), (20, 47), (300, 33)])
@pytest.mark.parametrize(
    "config",
    [DataConfig((32, 32), 1.0), DataConfig((32, 32), 0.875), DataConfig((24, 40), 0.9, crop_mode="squash")],
    ids=["whole", "crop", "squash"],
)
def test_the_numpy_frame_mapping_is_to_image_frame(image_size, config):
    """The same values at float32 rounding and the same NaN border, pixel for pixel, batched or not."""
    from attr_engine.pixels import image_frame_array

    maps = torch.randn(2, *config.input_size, generator=torch.Generator().manual_seed(5)) * 3
    oracle = to_image_frame(maps, image_size, config).numpy()
    ours = image_frame_array(maps.numpy(), image_size, config)
    assert ours.dtype == np.float32 and ours.shape == (2, *image_size)
    assert np.array_equal(np.isnan(ours), np.isnan(oracle))
    assert np.isfinite(oracle).any()
    np.testing.assert_allclose(ours, oracle, rtol=0, atol=1e-5)
    single = image_frame_array(maps[1].numpy(), image_size, config)
    np.testing.assert_array_equal(single, ours[1])
    with pytest.raises(ValueError, match="amap must be"):
        image_frame_array(np.zeros((8, 8), np.float32), image_size, config)


def test_the_torch_free_pipeline_imports_no_torch_and_imageops_shares_its_geometry():
    """One definition of the crop: imageops' names are pixels' own; pixels (and the artifact reader) import
    without torch, which the subprocess blocks."""
    import subprocess
    import sys

    from attr_engine import imageops, pixels

    for name in ("DataConfig", "CropGeometry", "crop_geometry", "decode_image"):
        assert getattr(imageops, name) is getattr(pixels, name), name
    program = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np; from PIL import Image\n"
        "from attr_engine.pixels import DataConfig, decode_image, preprocess_array, image_frame_array\n"
        "import attr_engine.artifact\n"
        "config = DataConfig((16, 16), 0.9)\n"
        "x = preprocess_array(Image.fromarray(np.zeros((20, 30, 3), np.uint8)), config)\n"
        "print(x.shape, image_frame_array(x[0], (20, 30), config).shape)\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["(3,", "16,", "16)", "(20,", "30)"]
