"""The CAM family of pytorch-grad-cam (``gradcam:<Class>``) against the library's own call, the automatic target
layers (timm CNNs / ViTs, torchvision ResNet / VGG / ConvNeXt / ViT), and the project's ``grad-cam`` on torchvision
models. Tiny untrained models, one torch thread."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from captum.attr import LayerGradCam
from torchvision.models.convnext import CNBlockConfig

from attr_engine.baselines import GradCAM, GradCamMethod
from attr_engine.baselines.cam import cnn_stage, find_layer, has_cnn_stage, layer_name
from attr_engine.baselines.gradcam_any import cam_layer
from attr_engine.classifier import Classifier
from attr_engine.cli import main
from attr_engine.explainer import get_explainer, list_explainers, list_methods, resolve_explainer
from tests import vit_twins
from tests.eval_helpers import images, single_thread, tiny_resnet, tiny_vit, untrained_resnet_checkpoint
from tests.tolerances import tol

REPO = Path(__file__).resolve().parents[1]
IMAGENET = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}
# The CNNs at 64 px: their last stage is a 2 x 2 grid there (1 x 1 at 32 px, where every CAM is constant).
SIZE = {"timm_cnn": 64, "timm_vit": 32, "tv_resnet": 64, "tv_vit": 32}
CLASSES = ["GradCAM", "GradCAMPlusPlus", "HiResCAM", "XGradCAM", "LayerCAM", "EigenCAM", "ScoreCAM"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


@pytest.fixture(scope="module")
def lib() -> Any:
    return pytest.importorskip("pytorch_grad_cam")


def tv_resnet() -> Classifier:
    torch.manual_seed(0)
    return Classifier(torchvision.models.resnet18(num_classes=4), **IMAGENET)


def tv_vit() -> Classifier:
    """A 2-layer torchvision ViT on 32 px (4 x 4 patches); its zero-initialised head made random, else every
    gradient is zero."""
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=4
    )
    torch.nn.init.normal_(model.heads.head.weight)
    return Classifier(model, **IMAGENET)


@pytest.fixture(scope="module")
def models() -> dict[str, Classifier]:
    return {"timm_cnn": tiny_resnet(), "timm_vit": tiny_vit(), "tv_resnet": tv_resnet(), "tv_vit": tv_vit()}


def library_maps(lib: Any, name: str, clf: Classifier, layer: Any, x: torch.Tensor, y: torch.Tensor, **call: Any):
    """The library's own call, as its README writes it (the ViT reshapes are the library's own functions)."""
    reshape = None
    if hasattr(clf.model, "blocks") or hasattr(clf.model, "encoder"):
        reshape = partial(lib.utils.reshape_transforms.vit_reshape_transform, height=4, width=4)
    targets = [lib.utils.model_targets.ClassifierOutputTarget(int(t)) for t in y]
    with getattr(lib, name)(model=clf, target_layers=[layer], reshape_transform=reshape) as cam:
        return torch.from_numpy(cam(input_tensor=x.clone().requires_grad_(True), targets=targets, **call))


# ---------------------------------------------------------------------------------------------------------------
# gradcam:<Class> equals the library's call
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["timm_cnn", "timm_vit", "tv_resnet"])
@pytest.mark.parametrize("name", CLASSES)
def test_each_method_equals_the_library_call(lib, models, model, name) -> None:
    clf, size = models[model], SIZE[model]
    x, y = images(2, size, seed=1), torch.tensor([2, 3])
    explainer = get_explainer(f"gradcam:{name}", clf)
    maps = explainer.attribute(x, y)
    assert explainer.name == f"gradcam:{name}" and maps.shape == (2, size, size) and maps.dtype == torch.float32
    torch.testing.assert_close(maps, library_maps(lib, name, clf, explainer.layer, x, y), rtol=0, atol=0)
    assert float(maps.min()) >= 0 and float(maps.max()) <= 1
    assert not explainer.layer._forward_hooks, "a hook of the library stayed on the layer"


def test_the_maps_are_not_trivially_zero(models) -> None:
    """The equality above would hold for all-zero maps: Grad-CAM on these random models responds to the classes it
    is asked about there (not to every class: the ReLU zeroes the timm CNN's class 1)."""
    for model in ("timm_cnn", "timm_vit", "tv_resnet", "tv_vit"):
        maps = get_explainer("gradcam:GradCAM", models[model]).attribute(images(2, SIZE[model], seed=1), [2, 3])
        assert maps.flatten(1).amax(1).min() > 0.5, model


def test_a_torchvision_vit_drops_its_class_token(lib, models) -> None:
    clf, x, y = models["tv_vit"], images(2, 32, seed=2), torch.tensor([0, 2])
    explainer = get_explainer("gradcam:GradCAM", clf)
    assert explainer.layer is clf.model.encoder.layers[-1].ln_1
    torch.testing.assert_close(explainer.attribute(x, y), library_maps(lib, "GradCAM", clf, explainer.layer, x, y))


def test_options_go_to_the_library(lib, models) -> None:
    clf, x, y = models["timm_cnn"], images(2, 64, seed=3), torch.tensor([0, 2])
    explainer = get_explainer("gradcam:GradCAM", clf, eigen_smooth=True)
    ref = library_maps(lib, "GradCAM", clf, explainer.layer, x, y, eigen_smooth=True)
    torch.testing.assert_close(explainer.attribute(x, y), ref)
    plain = library_maps(lib, "GradCAM", clf, explainer.layer, x, y)
    torch.testing.assert_close(explainer.attribute(x, y, eigen_smooth=False), plain)
    score = get_explainer("gradcam:ScoreCAM", clf, batch_size=5)
    torch.testing.assert_close(score.attribute(x, y), library_maps(lib, "ScoreCAM", clf, score.layer, x, y))
    with pytest.raises(ValueError, match="'aug_smooth' must be true or false"):
        get_explainer("gradcam:GradCAM", clf, aug_smooth="yes")
    with pytest.raises(ValueError, match="has no option 'n_steps'"):
        get_explainer("gradcam:GradCAM", clf, n_steps=3)
    with pytest.raises(ValueError, match="'batch_size' must be at least 1"):
        get_explainer("gradcam:AblationCAM", clf, batch_size=0)


# ---------------------------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------------------------


def test_default_layers(models) -> None:
    names = {model: get_explainer("gradcam:GradCAM", clf)._layer_name for model, clf in models.items()}
    assert names == {
        "timm_cnn": "layer4",
        "timm_vit": "blocks.1.norm1",
        "tv_resnet": "layer4",
        "tv_vit": "encoder.layers.encoder_layer_1.ln_1",
    }


def test_torchvision_cnn_stages_by_structure() -> None:
    """VGG: the ReLU after the last conv (in place: the conv's own output is rectified after its hook ran);
    ConvNeXt / DenseNet / MobileNet: the last ``features`` stage. Built on the meta device: shapes only."""
    with torch.device("meta"):
        built = {
            "vgg11": torchvision.models.vgg11(),
            "convnext_tiny": torchvision.models.convnext_tiny(),
            "densenet121": torchvision.models.densenet121(),
            "mobilenet_v3_small": torchvision.models.mobilenet_v3_small(),
            "resnet50": torchvision.models.resnet50(),
        }
    found = {name: layer_name(model, cnn_stage(model)) for name, model in built.items()}
    assert found == {
        "vgg11": "features.19",
        "convnext_tiny": "features.7",
        "densenet121": "features.norm5",
        "mobilenet_v3_small": "features.12",
        "resnet50": "layer4",
    }
    assert isinstance(built["vgg11"].features[19], torch.nn.ReLU)
    assert isinstance(built["vgg11"].features[18], torch.nn.Conv2d)
    assert all(has_cnn_stage(model) for model in built.values())
    with torch.device("meta"):
        assert not has_cnn_stage(torchvision.models.vit_b_16())


def test_layer_overrides(lib, models) -> None:
    clf, x, y = models["tv_resnet"], images(2, 64, seed=4), torch.tensor([2, 0])
    by_name = get_explainer("gradcam:HiResCAM", clf, layer="layer3")
    by_module = get_explainer("gradcam:HiResCAM", clf, layer=clf.model.layer3)
    assert by_name.layer is clf.model.layer3 and by_module._layer_name == "layer3"
    ref = library_maps(lib, "HiResCAM", clf, clf.model.layer3, x, y)
    torch.testing.assert_close(by_name.attribute(x, y), ref)
    torch.testing.assert_close(by_module.attribute(x, y), ref)
    vit = models["timm_vit"]
    block = get_explainer("gradcam:GradCAM", vit, layer="blocks.0")  # a block's (B, N, D) output, reshaped
    torch.testing.assert_close(
        block.attribute(x[:, :, :32, :32], y),
        library_maps(lib, "GradCAM", vit, vit.model.blocks[0], x[:, :, :32, :32], y),
    )


def test_unknown_class_or_layer_is_one_line(models) -> None:
    clf = models["timm_cnn"]
    with pytest.raises(ValueError, match=r"no CAM class 'GradCam\+\+'; known: AblationCAM, EigenCAM") as err:
        get_explainer("gradcam:GradCam++", clf)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="ResNet has no layer named 'layer9'") as err:
        get_explainer("gradcam:GradCAM", clf, layer="layer9")
    assert "\n" not in str(err.value)
    assert get_explainer("gradcam:gradcamplusplus", clf).name == "gradcam:GradCAMPlusPlus"


