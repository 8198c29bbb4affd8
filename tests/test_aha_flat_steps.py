"""Training steps without signal: the per-step record fit keeps (what each step drew, its curves' spread, the
decoder's gradient norm) and the flat-curve test."""

from __future__ import annotations

import pytest
import torch

from attr_engine.aha import AHA, AHAConfig
from attr_engine.aha.loss import FLAT_SPREAD, flat_curves
from attr_engine.aha.trainer import History, StepRecord
from attr_engine.classifier import Classifier
from tests.aha_helpers import FAST, ColourNet, colour_classifier, colour_images

# The colour classifier's evidence is the image's mean of (red - green), which a Gaussian blur keeps: blended towards
# its blur, an image keeps its class and its probability, so every curve of a "blur" step is flat. Black (and the
# identity normalisation's mean colour, also black) takes the evidence to 0, both probabilities to 1/2.
KEEPS_THE_CLASS, MOVES_IT = "blur", "black"
# The AHA tests' smallest config, cheaper still: one target and 4 fractions.
CHEAP = {**FAST, "targets": "pred", "n_fractions": 4}


class _Blind(ColourNet):
    """The colour classifier's features with logits that ignore the image: fixed logits plus 0 times its evidence
    (so the graph still reaches the blends, and their gradient is exactly zero)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        evidence = self._evidence(x).mean(dim=(1, 2, 3))[:, None]
        return torch.tensor([1.5, -0.5]) + 0.0 * evidence


def _data(n: int = 8) -> torch.utils.data.TensorDataset:
    x, y = colour_images(n)
    return torch.utils.data.TensorDataset(x, y)


def _fit(config: AHAConfig, steps: int = 6, classifier: Classifier | None = None) -> History:
    aha = AHA(classifier or colour_classifier(), config)
    return aha.fit(_data(), batch_size=4, epochs=10, max_steps=steps, progress=False)


def _flat_steps(history: History) -> int:
    return sum(record.flat_share == 1.0 for record in history.steps)


# ---------------------------------------------------------------------------------------------------------------
# The record
# ---------------------------------------------------------------------------------------------------------------


def test_fit_keeps_a_record_of_each_step():
    config = AHAConfig(**FAST, fraction_sampling="random")
    history = _fit(config, steps=4)
    assert isinstance(history, dict) and len(history.steps) == 4
    for key in ("grid", "flat_share", "grad_norm"):
        assert len(history[key]) == 4
    lo, hi = config.grid_range  # type: ignore[misc]
    for i, record in enumerate(history.steps):
        assert isinstance(record, StepRecord) and record.step == i
        curves = 2 * 4  # "pred+label": two targets for each of the 4 images
        assert len(record.reference) == curves and set(record.reference) <= set(config.references)
        assert len(set(record.reference)) == 1  # "step": one reference for the whole step
        assert lo <= record.grid <= hi and len(record.offset) == 2
        assert len(record.fractions) == config.n_fractions and record.fractions[0] == 0 and record.fractions[-1] == 1
        assert record.images is not None and len(record.images) == 4 and set(record.images) <= set(range(8))
        assert len(record.targets) == curves and all(t in (0, 1) for t in record.targets)
        for values in (record.p_image, record.p_reference, record.deletion_spread, record.insertion_spread):
            assert len(values) == curves and all(0.0 <= v <= 1.0 for v in values)
        assert len(record.flat) == curves and record.grad_norm > 0
        assert history["grid"][i] == record.grid and history["flat_share"][i] == record.flat_share
        assert history["grad_norm"][i] == record.grad_norm
    # An epoch draws each image once.
    assert sorted(history.steps[0].images + history.steps[1].images) == list(range(8))  # type: ignore[operator]


def test_a_dataloader_leaves_the_images_unknown():
    loader = torch.utils.data.DataLoader(_data(), batch_size=4)
    history = AHA(colour_classifier(), AHAConfig(**CHEAP)).fit(loader, max_steps=2, progress=False)
    assert [record.images for record in history.steps] == [None, None]


# ---------------------------------------------------------------------------------------------------------------
# Flat steps
# ---------------------------------------------------------------------------------------------------------------


def test_a_classifier_that_ignores_the_image_makes_every_step_flat():
    """Every blend scores like the image: deletion = insertion = p for each curve, so the loss is exactly 1 and
    nothing reaches the decoder."""
    blind = Classifier(_Blind(), mean=(0.0,) * 3, std=(1.0,) * 3, input_size=(3, 32, 32))
    history = _fit(AHAConfig(**CHEAP, peak_weight=0.0), steps=2, classifier=blind)
    assert _flat_steps(history) == 2 and history["flat_share"] == [1.0, 1.0]
    assert history["loss"] == pytest.approx([1.0] * 2, abs=1e-6)
    assert history["grad_norm"] == [0.0, 0.0]
    for record in history.steps:
        assert max(record.deletion_spread + record.insertion_spread) < 1e-6
        assert record.p_image == pytest.approx(record.p_reference)


def test_a_reference_that_keeps_the_class_makes_the_step_flat():
    """The flat steps logged as loss 1.000, deletion 0.500, insertion 0.500: a 2-class classifier explaining both
    classes, so each image's two curves add up to 1, against a reference that keeps the class."""
    flat = _fit(AHAConfig(**FAST, references=(KEEPS_THE_CLASS,)), steps=3)
    assert _flat_steps(flat) == 3
    assert flat["loss"] == pytest.approx([1.0] * 3, abs=2 * FLAT_SPREAD)
    assert flat["deletion"] == pytest.approx([0.5] * 3, abs=1e-3)
    assert flat["insertion"] == pytest.approx([0.5] * 3, abs=1e-3)
    for record in flat.steps:
        assert record.p_image == pytest.approx(record.p_reference, abs=FLAT_SPREAD)
    moving = _fit(AHAConfig(**FAST, references=(MOVES_IT,)), steps=2)
    assert _flat_steps(moving) == 0 and sum(moving["flat_share"]) == 0
    assert min(moving["grad_norm"]) > 20 * max(flat["grad_norm"])


def test_flat_curves_need_both_curves_within_the_spread():
    still = torch.full((1, 5), 0.7)
    moving = torch.tensor([[0.7, 0.5, 0.3, 0.2, 0.1]])
    assert flat_curves(still, still).tolist() == [True]
    assert flat_curves(still, moving).tolist() == [False]
    assert flat_curves(still + torch.tensor([[0.0, FLAT_SPREAD / 2, 0.0, 0.0, 0.0]]), still).tolist() == [True]
