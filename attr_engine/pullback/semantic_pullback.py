"""Semantic Pullback attributions (arXiv 2507.22832): Soft Pullback (SfP) and Pullback Ascent (PA).

- SfP: the gradient of the target *logit* with respect to the input image under :func:`soft_adjoint`, i.e. the
  pullback ``W(x)^T u`` of the class direction through the network's input-conditioned linear part.
- PA: ``K`` normalised ascent steps along the soft pullback, ``x_{t+1} = x_t + alpha * v_t / ||v_t||_2`` (norm per
  sample over C*H*W); the attribution is ``x_K - x_0``.

Everything happens in the [0, 1] image space a :class:`~attr_engine.classifier.Classifier` takes (it normalises
inside), so the attribution is in pixel units and clipping to the valid range means clipping to [0, 1].

Both are :class:`~attr_engine.explainer.Explainer` options of one class, :class:`SemanticPullback` (registered as
``pullback-soft`` and ``pullback-ascent``).

Step size: the paper's ``alpha = 20`` is for 3 x 224 x 224 inputs in [-1, 1] units, i.e. ``alpha = 10`` in [0, 1]
units. Each step moves the image by ``alpha`` in L2, so the root-mean-square change per pixel value is
``alpha / sqrt(C*H*W)``; keeping that constant across input sizes gives the default
``alpha = 10 * sqrt(C*H*W / (3*224*224))`` (2.86 at 3 x 64 x 64).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from attr_engine.explainer import Explainer, register_explainer
from attr_engine.pullback.soft_adjoint import GELU_TAU, MAXPOOL_TAU, RELU_TAU, SILU_TAU, soft_adjoint
from attr_engine_kernels.validate import check_int_at_least, check_positive

__all__ = ["PULLBACK_METHODS", "PULLBACK_RANKING_SOURCE", "PullbackConfig", "SemanticPullback", "default_alpha"]

# The pullback attributions: Pullback Ascent (the default) and Soft Pullback.
PULLBACK_METHODS = ("ascent", "soft")
# Where the pullback's pixel-ranking reduction comes from (see SemanticPullback).
PULLBACK_RANKING_SOURCE = (
    "314-Foundation/SemanticPullbacks lib/evaluator.py hands the full (B, C, H, W) pullback to Quantus 0.6.0; its "
    "MonotonicityCorrelation ranks absolute values (abs=True), its FaithfulnessEstimate the signed per-channel values"
)
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

    def soft_adjoint_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`soft_adjoint` this config sets."""
        keys = ("relu_tau", "gelu_tau", "silu_tau", "maxpool_tau", "layernorm", "attention", "warn_unknown")
        return {k: v for k, v in asdict(self).items() if k in keys}


