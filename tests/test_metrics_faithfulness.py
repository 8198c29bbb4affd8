"""Infidelity against Quantus 0.6.0 and Captum with shared randomness, its exact cases, and Pos / Neg perturbation AUC.

Quantus is given the same classifier (a Classifier takes [0, 1] images) and the same maps; its "uniform" draws are
reproduced by seeding numpy and drawing the same stream up front (Quantus draws one value per image and patch, in the
loop order sample -> patch size -> patch).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import quantus
import torch
from captum.metrics import infidelity as captum_infidelity

from attr_engine.metrics import deletion_insertion, pixel_ranks
from attr_engine.metrics.faithfulness import (
    infidelity,
    infidelity_from_perturbations,
    patch_grid,
    perturbation_auc,
)
from tests.eval_helpers import images, linear_classifier, single_thread, tiny_convnet
from tests.tolerances import tol

FP32 = torch.float32


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


@pytest.fixture(scope="module")
def case() -> tuple:
    clf = tiny_convnet()
    x = images(3, 16, seed=1)
    maps = torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y = clf(x).argmax(1)
    return clf, x, maps, y


def quantus_infidelity(clf, x, maps, y, **kwargs) -> np.ndarray:
    metric = quantus.Infidelity(disable_warnings=True, **kwargs)
    a = maps.numpy() if maps.ndim == 4 else maps.numpy()[:, None]
    return np.asarray(metric(model=clf, x_batch=x.numpy(), y_batch=y.numpy(), a_batch=a, device="cpu"))


@pytest.mark.parametrize(
    ("baseline", "options"),
    [("black", {}), ("white", {"normalise": True, "abs": True}), ("mean", {})],
)
def test_infidelity_equals_quantus_for_deterministic_baselines(case, baseline, options) -> None:
    clf, x, maps, y = case
    ref = quantus_infidelity(clf, x, maps, y, perturb_baseline=baseline, perturb_patch_sizes=[4, 8], **options)
    ours = infidelity(
        clf,
        x,
        maps,
        y,
        patch_sizes=(4, 8),
        baseline=baseline,
        abs=options.get("abs", False),
        normalise="batch_max" if options.get("normalise") else None,
    )
    torch.testing.assert_close(ours, torch.from_numpy(ref).float(), **tol("infidelity", FP32))


def test_infidelity_equals_quantus_uniform_with_shared_draws_and_channel_maps(case) -> None:
    clf, x, _, y = case
    maps = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(5))  # per-channel attributions
    samples, patches = 2, 16 + 4
    # Quantus draws from numpy's legacy global RNG, so the shared stream has to come from there too.
    np.random.seed(11)  # noqa: NPY002
    draws = np.random.uniform(-1.0, 1.0, size=(samples, patches, 3))  # noqa: NPY002
    np.random.seed(11)  # noqa: NPY002
    ref = quantus_infidelity(
        clf,
        x,
        maps,
        y,
        perturb_baseline="uniform",
        perturb_func_kwargs={"uniform_low": -1.0, "uniform_high": 1.0},
        perturb_patch_sizes=[4, 8],
        n_perturb_samples=samples,
    )
    ours = infidelity(
        clf, x, maps, y, patch_sizes=(4, 8), n_samples=samples, baseline="uniform", baseline_values=torch.tensor(draws)
    )
    torch.testing.assert_close(ours, torch.from_numpy(ref).float(), **tol("infidelity", FP32))


def cumulative_patch_perturbations(x: torch.Tensor, patch: int) -> torch.Tensor:
    """Quantus' perturbations I = x - x_pert for its "black" (image minimum) baseline, by hand: (P, B, C, H, W)."""
    out, current = [], x.clone()
    low = x.flatten(1).amin(dim=1).view(-1, 1, 1, 1)
    for i in range(0, x.shape[2], patch):
        for j in range(0, x.shape[3], patch):
            current = current.clone()
            current[:, :, i : i + patch, j : j + patch] = low
            out.append(x - current)
    return torch.stack(out)


