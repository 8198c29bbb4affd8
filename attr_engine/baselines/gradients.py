"""Gradient and perturbation baselines run through Captum: Gradient, Saliency, Gradient x Input, Integrated
Gradients, SmoothGrad and Occlusion.

Each reduces Captum's per-channel attribution to one value per pixel in the way its paper displays it:

| method | Captum call | per pixel |
|---|---|---|
| gradient | ``Saliency(abs=False)`` | channel mean of the signed gradient (like the Soft Pullback's display) |
| saliency | ``Saliency(abs=True)`` | max over channels of ``|grad|`` (Simonyan et al. 2014) |
| gradient-x-input | ``InputXGradient`` | channel sum (the attributions add up, as in a Taylor term) |
| integrated-gradients | ``IntegratedGradients`` | channel sum |
| smoothgrad | as ``NoiseTunnel(Saliency(abs=True))``, noise per image | max over channels of the mean ``|grad|`` |
| occlusion | ``Occlusion`` | channel mean (the window spans all channels, so they are equal) |

Gradients are taken of the target *logit* (Captum's convention).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from attr_engine.baselines._captum import import_captum
from attr_engine.classifier import images_per_call
from attr_engine.explainer import Explainer
from attr_engine_kernels.validate import check_int, check_int_at_least, check_positive

__all__ = ["Gradient", "GradientXInput", "IntegratedGradients", "Occlusion", "Saliency", "SmoothGrad", "image_seeds"]


def _leaf(x: torch.Tensor) -> torch.Tensor:
    """A fresh leaf that requires grad: Captum would otherwise flip the caller's tensor and warn about it."""
    return x.detach().requires_grad_(True)


def _check_int_option(options: dict[str, Any], key: str, low: int, *, optional: bool = False) -> None:
    if optional and options[key] is None:
        return
    options[key] = check_int_at_least(options[key], key, low)