class SemanticPullback(Explainer):
    """Soft Pullback and Pullback Ascent attributions of a classifier taking [0, 1] images.

    An :class:`~attr_engine.explainer.Explainer`: ``attribute(inputs, target=None, baselines=None, **options)`` with
    the options

    - ``method``: ``"ascent"`` (PA: ``x_K - x_0``, the default) or ``"soft"`` (SfP: one soft pullback of the target
      logit);
    - ``steps``: ascent steps K (None: ``config.steps``, default 5; ignored by ``"soft"``);
    - ``alpha``: ascent step length (None: ``config.alpha``, and if that is None :func:`default_alpha`);

    and ``reduce``: over channels ``"mean"`` (the default, what the paper displays), ``"sum"``, ``"abs"`` (mean of
    absolute values), ``"norm"`` (L2), ... (see :func:`~attr_engine.explainer.reduce_channels`), or None for the
    signed per-channel attribution (B, C, H, W) - what the official evaluation hands to Quantus, and what
    infidelity scores. Pixel-ranking metrics rank by ``ranking_reduce = "abs"`` (see
    :data:`PULLBACK_RANKING_SOURCE`); ``reduce="input"`` gives ``sum_c pullback_c * (x_c - reference_c)`` with the
    reference from ``baselines`` (default the classifier's mean colour).

    Images ``(B, C, H, W)`` of any channel count and floating dtype are accepted: the classifier runs in its own
    dtype and the result comes back in the caller's. Works inside ``torch.no_grad()`` (gradients are re-enabled
    internally); the result never requires grad; inside ``torch.inference_mode()`` it raises a RuntimeError.

    Args:
        classifier: maps ``(B, C, H, W)`` images in [0, 1] to ``(B, K)`` logits, e.g. a
            :class:`~attr_engine.classifier.Classifier` (which normalises inside). Its parameters receive no
            gradient; a model in training mode runs each call in eval mode (BatchNorm affine, no dropout) and gets
            its own modes back, so its state dict is bit-identical after any attribution.
        config: :class:`PullbackConfig`; None uses the paper's defaults.
        options: defaults of the per-call options above (``method``, ``steps``, ``alpha``).

    Example:
        >>> sp = SemanticPullback(load_classifier("resnet18", num_classes=10))  # doctest: +SKIP
        >>> maps = sp.attribute(images)  # (B, H, W): channel mean of x_5 - x_0  # doctest: +SKIP
        >>> sfp = sp.attribute(images, target, method="soft", reduce=None)  # (B, C, H, W)  # doctest: +SKIP
    """

    options: ClassVar[Mapping[str, Any]] = {"method": "ascent", "steps": None, "alpha": None}
    per_channel = True
    display_reduce = "mean"
    ranking_reduce = "abs"
    ranking_source = PULLBACK_RANKING_SOURCE
    infidelity_per_channel = True
    extra_rankings = ("input", "mean")
    channels = None  # any channel count: the pullback is defined for any input
    output_dtype: torch.dtype | None = None  # the caller's dtype back (float32 when built by name)
    checks_target_range = False  # checked against the logits of the first pullback (no extra host sync)

    def __init__(self, classifier: nn.Module, config: PullbackConfig | None = None, **options: Any) -> None:
        if config is not None and not isinstance(config, PullbackConfig):
            raise ValueError(f"config must be a PullbackConfig, got {type(config).__name__}")
        self.config = config or PullbackConfig()
        super().__init__(classifier, **options)

    @property
    def name(self) -> str:  # type: ignore[override]
        """``pullback-ascent`` or ``pullback-soft``: the registry name of the default method."""
        defaults = self.__dict__.get("defaults")
        return f"pullback-{defaults['method']}" if defaults else "pullback"

    def _check_options(self, options: dict[str, Any]) -> None:
        if options["method"] not in PULLBACK_METHODS:
            raise ValueError(f"method must be one of {PULLBACK_METHODS}, got {options['method']!r}")
        if options["steps"] is not None:
            check_int_at_least(options["steps"], "steps", 1)
        if options["alpha"] is not None:
            options["alpha"] = check_positive(options["alpha"], "alpha")

    def _attribute(
        self, x: torch.Tensor, target: torch.Tensor, *, method: str, steps: int | None, alpha: float | None
    ) -> torch.Tensor:
        """(B, C, H, W) signed attribution for images x (in the classifier's dtype) and targets (B,)."""
        steps = self.config.steps if steps is None else steps
        if alpha is None:
            alpha = self.config.alpha if self.config.alpha is not None else default_alpha(x.shape[1:].numel())
        # A clone outside inference mode turns an inference tensor into one autograd can use.
        x0 = x.detach().clone()
        with torch.enable_grad(), soft_adjoint(self.classifier, **self.config.soft_adjoint_kwargs()):
            if method == "soft":
                return self._soft_pullback(x0, target)
            return self._ascent(x0, target, steps, alpha)

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


def _registered(classifier: nn.Module, method: str, **options: Any) -> SemanticPullback:
    """The registry's pullbacks: float32 maps like every method built by name (:func:`get_explainer`), where a
    directly constructed SemanticPullback gives the caller's dtype back."""
    explainer = SemanticPullback(classifier, method=method, **options)
    explainer.output_dtype = torch.float32
    return explainer


register_explainer(
    "pullback-soft",
    lambda classifier, **kw: _registered(classifier, "soft", **kw),
    description="Soft Pullback (SfP)",
)
register_explainer(
    "pullback-ascent",
    lambda classifier, **kw: _registered(classifier, "ascent", **kw),
    description="Pullback Ascent (PA)",
)
