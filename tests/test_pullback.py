"""SemanticPullback: SfP and PA against their definitions, argument checks, and the model left untouched."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attr_engine.classifier import Classifier
from attr_engine.pullback import PullbackConfig, SemanticPullback, default_alpha, soft_adjoint
from tests.tolerances import tol

F64 = torch.float64
TOL = tol("pullback", F64)
TINY = dict(relu_tau=1e-12, maxpool_tau=1e-12)


class SmallNet(nn.Module):
    """Conv / BN / ReLU (module and functional) / max-pool / linear: every ReLU-network path the context touches."""

    def __init__(self, num_classes: int = 4) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
        )
        self.conv = nn.Conv2d(6, 6, 3, padding=1)
        self.head = nn.Linear(6 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.conv(self.features(x))).flatten(1))


@pytest.fixture
def clf() -> Classifier:
    net = SmallNet().double()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 2.0)
    return Classifier(net, mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3))


def plain_logit_grad(clf: Classifier, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(clf(x).gather(1, target.view(-1, 1)).sum(), x)
    return g


def test_soft_pullback_is_the_logit_gradient_under_the_soft_adjoint(clf: Classifier) -> None:
    x = torch.rand(3, 3, 8, 8, dtype=F64)
    target = torch.tensor([0, 3, 1])
    sfp = SemanticPullback(clf).attribute(x, target, method="soft", reduce=None)
    with soft_adjoint(clf):
        expected = plain_logit_grad(clf, x, target)
    torch.testing.assert_close(sfp, expected, **TOL)
    assert not torch.allclose(sfp, plain_logit_grad(clf, x, target))
    # With every temperature -> 0 the soft adjoint of a ReLU network is its plain backward.
    sharp = SemanticPullback(clf, PullbackConfig(**TINY)).attribute(x, target, method="soft", reduce=None)
    torch.testing.assert_close(sharp, plain_logit_grad(clf, x, target), **TOL)


def test_ascent_with_one_step_is_the_normalised_soft_pullback_step(clf: Classifier) -> None:
    x = torch.rand(2, 3, 8, 8, dtype=F64)
    sp = SemanticPullback(clf)
    sfp = sp.attribute(x, [2, 1], method="soft", reduce=None)
    pa = sp.attribute(x, [2, 1], method="ascent", steps=1, alpha=0.7, reduce=None)
    expected = 0.7 * sfp / sfp.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
    torch.testing.assert_close(pa, expected, **TOL)


def test_ascent_iterates_normalised_steps_and_clips(clf: Classifier) -> None:
    x = torch.rand(2, 3, 8, 8, dtype=F64)
    target = torch.tensor([1, 2])
    pa = SemanticPullback(clf).attribute(x, target, steps=3, alpha=0.5, reduce=None)
    xt = x.clone()
    for _ in range(3):
        with soft_adjoint(clf):
            v = plain_logit_grad(clf, xt, target)
        xt = xt + 0.5 * v / v.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
    torch.testing.assert_close(pa, xt - x, **TOL)
    big = SemanticPullback(clf, PullbackConfig(clip=True, alpha=20.0)).attribute(x, target, reduce=None)
    moved = x + big
    assert moved.min() >= 0 and moved.max() <= 1
    assert ((moved == 0) | (moved == 1)).any()  # the step is large enough that clipping really happened


def test_default_alpha_keeps_the_per_pixel_step() -> None:
    assert default_alpha(3 * 224 * 224) == pytest.approx(10.0)
    assert default_alpha(3 * 64 * 64) == pytest.approx(10.0 * 64 / 224)
    assert default_alpha(3 * 112 * 112) / math.sqrt(3 * 112 * 112) == pytest.approx(10.0 / math.sqrt(3 * 224 * 224))


def test_default_step_length_and_batch_independence(clf: Classifier) -> None:
    x = torch.rand(3, 3, 8, 8, dtype=F64)
    sp = SemanticPullback(clf)
    one = sp.attribute(x, 1, steps=1, reduce=None)
    torch.testing.assert_close(one.flatten(1).norm(dim=1), torch.full((3,), default_alpha(3 * 8 * 8), dtype=F64))
    batch = sp.attribute(x, reduce=None)
    singles = torch.cat([sp.attribute(x[i : i + 1], reduce=None) for i in range(3)])
    torch.testing.assert_close(batch, singles, **TOL)


def test_default_target_is_the_predicted_class(clf: Classifier) -> None:
    x = torch.rand(4, 3, 8, 8, dtype=F64)
    pred = clf(x).argmax(1)
    sp = SemanticPullback(clf)
    torch.testing.assert_close(sp.attribute(x, method="soft"), sp.attribute(x, pred, method="soft"), **TOL)


def test_reductions(clf: Classifier) -> None:
    x = torch.rand(2, 3, 8, 8, dtype=F64)
    sp = SemanticPullback(clf)
    full = sp.attribute(x, 0, reduce=None)
    assert full.shape == x.shape and full.dtype == x.dtype
    expected = {"mean": full.mean(1), "sum": full.sum(1), "abs": full.abs().mean(1), "norm": full.norm(dim=1)}
    for reduce, value in expected.items():
        torch.testing.assert_close(sp.attribute(x, 0, reduce=reduce), value, **TOL)


def test_grad_modes(clf: Classifier) -> None:
    x = torch.rand(2, 3, 8, 8, dtype=F64)
    sp = SemanticPullback(clf)
    expected = sp.attribute(x, 1, method="soft")
    with torch.no_grad():
        inside = sp.attribute(x, 1, method="soft")
    torch.testing.assert_close(inside, expected, **TOL)
    assert not inside.requires_grad
    with torch.inference_mode():
        x_inf = torch.rand(1, 3, 8, 8, dtype=F64)
        with pytest.raises(RuntimeError, match="inference_mode"):
            sp.attribute(x_inf)
    assert sp.attribute(x_inf, 0).shape == (1, 8, 8)  # an inference tensor is fine outside inference mode


def test_model_is_left_as_it_was(clf: Classifier) -> None:
    before = {name: "forward" in m.__dict__ for name, m in clf.named_modules()}
    relu = F.relu
    SemanticPullback(clf).attribute(torch.rand(1, 3, 8, 8, dtype=F64))
    assert {name: "forward" in m.__dict__ for name, m in clf.named_modules()} == before
    assert F.relu is relu and not any(p.requires_grad for p in clf.parameters())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(target=4), r"target classes must lie in \[0, 4\)"),
        (dict(target=[0, -1]), r"target classes must lie in \[0, 4\)"),
        (dict(target=[0, 1, 2]), "one entry per image"),
        (dict(target=torch.tensor([0.0, 1.0])), "integer class indices"),
        (dict(target=True), "integer class indices"),
        (dict(target="cat"), "target must be"),
        (dict(method="smooth"), "method must be one of"),
        (dict(reduce="median"), "reduce must be one of"),
        (dict(steps=0), "steps must be an integer >= 1"),
        (dict(alpha=-1.0), "alpha must be a positive"),
    ],
)
def test_argument_errors(clf: Classifier, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SemanticPullback(clf).attribute(torch.rand(2, 3, 8, 8, dtype=F64), **kwargs)


def test_input_and_config_errors(clf: Classifier) -> None:
    sp = SemanticPullback(clf)
    x = torch.rand(2, 3, 8, 8, dtype=F64)
    with pytest.raises(ValueError, match="x must have 4 dimensions"):
        sp.attribute(x[0])
    with pytest.raises(ValueError, match="x contains NaN"):
        sp.attribute(torch.where(x > 0.5, x, torch.nan))
    for bad, match in [
        (dict(relu_tau=0.0), "relu_tau"),
        (dict(maxpool_tau=float("inf")), "maxpool_tau"),
        (dict(steps=1.5), "steps"),
        (dict(alpha=0.0), "alpha"),
        (dict(clip=1), "clip must be a bool"),
    ]:
        with pytest.raises(ValueError, match=match):
            PullbackConfig(**bad)
    with pytest.raises(ValueError, match="PullbackConfig"):
        SemanticPullback(clf, config={"steps": 3})


def test_a_raw_model_in_training_mode_is_explained_in_eval_mode_and_left_as_it_was() -> None:
    """Issue #10.7: BatchNorm running statistics were updated and dropout ran during attribution."""
    torch.manual_seed(0)
    net = nn.Sequential(SmallNet(), nn.Dropout(0.5)).double()
    net.train()
    net[0].conv.eval()  # a mixed set of flags must come back exactly as it was
    flags = {name: m.training for name, m in net.named_modules()}
    state = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.rand(2, 3, 8, 8, dtype=F64)
    sp = SemanticPullback(net)
    maps = {method: sp.attribute(x, 1, method=method, steps=2) for method in ("soft", "ascent")}
    assert {name: m.training for name, m in net.named_modules()} == flags
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())  # incl. num_batches_tracked
    net.eval()
    for method, got in maps.items():  # the same maps as the model in eval mode: no dropout, affine BatchNorm
        torch.testing.assert_close(got, sp.attribute(x, 1, method=method, steps=2), **TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_images_of_another_dtype_are_cast_at_the_boundary(clf: Classifier, dtype: torch.dtype) -> None:
    """Issue #10.9: images whose dtype differed from the classifier's failed with torch's raw dtype error."""
    x = torch.rand(2, 3, 8, 8, dtype=F64)
    sp = SemanticPullback(clf)  # a float64 classifier
    for method in ("soft", "ascent"):
        got = sp.attribute(x.to(dtype), 1, method=method, steps=2)
        want = sp.attribute(x.to(dtype).to(F64), 1, method=method, steps=2)
        assert got.dtype == dtype  # the caller's dtype back
        torch.testing.assert_close(got, want.to(dtype))


def test_an_empty_batch_gives_an_empty_result(clf: Classifier) -> None:
    """Issue #10.10: an empty batch raised IndexError."""
    sp = SemanticPullback(clf)
    empty = torch.rand(0, 3, 8, 8, dtype=F64)
    for method in ("soft", "ascent"):
        assert sp.attribute(empty, method=method).shape == (0, 8, 8)
        assert sp.attribute(empty, 1, method=method, reduce=None).shape == (0, 3, 8, 8)
    with pytest.raises(ValueError, match="integer class indices"):
        sp.attribute(empty, 1.5)
