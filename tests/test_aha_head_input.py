"""AHAConfig.head_input: the classifier head's score of the target at each position of its deepest matching tap,
one channel of the decoder's input.

What a bug would break: another Linear or another level taken for the head (the score's mean would no longer be
the logit), the channel not reaching the map (the map would not depend on the target once the learned class
embedding says nothing), the channel lost in export or on load, or a classifier the option cannot serve accepted
silently.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from attr_engine.aha import AHA, AHAConfig
from attr_engine.aha.network import classifier_head_weight
from attr_engine.checkpoint import load_safetensors
from tests.conftest import ZOO
from tests.eval_helpers import images, onnx_session, single_thread

TINY = {"decoder_dim": 8, "class_dim": 4, "head_input": True}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


def test_the_head_score_is_the_class_activation_map_whose_mean_is_the_logit(timm_cnn) -> None:
    """resnet10t's head pools its last stage and applies one Linear: the score W_t · f at each position of that
    stage, averaged over the positions, plus the bias, is the target's logit; the decoder's channel is that map
    standardised per image. At 64 px the last stage is 2 x 2 (at 32 px one position, a constant channel)."""
    aha = AHA(timm_cnn, AHAConfig(**TINY), img_size=64)
    x, target = images(3, 64, seed=3), torch.tensor([0, 3, 4])
    feats, logits = aha.backbone.forward_with_logits(x)
    decoder = aha.decoder
    assert decoder.head_level == len(feats) - 1  # the last stage: 64 channels, the fc's input
    head = timm_cnn.model.get_classifier()
    torch.testing.assert_close(decoder.head_weight, head.weight)
    cam = torch.einsum("bchw,bc->bhw", feats[-1], head.weight[target])
    torch.testing.assert_close(cam.mean(dim=(1, 2)) + head.bias[target], logits[torch.arange(3), target])
    channel = decoder._with_head_score(feats, target)[decoder.head_level][:, -1]
    centred = cam - cam.mean(dim=(1, 2), keepdim=True)
    expected = centred / centred.square().mean(dim=(1, 2), keepdim=True).sqrt()
    torch.testing.assert_close(channel, expected, rtol=1e-4, atol=1e-5)
    assert decoder.project[decoder.head_level].in_channels == 64 + 4 + 1


def test_the_head_score_makes_the_map_depend_on_the_target_without_the_class_embedding(timm_cnn) -> None:
    """With the learned class embedding zeroed, the decoder's only word of the class is the head score: the maps of
    two targets differ with it and are equal without it."""
    x = images(2, 64, seed=3)
    maps = {}
    for on in (False, True):
        aha = AHA(timm_cnn, AHAConfig(**{**TINY, "head_input": on}), img_size=64)
        torch.nn.init.zeros_(aha.decoder.class_embed.weight)
        with torch.no_grad():
            maps[on] = [aha(x, torch.full((2,), t)) for t in (1, 2)]
    torch.testing.assert_close(maps[False][0], maps[False][1])
    assert (maps[True][0] - maps[True][1]).abs().max() > 1e-3


@pytest.mark.parametrize("family", ZOO)
def test_the_head_score_exports_on_every_family(family, request, tmp_path) -> None:
    """The head's last Linear is found on every family (timm's head / fc, torchvision's fc / heads.head, the
    transformers classifier) and the exported file gives eager's maps. The CNNs at 64 px: a last stage of 2 x 2,
    so the channel is not a constant."""
    pytest.importorskip("onnxruntime", reason="the export extra (onnxruntime) is not installed")
    pytest.importorskip("onnxscript", reason="the export extra (onnxscript) is not installed")
    classifier = request.getfixturevalue(family)
    side = 32 if "vit" in family else 64
    aha = AHA(classifier, AHAConfig(**TINY), img_size=side)
    assert aha.decoder.head_level is not None
    session = onnx_session(aha.export(tmp_path / "aha.onnx"))
    x = images(3, side, seed=3)
    _, maps = session.run(["logits", "maps"], {"images": x.numpy(), "target": np.array([0, 1, 2], np.int64)})
    np.testing.assert_allclose(maps, aha.attribute(x, target=[0, 1, 2]).numpy(), rtol=0, atol=1e-4)


def test_a_saved_explainer_reads_the_head_again_and_stores_none_of_it(timm_cnn, tmp_path) -> None:
    aha = AHA(timm_cnn, AHAConfig(**TINY), img_size=64)
    torch.nn.init.normal_(aha.decoder.out.weight)  # not the initial weights: the load must restore them
    aha.save(tmp_path / "aha")
    weights, _ = load_safetensors(tmp_path / "aha" / "explainer.safetensors")
    assert not any("head_weight" in key for key in weights)
    loaded = AHA.load(tmp_path / "aha", timm_cnn)
    assert loaded.config.head_input and loaded.decoder.head_level == aha.decoder.head_level
    x, target = images(2, 64, seed=3), torch.tensor([4, 0])
    torch.testing.assert_close(loaded.attribute(x, target=target), aha.attribute(x, target=target))


def test_what_the_head_score_cannot_serve_is_refused_by_name(timm_cnn) -> None:
    with pytest.raises(ValueError, match="head_input scores the classifier's own features with its head"):
        AHAConfig(head_input=True, backbone="resnet18")
    with pytest.raises(ValueError, match=r"no tapped level has the 64 channels the classifier's head takes"):
        AHA(timm_cnn, AHAConfig(**TINY, layers=(1, 2)), img_size=32)  # stages of 8 and 16 channels
    with pytest.raises(ValueError, match=r"an nn\.Linear with 5 outputs; Conv2d has none"):
        classifier_head_weight(torch.nn.Conv2d(3, 5, 1), 5)
