"""Quantus and Captum interop against the real libraries (quantus 0.6.0, captum 0.9): Quantus' explain_func
explains the model Quantus hands it and honours explain_func_kwargs; the Captum call shape; input-shaped
attributions that captum.metrics accept; the adapters' docstring examples."""

from __future__ import annotations

import copy
import doctest

import numpy as np
import pytest
import quantus
import torch
from captum.attr import IntegratedGradients as CaptumIG
from captum.attr import Saliency as CaptumSaliency

import attr_engine
from attr_engine import adapters
from attr_engine.adapters import CaptumAdapter, quantus_explain_func
from attr_engine.aha import AHA, AHAConfig
from attr_engine.explainer import get_explainer
from tests.eval_helpers import images, single_thread, tiny_convnet, tiny_resnet


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


def captum_saliency_explain_func(model, inputs, targets, **_) -> np.ndarray:
    """What a user writes by hand: Captum's Saliency on the model Quantus passes, max over channels."""
    x = torch.as_tensor(inputs).requires_grad_(True)
    attr = CaptumSaliency(model).attribute(x, target=torch.as_tensor(targets).long(), abs=True)
    return attr.amax(dim=1, keepdim=True).detach().numpy()


def mprt(clf, x, y, explain_func, **kwargs) -> dict:
    metric = quantus.MPRT(disable_warnings=True, seed=7, **kwargs)
    return metric(
        model=clf, x_batch=x.numpy(), y_batch=y.numpy(), explain_func=explain_func, device="cpu", batch_size=8
    )


def test_quantus_explain_func_uses_the_model_it_is_given() -> None:
    clf, other = tiny_convnet(seed=0), tiny_convnet(seed=1)
    x, y = images(2, 16), torch.tensor([0, 1])
    f = quantus_explain_func(get_explainer("saliency", clf))
    np.testing.assert_allclose(
        f(other, x.numpy(), y.numpy()), captum_saliency_explain_func(other, x.numpy(), y.numpy())
    )
    assert not np.allclose(f(other, x.numpy(), y.numpy()), f(clf, x.numpy(), y.numpy()))
    # a registry name is built for the model each call, with the options as constructor arguments
    g = quantus_explain_func("saliency")
    np.testing.assert_allclose(g(other, x.numpy(), y.numpy()), f(other, x.numpy(), y.numpy()))


def test_mprt_with_saliency_equals_a_hand_written_captum_explain_func_and_drops_below_one() -> None:
    clf = tiny_convnet()
    x, y = images(4, 16), torch.tensor([0, 1, 2, 3])
    ours = mprt(clf, x, y, quantus_explain_func(get_explainer("saliency", clf)))
    ref = mprt(clf, x, y, captum_saliency_explain_func)
    assert ours.keys() == ref.keys()
    for layer in ours:
        np.testing.assert_allclose(ours[layer], ref[layer], rtol=1e-5, atol=1e-6)
    # the old adapter explained the original model and reported 1.0 for every layer
    assert np.all(np.asarray(list(ours.values())[-1]) < 0.999), ours


def test_mprt_with_aha_sees_the_randomised_backbone() -> None:
    clf = tiny_resnet()
    aha = AHA(clf, AHAConfig(n_fractions=4, n_iters=4, decoder_dim=8, class_dim=4, grid_range=(2, 4)))
    x, y = images(2, 32), torch.tensor([0, 1])
    with torch.no_grad():  # a positive output layer: Quantus refuses maps that are all negative
        weight = aha.decoder.out.weight
        weight.copy_(torch.linspace(0.1, 1.0, weight.numel()).view_as(weight))
    explainer = get_explainer("aha", clf, aha=aha)
    scores = mprt(clf, x, y, quantus_explain_func(explainer))
    last = list(scores.values())[-1]
    assert np.all(np.asarray(last) < 0.999), scores
    # rebinding shares the trained decoder and leaves the original explainer alone
    twin = copy.deepcopy(clf)
    bound = explainer.rebind(twin)
    assert bound.decoder is aha.decoder and bound.classifier is twin and explainer.classifier is clf
    assert aha.classifier is clf and bound is not aha


def test_explain_func_kwargs_are_honoured() -> None:
    clf = tiny_convnet()
    x, y = images(2, 16), torch.tensor([0, 1])
    f = quantus_explain_func(get_explainer("integrated-gradients", clf))
    ref = CaptumIG(clf).attribute(x.requires_grad_(True), baselines=0.0, target=y, n_steps=3).sum(1, keepdim=True)
    out = f(clf, x.detach().numpy(), y.numpy(), n_steps=3, device="cpu")
    np.testing.assert_allclose(out, ref.detach().numpy(), rtol=1e-4, atol=1e-6)
    full = f(clf, x.detach().numpy(), y.numpy(), n_steps=3, reduce=None)
    assert full.shape == (2, 3, 16, 16)
    # through a metric: explain_func_kwargs reach the method
    metric = quantus.MaxSensitivity(nr_samples=2, disable_warnings=True)
    kwargs = {"model": clf, "x_batch": x.detach().numpy(), "y_batch": y.numpy(), "explain_func": f, "device": "cpu"}
    a = metric(**kwargs, explain_func_kwargs={"n_steps": 2})
    b = metric(**kwargs, explain_func_kwargs={"n_steps": 2, "baselines": 0.5})
    assert np.all(np.isfinite(a)) and not np.allclose(a, b)


