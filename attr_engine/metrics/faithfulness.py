"""Faithfulness metrics beyond deletion / insertion: positive / negative perturbation AUC and infidelity.

**Positive / negative perturbation** (Pos / Neg), as the AHA paper reports them (after Chefer et al., "Transformer
interpretability beyond attention visualization", CVPR 2021): pixels are removed - moved to the reference image,
by default the classifier's mean colour - in the order the map ranks them, and the score is the softmax probability
of the class predicted on the clean image. *Pos* removes the most important pixels first (lower is better), *Neg* the
least important first (higher is better). The removed fractions default to 0, 0.1, ..., 0.9 as in Chefer et al.,
and the AUC is the trapezoid over those fractions (so it lies in [0, 0.9]). With ``fractions`` 0, 0.05, ..., 1 the two
numbers equal AHA-protocol deletion and insertion (:func:`~attr_engine.metrics.deletion_insertion`).
``score="accuracy"`` scores whether the top-1 prediction is still the target instead (Chefer et al.'s own measure).

**Infidelity** (Yeh et al., NeurIPS 2019) compares, over perturbations ``I`` of the input, the attribution's
prediction ``a = sum(A * I)`` with the classifier's response ``b = f_t(x) - f_t(x - I)`` (``f_t`` the target logit):

- ``scaling="none"``: Quantus 0.6.0 ``Infidelity``: ``mean((a - b)^2)``. Its perturbations replace square patches
  *cumulatively* (patch 1, then patches 1-2, ...) by a baseline value, in row-major patch order, for each patch
  size and sample; the score is the mean over samples of the mean over patch sizes of the mean over patches.
- ``scaling="optimal"``: the variant of the Semantic Pullback paper (and Captum's ``normalize=True``): the
  attribution is rescaled by ``beta = E[a b] / E[a^2]`` (pooled over every perturbation of the image), and the
  score is ``E[(beta a - b)^2]``, so it does not depend on the map's scale.

:func:`infidelity_from_perturbations` takes arbitrary perturbations (e.g. Gaussian noise, as in Captum's
``infidelity``) instead of patches.

Everything is batched on ``x``'s device; perturbed images are made on the fly in chunks of ``batch_size``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from attr_engine.classifier import Classifier
from attr_engine.imageops import resolve_reference
from attr_engine.metrics._checks import check_classifier, check_images, check_pixel_maps, resolve_target
from attr_engine.metrics._maps import prepare_maps
from attr_engine.metrics.curves import batched_logits, perturbation_curve, target_probability
from attr_engine.metrics.perturbation import pixel_ranks
from attr_engine_kernels.validate import check_int_at_least, check_tensor

__all__ = [
    "INFIDELITY_BASELINES",
    "POS_NEG_FRACTIONS",
    "PerturbationAUC",
    "infidelity",
    "infidelity_from_perturbations",
    "patch_grid",
    "perturbation_auc",
]

POS_NEG_FRACTIONS: tuple[float, ...] = tuple(k / 10 for k in range(10))
# Quantus' baseline names: "black" / "white" are the image's own minimum / maximum value, "mean" its mean value (all
# recomputed on the partly perturbed image before each patch), "uniform" one U(low, high) value per patch and image.
INFIDELITY_BASELINES: tuple[str, ...] = ("black", "white", "mean", "uniform")
_SCORES = ("probability", "accuracy")
_OUTPUTS = ("logit", "probability")
_SCALINGS = ("none", "optimal")


# ---------------------------------------------------------------------------------------------------------------
# Positive / negative perturbation
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class PerturbationAUC:
    """Result of :func:`perturbation_auc`.

    Attributes:
        positive: (B,) Pos AUC, most important pixels removed first (lower is better).
        negative: (B,) Neg AUC, least important pixels removed first (higher is better).
        fractions: (F,) removed fractions.
        positive_curve, negative_curve: (B, F) scores at each fraction.
        target: (B,) the scored class.
    """

    positive: torch.Tensor
    negative: torch.Tensor
    fractions: torch.Tensor
    positive_curve: torch.Tensor
    negative_curve: torch.Tensor
    target: torch.Tensor


def _top1_hit(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(N,) 1.0 where the top-1 class is the target, else 0.0 (Chefer et al.'s accuracy score)."""
    return (logits.float().argmax(dim=1) == target).float()


