"""AHAConfig.decoder_stride / decoder_upsample: the decoder at a fraction of the input side, the map brought back by a
guided (joint bilateral) or bilinear upsampling.

What a bug would break: the convolutions running at full resolution anyway (the hidden activations' size), a
ragged side losing its last pixels, the guided upsampling following the cell grid instead of the image's edges or
not reproducing a constant map, the upsampler's scales not training, a checkpoint forgetting the stride, refinement
or an older checkpoint failing. Export parity for every classifier family is in tests/test_export.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from attr_engine.aha import AHA, AHAConfig
from attr_engine.aha.network import Decoder, GuidedUpsample
from attr_engine.aha.persistence import CONFIG_FILE
from tests.aha_helpers import FAST, assert_tail_starts_as_decoder, colour_classifier, colour_images


class _Pairs(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


@pytest.mark.parametrize(("field", "value"), [("decoder_stride", 3), ("decoder_stride", 16),
                                              ("decoder_stride", True), ("decoder_upsample", "nearest")])  # fmt: skip
def test_the_config_refuses_other_strides_and_upsamplings_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        AHAConfig(**{field: value})


@pytest.mark.parametrize("upsample", ["guided", "bilinear"])
@pytest.mark.parametrize(("stride", "kind"), [(2, "full"), (4, "full"), (8, "light")])
def test_the_convolutions_run_at_the_stride_and_the_map_at_the_input_side(stride, kind, upsample):
    decoder = Decoder([4, 8], 3, dim=8, class_dim=4, kind=kind, stride=stride, upsample=upsample).eval()
    x = torch.rand(2, 3, 30, 29)  # neither side a multiple of the stride
    feats = [torch.randn(2, 4, 15, 15), torch.randn(2, 8, 4, 4)]  # the first finer than the decoder at 4 and 8
    target = torch.tensor([0, 2])
    with torch.no_grad():
        hidden = decoder.hidden(feats, x, target, depth=1)
        maps = decoder(feats, x, target)
    low = (-(-30 // stride), -(-29 // stride))
    assert hidden.shape[-2:] == low
    assert maps.shape == (2, 30, 29) and torch.isfinite(maps).all()
    # The output projection of the hidden activations, brought to the input side, is the map.
    projected = decoder.out(hidden)[:, 0]
    torch.testing.assert_close(decoder.with_terms(projected, x), maps)


def test_stride_one_keeps_the_full_resolution_decoder_bit_for_bit():
    torch.manual_seed(0)
    one = Decoder([4, 8], 3, dim=8, class_dim=4)
    torch.manual_seed(0)
    default = Decoder([4, 8], 3, dim=8, class_dim=4, stride=1, upsample="bilinear")
    assert one.upsample is None and default.upsample is None
    x, target = torch.rand(2, 3, 16, 16), torch.tensor([1, 0])
    feats = [torch.randn(2, 4, 8, 8), torch.randn(2, 8, 4, 4)]
    with torch.no_grad():
        assert torch.equal(one(feats, x, target), default(feats, x, target))
    assert one.hidden(feats, x, target, depth=1).shape[-2:] == (16, 16)


def test_the_guided_upsampling_follows_the_image_edge_not_the_cell_grid():
    up = GuidedUpsample(4)
    low = torch.zeros(1, 4, 4)
    low[:, :, 2:] = 1.0  # the right half of the cells scores 1
    x = torch.zeros(1, 3, 16, 16)
    x[..., 9:] = 1.0  # the image's edge at column 9, one pixel inside the third cell (columns 8-11)
    with torch.no_grad():
        guided = up(low, x)[0]
    bilinear = F.interpolate(low[:, None], size=(16, 16), mode="bilinear", align_corners=False)[0, 0]
    assert guided[:, 9:].min() > 0.99 and guided[:, :9].max() < 0.01  # the step sits on the image's edge
    assert bilinear[:, 8].max() > 0.3  # where a bilinear resize blends across it
    # A constant map stays constant over any image (the weights are a softmax: they sum to 1).
    flat = up(torch.full((2, 4, 4), 3.0), torch.rand(2, 3, 16, 16))
    torch.testing.assert_close(flat, torch.full((2, 16, 16), 3.0))


def _joint_bilateral_by_the_pixel(up: GuidedUpsample, low: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The documented definition, one output pixel at a time: a softmax over the 3 x 3 cells around the pixel's
    cell (edge cells repeated) of ``-a d^2 - b |p - c|^2``, weighting those cells' scores."""
    s, (bsz, height, width) = up.stride, low.shape
    a, b = up.spatial_log.exp(), up.colour_log.exp()
    cells = F.avg_pool2d(x, s)
    out = torch.empty(bsz, height * s, width * s)
    for n in range(bsz):
        for py in range(height * s):
            for px in range(width * s):
                cy, cx = py // s, px // s
                logits, scores = [], []
                for dy in (-1, 0, 1):
                    for dx in (-1, 0, 1):
                        ny, nx = min(max(cy + dy, 0), height - 1), min(max(cx + dx, 0), width - 1)
                        d2 = ((py + 0.5) / s - (cy + dy + 0.5)) ** 2 + ((px + 0.5) / s - (cx + dx + 0.5)) ** 2
                        c2 = (x[n, :, py, px] - cells[n, :, ny, nx]).square().sum()
                        logits.append(-a * d2 - b * c2)
                        scores.append(low[n, ny, nx])
                out[n, py, px] = (torch.stack(logits).softmax(0) * torch.stack(scores)).sum()
    return out


