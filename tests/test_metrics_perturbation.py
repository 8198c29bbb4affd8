"""deletion_insertion against closed-form curves of a linear classifier, plus protocol, chunking and input checks.

The linear classifier scores class 0 with logit ``sum(w * z)`` on the normalised image z = (x - mean) / std and
class 1 with 0, so its class-0 probability is sigmoid(sum over pixels of w * z). A pixel moved to the mean colour
has z = 0 and drops out of the sum, which gives every point of an AHA curve in closed form.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from attr_engine.classifier import Classifier
from attr_engine.classifier_training import small_model_config
from attr_engine.imageops import gaussian_blur, scaled_blur
from attr_engine.metrics.perturbation import deletion_insertion, perturbation_counts, pixel_ranks
from tests.conftest import requires_cuda

MEAN = (0.5, 0.4, 0.3)
STD = (0.25, 0.2, 0.5)
H = W = 4
N = H * W


class LinearTwoClass(nn.Module):
    """logits = [sum(weight * z), 0] for normalised input z (B, 3, H, W)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        score = (z * self.weight).sum(dim=(1, 2, 3))
        return torch.stack([score, torch.zeros_like(score)], dim=1)


def linear_classifier(weight: torch.Tensor) -> Classifier:
    return Classifier(LinearTwoClass(weight), MEAN, STD)


def small_convnet(num_classes: int = 3) -> Classifier:
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(24, num_classes)
    )
    return Classifier(model, MEAN, STD)


def sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def trapezoid(curve: list[float], steps: int) -> float:
    return sum((a + b) / 2 for a, b in itertools.pairwise(curve)) / steps