def test_a_failing_library_call_leaves_the_classifier_whole(lib, models) -> None:
    """AblationCAM swaps its layer out of the model and puts it back only when it succeeds; the CNN ablation layer
    on a ViT's tokens fails mid-call. (Without ``ablation_layer`` the wrapper takes the library's ViT one.)"""
    vit, x = models["timm_vit"], images(2, 32, seed=5)
    layer = vit.model.blocks[-1].norm1
    before = vit(x)
    with pytest.raises(IndexError):
        get_explainer("gradcam:AblationCAM", vit, ablation_layer=lib.AblationLayer()).attribute(x, 1)
    assert vit.model.blocks[-1].norm1 is layer and not layer._forward_hooks
    torch.testing.assert_close(vit(x), before)
    assert get_explainer("gradcam:AblationCAM", vit).attribute(x, 1).shape == (2, 32, 32)


def test_rebind_follows_the_layer_by_name(models) -> None:
    explainer = get_explainer("gradcam:GradCAM", models["timm_cnn"], layer="layer3")
    twin = tiny_resnet(seed=1)
    assert explainer.rebind(twin).layer is twin.model.layer3 and explainer.layer is models["timm_cnn"].model.layer3


# ---------------------------------------------------------------------------------------------------------------
# The registry, the command line, imports
# ---------------------------------------------------------------------------------------------------------------