def captum_infidelity_of(clf, x, maps, y, perturbations: torch.Tensor, normalize: bool) -> torch.Tensor:
    """Captum's infidelity with the given (S, B, C, H, W) perturbations (it expects them image-major)."""
    samples = perturbations.shape[0]
    flat = perturbations.transpose(0, 1).reshape(-1, *x.shape[1:])

    def perturb(inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return flat, inputs - flat

    attr = maps.unsqueeze(1).expand_as(x) if maps.ndim == 3 else maps
    with torch.no_grad():
        return captum_infidelity(
            clf, perturb, x, attr, target=y, n_perturb_samples=samples, normalize=normalize
        ).float()


def test_optimal_scaling_equals_captum_normalize_on_the_patch_perturbations(case) -> None:
    clf, x, maps, y = case
    perturbations = cumulative_patch_perturbations(x, 4)
    ref = captum_infidelity_of(clf, x, maps, y, perturbations, normalize=True)
    ours = infidelity(clf, x, maps, y, patch_sizes=(4,), baseline="black", scaling="optimal")
    torch.testing.assert_close(ours, ref, **tol("infidelity", FP32))
    plain = infidelity(clf, x, maps, y, patch_sizes=(4,), baseline="black")
    torch.testing.assert_close(
        plain, captum_infidelity_of(clf, x, maps, y, perturbations, False), **tol("infidelity", FP32)
    )


@pytest.mark.parametrize("scaling", ["none", "optimal"])
def test_infidelity_from_perturbations_equals_captum_with_shared_noise(case, scaling) -> None:
    clf, x, maps, y = case
    noise = 0.1 * torch.randn(6, *x.shape, generator=torch.Generator().manual_seed(3))
    ref = captum_infidelity_of(clf, x, maps, y, noise, normalize=scaling == "optimal")
    ours = infidelity_from_perturbations(clf, x, maps, noise, y, scaling=scaling, batch_size=4)
    torch.testing.assert_close(ours, ref, **tol("infidelity", FP32))


def test_exact_attribution_of_a_linear_model_has_zero_infidelity() -> None:
    clf = linear_classifier()
    x = images(2, 8, seed=4)
    y = torch.tensor([1, 3])
    std = torch.tensor((0.25, 0.2, 0.5)).view(3, 1, 1)
    exact = clf.model.weight.detach()[y] / std  # d logit / d x, per channel: b = sum(exact * (x - x_pert)) exactly
    for baseline in ("black", "mean", 0.3):
        score = infidelity(clf, x, exact, y, patch_sizes=(2, 4), baseline=baseline)
        assert score.abs().max() < 1e-8
    assert infidelity(clf, x, exact.flip(-1), y, patch_sizes=(2,)).min() > 1e-2  # a wrong map is not


def test_optimal_scaling_ignores_the_map_scale_and_plain_does_not(case) -> None:
    clf, x, maps, y = case
    opt = infidelity(clf, x, maps, y, patch_sizes=(8,), scaling="optimal")
    torch.testing.assert_close(infidelity(clf, x, 7.0 * maps, y, patch_sizes=(8,), scaling="optimal"), opt)
    assert not torch.allclose(
        infidelity(clf, x, 7.0 * maps, y, patch_sizes=(8,)), infidelity(clf, x, maps, y, patch_sizes=(8,))
    )


def test_deterministic_baselines_are_evaluated_once_and_chunking_does_not_matter(case) -> None:
    clf, x, maps, y = case
    one = infidelity(clf, x, maps, y, patch_sizes=(4,), n_samples=1)
    torch.testing.assert_close(infidelity(clf, x, maps, y, patch_sizes=(4,), n_samples=7, batch_size=5), one)
    gen = torch.Generator().manual_seed(0)
    a = infidelity(clf, x, maps, y, patch_sizes=(8,), baseline="uniform", n_samples=3, generator=gen, batch_size=3)
    gen = torch.Generator().manual_seed(0)
    b = infidelity(clf, x, maps, y, patch_sizes=(8,), baseline="uniform", n_samples=3, generator=gen, batch_size=64)
    torch.testing.assert_close(a, b)


def test_patch_grid_blocks_and_centred_clipped_border() -> None:
    grid = patch_grid(4, 4, 2)
    assert grid.tolist() == [[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 3, 3], [2, 2, 3, 3]]
    odd = patch_grid(5, 5, 2)  # padded by 0 before / 1 after: border patches are clipped on the far side
    assert odd[0].tolist() == [0, 0, 1, 1, 2] and odd[:, 0].tolist() == [0, 0, 3, 3, 6]
    with pytest.raises(ValueError, match="larger than the image"):
        patch_grid(4, 4, 8)


def test_infidelity_rejects_bad_arguments(case) -> None:
    clf, x, maps, y = case
    with pytest.raises(ValueError, match="baseline"):
        infidelity(clf, x, maps, y, baseline="zero")
    with pytest.raises(ValueError, match="baseline_values"):
        infidelity(clf, x, maps, y, baseline="uniform", baseline_values=torch.zeros(1, 2, 3), n_samples=1)
    with pytest.raises(ValueError, match="scaling"):
        infidelity(clf, x, maps, y, scaling="beta")
    with pytest.raises(ValueError, match="maps"):
        infidelity(clf, x, maps[:, :8], y)


def test_pos_neg_equal_aha_deletion_and_insertion_on_the_same_fractions(case) -> None:
    clf, x, maps, y = case
    pn = perturbation_auc(clf, x, maps, y, fractions=[k / 20 for k in range(21)], batch_size=7)
    di = deletion_insertion(clf, x, maps, y, steps=20, protocol="aha")
    torch.testing.assert_close(pn.positive, di.deletion)
    torch.testing.assert_close(pn.negative, di.insertion)


@pytest.mark.parametrize("batch_size", [1, 7, 256])
def test_pos_neg_and_deletion_insertion_share_one_curve_engine(case, batch_size) -> None:
    # The two metrics once had their own curve loops; on the same fractions their curves are now the same numbers.
    clf, x, maps, y = case
    pn = perturbation_auc(clf, x, maps, y, fractions=[k / 20 for k in range(21)], batch_size=batch_size)
    di = deletion_insertion(clf, x, maps, y, steps=20, protocol="aha", batch_size=batch_size)
    # Interior points come from the same chunked loop; the endpoints from a whole-batch call in deletion_insertion.
    torch.testing.assert_close(pn.positive_curve[:, 1:-1], di.deletion_curve[:, 1:-1], rtol=0, atol=0)
    torch.testing.assert_close(pn.negative_curve[:, 1:-1], di.insertion_curve[:, 1:-1], rtol=0, atol=0)
    torch.testing.assert_close(pn.positive_curve, di.deletion_curve)


def test_perturbation_curve_scores_the_images_it_describes(case) -> None:
    from attr_engine.metrics.curves import perturbation_curve, target_probability

    clf, x, maps, y = case
    end = torch.rand(x.shape, generator=torch.Generator().manual_seed(4))
    ranks = pixel_ranks(maps)
    counts = [0, 5, 100, 256]
    curve = perturbation_curve(clf, x, end, ranks, counts, y, batch_size=5)
    assert curve.shape == (3, 4) and curve.dtype == torch.float32
    with torch.no_grad():
        for k, n in enumerate(counts):
            mask = (ranks < n).view(3, 1, 16, 16)
            expected = target_probability(clf(torch.where(mask, end, x)), y)
            torch.testing.assert_close(curve[:, k], expected)
    # Patch ids as ranks: whole patches switch at once, as infidelity's cumulative replacement needs.
    grid = patch_grid(16, 16, 8).flatten().expand(3, -1)
    patches = perturbation_curve(clf, x, end, grid, [1, 4], y, batch_size=2, dtype=torch.float64)
    with torch.no_grad():
        first = torch.where((grid < 1).view(3, 1, 16, 16), end, x)
        torch.testing.assert_close(patches[:, 0], target_probability(clf(first), y).double())
        torch.testing.assert_close(patches[:, 1], target_probability(clf(end), y).double())


def test_pos_neg_defaults_accuracy_and_ordering(case) -> None:
    clf, x, maps, _ = case
    pn = perturbation_auc(clf, x, maps)
    assert pn.fractions.tolist() == pytest.approx([k / 10 for k in range(10)])
    torch.testing.assert_close(pn.positive_curve[:, 0], pn.negative_curve[:, 0])  # nothing removed yet
    acc = perturbation_auc(clf, x, maps, score="accuracy")
    assert set(acc.positive_curve.unique().tolist()) <= {0.0, 1.0}
    assert acc.positive_curve[:, 0].eq(1).all()  # the clean image is predicted as its (predicted) target
    with pytest.raises(ValueError, match="increasing"):
        perturbation_auc(clf, x, maps, fractions=[0.0, 0.5, 0.5])
    with pytest.raises(ValueError, match="score"):
        perturbation_auc(clf, x, maps, score="logit")


@pytest.mark.parametrize("name", ["gradient", "integrated-gradients", "pullback-soft"])
def test_infidelity_of_per_channel_attributions_equals_captum_through_the_adapter(case, name) -> None:
    """captum.metrics.infidelity on CaptumAdapter's input-shaped attributions (its docstring example) equals ours."""
    from captum.metrics import infidelity_perturb_func_decorator

    from attr_engine.adapters import CaptumAdapter
    from attr_engine.explainer import get_explainer

    clf, x, _, y = case
    options = {"n_steps": 4} if name == "integrated-gradients" else {}
    adapter = CaptumAdapter(get_explainer(name, clf, **options))
    attr = adapter.attribute(x, target=y)
    assert attr.shape == x.shape
    noise = 0.05 * torch.randn(4, *x.shape, generator=torch.Generator().manual_seed(5))
    flat = noise.transpose(0, 1).reshape(-1, *x.shape[1:])

    @infidelity_perturb_func_decorator(False)
    def perturb(inputs: torch.Tensor) -> torch.Tensor:
        return inputs - flat  # the decorated function returns perturbed inputs; Captum derives I = x - x_pert

    with torch.no_grad():
        ref = captum_infidelity(adapter.forward_func, perturb, x, attr, target=y, n_perturb_samples=4).float()
    ours = infidelity_from_perturbations(clf, x, attr, noise, y, batch_size=4)
    torch.testing.assert_close(ours, ref, **tol("infidelity", FP32))