def test_the_guided_upsampling_equals_its_definition_pixel_by_pixel():
    torch.manual_seed(0)
    up = GuidedUpsample(4)
    with torch.no_grad():  # scales away from their initial values, as after training
        up.spatial_log.fill_(0.3)
        up.colour_log.fill_(3.1)
    low, x = torch.randn(2, 3, 2), torch.rand(2, 3, 12, 8)
    with torch.no_grad():
        torch.testing.assert_close(up(low, x), _joint_bilateral_by_the_pixel(up, low, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("stride", "height", "width"), [(4, 3, 2), (8, 1, 3)])
@pytest.mark.parametrize("colour_log", [3.1, 8.0])  # e^8 ~ 3000: each logit's exp alone over- or underflows
def test_a_traced_graph_gets_the_cell_by_cell_softmax_with_the_same_map_and_gradient(
    monkeypatch, colour_log, stride, height, width
):
    from attr_engine.aha import network

    torch.manual_seed(0)
    up = GuidedUpsample(stride)
    with torch.no_grad():
        up.spatial_log.fill_(0.3)
        up.colour_log.fill_(colour_log)
    low = torch.randn(3, height, width, requires_grad=True)
    x = torch.rand(3, 3, height * stride, width * stride)
    inputs = (low, up.spatial_log, up.colour_log)
    eager = up(low, x)
    grad_eager = torch.autograd.grad(eager.square().sum(), inputs)
    calls = []
    streamed = GuidedUpsample.cell_by_cell
    monkeypatch.setattr(GuidedUpsample, "cell_by_cell", lambda self, m, g: calls.append(len(m)) or streamed(self, m, g))
    monkeypatch.setattr(network, "_tracing", lambda: True)
    traced = up(low, x)
    assert calls == [3]
    grad_traced = torch.autograd.grad(traced.square().sum(), inputs)  # the map's and both scales' gradients
    assert torch.isfinite(traced).all()
    torch.testing.assert_close(traced, eager, atol=1e-5, rtol=1e-5)
    # at b ~ 3000 the scales' gradients sum logits of 1e3 and more, whose float32 rounding differs between the two
    # forms by about 0.4 %: there only the map's gradient is compared
    checked = len(inputs) if colour_log < 5 else 1
    torch.testing.assert_close(grad_traced[:checked], grad_eager[:checked], atol=1e-4, rtol=1e-4)
    tol = 1e-5 if colour_log < 5 else 1e-3  # at b ~ 3000 the expanded square (2b p.c - b |c|^2) keeps fewer digits
    with torch.no_grad():
        torch.testing.assert_close(traced, _joint_bilateral_by_the_pixel(up, low, x), atol=tol, rtol=tol)


def test_a_batch_is_upsampled_in_slices_that_equal_the_whole_batch_and_its_gradient(monkeypatch):
    from attr_engine.aha import network

    torch.manual_seed(0)
    up = GuidedUpsample(4)
    low, x = torch.randn(5, 3, 2, requires_grad=True), torch.rand(5, 3, 12, 8)
    whole = up(low, x)  # 5 x 9 x 96 logits: far below the budget, one step
    (grad_whole,) = torch.autograd.grad(whole.square().sum(), low)
    calls = []
    upsample = GuidedUpsample.all_cells
    monkeypatch.setattr(GuidedUpsample, "all_cells", lambda self, m, g: calls.append(len(m)) or upsample(self, m, g))
    monkeypatch.setattr(network, "GUIDED_SLICE_BYTES", 2 * 9 * 12 * 8 * 4)  # two images' logits
    sliced = up(low, x)
    assert calls == [2, 2, 1]
    (grad_sliced,) = torch.autograd.grad(sliced.square().sum(), low)
    torch.testing.assert_close(sliced, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad_sliced, grad_whole, atol=1e-6, rtol=1e-6)


def test_training_at_a_stride_moves_the_upsampler_and_lowers_the_soft_deletion():
    torch.manual_seed(0)
    clf = colour_classifier()
    x, y = colour_images(4)
    config = AHAConfig(**FAST, lr=3e-3, warmup=0.0, references=("mean",), targets="pred", peak_weight=0.0,
                       decoder_stride=4)  # fmt: skip
    aha = AHA(clf, config)
    scales = [p.detach().clone() for p in aha.decoder.upsample.parameters()]
    history = aha.fit(_Pairs(x, y), epochs=30, batch_size=4, progress=False)
    first, last = sum(history["deletion"][:5]) / 5, sum(history["deletion"][-5:]) / 5
    assert last < first - 0.01, f"soft deletion AUC fell only from {first:.3f} to {last:.3f}"
    moved = [not torch.equal(a, b) for a, b in zip(scales, aha.decoder.upsample.parameters(), strict=True)]
    assert all(moved)


@pytest.mark.parametrize("mode", ["decoder", "map"])
def test_refinement_at_a_stride_starts_from_the_map_and_moves_it(mode):
    clf = colour_classifier()
    aha = AHA(clf, AHAConfig(**FAST, decoder_stride=4, refine_mode=mode))
    x, _ = colour_images(3)
    target = clf(x).argmax(1)
    assert_tail_starts_as_decoder(aha, x, target)
    refined = aha.attribute(x, target, refine_steps=3, seed=0)
    assert refined.shape == (3, 32, 32) and not torch.allclose(refined, aha.attribute(x, target), atol=1e-3)


def test_a_checkpoint_keeps_the_stride_and_an_older_one_loads_at_full_resolution(tmp_path):
    clf = colour_classifier()
    x, y = colour_images(2)
    aha = AHA(clf, AHAConfig(**FAST, decoder_stride=8, decoder_upsample="guided"))
    aha.fit(_Pairs(x, y), epochs=1, batch_size=2, progress=False)
    aha.save(tmp_path / "s8")
    loaded = AHA.load(tmp_path / "s8", clf)
    assert loaded.config.decoder_stride == 8 and loaded.config.decoder_upsample == "guided"
    torch.testing.assert_close(loaded.attribute(x), aha.attribute(x), atol=0, rtol=0)

    AHA(clf, AHAConfig(**FAST)).save(tmp_path / "old")
    meta = json.loads((tmp_path / "old" / CONFIG_FILE).read_text())
    del meta["config"]["decoder_stride"], meta["config"]["decoder_upsample"]
    (tmp_path / "old" / CONFIG_FILE).write_text(json.dumps(meta))
    assert AHA.load(tmp_path / "old", clf).config.decoder_stride == 1