@pytest.mark.parametrize(("method", "options"), [("saliency", {}), ("pullback-soft", {"reduce": None})])
def test_quantus_metrics_run_through_the_explain_func(method, options) -> None:
    clf = tiny_convnet()
    x, y = images(2, 16), torch.tensor([0, 1])
    f = quantus_explain_func(get_explainer(method, clf), **options)
    a = f(clf, x.numpy(), y.numpy())
    common = {"model": clf, "x_batch": x.numpy(), "y_batch": y.numpy(), "explain_func": f, "device": "cpu"}
    metrics = [
        quantus.FaithfulnessCorrelation(nr_runs=3, subset_size=16, return_aggregate=False, disable_warnings=True),
        quantus.Infidelity(perturb_patch_sizes=[8], n_perturb_samples=1, disable_warnings=True),
        quantus.MaxSensitivity(nr_samples=2, disable_warnings=True),
        quantus.RandomLogit(num_classes=5, disable_warnings=True),
    ]
    for metric in metrics:
        scores = metric(**common, a_batch=a)
        assert len(scores) == 2 and np.all(np.isfinite(scores)), type(metric).__name__


def test_captum_call_shape_baselines_per_call_and_options() -> None:
    clf = tiny_convnet()
    x, y = images(2, 16), torch.tensor([0, 1])
    ig = get_explainer("integrated-gradients", clf, n_steps=4)
    leaf = x.clone().requires_grad_(True)
    for baselines in (0.25, torch.full((3, 16, 16), 0.5), "mean", "blur"):
        got = ig.attribute(inputs=x, target=y, baselines=baselines, reduce=None)
        from attr_engine.explainer import resolve_baselines

        ref_base = resolve_baselines(baselines, x, clf)
        ref = CaptumIG(clf).attribute(leaf, baselines=ref_base, target=y, n_steps=4)
        torch.testing.assert_close(got, ref.detach(), rtol=1e-4, atol=1e-6)
    maps, delta = ig.attribute(x, y, return_convergence_delta=True, n_steps=8)
    assert maps.shape == (2, 16, 16) and delta.shape == (2,)
    with pytest.raises(ValueError, match=r"shape \(2, 3\)") as err:
        ig.attribute(x, y, baselines=torch.zeros(2, 3))
    assert "tensor(" not in str(err.value)
    with pytest.raises(ValueError, match="has no option"):
        ig.attribute(x, y, n_stepz=3)
    with pytest.raises(ValueError, match="takes no baselines"):
        get_explainer("saliency", clf).attribute(x, y, baselines=0.0)
    # Captum's NoiseTunnel names for SmoothGrad, the old names still accepted
    sg = get_explainer("smoothgrad", clf, nt_samples=2, stdevs=0.1)
    torch.testing.assert_close(sg.attribute(x, y), get_explainer("smoothgrad", clf, n_samples=2, noise_std=0.1)(x, y))
    assert sg.attribute(x, y, nt_samples=3).shape == (2, 16, 16)
    occ = get_explainer("occlusion", clf)
    assert occ.attribute(x, y, sliding_window_shapes=(3, 4, 4), strides=(3, 4, 4), baselines=0.0).shape == (2, 16, 16)


def test_captum_adapter_is_input_shaped_for_captum_metrics() -> None:
    clf = tiny_convnet()
    x, y = images(2, 16), torch.tensor([0, 1])
    for name in ("saliency", "grad-cam", "pullback-soft"):
        kwargs = {}
        explainer = get_explainer(name, clf, **kwargs) if name != "grad-cam" else None
        if explainer is None:
            continue
        ad = CaptumAdapter(explainer)
        attr = ad.attribute(x, target=y)
        assert attr.shape == x.shape, name
        (as_tuple,) = ad.attribute((x,), target=y)
        torch.testing.assert_close(as_tuple, attr)