def _check_fractions(fractions: Sequence[float]) -> list[float]:
    try:
        values = [float(f) for f in fractions]
    except (TypeError, ValueError):
        raise ValueError(f"fractions must be a sequence of numbers, got {fractions!r}") from None
    if len(values) < 2 or any(not 0.0 <= f <= 1.0 for f in values):
        raise ValueError(f"fractions must be at least two numbers in [0, 1], got {values}")
    if any(b <= a for a, b in itertools.pairwise(values)):
        raise ValueError(f"fractions must be strictly increasing, got {values}")
    return values


def perturbation_auc(
    classifier: Classifier,
    x: torch.Tensor,
    maps: torch.Tensor,
    target: int | torch.Tensor | None = None,
    *,
    fractions: Sequence[float] = POS_NEG_FRACTIONS,
    score: str = "probability",
    reference: str | torch.Tensor = "mean",
    batch_size: int = 256,
) -> PerturbationAUC:
    """Positive and negative perturbation curves and AUCs (hard pixel ranking; see the module docstring).

    Args:
        classifier: the frozen classifier, on ``x``'s device.
        x: (B, 3, H, W) images in [0, 1].
        maps: (B, H, W) maps, or (B, C, H, W) summed over channels; higher = more important.
        target: class to score; ``None`` takes the class predicted on the clean image.
        fractions: increasing removed fractions in [0, 1]; ``round(f * H * W)`` pixels (halves up) are removed.
        score: ``"probability"`` (softmax of the target) or ``"accuracy"`` (1 while the top-1 class is the target).
        reference: what removed pixels become: ``"mean"``, ``"black"``, ``"blur"`` or a (B | 1, 3, H, W) tensor.
        batch_size: perturbed images per classifier call.

    Returns:
        :class:`PerturbationAUC`, float32 on ``x``'s device.
    """
    x = check_images(x)
    classifier = check_classifier(classifier, x)
    batch, _, height, width = x.shape
    maps = check_pixel_maps(maps, (batch, height, width)).to(x.device)
    values = _check_fractions(fractions)
    if score not in _SCORES:
        raise ValueError(f"score must be one of {_SCORES}, got {score!r}")
    check_int_at_least(batch_size, "batch_size", 1)
    num_pixels = height * width
    counts = torch.tensor([math.floor(f * num_pixels + 0.5) for f in values], device=x.device)

    with torch.no_grad():
        ref = resolve_reference(reference, x, classifier.norm_mean)
        target = resolve_target(target, batched_logits(classifier, x, batch_size))
        scorer = target_probability if score == "probability" else _top1_hit

        def curve(ranks: torch.Tensor) -> torch.Tensor:
            return perturbation_curve(classifier, x, ref, ranks, counts, target, batch_size, score=scorer)

        positive_curve = curve(pixel_ranks(maps))
        negative_curve = curve(pixel_ranks(-maps))
        frac = torch.tensor(values, dtype=torch.float32, device=x.device)
        return PerturbationAUC(
            positive=torch.trapezoid(positive_curve, frac, dim=1),
            negative=torch.trapezoid(negative_curve, frac, dim=1),
            fractions=frac,
            positive_curve=positive_curve,
            negative_curve=negative_curve,
            target=target,
        )


# ---------------------------------------------------------------------------------------------------------------
# Infidelity
# ---------------------------------------------------------------------------------------------------------------


