"""Every registered method on every model family: timm CNN and ViT, torchvision ResNet and ViT, a transformers ViT
(the shared tiny classifiers of conftest.py). Each method either gives finite (B, H, W) maps or refuses the model
with one ValueError that says why; which of the two is pinned here, so a method that starts or stops working on a
family is noticed. The registry is iterated, so methods added later join the matrix by themselves."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch

from attr_engine.explainer import get_explainer, list_explainers
from tests.aha_helpers import tiny_aha
from tests.conftest import ZOO
from tests.eval_helpers import single_thread

# Small option values: the matrix checks that each method runs on each family, not its numbers.
FAST = {
    "integrated-gradients": {"n_steps": 4},
    "smoothgrad": {"n_samples": 2},
    "rise": {"n_masks": 8},
    "occlusion": {"window": 16, "stride": 16},
    "pullback-ascent": {"steps": 1},
    "captum:IntegratedGradients": {"n_steps": 4},
}
# One or two members of each family.
FAMILY_MEMBERS = ("captum:IntegratedGradients", "captum:Saliency", "gradcam:GradCAM")
# (method, model) pairs that refuse, and a word of the reason their message must contain.
REFUSED = {
    ("attention-rollout", "timm_cnn"): "does not apply",
    ("attention-rollout", "tv_resnet"): "does not apply",
    ("attention-rollout", "tv_vit"): "does not apply",
    ("attention-rollout", "hf_vit"): "does not apply",
    ("legrad", "timm_cnn"): "does not apply",
    ("legrad", "tv_resnet"): "does not apply",
    ("guided-grad-cam", "timm_vit"): "does not apply",
    ("guided-grad-cam", "tv_resnet"): "does not apply",
    ("guided-grad-cam", "tv_vit"): "does not apply",
    ("guided-grad-cam", "hf_vit"): "does not apply",
    ("deeplift", "tv_resnet"): "used more than once",
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


def _methods() -> list[str]:
    return [*list_explainers(), *FAMILY_MEMBERS]


@pytest.mark.parametrize("model", ZOO)
def test_every_method_explains_or_refuses_every_model_family(model: str, request) -> None:
    clf = request.getfixturevalue(model)
    x = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    ran, refused = [], {}
    for name in _methods():
        kwargs = {"aha": tiny_aha(clf)} if name == "aha" else {}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # e.g. DeepLift's notes on untested nonlinearities
                explainer = get_explainer(name, clf, **kwargs, **FAST.get(name, {}))
                maps = explainer.attribute(x, target=1)
        except ValueError as err:
            refused[name] = str(err)
            continue
        assert maps.shape == (1, 32, 32) and maps.dtype == torch.float32, name
        assert torch.isfinite(maps).all(), name
        ran.append(name)
    expected = {m: reason for (m, family), reason in REFUSED.items() if family == model}
    assert set(refused) == set(expected), refused
    for name, reason in expected.items():
        assert reason in refused[name], (name, refused[name])
    assert len(ran) >= len(_methods()) - len(expected)


def test_a_raw_transformers_classifier_is_wrapped_and_a_headless_one_refused() -> None:
    """Issue #33 item 8: ``Classifier(ViTForImageClassification(...), mean, std)`` failed with "Input image size
    (224*224) doesn't match model (32*32)" (its output object is no logits tensor either). It is wrapped in
    HFImageClassifier: same input size, logits and gradients as the README's explicit wrapping."""
    from transformers import ViTModel

    from attr_engine.classifier import Classifier
    from attr_engine.model_sources import HFImageClassifier
    from tests.conftest import tiny_hf_vit

    hf = tiny_hf_vit()
    raw = Classifier(hf, (0.5,) * 3, (0.5,) * 3)
    wrapped = Classifier(HFImageClassifier(hf), (0.5,) * 3, (0.5,) * 3)
    assert isinstance(raw.model, HFImageClassifier) and raw.model.hf is hf
    assert raw.input_size == (3, 32, 32) and raw.num_classes == hf.config.num_labels
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(raw(x), wrapped(x), rtol=0, atol=0)
    maps = get_explainer("saliency", raw).attribute(x, target=1)
    torch.testing.assert_close(maps, get_explainer("saliency", wrapped).attribute(x, target=1), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"^ViTModel is a transformers model without an image-classification head;"
                       r".*HFImageClassifier"):  # fmt: skip
        Classifier(ViTModel(hf.config), (0.5,) * 3, (0.5,) * 3)
