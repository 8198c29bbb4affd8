"""Classifier adapter: normalisation, freezing, input checks; load_classifier / save_classifier over timm models."""

import re
from pathlib import Path

import pytest
import timm
import torch
from torch import nn

from attr_engine.checkpoint import load_safetensors, save_safetensors
from attr_engine.classifier import Classifier, load_classifier, save_classifier

MEAN, STD = (0.4, 0.5, 0.6), (0.2, 0.25, 0.5)
TINY = {
    "vit": ("vit_tiny_patch16_224", {"patch_size": 8, "depth": 1, "embed_dim": 48, "num_heads": 3}),
    "resnet": ("resnet10t", {"channels": (8, 16, 32, 64)}),
    "convnext": ("convnext_atto", {"depths": (1, 1, 1, 1), "dims": (8, 16, 32, 64)}),
}


class ChannelMean(nn.Module):
    """Logits = per-channel mean of the (normalised) input, so the normalisation is visible in the output."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x.mean(dim=(2, 3))


def test_forward_normalises_inside() -> None:
    clf = Classifier(ChannelMean(), MEAN, STD)
    x = torch.rand(2, 3, 5, 7)
    manual = ((x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)).mean(dim=(2, 3))
    torch.testing.assert_close(clf(x), manual)
    assert clf.mean == pytest.approx(MEAN) and clf.std == pytest.approx(STD)
    assert clf.num_classes == 3  # no num_classes attribute: found by a probe forward


def test_timm_model_matches_manual_normalisation() -> None:
    name, kwargs = TINY["resnet"]
    clf = load_classifier(name, num_classes=4, **kwargs)
    cfg = timm.data.resolve_model_data_config(clf.model)
    assert clf.mean == pytest.approx(cfg["mean"]) and clf.std == pytest.approx(cfg["std"])
    x = torch.rand(2, 3, 32, 32)
    manual = clf.model((x - torch.tensor(cfg["mean"]).view(1, 3, 1, 1)) / torch.tensor(cfg["std"]).view(1, 3, 1, 1))
    torch.testing.assert_close(clf(x), manual)


def test_frozen_parameters_eval_mode_and_input_gradients() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5), nn.Flatten(), nn.LazyLinear(2))
    model(torch.rand(1, 3, 6, 6))  # materialise the lazy layer
    clf = Classifier(model, MEAN, STD)
    assert not any(p.requires_grad for p in clf.parameters())
    clf.train()
    assert not clf.training and not any(m.training for m in clf.modules())
    outer = nn.Sequential(clf)
    outer.train()  # a parent's .train() must not unfreeze the classifier either
    assert not model.training
    x = torch.rand(2, 3, 6, 6, requires_grad=True)
    out1, out2 = clf(x), clf(x)
    torch.testing.assert_close(out1, out2)  # dropout off, BatchNorm uses running stats
    out1.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert all(p.grad is None for p in clf.parameters())


@pytest.mark.parametrize(
    ("x", "match"),
    [
        (torch.rand(3, 8, 8), "4 dimensions"),
        (torch.rand(1, 1, 8, 8), "RGB images"),
        (torch.rand(1, 4, 8, 8), "RGB images"),
        (torch.randint(0, 255, (1, 3, 8, 8)), "float32"),
        (torch.full((1, 3, 8, 8), float("nan")), "NaN or infinite"),
        (torch.full((1, 3, 8, 8), float("inf")), "NaN or infinite"),
        ([[0.0]], r"torch\.Tensor"),
    ],
)
def test_bad_inputs_raise(x, match: str) -> None:
    clf = Classifier(ChannelMean(), MEAN, STD)
    with pytest.raises(ValueError, match=match):
        clf(x)


def test_bad_construction_raises() -> None:
    with pytest.raises(ValueError, match="pretrained_cfg"):
        Classifier(ChannelMean())
    with pytest.raises(ValueError, match="3 entries"):
        Classifier(ChannelMean(), (0.5, 0.5), STD)
    with pytest.raises(ValueError, match="std must be positive"):
        Classifier(ChannelMean(), MEAN, (1.0, 0.0, 1.0))
    with pytest.raises(ValueError, match="input_size"):
        Classifier(ChannelMean(), MEAN, STD, input_size=(1, 8, 8))
    with pytest.raises(ValueError, match=r"nn\.Module"):
        Classifier(lambda x: x, MEAN, STD)  # type: ignore[arg-type]


def test_validate_inputs_can_be_switched_off() -> None:
    clf = Classifier(ChannelMean(), MEAN, STD, validate_inputs=False)
    assert torch.isnan(clf(torch.full((1, 3, 4, 4), float("nan")))).all()


@pytest.mark.parametrize("family", sorted(TINY))
def test_load_classifier_tiny_configs(family: str) -> None:
    name, kwargs = TINY[family]
    clf = load_classifier(name, num_classes=5, img_size=32, **kwargs)
    assert isinstance(clf, Classifier) and clf.num_classes == 5
    assert clf.input_size == (3, 32, 32)
    assert clf.model_name == name
    out = clf(torch.rand(2, 3, 32, 32))
    assert out.shape == (2, 5) and torch.isfinite(out).all()
    assert not any(p.requires_grad for p in clf.parameters())
    cfg = timm.models.get_pretrained_cfg(name)
    assert clf.mean == pytest.approx(cfg.mean) and clf.std == pytest.approx(cfg.std)


def test_img_size_reaches_vit_only() -> None:
    vit_name, vit_kwargs = TINY["vit"]
    vit = load_classifier(vit_name, num_classes=2, img_size=48, **vit_kwargs)
    assert tuple(vit.model.patch_embed.img_size) == (48, 48)
    assert vit.model.pos_embed.shape[1] == 1 + (48 // 8) ** 2
    # A CNN does not take img_size (timm would raise); it is only recorded.
    cnn_name, cnn_kwargs = TINY["resnet"]
    cnn = load_classifier(cnn_name, num_classes=2, img_size=40, **cnn_kwargs)
    assert cnn.input_size == (3, 40, 40)


def test_unknown_model_lists_close_matches() -> None:
    with pytest.raises(ValueError, match=r"unknown timm model 'resnt18'.*resnet18"):
        load_classifier("resnt18")
    with pytest.raises(ValueError, match="vit_tiny_patch16_224"):
        load_classifier("vit_tiny_patch16")


def test_checkpoint_round_trip_rebuilds_architecture(tmp_path: Path) -> None:
    name, kwargs = TINY["vit"]
    clf = load_classifier(name, num_classes=3, img_size=32, **kwargs)
    with torch.no_grad():
        clf.model.head.bias.add_(torch.tensor([1.0, -2.0, 0.5]))  # differ from a fresh init
    path = tmp_path / "clf.safetensors"
    save_classifier(clf, path)
    # Name only: num_classes, img_size, kwargs and mean/std come from the checkpoint's metadata.
    restored = load_classifier(name, checkpoint=path)
    x = torch.rand(2, 3, 32, 32)
    torch.testing.assert_close(restored(x), clf(x), rtol=0, atol=0)
    assert restored.input_size == clf.input_size and restored.mean == clf.mean

    # A bare timm state dict (no metadata) loads when the caller gives the architecture.
    tensors, _ = load_safetensors(path)
    bare = tmp_path / "bare.safetensors"
    save_safetensors(tensors, bare)
    again = load_classifier(name, checkpoint=bare, num_classes=3, img_size=32, **kwargs)
    torch.testing.assert_close(again(x), clf(x), rtol=0, atol=0)

    # A whole Classifier's state dict brings its own normalisation along.
    custom = Classifier(clf.model, MEAN, STD)
    whole = tmp_path / "whole.safetensors"
    save_safetensors(custom.state_dict(), whole)
    from_whole = load_classifier(name, checkpoint=whole, num_classes=3, img_size=32, **kwargs)
    assert from_whole.mean == pytest.approx(MEAN) and from_whole.std == pytest.approx(STD)
    torch.testing.assert_close(from_whole(x), custom(x), rtol=0, atol=0)


def test_checkpoint_errors_name_the_file(tmp_path: Path) -> None:
    name, kwargs = TINY["resnet"]
    path = tmp_path / "r10.safetensors"
    save_classifier(load_classifier(name, num_classes=3, **kwargs), path)
    mismatch = r"r10\.safetensors does not match resnet10t.*fc\.bias is \(3,\) in the file, \(4,\) in the model"
    with pytest.raises(ValueError, match=mismatch):
        load_classifier(name, checkpoint=path, num_classes=4)
    with pytest.raises(ValueError, match=r"r10\.safetensors was saved for model 'resnet10t'"):
        load_classifier("resnet18", checkpoint=path)
    bare = tmp_path / "bare.safetensors"
    save_safetensors({"not_a_weight": torch.zeros(1)}, bare)
    with pytest.raises(ValueError, match=r"bare\.safetensors does not match resnet10t.*missing"):
        load_classifier(name, checkpoint=bare, num_classes=3, **kwargs)
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"corrupt\.safetensors"):
        load_classifier(name, checkpoint=corrupt)
    with pytest.raises(FileNotFoundError, match=r"missing\.safetensors"):
        load_classifier(name, checkpoint=tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="not both"):
        load_classifier(name, pretrained=True, checkpoint=path)


def _crafted(tmp_path: Path, **meta_changes: str) -> Path:
    """A valid tiny classifier checkpoint with some of its metadata replaced."""
    name, kwargs = TINY["resnet"]
    good = tmp_path / "good.safetensors"
    save_classifier(load_classifier(name, num_classes=3, **kwargs), good)
    state, meta = load_safetensors(good)
    path = tmp_path / "crafted.safetensors"
    save_safetensors(state, path, {**meta, **meta_changes})
    return path


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_kwargs": '{"bogus": 1}'}, r"crafted\.safetensors: cannot build resnet10t .*bogus"),
        ({"model_kwargs": '{"checkpoint_path": "weights.pth"}'}, "refusing model kwarg 'checkpoint_path'"),
        ({"model_kwargs": '{"pretrained_cfg_overlay": {"file": "w.pth"}}'}, "refusing model kwarg 'pretrained_cfg"),
        ({"model_kwargs": '{"cache_dir": "elsewhere"}'}, "refusing model kwarg 'cache_dir'"),
        ({"model_kwargs": '{"depth": {"nested": 1}}'}, "must be a plain JSON value"),
        ({"model_kwargs": "[1, 2]"}, "model_kwargs must be a JSON object"),
        ({"model_kwargs": "{not json"}, "model_kwargs is not JSON"),
        ({"num_classes": "three"}, "corrupt metadata: num_classes must be an integer"),
    ],
)
def test_crafted_checkpoint_metadata_is_refused_in_one_value_error(tmp_path: Path, changes, message) -> None:
    """Issue #10.13: unknown kwargs gave a TypeError traceback; kwargs that open other files were passed to timm."""
    path = _crafted(tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        load_classifier("resnet10t", checkpoint=path)


def test_a_checkpoint_naming_another_architecture_is_one_value_error(tmp_path: Path) -> None:
    path = _crafted(tmp_path, model_name="vit_tiny_patch16_224")
    with pytest.raises(ValueError, match=r"crafted\.safetensors: cannot build vit_tiny_patch16_224"):
        load_classifier("vit_tiny_patch16_224", checkpoint=path)
    # drop_path_rate is an architecture argument, not a path: it still loads.
    name, kwargs = TINY["resnet"]
    ok = tmp_path / "ok.safetensors"
    save_classifier(load_classifier(name, num_classes=3, drop_path_rate=0.1, **kwargs), ok)
    assert load_classifier(name, checkpoint=ok).num_classes == 3


def test_save_classifier_rejects_unserialisable_kwargs(tmp_path: Path) -> None:
    clf = Classifier(ChannelMean(), MEAN, STD)
    with pytest.raises(ValueError, match="JSON"):
        save_classifier(clf, tmp_path / "x.safetensors", model_kwargs={"act": nn.ReLU})
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------------------------
# A path, a name or an object given where another goes: read as meant, or one line saying what to pass instead
# ---------------------------------------------------------------------------------------------------------------


def _saved(tmp_path: Path) -> tuple[Classifier, Path]:
    """A tiny ResNet saved as train-classifier writes it (OUT/classifier.safetensors)."""
    name, kwargs = TINY["resnet"]
    clf = load_classifier(name, num_classes=3, img_size=32, seed=0, **kwargs)
    (tmp_path / "clf").mkdir()
    path = tmp_path / "clf" / "classifier.safetensors"
    save_classifier(clf, path)
    return clf, path


def test_a_checkpoint_path_given_as_the_name_loads_as_the_checkpoint(tmp_path: Path) -> None:
    """The file records its architecture, sizes, kwargs and normalisation: the path alone rebuilds the model."""
    clf, path = _saved(tmp_path)
    x = torch.rand(2, 3, 32, 32)
    for given in (str(path), path):
        restored = load_classifier(given)
        assert restored.model_name == "resnet10t" and restored.input_size == (3, 32, 32)
        torch.testing.assert_close(restored(x), clf(x), rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match=r"classifier checkpoint not found: runs/clf/classifier\.safetensors"):
        load_classifier("runs/clf/classifier.safetensors")
    with pytest.raises(ValueError, match="beside checkpoint="):
        load_classifier(str(path), checkpoint=path)


def test_a_checkpoint_path_without_its_architecture_says_to_pass_the_name(tmp_path: Path) -> None:
    _, path = _saved(tmp_path)
    bare = tmp_path / "bare.safetensors"
    save_safetensors(load_safetensors(path)[0], bare)
    say = r"does not record its architecture: .* load_classifier\(NAME, checkpoint=PATH\)"
    with pytest.raises(ValueError, match=say):
        load_classifier(str(bare))


def test_a_directory_or_an_explainer_where_a_classifier_goes_is_named(tmp_path: Path) -> None:
    from attr_engine.aha import AHA, AHAConfig

    clf, path = _saved(tmp_path)
    AHA(clf, AHAConfig(decoder_dim=8, class_dim=4)).save(tmp_path / "aha")
    folder = re.escape(str(tmp_path / "clf"))
    in_it = re.escape(f"pass the classifier checkpoint in it, load_classifier(checkpoint='{path}')")
    with pytest.raises(ValueError, match=rf"load_classifier takes a model name, but {folder} is a directory: {in_it}"):
        load_classifier(str(tmp_path / "clf"))
    with pytest.raises(ValueError, match=rf"^{folder} is a directory: {in_it}"):
        load_classifier("resnet10t", checkpoint=tmp_path / "clf")
    with pytest.raises(ValueError, match=r"is an AHA checkpoint directory .*AHA\.load\("):
        load_classifier(str(tmp_path / "aha"))
    with pytest.raises(ValueError, match=r"is an AHA checkpoint directory .*AHA\.load\("):
        load_classifier(checkpoint=tmp_path / "aha")
    with pytest.raises(ValueError, match=r"explainer\.safetensors is an AHA explainer's weights, not a classifier"):
        load_classifier(checkpoint=tmp_path / "aha" / "explainer.safetensors")
    name_it = rf"{folder} is a directory: name the checkpoint file, e\.g\. {re.escape(str(path))}"
    with pytest.raises(ValueError, match=name_it):
        save_classifier(clf, tmp_path / "clf")


def test_a_model_object_given_as_the_name_is_named() -> None:
    clf = Classifier(ChannelMean(), MEAN, STD)
    with pytest.raises(ValueError, match="this is a Classifier already: use a Classifier as it is"):
        load_classifier(clf)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"got str; build the classifier first: load_classifier\('resnet18'\)"):
        Classifier("resnet18", MEAN, STD)  # type: ignore[arg-type]


def test_an_hf_name_that_is_a_missing_folder_or_a_file_is_named(tmp_path: Path) -> None:
    """transformers would report a missing folder as a malformed hub repo id, and a file as broken JSON."""
    _, path = _saved(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"hf:\./nope: no such directory"):
        load_classifier("hf:./nope")
    with pytest.raises(ValueError, match=r"is a classifier checkpoint, not a transformers directory"):
        load_classifier(f"hf:{path}")
