"""How AHA's decoder pads the frame (``AHAConfig.decoder_padding``, issue #31's border mass): zeros, as a DPT does,
or the edge pixels replicated, so no convolution sees a dark border that no image has."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attr_engine.aha import AHA, AHAConfig
from attr_engine.aha.network import Decoder
from tests.aha_helpers import FAST, colour_classifier, colour_images


def _constant_decoder_map(padding: str) -> torch.Tensor:
    """A seeded decoder's map (1, 32, 32) for spatially constant features and a constant grey image."""
    torch.manual_seed(0)
    decoder = Decoder([4, 6], num_classes=3, dim=8, class_dim=4, padding=padding)
    feats = [torch.full((1, 4, 8, 8), 0.3), torch.full((1, 6, 4, 4), -0.2)]
    with torch.no_grad():
        return decoder(feats, torch.full((1, 3, 32, 32), 0.5), torch.tensor([1]))


def test_replicate_padding_gives_a_constant_map_for_a_constant_input_and_zeros_does_not():
    """Every layer is translation invariant, so only the padding can make a constant input's map vary: the zero
    padding draws a frame into it, the replicated edge does not."""
    replicate, zeros = _constant_decoder_map("replicate"), _constant_decoder_map("zeros")
    assert float(replicate.max() - replicate.min()) < 1e-5 * (1.0 + float(replicate.abs().max()))
    frame = zeros - zeros[0, 16, 16]
    assert float(frame[0, 0].abs().max()) > 1e-3  # the outer row differs from the centre
    assert float(frame[0, 12:20, 12:20].abs().max()) < float(frame[0, 0].abs().max())


def test_every_padded_convolution_follows_the_config_and_the_weights_do_not_change():
    clf = colour_classifier()
    plain = AHA(clf, AHAConfig(**FAST))
    edge = AHA(clf, AHAConfig(**FAST, decoder_padding="replicate"))
    padded = [m for m in edge.decoder.modules() if isinstance(m, torch.nn.Conv2d) and m.padding != (0, 0)]
    assert padded and all(m.padding_mode == "replicate" for m in padded)
    for name, value in plain.decoder.state_dict().items():  # same seeded initialisation, only the padding differs
        torch.testing.assert_close(edge.decoder.state_dict()[name], value, atol=0, rtol=0)
    x, _ = colour_images(2)
    target = torch.tensor([0, 1])
    with torch.no_grad():
        assert not torch.allclose(edge(x, target), plain(x, target))


def test_a_checkpoint_keeps_the_padding(tmp_path):
    clf = colour_classifier()
    aha = AHA(clf, AHAConfig(**FAST, decoder_padding="replicate", targets="pred"))
    x, y = colour_images(8)
    aha.fit(torch.utils.data.TensorDataset(x, y), epochs=1, batch_size=4, progress=False)
    aha.save(tmp_path)
    loaded = AHA.load(tmp_path, clf)
    assert loaded.config.decoder_padding == "replicate"
    torch.testing.assert_close(loaded.attribute(x), aha.attribute(x), atol=0, rtol=0)


def test_decoder_refinement_pads_its_per_image_copies_the_same_way():
    """At a vanishing rate the refined map stays the T=0 map: the per-image copy of the head's last convolution
    pads as the decoder does (with zeros there the outer pixels would move)."""
    clf = colour_classifier()
    config = AHAConfig(**FAST, decoder_padding="replicate", refine_mode="decoder", refine_lr=1e-12)
    aha = AHA(clf, config)
    x, _ = colour_images(3)
    target = torch.tensor([0, 1, 0])
    torch.testing.assert_close(aha.attribute(x, target, refine_steps=1, seed=0), aha.attribute(x, target),
                               atol=1e-4, rtol=1e-4)  # fmt: skip


def test_an_unknown_padding_is_refused_in_one_line():
    with pytest.raises(ValueError, match="decoder_padding must be one of"):
        AHAConfig(decoder_padding="reflect")
    with pytest.raises(ValueError, match="decoder padding must be one of"):
        Decoder([4], num_classes=2, padding="circular")


def test_onnxruntime_runs_the_replicate_padded_decoder_as_eager(timm_cnn, tmp_path):
    ort = pytest.importorskip("onnxruntime", reason="the export extra (onnxruntime) is not installed")
    pytest.importorskip("onnxscript", reason="the export extra (onnxscript) is not installed")
    aha = AHA(timm_cnn, AHAConfig(decoder_dim=8, class_dim=4, decoder_padding="replicate"), img_size=32)
    path = aha.export(tmp_path / "aha.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    _, maps = session.run(["logits", "maps"], {"images": x.numpy(), "target": np.full(3, -1, np.int64)})
    np.testing.assert_allclose(maps, aha.predict_and_explain(x)[1].numpy(), rtol=0, atol=1e-4)
