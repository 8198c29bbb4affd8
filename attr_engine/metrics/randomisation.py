"""Randomisation check: random logit (Sixt et al., ICML 2020), as Quantus 0.6.0 ``RandomLogit`` computes it.

The map for the target class is compared with the map the same explainer gives for a random *other* class; a
class-sensitive explainer gives dissimilar maps, so lower similarity is better. The other class is drawn uniformly
from the ``K - 1`` classes that are not the target (Quantus draws ``r`` in ``[0, K - 2]`` and takes the ``r``-th
class of the sorted others, i.e. ``r + (r >= target)``, which is what is done here too).

Similarities (batched, float64, on the maps' device), both on the *flattened* maps as Quantus compares them:

- ``"ssim"`` (Quantus' default): skimage's ``structural_similarity`` of the two flattened maps treated as 1-D
  signals: 7-sample uniform window, sample covariance, ``K1 = 0.01``, ``K2 = 0.03``, data range = max - min over both
  maps, mean over the windows that fit inside the signal.
- ``"pearson"`` (what the Semantic Pullback paper reports): Pearson correlation.

Quantus normalises maps by default (``normalise=True``: divided by the maximum ``|value|`` over the whole batch);
here ``normalise="max"`` divides each map by its own maximum, so a score does not depend on which other images share
the batch. Pass ``normalise="batch_max"`` to reproduce Quantus' default exactly (for a batch of at most its
``batch_size`` images). Pearson is unaffected by either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attr_engine.metrics._checks import check_images
from attr_engine.metrics._maps import Explain, call_explainer, prepare_maps
from attr_engine.metrics.robustness import resolve_explainer_target
from attr_engine_kernels.validate import check_int_at_least

__all__ = ["SIMILARITIES", "pearson_similarity", "random_logit", "random_other_class", "ssim_similarity"]

SIMILARITIES: tuple[str, ...] = ("ssim", "pearson")
_SSIM_WINDOW = 7
_SSIM_K1, _SSIM_K2 = 0.01, 0.03


def ssim_similarity(a: torch.Tensor, b: torch.Tensor, *, win_size: int = _SSIM_WINDOW) -> torch.Tensor:
    """Mean SSIM of paired 1-D signals, as ``skimage.metrics.structural_similarity`` with its defaults.

    Args:
        a, b: (B, N) signals (flattened maps), N >= ``win_size``.
        win_size: odd uniform-window length.

    Returns:
        (B,) float64; NaN where both signals are one constant (zero data range), as skimage.
    """
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"a and b must both be (B, N), got {tuple(a.shape)} and {tuple(b.shape)}")
    check_int_at_least(win_size, "win_size", 3)
    if win_size % 2 == 0 or a.shape[1] < win_size:
        raise ValueError(f"win_size must be odd and at most the signal length {a.shape[1]}, got {win_size}")
    a, b = a.double(), b.double()
    # skimage filters the whole signal and then crops (win_size - 1) / 2 samples per side: exactly the windows that
    # lie inside the signal, i.e. a 'valid' moving average, so the filter's border mode never matters.
    stacked = torch.stack([a, b, a * a, b * b, a * b], dim=1)  # (B, 5, N)
    ux, uy, uxx, uyy, uxy = F.avg_pool1d(stacked, win_size, stride=1).unbind(dim=1)
    cov_norm = win_size / (win_size - 1)
    vx, vy, vxy = cov_norm * (uxx - ux * ux), cov_norm * (uyy - uy * uy), cov_norm * (uxy - ux * uy)
    data_range = torch.maximum(a.amax(dim=1), b.amax(dim=1)) - torch.minimum(a.amin(dim=1), b.amin(dim=1))
    c1 = ((_SSIM_K1 * data_range) ** 2)[:, None]
    c2 = ((_SSIM_K2 * data_range) ** 2)[:, None]
    s = (2 * ux * uy + c1) * (2 * vxy + c2) / ((ux * ux + uy * uy + c1) * (vx + vy + c2))
    return s.mean(dim=1)


def pearson_similarity(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of paired signals. a, b: (B, N) -> (B,) float64 (NaN for a constant signal)."""
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"a and b must both be (B, N), got {tuple(a.shape)} and {tuple(b.shape)}")
    a = a.double() - a.double().mean(dim=1, keepdim=True)
    b = b.double() - b.double().mean(dim=1, keepdim=True)
    return (a * b).sum(dim=1) / (a.norm(dim=1) * b.norm(dim=1))


