"""Small models for the AHA tests: a hand-built colour classifier with a known decision rule.

The classifier's evidence for class 0 is the mean of (red - green) over the image, for class 1 its negation, so
deleting the reddest pixels first is the optimal deletion order for class 0: an explainer that learns it lowers the
soft deletion AUC markedly, which makes the overfit test meaningful on a CPU budget.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attr_engine.aha import AHA, AHAConfig
from attr_engine.aha.network import PerImageTail
from attr_engine.classifier import Classifier


class ColourNet(nn.Module):
    """Logits (B, 2) = gain * [mean(R - G), -mean(R - G)]; intermediates = pooled colour-difference maps."""

    num_classes = 2

    def __init__(self, gain: float = 40.0) -> None:
        super().__init__()
        # A parameter so the classifier has a state dict (fingerprints) even though the rule is fixed.
        self.gain = nn.Parameter(torch.tensor(float(gain)))

    def _evidence(self, x: torch.Tensor) -> torch.Tensor:
        return (x[:, 0] - x[:, 1])[:, None]

    def forward_intermediates(self, x: torch.Tensor, indices=None, intermediates_only: bool = True, **_):
        ev = self._evidence(x)
        return [
            torch.cat((ev, x), 1),
            F.avg_pool2d(torch.cat((ev, x), 1), 2),
            F.avg_pool2d(ev.expand(-1, 4, -1, -1), 4),
        ]

    @property
    def feature_info(self) -> list[dict]:
        return [{}, {}, {}]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ev = self._evidence(x).mean(dim=(1, 2, 3))
        return self.gain * torch.stack((ev, -ev), dim=1)


# The smallest AHA config that still trains and refines in a test (6 fractions, 8 Sinkhorn iterations, a 16-channel
# decoder, grids 2..6 on 32 px images): shared by the AHA tests.
FAST = {"n_fractions": 6, "n_iters": 8, "decoder_dim": 16, "class_dim": 8, "grid_range": (2, 6)}


def colour_classifier() -> Classifier:
    """ColourNet on raw [0, 1] pixels (identity normalisation), input size 32."""
    return Classifier(ColourNet(), mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), input_size=(3, 32, 32))


def colour_images(n: int, size: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Images with a red blob (class 0) or a green blob (class 1) on a grey textured background."""
    gen = torch.Generator().manual_seed(seed)
    x = 0.4 + 0.1 * torch.rand(n, 3, size, size, generator=gen)
    labels = torch.arange(n) % 2
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    for i in range(n):
        cy, cx = torch.randint(size // 4, 3 * size // 4, (2,), generator=gen).tolist()
        blob = ((yy - cy) ** 2 + (xx - cx) ** 2) < (size // 5) ** 2
        channel = 0 if labels[i] == 0 else 1
        x[i, channel][blob] = 0.9
    return x, labels


def tiny_aha(classifier: Classifier) -> AHA:
    """An untrained AHA with the smallest decoder at 32 px: for checks that the taps, decoder and export run, not
    what they learned."""
    return AHA(classifier, AHAConfig(decoder_dim=8, class_dim=4), img_size=32)


def assert_tail_starts_as_decoder(aha: AHA, x: torch.Tensor, target: torch.Tensor, **tolerance: float) -> None:
    """Per-image copies of the decoder's last layers (:class:`PerImageTail`, depths 1 and 2), before any refinement
    step, give the decoder's own maps for x (B, 3, H, W): refinement starts from the map at T=0. The tail's maps go
    through ``with_terms`` (the upsampling at a stride, the terms that skip the convolutions) as refinement's do.
    ``tolerance``: ``atol`` / ``rtol`` for :func:`torch.testing.assert_close` (its float32 defaults otherwise)."""
    feats = aha.backbone(x)
    with torch.no_grad():
        for depth in (1, 2):
            tail = PerImageTail(aha.decoder, len(x), depth)
            hidden = aha.decoder.hidden(feats, x, target, depth)
            maps = aha.decoder.with_terms(tail(hidden), x)
            torch.testing.assert_close(maps, aha.decoder(feats, x, target), **tolerance)  # type: ignore[arg-type]
