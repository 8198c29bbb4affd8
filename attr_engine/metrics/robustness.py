"""Robustness of explanations to input noise: max-sensitivity (Yeh et al., NeurIPS 2019).

``max_sensitivity = max over samples of ||A(x) - A(x + d)|| / ||A(x)||`` with ``d`` drawn uniformly from
``[-radius, radius]`` for every input value (no clipping), the Frobenius norm over the whole map, and ``A`` explaining
the same target class on the clean and the noisy input. Quantus 0.6.0 ``MaxSensitivity`` (defaults: radius 0.2, 200
samples) and Captum ``sensitivity_max`` (radius 0.02, 10 samples) compute exactly this; where ``||A(x)|| = 0`` the
denominator is taken as 1 (Captum; Quantus returns inf or NaN there).

Noisy copies of all images are explained together, ``batch_size`` at a time, so the explainer must treat the images
of a batch independently (true of gradient methods; AHA with test-time refinement fine-tunes on its batch).
"""

from __future__ import annotations

import torch

from attr_engine.classifier import resolve_targets
from attr_engine.metrics._checks import check_images
from attr_engine.metrics._maps import Explain, call_explainer, prepare_maps
from attr_engine_kernels.validate import check_int_at_least, check_positive, check_tensor

__all__ = ["max_sensitivity", "resolve_explainer_target"]


def resolve_explainer_target(explain: Explain, x: torch.Tensor, target: int | torch.Tensor | None) -> torch.Tensor:
    """(B,) int64 targets; ``None`` takes the class ``explain.classifier`` predicts for ``x``.

    Metrics that explain perturbed inputs need the class fixed up front: the prediction on a noisy copy may differ.
    The package's one resolver (:func:`~attr_engine.classifier.resolve_targets`) does the work.
    """
    return resolve_targets(getattr(explain, "classifier", None), x, target)


def max_sensitivity(
    explain: Explain,
    x: torch.Tensor,
    target: int | torch.Tensor | None = None,
    *,
    maps: torch.Tensor | None = None,
    radius: float = 0.2,
    n_samples: int = 200,
    noise: torch.Tensor | None = None,
    abs: bool = False,
    normalise: str | None = None,
    generator: torch.Generator | None = None,
    batch_size: int = 64,
) -> torch.Tensor:
    """Max-sensitivity of an explainer at ``x`` (lower is better).

    Args:
        explain: ``explain(images (N, 3, H, W), target (N,)) -> (N, H, W) or (N, C, H, W)``, e.g. an
            :class:`~attr_engine.baselines.Explainer`; called on noisy copies of ``x``.
        x: (B, 3, H, W) images.
        target: class per image; ``None`` takes ``explain.classifier``'s prediction on ``x``.
        maps: the explanations of ``x``, if already computed (otherwise ``explain(x, target)``).
        radius: noise bound ``r`` of U(-r, r) (Quantus' ``lower_bound``, Captum's ``perturb_radius``).
        n_samples: noisy copies per image (Quantus' ``nr_samples``).
        noise: (n_samples, B, 3, H, W) noise to add instead of drawing it (to share randomness with another
            implementation); ``radius`` and ``generator`` are then unused.
        abs, normalise: preprocessing of every map, clean and noisy, as in Quantus (``normalise`` one of None,
            ``"max"``, ``"batch_max"``; ``"batch_max"`` normalises each explained chunk by its own maximum).
        generator: for the noise draws (on ``x``'s device); ``None`` uses the global RNG. The draws are made in
            groups of ``max(1, batch_size // B)`` samples, so a seed reproduces a result for the same ``batch_size``.
        batch_size: noisy images per explainer call.

    Returns:
        (B,) float32 on ``x``'s device.
    """
    x = check_images(x)
    batch = x.shape[0]
    target = resolve_explainer_target(explain, x, target)
    check_int_at_least(batch_size, "batch_size", 1)
    if noise is not None:
        noise = check_tensor(noise, "noise", ndim=5, finite=True)
        if noise.shape[1:] != x.shape:
            raise ValueError(f"noise must be (n_samples, *x.shape) = (S, {tuple(x.shape)}), got {tuple(noise.shape)}")
        n_samples = noise.shape[0]
    else:
        radius = check_positive(radius, "radius")
        check_int_at_least(n_samples, "n_samples", 1)
    if maps is None:
        maps = call_explainer(explain, x, target)
    clean = prepare_maps(maps, x, abs=abs, normalise=normalise).flatten(1).double()
    norm = clean.norm(dim=1)
    norm = torch.where(norm == 0, torch.ones_like(norm), norm)

    worst = torch.full((batch,), -torch.inf, dtype=torch.float64, device=x.device)
    group = max(1, batch_size // batch)
    for s0 in range(0, n_samples, group):
        s1 = min(s0 + group, n_samples)
        if noise is not None:
            delta = noise[s0:s1].to(device=x.device, dtype=x.dtype)
        else:
            delta = torch.rand((s1 - s0, *x.shape), generator=generator, device=x.device, dtype=x.dtype)
            delta = (2 * delta - 1) * radius
        noisy = (x + delta).flatten(0, 1)  # (g * B, C, H, W), sample-major
        tgt = target.repeat(s1 - s0)
        for lo in range(0, len(noisy), batch_size):
            chunk = noisy[lo : lo + batch_size]
            perturbed = call_explainer(explain, chunk, tgt[lo : lo + batch_size])
            perturbed = prepare_maps(perturbed, chunk, abs=abs, normalise=normalise, name="perturbed maps")
            idx = torch.arange(lo, lo + len(chunk), device=x.device) % batch
            if perturbed.shape[1] != clean.shape[1] // (x.shape[2] * x.shape[3]):
                raise ValueError("the explainer returned maps with a different channel count on noisy inputs")
            ratio = (clean[idx] - perturbed.flatten(1).double()).norm(dim=1) / norm[idx]
            worst.scatter_reduce_(0, idx, ratio, reduce="amax")
    return worst.float()
