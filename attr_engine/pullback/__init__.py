"""Semantic Pullback: the soft adjoint of a network (exact forward, softened backward) and the attributions built
on it, Soft Pullback (SfP) and Pullback Ascent (PA)."""

from attr_engine.pullback.semantic_pullback import PullbackConfig, SemanticPullback, default_alpha
from attr_engine.pullback.soft_adjoint import SoftAdjoint, soft_adjoint

__all__ = ["PullbackConfig", "SemanticPullback", "SoftAdjoint", "default_alpha", "soft_adjoint"]
