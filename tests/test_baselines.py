"""The baseline registry and its explainers: shapes on tiny timm ViT / ResNet models, each method against an
independent computation (autograd, closed forms on a linear model, a hand-run ViT), and the Quantus / Captum
adapters."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from captum.attr import LayerGradCam

from attr_engine.adapters import CaptumAdapter, quantus_explain_func
from attr_engine.aha import AHA, AHAConfig
from attr_engine.baselines import (
    RISE,
    AttentionRollout,
    GradCAM,
    Gradient,
    GradientXInput,
    IntegratedGradients,
    Occlusion,
    Saliency,
    SmoothGrad,
    rise_masks,
)
from attr_engine.explainer import FunctionExplainer, get_explainer, list_explainers
from attr_engine.pullback import SemanticPullback
from tests.aha_helpers import colour_classifier, colour_images
from tests.eval_helpers import images, linear_classifier, single_thread, tiny_convnet, tiny_resnet, tiny_vit
from tests.tolerances import tol

FP32 = torch.float32
ALL = {
    "aha",
    "attention-rollout",
    "deeplift",
    "grad-cam",
    "gradient",
    "gradient-x-input",
    "guided-grad-cam",
    "integrated-gradients",
    "legrad",
    "mda",
    "occlusion",
    "pullback-ascent",
    "pullback-soft",
    "rise",
    "saliency",
    "smoothgrad",
}
VIT_ONLY = {"attention-rollout", "legrad"}  # refused on the ResNet the dtype / empty-batch sweeps use
FAST_KWARGS = {
    "integrated-gradients": {"n_steps": 4},
    "smoothgrad": {"n_samples": 2},
    "rise": {"n_masks": 16},
    "occlusion": {"window": 8, "stride": 8},
    "pullback-ascent": {"steps": 2},
    "mda": {"grid": 2, "prior": "gradient"},
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


@pytest.fixture(scope="module")
def vit():
    return tiny_vit()


@pytest.fixture(scope="module")
def resnet():
    return tiny_resnet()


def input_gradient(clf, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(clf(x).gather(1, y[:, None]).sum(), x)
    return grad


def test_registry_names_aliases_and_applicability(vit, resnet) -> None:
    assert set(list_explainers()) == ALL
    assert "attention-rollout" in list_explainers(vit) and "attention-rollout" not in list_explainers(resnet)
    assert "guided-grad-cam" in list_explainers(resnet) and "guided-grad-cam" not in list_explainers(vit)
    assert isinstance(get_explainer("IG", resnet), IntegratedGradients)
    assert isinstance(get_explainer("grad_cam", resnet), GradCAM)
    assert get_explainer("SfP", resnet).name == "pullback-soft"
    with pytest.raises(ValueError, match="known: aha, attention-rollout"):
        get_explainer("lime", resnet)
    with pytest.raises(ValueError, match="does not apply"):
        get_explainer("attention-rollout", resnet)
    with pytest.raises(ValueError, match="aha="):
        get_explainer("aha", resnet)


@pytest.mark.parametrize("model", ["vit", "resnet"])
def test_every_explainer_returns_finite_pixel_maps(model, request) -> None:
    clf = request.getfixturevalue(model)
    x = images(2, 32, seed=3)
    for name in list_explainers(clf):
        if name == "aha":
            continue
        maps = get_explainer(name, clf, **FAST_KWARGS.get(name, {})).attribute(x, target=1)
        assert maps.shape == (2, 32, 32) and maps.dtype == torch.float32, name
        assert torch.isfinite(maps).all(), name
        # Grad-CAM's ReLU may legitimately zero a random network's map, and so does MDA where the mean colour scores
        # the target higher than the image (nothing to delete); every other method must respond.
        assert name in ("grad-cam", "guided-grad-cam", "mda") or maps.abs().sum() > 0, name


def test_gradient_family_matches_autograd() -> None:
    clf = tiny_convnet()
    x, y = images(3, 16, seed=1), torch.tensor([0, 2, 4])
    grad = input_gradient(clf, x, y)
    torch.testing.assert_close(Gradient(clf).attribute(x, y), grad.mean(1), **tol("baselines", FP32))
    torch.testing.assert_close(Saliency(clf).attribute(x, y), grad.abs().amax(1), **tol("baselines", FP32))
    torch.testing.assert_close(GradientXInput(clf).attribute(x, y), (grad * x).sum(1), **tol("baselines", FP32))


def test_integrated_gradients_is_exact_on_a_linear_model_and_complete_on_a_relu_net() -> None:
    lin = linear_classifier()
    x, y = images(2, 8, seed=2), torch.tensor([1, 3])
    grad = input_gradient(lin, x, y)
    torch.testing.assert_close(IntegratedGradients(lin, n_steps=3).attribute(x, y), (grad * x).sum(1))
    torch.testing.assert_close(
        IntegratedGradients(lin, n_steps=3, baseline="mean").attribute(x, y),
        (grad * (x - lin.norm_mean)).sum(1),
    )
    clf = tiny_convnet()
    x, y = images(2, 16, seed=5), torch.tensor([1, 2])
    total = IntegratedGradients(clf, n_steps=64).attribute(x, y).sum(dim=(1, 2))
    with torch.no_grad():
        gap = clf(x).gather(1, y[:, None]).squeeze(1) - clf(torch.zeros_like(x)).gather(1, y[:, None]).squeeze(1)
    torch.testing.assert_close(total, gap, atol=0.05 * gap.abs().max().item(), rtol=0)


def test_occlusion_of_a_linear_model_is_the_windows_logit_share() -> None:
    clf = linear_classifier(size=8)
    x, y = images(1, 8, seed=4), torch.tensor([2])
    maps = Occlusion(clf, window=4, stride=4).attribute(x, y)
    z = (x - clf.norm_mean) / clf.norm_std  # the mean colour is z = 0, so a window's drop is its share of the logit
    share = (z * clf.model.weight.detach()[2]).sum(1)[0]
    expected = F.avg_pool2d(share[None, None], 4).mul(16).repeat_interleave(4, -1).repeat_interleave(4, -2)[0, 0]
    torch.testing.assert_close(maps[0], expected, **tol("baselines", FP32))


def test_smoothgrad_is_seeded_and_leaves_the_global_rng_alone() -> None:
    clf = tiny_convnet()
    x = images(2, 16)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = SmoothGrad(clf, n_samples=3, seed=1).attribute(x, 0)
    assert torch.equal(torch.get_rng_state(), state)
    torch.testing.assert_close(SmoothGrad(clf, n_samples=3, seed=1).attribute(x, 0), a)
    assert not torch.allclose(SmoothGrad(clf, n_samples=3, seed=2).attribute(x, 0), a)


def test_smoothgrad_map_of_an_image_does_not_depend_on_its_batch_or_position() -> None:
    """Issue #10.6: the noise used to be drawn for the whole batch, so a map changed with --batch-size and resumes."""
    clf = tiny_convnet()
    x = images(8, 16, seed=3)
    target = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    sg = SmoothGrad(clf, n_samples=5, batch_size=2, seed=7)
    batched = sg.attribute(x, target)
    alone = torch.cat([sg.attribute(x[i : i + 1], target[i : i + 1]) for i in range(8)])
    torch.testing.assert_close(alone, batched, atol=1e-6, rtol=1e-5)
    order = torch.tensor([5, 2, 7, 0, 1, 3, 6, 4])
    torch.testing.assert_close(sg.attribute(x[order], target[order]), batched[order], atol=1e-6, rtol=1e-5)
    chunked = SmoothGrad(clf, n_samples=5, batch_size=5, seed=7).attribute(x, target)
    torch.testing.assert_close(chunked, batched, atol=1e-6, rtol=1e-5)


