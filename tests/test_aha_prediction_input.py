"""AHAConfig.prediction_input: the classifier's predicted distribution (the softmax of its logits) conditions the
decoder through a learned matrix onto the class embedding.

What a bug would break: a distribution other than the classifier's (another pass, the logits unnormalised), the
untrained map no longer the default's (the option would change the start of training), the distribution lost in
training (the matrix never learns), in the fused prediction path, in export or on load, or a wrong last input
accepted silently.
"""

from __future__ import annotations

from collections.abc import Iterator
from copy import deepcopy

import numpy as np
import pytest
import torch

from attr_engine.aha import AHA, AHAConfig
from attr_engine.aha.network import FeatureBackbone, with_prediction
from tests.aha_helpers import FAST, colour_classifier, colour_images
from tests.conftest import ZOO
from tests.eval_helpers import images, onnx_session, single_thread

TINY = {"decoder_dim": 8, "class_dim": 4, "prediction_input": True}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


def _random_matrix(aha: AHA) -> None:
    """A non-zero matrix, as training leaves it: at its zero start the distribution changes nothing."""
    weight = aha.decoder.prediction_weight
    assert weight is not None
    with torch.no_grad():
        weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(7)))


def test_the_last_input_is_the_classifiers_own_distribution(timm_cnn) -> None:
    """``features`` gives the backbone's levels and then softmax(classifier logits), from the fused pass or from
    logits the caller passes; the first entries are the levels of the option off."""
    aha = AHA(timm_cnn, AHAConfig(**TINY), img_size=32)
    x = images(3, 32, seed=3)
    inputs = aha.features(x)
    expected = torch.softmax(timm_cnn(x).float(), dim=1)
    torch.testing.assert_close(inputs[-1], expected)
    torch.testing.assert_close(inputs[-1].sum(dim=1), torch.ones(3))
    for got, level in zip(inputs[:-1], aha.backbone(x), strict=True):
        torch.testing.assert_close(got, level)
    logits = torch.randn(3, 5)
    torch.testing.assert_close(aha.features(x, logits)[-1], torch.softmax(logits, dim=1))


