"""AHA's pullback input (``AHAConfig.pullback_input``, issue #31): the decoder's stem also takes the classifier's
pullback ``v`` for the target class (the Soft Pullback, or Pullback Ascent's with ``pullback_method="ascent"``), as
``sum_c v_c (x_c - r_c)`` and ``sum_c |v_c|``, each scaled to unit root mean square per image.

The colour classifier's logits are ``gain * [mean(R - G), -mean(R - G)]``, so its pullback is known in closed form:
``v = +-gain / (H W)`` on red, ``-+gain / (H W)`` on green, 0 on blue. With its identity normalisation (mean colour
0) the first channel is ``(R - G)`` up to a positive scale for class 0 and its negation for class 1, and the second
is constant.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from attr_engine.aha import AHA, AHAConfig
from attr_engine.aha.network import PULLBACK_CHANNELS
from attr_engine.aha.validation import score_validation
from attr_engine.metrics import deletion_insertion
from attr_engine.pullback import SemanticPullback
from tests.aha_helpers import FAST, colour_classifier, colour_images
from tests.eval_helpers import images, tiny_resnet


@pytest.fixture(scope="module")
def pulled() -> AHA:
    return AHA(colour_classifier(), AHAConfig(**FAST, pullback_input=True, targets="pred"))


def _unit_rms(values: torch.Tensor) -> torch.Tensor:
    return values / values.square().mean(dim=(-2, -1), keepdim=True).sqrt()


def test_the_channels_are_the_pullback_times_the_distance_to_the_reference_and_its_magnitude(pulled):
    x, _ = colour_images(3)
    target = torch.tensor([0, 1, 0])
    extra = pulled.pullback_input(x, target)
    assert extra is not None and extra.shape == (3, PULLBACK_CHANNELS, 32, 32) and not extra.requires_grad
    red_minus_green = _unit_rms(x[:, 0] - x[:, 1])
    sign = torch.tensor([1.0, -1.0, 1.0]).view(3, 1, 1)
    torch.testing.assert_close(extra[:, 0], sign * red_minus_green, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(extra[:, 1], torch.ones(3, 32, 32), atol=1e-5, rtol=1e-5)


def test_the_decoder_takes_them_and_off_means_no_channels_and_no_pullback(pulled):
    plain = AHA(pulled.classifier, AHAConfig(**FAST, targets="pred"))
    assert plain.pullback_input(*colour_images(1)) is None
    assert plain.decoder.image_stem[0].in_channels == 3 and pulled.decoder.image_stem[0].in_channels == 5
    x, _ = colour_images(2)
    target = torch.tensor([0, 1])
    with torch.no_grad():
        feats = pulled.backbone(x)
        maps = pulled(x, target)
        torch.testing.assert_close(maps, pulled.decoder(feats, x, target, pulled.pullback_input(x, target)))
        assert not torch.allclose(maps, pulled.decoder(feats, x, target, torch.zeros(2, 2, 32, 32)))
        with pytest.raises(ValueError, match="takes 2 channels beside the image, got 0"):
            pulled.decoder(feats, x, target)


def test_every_path_to_a_map_passes_them(pulled):
    """The one-pass map, the fused prediction and decoder refinement at a vanishing rate give the same map (a path
    that forgot the pullback would fail in the stem)."""
    x, _ = colour_images(3)
    target = torch.tensor([0, 1, 1])
    one_pass = pulled.attribute(x, target)
    _, fused = pulled.predict_and_explain(x, target)
    torch.testing.assert_close(fused, one_pass, atol=0, rtol=0)
    decoder_steps = pulled.with_options()
    decoder_steps.config = AHAConfig(**FAST, pullback_input=True, refine_mode="decoder", refine_lr=1e-12).resolved(32)
    torch.testing.assert_close(decoder_steps.attribute(x, target, refine_steps=1, seed=0), one_pass, atol=1e-4,
                               rtol=1e-4)  # fmt: skip
    assert pulled.attribute(x, target, refine_steps=1, seed=0).shape == (3, 32, 32)


def test_it_trains_and_a_checkpoint_keeps_it(tmp_path):
    clf = colour_classifier()
    aha = AHA(clf, AHAConfig(**FAST, pullback_input=True, targets="pred"))
    stem = aha.decoder.image_stem[0].weight.detach().clone()
    x, y = colour_images(8)
    aha.fit(torch.utils.data.TensorDataset(x, y), epochs=1, batch_size=4, progress=False)
    assert not torch.equal(aha.decoder.image_stem[0].weight[:, 3:], stem[:, 3:])  # the pullback weights learn
    aha.save(tmp_path)
    loaded = AHA.load(tmp_path, clf)
    assert loaded.config.pullback_input
    torch.testing.assert_close(loaded.attribute(x), aha.attribute(x), atol=0, rtol=0)


def test_export_and_inference_mode_are_refused_in_one_line(pulled, tmp_path):
    with pytest.raises(ValueError, match="pullback_input cannot be exported"):
        pulled.export(tmp_path / "aha.onnx")
    assert not (tmp_path / "aha.onnx").exists()
    x, _ = colour_images(1)
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="needs autograd"):
            pulled.attribute(x)
        with pytest.raises(RuntimeError, match="the pullback input needs autograd"):
            pulled.predict_and_explain(x)


def test_the_ascent_method_feeds_pullback_ascents_displacement(tmp_path):
    """``pullback_method="ascent"``: the channels come from Pullback Ascent's ``x_K - x_0`` (the ranking that leads the
    photos board) instead of the Soft Pullback. On a nonlinear classifier the two differ (on the colour classifier
    they would not: its pullback is the same at every ascent step)."""
    clf = tiny_resnet()
    x, target = images(2, 32), torch.tensor([0, 3])
    ascent = AHA(clf, AHAConfig(**FAST, pullback_input=True, pullback_method="ascent", targets="pred"))
    soft = AHA(clf, AHAConfig(**FAST, pullback_input=True, targets="pred"))
    pa = SemanticPullback(clf, method="ascent").attribute(x, target, reduce=None)
    reference = clf.norm_mean.view(1, -1, 1, 1)
    expected = torch.stack(((pa * (x - reference)).sum(dim=1), pa.abs().sum(dim=1)), dim=1)
    fed = ascent.pullback_input(x, target)
    torch.testing.assert_close(fed, _unit_rms(expected), atol=1e-5, rtol=1e-4)
    assert (fed - soft.pullback_input(x, target)).abs().amax() > 0.1
    ascent.save(tmp_path)
    loaded = AHA.load(tmp_path, clf)
    assert loaded.config.pullback_method == "ascent"
    torch.testing.assert_close(loaded.attribute(x, target), ascent.attribute(x, target), atol=0, rtol=0)
    with pytest.raises(ValueError, match="pullback_method must be one of"):
        AHAConfig(pullback_method="gradient")


def test_the_skip_adds_a_learned_multiple_of_the_first_channel_on_every_path(tmp_path):
    """``pullback_skip``: map = decoder output + s * (the ``v·(x − r)`` channel), s starting at 1 and trained; the
    refinement of the decoder's last layers keeps the term (a path that dropped it would move the map by the whole
    channel), and a checkpoint keeps s."""
    clf = tiny_resnet()
    x, target = images(4, 32), torch.tensor([0, 3, 1, 2])
    aha = AHA(clf, AHAConfig(**FAST, pullback_input=True, pullback_skip=True, targets="pred"))
    assert aha.decoder.skip_weight is not None and float(aha.decoder.skip_weight.detach()) == 1.0
    extra = aha.pullback_input(x, target)
    with torch.no_grad():
        decoder = aha.decoder
        convolutions = decoder.out(decoder.head(decoder.trunk(aha.backbone(x), x, target, extra)))[:, 0]
        torch.testing.assert_close(aha(x, target), convolutions + extra[:, 0])
        decoder.skip_weight.fill_(0.25)
        torch.testing.assert_close(aha(x, target), convolutions + 0.25 * extra[:, 0])
        decoder.skip_weight.fill_(1.0)
    one_pass = aha.attribute(x, target)
    decoder_steps = aha.with_options()
    decoder_steps.config = dataclasses.replace(aha.config, refine_mode="decoder", refine_lr=1e-12)
    torch.testing.assert_close(decoder_steps.attribute(x, target, refine_steps=1, seed=0), one_pass, atol=1e-4,
                               rtol=1e-4)  # fmt: skip
    aha.fit(torch.utils.data.TensorDataset(x, target), epochs=1, batch_size=4, progress=False)
    learned = float(aha.decoder.skip_weight.detach())
    assert learned != 1.0
    aha.save(tmp_path)
    loaded = AHA.load(tmp_path, clf)
    assert loaded.config.pullback_skip and float(loaded.decoder.skip_weight.detach()) == learned
    torch.testing.assert_close(loaded.attribute(x, target), aha.attribute(x, target), atol=0, rtol=0)
    with pytest.raises(ValueError, match="pullback_skip adds the pullback input's channel"):
        AHAConfig(pullback_skip=True)


def test_validation_scores_the_maps_the_explainer_draws(pulled):
    """``fit(val=)`` scores the maps of the pullback-input decoder (a scorer that left the channels out would fail in
    the stem, and one that fed other channels would score other maps)."""
    x, _ = colour_images(4, seed=1)
    scores = score_validation(pulled, x, device=torch.device("cpu"), batch_size=2)
    target = pulled.classifier(x).argmax(1)
    with torch.no_grad():
        maps = pulled(x, target)
    di = deletion_insertion(pulled.classifier, x, maps, target, steps=pulled.config.val_fractions, reference="mean",
                            protocol="aha")  # fmt: skip
    assert scores["images"] == 4
    assert scores["deletion"] == pytest.approx(float(di.deletion.mean()), abs=1e-6)
    assert scores["insertion"] == pytest.approx(float(di.insertion.mean()), abs=1e-6)
    fresh = AHA(pulled.classifier, AHAConfig(**FAST, pullback_input=True, targets="pred"))
    history = fresh.fit(torch.utils.data.TensorDataset(x, target), max_steps=1, batch_size=4, progress=False, val=x)
    assert len(history["val_composite"]) == 2 and all(math.isfinite(v) for v in history["val_composite"])
