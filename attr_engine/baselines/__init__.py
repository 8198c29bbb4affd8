"""Attribution baselines and this project's methods behind one registry and one call shape.

``get_explainer(name, classifier, **kwargs).attribute(inputs, target=None) -> (B, H, W)``:

| name | method | where |
|---|---|---|
| gradient, saliency, gradient-x-input, integrated-gradients | gradient baselines | Captum |
| smoothgrad, occlusion | noise / perturbation baselines | Captum |
| grad-cam | Grad-CAM: CNN stages through Captum, ViT tokens here | Captum / here |
| rise | RISE, masks on the device | here |
| attention-rollout | attention rollout (ViTs) | here |
| aha | a trained AHA (``aha=...``, ``refine_steps=T``) | attr_engine.aha |
| pullback-soft, pullback-ascent | Soft Pullback (SfP), Pullback Ascent (PA) | attr_engine.pullback |
| deeplift, guided-grad-cam | DeepLift (Shrikumar et al. 2017); Guided Grad-CAM on the last CNN stage | Captum |
| captum:<ClassName> | any ``captum.attr`` class, Captum's option names (:class:`CaptumMethod`) | Captum |

Every method takes Captum's call shape, ``attribute(inputs, target=None, baselines=None, **options)``.

Adapters turn any explainer into a Quantus ``explain_func`` (:func:`quantus_explain_func`) or a Captum-style
attribution object (:class:`CaptumAdapter`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from attr_engine.baselines.adapters import CaptumAdapter, quantus_explain_func
from attr_engine.baselines.base import Explainer, FunctionExplainer, resolve_targets
from attr_engine.baselines.cam import GradCAM, is_vit
from attr_engine.baselines.captum_any import CaptumMethod, captum_class
from attr_engine.baselines.gradients import (
    Gradient,
    GradientXInput,
    IntegratedGradients,
    Occlusion,
    Saliency,
    SmoothGrad,
)
from attr_engine.baselines.ours import AHAExplainer, PullbackExplainer
from attr_engine.baselines.rise import RISE, rise_masks
from attr_engine.baselines.rollout import AttentionRollout

__all__ = [
    "RISE",
    "AHAExplainer",
    "AttentionRollout",
    "CaptumAdapter",
    "CaptumMethod",
    "Explainer",
    "ExplainerSpec",
    "FunctionExplainer",
    "GradCAM",
    "Gradient",
    "GradientXInput",
    "IntegratedGradients",
    "Occlusion",
    "PullbackExplainer",
    "Saliency",
    "SmoothGrad",
    "captum_class",
    "get_explainer",
    "is_vit",
    "list_explainers",
    "quantus_explain_func",
    "register_explainer",
    "resolve_targets",
    "rise_masks",
]


@dataclass(frozen=True)
class ExplainerSpec:
    """A registry entry: ``factory(classifier, **kwargs) -> Explainer``; ``applies(model)`` says which models fit."""

    name: str
    factory: Callable[..., Explainer]
    description: str
    applies: Callable[[nn.Module], bool] = lambda model: True


_REGISTRY: dict[str, ExplainerSpec] = {}
_ALIASES = {
    "grad": "gradient",
    "gxi": "gradient-x-input",
    "input-x-gradient": "gradient-x-input",
    "ig": "integrated-gradients",
    "gradcam": "grad-cam",
    "rollout": "attention-rollout",
    "sfp": "pullback-soft",
    "pa": "pullback-ascent",
}


def _canonical(name: str) -> str:
    if not isinstance(name, str):
        raise ValueError(f"explainer name must be a string, got {type(name).__name__}")
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    return _ALIASES.get(key, key)


def register_explainer(
    name: str,
    factory: Callable[..., Explainer],
    *,
    description: str = "",
    applies: Callable[[nn.Module], bool] | None = None,
) -> None:
    """Add a method to the registry (names are case-insensitive; ``_`` and ``-`` are the same)."""
    key = _canonical(name)
    if key in _REGISTRY:
        raise ValueError(f"an explainer named {key!r} is already registered")
    _REGISTRY[key] = ExplainerSpec(key, factory, description, applies or (lambda model: True))


def list_explainers(classifier: nn.Module | None = None) -> list[str]:
    """Registered method names, sorted; with ``classifier``, only those that apply to its model."""
    if classifier is None:
        return sorted(_REGISTRY)
    model = getattr(classifier, "model", classifier)
    return sorted(name for name, spec in _REGISTRY.items() if spec.applies(model))


def get_explainer(name: str, classifier: nn.Module, **kwargs: Any) -> Explainer:
    """Build the explainer ``name`` for ``classifier``; ``kwargs`` go to its constructor.

    Raises:
        ValueError: an unknown name (listing the known ones), a method that does not apply to this model, or bad
            constructor arguments (e.g. ``"aha"`` without ``aha=``).
    """
    if isinstance(name, str) and name.strip().lower().startswith("captum:"):
        return CaptumMethod(classifier, name.strip()[len("captum:") :], **kwargs)
    key = _canonical(name)
    spec = _REGISTRY.get(key)
    if spec is None:
        raise ValueError(f"unknown explainer {name!r}; known: {', '.join(list_explainers())}")
    model = getattr(classifier, "model", classifier)
    if not spec.applies(model):
        raise ValueError(f"explainer {key!r} does not apply to {type(model).__name__} ({spec.description})")
    return spec.factory(classifier, **kwargs)


def _grad_cam_applies(model: nn.Module) -> bool:
    return is_vit(model) or bool(getattr(model, "feature_info", None))


register_explainer("gradient", Gradient, description="signed input gradient, channel mean")
register_explainer("saliency", Saliency, description="max over channels of |input gradient|")
register_explainer("gradient-x-input", GradientXInput, description="gradient x input, channel sum")
register_explainer("integrated-gradients", IntegratedGradients, description="Integrated Gradients, channel sum")
register_explainer("smoothgrad", SmoothGrad, description="SmoothGrad of |gradient|, max over channels")
register_explainer("occlusion", Occlusion, description="sliding-window occlusion to the mean colour")
register_explainer(
    "grad-cam", GradCAM, description="Grad-CAM, timm CNN stages or ViT tokens", applies=_grad_cam_applies
)
register_explainer("rise", RISE, description="RISE random masks")
register_explainer("attention-rollout", AttentionRollout, description="attention rollout, timm ViTs", applies=is_vit)
register_explainer("aha", AHAExplainer, description="trained AHA explainer (aha=..., refine_steps=T)")
register_explainer(
    "pullback-soft",
    lambda classifier, **kw: PullbackExplainer(classifier, method="soft", **kw),
    description="Soft Pullback (SfP)",
)
register_explainer(
    "pullback-ascent",
    lambda classifier, **kw: PullbackExplainer(classifier, method="ascent", **kw),
    description="Pullback Ascent (PA)",
)
register_explainer(
    "deeplift",
    lambda classifier, **kw: CaptumMethod(classifier, "DeepLift", **kw),
    description="DeepLift (Captum), channel sum",
)
register_explainer(
    "guided-grad-cam",
    lambda classifier, **kw: CaptumMethod(classifier, "GuidedGradCam", display_reduce="abs", **kw),
    description="Guided Grad-CAM (Captum) on the last CNN stage, mean |value| over channels",
    applies=lambda model: bool(getattr(model, "feature_info", None)) and not is_vit(model),
)
