"""Gradient and perturbation baselines run through Captum: Gradient, Saliency, Gradient x Input, Integrated
Gradients, SmoothGrad and Occlusion.

Each reduces Captum's per-channel attribution to one value per pixel in the way its paper displays it:

| method | Captum call | per pixel |
|---|---|---|
| gradient | ``Saliency(abs=False)`` | channel mean of the signed gradient (like the Soft Pullback's display) |
| saliency | ``Saliency(abs=True)`` | max over channels of ``|grad|`` (Simonyan et al. 2014) |
| gradient-x-input | ``InputXGradient`` | channel sum (the attributions add up, as in a Taylor term) |
| integrated-gradients | ``IntegratedGradients`` | channel sum |
| smoothgrad | ``NoiseTunnel(Saliency(abs=True))`` | max over channels of the mean ``|grad|`` under noise |
| occlusion | ``Occlusion`` | channel mean (the window spans all channels, so they are equal) |

Gradients are taken of the target *logit* (Captum's convention).
"""

from __future__ import annotations

import torch
from torch import nn

from attr_engine.baselines.base import Explainer, import_captum
from kernels._validate import check_int_at_least, check_positive

__all__ = ["Gradient", "GradientXInput", "IntegratedGradients", "Occlusion", "Saliency", "SmoothGrad"]


def _leaf(x: torch.Tensor) -> torch.Tensor:
    """A fresh leaf that requires grad: Captum would otherwise flip the caller's tensor and warn about it."""
    return x.detach().requires_grad_(True)


def _reference(kind: str | float, x: torch.Tensor, classifier: nn.Module) -> torch.Tensor | float:
    """A baseline image for IG / occlusion: 'black' (0), 'mean' (the classifier's mean colour) or a number."""
    if isinstance(kind, int | float) and not isinstance(kind, bool):
        return float(kind)
    if kind == "black":
        return 0.0
    if kind == "mean":
        mean = getattr(classifier, "norm_mean", None)
        if mean is None:
            raise ValueError("baseline 'mean' needs a Classifier (it reads the normalisation mean)")
        return mean.to(x.dtype).reshape(1, 3, 1, 1).expand(1, 3, *x.shape[2:]).contiguous()
    raise ValueError(f"baseline must be 'black', 'mean' or a number, got {kind!r}")


