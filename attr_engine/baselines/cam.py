"""Grad-CAM (Selvaraju et al. 2017) for CNNs (through Captum) and ViTs (on the last block's patch tokens).

CNNs: Captum's ``LayerGradCam`` on the last feature stage (timm's ``feature_info[-1]``), ReLU, then bilinear
upsampling to the input size. ViTs: Captum's layer methods expect a (B, C, h, w) layer output, so the token case is
done here, on the tokens *entering* the last block (in a class-token ViT only the class token of the last block's
output reaches the head, so its patch tokens have zero gradient; the common choice, as in pytorch-grad-cam, is the
last block's input side). The patch tokens - the prefix tokens (class / distillation / register) dropped - are laid
out on the patch grid, weighted by their mean gradient per channel, summed over channels, passed through a ReLU and
upsampled bilinearly. timm, torchvision and transformers ViTs are read alike, through
:func:`~attr_engine.baselines._vit.vit_layout` (blocks, prefix tokens, grid).

The last CNN stage (:func:`cnn_stage`) is timm's ``feature_info[-1]``, or for torchvision classifiers (found by their
structure: attr-engine never imports torchvision) ResNet's ``layer4``, the last stage of ``features`` (ConvNeXt,
EfficientNet, MobileNet, DenseNet) or, where ``features`` is a flat list of layers (VGG, AlexNet), the ReLU after
its last convolution: that ReLU is in place, so a hook on the Conv2d itself would see its output rectified after
the fact while the gradient reaching it is the pre-ReLU one - the ReLU's output is the rectified feature map Grad-CAM
weights, with its own gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attr_engine.baselines._captum import import_captum
from attr_engine.baselines._vit import is_vit, token_grid, vit_layout
from attr_engine.explainer import Explainer
from attr_engine.model_sources import is_torchvision_vit

__all__ = [
    "GradCAM",
    "cnn_stage",
    "find_layer",
    "has_cnn_stage",
    "is_torchvision_vit",
    "is_vit",
    "layer_name",
    "token_grid",
    "vit_layout",
]


def find_layer(classifier: nn.Module, name: str) -> nn.Module:
    """The module called ``name`` in the classifier's model (``"layer4"``, ``"blocks.1"``), else in the classifier."""
    model = getattr(classifier, "model", classifier)
    for root in (model, classifier):
        try:
            return root.get_submodule(name)
        except AttributeError:
            continue
    raise ValueError(f"{type(model).__name__} has no layer named {name!r}")


def layer_name(classifier: nn.Module, layer: nn.Module) -> str:
    """The name of ``layer`` inside the classifier's model (or the classifier), as :func:`find_layer` reads it."""
    model = getattr(classifier, "model", classifier)
    for root in (model, classifier):
        for name, module in root.named_modules():
            if module is layer:
                return name
    raise ValueError(f"layer {type(layer).__name__} is not a module of the explained classifier")


# Layers a flat ``features`` list (torchvision VGG, AlexNet) is made of; a ``features`` of stages has other modules.
_FLAT_LAYERS = (nn.Conv2d, nn.ReLU, nn.MaxPool2d, nn.BatchNorm2d, nn.Dropout, nn.AdaptiveAvgPool2d)


def _torchvision_cnn_stage(model: nn.Module) -> nn.Module | None:
    """The last feature stage of a torchvision CNN (see the module doc), or None if ``model`` has no such layout."""
    stage = getattr(model, "layer4", None)
    if isinstance(stage, nn.Module) and hasattr(model, "fc"):  # ResNet, ResNeXt, Wide ResNet
        return stage
    features = getattr(model, "features", None)
    if not isinstance(features, nn.Sequential) or len(features) == 0 or is_torchvision_vit(model):
        return None
    children = list(features)
    if not all(isinstance(c, _FLAT_LAYERS) for c in children):
        return children[-1]  # ConvNeXt, EfficientNet, MobileNet, DenseNet: the last stage
    convs = [i for i, c in enumerate(children) if isinstance(c, nn.Conv2d)]
    if not convs:
        return None
    last = convs[-1]
    after = children[last + 1] if last + 1 < len(children) else None
    return after if isinstance(after, nn.ReLU) else children[last]


