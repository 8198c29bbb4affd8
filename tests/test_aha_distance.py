"""AHA's reference-distance term (``AHAConfig.reference_distance``, issue #31 item 2): a learned multiple of
log(||x - r|| + eps) added to the map, which orders the pixels inside a region-pooling cell."""

from __future__ import annotations

import math

import torch

from attr_engine.aha import AHA, AHAConfig
from attr_engine.aha.network import DISTANCE_EPS
from tests.aha_helpers import FAST, colour_classifier, colour_images


def _log_distance(aha: AHA, x: torch.Tensor) -> torch.Tensor:
    reference = aha.classifier.norm_mean.view(1, 3, 1, 1)
    return torch.log((x - reference).norm(dim=1) + DISTANCE_EPS)


def test_the_term_starts_at_zero_and_adds_its_weight_times_the_log_distance():
    clf = colour_classifier()
    plain = AHA(clf, AHAConfig(**FAST))
    with_term = AHA(clf, AHAConfig(**FAST, reference_distance=True))
    x, _ = colour_images(3)
    target = torch.tensor([0, 1, 0])
    with torch.no_grad():
        # Untrained: the weight is 0 and every other weight is initialised as without the term.
        torch.testing.assert_close(with_term(x, target), plain(x, target), atol=0, rtol=0)
        assert with_term.decoder.distance_weight is not None and plain.decoder.distance_weight is None
        with_term.decoder.distance_weight.fill_(0.7)
        torch.testing.assert_close(with_term(x, target), plain(x, target) + 0.7 * _log_distance(with_term, x))


def test_a_positive_weight_ranks_reference_coloured_pixels_last():
    """Inside one cell pooling cannot tell pixels apart; the term puts the ones of the reference colour last."""
    clf = colour_classifier()
    aha = AHA(clf, AHAConfig(**FAST, reference_distance=True))
    x, _ = colour_images(1)
    reference = clf.norm_mean.view(1, 3, 1, 1)
    x[..., ::2, :] = reference.expand(1, 3, 16, 32)  # every other row: the reference colour
    with torch.no_grad():
        aha.decoder.distance_weight.fill_(50.0)  # far above the untrained decoder's own spread
        maps = aha(x, torch.tensor([0]))[0]
    assert maps[::2].max() < maps[1::2].min()


def test_training_moves_the_weight_and_a_checkpoint_keeps_it(tmp_path):
    clf = colour_classifier()
    aha = AHA(clf, AHAConfig(**FAST, reference_distance=True, targets="pred"))
    x, y = colour_images(8)
    aha.fit(torch.utils.data.TensorDataset(x, y), epochs=1, batch_size=4, progress=False)
    weight = float(aha.decoder.distance_weight.detach())
    assert weight != 0.0 and math.isfinite(weight)
    aha.save(tmp_path)
    loaded = AHA.load(tmp_path, clf)
    assert float(loaded.decoder.distance_weight.detach()) == weight
    torch.testing.assert_close(loaded.attribute(x), aha.attribute(x), atol=0, rtol=0)


def test_decoder_refinement_keeps_the_term():
    """Refinement of per-image decoder copies ends with the term too: at a vanishing rate it stays the T=0 map."""
    clf = colour_classifier()
    config = AHAConfig(**FAST, reference_distance=True, refine_mode="decoder", refine_lr=1e-12)
    aha = AHA(clf, config)
    x, _ = colour_images(3)
    with torch.no_grad():
        aha.decoder.distance_weight.fill_(2.0)
    target = torch.tensor([0, 1, 0])
    torch.testing.assert_close(aha.attribute(x, target, refine_steps=1, seed=0), aha.attribute(x, target),
                               atol=1e-4, rtol=1e-4)  # fmt: skip
