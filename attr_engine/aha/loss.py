"""The soft deletion/insertion AUC objective of AHA (methods.md section 1), built on the fused kernels.

One evaluation of the objective for maps A (B, H, W):
  region scores s = region_pool(A, g, offset) (B, g*g)  ->  soft top-k masks for S fractions, from s (deletion:
  most important first) and from -s (insertion: least important first)  ->  perturbed images
  x + up(m) * (r - x) (B, S, C, H, W), the upsampled masks Gaussian-smoothed in training as the official code does
  (``mask_sigma``)  ->  softmax probability of the target class  ->  trapezoid AUC.
loss = delAUC + (1 - insAUC) + w * mean(relu(A - avgpool(A))^2).

What enters the sorter is set by ``score_norm`` (:func:`sorter_scores`). Raw region scores (paper, official code)
act through their scale as an inverse temperature (the cost -(s_i - a_j)^2 changes by 2 s_i a_j / tau between rank
slots), so the explainer must first learn how sharply to rank. The default z-scores each image's scores and ranks
them against anchors spanning [-2, 2] (``anchor_span`` 4): the sharpness is fixed by the schedule's temperature and
training moves only the order. The comparison behind this default: docs/aha_config.md (``score_norm``).

The settings a config fixes for every call (sorter iterations, peak penalty, mask smoothing, score normalisation,
autocast) come from :meth:`AHAConfig.loss_kwargs <attr_engine.aha.config.AHAConfig.loss_kwargs>`, the same in a
training step and a refinement step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import attr_engine_kernels as kernels
from attr_engine.classifier import Classifier, images_per_call


@dataclass
class SoftAUC:
    """Result of :func:`soft_auc_loss`.

    Attributes:
        loss: scalar objective (mean over the batch).
        deletion: (B,) soft deletion AUC (lower is better).
        insertion: (B,) soft insertion AUC (higher is better).
        deletion_curve, insertion_curve: (B, S) target probabilities at each fraction.
    """

    loss: torch.Tensor
    deletion: torch.Tensor
    insertion: torch.Tensor
    deletion_curve: torch.Tensor
    insertion_curve: torch.Tensor


# A curve whose target probability moves by less than this (one percentage point) between its lowest and highest
# point is flat: its AUC hardly depends on the map, so it gives the decoder (almost) no gradient.
FLAT_SPREAD = 0.01


def curve_spread(curves: torch.Tensor) -> torch.Tensor:
    """How far the target probability moves along each curve: max - min over the fractions. (B, S) -> (B,)."""
    return curves.amax(dim=1) - curves.amin(dim=1)


def flat_curves(deletion: torch.Tensor, insertion: torch.Tensor, eps: float = FLAT_SPREAD) -> torch.Tensor:
    """(B,) bool: each image's deletion and insertion curves, (B, S) each, both spread less than ``eps``.

    Both curves run from the image (fraction 0) to the reference (fraction 1), so each spreads at least
    ``|p(x) - p(r)|``: a flat pair needs a reference the classifier scores like the image for that target. Both
    AUCs then lie within ``eps`` of ``p(x)``, so the pair's loss term ``deletion + (1 - insertion)`` is 1 up to
    ``2 eps`` whatever the map, and its gradient is as small.
    """
    return (curve_spread(deletion) < eps) & (curve_spread(insertion) < eps)


def trapezoid_auc(curve: torch.Tensor, fractions: torch.Tensor) -> torch.Tensor:
    """Area under (fractions, curve) by the trapezoid rule, normalised by the fraction span. curve: (B, S) -> (B,)."""
    widths = fractions[1:] - fractions[:-1]
    area = ((curve[:, 1:] + curve[:, :-1]) * 0.5 * widths).sum(dim=1)
    return area / (fractions[-1] - fractions[0]).clamp_min(1e-12)


def peak_penalty(maps: torch.Tensor, kernel: int) -> torch.Tensor:
    """mean(relu(A - avgpool_k(A))^2): discourages isolated spikes. maps: (B, H, W) -> scalar."""
    local = F.avg_pool2d(maps[:, None], kernel, stride=1, padding=kernel // 2, count_include_pad=False)[:, 0]
    return F.relu(maps - local).square().mean()


def sorter_scores(scores: torch.Tensor, score_norm: str, anchor_span: float = 4.0) -> torch.Tensor:
    """The region scores (B, N) as the sorter sees them: raw, or z-scored per image and scaled by ``anchor_span``.

    The sorter's anchors span [0, 1] (``attr_engine_kernels.rank_anchors``). Ranking z-scores against anchors spanning
    ``[-span / 2, span / 2]`` costs ``-(z_i - (span a_j - span / 2))^2 = 2 span z_i a_j + (terms constant along a
    row or a column)``, and Sinkhorn cancels such terms, so it equals ranking ``span * z`` against the [0, 1]
    anchors: that is what is passed on. Standardising fixes how sharply the ranking is drawn at a given tau,
    whatever the map's scale.
    """
    if score_norm == "raw":
        return scores
    if score_norm != "zscore":
        raise ValueError(f"score_norm must be 'raw' or 'zscore', got {score_norm!r}")
    return standardise(scores, dim=1, scale=anchor_span)


def standardise(values: torch.Tensor, dim: int | tuple[int, ...], scale: float = 1.0) -> torch.Tensor:
    """``values`` shifted to mean 0 and scaled to (population) standard deviation ``scale`` along ``dim``."""
    centred = values - values.mean(dim=dim, keepdim=True)
    # rsqrt(var + eps): finite values and gradients for a constant input (std 0: all zeros), unlike dividing by std().
    inv_std = torch.rsqrt(centred.square().mean(dim=dim, keepdim=True) + 1e-12)
    # No multiply by a Python 1.0 (exact, so the values are the same): an exported graph would carry it as a constant
    # Mul, which onnxruntime's optimiser mishandles in graphs from the legacy exporter (microsoft/onnxruntime#32413).
    return centred * inv_std if scale == 1.0 else scale * centred * inv_std


def target_probabilities(
    classifier: Classifier, images: torch.Tensor, target: torch.Tensor, *, amp: bool = False
) -> torch.Tensor:
    """Softmax probability of each curve's target class. images: (B, S, C, H, W), target: (B,) -> (B, S)."""
    bsz, steps = images.shape[:2]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp and images.is_cuda):
        logits = classifier.forward_trusted(images.flatten(0, 1))  # blends of validated images
    probs = logits.float().softmax(dim=-1).view(bsz, steps, -1)
    return probs.gather(2, target.view(bsz, 1, 1).expand(bsz, steps, 1))[..., 0]


