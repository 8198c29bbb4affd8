"""Attribution baselines, each an :class:`~attr_engine.explainer.Explainer` registered by name.

``get_explainer(name, classifier, **kwargs).attribute(inputs, target=None, baselines=None) -> (B, H, W)``
(:func:`attr_engine.get_explainer`); importing this package registers:

| name | method | where |
|---|---|---|
| gradient, saliency, gradient-x-input, integrated-gradients | gradient baselines | Captum |
| smoothgrad, occlusion | noise / perturbation baselines | Captum |
| grad-cam | Grad-CAM: timm / torchvision CNN stages through Captum, ViT tokens here | Captum / here |
| rise | RISE, masks on the device | here |
| mda | MDA (Walker et al. 2025): a per-image greedy search driven by the perturbation curves | here |
| attention-rollout | attention rollout (ViTs) | here |
| legrad | LeGrad (Bousselham et al., ICCV 2025): gradients w.r.t. attention maps (ViTs) | here |
| deeplift, guided-grad-cam | DeepLift (Shrikumar et al. 2017); Guided Grad-CAM on the last CNN stage | Captum |
| captum:<ClassName> | any ``captum.attr`` class, Captum's option names (:class:`CaptumMethod`) | Captum |
| gradcam:<ClassName> | any pytorch-grad-cam CAM class (:class:`GradCamMethod`; the ``cam`` extra) | pytorch-grad-cam |

This project's own methods register themselves from their packages: ``aha`` (:class:`attr_engine.aha.AHA`) and
``pullback-soft`` / ``pullback-ascent`` (:class:`attr_engine.pullback.SemanticPullback`).
"""

from __future__ import annotations

from torch import nn

from attr_engine.baselines.cam import GradCAM, has_cnn_stage, is_vit, vit_layout
from attr_engine.baselines.captum_any import CaptumMethod, captum_class
from attr_engine.baselines.gradcam_any import GradCamMethod, gradcam_class
from attr_engine.baselines.gradients import (
    Gradient,
    GradientXInput,
    IntegratedGradients,
    Occlusion,
    Saliency,
    SmoothGrad,
)
from attr_engine.baselines.legrad import LeGrad, legrad_applies
from attr_engine.baselines.mda import MDA
from attr_engine.baselines.rise import RISE, rise_masks
from attr_engine.baselines.rollout import AttentionRollout
from attr_engine.explainer import register_explainer, register_explainer_family

__all__ = [
    "MDA",
    "RISE",
    "AttentionRollout",
    "CaptumMethod",
    "GradCAM",
    "GradCamMethod",
    "Gradient",
    "GradientXInput",
    "IntegratedGradients",
    "LeGrad",
    "Occlusion",
    "Saliency",
    "SmoothGrad",
    "captum_class",
    "gradcam_class",
    "is_vit",
    "legrad_applies",
    "rise_masks",
]


def _grad_cam_applies(model: nn.Module) -> bool:
    """ViTs (timm, torchvision, transformers: their tokens), timm CNNs and torchvision CNNs (ResNet, VGG, ConvNeXt,
    ...: their last stage)."""
    return vit_layout(model) is not None or has_cnn_stage(model)


register_explainer("gradient", Gradient, description="signed input gradient, channel mean")
register_explainer("saliency", Saliency, description="max over channels of |input gradient|")
register_explainer("gradient-x-input", GradientXInput, description="gradient x input, channel sum")
register_explainer("integrated-gradients", IntegratedGradients, description="Integrated Gradients, channel sum")
register_explainer("smoothgrad", SmoothGrad, description="SmoothGrad of |gradient|, max over channels")
register_explainer("occlusion", Occlusion, description="sliding-window occlusion to the mean colour")
register_explainer(
    "grad-cam",
    GradCAM,
    description="Grad-CAM, timm / torchvision CNN stages or ViT tokens",
    applies=_grad_cam_applies,
)
register_explainer("rise", RISE, description="RISE random masks")
register_explainer("mda", MDA, description="MDA metric-driven attribution, a per-image search (slow)")
register_explainer("attention-rollout", AttentionRollout, description="attention rollout, timm ViTs", applies=is_vit)
register_explainer(
    "legrad", LeGrad, description="LeGrad, gradients w.r.t. attention maps, ViTs", applies=legrad_applies
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
register_explainer_family("captum", CaptumMethod)
register_explainer_family("gradcam", GradCamMethod)
