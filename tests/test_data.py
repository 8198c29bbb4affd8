"""ShapesDataset (determinism, masks, labelling rule) and ImageFolderDataset (layouts, resizing, bad files)."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from attr_engine.data import SHAPE_KINDS, ImageFolderDataset, ShapesDataset


@pytest.mark.parametrize("colour_cue", [True, False])
def test_shapes_items_are_valid(colour_cue: bool) -> None:
    ds = ShapesDataset(24, img_size=40, seed=3, num_classes=6, colour_cue=colour_cue)
    assert len(ds) == 24 and ds.class_names == SHAPE_KINDS[:6]
    for i in range(len(ds)):
        s = ds.render(i)
        image, label, mask = ds[i]
        assert torch.equal(image, s.image) and torch.equal(mask, s.mask) and label == s.label
        assert image.shape == (3, 40, 40) and image.dtype == torch.float32
        assert mask.shape == (40, 40) and mask.dtype == torch.bool
        assert 0.0 <= float(image.min()) and float(image.max()) <= 1.0
        assert label == i % 6
        area = int(mask.sum())
        assert area >= 0.03 * 40 * 40, f"item {i}: target mask too small ({area} px)"
        # The target is visible: inside the mask the image departs clearly from the bare background.
        diff = (s.image - s.background).abs().amax(dim=0)
        assert float(diff[mask].mean()) > 0.15, f"item {i}: target does not stand out"
        # Labelling rule: distractors are disjoint from the target and smaller than it, even all together.
        assert not (s.distractor_mask & mask).any()
        assert int(s.distractor_mask.sum()) < area
        # Outside the target and distractors only pixel noise separates image and background.
        background_only = ~mask & ~s.distractor_mask
        assert float(diff[background_only].mean()) < 0.05


def test_shapes_deterministic_per_seed_and_index() -> None:
    a = ShapesDataset(10, img_size=32, seed=5)
    b = ShapesDataset(200, img_size=32, seed=5)  # an item does not depend on the dataset length
    c = ShapesDataset(10, img_size=32, seed=6)
    for i in (0, 3, 9):
        for x, y in zip(a[i], b[i], strict=True):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        assert not torch.equal(a[i][0], c[i][0])
    assert not torch.equal(a[0][0], a[a.num_classes][0])  # same label, different image
    assert torch.equal(a[-1][0], a[9][0])


def test_shapes_any_size_and_pairs() -> None:
    ds = ShapesDataset(3, img_size=37, num_classes=2, max_distractors=0, with_masks=False)
    item = ds[1]
    assert len(item) == 2 and item[0].shape == (3, 37, 37) and item[1] == 1
    images, labels, masks = ShapesDataset(5, img_size=16, num_classes=3).tensors()
    assert images.shape == (5, 3, 16, 16) and masks.shape == (5, 16, 16)
    assert labels.tolist() == [0, 1, 2, 0, 1]


def test_shapes_hue_is_uninformative_without_colour_cue() -> None:
    # With colour_cue off, hue carries no label information: compare mean target hue spread per class.
    ds = ShapesDataset(60, img_size=32, num_classes=3, colour_cue=False, max_distractors=0)
    colours = {k: [] for k in range(3)}
    for i in range(len(ds)):
        image, label, mask = ds[i]
        colours[label].append(image[:, mask].mean(dim=1))
    spreads = [torch.stack(v).std(dim=0).mean() for v in colours.values()]
    assert min(spreads) > 0.1


def test_shapes_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_classes"):
        ShapesDataset(4, num_classes=1)
    with pytest.raises(ValueError, match="num_classes"):
        ShapesDataset(4, num_classes=len(SHAPE_KINDS) + 1)
    with pytest.raises(ValueError, match="img_size"):
        ShapesDataset(4, img_size=4)
    with pytest.raises(ValueError, match="seed"):
        ShapesDataset(4, seed=-1)
    with pytest.raises(IndexError):
        ShapesDataset(4)[4]


def _write_image(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


@pytest.fixture
def image_tree(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    _write_image(tmp_path / "cat" / "a.png", rng.integers(0, 256, (12, 20, 3), dtype=np.uint8))
    _write_image(tmp_path / "cat" / "nested" / "b.PNG", rng.integers(0, 256, (30, 10), dtype=np.uint8))  # grey
    _write_image(tmp_path / "dog" / "c.png", rng.integers(0, 256, (16, 16, 4), dtype=np.uint8))  # RGBA
    (tmp_path / "dog" / "broken.jpg").write_bytes(b"\xff\xd8 definitely not a jpeg")
    (tmp_path / "dog" / "notes.txt").write_text("ignored: not an image extension")
    (tmp_path / "empty_class").mkdir()  # no images: not a class
    return tmp_path


def test_image_folder_classes_and_exact_pixels(image_tree: Path) -> None:
    ds = ImageFolderDataset(image_tree)
    assert ds.class_names == ("cat", "dog") and ds.num_classes == 2
    assert [(p.name, y) for p, y in ds.samples] == [("a.png", 0), ("b.PNG", 0), ("broken.jpg", 1), ("c.png", 1)]
    image, label = ds[0]
    expected = np.asarray(Image.open(image_tree / "cat" / "a.png"), dtype=np.float32) / 255.0
    assert label == 0 and image.shape == (3, 12, 20) and image.dtype == torch.float32
    torch.testing.assert_close(image, torch.from_numpy(expected).permute(2, 0, 1))
    grey, _ = ds[1]
    assert grey.shape == (3, 30, 10) and torch.equal(grey[0], grey[2])
    assert ds[3][0].shape == (3, 16, 16)
    with pytest.raises(ValueError, match=r"cannot read image .*broken\.jpg"):
        ds[2]


def test_image_folder_skips_and_reports_unreadable(image_tree: Path) -> None:
    with pytest.warns(UserWarning, match=r"skipped 1 unreadable image.*broken\.jpg"):
        ds = ImageFolderDataset(image_tree, img_size=8, skip_unreadable=True)
    assert len(ds) == 3 and [p.name for p, _ in ds.skipped] == ["broken.jpg"]
    for i in range(len(ds)):
        image, _ = ds[i]
        assert image.shape == (3, 8, 8) and 0.0 <= float(image.min()) <= float(image.max()) <= 1.0


def test_image_folder_resize_center_crop(tmp_path: Path) -> None:
    # Left third red, middle green, right third blue: a centre crop of the square keeps mostly green.
    array = np.zeros((30, 90, 3), dtype=np.uint8)
    array[:, :30, 0], array[:, 30:60, 1], array[:, 60:, 2] = 255, 255, 255
    _write_image(tmp_path / "wide.png", array)
    image, label = ImageFolderDataset(tmp_path, img_size=10)[0]
    assert label == -1 and image.shape == (3, 10, 10)
    assert float(image[1].mean()) > 0.95 and float(image[0].mean()) < 0.05 and float(image[2].mean()) < 0.05
    # crop_pct < 1 resizes the short side to 10 / 0.5 = 20 first, so the crop still sees only green.
    image, _ = ImageFolderDataset(tmp_path, img_size=10, crop_pct=0.5)[0]
    assert float(image[1].mean()) > 0.95


def test_image_folder_flat_and_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ImageFolderDataset(tmp_path / "missing")
    with pytest.raises(ValueError, match="no images"):
        ImageFolderDataset(tmp_path)
    _write_image(tmp_path / "x.png", np.zeros((4, 4, 3), dtype=np.uint8))
    (tmp_path / "y.png").write_bytes(b"junk")
    flat = ImageFolderDataset(tmp_path)
    assert flat.class_names == () and [y for _, y in flat.samples] == [-1, -1]
    with pytest.raises(ValueError, match=r"y\.png"):
        flat[1]
    (tmp_path / "x.png").write_bytes(b"junk")
    with pytest.raises(ValueError, match="every image"), pytest.warns(UserWarning):
        ImageFolderDataset(tmp_path, skip_unreadable=True)
    with pytest.raises(ValueError, match="crop_pct"):
        ImageFolderDataset(tmp_path, img_size=8, crop_pct=0.0)


def test_image_folder_reads_16_bit_and_float_images_into_the_unit_range(tmp_path: Path) -> None:
    """Issue #10.4: a 16-bit greyscale PNG came out all 1.0 (convert("RGB") clips at 255)."""
    grey16 = (np.arange(12 * 20, dtype=np.uint16).reshape(12, 20) * 273).astype(np.uint16)
    Image.fromarray(grey16).save(tmp_path / "a16.png")
    assert Image.open(tmp_path / "a16.png").mode.startswith("I")
    grey_f = np.linspace(0.0, 1.0, 12 * 20, dtype=np.float32).reshape(12, 20)
    Image.fromarray(grey_f).save(tmp_path / "b.tif")  # 32-bit float TIFF, mode F
    ds = ImageFolderDataset(tmp_path)
    for (image, _), want in zip((ds[0], ds[1]), (grey16 / 65535.0, grey_f), strict=True):
        assert image.shape == (3, 12, 20) and image.dtype == torch.float32
        for channel in image:
            np.testing.assert_allclose(channel.numpy(), want, atol=1e-6)
    resized = ImageFolderDataset(tmp_path, img_size=8)[0][0]
    assert resized.shape == (3, 8, 8) and 0.0 <= resized.min() and resized.max() <= 1.0
    assert 0.2 < resized.mean() < 0.8  # not the white image it used to be


