"""Training steps without signal: the per-step record fit keeps (what each step drew, its curves' spread, the
decoder's gradient norm), the flat-curve test, and ``AHAConfig.reference_draw``, which keeps a reference the
classifier scores like the image from flattening the curves."""

from __future__ import annotations

import json

import pytest
import torch

from attr_engine.aha import AHA, AHAConfig
from attr_engine.aha.loss import FLAT_SPREAD, flat_curves, soft_auc_loss
from attr_engine.aha.persistence import CONFIG_FILE
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


# ---------------------------------------------------------------------------------------------------------------
# reference_draw
# ---------------------------------------------------------------------------------------------------------------


def test_reference_draw_is_validated_and_defaults_to_one_per_step():
    assert AHAConfig().reference_draw == "step"
    with pytest.raises(ValueError, match="reference_draw"):
        AHAConfig(reference_draw="batch")


def test_drawing_per_image_or_by_signal_ends_the_flat_steps():
    """With the three references and one draw per step, the blur steps are flat (all but a curve or two); one draw
    per image leaves no step flat but keeps the flat curves; "signal" replaces the blur where it leaves a curve
    flat, so no curve is."""
    step = _fit(AHAConfig(**CHEAP), steps=8)
    blurred = [i for i, record in enumerate(step.steps) if record.reference[0] == KEEPS_THE_CLASS]
    assert blurred and all(step["flat_share"][i] >= 0.75 for i in blurred) and _flat_steps(step) > 0
    assert (
        max(step["grad_norm"][i] for i in blurred)
        < min(g for i, g in enumerate(step["grad_norm"]) if i not in blurred) / 20
    )
    image = _fit(AHAConfig(**CHEAP, reference_draw="image"), steps=8)
    assert _flat_steps(image) == 0 and sum(image["flat_share"]) > 0
    assert any(len(set(record.reference)) > 1 for record in image.steps)  # mixed within a step
    signal = _fit(AHAConfig(**CHEAP, reference_draw="signal"), steps=8)
    assert _flat_steps(signal) == 0 and sum(signal["flat_share"]) == 0
    assert all(KEEPS_THE_CLASS not in record.reference for record in signal.steps)


def test_signal_keeps_the_steps_reference_where_it_moves_the_curve():
    """Where the drawn reference carries signal, "signal" trains exactly as "step" does (the redraw has its own
    generator): same references, same losses up to the curves' ends coming from their own classifier pass."""
    step = _fit(AHAConfig(**CHEAP, references=(MOVES_IT, "mean")), steps=3)
    signal = _fit(AHAConfig(**CHEAP, references=(MOVES_IT, "mean"), reference_draw="signal"), steps=3)
    assert [r.reference for r in signal.steps] == [r.reference for r in step.steps]
    assert [r.grid for r in signal.steps] == [r.grid for r in step.steps]
    assert signal["loss"] == pytest.approx(step["loss"], abs=1e-4)


def test_drop_flat_averages_over_the_curves_with_signal_only():
    clf = colour_classifier()
    x, _ = colour_images(2)
    target = clf(x).argmax(dim=1)
    maps = torch.randn(2, 32, 32)
    kw = dict(grid=4, fractions=torch.linspace(0, 1, 5), tau=0.5, n_iters=10, noise=0.0)
    # Image 0 blends towards itself (flat), image 1 towards black.
    reference = torch.stack((x[0], torch.zeros_like(x[1])))
    mixed = soft_auc_loss(clf, x, maps, target, reference, **kw)
    dropped = soft_auc_loss(clf, x, maps, target, reference, drop_flat=True, **kw)
    assert flat_curves(mixed.deletion_curve, mixed.insertion_curve).tolist() == [True, False]
    assert float(mixed.loss) == pytest.approx(float(1 + (mixed.deletion - mixed.insertion).mean()), abs=1e-6)
    assert float(dropped.loss) == pytest.approx(float(1 + mixed.deletion[1] - mixed.insertion[1]), abs=1e-6)
    # No flat curve: the same loss.
    black = torch.zeros_like(x)
    plain = soft_auc_loss(clf, x, maps, target, black, **kw)
    assert float(soft_auc_loss(clf, x, maps, target, black, drop_flat=True, **kw).loss) == pytest.approx(
        float(plain.loss), abs=1e-6
    )


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------------------


class _Crashing(torch.utils.data.Dataset):
    """The colour images, raising (a crash) once more than ``reads`` items were read."""

    def __init__(self, reads: int | None = None) -> None:
        self.x, self.y = colour_images(8)
        self.left = reads

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.left is not None:
            if self.left == 0:
                raise KeyboardInterrupt("simulated interruption")
            self.left -= 1
        return self.x[i], int(self.y[i])


def test_a_checkpoint_keeps_the_draw_and_resumes_exactly(tmp_path):
    config = AHAConfig(**CHEAP, reference_draw="signal")
    whole = AHA(colour_classifier(), config)
    uninterrupted = whole.fit(_Crashing(), batch_size=4, epochs=2, progress=False)  # 2 steps an epoch, 4 in all

    crashed = AHA(colour_classifier(), config)
    with pytest.raises(KeyboardInterrupt):  # during step 4: the checkpoint after step 2 is the last
        crashed.fit(_Crashing(reads=13), batch_size=4, epochs=2, progress=False, checkpoint_dir=tmp_path,
                    checkpoint_every=2)  # fmt: skip
    assert AHA.load(tmp_path, colour_classifier()).config.reference_draw == "signal"
    one_per_step = AHA(colour_classifier(), AHAConfig(**CHEAP))
    with pytest.raises(ValueError, match="different AHAConfig"):
        one_per_step.fit(_Crashing(), batch_size=4, epochs=2, progress=False, resume=tmp_path)
    resumed = AHA(colour_classifier(), config)
    history = resumed.fit(_Crashing(), batch_size=4, epochs=2, progress=False, resume=tmp_path)
    assert [record.step for record in history.steps] == [2, 3]
    # Step 3's blur draw leaves its curves flat, so they draw again (black or the mean colour, mixed): the same
    # draws as uninterrupted, from the generator the checkpoint keeps.
    assert len(set(history.steps[1].reference)) > 1
    assert [r.reference for r in history.steps] == [r.reference for r in uninterrupted.steps[2:]]
    for key, value in whole.decoder.state_dict().items():
        torch.testing.assert_close(resumed.decoder.state_dict()[key], value, atol=0, rtol=0, msg=key)


def test_a_checkpoint_from_before_the_option_loads_as_one_draw_per_step(tmp_path):
    aha = AHA(colour_classifier(), AHAConfig(**CHEAP))
    aha.save(tmp_path)
    meta = json.loads((tmp_path / CONFIG_FILE).read_text())
    del meta["config"]["reference_draw"]
    (tmp_path / CONFIG_FILE).write_text(json.dumps(meta))
    assert AHA.load(tmp_path, colour_classifier()).config.reference_draw == "step"
