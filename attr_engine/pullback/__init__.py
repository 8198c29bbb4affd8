"""Semantic Pullback: the soft adjoint of a network (exact forward, softened backward) and the attributions built
on it, Soft Pullback (SfP) and Pullback Ascent (PA); importing it registers ``pullback-soft`` and
``pullback-ascent`` with :func:`attr_engine.get_explainer`."""

from attr_engine.pullback.semantic_pullback import (
    PULLBACK_METHODS,
    PULLBACK_RANKING_SOURCE,
    PullbackConfig,
    SemanticPullback,
    default_alpha,
)
from attr_engine.pullback.soft_adjoint import SoftAdjoint, soft_adjoint

__all__ = [
    "PULLBACK_METHODS",
    "PULLBACK_RANKING_SOURCE",
    "PullbackConfig",
    "SemanticPullback",
    "SoftAdjoint",
    "default_alpha",
    "soft_adjoint",
]