def test_smoothgrad_of_a_linear_model_is_the_weight_magnitude() -> None:
    clf = linear_classifier()
    x, y = images(2, 8, seed=1), torch.tensor([1, 2])
    weight = clf.model.weight.detach() / clf.norm_std  # d logit / d pixel, whatever the noise
    expected = weight[y].abs().amax(dim=1)
    torch.testing.assert_close(SmoothGrad(clf, n_samples=3).attribute(x, y), expected, **tol("baselines", FP32))


@pytest.mark.parametrize("name", ["gradient", "saliency", "gradient-x-input", "integrated-gradients", "smoothgrad"])
def test_gradient_baselines_leave_a_raw_training_mode_model_bit_identical(name: str) -> None:
    """Issue #10.7: a raw model in training mode had its BatchNorm statistics updated and ran dropout."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Dropout(0.5),
        torch.nn.Flatten(), torch.nn.Linear(4 * 8 * 8, 3),
    ).train()  # fmt: skip
    state = {k: v.clone() for k, v in net.state_dict().items()}
    x = images(2, 8, seed=2)
    explainer = get_explainer(name, net, **FAST_KWARGS.get(name, {}))
    maps = explainer.attribute(x, 1)
    assert all(m.training for m in net.modules())
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())
    net.eval()
    torch.testing.assert_close(maps, explainer.attribute(x, 1), **tol("baselines", FP32))


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.float32])
def test_every_method_takes_images_of_any_float_dtype(model_dtype, dtype) -> None:
    """Issue #10.9: fp16 / bf16 / float64 images with a float32 model (and the reverse) gave torch's dtype error."""
    clf = tiny_resnet().to(model_dtype)
    x = images(2, 32, seed=5)
    for name in sorted(ALL - {"aha", *VIT_ONLY}):
        explainer = get_explainer(name, clf, **FAST_KWARGS.get(name, {}))
        maps = explainer.attribute(x.to(dtype), 1)
        assert maps.shape == (2, 32, 32) and maps.dtype == torch.float32 and torch.isfinite(maps).all(), name
        if dtype == model_dtype or dtype.itemsize > model_dtype.itemsize:  # the same images after the cast
            torch.testing.assert_close(maps, explainer.attribute(x.to(model_dtype), 1), msg=name)


