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

import torch
from torch import nn

from attr_engine.baselines.base import Explainer, import_captum
from kernels._validate import check_int_at_least, check_positive

__all__ = ["Gradient", "GradientXInput", "IntegratedGradients", "Occlusion", "Saliency", "SmoothGrad", "image_seeds"]


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

    ``map = max_c mean_s |d logit_t / dx (x + noise_s)|`` with ``noise_s ~ N(0, noise_std^2)``, as Captum's
    ``NoiseTunnel(Saliency(abs=True))`` computes it. Each image's noise comes from its own generator, seeded from
    ``seed`` and the image's content (:func:`image_seeds`), so an image gets the same map whatever batch it is in,
    wherever it sits there, and in a resumed run; the global RNG is never touched.

    Args:
        classifier: the explained classifier.
        n_samples: noisy copies per image.
        noise_std: noise standard deviation in [0, 1] pixel units (0.15 = 15 % of the range, the paper's advice).
        batch_size: noisy copies of each image per classifier call.
        seed: the run seed the per-image noise is derived from.
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
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.seed = seed

    def _attribute(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # (B, S, C, H, W) noise, one generator per image, drawn in full before any chunking so the chunk size
        # (batch_size) cannot change which noise an image gets either.
        noise = torch.stack(
            [
                torch.randn(
                    (self.n_samples, *x.shape[1:]),
                    generator=torch.Generator(device=x.device).manual_seed(s),
                    device=x.device,
                    dtype=x.dtype,
                )
                for s in image_seeds(x, self.seed)
            ]
        ).mul_(self.noise_std)
        total = torch.zeros_like(x)
        for lo in range(0, self.n_samples, self.batch_size):
            chunk = noise[:, lo : lo + self.batch_size]
            k = chunk.shape[1]
            noisy = (x.detach()[:, None] + chunk).flatten(0, 1).requires_grad_(True)
            logits = self.classifier(noisy)
            picked = logits.gather(1, target.repeat_interleave(k)[:, None]).sum()
            (grad,) = torch.autograd.grad(picked, noisy)
            total += grad.abs().view(x.shape[0], k, *x.shape[1:]).sum(dim=1)
        return (total / self.n_samples).amax(dim=1)


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
