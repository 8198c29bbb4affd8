"""This project's methods in the shared call shape: AHA and the Semantic Pullback (SfP, PA)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from attr_engine.aha import AHA
from attr_engine.aha.explainer import build_backbone
from attr_engine.baselines.base import Explainer
from attr_engine.classifier import Classifier
from attr_engine.pullback import PullbackConfig, SemanticPullback

__all__ = ["PULLBACK_RANKING_SOURCE", "AHAExplainer", "PullbackExplainer", "aha_for_classifier"]

# Where the pullback's pixel-ranking reduction comes from (see PullbackExplainer).
PULLBACK_RANKING_SOURCE = (
    "314-Foundation/SemanticPullbacks lib/evaluator.py hands the full (B, C, H, W) pullback to Quantus 0.6.0; its "
    "MonotonicityCorrelation ranks absolute values (abs=True), its FaithfulnessEstimate the signed per-channel values"
)


def aha_for_classifier(aha: AHA, classifier: Classifier) -> AHA:
    """The trained decoder of ``aha`` over another classifier: that classifier's backbone (when AHA uses the
    classifier's own) and that classifier as the scorer, so a model with randomised layers changes the maps.

    Nothing is copied: the decoder is shared with ``aha``. A separately configured backbone (``config.backbone``)
    is kept, since it is not part of the classifier.
    """
    if classifier is aha.classifier:
        return aha
    if not isinstance(classifier, Classifier):
        raise ValueError(f"AHA explains an attr_engine Classifier, got {type(classifier).__name__}")
    new = AHA.__new__(AHA)
    nn.Module.__init__(new)
    new.classifier = classifier
    new.img_size = aha.img_size
    new.config = aha.config
    if aha.config.backbone is None:
        new.backbone = build_backbone(classifier, None, aha.config.layers, False)
    else:
        new.backbone = aha.backbone
    new.feature_channels = aha.feature_channels
    new.decoder = aha.decoder
    new.steps_trained = aha.steps_trained
    return new


class AHAExplainer(Explainer):
    """A trained :class:`~attr_engine.aha.AHA` explainer.

    Args:
        classifier: the classifier ``aha`` was trained for.
        aha: the trained AHA model.
        refine_steps: test-time refinement steps T (0: one forward pass; also a per-call option). With T > 0 the
            decoder is fine-tuned on the whole batch, so a map depends on the other images of its batch.
        seed: seeds the refinement's grid draws, so refined maps are reproducible (also a per-call option).
    """

    name = "aha"
    options: ClassVar[dict[str, Any]] = {"refine_steps": 0, "seed": 0}

    def __init__(self, classifier: nn.Module, *, aha: AHA | None = None, **options: Any) -> None:
        if not isinstance(aha, AHA):
            raise ValueError(f"the 'aha' explainer needs a trained AHA passed as aha=..., got {type(aha).__name__}")
        if aha.classifier is not classifier:
            raise ValueError("aha was built for a different classifier than the one given")
        self.aha = aha
        super().__init__(classifier, **options)

    def _check_options(self, options: dict[str, Any]) -> None:
        steps = options["refine_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"refine_steps must be an int >= 0, got {steps!r}")

    @property
    def refine_steps(self) -> int:
        return self.defaults["refine_steps"]

    @property
    def seed(self) -> int:
        return self.defaults["seed"]

    @property
    def needs_grad(self) -> bool:  # type: ignore[override]
        return self.defaults["refine_steps"] > 0

    def _bind(self) -> None:
        self.aha = aha_for_classifier(self.aha, self.classifier)

    def _attribute(self, x: torch.Tensor, target: torch.Tensor, *, refine_steps: int, seed: int) -> torch.Tensor:
        generator = seed if refine_steps else None
        with torch.enable_grad() if refine_steps else torch.no_grad():
            return self.aha.attribute(x, target, refine_steps=refine_steps, generator=generator)


class PullbackExplainer(Explainer):
    """Soft Pullback (``method="soft"``) or Pullback Ascent (``method="ascent"``).

    The signed per-channel pullback (B, C, H, W) is the attribution (``reduce=None``; what the official evaluation
    hands to Quantus, and what infidelity scores); its display is the channel mean (the paper's figures), and pixel
    ranking metrics rank by ``ranking_reduce = "abs"``, the mean absolute value over channels (see
    :data:`PULLBACK_RANKING_SOURCE`). ``reduce="input"`` gives ``sum_c pullback_c * (x_c - reference_c)`` with the
    reference from ``baselines`` (default the classifier's mean colour).

    Args:
        classifier: the explained classifier.
        method: ``"soft"`` (SfP) or ``"ascent"`` (PA).
        config: a :class:`~attr_engine.pullback.PullbackConfig` (None: the paper's defaults).
        steps, alpha: PA steps and step length (None: the config's); also per-call options.
    """

    per_channel = True
    display_reduce = "mean"
    ranking_reduce = "abs"
    ranking_source = PULLBACK_RANKING_SOURCE
    infidelity_per_channel = True
    extra_rankings = ("input", "mean")
    options: ClassVar[dict[str, Any]] = {"steps": None, "alpha": None}

    def __init__(
        self, classifier: nn.Module, *, method: str = "ascent", config: PullbackConfig | None = None, **options: Any
    ) -> None:
        if method not in ("soft", "ascent"):
            raise ValueError(f"method must be 'soft' or 'ascent', got {method!r}")
        self.method = method
        self.name = f"pullback-{method}"
        super().__init__(classifier, **options)
        self.pullback = SemanticPullback(classifier, config)

    @property
    def steps(self) -> int | None:
        return self.defaults["steps"]

    @property
    def alpha(self) -> float | None:
        return self.defaults["alpha"]

    def _bind(self) -> None:
        self.pullback = SemanticPullback(self.classifier, self.pullback.config)

    def _attribute(self, x: torch.Tensor, target: torch.Tensor, *, steps: int | None, alpha: float | None) -> Any:
        return self.pullback.attribute(x, target, method=self.method, steps=steps, alpha=alpha, reduce=None)
