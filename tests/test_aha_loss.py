"""attr_engine.aha.loss with mask smoothing: the soft objective blurs its masks when asked, AHAConfig's mask_sigma
(1.0 at 224 px, scaled with the side) reaches the training step, and attribution and the hard metric never blur."""

from __future__ import annotations

import pytest
import torch

import kernels
from attr_engine.aha import AHA, AHAConfig
from attr_engine.aha.loss import soft_auc_loss
from attr_engine.metrics import deletion_insertion
from tests.aha_helpers import colour_classifier, colour_images

FAST = {"n_fractions": 4, "n_iters": 4, "decoder_dim": 8, "class_dim": 4, "grid_range": (4, 4)}


def test_mask_sigma_default_is_the_official_sigma_scaled_with_the_side() -> None:
    assert AHAConfig().mask_sigma is None
    assert AHAConfig().resolved(224).mask_sigma == pytest.approx(1.0)
    assert AHAConfig().resolved(64).mask_sigma == pytest.approx(64 / 224)
    assert AHAConfig(mask_sigma=0.0).resolved(224).mask_sigma == 0.0  # off
    assert AHAConfig(mask_sigma=2.5).resolved(32).mask_sigma == 2.5  # explicit values are not rescaled
    assert AHAConfig.from_dict(AHAConfig(mask_sigma=0.5).to_dict()).mask_sigma == 0.5


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "1.0"])
def test_mask_sigma_rejects_bad_values(bad: object) -> None:
    with pytest.raises(ValueError, match="mask_sigma must be a finite number >= 0"):
        AHAConfig(mask_sigma=bad)  # type: ignore[arg-type]


def test_smoothed_objective_differs_and_is_differentiable() -> None:
    clf = colour_classifier()
    x, _ = colour_images(2)
    target = clf(x).argmax(1)
    maps = torch.randn(2, 32, 32, requires_grad=True)
    kw = dict(grid=4, fractions=torch.linspace(0, 1, 5), tau=0.3, n_iters=10, noise=0.0)
    plain = soft_auc_loss(clf, x, maps, target, torch.zeros_like(x), **kw)
    smooth = soft_auc_loss(clf, x, maps, target, torch.zeros_like(x), mask_sigma=1.0, **kw)
    assert not torch.allclose(plain.deletion_curve, smooth.deletion_curve)
    # The endpoints (no cell removed / every cell removed) are constant masks, which the blur keeps.
    torch.testing.assert_close(smooth.deletion_curve[:, 0], plain.deletion_curve[:, 0])
    (grad,) = torch.autograd.grad(smooth.loss, maps)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_training_smooths_the_masks_and_attribution_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    sigmas: list[float] = []
    blend = kernels.soft_mask_blend

    def recording_blend(*args: object, smooth_sigma: float = 0.0, **kwargs: object) -> torch.Tensor:
        sigmas.append(smooth_sigma)
        return blend(*args, smooth_sigma=smooth_sigma, **kwargs)

    monkeypatch.setattr(kernels, "soft_mask_blend", recording_blend)
    clf = colour_classifier()
    x, y = colour_images(2)
    aha = AHA(clf, AHAConfig(**FAST, references=("mean",), targets="pred"))
    aha.fit(torch.utils.data.TensorDataset(x, y), epochs=1, batch_size=2, progress=False)
    assert sigmas and all(s == pytest.approx(32 / 224) for s in sigmas)
    sigmas.clear()
    maps = aha.attribute(x)
    deletion_insertion(clf, x, maps, clf(x).argmax(1), steps=4, protocol="aha")
    assert all(s == 0.0 for s in sigmas)


def test_smoothed_objective_compiles_fullgraph_and_equals_eager() -> None:
    """Training smooths by default, so the smoothed step must trace as one graph too (the blur's geometry is host
    set-up inside the op, cached per shape)."""
    clf = colour_classifier()
    x, target = colour_images(3, size=16)
    maps = torch.randn(3, 16, 16)
    kw = dict(grid=4, fractions=torch.linspace(0, 1, 8), tau=0.3, n_iters=5, generator=5, offset=(0.25, 0.5))
    compiled = torch.compile(soft_auc_loss, fullgraph=True, backend="aot_eager")
    results = []
    with kernels.set_backend("reference"):
        for fn in (soft_auc_loss, compiled):
            leaf = maps.clone().requires_grad_()
            loss = fn(clf, x, leaf, target, torch.full_like(x, 0.5), mask_sigma=0.8, **kw).loss
            results.append((loss.detach(), torch.autograd.grad(loss, leaf)[0]))
    for e, o in zip(*results, strict=True):
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-6)
