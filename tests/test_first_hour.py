"""A practitioner's first hour (issue #33): Captum's call order, Quantus' perturbations without a false range
warning, the Python leaderboard like the CLI's, a classifier at chance said out loud, a demo without the extras."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from captum.attr import IntegratedGradients as CaptumIG

from attr_engine import explainer as registry
from attr_engine.adapters import CaptumAdapter, quantus_explain_func
from attr_engine.explainer import get_explainer
from tests.eval_helpers import images, single_thread, tiny_convnet


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


# ---------------------------------------------------------------------------------------------------------------
# Captum's call order
# ---------------------------------------------------------------------------------------------------------------


def test_integrated_gradients_takes_captums_positional_order() -> None:
    """Captum's ``IntegratedGradients.attribute(inputs, baselines, target)`` copied as is gives Captum's result."""
    clf = tiny_convnet()
    x, t = images(2, 16), torch.tensor([1, 3])
    ig = get_explainer("integrated-gradients", clf, n_steps=8)
    ref = CaptumIG(clf).attribute(x.clone().requires_grad_(True), torch.zeros_like(x), t, n_steps=8).detach()
    ours = ig.attribute(x, torch.zeros_like(x), t, reduce=None)  # Captum's order, Captum's input-shaped result
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-6)
    # attr-engine's order and keywords give the same; a float number is a baseline, the int after it the target
    torch.testing.assert_close(ig.attribute(x, t, torch.zeros_like(x), reduce=None), ours)
    torch.testing.assert_close(ig.attribute(x, target=t, baselines=0.0, reduce=None), ours)
    torch.testing.assert_close(ig.attribute(x, 0.0, 3), ig.attribute(x, 3, 0.0))
    torch.testing.assert_close(ig.attribute(x, "black", t), ig.attribute(x, t, baselines="black"))
    # a baseline alone in the target's place explains the predicted class, as in Captum with target=None
    torch.testing.assert_close(ig.attribute(x, 0.0), ig.attribute(x, None, 0.0))


def test_captum_order_refuses_what_it_cannot_tell_apart() -> None:
    ig = get_explainer("integrated-gradients", tiny_convnet(), n_steps=4)
    x = images(2, 16)
    with pytest.raises(ValueError, match=r"order is attribute\(inputs, target, baselines\) or Captum's"):
        ig.attribute(x, 0.0, torch.zeros_like(x))  # two baselines
    with pytest.raises(ValueError, match=r"baselines=3 is an integer outside .* pass target= by keyword"):
        ig.attribute(x, 0, 3)  # Captum's order with an integer baseline: 3 is the class
    # Captum's Saliency takes (inputs, target): a method without a baseline reads no baseline in the target's place
    saliency = get_explainer("saliency", ig.classifier)
    with pytest.raises(ValueError, match=r"target must hold integer class indices, got dtype torch\.float32"):
        saliency.attribute(x, torch.zeros_like(x))
    with pytest.raises(ValueError, match="saliency takes no baselines"):
        saliency.attribute(x, torch.zeros_like(x), 1)


def test_the_captum_adapter_takes_captums_order_too() -> None:
    clf = tiny_convnet()
    x, t = images(2, 16), torch.tensor([0, 2])
    adapter = CaptumAdapter(get_explainer("integrated-gradients", clf, n_steps=4))
    torch.testing.assert_close(adapter.attribute(x, torch.zeros_like(x), t), adapter.attribute(x, t, 0.0))


# ---------------------------------------------------------------------------------------------------------------
# Quantus' perturbations are not the user's images
# ---------------------------------------------------------------------------------------------------------------


def test_no_range_warning_under_quantus_max_sensitivity(monkeypatch: pytest.MonkeyPatch) -> None:
    """MaxSensitivity's own uniform noise (radius 0.2) pushes [0, 1] images to 1.2: no ImageRangeWarning for
    those, with or without a precomputed a_batch (then Quantus' first call is already perturbed); 0..255 and
    normalised images handed to Quantus still get it."""
    import quantus

    monkeypatch.setattr(registry, "_range_warned", False)
    clf = tiny_convnet()
    x = images(4, 16).clamp(0.85, 1.0)  # bright images: the noise overshoots 1.1 for sure
    y = clf(x).argmax(1)
    metric = quantus.MaxSensitivity(nr_samples=3, lower_bound=0.2, disable_warnings=True)
    seen = []
    f = quantus_explain_func(get_explainer("saliency", clf))

    def spy(model, inputs, targets, **kwargs):
        seen.append(float(np.max(inputs)))
        return f(model, inputs, targets, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("error", registry.ImageRangeWarning)
        for a_batch in (None, f(clf, x.numpy(), y.numpy())):
            scores = metric(model=clf, x_batch=x.numpy(), y_batch=y.numpy(), a_batch=a_batch, explain_func=spy)
            assert len(scores) == 4
    assert max(seen) > registry.RANGE_WARNING_ABOVE  # the noise did overshoot
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    dark = images(4, 16) * 0.5  # normalised, its brightest pixels (0.4) pass; its darkest (-2.1) do not
    for wrong, message in ((x * 255, "reach 2"), ((dark - mean[:, None, None]) / std[:, None, None], "go down to -")):
        monkeypatch.setattr(registry, "_range_warned", False)
        with pytest.warns(registry.ImageRangeWarning, match=f"the images {message}"):
            f(clf, wrong.numpy(), y.numpy())


# ---------------------------------------------------------------------------------------------------------------
# The Python leaderboard behaves like the CLI's, and writes itself
# ---------------------------------------------------------------------------------------------------------------


def _trained_enough(num_classes: int = 3):
    """A linear classifier whose classes the labels follow (its own predictions): far from chance."""
    from tests.eval_helpers import linear_classifier

    clf = linear_classifier(num_classes=num_classes, size=8)
    x = images(12, 8)
    with torch.no_grad():
        labels = clf(x).argmax(1)
    return clf, x, labels


def test_python_evaluate_drops_mask_metrics_like_the_cli() -> None:
    """The CLI's default metrics leave the pointing game out on data without masks; so does evaluate's default
    set now (with one warning), where it raised. Asking for it by name still refuses, in both."""
    from attr_engine.evaluate import DEFAULT_METRICS, evaluate

    clf, x, labels = _trained_enough()
    with pytest.warns(UserWarning, match="no object masks: pointing_game left out of the default metrics"):
        board = evaluate(clf, ["gradient"], (x, labels), metrics=DEFAULT_METRICS, batch_size=12)
    assert board.metrics == [m for m in DEFAULT_METRICS if m != "pointing_game"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        masks = torch.zeros(12, 8, 8, dtype=torch.bool)
        masks[:, 2:6, 2:6] = True
        with_masks = evaluate(clf, ["gradient"], (x, labels, masks), metrics=["deletion", "pointing_game"])
    assert with_masks.metrics == ["deletion", "pointing_game"]
    with pytest.raises(ValueError, match=r"pointing_game need object masks: pass data as \(x, labels, masks\)"):
        evaluate(clf, ["gradient"], (x, labels), metrics=["deletion", "pointing_game"])


def test_leaderboard_writes_markdown_and_csv(tmp_path) -> None:
    import csv

    from attr_engine.evaluate import evaluate
    from attr_engine.report import leaderboard_markdown, write_leaderboard_csv

    clf, x, labels = _trained_enough()
    board = evaluate(clf, ["gradient", "pullback-soft"], (x, labels), metrics=["deletion", "insertion"])
    text = board.to_markdown()
    assert text.startswith("| method | ranked by | deletion ↓ | insertion ↑ | ms/image ↓ |")
    assert text == leaderboard_markdown(board) and text.count("**") >= 6  # three best cells
    # the notes under the table in the user's words: no file of another project, no tensor shapes
    note = next(n for n in board.notes if n.startswith("pullback-soft:"))
    assert "mean absolute value of its colour channels" in text and note in text
    assert "lib/" not in text and "(B, C, H, W)" not in text and ".py" not in text
    path = tmp_path / "deep" / "board.csv"
    csv_text = board.to_csv(path)
    assert path.open(encoding="utf-8", newline="").read() == csv_text
    rows = list(csv.DictReader(path.open(newline="")))
    assert [r["method"] for r in rows] == ["gradient", "pullback-soft"]
    assert float(rows[0]["deletion"]) == board.rows[0]["deletion"]  # full precision
    assert write_leaderboard_csv(board, tmp_path / "b.csv").open(newline="").read() == csv_text


# ---------------------------------------------------------------------------------------------------------------
# A classifier at chance is said out loud
# ---------------------------------------------------------------------------------------------------------------


def test_a_classifier_at_chance_warns_and_notes_it() -> None:
    from attr_engine.evaluate import ChanceLevelWarning, chance_level, evaluate

    clf, x, labels = _trained_enough()
    wrong = (labels + 1) % 3  # labels the classifier never predicts: 0 % accuracy
    with pytest.warns(ChanceLevelWarning, match=r"accuracy on these 12 labelled images is 0\.0%, chance is 33\.3%"):
        board = evaluate(clf, ["gradient"], (x, wrong), metrics=["deletion"])
    assert any(n.startswith("The classifier's accuracy on these 12 labelled images") for n in board.notes)
    assert board.to_markdown().count("chance is 33.3%") == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", ChanceLevelWarning)  # right labels: no word
        assert not any("chance" in n for n in evaluate(clf, ["gradient"], (x, labels), metrics=["deletion"]).notes)
    # the threshold: within two standard errors of chance warns, clearly above does not
    logits = torch.eye(5)[torch.arange(100) % 5] * 5
    truth = torch.arange(100) % 5
    assert chance_level(logits, truth) is None
    assert chance_level(logits, torch.where(torch.arange(100) < 25, truth, (truth + 1) % 5)) is not None  # 25 %
    assert chance_level(logits, torch.where(torch.arange(100) < 45, truth, (truth + 1) % 5)) is None  # 45 %
    # without labels: near-uniform predictions
    assert "mean confidence" in chance_level(torch.zeros(4, 10) + 0.01 * torch.randn(4, 10))
    assert chance_level(logits[:4]) is None


def test_cli_evaluate_on_a_folder_leaves_the_pointing_game_out_like_python(tmp_path, capsys) -> None:
    """The CLI half of the agreement: an image folder has no masks; the default metrics leave the pointing game
    out, and asking for it is refused in one line with exit status 2."""
    from PIL import Image

    from attr_engine.cli import main
    from tests.eval_helpers import untrained_resnet_checkpoint

    checkpoint = untrained_resnet_checkpoint(tmp_path / "clf")
    gen = np.random.default_rng(0)
    for k in range(4):
        (tmp_path / "imgs" / f"c{k % 2}").mkdir(parents=True, exist_ok=True)
        Image.fromarray((gen.random((36, 40, 3)) * 255).astype(np.uint8)).save(
            tmp_path / "imgs" / f"c{k % 2}" / f"{k}.png"
        )
    args = ["evaluate", "--classifier", str(checkpoint), "--data", str(tmp_path / "imgs"), "--num-images", "4",
            "--methods", "gradient", "--no-progress", "--img-size", "32"]  # fmt: skip
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "deletion" in table and "pointing_game" not in table
    assert main([*args, "--metrics", "deletion,pointing_game"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pointing-game metrics need object masks" in err[0]