def test_the_family_is_listed_but_not_a_method_name(models) -> None:
    rows = {name: description for name, description, _ in list_methods()}
    assert rows["gradcam:<Class>"].startswith("A pytorch-grad-cam CAM class")
    assert not any(name.startswith("gradcam") for name in list_explainers())
    assert resolve_explainer("GradCAM:HiResCAM") == "gradcam:HiResCAM"
    assert resolve_explainer("gradcam") == "grad-cam"  # the plain alias is still the project's Grad-CAM
    assert isinstance(get_explainer("gradcam:GradCAM", models["timm_cnn"]), GradCamMethod)


def _one_image(root: Path) -> Path:
    root.mkdir()
    from PIL import Image

    pixels = (np.random.default_rng(0).random((40, 36, 3)) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(root / "x.png")
    return root


def test_explain_runs_a_family_member_end_to_end(lib, tmp_path, capsys) -> None:
    ckpt = untrained_resnet_checkpoint(tmp_path)
    src = _one_image(tmp_path / "in")
    base = ["explain", str(src), "--classifier", str(ckpt), "--no-progress"]
    for method, extra in [("gradcam:GradCAMPlusPlus", ["--option", "layer=layer3"]), ("captum:LayerGradCam", [])]:
        out = tmp_path / method.replace(":", "-")
        assert main([*base, "--out", str(out), "--method", method, *extra]) == 0, method
        maps = np.load(out / "x.npy")
        assert maps.shape == (40, 36) and np.isfinite(maps[~np.isnan(maps)]).all(), method
    capsys.readouterr()
    assert main([*base, "--out", str(tmp_path / "bad"), "--method", "gradcam:NoSuchCAM"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CAM class 'NoSuchCAM'" in err[0], err


def test_importing_the_package_does_not_import_the_library() -> None:
    code = (
        "import sys, attr_engine, attr_engine.baselines\n"
        "from attr_engine.explainer import list_methods\n"
        "list_methods()\n"
        "assert 'pytorch_grad_cam' not in sys.modules and 'cv2' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------------------------------------------------------
# The project's grad-cam on torchvision models
# ---------------------------------------------------------------------------------------------------------------


def test_project_grad_cam_on_a_torchvision_resnet(lib, models) -> None:
    """Issue item 4: ``grad-cam`` refused ("does not apply to ResNet"). It is Captum's LayerGradCam on ``layer4``,
    upsampled bilinearly, without the library's per-image [0, 1] rescale: equal to ``gradcam:GradCAM`` after that
    rescale. On this 2 x 2 grid every grid value is also an output pixel (the corners of a half-pixel bilinear
    upsampling), so rescaling before (the library) or after (here) the upsampling is the same."""
    clf, x, y = models["tv_resnet"], images(2, 64, seed=6), torch.tensor([1, 2])
    explainer = get_explainer("grad-cam", clf)
    assert isinstance(explainer, GradCAM) and explainer.layer is clf.model.layer4
    maps = explainer.attribute(x, y)
    ref = LayerGradCam(clf, clf.model.layer4).attribute(x.clone().requires_grad_(True), y, relu_attributions=True)
    ref = F.interpolate(ref, size=(64, 64), mode="bilinear", align_corners=False)[:, 0]
    torch.testing.assert_close(maps, ref, **tol("baselines", torch.float32))
    low = maps.flatten(1).amin(1)[:, None, None]
    scaled = (maps - low) / (1e-7 + (maps - low).flatten(1).amax(1)[:, None, None])
    library = get_explainer("gradcam:GradCAM", clf).attribute(x, y)
    assert float(library.amax()) > 0.5
    torch.testing.assert_close(scaled, library, atol=1e-5, rtol=1e-5)


def test_project_grad_cam_applies_to_torchvision_cnns_and_vits(models) -> None:
    torch.manual_seed(0)
    convnext = Classifier(
        torchvision.models.ConvNeXt([CNBlockConfig(8, 16, 1), CNBlockConfig(16, None, 1)], num_classes=4), **IMAGENET
    )
    for clf, size in ((models["tv_resnet"], 64), (convnext, 64), (models["tv_vit"], 32)):
        assert "grad-cam" in list_explainers(clf)
        maps = get_explainer("grad-cam", clf).attribute(images(2, size, seed=7), 1)
        assert maps.shape == (2, size, size) and torch.isfinite(maps).all()
    assert find_layer(convnext, "features.3") is get_explainer("grad-cam", convnext).layer
    assert cam_layer(models["tv_vit"].model) is models["tv_vit"].model.encoder.layers[-1].ln_1


# ---------------------------------------------------------------------------------------------------------------
# torchvision and transformers ViTs (issue #33 item 8): the library's documented ViT call, and the timm twins
# ---------------------------------------------------------------------------------------------------------------

VIT_FAMILIES = {
    "tv_vit": lambda **kw: vit_twins.tv_vit(**kw),
    "hf_vit": lambda **kw: vit_twins.hf_vit(**kw),
    "hf_vit_eager": lambda **kw: vit_twins.hf_vit(attn="eager", **kw),
}


def _blocks(clf: Classifier) -> list[torch.nn.Module]:
    model = clf.model
    return list(model.encoder.layers) if hasattr(model, "encoder") else list(model.hf.vit.layers)


def _vit_library_maps(lib: Any, name: str, clf: Classifier, layer: Any, x: torch.Tensor, y: torch.Tensor, grid: int):
    """pytorch-grad-cam called as its ViT tutorial does: the layer, and its ``vit_reshape_transform`` (one class
    token dropped, the rest laid on a ``grid`` x ``grid`` patch grid)."""
    reshape = partial(lib.utils.reshape_transforms.vit_reshape_transform, height=grid, width=grid)
    targets = [lib.utils.model_targets.ClassifierOutputTarget(int(t)) for t in y]
    with getattr(lib, name)(model=clf, target_layers=[layer], reshape_transform=reshape) as cam:
        return torch.from_numpy(cam(input_tensor=x.clone().requires_grad_(True), targets=targets))


@pytest.mark.parametrize("family", list(VIT_FAMILIES))
@pytest.mark.parametrize("name", ["GradCAM", "GradCAMPlusPlus", "ScoreCAM"])
def test_gradcam_family_on_torchvision_and_transformers_vits_equals_the_library(lib, family, name) -> None:
    """``gradcam:*`` refused a transformers ViT ("cannot find the last feature stage"); on both families it is the
    library's documented ViT call on the last block's first LayerNorm."""
    clf, x, y = VIT_FAMILIES[family](), images(2, 32, seed=8), torch.tensor([1, 3])
    explainer = get_explainer(f"gradcam:{name}", clf)
    first_norm = "ln_1" if family == "tv_vit" else "layernorm_before"
    assert explainer.layer is getattr(_blocks(clf)[-1], first_norm)
    maps = explainer.attribute(x, y)
    torch.testing.assert_close(maps, _vit_library_maps(lib, name, clf, explainer.layer, x, y, 4), rtol=0, atol=0)
    assert float(maps.amax()) > 0.5 and not explainer.layer._forward_hooks


@pytest.mark.parametrize("family", list(VIT_FAMILIES))
def test_project_grad_cam_on_torchvision_and_transformers_vits_equals_the_library(lib, family) -> None:
    """``grad-cam`` refused both ("does not apply to VisionTransformer"). It weights the tokens entering the last
    block - the output of the block before, the library's layer here - without the library's per-image [0, 1]
    rescale. With 1-pixel patches the grid is the image (no resize on either side), so the rescaled maps must be
    the library's exactly."""
    clf, x, y = VIT_FAMILIES[family](image_size=4, patch_size=1), images(3, 4, seed=9), torch.tensor([0, 1, 3])
    explainer = get_explainer("grad-cam", clf)
    assert explainer.tokens and explainer.layer is _blocks(clf)[-1]
    maps = explainer.attribute(x, y)
    low = maps.flatten(1).amin(1)[:, None, None]
    scaled = (maps - low) / (1e-7 + (maps - low).flatten(1).amax(1)[:, None, None])
    library = _vit_library_maps(lib, "GradCAM", clf, _blocks(clf)[-2], x, y, 4)
    assert float(library.amax()) > 0.5
    torch.testing.assert_close(scaled, library, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", list(VIT_FAMILIES))
def test_vit_families_equal_their_timm_twin(family) -> None:
    """The same network as a timm ViT (tests/vit_twins.py) gives the same maps: one layout, read three ways."""
    clf, x, y = VIT_FAMILIES[family](), images(2, 32, seed=10), torch.tensor([2, 0])
    twin = vit_twins.timm_twin_of_torchvision(clf) if family == "tv_vit" else vit_twins.timm_twin_of_transformers(clf)
    torch.testing.assert_close(clf(x), twin(x), rtol=1e-5, atol=1e-5)
    for name in ("grad-cam", "gradcam:GradCAM", "gradcam:HiResCAM"):
        maps = get_explainer(name, clf).attribute(x, y)
        assert float(maps.amax()) > 0, name
        torch.testing.assert_close(maps, get_explainer(name, twin).attribute(x, y), rtol=1e-4, atol=1e-5)


def test_deeplift_on_a_model_that_reuses_its_relu_is_a_clear_error():
    """torchvision's ResNet blocks call one ReLU module twice: Captum's DeepLift fails deep inside; said in one
    ValueError naming the reason instead of a RuntimeError traceback."""
    torch.manual_seed(0)
    clf = Classifier(torchvision.models.resnet18(num_classes=3), (0.5,) * 3, (0.25,) * 3, input_size=(3, 32, 32))
    with pytest.raises(ValueError, match="used more than once in its forward pass"):
        get_explainer("deeplift", clf).attribute(torch.rand(1, 3, 32, 32))