def test_the_untrained_map_is_the_defaults_and_a_learned_matrix_reads_the_distribution(timm_cnn) -> None:
    """Built from the same seed, the decoder with the option has the default's weights and maps (its matrix starts
    at zero and draws nothing); with a non-zero matrix, two distributions give two maps for the same image,
    features and class."""
    x, target = images(2, 32, seed=3), torch.tensor([1, 3])
    built = {}
    for on in (False, True):
        torch.manual_seed(11)
        built[on] = AHA(timm_cnn, AHAConfig(**{**TINY, "prediction_input": on}), img_size=32)
    plain, option = built[False].decoder.state_dict(), built[True].decoder.state_dict()
    assert set(option) - set(plain) == {"prediction_weight"}
    for key, value in plain.items():
        torch.testing.assert_close(option[key], value, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(built[True](x, target), built[False](x, target), rtol=0, atol=0)
        aha = built[True]
        _random_matrix(aha)
        feats = aha.backbone(x)
        two = (torch.zeros(2, 5), 9 * torch.eye(5)[:2])  # uniform, then sure of classes 0 and 1
        maps = [aha.decoder(with_prediction(feats, logits), x, target) for logits in two]
    assert (maps[0] - maps[1]).abs().max() > 1e-3


def test_training_feeds_each_curve_its_images_distribution_and_learns_the_matrix(monkeypatch) -> None:
    """A ``pred+label`` step explains each image twice: every row of the decoder's batch gets the distribution of
    its own image (the batch repeated as the images are), and the matrix, zero at the start, is non-zero after two
    steps."""
    x, labels = colour_images(8)
    classifier = colour_classifier()
    aha = AHA(classifier, AHAConfig(**FAST, targets="pred+label", prediction_input=True))
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    forward = aha.decoder.forward
    monkeypatch.setattr(
        aha.decoder, "forward", lambda feats, xs, *rest: seen.append((feats[-1], xs)) or forward(feats, xs, *rest)
    )
    aha.fit(torch.utils.data.TensorDataset(x, labels), batch_size=4, max_steps=2, progress=False)
    assert len(seen) == 2
    for probs, batch in seen:
        assert len(probs) == len(batch) == 8  # 4 images, two targets each
        torch.testing.assert_close(probs, torch.softmax(classifier(batch), dim=1))
    weight = aha.decoder.prediction_weight
    assert weight is not None and aha.steps_trained == 2
    assert weight.abs().max() > 0


@pytest.mark.parametrize("mode", ["map", "decoder"])
def test_refinement_from_one_pass_prediction_gives_the_maps_of_attribute(timm_cnn, mode) -> None:
    """Refinement starts from the decoder's inputs with the distribution, whether predict_and_explain hands them
    over or the refinement computes them."""
    aha = AHA(timm_cnn, AHAConfig(**TINY, refine_mode=mode), img_size=32).with_options(refine_steps=1)
    _random_matrix(aha)
    x = images(2, 32, seed=3)
    logits, maps = aha.predict_and_explain(x)
    torch.testing.assert_close(maps, aha.attribute(x, target=logits.argmax(dim=1)), rtol=0, atol=0)


def test_a_separate_backbone_takes_the_distribution_from_the_classifier(timm_cnn, tmp_path) -> None:
    """A backbone that is not the classifier's network (here a copy of it) gives no logits: the distribution comes
    from one classifier pass, eager and exported alike."""
    pytest.importorskip("onnxruntime", reason="the export extra (onnxruntime) is not installed")
    pytest.importorskip("onnxscript", reason="the export extra (onnxscript) is not installed")
    copy = FeatureBackbone(deepcopy(timm_cnn.model), timm_cnn.norm_mean, timm_cnn.norm_std)
    aha = AHA(timm_cnn, AHAConfig(**TINY), img_size=32, backbone=copy)
    assert aha.backbone.model is not timm_cnn.model
    _random_matrix(aha)
    x, target = images(3, 32, seed=3), [0, 1, 2]
    torch.testing.assert_close(aha.features(x)[-1], torch.softmax(timm_cnn(x), dim=1))
    session = onnx_session(aha.export(tmp_path / "aha.onnx"))
    _, maps = session.run(["logits", "maps"], {"images": x.numpy(), "target": np.array(target, np.int64)})
    np.testing.assert_allclose(maps, aha.attribute(x, target=target).numpy(), rtol=0, atol=1e-4)


def test_one_pass_prediction_gives_the_maps_of_attribute(timm_vit) -> None:
    aha = AHA(timm_vit, AHAConfig(**TINY), img_size=32)
    _random_matrix(aha)
    x = images(3, 32, seed=3)
    logits, maps = aha.predict_and_explain(x)
    torch.testing.assert_close(logits, timm_vit(x))
    torch.testing.assert_close(maps, aha.attribute(x, target=logits.argmax(dim=1)), rtol=0, atol=0)


@pytest.mark.parametrize("family", ZOO)
def test_the_distribution_exports_on_every_family(family, request, tmp_path) -> None:
    """The exported graph takes the distribution from its own logits: onnxruntime's maps equal eager's, and differ
    from those of the same decoder with its matrix at zero (so the parity covers the input)."""
    pytest.importorskip("onnxruntime", reason="the export extra (onnxruntime) is not installed")
    pytest.importorskip("onnxscript", reason="the export extra (onnxscript) is not installed")
    classifier = request.getfixturevalue(family)
    aha = AHA(classifier, AHAConfig(**TINY), img_size=32)
    x, target = images(3, 32, seed=3), [0, 1, 2]
    zero = aha.attribute(x, target=target)
    _random_matrix(aha)
    session = onnx_session(aha.export(tmp_path / "aha.onnx"))
    _, maps = session.run(["logits", "maps"], {"images": x.numpy(), "target": np.array(target, np.int64)})
    eager = aha.attribute(x, target=target)
    np.testing.assert_allclose(maps, eager.numpy(), rtol=0, atol=1e-4)
    assert (eager - zero).abs().max() > 1e-3


def test_a_saved_explainer_keeps_the_matrix(timm_cnn, tmp_path) -> None:
    aha = AHA(timm_cnn, AHAConfig(**TINY), img_size=32)
    _random_matrix(aha)
    aha.save(tmp_path / "aha")
    loaded = AHA.load(tmp_path / "aha", timm_cnn)
    assert loaded.config.prediction_input
    torch.testing.assert_close(loaded.decoder.prediction_weight, aha.decoder.prediction_weight)
    x, target = images(2, 32, seed=3), torch.tensor([4, 0])
    torch.testing.assert_close(loaded.attribute(x, target=target), aha.attribute(x, target=target))


def test_a_last_input_that_is_not_the_distribution_is_refused_by_name(timm_cnn) -> None:
    aha = AHA(timm_cnn, AHAConfig(**TINY), img_size=32)
    x, target = images(2, 32, seed=3), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"must be the predicted distribution \(2, 5\) \(with_prediction\), got"):
        aha.decoder(aha.backbone(x), x, target)
    with pytest.raises(ValueError, match=r"prediction_input must be a bool"):
        AHAConfig(prediction_input=1)
    with pytest.raises(ValueError, match=r"predicted distribution \(2, 5\) \(with_prediction\), got \(1, 5\)"):
        aha.decoder(with_prediction(aha.backbone(x), torch.zeros(1, 5)), x, target)  # one row for two images
    plain = AHA(timm_cnn, AHAConfig(**{**TINY, "prediction_input": False}), img_size=32)
    with pytest.raises(ValueError, match=r"built without prediction_input: pass the backbone's levels alone"):
        plain.decoder(with_prediction(plain.backbone(x), torch.zeros(2, 5)), x, target)