def blend_probabilities(
    classifier: Classifier,
    x: torch.Tensor,
    reference: torch.Tensor,
    masks: torch.Tensor,
    target: torch.Tensor,
    *,
    offset: tuple[float, float],
    mask_sigma: float,
    amp: bool = False,
) -> torch.Tensor:
    """The target probability of each blend ``x + up(m) * (reference - x)``: (B, S) for masks (B, S, g, g).

    x, reference: (B, C, H, W); target: (B,). The B x S blends go through the classifier in groups of at most
    :func:`~attr_engine.classifier.images_per_call` (on a CPU; all at once elsewhere), each group recomputed in the
    backward instead of keeping its activations (``torch.utils.checkpoint``): a training step at 224 px would
    otherwise hold every blend's activations at once. Each blend is computed on its own (per image and fraction),
    so the grouping changes neither the probabilities nor their gradients (up to float rounding); it costs one
    more classifier forward per group in the backward, and only where the blends exceed the limit.
    """
    bsz, steps = masks.shape[:2]
    per_call = images_per_call(x.shape[-2], x.shape[-1], x.device)
    if per_call is None or per_call >= bsz * steps:
        return _blend_group(classifier, x, reference, masks, target, offset, mask_sigma, amp)
    # Whole curves per group where one fits, else pieces of one curve.
    rows, cols = (per_call // steps, steps) if per_call >= steps else (1, per_call)
    recompute = torch.is_grad_enabled() and masks.requires_grad
    curves = []
    for b in range(0, bsz, rows):
        pieces = []
        for s in range(0, steps, cols):
            args = (x[b : b + rows], reference[b : b + rows], masks[b : b + rows, s : s + cols], target[b : b + rows])
            extra = (offset, mask_sigma, amp)
            if recompute:
                pieces.append(checkpoint(_blend_group, classifier, *args, *extra, use_reentrant=False))
            else:
                pieces.append(_blend_group(classifier, *args, *extra))
        curves.append(torch.cat(pieces, dim=1))
    return torch.cat(curves)


def _blend_group(
    classifier: Classifier,
    x: torch.Tensor,
    reference: torch.Tensor,
    masks: torch.Tensor,
    target: torch.Tensor,
    offset: tuple[float, float],
    mask_sigma: float,
    amp: bool,
) -> torch.Tensor:
    """masks: (b, s, g, g) over x, reference: (b, C, H, W) -> (b, s) target probabilities, in one classifier call."""
    images = kernels.soft_mask_blend(x, reference, masks, offset, smooth_sigma=mask_sigma, validate=False)
    return target_probabilities(classifier, images, target, amp=amp)


def soft_auc_loss(
    classifier: Classifier,
    x: torch.Tensor,
    maps: torch.Tensor,
    target: torch.Tensor,
    reference: torch.Tensor,
    *,
    grid: int,
    fractions: torch.Tensor,
    tau: float,
    n_iters: int,
    offset: tuple[float, float] = (0.0, 0.0),
    noise: float = 1.0,
    generator: torch.Generator | int | None = None,
    peak_weight: float = 0.0,
    peak_kernel: int = 3,
    mask_sigma: float = 0.0,
    score_norm: str = "raw",
    anchor_span: float = 4.0,
    amp: bool = False,
    endpoints: tuple[torch.Tensor, torch.Tensor] | None = None,
    drop_flat: bool = False,
) -> SoftAUC:
    """Differentiable deletion and insertion AUC of ``maps`` for ``classifier``.

    Args:
        classifier: frozen classifier taking [0, 1] images.
        x: (B, C, H, W) images; maps: (B, H, W) raw attribution scores; target: (B,) classes to explain.
        reference: (B, C, H, W) image that removed regions are blended towards.
        grid: g, the region grid is g x g; offset: sub-cell grid shift (fractions of a cell).
        fractions: (S,) increasing fractions in [0, 1] at which the curves are sampled.
        tau, n_iters, noise, generator: the Gumbel-Sinkhorn sorter (see :func:`attr_engine_kernels.soft_topk_masks`).
        peak_weight, peak_kernel: the peak penalty term.
        mask_sigma: Gaussian smoothing of the upsampled masks before blending, in pixels (official training: 1.0
            at 224 px, 7 taps, reflect padding, clamped to [0, 1]; see
            :func:`attr_engine_kernels.soft_mask_blend`); 0 blends with the hard cell masks. Training passes
            ``AHAConfig.mask_sigma``; evaluation never smooths.
        score_norm, anchor_span: what enters the sorter: ``"raw"`` region scores, or ``"zscore"`` (each image's
            scores standardised over its cells, then ranked against anchors spanning ``anchor_span``; see
            :func:`sorter_scores`).
        amp: bf16 autocast of the classifier on CUDA.
        endpoints: ``(p_image, p_reference)``, each (B,): the target probabilities of ``x`` and of ``reference``,
            given when ``fractions`` starts at 0 and ends at 1. At those two fractions every cell is kept or every
            cell removed whatever the map, so the curves' end values carry no gradient; with them given, the
            classifier runs only at the interior fractions (2 x (S - 2) passes per image instead of 2 x S).
            Test-time refinement computes them once for all its steps.
        drop_flat: average the loss over the images whose curves are not flat (:func:`flat_curves`) instead of over
            all: ``1 + mean(deletion - insertion)`` over those, which is the usual loss when none is flat; a flat
            pair adds ~0 to the gradient but counts in the mean, diluting the rest. The AUCs returned are all.

    Returns:
        :class:`SoftAUC` with the scalar loss and per-image AUCs and curves.
    """
    bsz = x.shape[0]
    inner = fractions
    if endpoints is not None:
        if fractions.numel() < 3 or float(fractions[0]) != 0.0 or float(fractions[-1]) != 1.0:
            raise ValueError("endpoints need fractions that run from 0 to 1 with at least one fraction between")
        inner = fractions[1:-1]
    scores = sorter_scores(kernels.region_pool(maps, grid, offset).flatten(1), score_norm, anchor_span)
    # Deletion ranks the map, insertion its negation; both go through the sorter and the classifier as one batch.
    # The inputs were validated where the training step or the refinement began: no kernel reads them again (each
    # data check would be a host-device synchronisation inside the step).
    both = torch.cat((scores, -scores), dim=0)
    masks = kernels.soft_topk_masks(
        both, inner, tau=tau, n_iters=n_iters, noise=noise, generator=generator, validate=False
    )
    masks = masks.view(2 * bsz, inner.numel(), grid, grid)
    curves = blend_probabilities(
        classifier, torch.cat((x, x)), torch.cat((reference, reference)), masks, torch.cat((target, target)),
        offset=offset, mask_sigma=mask_sigma, amp=amp,
    )  # fmt: skip
    if endpoints is not None:
        # Both curves blend towards the reference (insertion removes the least important cells first): each
        # runs from the image at fraction 0 to the reference at fraction 1.
        p_image, p_ref = (p.detach().to(curves.dtype)[:, None].repeat(2, 1) for p in endpoints)
        curves = torch.cat((p_image, curves, p_ref), dim=1)
    aucs = trapezoid_auc(curves, fractions.to(curves.dtype))
    deletion, insertion = aucs[:bsz], aucs[bsz:]
    if drop_flat:
        keep = (~flat_curves(curves[:bsz].detach(), curves[bsz:].detach())).to(aucs.dtype)
        loss = 1.0 + ((deletion - insertion) * keep).sum() / keep.sum().clamp_min(1.0)
    else:
        loss = deletion.mean() + (1.0 - insertion).mean()
    if peak_weight > 0:
        loss = loss + peak_weight * peak_penalty(maps, peak_kernel)
    return SoftAUC(loss, deletion, insertion, curves[:bsz], curves[bsz:])