def test_grad_cam_cnn_equals_captum_layer_grad_cam(resnet) -> None:
    x, y = images(2, 32, seed=6), torch.tensor([0, 3])
    layer = resnet.model.layer4
    ref = LayerGradCam(resnet, layer).attribute(x.clone().requires_grad_(True), target=y, relu_attributions=True)
    ref = F.interpolate(ref, size=(32, 32), mode="bilinear", align_corners=False)[:, 0]
    torch.testing.assert_close(GradCAM(resnet).attribute(x, y), ref, **tol("baselines", FP32))


def vit_tokens_by_hand(vit, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Run a timm ViT block by block: (tokens entering the last block, each block's attention weights, logits)."""
    model = vit.model
    tokens = model.norm_pre(model._pos_embed(model.patch_embed(vit.normalize(x))))
    weights = []
    for i, block in enumerate(model.blocks):
        attn = block.attn
        h = block.norm1(tokens)
        qkv = attn.qkv(h).reshape(h.shape[0], h.shape[1], 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = attn.q_norm(qkv[0]), attn.k_norm(qkv[1])
        weights.append(((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1))
        if i == len(model.blocks) - 1:
            entering = tokens
        tokens = block(tokens)
    logits = model.forward_head(model.norm(tokens))
    return entering, weights, logits


def test_grad_cam_vit_weights_the_last_blocks_input_tokens(vit) -> None:
    x, y = images(2, 32, seed=7), torch.tensor([1, 2])
    entering, _, logits = vit_tokens_by_hand(vit, x.requires_grad_(True))
    (grads,) = torch.autograd.grad(logits.gather(1, y[:, None]).sum(), entering)
    patch, g = entering[:, 1:], grads[:, 1:]  # one class token in front
    cam = (patch * g.mean(dim=1, keepdim=True)).sum(-1).relu().view(2, 1, 4, 4)
    ref = F.interpolate(cam, size=(32, 32), mode="bilinear", align_corners=False)[:, 0]
    torch.testing.assert_close(GradCAM(vit).attribute(x.detach(), y), ref.detach(), **tol("baselines", FP32))


def test_attention_rollout_matches_a_hand_rollout_and_restores_fused_attention(vit) -> None:
    x = images(2, 32, seed=8)
    fused = [b.attn.fused_attn for b in vit.model.blocks]
    maps = AttentionRollout(vit).attribute(x)
    assert [b.attn.fused_attn for b in vit.model.blocks] == fused
    with torch.no_grad():
        _, weights, _ = vit_tokens_by_hand(vit, x)
    rollout = torch.eye(17).expand(2, 17, 17)
    for a in weights:
        a = 0.5 * a.mean(dim=1) + 0.5 * torch.eye(17)
        rollout = (a / a.sum(-1, keepdim=True)) @ rollout
    ref = F.interpolate(rollout[:, 0, 1:].reshape(2, 1, 4, 4), size=(32, 32), mode="bilinear", align_corners=False)
    torch.testing.assert_close(maps, ref[:, 0], **tol("baselines", FP32))
    torch.testing.assert_close(AttentionRollout(vit).attribute(x, target=3), maps)  # class-agnostic


def test_rise_masks_and_maps_find_the_only_evidence() -> None:
    masks = rise_masks(5, 20, 24, grid=4, generator=torch.Generator().manual_seed(0))
    assert masks.shape == (5, 20, 24) and masks.min() >= 0 and masks.max() <= 1 and masks.std() > 0.1
    clf = linear_classifier(num_classes=2, size=16)
    with torch.no_grad():  # class 0's logit reads the top-left quadrant only
        clf.model.weight.zero_()
        clf.model.weight[0, :, :8, :8] = 0.01  # small, so the probability does not saturate
    x = torch.full((1, 3, 16, 16), 0.9)
    maps = RISE(clf, n_masks=256, grid=2, batch_size=40).attribute(x, 0)
    quadrants = maps[0].view(2, 8, 2, 8).mean(dim=(1, 3)).flatten()
    assert quadrants[0] > quadrants[1:].max() + 0.03
    torch.testing.assert_close(RISE(clf, n_masks=256, grid=2, batch_size=7).attribute(x, 0), maps)


def test_pullback_and_aha_entries_run_our_methods() -> None:
    clf = tiny_convnet()
    x, y = images(2, 16), torch.tensor([1, 0])
    ref = SemanticPullback(clf).attribute(x, y, method="soft")
    torch.testing.assert_close(get_explainer("pullback-soft", clf).attribute(x, y), ref)
    colour = colour_classifier()
    aha = AHA(colour, AHAConfig(n_fractions=6, n_iters=8, decoder_dim=16, class_dim=8, grid_range=(2, 6)))
    xc, _ = colour_images(2)
    torch.testing.assert_close(get_explainer("aha", colour, aha=aha).attribute(xc), aha.attribute(xc))
    with pytest.raises(ValueError, match="different classifier"):
        get_explainer("aha", clf, aha=aha)


def test_adapters_for_quantus_and_captum() -> None:
    clf = tiny_convnet()
    explainer = Gradient(clf)
    x, y = images(2, 16), torch.tensor([0, 1])
    maps = explainer.attribute(x, y)
    out = quantus_explain_func(explainer)(model=clf, inputs=x.numpy(), targets=y.numpy(), device="cpu")
    assert isinstance(out, np.ndarray) and out.shape == (2, 1, 16, 16)
    np.testing.assert_allclose(out[:, 0], maps.numpy())
    adapter = CaptumAdapter(explainer)
    assert adapter.forward_func is clf and not adapter.has_convergence_delta()
    # input-shaped: the per-channel gradient, whose channel mean is the map
    per_channel = adapter.attribute(x, target=y)
    assert per_channel.shape == x.shape
    torch.testing.assert_close(per_channel.mean(dim=1), maps)
    (as_tuple,) = adapter.attribute((x,), target=y)
    torch.testing.assert_close(as_tuple, per_channel)
    with pytest.raises(ValueError, match="takes no baselines"):
        adapter.attribute(x, target=y, baselines=0)


def test_every_method_returns_an_empty_result_for_an_empty_batch(resnet) -> None:
    """Issue #10.10: the empty batch is a result, not an error, for every method."""
    empty = torch.rand(0, 3, 32, 32)
    for name in sorted(ALL - {"aha", *VIT_ONLY}):
        explainer = get_explainer(name, resnet, **FAST_KWARGS.get(name, {}))
        assert explainer.attribute(empty).shape == (0, 32, 32), name
        assert explainer.attribute(empty, 1).shape == (0, 32, 32), name


def test_meta_or_mismatched_devices_are_named_in_one_error() -> None:
    """Issue #10.12: meta-device or mismatched-device inputs failed in .item() instead of naming the devices."""
    clf = tiny_convnet()
    x = images(2, 16)
    meta = torch.empty(2, 3, 16, 16, device="meta")
    methods = [get_explainer(n, clf, **FAST_KWARGS.get(n, {})) for n in ("gradient", "smoothgrad", "pullback-soft")]
    for explainer in methods:
        with pytest.raises(ValueError, match=r"x is on the meta device.*classifier's device \(cpu\)"):
            explainer.attribute(meta, 0)
    with pytest.raises(ValueError, match="x is on the meta device"):
        SemanticPullback(clf).attribute(meta, 0)
    with pytest.raises(ValueError, match="x is on the meta device"):
        clf(meta)
    clf_meta = tiny_convnet().to("meta")
    with pytest.raises(ValueError, match=r"classifier is on the meta device .* but x is on cpu"):
        Gradient(clf_meta).attribute(x, 0)
    with pytest.raises(ValueError, match=r"classifier is on the meta device .* but x is on cpu"):
        SemanticPullback(clf_meta).attribute(x, 0)


def test_explainer_input_checks() -> None:
    clf = tiny_convnet()
    explainer = Gradient(clf)
    x = images(2, 16)
    with pytest.raises(ValueError, match="booleans"):
        explainer.attribute(x, torch.tensor([True, False]))
    with pytest.raises(ValueError, match="one entry per image"):
        explainer.attribute(x, [0, 1, 2])
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        explainer.attribute(x, 5)
    with pytest.raises(ValueError, match="RGB"):
        explainer.attribute(torch.rand(2, 1, 16, 16))
    with pytest.raises(RuntimeError, match="inference_mode"), torch.inference_mode():
        explainer.attribute(x)
    channel = FunctionExplainer(clf, lambda a, t: a * 2.0, name="double")
    torch.testing.assert_close(channel.attribute(x), 2.0 * x.mean(1))
