"""AHA.optimise_maps: the per-image optimum of AHA's own objective (issue #31's amortization gap)."""

from __future__ import annotations

import pytest
import torch

from attr_engine.aha import AHA, AHAConfig
from attr_engine.aha.loss import soft_auc_loss
from attr_engine.aha.model import standardise_maps
from attr_engine.imageops import reference_image
from attr_engine.metrics import deletion_insertion
from tests.aha_helpers import FAST, colour_classifier, colour_images


def _objective(aha: AHA, x: torch.Tensor, maps: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The soft objective averaged over every grid of the range and a fixed offset (noise-free)."""
    ref = reference_image(x, "mean", aha.classifier.norm_mean)
    fractions = torch.linspace(0, 1, 6)
    kwargs = {"fractions": fractions, "tau": 0.3, "n_iters": 8, "noise": 0.0, "score_norm": "zscore"}
    losses = [soft_auc_loss(aha.classifier, x, maps, target, ref, grid=g, **kwargs).loss for g in range(2, 7)]
    return torch.stack(losses).mean()


def test_optimise_maps_starts_at_the_one_pass_map_and_lowers_the_objective_and_the_hard_composite():
    clf = colour_classifier()
    aha = AHA(clf, AHAConfig(**FAST, targets="pred"))  # untrained: far from its optimum
    x, _ = colour_images(4)
    target = clf(x).argmax(1)
    out = aha.optimise_maps(x, steps=20, record=(0, 5), lr=0.1, seed=0)
    assert sorted(out) == [0, 5, 20]
    with torch.no_grad():
        torch.testing.assert_close(out[0], standardise_maps(aha(x, target)))
        losses = [float(_objective(aha, x, out[s], target)) for s in (0, 5, 20)]
    assert losses[2] < losses[0] - 0.02, losses
    before = deletion_insertion(clf, x, out[0], target)
    after = deletion_insertion(clf, x, out[20], target)
    gain = (after.insertion - after.deletion).mean() - (before.insertion - before.deletion).mean()
    assert gain > 0.02, float(gain)


def test_an_optimised_map_does_not_depend_on_its_batch():
    clf = colour_classifier()
    aha = AHA(clf, AHAConfig(**FAST))
    x, _ = colour_images(3)
    together = aha.optimise_maps(x, steps=5, seed=1)[5]
    alone = aha.optimise_maps(x[1:2], steps=5, seed=1)[5]
    moved = (together[1] - standardise_maps(aha(x[1:2], clf(x[1:2]).argmax(1)))[0]).abs().max()
    torch.testing.assert_close(together[1:2], alone, atol=1e-4, rtol=1e-4)
    assert moved > 1e-2  # the steps moved the map far more than the tolerance


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": -1}, "steps"),
        ({"steps": 3, "record": (4,)}, "record"),
        ({"steps": 3, "lr": 0.0}, "lr"),
    ],
)
def test_optimise_maps_rejects_bad_arguments(kwargs, match):
    aha = AHA(colour_classifier(), AHAConfig(**FAST))
    x, _ = colour_images(1)
    with pytest.raises(ValueError, match=match):
        aha.optimise_maps(x, **kwargs)
    with pytest.raises(ValueError, match="x must be"):
        aha.optimise_maps(x[0], steps=1)


def test_map_refinement_is_a_short_run_of_the_optimum_descent():
    """``refine_mode="map"`` takes the optimum's steps (same start, loop and grid draws) under the refinement's
    grids, fractions and rate: with those set to the training's, T refinement steps are T optimum steps."""
    clf = colour_classifier()
    config = AHAConfig(**FAST, refine_mode="map", refine_grid_range=(2, 6), refine_fractions=6, refine_map_lr=0.1)
    aha = AHA(clf, config)
    x, _ = colour_images(3)
    target = clf(x).argmax(1)
    refined = aha.attribute(x, target, refine_steps=4, seed=3)
    optimum = aha.optimise_maps(x, target, steps=4, lr=0.1, seed=3)[4]
    torch.testing.assert_close(refined, standardise_maps(optimum), atol=1e-5, rtol=1e-5)
    assert (refined - aha.attribute(x, target)).abs().amax() > 1e-2  # the steps moved the maps
    # A changed rate or grid range is a different descent.
    other = aha.with_options()
    other.config = AHAConfig(**{**FAST, "refine_grid_range": (2, 3)}, refine_fractions=6, refine_map_lr=0.1)
    assert not torch.allclose(other.attribute(x, target, refine_steps=4, seed=3), refined, atol=1e-3)


def test_smoothed_map_refinement_moves_the_map_smoothly_and_per_image():
    """``refine_smooth`` > 0: the map moves by a Gaussian blur of its free values, so a step's per-cell blocks (a
    sign pattern under Adam's first step) arrive without their edges; each map still depends on its image alone."""
    clf = colour_classifier()
    x, _ = colour_images(4)
    target = clf(x).argmax(1)

    def change(smooth: float, images: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        aha = AHA(clf, AHAConfig(**FAST, refine_grid_range=(4, 4), refine_smooth=smooth))
        with torch.no_grad():
            start = standardise_maps(aha(images, classes))
        return aha._refine(images.clone(), classes, 2, 0) - start  # before attribute's standardisation

    blocky, smooth = change(0.0, x, target), change(0.5, x, target)

    def roughness(d: torch.Tensor) -> torch.Tensor:  # mean squared jump between neighbours, relative to the change
        jumps = (d[:, 1:] - d[:, :-1]).square().mean() + (d[:, :, 1:] - d[:, :, :-1]).square().mean()
        return jumps / d.square().mean()

    assert smooth.abs().amax() > 1e-2  # it moved
    assert roughness(smooth) < 0.5 * roughness(blocky), (roughness(smooth), roughness(blocky))
    torch.testing.assert_close(change(0.5, x[1:2], target[1:2]), smooth[1:2], atol=1e-4, rtol=1e-4)