class Gradient(Explainer):
    """Signed input gradient of the target logit (Captum ``Saliency(abs=False)``); displayed as the channel mean."""

    name = "gradient"
    per_channel = True
    infidelity_per_channel = True
    display_reduce = "mean"

    def __init__(self, classifier: nn.Module, **options: Any) -> None:
        super().__init__(classifier, **options)

    def _attribute(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return import_captum().Saliency(self.classifier).attribute(_leaf(x), target=target, abs=False)


class Saliency(Explainer):
    """Vanilla saliency (Simonyan et al. 2014): Captum ``Saliency``, displayed as the max over channels.

    Options: ``abs`` (Captum's; default True: absolute gradients).
    """

    name = "saliency"
    per_channel = True
    display_reduce = "max"
    options: ClassVar[dict[str, Any]] = {"abs": True}

    def __init__(self, classifier: nn.Module, **options: Any) -> None:
        super().__init__(classifier, **options)

    def _attribute(self, x: torch.Tensor, target: torch.Tensor, *, abs: bool) -> torch.Tensor:
        return import_captum().Saliency(self.classifier).attribute(_leaf(x), target=target, abs=bool(abs))


class GradientXInput(Explainer):
    """Gradient x input (Shrikumar et al. 2016), Captum ``InputXGradient``, summed over channels."""

    name = "gradient-x-input"
    per_channel = True
    infidelity_per_channel = True
    multiplies_by_inputs = True
    display_reduce = "sum"

    def __init__(self, classifier: nn.Module, **options: Any) -> None:
        super().__init__(classifier, **options)

    def _attribute(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return import_captum().InputXGradient(self.classifier).attribute(_leaf(x), target=target)


class IntegratedGradients(Explainer):
    """Integrated Gradients (Sundararajan et al. 2017), Captum ``IntegratedGradients``, summed over channels.

    Options (Captum's names): ``n_steps`` (path points, default 32), ``method`` (``"gausslegendre"``),
    ``internal_batch_size`` (path points per classifier call; None evaluates all at once), and per call
    ``baselines`` (default ``"black"``, the paper's) and ``return_convergence_delta``. ``baseline=`` at
    construction is the older spelling of ``baselines=``.

    ``internal_batch_size="auto"`` (the default) sizes the classifier calls from the image size: on a CPU at most
    :func:`~attr_engine.classifier.images_per_call` images a call (the images themselves split into groups where
    the batch alone exceeds it), so host memory stays bounded at any image size; on an accelerator 256. Each
    image's path is its own, so the grouping changes how the work is split, not the maps (up to float rounding).
    """

    name = "integrated-gradients"
    per_channel = True
    infidelity_per_channel = True
    multiplies_by_inputs = True
    display_reduce = "sum"
    options: ClassVar[dict[str, Any]] = {"n_steps": 32, "method": "gausslegendre", "internal_batch_size": "auto"}
    option_types: ClassVar[dict[str, Any]] = {"internal_batch_size": int | str | None}
    takes_baselines = True
    default_baselines = "black"
    has_convergence_delta = True

    def __init__(self, classifier: nn.Module, *, baselines: Any = None, baseline: Any = None, **options: Any) -> None:
        super().__init__(classifier, baselines=baselines if baselines is not None else baseline, **options)

    def _check_options(self, options: dict[str, Any]) -> None:
        _check_int_option(options, "n_steps", 1)
        size = options["internal_batch_size"]
        if isinstance(size, str):
            if size != "auto":
                raise ValueError(f"internal_batch_size must be an integer >= 1, None or 'auto', got {size!r}")
        else:
            _check_int_option(options, "internal_batch_size", 1, optional=True)

    def _attribute(
        self,
        x: torch.Tensor,
        target: torch.Tensor,
        *,
        baselines: torch.Tensor | float,
        n_steps: int,
        method: str,
        internal_batch_size: int | str | None,
        return_convergence_delta: bool = False,
    ) -> Any:
        ig = import_captum().IntegratedGradients(self.classifier)
        group = x.shape[0]
        per_call: int | None
        if isinstance(internal_batch_size, str):  # "auto": _check_options lets no other string through
            limit = images_per_call(x.shape[-2], x.shape[-1], x.device)
            per_call = _AUTO_ACCELERATOR_BATCH if limit is None else limit
            group = min(group, per_call)
        else:
            per_call = internal_batch_size
        results = []
        for start in range(0, x.shape[0], group):
            rows = slice(start, start + group)
            part = baselines[rows] if isinstance(baselines, torch.Tensor) and baselines.shape[0] > 1 else baselines
            # Captum splits n_steps * B path points into chunks; a chunk below B would split one image's path points.
            chunk = None if per_call is None else max(per_call, x[rows].shape[0])
            results.append(
                ig.attribute(
                    _leaf(x[rows]),
                    baselines=part,
                    target=target[rows],
                    n_steps=n_steps,
                    method=method,
                    internal_batch_size=chunk,
                    return_convergence_delta=return_convergence_delta,
                )
            )
        if len(results) == 1:
            return results[0]
        if return_convergence_delta:
            return torch.cat([r[0] for r in results]), torch.cat([r[1] for r in results])
        return torch.cat(results)


# internal_batch_size="auto" off the CPU: the former fixed default, whose speed on a GPU needs no new evidence.
_AUTO_ACCELERATOR_BATCH = 256


def image_seeds(x: torch.Tensor, seed: int) -> list[int]:
    """One 63-bit seed per image of ``x (B, C, H, W)``, from ``seed`` and the image's bytes (dtype, shape, values).

    Noise drawn from these depends on nothing but the run seed and the image itself: not on the batch it lands in,
    its position there, or how far an interrupted run had got.
    """
    host = x.detach().to("cpu").contiguous()
    seeds = []
    for image in host:
        digest = hashlib.sha256(f"{int(seed)}/{image.dtype}/{tuple(image.shape)}/".encode())
        digest.update(image.numpy().tobytes() if image.dtype != torch.bfloat16 else image.float().numpy().tobytes())
        seeds.append(int.from_bytes(digest.digest()[:8], "little") >> 1)
    return seeds


class SmoothGrad(Explainer):
    """SmoothGrad (Smilkov et al. 2017): mean absolute gradient under Gaussian input noise, max over channels.

    ``map = max_c mean_s |d logit_t / dx (x + noise_s)|`` with ``noise_s ~ N(0, stdevs^2)``, as Captum's
    ``NoiseTunnel(Saliency(abs=True)).attribute(nt_type="smoothgrad")`` computes it. Each image's noise comes from
    its own generator, seeded from ``seed`` and the image's content (:func:`image_seeds`), so an image gets the same
    map whatever batch it is in, wherever it sits there, and in a resumed run; the global RNG is never touched.

    Options (Captum's ``NoiseTunnel`` names; the older ``n_samples`` / ``noise_std`` / ``batch_size`` still work):
        nt_samples: noisy copies per image (16).
        stdevs: noise standard deviation in [0, 1] pixel units (0.15 = 15 % of the range, the paper's advice).
        nt_samples_batch_size: noisy copies of each image per classifier call (16).
        seed: the run seed the per-image noise is derived from (0).
    """

    name = "smoothgrad"
    per_channel = True
    display_reduce = "max"
    options: ClassVar[dict[str, Any]] = {"nt_samples": 16, "stdevs": 0.15, "nt_samples_batch_size": 16, "seed": 0}
    option_aliases: ClassVar[dict[str, str]] = {
        "n_samples": "nt_samples",
        "noise_std": "stdevs",
        "batch_size": "nt_samples_batch_size",
    }

    def __init__(self, classifier: nn.Module, **options: Any) -> None:
        super().__init__(classifier, **options)

    def _check_options(self, options: dict[str, Any]) -> None:
        _check_int_option(options, "nt_samples", 1)
        _check_int_option(options, "nt_samples_batch_size", 1)
        options["stdevs"] = check_positive(options["stdevs"], "stdevs")
        check_int(options["seed"], "seed")

    @property
    def n_samples(self) -> int:
        return self.defaults["nt_samples"]

    @property
    def noise_std(self) -> float:
        return self.defaults["stdevs"]

    def _attribute(
        self,
        x: torch.Tensor,
        target: torch.Tensor,
        *,
        nt_samples: int,
        stdevs: float,
        nt_samples_batch_size: int,
        seed: int,
    ) -> torch.Tensor:
        # (B, S, C, H, W) noise, one generator per image, drawn in full before any chunking so the chunk size
        # cannot change which noise an image gets either.
        noise = torch.stack(
            [
                torch.randn(
                    (nt_samples, *x.shape[1:]),
                    generator=torch.Generator(device=x.device).manual_seed(s),
                    device=x.device,
                    dtype=x.dtype,
                )
                for s in image_seeds(x, seed)
            ]
        ).mul_(stdevs)
        total = torch.zeros_like(x)
        for lo in range(0, nt_samples, nt_samples_batch_size):
            chunk = noise[:, lo : lo + nt_samples_batch_size]
            k = chunk.shape[1]
            noisy = (x.detach()[:, None] + chunk).flatten(0, 1).requires_grad_(True)
            logits = self.classifier(noisy)
            picked = logits.gather(1, target.repeat_interleave(k)[:, None]).sum()
            (grad,) = torch.autograd.grad(picked, noisy)
            total += grad.abs().view(x.shape[0], k, *x.shape[1:]).sum(dim=1)
        return total / nt_samples


class Occlusion(Explainer):
    """Occlusion (Zeiler & Fergus 2014), Captum ``Occlusion``: drop in the target logit when a window is replaced
    by a baseline; the window spans all channels, so the channel mean is the per-pixel value.

    Options (Captum's names; ``window`` / ``stride`` are the older square spellings):
        sliding_window_shapes: (3, h, w) or a side; None takes ``max(2, H // 8)``.
        strides: (3, h, w) or a step; None takes half the window.
        perturbations_per_eval: occluded copies of the batch per classifier call; None takes ``max(1, 256 // B)``.
        baselines (per call): default ``"mean"`` (the classifier's mean colour).
    """

    name = "occlusion"
    needs_grad = False
    per_channel = True
    display_reduce = "mean"
    options: ClassVar[dict[str, Any]] = {"sliding_window_shapes": None, "strides": None, "perturbations_per_eval": None}
    option_aliases: ClassVar[dict[str, str]] = {"window": "sliding_window_shapes", "stride": "strides"}
    takes_baselines = True
    default_baselines = "mean"

    def __init__(self, classifier: nn.Module, *, baselines: Any = None, baseline: Any = None, **options: Any) -> None:
        super().__init__(classifier, baselines=baselines if baselines is not None else baseline, **options)

    def _check_options(self, options: dict[str, Any]) -> None:
        for key in ("sliding_window_shapes", "strides"):
            value = options[key]
            if value is None:
                continue
            # Errors name the window / stride: most callers give a side through the older option names.
            label = "window" if key == "sliding_window_shapes" else "stride"
            if isinstance(value, int | float) and not isinstance(value, bool):
                options[key] = (3, check_int_at_least(value, label, 1), int(value))
            elif isinstance(value, Sequence) and not isinstance(value, str) and len(value) in (2, 3):
                sides = tuple(check_int_at_least(v, label, 1) for v in value)
                options[key] = sides if len(sides) == 3 else (3, *sides)
            else:
                raise ValueError(f"{key} must be a side, (h, w) or (3, h, w), got {value!r}")
        _check_int_option(options, "perturbations_per_eval", 1, optional=True)

    def _attribute(
        self,
        x: torch.Tensor,
        target: torch.Tensor,
        *,
        baselines: torch.Tensor | float,
        sliding_window_shapes: tuple[int, int, int] | None,
        strides: tuple[int, int, int] | None,
        perturbations_per_eval: int | None,
    ) -> torch.Tensor:
        side = max(2, x.shape[-2] // 8)
        window = sliding_window_shapes or (3, side, side)
        if window[1] > x.shape[-2] or window[2] > x.shape[-1]:
            raise ValueError(f"occlusion window {window[1:]} is larger than the image {tuple(x.shape[-2:])}")
        stride = strides or (3, max(1, window[1] // 2), max(1, window[2] // 2))
        with torch.no_grad():
            return (
                import_captum()
                .Occlusion(self.classifier)
                .attribute(
                    x,
                    sliding_window_shapes=window,
                    strides=stride,
                    baselines=baselines,
                    target=target,
                    perturbations_per_eval=perturbations_per_eval or max(1, 256 // x.shape[0]),
                )
            )
