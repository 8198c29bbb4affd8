"""AHA training with a validation set: the hard score, early stopping, the best weights, resuming, the CLI flag."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import attr_engine.aha.trainer as trainer
from attr_engine.aha import AHA, AHAConfig
from attr_engine.aha.persistence import BEST_FILE
from attr_engine.aha.validation import EarlyStopping, score_validation
from attr_engine.cli import main
from attr_engine.data.split import holdout_split
from attr_engine.metrics import deletion_insertion
from tests.aha_helpers import colour_classifier, colour_images
from tests.eval_helpers import untrained_resnet_checkpoint
from tests.test_aha import FAST, _Pairs, _weights

CPU = torch.device("cpu")


def _scripted(monkeypatch, composite_at: dict[int, float]) -> dict[int, dict[str, torch.Tensor]]:
    """Replace the validation score by ``composite_at[step]`` and return the decoder weights seen at each score."""
    seen: dict[int, dict[str, torch.Tensor]] = {}

    def score(aha, val, **_):
        step = aha.steps_trained
        seen[step] = _weights(aha)
        return {"deletion": 0.25, "insertion": 0.25 + composite_at[step], "images": len(val)}

    monkeypatch.setattr(trainer, "score_validation", score)
    return seen


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=0, rtol=0, msg=k)


def test_a_score_that_stops_improving_stops_training_and_restores_the_best_weights(monkeypatch):
    # Best at step 2; step 4 gains less than min_delta (0.001), so it is no improvement either: patience 2 ends
    # the run at step 4 of a 12-step cap.
    seen = _scripted(monkeypatch, {0: 0.1, 1: 0.2, 2: 0.5, 3: 0.45, 4: 0.5005})
    x, y = colour_images(8)
    aha = AHA(colour_classifier(), AHAConfig(**FAST, val_every=1, patience=2))
    vx, _ = colour_images(3, seed=1)
    history = aha.fit(_Pairs(x, y), epochs=3, batch_size=2, val=vx, progress=False)
    assert len(history["loss"]) == 4 and aha.steps_trained == 4
    assert history["val_step"] == [0, 1, 2, 3, 4]
    assert history["val_composite"] == pytest.approx([0.1, 0.2, 0.5, 0.45, 0.5005])
    assert math.isnan(history["val_loss"][0]) and history["val_loss"][1] == pytest.approx(history["loss"][0])
    _assert_same(_weights(aha), seen[2])
    assert any(not torch.equal(seen[4][k], seen[2][k]) for k in seen[2])  # training did move past the best


def test_a_real_run_stops_before_its_cap_and_keeps_the_weights_of_its_best_score():
    x, y = colour_images(8)
    vx, _ = colour_images(4, seed=1)
    clf = colour_classifier()
    config = AHAConfig(**FAST, lr=3e-3, warmup=0.0, references=("mean",), targets="pred", val_every=2, patience=2,
                       min_delta=0.005)  # fmt: skip
    aha = AHA(clf, config)
    history = aha.fit(_Pairs(x, y), epochs=30, batch_size=4, val=vx, progress=False)  # a cap of 60 steps
    steps, scores = history["val_step"], history["val_composite"]
    assert steps[-1] == len(history["loss"]) < 60  # it stopped early, at a score
    # The rule, replayed on the curve: the best so far moves only on a gain above min_delta; the run stopped at
    # the second score in a row without one.
    best, bad = 0, 0
    for i in range(1, len(scores)):
        best, bad = (i, 0) if scores[i] - 0.005 > scores[best] else (best, bad + 1)
        assert bad < 2 or i == len(scores) - 1
    assert bad == 2 and scores[best] > scores[0] + 0.05  # training helped before it plateaued
    # The restored decoder scores what its step scored, in any batching (a score depends on each image alone).
    for batch_size in (1, 4):
        again = score_validation(aha, vx, device=CPU, batch_size=batch_size)
        assert again["insertion"] - again["deletion"] == pytest.approx(scores[best], abs=1e-5)
    maps = aha.attribute(vx, clf(vx).argmax(1))
    di = deletion_insertion(clf, vx, maps, steps=config.val_fractions)  # the metric, as any user calls it
    assert (di.insertion - di.deletion).mean().item() == pytest.approx(scores[best], abs=1e-5)


def test_a_run_killed_mid_way_resumes_its_curve_patience_and_best_weights(monkeypatch, tmp_path):
    # Best at step 3, no improvement at 4 and 5: patience 2 stops at 5. The kill comes during step 5, after the
    # checkpoint of step 4 (one score without improvement): a resumed run that forgot it would stop at 6.
    composite_at = {0: 0.1, 1: 0.3, 2: 0.2, 3: 0.6, 4: 0.5, 5: 0.5, 6: 0.4}
    x, y = colour_images(8)
    vx, _ = colour_images(3, seed=1)
    cfg = AHAConfig(**FAST, fraction_sampling="random", val_every=1, patience=2)
    seen = _scripted(monkeypatch, composite_at)
    reference = AHA(colour_classifier(), cfg)
    want = reference.fit(_Pairs(x, y), epochs=3, batch_size=2, val=vx, progress=False)
    assert want["val_step"] == [0, 1, 2, 3, 4, 5]
    _assert_same(_weights(reference), seen[3])

    crashed = AHA(colour_classifier(), cfg)
    with pytest.raises(KeyboardInterrupt):  # 2 items a step: the 10th read is step 5's
        crashed.fit(_Pairs(x, y, fail_after=9), epochs=3, batch_size=2, val=vx, progress=False,
                    checkpoint_dir=tmp_path, checkpoint_every=2)  # fmt: skip
    step4 = tmp_path / "checkpoints" / "step-00000004"
    meta = json.loads((step4 / "config.json").read_text())["validation"]
    assert meta["best_step"] == 3 and meta["bad_scores"] == 1 and [p["step"] for p in meta["curve"]] == [0, 1, 2, 3, 4]
    assert (step4 / BEST_FILE).is_file()

    seen.clear()
    resumed = AHA(colour_classifier(), cfg)
    got = resumed.fit(_Pairs(x, y), epochs=3, batch_size=2, val=vx, progress=False, checkpoint_dir=tmp_path,
                      resume=tmp_path)  # fmt: skip
    assert sorted(seen) == [5]  # only the step after the checkpoint was scored again
    assert len(got["loss"]) == 1 and resumed.steps_trained == 5
    for key in ("val_step", "val_composite", "val_loss"):
        assert got[key] == pytest.approx(want[key], nan_ok=True), key
    _assert_same(_weights(resumed), _weights(reference))  # the best weights came back from best.safetensors
    loaded = AHA.load(tmp_path, colour_classifier())  # the final checkpoint holds the restored decoder
    _assert_same(_weights(loaded), _weights(reference))
    final = json.loads((tmp_path / "config.json").read_text())["validation"]
    assert final["stopped"] and final["restored"] and final["best_step"] == 3

    # A validated run resumes only with a validation set, of the same size.
    with pytest.raises(ValueError, match="run with a validation set"):
        AHA(colour_classifier(), cfg).fit(_Pairs(x, y), epochs=3, batch_size=2, resume=tmp_path, progress=False)
    with pytest.raises(ValueError, match="validated on 3 images, this val has 2"):
        AHA(colour_classifier(), cfg).fit(_Pairs(x, y), epochs=3, batch_size=2, resume=tmp_path, val=vx[:2],
                                          progress=False)  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value"),
    [("val_every", 0), ("patience", 0), ("min_delta", -0.1), ("min_delta", math.nan), ("val_fractions", 1),
     ("patience", 1.5)],
)  # fmt: skip
def test_config_refuses_bad_validation_settings_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        AHAConfig(**{field: value})


@pytest.mark.parametrize(
    ("val", "message"),
    [
        (torch.zeros(0, 3, 32, 32), "val is empty"),
        (_Pairs(torch.zeros(0, 3, 32, 32), torch.zeros(0)), "val is empty"),
        (torch.zeros(2, 32, 32), "val images must be a .N, 3, H, W. tensor"),
        ("images/", "val must be a Dataset, a DataLoader or"),
    ],
)
def test_fit_refuses_an_empty_or_unusable_validation_set(val, message):
    x, y = colour_images(4)
    aha = AHA(colour_classifier(), AHAConfig(**FAST))
    with pytest.raises(ValueError, match=message):
        aha.fit(_Pairs(x, y), batch_size=2, val=val, progress=False)
    assert aha.steps_trained == 0  # refused before any step


def test_early_stopping_counts_only_gains_above_min_delta():
    stopper = EarlyStopping(patience=2, min_delta=0.1)
    decoder = torch.nn.Linear(1, 1)
    assert stopper.record(0, {"deletion": 0.5, "insertion": 0.6}, decoder)  # the first score is the best
    assert not stopper.record(5, {"deletion": 0.5, "insertion": 0.65}, decoder)  # +0.05: not enough
    assert stopper.record(9, {"deletion": 0.3, "insertion": 0.65}, decoder) and stopper.bad_scores == 0
    assert not stopper.record(10, {"deletion": math.nan, "insertion": 0.9}, decoder)  # NaN never improves
    assert not stopper.stopped
    assert not stopper.record(11, {"deletion": 0.3, "insertion": 0.7}, decoder) and stopper.stopped
    assert stopper.best_step == 9 and stopper.best_composite == pytest.approx(0.35)


def test_a_first_score_of_nan_does_not_block_every_later_improvement():
    # NaN - min_delta > x is False for every x: a NaN taken as the best so far would make every later score "no
    # improvement", stop the run after patience scores and restore the step-0 decoder.
    stopper = EarlyStopping(patience=2, min_delta=0.001)
    decoder = torch.nn.Linear(1, 1)
    assert not stopper.record(0, {"deletion": math.nan, "insertion": 0.5}, decoder)
    assert stopper.best_state is not None  # the run still has weights to end with
    assert stopper.record(3, {"deletion": 0.2, "insertion": 0.6}, decoder)
    assert stopper.best_step == 3 and stopper.best_composite == pytest.approx(0.4) and not stopper.stopped


def test_the_holdout_split_depends_on_names_and_seed_not_on_listing_order():
    class Listed:
        def __init__(self, names: list[str]) -> None:
            self.root = Path("root")
            self.samples = [(self.root / n, 0) for n in names]

        def __len__(self) -> int:
            return len(self.samples)

    names = [f"c{i % 3}/img{i:02d}.png" for i in range(20)]
    kept, held = holdout_split(Listed(names), 0.25, seed=3)
    assert len(held) == 5 and sorted(kept + held) == list(range(20))
    shuffled = [names[i] for i in torch.randperm(20, generator=torch.Generator().manual_seed(1)).tolist()]
    _, held2 = holdout_split(Listed(shuffled), 0.25, seed=3)
    assert sorted(shuffled[i] for i in held2) == sorted(names[i] for i in held)
    assert holdout_split(Listed(names), 0.25, seed=4)[1] != held
    for fraction in (0.0, 1.0, 1.5, 0.01):
        with pytest.raises(ValueError, match="fraction"):
            holdout_split(Listed(names), fraction, seed=0)


def _folder(root: Path, per_class: int = 5) -> Path:
    rng = np.random.default_rng(0)
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray((rng.random((32, 32, 3)) * 255).astype(np.uint8)).save(root / label / f"{i}.png")
    return root


def _fast_config(root: Path) -> Path:
    path = root / "aha.yaml"
    fields = {
        **FAST,
        "n_fractions": 4,
        "n_iters": 5,
        "targets": "pred",
        "grid_range": list(FAST["grid_range"]),
        "val_fractions": 2,
    }
    path.write_text(json.dumps({"aha": fields}))  # JSON is YAML
    return path


def test_train_aha_val_fraction_end_to_end(tmp_path, capsys):
    clf = str(untrained_resnet_checkpoint(tmp_path))
    data, out = _folder(tmp_path / "images"), tmp_path / "aha"
    args = ["train-aha", "--classifier", clf, "--data", str(data), "--out", str(out), "--img-size", "32",
            "--batch-size", "2", "--max-steps", "2", "--val-fraction", "0.2", "--val-every", "1", "--no-progress",
            "--config", str(_fast_config(tmp_path))]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "validation: best composite" in printed and "val_curve.png" in printed
    summary = json.loads((out / "train.json").read_text())
    assert summary["val_images"] == 2 and summary["val_fraction"] == 0.2
    curve = summary["validation"]["curve"]
    assert [p["step"] for p in curve] == [0, 1, 2] and summary["steps_trained"] == 2
    assert summary["validation"]["best_step"] in [p["step"] for p in curve]
    assert (out / "val_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "config.json").read_text())["validation"]["curve"] == curve

    for fraction, message in (("0", "must be in (0, 1)"), ("nan", "must be in (0, 1)"), ("0.01", "holds out 0")):
        bad = [a if a != "0.2" else fraction for a in args]
        assert main([*bad, "--overwrite"]) == 2
        assert "--val-fraction: " in (err := capsys.readouterr().err) and message in err, err


def test_a_diverged_decoder_scores_nan_instead_of_aborting_fit():
    aha = AHA(colour_classifier(), AHAConfig(**FAST))
    with torch.no_grad():
        for p in aha.decoder.parameters():
            p.fill_(float("nan"))
    scores = score_validation(aha, colour_images(3, seed=1)[0], device=CPU, batch_size=2)
    assert math.isnan(scores["deletion"]) and math.isnan(scores["insertion"]) and scores["images"] == 3
    stop, decoder = EarlyStopping(patience=1, min_delta=0.0), torch.nn.Linear(1, 1)
    assert stop.record(0, {"deletion": 0.2, "insertion": 0.5}, decoder) and not stop.record(1, scores, decoder)
    assert stop.best_step == 0 and stop.best_composite == pytest.approx(0.3) and stop.stopped


@pytest.mark.parametrize(
    "images, message",
    [
        (torch.rand(2, 3, 16, 16) * 3, r"must be RGB in \[0, 1\]"),
        (torch.full((2, 3, 16, 16), float("nan")), "NaN or infinite"),
    ],
)
def test_validation_images_out_of_range_or_not_finite_are_refused_in_one_line(images, message):
    aha = AHA(colour_classifier(), AHAConfig(**FAST))
    with pytest.raises(ValueError, match=message):
        score_validation(aha, images, device=CPU, batch_size=2)


def test_validation_images_a_fixed_size_vit_refuses_are_one_line_naming_their_size(timm_vit):
    aha = AHA(timm_vit, AHAConfig(decoder_dim=8, class_dim=4), img_size=32)
    with pytest.raises(ValueError, match="refused validation images of size 48 x 48"):
        score_validation(aha, torch.rand(2, 3, 48, 48), device=CPU, batch_size=2)
