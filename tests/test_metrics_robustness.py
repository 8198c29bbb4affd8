"""max_sensitivity against Quantus 0.6.0 MaxSensitivity and Captum sensitivity_max with the same noise, plus its
exact cases (a linear model's gradient never changes) and chunking / seeding behaviour."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import quantus
import torch
from captum.metrics import sensitivity_max

from attr_engine.adapters import CaptumAdapter, quantus_explain_func
from attr_engine.baselines import Gradient
from attr_engine.metrics.robustness import max_sensitivity
from tests.eval_helpers import images, linear_classifier, single_thread, tiny_convnet
from tests.tolerances import tol

FP32 = torch.float32
SAMPLES = 4


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


@pytest.fixture(scope="module")
def case() -> tuple:
    clf = tiny_convnet()
    x = images(3, 16, seed=1)
    with torch.no_grad():
        y = clf(x).argmax(1)
    explainer = Gradient(clf)
    return clf, x, y, explainer, explainer.attribute(x, y)


def test_max_sensitivity_equals_quantus_with_shared_noise(case) -> None:
    clf, x, y, explainer, maps = case
    # Quantus draws U(-r, r) of shape (B, C*H*W) per sample from numpy's legacy global RNG.
    np.random.seed(7)  # noqa: NPY002
    noise = np.random.uniform(-0.2, 0.2, size=(SAMPLES, 3, 3 * 16 * 16))  # noqa: NPY002
    np.random.seed(7)  # noqa: NPY002
    metric = quantus.MaxSensitivity(nr_samples=SAMPLES, lower_bound=0.2, disable_warnings=True)
    ref = metric(
        model=clf,
        x_batch=x.numpy(),
        y_batch=y.numpy(),
        a_batch=maps.numpy()[:, None],
        explain_func=quantus_explain_func(explainer),
        device="cpu",
    )
    shared = torch.from_numpy(noise).float().view(SAMPLES, *x.shape)
    ours = max_sensitivity(explainer, x, y, maps=maps, noise=shared, batch_size=5)
    torch.testing.assert_close(ours, torch.tensor(np.asarray(ref)).float(), **tol("max_sensitivity", FP32))


def test_max_sensitivity_equals_captum_with_shared_noise(case) -> None:
    _, x, y, explainer, _ = case
    noise = 0.02 * (2 * torch.rand(SAMPLES, *x.shape, generator=torch.Generator().manual_seed(3)) - 1)

    def perturb(inputs: torch.Tensor, radius: float) -> torch.Tensor:
        # Captum repeats each image SAMPLES times (image-major) before perturbing.
        return inputs + noise.transpose(0, 1).reshape(-1, *x.shape[1:])

    # The map (repeated over channels by the adapter, which scales both norms alike) and the per-channel form.
    ref = sensitivity_max(
        CaptumAdapter(explainer, reduce="mean").attribute, x, perturb_func=perturb, n_perturb_samples=SAMPLES, target=y
    )
    ours = max_sensitivity(explainer, x, y, noise=noise)
    torch.testing.assert_close(ours, ref.float(), **tol("max_sensitivity", FP32))
    ref = sensitivity_max(
        CaptumAdapter(explainer).attribute, x, perturb_func=perturb, n_perturb_samples=SAMPLES, target=y
    )
    ours = max_sensitivity(lambda a, t: explainer.attribute(a, t, reduce=None), x, y, noise=noise)
    torch.testing.assert_close(ours, ref.float(), **tol("max_sensitivity", FP32))


def test_a_linear_models_gradient_is_perfectly_stable() -> None:
    clf = linear_classifier()
    score = max_sensitivity(Gradient(clf), images(2, 8), torch.tensor([0, 2]), radius=0.3, n_samples=5)
    assert score.abs().max() < 1e-6


def test_seeded_draws_reproduce_and_target_none_uses_the_explainers_classifier(case) -> None:
    _, x, y, explainer, maps = case
    first = max_sensitivity(explainer, x, radius=0.1, n_samples=6, generator=torch.Generator().manual_seed(1))
    again = max_sensitivity(
        explainer, x, y, maps=maps, radius=0.1, n_samples=6, generator=torch.Generator().manual_seed(1)
    )
    torch.testing.assert_close(first, again)
    assert (first > 0).all()
    bigger = max_sensitivity(
        explainer, x, y, maps=maps, radius=0.1, n_samples=12, generator=torch.Generator().manual_seed(1)
    )
    assert (bigger >= first - 1e-6).all()  # a max over a superset of the same draws


def test_max_sensitivity_input_checks(case) -> None:
    _, x, y, explainer, _ = case
    with pytest.raises(ValueError, match="noise"):
        max_sensitivity(explainer, x, y, noise=torch.zeros(2, 1, 3, 16, 16))
    with pytest.raises(ValueError, match="target"):
        max_sensitivity(lambda a, t: a.sum(1), x, None)
    with pytest.raises(ValueError, match="explainer must return"):
        max_sensitivity(lambda a, t: a[:, 0, :4], x, y, n_samples=1)
