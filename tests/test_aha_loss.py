"""attr_engine.aha.loss with mask smoothing: the soft objective blurs its masks when asked, AHAConfig's mask_sigma
(1.0 at 224 px, scaled with the side) reaches the training step, and attribution and the hard metric never blur."""

from __future__ import annotations

import pytest
import torch

import attr_engine_kernels as kernels
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


# ---------------------------------------------------------------------------------------------------------------
# Score scaling: what enters the sorter
# ---------------------------------------------------------------------------------------------------------------


def test_zscored_scores_are_standardised_and_scale_free() -> None:
    from attr_engine.aha.loss import sorter_scores

    scores = torch.randn(3, 49, dtype=torch.float64)
    z = sorter_scores(scores, "zscore", anchor_span=4.0)
    torch.testing.assert_close(z.mean(1), torch.zeros(3, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(z.square().mean(1).sqrt(), torch.full((3,), 4.0, dtype=torch.float64))
    # A positive affine change of the map gives the sorter the same input.
    torch.testing.assert_close(sorter_scores(25.0 * scores + 3.0, "zscore", 4.0), z)
    assert sorter_scores(scores, "raw") is scores


def test_zscored_ranking_equals_anchors_spanning_the_span() -> None:
    """span * z against the sorter's [0, 1] anchors is the cost -(z - A)^2 with A in [-span/2, span/2] (Sinkhorn
    cancels the row and column constants), checked at convergence with the dense definition."""
    from attr_engine.aha.loss import sorter_scores
    from attr_engine_kernels.sinkhorn import sinkhorn_reference
    from attr_engine_kernels.soft_rank import prefix_weights

    n, span, tau, iters = 16, 4.0, 0.5, 400
    scores = torch.randn(2, n, dtype=torch.float64)
    fractions = torch.linspace(0, 1, 5, dtype=torch.float64)
    z = sorter_scores(scores, "zscore", span) / span
    anchors = torch.linspace(span / 2, -span / 2, n, dtype=torch.float64)
    perm = sinkhorn_reference(-(z[:, None, :] - anchors[None, :, None]).square(), iters, tau)
    expected = prefix_weights(fractions, n).to(perm.dtype) @ perm
    ours = kernels.soft_topk_masks(sorter_scores(scores, "zscore", span), fractions, tau=tau, n_iters=iters, noise=0.0)
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=0)


def test_zscored_objective_ignores_the_map_scale_and_survives_a_constant_map() -> None:
    clf = colour_classifier()
    x, _ = colour_images(2)
    target = clf(x).argmax(1)
    maps = torch.randn(2, 32, 32)
    kw = dict(grid=4, fractions=torch.linspace(0, 1, 5), tau=0.3, n_iters=10, noise=0.0, score_norm="zscore")
    ref = torch.zeros_like(x)
    small = soft_auc_loss(clf, x, 0.01 * maps, target, ref, **kw)
    large = soft_auc_loss(clf, x, 100.0 * maps, target, ref, **kw)
    torch.testing.assert_close(small.deletion, large.deletion, atol=1e-5, rtol=0)
    raw = soft_auc_loss(clf, x, 0.01 * maps, target, ref, **(kw | {"score_norm": "raw"}))
    raw_large = soft_auc_loss(clf, x, 100.0 * maps, target, ref, **(kw | {"score_norm": "raw"}))
    assert not torch.allclose(raw.deletion, raw_large.deletion, atol=1e-3)  # raw scores: the scale is a temperature
    flat = torch.full((2, 32, 32), 0.5, requires_grad=True)
    (grad,) = torch.autograd.grad(soft_auc_loss(clf, x, flat, target, ref, **kw).loss, flat)
    assert torch.isfinite(grad).all()
    with pytest.raises(ValueError, match="score_norm"):
        soft_auc_loss(clf, x, maps, target, ref, **(kw | {"score_norm": "minmax"}))


def test_training_passes_the_configured_score_scaling(monkeypatch: pytest.MonkeyPatch) -> None:
    import attr_engine.aha.loss as loss_module

    seen: list[tuple[str, float]] = []
    original = loss_module.soft_auc_loss

    def recording(*args: object, score_norm: str, anchor_span: float, **kwargs: object) -> object:
        seen.append((score_norm, anchor_span))
        return original(*args, score_norm=score_norm, anchor_span=anchor_span, **kwargs)

    monkeypatch.setattr("attr_engine.aha.trainer.soft_auc_loss", recording)
    x, y = colour_images(4)
    aha = AHA(colour_classifier(), AHAConfig(**FAST, targets="pred", score_norm="zscore", anchor_span=3.0))
    aha.fit(torch.utils.data.TensorDataset(x, y), batch_size=2, max_steps=2, progress=False)
    assert seen == [("zscore", 3.0), ("zscore", 3.0)]
