"""Classifiers from torchvision and Hugging Face transformers: load_classifier("torchvision:...") / ("hf:...") on
tiny untrained models built offline, what pretrained=True passes (spied, nothing downloaded), the checkpoint round
trip, the names a file may carry, and the job layer."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torchvision
from transformers import AutoModelForImageClassification, ViTImageProcessor

from attr_engine.classifier import Classifier, is_external_name, load_classifier, save_classifier
from attr_engine.imageops import data_config
from attr_engine.jobs import AttributionJob
from attr_engine.model_sources import IMAGENET_MEAN, HFImageClassifier, split_source
from tests.conftest import tiny_hf_vit


def test_source_prefixes() -> None:
    assert split_source("torchvision:resnet50") == ("torchvision", "resnet50")
    assert split_source("hf:google/vit-base-patch16-224") == ("hf", "google/vit-base-patch16-224")
    assert split_source("hf-hub:timm/resnet18.a1_in1k") == ("timm", "hf-hub:timm/resnet18.a1_in1k")  # timm's own
    with pytest.raises(ValueError, match="names no model after 'hf:'"):
        load_classifier("hf:")


def test_torchvision_by_name_at_32_px_and_its_preprocessing() -> None:
    clf = load_classifier("torchvision:resnet18", num_classes=5, img_size=32)
    assert isinstance(clf.model, torchvision.models.ResNet) and clf.num_classes == 5
    assert clf.input_size == (3, 32, 32) and clf.mean == pytest.approx(IMAGENET_MEAN)
    assert clf(torch.rand(2, 3, 32, 32)).shape == (2, 5)
    # resnet18's default weights: resize 256, crop 224, bilinear (torchvision's metadata, not downloaded)
    cfg = data_config(clf)
    assert cfg.input_size == (32, 32) and cfg.crop_pct == pytest.approx(224 / 256) and cfg.interpolation == "bilinear"
    with torch.device("meta"):  # shapes only: ViT-B/16's 86M weights are never allocated
        vit = load_classifier("torchvision:vit_b_16", num_classes=3, img_size=32)
    assert vit.model.image_size == 32 and vit.input_size == (3, 32, 32)  # img_size reaches a ViT's image_size
    with pytest.raises(ValueError, match=r"unknown torchvision classification model 'resnt18'.*resnet18"):
        load_classifier("torchvision:resnt18")
    with pytest.raises(ValueError, match="cannot build torchvision:resnet18"):
        load_classifier("torchvision:resnet18", depth=3)


def test_torchvision_pretrained_passes_weights_default(monkeypatch) -> None:
    calls: list[dict] = []
    real = torchvision.models.get_model

    def spy(name: str, **kwargs):
        calls.append({"name": name, **kwargs})
        return real(name, **{**kwargs, "weights": None})  # the architecture, without the download

    monkeypatch.setattr(torchvision.models, "get_model", spy)
    load_classifier("torchvision:resnet18", pretrained=True)
    load_classifier("torchvision:resnet18")
    assert [c["weights"] for c in calls] == ["DEFAULT", None] and calls[0]["name"] == "resnet18"


def test_a_torchvision_checkpoint_round_trips_and_loads_through_the_job(tmp_path: Path) -> None:
    clf = load_classifier("torchvision:squeezenet1_1", num_classes=4, img_size=32)  # 0.7M weights
    path = tmp_path / "tv.safetensors"
    save_classifier(clf, path)
    back = load_classifier("torchvision:squeezenet1_1", checkpoint=path)
    assert back.num_classes == 4 and back.input_size == (3, 32, 32)
    x = torch.rand(2, 3, 32, 32)
    assert torch.equal(back(x), clf(x))
    # A torchvision registry name in a file is not external: the job builds it without --model.
    assert not is_external_name("torchvision:squeezenet1_1") and is_external_name("torchvision:resnt18")
    job = AttributionJob(method="saliency", classifier=str(path))
    assert torch.equal(job.load_classifier()(x), clf(x))
    with pytest.warns(UserWarning, match="random weights"):
        fresh = AttributionJob(method="saliency", model="torchvision:squeezenet1_1", num_classes=3).load_classifier()
    assert fresh.num_classes == 3


def test_a_checkpoint_may_not_set_torchvision_weights(tmp_path: Path) -> None:
    clf = load_classifier("torchvision:squeezenet1_1", num_classes=4, img_size=32)
    path = tmp_path / "tv.safetensors"
    save_classifier(clf, path, model_kwargs={"weights": "DEFAULT"})
    with pytest.raises(ValueError, match="refusing model kwarg 'weights'"):
        load_classifier("torchvision:squeezenet1_1", checkpoint=path)


def _hf_dir(tmp_path: Path) -> Path:
    """A tiny ViTForImageClassification and its image processor, saved as a hub repository stores them."""
    root = tmp_path / "hf-vit"
    tiny_hf_vit().save_pretrained(root)
    processor = ViTImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.4] * 3, image_std=[0.2] * 3)
    processor.save_pretrained(root)
    return root


def test_hf_from_a_save_pretrained_directory(tmp_path: Path, monkeypatch) -> None:
    root = _hf_dir(tmp_path)
    calls: list[dict] = []
    real = AutoModelForImageClassification.from_pretrained

    def spy(ident, **kwargs):
        calls.append(kwargs)
        return real(ident, **kwargs)

    monkeypatch.setattr(AutoModelForImageClassification, "from_pretrained", spy)
    clf = load_classifier(f"hf:{root}", pretrained=True)
    # Safetensors only, and no code from the repository.
    assert calls == [{"use_safetensors": True, "trust_remote_code": False}]
    assert isinstance(clf.model, HFImageClassifier) and clf.num_classes == 5
    assert clf.mean == pytest.approx((0.4,) * 3) and clf.std == pytest.approx((0.2,) * 3)
    assert clf.input_size == (3, 32, 32) and data_config(clf).crop_pct == 1.0
    x = torch.rand(2, 3, 32, 32)
    expected = tiny_hf_vit().eval()(pixel_values=(x - 0.4) / 0.2).logits
    torch.testing.assert_close(clf(x), expected)
    # A new head for other classes, random weights from the config alone, position embeddings interpolated.
    assert load_classifier(f"hf:{root}", pretrained=True, num_classes=3).num_classes == 3
    assert load_classifier(f"hf:{root}", num_classes=2).num_classes == 2
    assert clf(torch.rand(1, 3, 48, 48)).shape == (1, 5)


def test_hf_refusals(tmp_path: Path) -> None:
    root = _hf_dir(tmp_path)
    clf = load_classifier(f"hf:{root}", pretrained=True)
    with pytest.raises(ValueError, match="save_pretrained"):
        save_classifier(clf, tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="not from checkpoint="):
        load_classifier(f"hf:{root}", checkpoint=tmp_path / "x.safetensors")
    (root / "preprocessor_config.json").unlink()
    with pytest.raises(ValueError, match="no image processor config"):
        load_classifier(f"hf:{root}", pretrained=True)
    assert is_external_name(f"hf:{root}") and is_external_name("hf:google/vit-base-patch16-224")
    with pytest.raises(ValueError, match="not a transformers image classifier"):
        HFImageClassifier(torch.nn.Linear(2, 2))


def test_hf_through_the_job_layer(tmp_path: Path) -> None:
    root = _hf_dir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random weights
        clf = AttributionJob(method="saliency", model=f"hf:{root}").load_classifier()
    assert isinstance(clf, Classifier) and isinstance(clf.model, HFImageClassifier)
    assert clf(torch.rand(1, 3, 32, 32)).shape == (1, 5)


def test_aha_taps_a_torchvision_swin_channels_first() -> None:
    # torchvision's Swin stages put out (B, h, w, C); read as (B, C, h, w) the "channels" would be the rows.
    from attr_engine.aha.network import FeatureBackbone

    torch.manual_seed(0)
    swin = torchvision.models.SwinTransformer(
        patch_size=[4, 4], embed_dim=12, depths=[1, 1], num_heads=[1, 2], window_size=[2, 2], num_classes=3
    ).eval()
    backbone = FeatureBackbone(swin, torch.zeros(3), torch.ones(3), img_size=32)
    x = torch.rand(2, 3, 32, 32)
    feats = backbone(x)
    assert [tuple(f.shape) for f in feats] == [(2, 12, 8, 8), (2, 24, 4, 4)]
    assert backbone.channels((32, 32)) == [12, 24]
    # The last level is what the model itself pools: its own norm and permute of the last stage, as channels-first.
    with torch.no_grad():
        last = swin.features(x)
    torch.testing.assert_close(feats[-1], last.permute(0, 3, 1, 2))


def test_aha_taps_a_hierarchical_hf_transformer_on_its_own_grids() -> None:
    # Swin's stages hold 8 x 8, 4 x 4, ... tokens, not the patch grid's: its reshaped_hidden_states are the maps.
    from transformers import SwinConfig, SwinForImageClassification

    from attr_engine.aha.network import FeatureBackbone

    torch.manual_seed(0)
    config = SwinConfig(image_size=32, patch_size=4, embed_dim=12, depths=[1, 1], num_heads=[1, 2], window_size=2,
                        num_labels=3)  # fmt: skip
    model = HFImageClassifier(SwinForImageClassification(config).eval())
    backbone = FeatureBackbone(model, torch.zeros(3), torch.ones(3), img_size=32)
    feats = backbone(torch.rand(2, 3, 32, 32))
    assert [tuple(f.shape) for f in feats] == [(2, 24, 4, 4), (2, 24, 4, 4)]