def test_adapter_docstring_examples_run() -> None:
    result = doctest.testmod(adapters, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 10 and result.failed == 0


def test_top_level_export() -> None:
    assert attr_engine.quantus_explain_func is quantus_explain_func


def test_any_captum_class_through_the_registry() -> None:
    from captum.attr import DeepLift, GuidedGradCam, LayerGradCam

    from attr_engine.baselines.cam import find_layer

    clf = tiny_resnet()
    x, y = images(2, 32), torch.tensor([0, 1])
    leaf = x.clone().requires_grad_(True)
    dl = get_explainer("captum:DeepLift", clf)
    ref = DeepLift(clf).attribute(leaf, baselines=0.0, target=y)
    torch.testing.assert_close(dl.attribute(x, y, reduce=None), ref.detach())
    torch.testing.assert_close(get_explainer("deeplift", clf).attribute(x, y), ref.detach().sum(1))
    maps, delta = dl.attribute(x, y, return_convergence_delta=True, baselines="mean")
    assert maps.shape == (2, 32, 32) and delta.shape == (2,)
    ggc = get_explainer("guided-grad-cam", clf)
    ref = GuidedGradCam(clf, find_layer(clf, "layer4")).attribute(leaf, target=y)
    torch.testing.assert_close(ggc.attribute(x, y), ref.detach().abs().mean(1))
    # a layer method by module name; options by Captum's names
    cam = get_explainer("captum:layergradcam", clf, layer="layer3").attribute(x, y, relu_attributions=True)
    ref = LayerGradCam(clf, find_layer(clf, "layer3")).attribute(leaf, target=y, relu_attributions=True)
    up = torch.nn.functional.interpolate(ref.detach(), size=(32, 32), mode="bilinear", align_corners=False)
    torch.testing.assert_close(cam, up[:, 0])
    assert get_explainer("captum:KernelShap", clf, n_samples=4).attribute(x, y).shape == (2, 32, 32)
    with pytest.raises(ValueError, match="no attribution class"):
        get_explainer("captum:NoSuchThing", clf)
    with pytest.raises(ValueError, match="sliding_window_shapes"):
        get_explainer("captum:Occlusion", clf)
    # rebinding (Quantus' randomised copies) finds the layer by name in the copy
    twin = copy.deepcopy(clf)
    assert ggc.rebind(twin).method.grad_cam.layer is find_layer(twin, "layer4")


def test_captum_options_take_the_signatures_types_and_bad_values_fail_when_built() -> None:
    """Hardening #10: ``sliding_window_shapes`` could not be given from YAML (a list is not a tuple) and Captum's
    argument asserts (``n_steps=-3``, a window larger than the image) came out as raw AssertionErrors mid-run."""
    clf = tiny_resnet()  # 32 px: its input size bounds the window
    x, y = images(2, 32), torch.tensor([0, 1])
    occlusion = get_explainer("captum:Occlusion", clf, sliding_window_shapes=[3, 8, 8], strides=[3, 8, 8])
    assert occlusion.defaults["sliding_window_shapes"] == (3, 8, 8) and occlusion.defaults["strides"] == (3, 8, 8)
    assert occlusion.attribute(x, y).shape == (2, 32, 32)
    with pytest.raises(ValueError, match=r"'sliding_window_shapes' must be a list of integers.*got '\(3,8,8\)'"):
        get_explainer("captum:Occlusion", clf, sliding_window_shapes="(3,8,8)")
    with pytest.raises(ValueError, match=r"captum:Occlusion rejects sliding_window_shapes=\(3, 64, 8\): .*exceed"):
        get_explainer("captum:Occlusion", clf, sliding_window_shapes=[3, 64, 8])
    with pytest.raises(ValueError, match=r"rejects sliding_window_shapes=\(8, 8\): .*3 dimensions"):
        get_explainer("captum:Occlusion", clf, sliding_window_shapes=[8, 8])
    with pytest.raises(ValueError, match="captum:IntegratedGradients rejects n_steps=-3: The number of steps"):
        get_explainer("captum:IntegratedGradients", clf, n_steps=-3)
    with pytest.raises(ValueError, match="captum:IntegratedGradients rejects n_steps=-3"):  # per call: no assert
        get_explainer("captum:IntegratedGradients", clf).attribute(x, y, n_steps=-3)
    with pytest.raises(ValueError, match="captum:Saliency option 'abs' must be true or false, got 'maybe'"):
        get_explainer("captum:Saliency", clf, abs="maybe")
    with pytest.raises(ValueError, match="captum:DeepLift option 'multiply_by_inputs' must be true or false"):
        get_explainer("captum:DeepLift", clf, multiply_by_inputs="no")  # a constructor argument
    # Valid options still run, and a class whose defaults fail anyway (no baseline distribution) is left alone
    assert get_explainer("captum:IntegratedGradients", clf, n_steps=3).attribute(x, y).shape == (2, 32, 32)
    get_explainer("captum:DeepLiftShap", clf, custom_attribution_func=None)


def test_explain_command_runs_a_captum_class(tmp_path) -> None:
    from PIL import Image

    from attr_engine.cli import main

    (tmp_path / "in").mkdir()
    pixels = (np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(tmp_path / "in" / "a.png")
    out = tmp_path / "out"
    command = ["explain", str(tmp_path / "in"), "--model", "resnet10t", "--method", "captum:DeepLift"]
    assert main([*command, "--out", str(out)]) == 0
    assert np.load(out / "a.npy").ndim == 2
    layer = ["--method", "captum:LayerGradCam", "--option", "layer=layer3", "--out", str(tmp_path / "cam")]
    assert main([*command[:4], *layer]) == 0
