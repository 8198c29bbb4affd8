"""RISE (Petsiuk et al., BMVC 2018): saliency as the probability-weighted average of random masks.

Masks: an ``s x s`` grid of independent Bernoulli(p) cells is upsampled bilinearly to ``(s + 1) * cell`` pixels per
side (``cell = ceil(H / s)``) and cropped at a random offset in ``[0, cell)``, which gives smooth masks that do not
all share the grid's edges. The masked image keeps the pixels where the mask is 1 and fades to the classifier's mean
colour where it is 0 (RISE multiplies the *normalised* image by the mask, i.e. fades to the mean colour too).
``saliency = sum_i P_t(x masked by M_i) * M_i / (N * p)``.

Masks are generated on the device from a seeded generator, ``batch_size`` masked images at a time (masks and
images chunked together), so memory stays at one chunk whatever ``n_masks`` is, and the same seed gives the same
maps whatever the batch size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attr_engine.explainer import Explainer
from attr_engine_kernels.validate import check_int_at_least, check_positive

__all__ = ["RISE", "rise_masks"]

# Masks drawn per generator call; fixed so that the same seed gives the same masks whatever batch_size is.
_MASK_BLOCK = 64


def rise_masks(
    n: int,
    height: int,
    width: int,
    *,
    grid: int = 8,
    p: float = 0.5,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``n`` RISE masks (n, H, W) in [0, 1], float32, drawn from ``generator`` on ``device``."""
    cell_h, cell_w = math.ceil(height / grid), math.ceil(width / grid)
    cells = (torch.rand(n, 1, grid, grid, generator=generator, device=device) < p).float()
    up = F.interpolate(cells, size=((grid + 1) * cell_h, (grid + 1) * cell_w), mode="bilinear", align_corners=False)
    dy = torch.randint(0, cell_h, (n,), generator=generator, device=device)
    dx = torch.randint(0, cell_w, (n,), generator=generator, device=device)
    rows = (dy[:, None] + torch.arange(height, device=device))[:, :, None]  # (n, H, 1)
    cols = (dx[:, None] + torch.arange(width, device=device))[:, None, :]  # (n, 1, W)
    return up[torch.arange(n, device=device)[:, None, None], 0, rows, cols]


class RISE(Explainer):
    """Randomized Input Sampling for Explanation.

    Args:
        classifier: a :class:`~attr_engine.classifier.Classifier` (its mean colour fills masked-out pixels).
        n_masks: masks N (RISE used 4000 at 224 px; fewer suffice at small sizes).
        grid: mask grid side s.
        p: probability that a grid cell is kept.
        batch_size: masked images per classifier call.
        seed: seed of the mask generator; every call uses the same masks.
    """

    name = "rise"
    needs_grad = False

    def __init__(
        self,
        classifier: nn.Module,
        *,
        n_masks: int = 2000,
        grid: int = 8,
        p: float = 0.5,
        batch_size: int = 256,
        seed: int = 0,
    ) -> None:
        super().__init__(classifier)
        self.n_masks = check_int_at_least(n_masks, "n_masks", 1)
        self.grid = check_int_at_least(grid, "grid", 1)
        if not 0.0 < float(p) < 1.0:
            raise ValueError(f"p must be in (0, 1), got {p!r}")
        self.p = check_positive(p, "p")
        self.batch_size = check_int_at_least(batch_size, "batch_size", 1)
        self.seed = seed
        mean = getattr(classifier, "norm_mean", None)
        if mean is None:
            raise ValueError("RISE needs a Classifier: masked pixels fade to its normalisation mean")

    def _attribute(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = x.shape
        # A Classifier's buffer (checked in __init__); self.classifier is typed as any nn.Module.
        fill = self.classifier.norm_mean.to(x.dtype).view(1, 3, 1, 1)  # type: ignore[operator]
        gen = torch.Generator(device=x.device).manual_seed(self.seed)
        saliency = torch.zeros(batch, height, width, dtype=torch.float32, device=x.device)
        # Masks come in fixed blocks, so the random stream - and the maps - do not depend on batch_size; within a
        # block the (image, mask) pairs are classified batch_size at a time.
        for m0 in range(0, self.n_masks, _MASK_BLOCK):
            n = min(_MASK_BLOCK, self.n_masks - m0)
            masks = rise_masks(n, height, width, grid=self.grid, p=self.p, generator=gen, device=x.device)
            for lo in range(0, batch * n, self.batch_size):
                j = torch.arange(lo, min(lo + self.batch_size, batch * n), device=x.device)
                b, m = j // n, j % n
                images = fill + (x[b] - fill) * masks[m, None].to(x.dtype)
                probs = self.classifier(images).float().softmax(dim=1)
                weight = probs.gather(1, target[b, None])  # (len(j), 1)
                saliency.index_add_(0, b, weight[:, :, None] * masks[m])
        return saliency / (self.n_masks * self.p)