def patch_grid(height: int, width: int, patch_size: int, device: torch.device | None = None) -> torch.Tensor:
    """Patch index of every pixel for square patches of ``patch_size``, numbered row-major.

    Where the size does not divide the image, the grid is centred the way Quantus pads (floor of half the shortfall
    before, ceil after), so border patches are clipped. (Quantus 0.6.0 itself fails on such sizes.)

    Returns:
        (H, W) int64 patch ids in ``[0, ceil(H / p) * ceil(W / p))``.
    """
    check_int_at_least(patch_size, "patch_size", 1)
    if patch_size > min(height, width):
        raise ValueError(f"patch_size {patch_size} is larger than the image ({height} x {width})")
    pad_h = (-height % patch_size) // 2
    pad_w = (-width % patch_size) // 2
    cols = -(-(width + (-width % patch_size)) // patch_size)
    rows_id = (torch.arange(height, device=device) + pad_h) // patch_size
    cols_id = (torch.arange(width, device=device) + pad_w) // patch_size
    return rows_id[:, None] * cols + cols_id[None, :]


def _target_scores(logits: torch.Tensor, target: torch.Tensor, output: str) -> torch.Tensor:
    logits = logits.double()
    if output == "probability":
        logits = logits.softmax(dim=1)
    return logits.gather(1, target[:, None]).squeeze(1)


def _chunked_scores(
    classifier: Classifier, images: torch.Tensor, target: torch.Tensor, output: str, batch_size: int
) -> torch.Tensor:
    """Target scores of a stack of images, ``batch_size`` images per classifier call. Returns (N,) float64."""
    chunks = zip(images.split(batch_size), target.split(batch_size), strict=True)
    return torch.cat([_target_scores(classifier.forward_trusted(c), t, output) for c, t in chunks])


def _check_common(
    classifier: Classifier, x: torch.Tensor, scaling: str, output: str, batch_size: int
) -> tuple[torch.Tensor, Classifier]:
    x = check_images(x)
    classifier = check_classifier(classifier, x)
    if scaling not in _SCALINGS:
        raise ValueError(f"scaling must be one of {_SCALINGS}, got {scaling!r}")
    if output not in _OUTPUTS:
        raise ValueError(f"output must be one of {_OUTPUTS}, got {output!r}")
    check_int_at_least(batch_size, "batch_size", 1)
    return x, classifier


def _optimal_scaling_loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``E[(beta a - b)^2]`` with ``beta = E[ab] / E[a^2]`` over the last axis (beta's denominator 0 -> 1)."""
    a2, ab, b2 = (a * a).sum(-1), (a * b).sum(-1), (b * b).sum(-1)
    beta = ab / torch.where(a2 != 0, a2, torch.ones_like(a2))
    return (beta * beta * a2 - 2.0 * beta * ab + b2) / a.shape[-1]


def _patch_values(
    kind: str | float,
    x: torch.Tensor,
    patch_ids: torch.Tensor,
    num_patches: int,
    uniform: torch.Tensor | None,
) -> torch.Tensor:
    """Baseline value of each patch, (B, P) float64, following Quantus' definition of ``kind``."""
    flat = x.double().flatten(1)
    batch = x.shape[0]
    if uniform is not None:
        return uniform.double().T.contiguous()
    if isinstance(kind, float):
        return torch.full((batch, num_patches), kind, dtype=torch.float64, device=x.device)
    if kind == "black":  # replaced values equal the minimum, so the running minimum never changes
        return flat.amin(dim=1, keepdim=True).expand(batch, num_patches)
    if kind == "white":
        return flat.amax(dim=1, keepdim=True).expand(batch, num_patches)
    # "mean": each patch gets the mean of the image as perturbed so far, so the value drifts; a running sum tracks it.
    numel = flat.shape[1]
    channels = x.shape[1]
    patch_sums = torch.zeros(batch, num_patches, dtype=torch.float64, device=x.device)
    patch_sums.index_add_(1, patch_ids.flatten(), x.double().sum(dim=1).flatten(1))
    patch_sizes = torch.bincount(patch_ids.flatten(), minlength=num_patches).double() * channels
    total = flat.sum(dim=1)
    values = torch.empty(batch, num_patches, dtype=torch.float64, device=x.device)
    for k in range(num_patches):
        # Rounded to the image dtype, as the value written into the image is.
        values[:, k] = (total / numel).to(x.dtype).double()
        total = total - patch_sums[:, k] + patch_sizes[k] * values[:, k]
    return values


def infidelity(
    classifier: Classifier,
    x: torch.Tensor,
    maps: torch.Tensor,
    target: int | torch.Tensor | None = None,
    *,
    patch_sizes: Sequence[int] = (4,),
    n_samples: int = 10,
    baseline: str | float = "black",
    uniform_range: tuple[float, float] = (0.0, 1.0),
    baseline_values: torch.Tensor | None = None,
    scaling: str = "none",
    output: str = "logit",
    abs: bool = False,
    normalise: str | None = None,
    generator: torch.Generator | None = None,
    batch_size: int = 256,
) -> torch.Tensor:
    """Patch infidelity of attribution maps (lower is better); Quantus 0.6.0 ``Infidelity`` for ``scaling="none"``.

    For each sample and patch size, the patches of the grid (:func:`patch_grid`) are replaced one after the other,
    cumulatively, by a baseline value; after each replacement ``a = sum(A * (x - x_pert))`` (the map broadcast over
    channels) is compared with ``b = f_t(x) - f_t(x_pert)``. See the module docstring for the two reductions.
    Deterministic baselines give the same perturbations in every sample, so they are evaluated once.

    Args:
        classifier: the frozen classifier, on ``x``'s device.
        x: (B, 3, H, W) images in [0, 1].
        maps: (B, H, W), (B, 1, H, W) or (B, 3, H, W) attributions (not summed over channels).
        target: class per image; ``None`` takes the predicted class.
        patch_sizes: square patch sides, each at most the image side (Quantus' default: (4,)).
        n_samples: samples of the (random) baseline (Quantus' default: 10).
        baseline: ``"black"`` / ``"white"`` (the image's minimum / maximum value - Quantus' meaning), ``"mean"`` (the
            mean value of the partly perturbed image), ``"uniform"`` (one U(``uniform_range``) value per patch and
            image), or a number.
        uniform_range: (low, high) of the ``"uniform"`` baseline (Quantus' ``uniform_low`` / ``uniform_high``).
        baseline_values: replaces the uniform draws, shape ``(n_samples, sum of patches over patch_sizes, B)`` in
            Quantus' loop order (sample, patch size, row-major patch): reproduces another implementation's
            randomness, e.g. ``numpy.random.uniform(low, high, size=that_shape)`` after seeding numpy as Quantus
            does.
        scaling: ``"none"`` (Quantus) or ``"optimal"`` (Semantic Pullback paper / Captum ``normalize=True``).
        output: compare ``"logit"`` (Quantus' default, ``softmax=False``) or softmax ``"probability"``.
        abs, normalise: Quantus' map preprocessing (see :func:`~attr_engine.metrics._maps.prepare_maps`).
        generator: for the uniform draws (a generator on ``x``'s device); ``None`` uses the global RNG.
        batch_size: perturbed images per classifier call.

    Returns:
        (B,) float32 infidelity on ``x``'s device.
    """
    x, classifier = _check_common(classifier, x, scaling, output, batch_size)
    batch, _, height, width = x.shape
    attr = prepare_maps(maps, x, abs=abs, normalise=normalise).double()
    sizes = [check_int_at_least(p, "patch_sizes", 1) for p in patch_sizes]
    if not sizes:
        raise ValueError("patch_sizes must name at least one patch size")
    grids = [patch_grid(height, width, p, x.device) for p in sizes]
    counts = [int(g.max()) + 1 for g in grids]
    check_int_at_least(n_samples, "n_samples", 1)
    kind = _check_baseline(baseline)
    if kind != "uniform" and baseline_values is not None:
        raise ValueError("baseline_values replaces the draws of baseline='uniform' only")
    draws = None
    if kind == "uniform":
        draws = _uniform_draws(baseline_values, uniform_range, (n_samples, sum(counts), batch), generator, x.device)
    # Deterministic baselines perturb every sample alike: one pass gives the same score.
    samples = n_samples if draws is not None else 1

    x_channel_sum = (attr * x.double()).sum(dim=1).flatten(1)  # (B, H*W): sum_c A_c x_c per pixel
    attr_channel_sum = attr.sum(dim=1).flatten(1) * (x.shape[1] if attr.shape[1] == 1 else 1)

    with torch.no_grad():
        logits = batched_logits(classifier, x, batch_size)
        target = resolve_target(target, logits)
        clean = _target_scores(logits, target, output)
        # a and b for every (sample, patch size) segment: lists of (B, P) tensors.
        a_terms: list[list[torch.Tensor]] = []
        b_terms: list[list[torch.Tensor]] = []
        for s in range(samples):
            a_row, b_row = [], []
            offset = 0
            for grid, num in zip(grids, counts, strict=True):
                uniform = None if draws is None else draws[s, offset : offset + num]
                offset += num
                # (B, P), rounded to the image dtype so that a sees exactly the pixels the classifier sees.
                values = _patch_values(kind, x, grid, num, uniform).to(x.dtype).double()
                a_row.append(_predicted_differences(grid, num, values, x_channel_sum, attr_channel_sum))
                perturbed = _cumulative_patch_scores(classifier, x, grid, num, values, target, output, batch_size)
                b_row.append(clean[:, None] - perturbed)
            a_terms.append(a_row)
            b_terms.append(b_row)
    return _reduce_infidelity(a_terms, b_terms, scaling).float()


def _check_baseline(baseline: str | float) -> str | float:
    """One of :data:`INFIDELITY_BASELINES`, or a number (as a float)."""
    if isinstance(baseline, bool) or not (isinstance(baseline, int | float) or baseline in INFIDELITY_BASELINES):
        raise ValueError(f"baseline must be one of {INFIDELITY_BASELINES} or a number, got {baseline!r}")
    return float(baseline) if isinstance(baseline, int | float) else baseline


def _uniform_draws(
    given: torch.Tensor | None,
    uniform_range: tuple[float, float],
    shape: tuple[int, int, int],
    generator: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """The ``"uniform"`` baseline's values, (samples, patches over all sizes, B): ``given`` checked, else drawn."""
    if given is not None:
        given = check_tensor(given, "baseline_values", ndim=3, finite=True)
        if tuple(given.shape) != shape:
            raise ValueError(f"baseline_values must have shape {shape}, got {tuple(given.shape)}")
        return given.to(device)
    low, high = (float(v) for v in uniform_range)
    if not low < high:
        raise ValueError(f"uniform_range must be (low, high) with low < high, got {uniform_range!r}")
    draw = torch.rand(*shape, generator=generator, device=device, dtype=torch.float64)
    return low + (high - low) * draw


def _predicted_differences(
    grid: torch.Tensor,
    num: int,
    values: torch.Tensor,
    x_channel_sum: torch.Tensor,
    attr_channel_sum: torch.Tensor,
) -> torch.Tensor:
    """``a = sum(A * (x - x_pert))`` after each cumulative patch replacement, (B, P) float64.

    Replacing patch p by value v_p changes ``sum(A * x)`` by ``sum_p(A x) - v_p sum_p(A)``, so per-patch sums of
    ``A x`` and ``A`` (summed over channels: ``x_channel_sum``, ``attr_channel_sum``, (B, H*W)) and a cumulative
    sum give every ``a`` without building an image.
    """
    batch = values.shape[0]
    ids = grid.flatten()
    s1 = torch.zeros(batch, num, dtype=torch.float64, device=values.device).index_add_(1, ids, x_channel_sum)
    s2 = torch.zeros(batch, num, dtype=torch.float64, device=values.device).index_add_(1, ids, attr_channel_sum)
    return torch.cumsum(s1 - values * s2, dim=1)


def _cumulative_patch_scores(
    classifier: Classifier,
    x: torch.Tensor,
    grid: torch.Tensor,
    num: int,
    values: torch.Tensor,
    target: torch.Tensor,
    output: str,
    batch_size: int,
) -> torch.Tensor:
    """``f_t(x_pert)`` after patches 0..k are replaced by their values, for every k: (B, P) float64.

    The patch id is the pixel's rank, and ``k + 1`` the count: a perturbation curve over patches.
    """
    batch, _, height, width = x.shape
    ranks = grid.flatten().expand(batch, -1)
    fill = values.to(x.dtype).gather(1, ranks).view(batch, 1, height, width)  # each pixel its patch's value
    counts = torch.arange(1, num + 1, device=x.device)
    return perturbation_curve(
        classifier, x, fill, ranks, counts, target, batch_size,
        score=lambda logits, t: _target_scores(logits, t, output), dtype=torch.float64,
    )  # fmt: skip


def _reduce_infidelity(
    a_terms: list[list[torch.Tensor]], b_terms: list[list[torch.Tensor]], scaling: str
) -> torch.Tensor:
    """(B,) score from the (B, P) ``a`` and ``b`` of every (sample, patch size): Quantus' nested means for
    ``"none"``, the optimal scaling pooled over every perturbation of the image for ``"optimal"``."""
    if scaling == "none":
        per_sample = [
            torch.stack([((a - b) ** 2).mean(dim=1) for a, b in zip(a_row, b_row, strict=True)]).mean(dim=0)
            for a_row, b_row in zip(a_terms, b_terms, strict=True)
        ]
        return torch.stack(per_sample).mean(dim=0)
    a_all = torch.cat([t for row in a_terms for t in row], dim=1)
    b_all = torch.cat([t for row in b_terms for t in row], dim=1)
    return _optimal_scaling_loss(a_all, b_all)


def infidelity_from_perturbations(
    classifier: Classifier,
    x: torch.Tensor,
    maps: torch.Tensor,
    perturbations: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
    target: int | torch.Tensor | None = None,
    *,
    n_samples: int = 10,
    scaling: str = "none",
    output: str = "logit",
    abs: bool = False,
    normalise: str | None = None,
    batch_size: int = 256,
) -> torch.Tensor:
    """Infidelity over given perturbations ``I``: ``a = sum(A * I)``, ``b = f_t(x) - f_t(x - I)``.

    With the same perturbations this is Captum's ``infidelity`` (``scaling="optimal"`` is its ``normalize=True``)
    for maps that are local, i.e. not multiplied by the input.

    Args:
        classifier: the frozen classifier, on ``x``'s device.
        x: (B, 3, H, W) images.
        maps: (B, H, W), (B, 1, H, W) or (B, 3, H, W) attributions.
        perturbations: (S, B, 3, H, W) perturbations, or a callable drawing one (B, 3, H, W) perturbation of ``x``
            per call (called ``n_samples`` times), e.g. ``lambda x: 0.003 * torch.randn_like(x)`` (Yeh et al.).
        target: class per image; ``None`` takes the predicted class.
        n_samples: draws of a callable ``perturbations``.
        scaling, output, abs, normalise, batch_size: as in :func:`infidelity`.

    Returns:
        (B,) float32 infidelity on ``x``'s device.
    """
    x, classifier = _check_common(classifier, x, scaling, output, batch_size)
    batch = x.shape[0]
    attr = prepare_maps(maps, x, abs=abs, normalise=normalise).double()
    if isinstance(perturbations, torch.Tensor):
        stored = check_tensor(perturbations, "perturbations", ndim=5, finite=True)
        if stored.shape[1:] != x.shape:
            raise ValueError(f"perturbations must be (S, *x.shape) = (S, {tuple(x.shape)}), got {tuple(stored.shape)}")
        samples = stored.shape[0]
    elif callable(perturbations):
        samples = check_int_at_least(n_samples, "n_samples", 1)
    else:
        raise ValueError(f"perturbations must be a tensor or a callable, got {type(perturbations).__name__}")

    def sample(s: int) -> torch.Tensor:
        out = stored[s] if isinstance(perturbations, torch.Tensor) else perturbations(x)
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            raise ValueError(f"a perturbation must be a tensor shaped like x {tuple(x.shape)}")
        return out.to(device=x.device, dtype=x.dtype)

    with torch.no_grad():
        logits = batched_logits(classifier, x, batch_size)
        target = resolve_target(target, logits)
        clean = _target_scores(logits, target, output)
        a = torch.empty(samples, batch, dtype=torch.float64, device=x.device)
        b = torch.empty(samples, batch, dtype=torch.float64, device=x.device)
        # Several samples share one classifier call when the batch is small.
        group = max(1, batch_size // batch)
        for s0 in range(0, samples, group):
            pert = torch.stack([sample(s) for s in range(s0, min(s0 + group, samples))])  # (g, B, C, H, W)
            a[s0 : s0 + len(pert)] = (attr * pert.double()).flatten(2).sum(dim=2)
            flat = (x - pert).flatten(0, 1)
            scores = _chunked_scores(classifier, flat, target.repeat(len(pert)), output, batch_size)
            b[s0 : s0 + len(pert)] = clean - scores.view(len(pert), batch)
    a, b = a.T, b.T
    score = ((a - b) ** 2).mean(dim=1) if scaling == "none" else _optimal_scaling_loss(a, b)
    return score.float()
