"""random_logit against Quantus 0.6.0 RandomLogit (SSIM and Pearson) with the same random classes; the batched
SSIM / Pearson against skimage / scipy; the other-class draw."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import quantus
import scipy.stats
import torch
from skimage.metrics import structural_similarity

from attr_engine.adapters import quantus_explain_func
from attr_engine.baselines import Gradient
from attr_engine.metrics.randomisation import pearson_similarity, random_logit, random_other_class, ssim_similarity
from tests.eval_helpers import images, single_thread, tiny_convnet
from tests.tolerances import tol

FP32 = torch.float32


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


@pytest.fixture(scope="module")
def case() -> tuple:
    clf = tiny_convnet(num_classes=5)
    x = images(4, 16, seed=2)
    with torch.no_grad():
        y = clf(x).argmax(1)
    explainer = Gradient(clf)
    return clf, x, y, explainer, explainer.attribute(x, y)


@pytest.mark.parametrize(
    ("similarity", "quantus_func"),
    [("ssim", quantus.similarity_func.ssim), ("pearson", quantus.similarity_func.correlation_pearson)],
)
def test_random_logit_equals_quantus(case, similarity, quantus_func) -> None:
    clf, x, y, explainer, maps = case
    metric = quantus.RandomLogit(num_classes=5, similarity_func=quantus_func, seed=42, disable_warnings=True)
    ref = metric(
        model=clf,
        x_batch=x.numpy(),
        y_batch=y.numpy(),
        a_batch=maps.numpy()[:, None],
        explain_func=quantus_explain_func(explainer),
        device="cpu",
    )
    # Quantus reseeds numpy with its seed per batch and draws r in [0, K - 2]; the class is the r-th of the others.
    np.random.seed(42)  # noqa: NPY002
    r = torch.from_numpy(np.random.randint(0, 4, len(x)))  # noqa: NPY002
    off = r + (r >= y).long()
    # Quantus' default normalise=True divides by the max |value| over the whole batch.
    ours = random_logit(explainer, x, y, maps=maps, similarity=similarity, off_target=off, normalise="batch_max")
    torch.testing.assert_close(ours, torch.tensor(np.asarray(ref)).float(), **tol("random_logit", FP32))


@pytest.mark.parametrize("length", [7, 30, 256])
def test_ssim_similarity_equals_skimage_on_1d_signals(length) -> None:
    gen = torch.Generator().manual_seed(length)
    a, b = torch.randn(3, length, generator=gen, dtype=torch.float64), torch.randn(3, length, generator=gen).double()
    b[1] = 0.5 * a[1] + 0.1  # correlated pair
    ours = ssim_similarity(a, b)
    for i in range(3):
        lo, hi = min(a[i].min(), b[i].min()), max(a[i].max(), b[i].max())
        ref = structural_similarity(a[i].numpy(), b[i].numpy(), data_range=float(hi - lo))
        assert ours[i].item() == pytest.approx(ref, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(ssim_similarity(a, a), torch.ones(3, dtype=torch.float64))


def test_pearson_similarity_equals_scipy() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 50, generator=gen), torch.randn(4, 50, generator=gen)
    ref = scipy.stats.pearsonr(a.double().numpy(), b.double().numpy(), axis=1)[0]
    torch.testing.assert_close(pearson_similarity(a, b), torch.from_numpy(ref))


def test_random_other_class_is_uniform_over_the_others() -> None:
    target = torch.tensor([0, 2, 4] * 400)
    off = random_other_class(target, 5, torch.Generator().manual_seed(0))
    assert (off != target).all() and off.min() >= 0 and off.max() <= 4
    for t in (0, 2, 4):
        counts = torch.bincount(off[target == t], minlength=5)
        assert counts[t] == 0 and (counts[torch.arange(5) != t] > 60).all()


def test_per_map_normalisation_makes_ssim_independent_of_the_batch(case) -> None:
    _, x, y, explainer, maps = case
    off = (y + 1) % 5
    full = random_logit(explainer, x, y, maps=maps, off_target=off)
    alone = random_logit(explainer, x[:1], y[:1], maps=maps[:1], off_target=off[:1])
    torch.testing.assert_close(full[:1], alone)
    same = random_logit(explainer, x, y, maps=maps, off_target=off, similarity="pearson")
    assert (same < 0.999).all()  # different classes, different gradients
    with pytest.raises(ValueError, match="off_target"):
        random_logit(explainer, x, y, maps=maps, off_target=y)