def _timm_cnn_stage(model: nn.Module) -> nn.Module | None:
    info = getattr(model, "feature_info", None)
    if info:
        entry = info[-1]
        name = entry.get("module") if isinstance(entry, dict) else None
        if name:
            return model.get_submodule(name)
    return None


def has_cnn_stage(model: nn.Module) -> bool:
    """Whether :func:`cnn_stage` finds a last CNN stage in ``model`` (a timm CNN or a torchvision one)."""
    return vit_layout(model) is None and (_timm_cnn_stage(model) or _torchvision_cnn_stage(model)) is not None


def cnn_stage(model: nn.Module) -> nn.Module:
    """The last feature stage of a timm CNN (``feature_info[-1]``) or a torchvision CNN (see the module doc).

    Raises:
        ValueError: neither layout; the message asks for ``layer=``.
    """
    stage = _timm_cnn_stage(model)
    if stage is None:
        stage = _torchvision_cnn_stage(model)
    if stage is None:
        raise ValueError(
            f"cannot find the last feature stage of {type(model).__name__} (no timm feature_info, no torchvision "
            "layer4 or features); pass layer="
        )
    return stage


class GradCAM(Explainer):
    """Grad-CAM maps, upsampled to the input.

    Args:
        classifier: a :class:`~attr_engine.classifier.Classifier` around a timm CNN, a torchvision CNN (ResNet,
            VGG, ConvNeXt, ...: :func:`cnn_stage`) or a timm, torchvision or transformers ViT
            (:func:`~attr_engine.baselines._vit.vit_layout`).
        layer: the module to take activations from; None picks the last CNN stage, or for ViTs the last block
            (whose input tokens are used). Any other layer goes to Captum's ``LayerGradCam``, which expects a
            (B, C, h, w) output.
    """

    name = "grad-cam"

    def __init__(self, classifier: nn.Module, *, layer: nn.Module | str | None = None) -> None:
        super().__init__(classifier)
        model = getattr(classifier, "model", classifier)
        if isinstance(layer, str):
            layer = find_layer(classifier, layer)
        layout = vit_layout(model)
        self.tokens = layout is not None and (layer is None or layer is layout.blocks[-1])
        if layer is None:
            layer = layout.blocks[-1] if layout is not None else cnn_stage(model)
        self.layer = layer
        self._layer_name = layer_name(classifier, self.layer)

    def _bind(self) -> None:
        # The same layer, by name, in the new classifier (e.g. Quantus' copy with randomised weights).
        self.layer = find_layer(self.classifier, self._layer_name)

    def _attribute(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.tokens:
            cam = self._token_cam(x, target)
        else:
            captum = import_captum()
            gradcam = captum.LayerGradCam(self.classifier, self.layer)
            cam = gradcam.attribute(x.detach().requires_grad_(True), target=target, relu_attributions=True)
        return F.interpolate(cam.float(), size=x.shape[-2:], mode="bilinear", align_corners=False).squeeze(1)

    def _token_cam(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        layout: Any = vit_layout(getattr(self.classifier, "model", self.classifier))  # a ViT: self.tokens says so
        captured: list[torch.Tensor] = []
        handle = self.layer.register_forward_hook(lambda _m, inputs, _out: captured.append(inputs[0]))
        try:
            logits = self.classifier(x.detach().requires_grad_(True))
        finally:
            handle.remove()
        if len(captured) != 1 or captured[0].ndim != 3:
            raise RuntimeError(f"expected one (B, N, D) token input to the last block, got {len(captured)} calls")
        tokens = captured[0]
        (grads,) = torch.autograd.grad(logits.gather(1, target[:, None]).sum(), tokens)
        cells = layout.reshape(*x.shape[-2:])  # (B, D, rows, cols), the prefix tokens dropped
        tokens, grads = cells(tokens), cells(grads)
        weights = grads.mean(dim=(2, 3), keepdim=True)  # (B, D, 1, 1): global-average-pooled gradient per channel
        return (tokens * weights).sum(dim=1, keepdim=True).relu().detach()
