"""Bounded memory on a CPU (issue #33 item 4): Integrated Gradients' classifier calls and AHA's blends are split into
groups of at most ``images_per_call`` images, and the split changes neither the maps nor the loss and gradients.
The limit is shrunk here so that 32 px images split; benches/bench_memory.py measures the peaks at 224 px."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import attr_engine.classifier as classifier_module
from attr_engine.aha import AHA, AHAConfig
from attr_engine.aha.loss import soft_auc_loss
from attr_engine.classifier import Classifier, images_per_call
from attr_engine.explainer import get_explainer
from tests.aha_helpers import colour_classifier, colour_images
from tests.eval_helpers import images, single_thread, tiny_convnet


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


def _limit(monkeypatch: pytest.MonkeyPatch, count: int, side: int) -> None:
    """``count`` images of ``side`` x ``side`` per differentiated call on a CPU."""
    monkeypatch.setattr(classifier_module, "CPU_PIXELS_PER_CALL", count * side * side)


def _record_batches(clf: Classifier) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    sizes: list[int] = []
    handle = clf.model.register_forward_pre_hook(lambda _m, inputs: sizes.append(inputs[0].shape[0]))
    return sizes, handle


def test_images_per_call_follows_the_image_size_on_a_cpu_only() -> None:
    assert images_per_call(224, 224, "cpu") == 16
    assert images_per_call(448, 448, torch.device("cpu")) == 4
    assert images_per_call(4000, 4000, "cpu") == 1
    assert images_per_call(32, 32, "cpu") == 16 * 49
    assert images_per_call(224, 224, "cuda") is None  # a device string: nothing runs there


def test_integrated_gradients_in_groups_equals_one_call(monkeypatch) -> None:
    clf = tiny_convnet()
    x, target = images(3, 16, seed=1), torch.tensor([0, 2, 4])
    whole = get_explainer("integrated-gradients", clf, n_steps=5, internal_batch_size=None)
    expected, delta = whole.attribute(x, target, return_convergence_delta=True)
    _limit(monkeypatch, 2, 16)
    sizes, handle = _record_batches(clf)
    try:
        auto = get_explainer("integrated-gradients", clf, n_steps=5)
        assert auto.defaults["internal_batch_size"] == "auto"
        maps, auto_delta = auto.attribute(x, target, return_convergence_delta=True)
        plain = auto.attribute(x, target, baselines=torch.full_like(x, 0.25))
    finally:
        handle.remove()
    # Two images a group, two path points a call (Captum's chunks never split an image's path below the group).
    assert max(sizes) == 2 and sum(sizes) >= 2 * 3 * 5
    torch.testing.assert_close(maps, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(auto_delta, delta, rtol=1e-4, atol=1e-5)
    per_image = torch.cat([whole.attribute(x[i : i + 1], target[i : i + 1], baselines=0.25) for i in range(3)])
    torch.testing.assert_close(plain, per_image, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="internal_batch_size must be an integer >= 1, None or 'auto'"):
        get_explainer("integrated-gradients", clf, internal_batch_size="half")


@pytest.mark.parametrize("count", [3, 10])  # pieces of a curve (3 < S = 5), whole curves (2 a group)
def test_aha_blends_in_groups_give_the_same_loss_and_gradients(monkeypatch, count: int) -> None:
    clf = tiny_convnet()
    x = images(3, 16, seed=2)
    target = clf(x).argmax(1)
    maps = torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
    kw = dict(grid=4, fractions=torch.linspace(0, 1, 5), tau=0.3, n_iters=10, noise=0.5, generator=7, mask_sigma=1.0)
    ref = torch.full_like(x, 0.5)
    whole = soft_auc_loss(clf, x, maps, target, ref, peak_weight=0.1, **kw)
    (grad,) = torch.autograd.grad(whole.loss, maps)
    _limit(monkeypatch, count, 16)
    sizes, handle = _record_batches(clf)
    try:
        split = soft_auc_loss(clf, x, maps, target, ref, peak_weight=0.1, **kw)
        (split_grad,) = torch.autograd.grad(split.loss, maps)
    finally:
        handle.remove()
    assert max(sizes) <= count and len(sizes) > 2  # groups in the forward and again in the backward
    torch.testing.assert_close(split.loss, whole.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(split.deletion_curve, whole.deletion_curve, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(split.insertion_curve, whole.insertion_curve, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(split_grad, grad, rtol=1e-5, atol=1e-7)
    assert grad.abs().sum() > 0


def test_aha_training_steps_are_the_same_with_grouped_blends(monkeypatch) -> None:
    """Two training steps of AHA on the colour classifier: the same losses and decoder weights when its 2 x 2 x 6
    blends a step go through the classifier four at a time."""
    x, labels = colour_images(2)
    data = torch.utils.data.TensorDataset(x, labels)
    cfg = AHAConfig(decoder_dim=8, class_dim=4, n_fractions=6, seed=0)

    def train() -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
        aha = AHA(colour_classifier(), cfg, img_size=32)
        history = aha.fit(data, batch_size=2, max_steps=2, progress=False)
        return history, {k: v.clone() for k, v in aha.decoder.state_dict().items()}

    history, weights = train()
    _limit(monkeypatch, 4, 32)
    split_history, split_weights = train()
    assert split_history["loss"] == pytest.approx(history["loss"], rel=1e-5)
    for name, value in weights.items():
        torch.testing.assert_close(split_weights[name], value, rtol=1e-4, atol=1e-6)
