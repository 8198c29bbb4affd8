"""The perturbation-curve engine shared by deletion / insertion, positive / negative perturbation and infidelity.

Every one of these metrics classifies images ``where(rank < n, end, start)``: for each image, some pixels (those
whose rank under a map is below a count ``n``, or whose patch id is below it) come from an end image, the rest from
a start image, for a list of counts. :func:`perturbation_curve` builds those images on the fly, in chunks of
``batch_size`` over the flat (image, count) index, and scores each with a callable of the logits, so memory stays at
one chunk of images whatever the number of counts and images.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from attr_engine.classifier import Classifier

__all__ = ["Score", "batched_logits", "perturbation_curve", "target_probability"]

# (logits (N, K), target (N,)) -> (N,) scores of one chunk of perturbed images.
Score = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def batched_logits(classifier: Classifier, images: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Logits (N, K) of ``images`` (N, 3, H, W), ``batch_size`` images per classifier call."""
    return torch.cat([classifier.forward_trusted(chunk) for chunk in images.split(batch_size)])


def target_probability(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(N,) softmax probability of each row's target class, computed in float32 whatever the classifier's dtype:
    probabilities near 0 or 1 are what the curves resolve."""
    return logits.float().softmax(dim=1).gather(1, target[:, None]).squeeze(1)


def perturbation_curve(
    classifier: Classifier,
    start: torch.Tensor,
    end: torch.Tensor,
    ranks: torch.Tensor,
    counts: Sequence[int] | torch.Tensor,
    target: torch.Tensor,
    batch_size: int,
    *,
    score: Score = target_probability,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Scores of ``where(rank < n, end, start)`` for every image and every count ``n``.

    Args:
        classifier: the frozen classifier, on the images' device.
        start: (B, C, H, W) images the curves start from (or (B, 1, H, W), broadcast over channels).
        end: (B, C, H, W) or (B, 1, H, W) images the perturbed pixels are taken from.
        ranks: (B, H * W) integer rank of every pixel (row-major); a pixel is perturbed once its rank is below the
            count, so ranks need not be a permutation (patch ids perturb whole patches at once).
        counts: (K,) counts n, one curve point each.
        target: (B,) class scored for each image.
        batch_size: perturbed images per classifier call.
        score: ``(logits (N, K), target (N,)) -> (N,)``; the default is the target's softmax probability.
        dtype: dtype of the returned scores.

    Returns:
        (B, K) scores of ``dtype`` on the images' device.
    """
    batch = ranks.shape[0]
    height, width = start.shape[-2:]
    device = start.device
    steps = len(counts)
    curve = torch.empty(batch * steps, dtype=dtype, device=device)
    counts_t = torch.as_tensor(counts, dtype=torch.long, device=device)
    # Flat index j = b * steps + k over (image, count): one chunk may straddle images, so every chunk is full.
    for lo in range(0, batch * steps, batch_size):
        j = torch.arange(lo, min(lo + batch_size, batch * steps), device=device)
        b, k = j // steps, j % steps
        perturbed = (ranks[b] < counts_t[k, None]).view(-1, 1, height, width)
        images = torch.where(perturbed, end[b], start[b])
        curve[lo : lo + len(j)] = score(classifier.forward_trusted(images), target[b])
    return curve.view(batch, steps)
