"""This project's methods in the shared call shape: AHA and the Semantic Pullback (SfP, PA)."""

from __future__ import annotations

import torch
from torch import nn

from attr_engine.aha import AHA
from attr_engine.baselines.base import Explainer
from attr_engine.pullback import PullbackConfig, SemanticPullback

__all__ = ["AHAExplainer", "PullbackExplainer"]


class AHAExplainer(Explainer):
    """A trained :class:`~attr_engine.aha.AHA` explainer.

    Args:
        classifier: the classifier ``aha`` was trained for.
        aha: the trained AHA model.
        refine_steps: test-time refinement steps T (0: one forward pass). With T > 0 the decoder is fine-tuned on
            the whole batch, so a map depends on the other images of its batch.
        seed: seeds the refinement's grid draws, so refined maps are reproducible.
    """

    name = "aha"

    def __init__(self, classifier: nn.Module, *, aha: AHA | None = None, refine_steps: int = 0, seed: int = 0) -> None:
        super().__init__(classifier)
        if not isinstance(aha, AHA):
            raise ValueError(f"the 'aha' explainer needs a trained AHA passed as aha=..., got {type(aha).__name__}")
        if aha.classifier is not classifier:
            raise ValueError("aha was built for a different classifier than the one given")
        if isinstance(refine_steps, bool) or not isinstance(refine_steps, int) or refine_steps < 0:
            raise ValueError(f"refine_steps must be an int >= 0, got {refine_steps!r}")
        self.aha = aha
        self.refine_steps = refine_steps
        self.seed = seed
        self.needs_grad = refine_steps > 0

    def _attribute(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        generator = self.seed if self.refine_steps else None
        return self.aha.attribute(x, target, refine_steps=self.refine_steps, generator=generator)


class PullbackExplainer(Explainer):
    """Soft Pullback (``method="soft"``) or Pullback Ascent (``method="ascent"``), channel mean of the signed map.

    Args:
        classifier: the explained classifier.
        method: ``"soft"`` (SfP) or ``"ascent"`` (PA).
        config: a :class:`~attr_engine.pullback.PullbackConfig` (None: the paper's defaults).
        steps, alpha: PA steps and step length (None: the config's).
    """

    def __init__(
        self,
        classifier: nn.Module,
        *,
        method: str = "ascent",
        config: PullbackConfig | None = None,
        steps: int | None = None,
        alpha: float | None = None,
    ) -> None:
        super().__init__(classifier)
        if method not in ("soft", "ascent"):
            raise ValueError(f"method must be 'soft' or 'ascent', got {method!r}")
        self.pullback = SemanticPullback(classifier, config)
        self.method = method
        self.steps = steps
        self.alpha = alpha
        self.name = f"pullback-{method}"

    def _attribute(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.pullback.attribute(x, target, method=self.method, steps=self.steps, alpha=self.alpha, reduce="mean")