def random_other_class(
    target: torch.Tensor, num_classes: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """A class drawn uniformly from the ``num_classes - 1`` classes other than each target. target: (B,) -> (B,)."""
    check_int_at_least(num_classes, "num_classes", 2)
    r = torch.randint(0, num_classes - 1, target.shape, generator=generator, device=target.device)
    return r + (r >= target).long()


def random_logit(
    explain: Explain,
    x: torch.Tensor,
    target: int | torch.Tensor | None = None,
    *,
    maps: torch.Tensor | None = None,
    num_classes: int | None = None,
    similarity: str = "ssim",
    off_target: torch.Tensor | None = None,
    abs: bool = False,
    normalise: str | None = "max",
    generator: torch.Generator | None = None,
    batch_size: int = 64,
) -> torch.Tensor:
    """Similarity between the explanation of the target class and of a random other class (lower is better).

    Args:
        explain: ``explain(images (N, 3, H, W), target (N,)) -> (N, H, W) or (N, C, H, W)``.
        x: (B, 3, H, W) images.
        target: class per image; ``None`` takes ``explain.classifier``'s prediction.
        maps: the target-class explanations of ``x``, if already computed.
        num_classes: K; ``None`` reads ``explain.classifier.num_classes``. Not needed with ``off_target``.
        similarity: ``"ssim"`` or ``"pearson"`` (see the module docstring).
        off_target: (B,) the other classes to explain instead of drawing them (to share randomness).
        abs, normalise: map preprocessing as Quantus' (``normalise`` None, ``"max"`` or ``"batch_max"``).
        generator: for drawing the other classes (on ``x``'s device).
        batch_size: images per explainer call.

    Returns:
        (B,) float32 similarities on ``x``'s device.
    """
    x = check_images(x)
    target = resolve_explainer_target(explain, x, target)
    if similarity not in SIMILARITIES:
        raise ValueError(f"similarity must be one of {SIMILARITIES}, got {similarity!r}")
    check_int_at_least(batch_size, "batch_size", 1)
    if off_target is None:
        if num_classes is None:
            classifier = getattr(explain, "classifier", None)
            if classifier is None:
                raise ValueError("pass num_classes (or off_target), or an explainer with a .classifier")
            num_classes = classifier.num_classes
        off_target = random_other_class(target, num_classes, generator)
    else:
        if not isinstance(off_target, torch.Tensor) or off_target.is_floating_point() or off_target.dtype == torch.bool:
            raise ValueError(f"off_target must be an integer tensor of classes, got {off_target!r}")
        off_target = off_target.to(x.device).long()
        if off_target.shape != target.shape or bool((off_target == target).any()) or bool((off_target < 0).any()):
            raise ValueError("off_target must be (B,) classes, each different from its image's target")
    if maps is None:
        maps = torch.cat(
            [call_explainer(explain, c, t) for c, t in zip(x.split(batch_size), target.split(batch_size), strict=True)]
        )
    other = torch.cat(
        [call_explainer(explain, c, t) for c, t in zip(x.split(batch_size), off_target.split(batch_size), strict=True)]
    )
    a = prepare_maps(maps, x, abs=abs, normalise=normalise).flatten(1)
    b = prepare_maps(other, x, abs=abs, normalise=normalise, name="off-target maps").flatten(1)
    score = ssim_similarity(a, b) if similarity == "ssim" else pearson_similarity(a, b)
    return score.float()
