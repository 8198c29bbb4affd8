"""Deletion and insertion: how fast the target probability falls (rises) as pixels are removed (added) in the
order an attribution map ranks them (methods.md sections 1 and 4).

Pixels are ranked hard, per pixel, by the map (descending; ties go to the lower row-major index, via a stable
sort). At fraction f = k / steps the top ``n_k = round(f * H * W)`` pixels are perturbed; the score is the softmax
probability of the target class and the AUC is the trapezoid over f in [0, 1].

Two protocols:
- ``"aha"`` (the official AHA evaluation): one reference image (default the classifier's mean colour) for both
  curves. Deletion replaces the most important pixels first (lower is better); insertion is deletion of the *least*
  important pixels first, so its curve runs from the clean image to the reference (higher is better).
- ``"rise"`` (RISE, Petsiuk et al. 2018): deletion moves pixels onto the reference (default the mean colour, i.e.
  RISE's zero substrate in normalised space); insertion starts from a Gaussian blur of the image (kernel 11,
  sigma 5, as RISE uses whatever the image size) and puts the most important pixels back first.

Cost: the two curve endpoints are whole images (clean, reference, blurred) classified once per image; the
``steps - 1`` interior points of each curve are built on the fly from a rank map, ``where(rank < n_k, end, start)``,
in chunks of ``batch_size`` images, so memory stays at one chunk of images whatever ``steps`` and B are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attr_engine.classifier import Classifier
from attr_engine.imageops import gaussian_blur, resolve_reference
from attr_engine.metrics._checks import check_classifier, check_images, check_pixel_maps, resolve_target
from attr_engine.metrics.curves import batched_logits, perturbation_curve, target_probability
from attr_engine_kernels.validate import check_int_at_least

__all__ = ["PROTOCOLS", "DeletionInsertion", "deletion_insertion", "perturbation_counts", "pixel_ranks"]

PROTOCOLS: tuple[str, ...] = ("aha", "rise")
# RISE's insertion start: a fixed blur, not scaled with the image (its code uses kernel 11, sigma 5 at any size).
RISE_BLUR_KERNEL = 11
RISE_BLUR_SIGMA = 5.0


@dataclass
class DeletionInsertion:
    """Result of :func:`deletion_insertion`.

    Attributes:
        deletion: (B,) deletion AUC (lower is better).
        insertion: (B,) insertion AUC (higher is better).
        fractions: (steps + 1,) perturbed fractions 0, 1/steps, ..., 1.
        deletion_curve, insertion_curve: (B, steps + 1) target probabilities at each fraction.
        target: (B,) the class each curve scores (the clean prediction when ``target=None`` was passed).
    """

    deletion: torch.Tensor
    insertion: torch.Tensor
    fractions: torch.Tensor
    deletion_curve: torch.Tensor
    insertion_curve: torch.Tensor
    target: torch.Tensor


def pixel_ranks(maps: torch.Tensor) -> torch.Tensor:
    """Rank of every pixel under a map, 0 = most important; ties go to the lower row-major index.

    Args:
        maps: (B, H, W) scores.

    Returns:
        (B, H * W) int64 ranks, each row a permutation of 0 .. H*W - 1.
    """
    # + 0.0 turns -0.0 into +0.0: radix sorts (CUDA) order by bit pattern and would split the tie between them.
    scores = maps.flatten(1) + 0.0
    order = torch.argsort(scores, dim=1, descending=True, stable=True)
    # Inverting the permutation by a scatter is O(N) where a second argsort would be another sort.
    positions = torch.arange(order.shape[1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, positions)


def perturbation_counts(num_pixels: int, steps: int) -> list[int]:
    """Pixels perturbed at each fraction k / steps: ``round(k * num_pixels / steps)`` (halves round up), k = 0..steps.

    Integer arithmetic, so the counts do not depend on float rounding of k / steps; they start at 0 and end at
    ``num_pixels``.
    """
    return [(2 * k * num_pixels + steps) // (2 * steps) for k in range(steps + 1)]


def deletion_insertion(
    classifier: Classifier,
    x: torch.Tensor,
    maps: torch.Tensor,
    target: int | torch.Tensor | None = None,
    *,
    steps: int = 20,
    reference: str | torch.Tensor = "mean",
    protocol: str = "aha",
    batch_size: int = 256,
) -> DeletionInsertion:
    """Deletion and insertion curves and AUCs of attribution maps (hard pixel ranking).

    Args:
        classifier: the frozen classifier, on ``x``'s device.
        x: (B, 3, H, W) images in [0, 1].
        maps: (B, H, W) attribution maps, or (B, C, H, W) summed over channels; higher = more important. Moved to
            ``x``'s device.
        target: class to score: ``None`` (the class predicted on the clean image), one int for all images, or (B,).
        steps: number of fraction intervals; the curves have ``steps + 1`` points (20 gives AHA's 21).
        reference: what deleted pixels become: ``"mean"`` (the classifier's normalisation mean, zero in normalised
            space), ``"black"``, ``"blur"`` (strong blur, kernel 37 / sigma 37 scaled from 224 px), or a tensor
            (B, 3, H, W) / (3, H, W). Under ``"rise"`` it is the deletion substrate only.
        protocol: ``"aha"`` (insertion = deletion of the least important pixels first, same reference) or
            ``"rise"`` (insertion of the most important pixels into a blurred image, kernel 11, sigma 5).
        batch_size: images per classifier call; bounds memory at ``batch_size`` perturbed images.

    Returns:
        :class:`DeletionInsertion` with float32 (B,) AUCs and (B, steps + 1) curves on ``x``'s device.

    Raises:
        ValueError: a bad shape, dtype or device, NaN/inf in ``x``, ``maps`` or ``reference``, ``steps`` or
            ``batch_size`` < 1, an unknown ``protocol`` or ``reference``, or a ``target`` out of range.
    """
    x = check_images(x)
    classifier = check_classifier(classifier, x)
    batch, _, height, width = x.shape
    maps = check_pixel_maps(maps, (batch, height, width)).to(x.device)
    check_int_at_least(steps, "steps", 1)
    check_int_at_least(batch_size, "batch_size", 1)
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; expected one of {', '.join(PROTOCOLS)}")

    with torch.no_grad():
        ref = resolve_reference(reference, x, classifier.norm_mean)
        clean_logits = batched_logits(classifier, x, batch_size)
        target = resolve_target(target, clean_logits)
        p_clean = target_probability(clean_logits, target)
        p_ref = target_probability(batched_logits(classifier, ref, batch_size), target)
        # Endpoints (k = 0 and k = steps) are the whole start and end images, scored above once.
        counts = perturbation_counts(height * width, steps)[1:-1]
        ranks = pixel_ranks(maps)

        def curve(
            start: torch.Tensor, end: torch.Tensor, order: torch.Tensor, p_start: torch.Tensor, p_end: torch.Tensor
        ) -> torch.Tensor:
            inner = perturbation_curve(classifier, start, end, order, counts, target, batch_size)
            return torch.cat([p_start[:, None], inner, p_end[:, None]], dim=1)

        deletion_curve = curve(x, ref, ranks, p_clean, p_ref)
        if protocol == "aha":
            insertion_curve = curve(x, ref, pixel_ranks(-maps), p_clean, p_ref)
        else:
            blurred = gaussian_blur(x, RISE_BLUR_KERNEL, RISE_BLUR_SIGMA)
            p_blurred = target_probability(batched_logits(classifier, blurred, batch_size), target)
            insertion_curve = curve(blurred, x, ranks, p_blurred, p_clean)

        fractions = torch.arange(steps + 1, dtype=torch.float32, device=x.device) / steps
        return DeletionInsertion(
            deletion=torch.trapezoid(deletion_curve, fractions, dim=1),
            insertion=torch.trapezoid(insertion_curve, fractions, dim=1),
            fractions=fractions,
            deletion_curve=deletion_curve,
            insertion_curve=insertion_curve,
            target=target,
        )