class Gradient(Explainer):
    """Signed input gradient of the target logit, channel mean."""

    name = "gradient"

    def _attribute(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        grad = import_captum().Saliency(self.classifier).attribute(_leaf(x), target=target, abs=False)
        return grad.mean(dim=1)


class Saliency(Explainer):
    """Vanilla saliency (Simonyan et al. 2014): max over channels of the absolute input gradient."""

    name = "saliency"

    def _attribute(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return import_captum().Saliency(self.classifier).attribute(_leaf(x), target=target, abs=True).amax(dim=1)


class GradientXInput(Explainer):
    """Gradient x input (Shrikumar et al. 2016), summed over channels."""

    name = "gradient-x-input"

    def _attribute(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return import_captum().InputXGradient(self.classifier).attribute(_leaf(x), target=target).sum(dim=1)


class IntegratedGradients(Explainer):
    """Integrated Gradients (Sundararajan et al. 2017), summed over channels.

    Args:
        classifier: the explained classifier.
        n_steps: points of the Gauss-Legendre path integral.
        baseline: ``"black"`` (the paper's), ``"mean"`` (the classifier's mean colour) or a number.
        internal_batch_size: path points per classifier call (bounds memory); None evaluates all at once.
    """

    name = "integrated-gradients"

    def __init__(
        self,
        classifier: nn.Module,
        *,
        n_steps: int = 32,
        baseline: str | float = "black",
        internal_batch_size: int | None = 256,
    ) -> None:
        super().__init__(classifier)
        self.n_steps = check_int_at_least(n_steps, "n_steps", 1)
        self.baseline = baseline
        if internal_batch_size is not None:
            check_int_at_least(internal_batch_size, "internal_batch_size", 1)
        self.internal_batch_size = internal_batch_size
        _reference(baseline, torch.zeros(1, 3, 1, 1), classifier)  # fail at construction on a bad baseline

    def _attribute(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        ig = import_captum().IntegratedGradients(self.classifier)
        chunk = None if self.internal_batch_size is None else max(self.internal_batch_size, x.shape[0])
        attr = ig.attribute(
            _leaf(x),
            baselines=_reference(self.baseline, x, self.classifier),
            target=target,
            n_steps=self.n_steps,
            internal_batch_size=chunk,
        )
        return attr.sum(dim=1)


class SmoothGrad(Explainer):
    """SmoothGrad (Smilkov et al. 2017): mean absolute gradient under Gaussian input noise, max over channels.

    Args:
        classifier: the explained classifier.
        n_samples: noisy copies per image.
        noise_std: noise standard deviation in [0, 1] pixel units (0.15 = 15 % of the range, the paper's advice).
        batch_size: noisy copies per call (Captum's ``nt_samples_batch_size``).
        seed: the noise is drawn from a fixed seed (the global RNG state is restored), so maps are reproducible.
    """

    name = "smoothgrad"

    def __init__(
        self,
        classifier: nn.Module,
        *,
        n_samples: int = 16,
        noise_std: float = 0.15,
        batch_size: int = 16,
        seed: int = 0,
    ) -> None:
        super().__init__(classifier)
        self.n_samples = check_int_at_least(n_samples, "n_samples", 1)
        self.noise_std = check_positive(noise_std, "noise_std")
        self.batch_size = check_int_at_least(batch_size, "batch_size", 1)
        self.seed = seed

    def _attribute(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        captum = import_captum()
        tunnel = captum.NoiseTunnel(captum.Saliency(self.classifier))
        devices = [x.device] if x.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.seed)
            attr = tunnel.attribute(
                _leaf(x),
                nt_type="smoothgrad",
                nt_samples=self.n_samples,
                nt_samples_batch_size=self.batch_size,
                stdevs=self.noise_std,
                target=target,
                abs=True,
            )
        return attr.amax(dim=1)


class Occlusion(Explainer):
    """Occlusion (Zeiler & Fergus 2014): drop in the target logit when a window is replaced by a baseline.

    Args:
        classifier: the explained classifier.
        window: square window side in pixels; None takes ``max(2, H // 8)``.
        stride: window step; None takes half the window.
        baseline: ``"mean"`` (the classifier's mean colour, default), ``"black"`` or a number.
        perturbations_per_eval: occluded copies of the batch per classifier call; None takes ``max(1, 256 // B)``.
    """

    name = "occlusion"
    needs_grad = False

    def __init__(
        self,
        classifier: nn.Module,
        *,
        window: int | None = None,
        stride: int | None = None,
        baseline: str | float = "mean",
        perturbations_per_eval: int | None = None,
    ) -> None:
        super().__init__(classifier)
        self.window = None if window is None else check_int_at_least(window, "window", 1)
        self.stride = None if stride is None else check_int_at_least(stride, "stride", 1)
        self.baseline = baseline
        if perturbations_per_eval is not None:
            check_int_at_least(perturbations_per_eval, "perturbations_per_eval", 1)
        self.perturbations_per_eval = perturbations_per_eval
        _reference(baseline, torch.zeros(1, 3, 1, 1), classifier)

    def _attribute(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        window = self.window or max(2, x.shape[-2] // 8)
        if window > min(x.shape[-2:]):
            raise ValueError(f"occlusion window {window} is larger than the image {tuple(x.shape[-2:])}")
        stride = self.stride or max(1, window // 2)
        with torch.no_grad():
            attr = (
                import_captum()
                .Occlusion(self.classifier)
                .attribute(
                    x,
                    sliding_window_shapes=(3, window, window),
                    strides=(3, stride, stride),
                    baselines=_reference(self.baseline, x, self.classifier),
                    target=target,
                    perturbations_per_eval=self.perturbations_per_eval or max(1, 256 // x.shape[0]),
                )
            )
        return attr.mean(dim=1)
