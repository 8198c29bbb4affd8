"""Semantic Pullback attributions (arXiv 2507.22832): Soft Pullback (SfP) and Pullback Ascent (PA).

- SfP: the gradient of the target *logit* with respect to the input image under :func:`soft_adjoint`, i.e. the
  pullback ``W(x)^T u`` of the class direction through the network's input-conditioned linear part.
- PA: ``K`` normalised ascent steps along the soft pullback, ``x_{t+1} = x_t + alpha * v_t / ||v_t||_2`` (norm per
  sample over C*H*W); the attribution is ``x_K - x_0``.

Everything happens in the [0, 1] image space a :class:`~attr_engine.classifier.Classifier` takes (it normalises
inside), so the attribution is in pixel units and clipping to the valid range means clipping to [0, 1].

Step size: the paper's ``alpha = 20`` is for 3 x 224 x 224 inputs in [-1, 1] units, i.e. ``alpha = 10`` in [0, 1]
units. Each step moves the image by ``alpha`` in L2, so the root-mean-square change per pixel value is
``alpha / sqrt(C*H*W)``; keeping that constant across input sizes gives the default
``alpha = 10 * sqrt(C*H*W / (3*224*224))`` (2.86 at 3 x 64 x 64).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from attr_engine.classifier import check_device, eval_mode, input_dtype, resolve_targets
from attr_engine.pullback.soft_adjoint import GELU_TAU, MAXPOOL_TAU, RELU_TAU, SILU_TAU, soft_adjoint
from kernels._validate import check_int_at_least, check_positive, check_tensor

__all__ = ["PullbackConfig", "SemanticPullback", "default_alpha"]

_METHODS = ("ascent", "soft")
_REDUCTIONS = ("mean", "sum", "abs", "norm", None)
# The paper's step for 3 x 224 x 224 inputs, converted from [-1, 1] to [0, 1] pixel units (half the range).
_ALPHA_224 = 10.0
_NUMEL_224 = 3 * 224 * 224


def default_alpha(numel: int) -> float:
    """Pullback-ascent step for an input of ``numel = C*H*W`` values in [0, 1]: ``10 * sqrt(numel / (3*224*224))``.

    Keeps the per-pixel (root-mean-square) step of the paper's setting (``alpha = 20`` at 224 px in [-1, 1] units).
    """
    check_int_at_least(numel, "numel", 1)
    return _ALPHA_224 * math.sqrt(numel / _NUMEL_224)


@dataclass(frozen=True)
class PullbackConfig:
    """Settings of :class:`SemanticPullback`.

    Args:
        relu_tau, gelu_tau, silu_tau, maxpool_tau: soft-adjoint temperatures (> 0; the paper's defaults).
        layernorm: hold LayerNorm statistics constant in the backward.
        attention: hold softmax attention weights constant in the backward.
        steps: pullback-ascent steps K (>= 1).
        alpha: ascent step length in [0, 1] pixel units (L2 over C*H*W per step); None uses
            :func:`default_alpha` of the input size.
        clip: clamp every ascent iterate to the valid pixel range [0, 1].
        warn_unknown: warn about layers the soft adjoint does not handle (see :func:`soft_adjoint`).
    """

    relu_tau: float = RELU_TAU
    gelu_tau: float = GELU_TAU
    silu_tau: float = SILU_TAU
    maxpool_tau: float = MAXPOOL_TAU
    layernorm: bool = True
    attention: bool = True
    steps: int = 5
    alpha: float | None = None
    clip: bool = False
    warn_unknown: bool = True

    def __post_init__(self) -> None:
        for name in ("relu_tau", "gelu_tau", "silu_tau", "maxpool_tau"):
            object.__setattr__(self, name, check_positive(getattr(self, name), name))
        check_int_at_least(self.steps, "steps", 1)
        if self.alpha is not None:
            object.__setattr__(self, "alpha", check_positive(self.alpha, "alpha"))
        for name in ("layernorm", "attention", "clip", "warn_unknown"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def soft_adjoint_kwargs(self) -> dict[str, float | bool]:
        """The keyword arguments of :func:`soft_adjoint` this config sets."""
        keys = ("relu_tau", "gelu_tau", "silu_tau", "maxpool_tau", "layernorm", "attention", "warn_unknown")
        return {k: v for k, v in asdict(self).items() if k in keys}


class SemanticPullback:
    """Soft Pullback and Pullback Ascent attributions of a classifier taking [0, 1] images.

    Args:
        classifier: maps ``(B, C, H, W)`` images in [0, 1] to ``(B, K)`` logits, e.g. a
            :class:`~attr_engine.classifier.Classifier` (which normalises inside). Its parameters receive no
            gradient; a model in training mode runs each call in eval mode (BatchNorm affine, no dropout) and gets
            its own modes back, so its state dict is bit-identical after any attribution.
        config: :class:`PullbackConfig`; None uses the paper's defaults.

    Example:
        >>> sp = SemanticPullback(load_classifier("resnet18", num_classes=10))  # doctest: +SKIP
        >>> maps = sp.attribute(images)  # (B, H, W): channel mean of x_5 - x_0  # doctest: +SKIP
    """

    def __init__(self, classifier: nn.Module, config: PullbackConfig | None = None) -> None:
        if not isinstance(classifier, nn.Module):
            raise ValueError(f"classifier must be a torch.nn.Module, got {type(classifier).__name__}")
        if config is not None and not isinstance(config, PullbackConfig):
            raise ValueError(f"config must be a PullbackConfig, got {type(config).__name__}")
        self.classifier = classifier
        self.config = config or PullbackConfig()

    def attribute(
        self,
        x: torch.Tensor,
        target: int | Sequence[int] | torch.Tensor | None = None,
        *,
        method: str = "ascent",
        steps: int | None = None,
        alpha: float | None = None,
        reduce: str | None = "mean",
    ) -> torch.Tensor:
        """Attribution maps for ``x`` and the ``target`` logits.

        Args:
            x: ``(B, C, H, W)`` finite images in [0, 1].
            target: class index per image: an int (all images), a sequence / ``(B,)`` integer tensor, or None for
                the class each image is predicted as.
            method: ``"ascent"`` (PA: ``x_K - x_0``) or ``"soft"`` (SfP: one soft pullback of the target logit).
            steps: ascent steps K; None takes ``config.steps`` (default 5). Ignored by ``"soft"``.
            alpha: ascent step length; None takes ``config.alpha``, and if that is None :func:`default_alpha`.
            reduce: over channels: ``"mean"`` (what the paper displays), ``"sum"``, ``"abs"`` (mean of absolute
                values), ``"norm"`` (L2), or None for the signed per-channel attribution.

        Returns:
            ``(B, H, W)``, or ``(B, C, H, W)`` when ``reduce`` is None; ``x``'s dtype and device (any floating
            dtype: the classifier runs in its own, the map is cast back). Works inside
            ``torch.no_grad()`` (gradients are re-enabled internally); the result never requires grad.

        Raises:
            RuntimeError: inside ``torch.inference_mode()``, where no gradient can be computed.
            ValueError: bad ``x`` (rank, dtype, NaN / inf), ``target`` (type, length, range), ``method``,
                ``steps``, ``alpha`` or ``reduce``.
        """
        if torch.is_inference_mode_enabled():
            raise RuntimeError(
                "SemanticPullback.attribute needs autograd and cannot run inside torch.inference_mode(); "
                "call it outside (torch.no_grad() is fine)"
            )
        check_device(x, self.classifier)
        check_tensor(x, "x", ndim=4, finite=True)
        if method not in _METHODS:
            raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
        if reduce not in _REDUCTIONS:
            raise ValueError(f"reduce must be one of {_REDUCTIONS}, got {reduce!r}")
        steps = check_int_at_least(self.config.steps if steps is None else steps, "steps", 1)
        if alpha is None:
            alpha = self.config.alpha if self.config.alpha is not None else default_alpha(x.shape[1:].numel())
        alpha = check_positive(alpha, "alpha")
        if x.shape[0] == 0:  # an empty batch: an empty result of the documented shape (the target still checked)
            if target is not None:
                resolve_targets(self.classifier, x, target, check_range=False)  # no entries: no range to check
            empty = x.new_zeros(x.shape)
            return empty if reduce is None else empty[:, 0]

        # A clone outside inference mode turns an inference tensor into one autograd can use; the images are cast
        # to the classifier's dtype (the map comes back in the caller's).
        model_dtype = input_dtype(self.classifier) or x.dtype
        x0 = x.detach().to(model_dtype).clone()
        # Eval mode for the call (BatchNorm affine, no dropout), the caller's modes restored afterwards.
        with torch.enable_grad(), eval_mode(self.classifier):
            # The class range is checked against the logits in _soft_pullback.
            target_idx = resolve_targets(self.classifier, x0, target, check_range=False)
            with soft_adjoint(self.classifier, **self.config.soft_adjoint_kwargs()):
                if method == "soft":
                    attribution = self._soft_pullback(x0, target_idx)
                else:
                    attribution = self._ascent(x0, target_idx, steps, alpha)
        return _reduce_channels(attribution, reduce).to(x.dtype)

    def _soft_pullback(self, x: torch.Tensor, target: torch.Tensor, *, check: bool = True) -> torch.Tensor:
        """Gradient of the target logits at ``x`` under the (already open) soft adjoint: ``(B, C, H, W)``.

        ``check`` validates the target range against the logits, which reads the target (a host-device
        synchronisation on a GPU): the ascent checks at its first step only, and its later steps also skip the
        classifier's input check (their images are the validated ones plus finite steps).
        """
        x = x.detach().requires_grad_(True)
        trusted = getattr(self.classifier, "forward_trusted", None)
        logits = self.classifier(x) if check or trusted is None else trusted(x)
        num_classes = logits.shape[-1]
        if check and (int(target.min()) < 0 or int(target.max()) >= num_classes):
            raise ValueError(f"target classes must lie in [0, {num_classes}), got {target.tolist()}")
        # Samples are independent (eval mode), so the gradient of the sum is the per-sample gradient.
        selected = logits.gather(1, target.view(-1, 1)).sum()
        (grad,) = torch.autograd.grad(selected, x)
        return grad

    def _ascent(self, x0: torch.Tensor, target: torch.Tensor, steps: int, alpha: float) -> torch.Tensor:
        xt = x0
        for step in range(steps):
            v = self._soft_pullback(xt, target, check=step == 0)
            norm = v.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
            # A zero pullback (a dead network) takes a zero step instead of dividing by zero.
            xt = xt + alpha * v / norm.clamp_min(torch.finfo(v.dtype).tiny)
            if self.config.clip:
                xt = xt.clamp(0.0, 1.0)
        return xt - x0


def _reduce_channels(a: torch.Tensor, reduce: str | None) -> torch.Tensor:
    if reduce is None:
        return a
    if reduce == "mean":
        return a.mean(dim=1)
    if reduce == "sum":
        return a.sum(dim=1)
    if reduce == "abs":
        return a.abs().mean(dim=1)
    return a.norm(dim=1)