def test_images_next_to_class_folders_are_reported_or_kept(image_tree: Path) -> None:
    """Issue #10.5: images directly in root were dropped without a word when class folders existed."""
    rng = np.random.default_rng(1)
    for name in ("top1.png", "top2.png"):
        _write_image(image_tree / name, rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    with pytest.warns(UserWarning, match=r"2 image\(s\) directly in .* are in no class folder and are left out"):
        ds = ImageFolderDataset(image_tree, skip_unreadable=False)
    assert [p.name for p in ds.unclassified] == ["top1.png", "top2.png"]
    assert all(label >= 0 for _, label in ds.samples)
    kept = ImageFolderDataset(image_tree, include_unclassified=True)
    assert [(p.name, label) for p, label in kept.samples[:2]] == [("top1.png", -1), ("top2.png", -1)]
    assert len(kept) == len(ds) + 2 and kept.class_names == ds.class_names


def test_linked_directories_are_followed_once_and_a_loop_lists_nothing_twice(image_tree: Path) -> None:
    """Hardening #12: a directory link to ``.`` was followed one level, so every image was listed (explained) twice;
    every real directory is entered once now, through its real path before any link."""
    (image_tree / "loop").symlink_to(".", target_is_directory=True)  # root/loop -> root
    (image_tree / "cat" / "up").symlink_to("..", target_is_directory=True)  # cat/up -> root
    (image_tree / "cat" / "nested" / "again").symlink_to("..", target_is_directory=True)  # -> cat
    (image_tree / "a_dog").symlink_to("dog", target_is_directory=True)  # sorts first; dog keeps its images
    ds = ImageFolderDataset(image_tree)
    assert ds.class_names == ("cat", "dog")
    listed = [(p.relative_to(image_tree).as_posix(), y) for p, y in ds.samples]
    assert listed == [("cat/a.png", 0), ("cat/nested/b.PNG", 0), ("dog/broken.jpg", 1), ("dog/c.png", 1)]
    # A flat folder with a link to itself stays flat, each image once.
    flat = image_tree / "dog"
    (flat / "self").symlink_to(".", target_is_directory=True)
    (flat / "broken.jpg").unlink()
    assert [(p.name, y) for p, y in ImageFolderDataset(flat).samples] == [("c.png", -1)]
    # A link to a folder outside the tree is still followed (once).
    outside = image_tree.parent / f"{image_tree.name}-outside"
    _write_image(outside / "far.png", np.zeros((4, 4, 3), dtype=np.uint8))
    (image_tree / "cat" / "far").symlink_to(outside, target_is_directory=True)
    (image_tree / "cat" / "far2").symlink_to(outside, target_is_directory=True)
    names = [p.relative_to(image_tree).as_posix() for p, _ in ImageFolderDataset(image_tree).samples]
    assert names.count("cat/far/far.png") + names.count("cat/far2/far.png") == 1 and len(names) == 4


# (h, w), img_size, crop_pct where the folder's old resize/crop (rounded long side, floored offset, rounded short
# side, PIL's reducing_gap shortcut) cut other pixels than explain's: the folder now cuts explain's.
_ONE_PIPELINE_CASES = [
    ((30, 47), 10, 1.0),  # long side 15.67: 15 px (truncated, timm), not 16; offset 2, not 3
    ((47, 30), 10, 0.9),  # offset (17 - 10) / 2 = 3.5: 4 (rounded), not 3
    ((24, 37), 16, 0.95),  # short side 16 / 0.95 = 16.8: 16 px (floored, timm), not 17
    ((300, 420), 10, 1.0),  # a 30x shrink: a plain bicubic filter, no box-reduce first
    ((12, 20), 12, 1.0),  # the short side already at img_size: no resize of it
]


@pytest.mark.parametrize(("shape", "img_size", "crop_pct"), _ONE_PIPELINE_CASES)
@pytest.mark.parametrize("kind", ["rgb", "grey16"])
def test_the_folder_gives_the_classifier_the_pixels_explain_gives_it(tmp_path, shape, img_size, crop_pct, kind):
    """Issue: training (the folder dataset) and explaining (decode_image + prepare_input) cropped one pixel apart.
    Both go through one decode, one geometry and one pil_to_tensor now: the same file, the same tensor, bit for bit."""
    from attr_engine.imageops import DataConfig, crop_geometry, decode_image, prepare_input

    rng = np.random.default_rng(sum(shape))
    if kind == "rgb":
        _write_image(tmp_path / "im.png", rng.integers(0, 256, (*shape, 3), dtype=np.uint8))
    else:
        _write_image(tmp_path / "im.png", rng.integers(0, 65536, shape, dtype=np.uint16))
    ds = ImageFolderDataset(tmp_path, img_size=img_size, crop_pct=crop_pct)
    image, _ = ds[0]
    config = DataConfig((img_size, img_size), crop_pct, "bicubic")
    assert ds.config == config
    x, size, original = prepare_input(decode_image(tmp_path / "im.png"), config, keep_original=True)
    assert image.shape == (3, img_size, img_size) and size == shape
    assert torch.equal(image, x)
    # Without img_size the folder gives the whole decoded image, as explain's overlays see it.
    whole, _ = ImageFolderDataset(tmp_path)[0]
    assert original is not None and torch.equal(whole.mul(255).round().to(torch.uint8), original)
    # And the crop is timm's arithmetic, which the cases above were picked to tell from the old folder rule.
    geo = crop_geometry(shape, config)
    assert geo.size == (img_size, img_size) and min(geo.resized) == max(img_size, int(img_size / crop_pct))


def test_the_private_decode_is_a_deprecated_alias_of_decode_image(image_tree: Path) -> None:
    from attr_engine.imageops import decode_image

    ds = ImageFolderDataset(image_tree)
    img = ds._decode(image_tree / "cat" / "a.png")
    assert np.array_equal(np.asarray(img), np.asarray(decode_image(image_tree / "cat" / "a.png")))
    with pytest.raises(ValueError, match=r"cannot read image .*broken\.jpg"):
        ImageFolderDataset._decode(image_tree / "dog" / "broken.jpg")