@pytest.fixture
def linear_case() -> tuple[Classifier, torch.Tensor, torch.Tensor, list[int], torch.Tensor]:
    """A linear classifier, one image, a map with a known pixel order (most important first), per-pixel terms."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(1, 3, H, W, generator=gen)
    x = torch.rand(1, 3, H, W, generator=gen)
    order = torch.randperm(N, generator=gen).tolist()
    maps = torch.empty(N)
    for position, pixel in enumerate(order):
        maps[pixel] = float(N - position)  # distinct scores: rank = position in `order`
    z = (x.double() - torch.tensor(MEAN, dtype=torch.float64).view(1, 3, 1, 1)) / torch.tensor(
        STD, dtype=torch.float64
    ).view(1, 3, 1, 1)
    terms = (z * weight.double()).sum(dim=1).flatten()  # each pixel's share of the class-0 logit
    return linear_classifier(weight), x, maps.view(1, H, W), order, terms


def test_perturbation_counts_round_half_up_and_cover_the_image() -> None:
    assert perturbation_counts(16, 5) == [0, 3, 6, 10, 13, 16]
    assert perturbation_counts(6, 4) == [0, 2, 3, 5, 6]  # 1.5 -> 2 and 4.5 -> 5 (not banker's 4)
    assert perturbation_counts(224 * 224, 20)[1] == round(0.05 * 224 * 224)


def test_pixel_ranks_break_ties_by_pixel_index() -> None:
    maps = torch.tensor([[[1.0, 3.0, 3.0], [0.0, 3.0, 1.0]]])
    assert pixel_ranks(maps).tolist() == [[3, 0, 1, 5, 2, 4]]
    # -0.0 and 0.0 are one tie, in index order, whatever the sort's treatment of the sign bit.
    signed_zeros = torch.tensor([[[-1.0, 0.0, -0.0, 0.0, -0.0, -2.0]]])
    assert pixel_ranks(signed_zeros).tolist() == [[4, 0, 1, 2, 3, 5]]


@pytest.mark.parametrize("steps", [5, 1, 16])
def test_aha_curves_match_closed_form(linear_case, steps: int) -> None:
    classifier, x, maps, order, terms = linear_case
    counts = perturbation_counts(N, steps)
    # Deletion: the first n pixels of `order` sit at the mean colour (z = 0), so their terms vanish.
    deletion = [sigmoid(float(terms[order[n:]].sum())) for n in counts]
    # Insertion (AHA): the n least important pixels are deleted first.
    insertion = [sigmoid(float(terms[order[: N - n]].sum())) for n in counts]

    result = deletion_insertion(classifier, x, maps, target=0, steps=steps)

    torch.testing.assert_close(result.fractions, torch.arange(steps + 1) / steps, atol=0, rtol=0)
    torch.testing.assert_close(result.deletion_curve[0], torch.tensor(deletion), atol=1e-5, rtol=0)
    torch.testing.assert_close(result.insertion_curve[0], torch.tensor(insertion), atol=1e-5, rtol=0)
    assert result.deletion.shape == result.insertion.shape == (1,)
    assert result.deletion.item() == pytest.approx(trapezoid(deletion, steps), abs=1e-5)
    assert result.insertion.item() == pytest.approx(trapezoid(insertion, steps), abs=1e-5)
    # Both AHA curves run from the clean image to the reference (here: every term gone, logit 0).
    assert deletion[0] == insertion[0] and deletion[-1] == insertion[-1] == 0.5


def test_faithful_map_beats_reversed_map(linear_case) -> None:
    classifier, x, _, _, terms = linear_case
    # The class-0 evidence of each pixel is a faithful map for class 0; its negation ranks pixels backwards.
    faithful = terms.float().view(1, H, W)
    good = deletion_insertion(classifier, x, faithful, target=0, steps=8)
    bad = deletion_insertion(classifier, x, -faithful, target=0, steps=8)
    assert good.deletion.item() < bad.deletion.item() - 0.05
    assert good.insertion.item() > bad.insertion.item() + 0.05
    # Reversing the map swaps the AHA curves (no ties in the map, so the orders are exact reverses).
    torch.testing.assert_close(good.deletion_curve, bad.insertion_curve)


def test_constant_map_removes_pixels_in_index_order() -> None:
    weight = torch.zeros(1, 3, H, W)
    weight[0, 0].view(-1)[:4] = 1.0  # only the first four pixels (row 0) carry evidence
    classifier = linear_classifier(weight)
    x = torch.ones(1, 3, H, W)  # red z = (1 - 0.5) / 0.25 = 2 per pixel
    result = deletion_insertion(classifier, x, torch.zeros(1, H, W), target=0, steps=4)
    # Ties go by pixel index for both curves (insertion ranks -map, also constant): identical curves.
    expected = [sigmoid(2.0 * max(0, 4 - n)) for n in perturbation_counts(N, 4)]
    torch.testing.assert_close(result.deletion_curve[0], torch.tensor(expected), atol=1e-5, rtol=0)
    torch.testing.assert_close(result.insertion_curve, result.deletion_curve, atol=0, rtol=0)


def test_rise_protocol_substrate_and_blurred_start() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.rand(2, 3, 12, 12, generator=gen)
    weight = torch.randn(1, 3, 12, 12, generator=gen)
    classifier = linear_classifier(weight)
    maps = torch.randn(2, 12, 12, generator=gen)
    steps = 6
    result = deletion_insertion(classifier, x, maps, target=0, steps=steps, protocol="rise")

    def prob(images: torch.Tensor) -> torch.Tensor:
        return classifier(images).softmax(dim=1)[:, 0]

    substrate = classifier.norm_mean.expand_as(x)
    torch.testing.assert_close(classifier.normalize(substrate), torch.zeros_like(x))  # zero in normalised space
    blurred = gaussian_blur(x, 11, 5.0)
    torch.testing.assert_close(result.deletion_curve[:, 0], prob(x), atol=1e-6, rtol=0)
    torch.testing.assert_close(result.deletion_curve[:, -1], prob(substrate), atol=1e-6, rtol=0)
    torch.testing.assert_close(result.insertion_curve[:, 0], prob(blurred), atol=1e-6, rtol=0)
    torch.testing.assert_close(result.insertion_curve[:, -1], prob(x), atol=1e-6, rtol=0)
    # Interior insertion points: the top-n pixels of each map copied from x into the blurred image, built by hand.
    for k, n in enumerate(perturbation_counts(144, steps)):
        images = blurred.clone()
        for b in range(2):
            top = torch.argsort(maps[b].flatten(), descending=True)[:n]  # no ties in a random map
            images[b].view(3, -1)[:, top] = x[b].view(3, -1)[:, top]
        torch.testing.assert_close(result.insertion_curve[:, k], prob(images), atol=1e-6, rtol=0)
    # Deletion is the same for both protocols (same mean-colour substrate); insertion differs.
    aha = deletion_insertion(classifier, x, maps, target=0, steps=steps, protocol="aha")
    torch.testing.assert_close(aha.deletion_curve, result.deletion_curve, atol=1e-6, rtol=0)
    assert not torch.allclose(aha.insertion_curve, result.insertion_curve, atol=1e-3)


def test_reference_kinds_set_the_deletion_end_point() -> None:
    classifier = small_convnet()
    x = torch.rand(2, 3, 10, 10)
    maps = torch.randn(2, 10, 10)

    def prob(images: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return classifier(images).softmax(dim=1).gather(1, target[:, None])[:, 0]

    custom = torch.rand(3, 10, 10)
    kernel, sigma = scaled_blur(10)
    ends = {
        "black": torch.zeros_like(x),
        "mean": classifier.norm_mean.expand_as(x),
        "blur": gaussian_blur(x, kernel, sigma),
    }
    for reference, end in [*ends.items(), (custom, custom.expand_as(x))]:
        result = deletion_insertion(classifier, x, maps, steps=3, reference=reference)
        torch.testing.assert_close(result.deletion_curve[:, -1], prob(end, result.target), atol=1e-6, rtol=0)
        torch.testing.assert_close(result.insertion_curve[:, -1], prob(end, result.target), atol=1e-6, rtol=0)
        torch.testing.assert_close(result.deletion_curve[:, 0], prob(x, result.target), atol=1e-6, rtol=0)


def test_chunking_does_not_change_results() -> None:
    classifier = small_convnet()
    x = torch.rand(3, 3, 8, 8)
    maps = torch.randn(3, 8, 8)
    for protocol in ("aha", "rise"):
        runs = [
            deletion_insertion(classifier, x, maps, steps=7, protocol=protocol, batch_size=size)
            for size in (1, 5, 1000)
        ]
        for other in runs[1:]:
            for field in ("deletion_curve", "insertion_curve", "deletion", "insertion"):
                torch.testing.assert_close(getattr(other, field), getattr(runs[0], field), atol=1e-6, rtol=0)


def test_target_none_int_and_tensor() -> None:
    weight = torch.zeros(1, 3, H, W)
    weight[:, 0] = 0.1
    classifier = linear_classifier(weight)
    x = torch.rand(4, 3, H, W)
    x[:, 0] = torch.tensor([0.9, 0.1, 0.2, 0.8]).view(4, 1, 1)  # red above the mean -> class 0, below -> class 1
    maps = torch.randn(4, H, W)
    probs = classifier(x).softmax(dim=1)
    assert probs.argmax(dim=1).tolist() == [0, 1, 1, 0]

    result = deletion_insertion(classifier, x, maps, steps=2)
    assert result.target.tolist() == [0, 1, 1, 0]
    torch.testing.assert_close(result.deletion_curve[:, 0], probs.max(dim=1).values, atol=1e-6, rtol=0)

    as_int = deletion_insertion(classifier, x, maps, target=1, steps=2)
    torch.testing.assert_close(as_int.deletion_curve[:, 0], probs[:, 1], atol=1e-6, rtol=0)
    as_tensor = deletion_insertion(classifier, x, maps, target=torch.tensor([0, 1, 1, 0]), steps=2)
    torch.testing.assert_close(as_tensor.deletion_curve, result.deletion_curve, atol=0, rtol=0)


def test_channel_maps_are_summed() -> None:
    classifier = small_convnet()
    x = torch.rand(2, 3, 6, 6)
    channel_maps = torch.randn(2, 3, 6, 6)
    summed = deletion_insertion(classifier, x, channel_maps.sum(dim=1), steps=4)
    direct = deletion_insertion(classifier, x, channel_maps, steps=4)
    torch.testing.assert_close(direct.deletion_curve, summed.deletion_curve, atol=0, rtol=0)
    torch.testing.assert_close(direct.insertion_curve, summed.insertion_curve, atol=0, rtol=0)


def test_runs_on_a_small_timm_model() -> None:
    classifier = small_model_config("resnet", img_size=32).build(num_classes=4)
    x = torch.rand(2, 3, 32, 32)
    result = deletion_insertion(classifier, x, torch.randn(2, 32, 32), steps=4, batch_size=4)
    assert result.deletion_curve.shape == result.insertion_curve.shape == (2, 5)
    assert bool(((result.deletion_curve >= 0) & (result.deletion_curve <= 1)).all())
    assert bool(((result.deletion >= 0) & (result.deletion <= 1)).all())
    torch.testing.assert_close(result.deletion_curve[:, 0], result.insertion_curve[:, 0], atol=0, rtol=0)


@requires_cuda
def test_cuda_matches_cpu() -> None:
    # CUDA sorts floats by bit pattern (radix sort): signed zeros must still tie, and curves must match the CPU's.
    signed_zeros = torch.tensor([[[-1.0, 0.0, -0.0, 0.0, -0.0, -2.0]]], device="cuda")
    assert pixel_ranks(signed_zeros).tolist() == [[4, 0, 1, 2, 3, 5]]
    classifier = linear_classifier(torch.randn(1, 3, 8, 8))  # no convolution: no TF32 rounding on the GPU
    x = torch.rand(3, 3, 8, 8)
    maps = torch.randn(3, 8, 8).round()  # many ties, and both 0.0 and -0.0
    for protocol in ("aha", "rise"):
        cpu = deletion_insertion(classifier, x, maps, steps=7, protocol=protocol)
        # cuDNN off: its TF32 convolutions would round RISE's blur far above the tolerance.
        with torch.backends.cudnn.flags(enabled=False):
            gpu = deletion_insertion(classifier.cuda(), x.cuda(), maps.cuda(), steps=7, protocol=protocol, batch_size=5)
        classifier.cpu()
        for field in ("deletion_curve", "insertion_curve", "target"):
            torch.testing.assert_close(getattr(gpu, field).cpu(), getattr(cpu, field), atol=1e-5, rtol=0)


def _bad_cases() -> list[tuple[dict, str]]:
    nan_maps = torch.randn(2, 4, 4)
    nan_maps[1, 2, 3] = float("nan")
    nan_x = torch.rand(2, 3, 4, 4)
    nan_x[0, 1, 0, 0] = float("nan")
    return [
        ({"maps": nan_maps}, "maps"),
        ({"x": nan_x}, "x contains NaN"),
        ({"maps": torch.randn(2, 4, 5)}, "maps"),
        ({"maps": torch.randn(4, 4)}, "maps"),
        ({"maps": torch.randn(3, 4, 4)}, "maps"),
        ({"x": torch.rand(2, 1, 4, 4), "maps": torch.randn(2, 4, 4)}, "RGB"),
        ({"steps": 0}, "steps"),
        ({"batch_size": 0}, "batch_size"),
        ({"protocol": "lime"}, "protocol"),
        ({"reference": "gray"}, "reference"),
        ({"reference": torch.rand(3, 5, 4)}, "reference"),
        ({"reference": torch.full((3, 4, 4), float("nan"))}, "reference"),
        ({"target": 2}, "target"),
        ({"target": -1}, "target"),
        ({"target": torch.tensor([0, 5])}, "target"),
        ({"target": torch.tensor([0.0, 1.0])}, "target"),
        ({"target": torch.tensor([0, 1, 1])}, "target"),
        ({"classifier": nn.Linear(3, 2)}, "classifier"),
    ]


@pytest.mark.parametrize(("override", "message"), _bad_cases())
def test_bad_inputs_raise(override: dict, message: str) -> None:
    args = {
        "classifier": linear_classifier(torch.randn(1, 3, 4, 4)),
        "x": torch.rand(2, 3, 4, 4),
        "maps": torch.randn(2, 4, 4),
    }
    kwargs = {k: v for k, v in override.items() if k not in args}
    args.update({k: v for k, v in override.items() if k in args})
    with pytest.raises(ValueError, match=message):
        deletion_insertion(args["classifier"], args["x"], args["maps"], **kwargs)
