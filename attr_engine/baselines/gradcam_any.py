"""Any CAM method of pytorch-grad-cam (PyPI ``grad-cam``) as an :class:`~attr_engine.explainer.Explainer`:
``gradcam:<ClassName>``.

``get_explainer("gradcam:GradCAMPlusPlus", clf)`` (and ``attr-engine explain --method gradcam:GradCAMPlusPlus``)
runs ``pytorch_grad_cam.GradCAMPlusPlus(model=clf, target_layers=[layer], reshape_transform=...)`` with one
``ClassifierOutputTarget(t)`` per image - the library's own call, so the maps are the library's maps. Every
``BaseCAM`` method of the library is a member (GradCAM, GradCAMPlusPlus, HiResCAM, ScoreCAM, XGradCAM, EigenCAM,
EigenGradCAM, LayerCAM, AblationCAM, FullGrad, ...); the meta-methods that wrap another CAM class (FinerCAM,
RefineCAM, SESS) take a class as an option and are not.

The model is the :class:`~attr_engine.classifier.Classifier` itself: an ``nn.Module`` that normalises [0, 1] images
and then calls the wrapped model, which is what the library's classes expect of ``model`` (a module on the images
they are given), and whose layers stay findable under ``.model``.

Layers: ``layer`` is a module or its name in the model (``"layer4"``, ``"blocks.1.norm1"``); by default the last
CNN stage (:func:`~attr_engine.baselines.cam.cnn_stage`: timm ``feature_info[-1]``, torchvision ``layer4`` /
``features``), for a ViT its last block's first LayerNorm: timm ``blocks[-1].norm1``, torchvision
``encoder.layers[-1].ln_1``, transformers ``vit.layers[-1].layernorm_before`` (the layer pytorch-grad-cam's
documentation uses for ViTs; :func:`~attr_engine.baselines._vit.vit_layout`). A ViT layer's (B, N, D) tokens are
reshaped to (B, D, h, w) on the patch grid, its prefix tokens (class, distillation, register) dropped; (B, C, h, w)
outputs pass unchanged.

Options: the class's constructor arguments beyond model / layers / reshape (``batch_size`` and
``ratio_channels_to_ablate`` of AblationCAM, ``k`` of FEM, ``kernel`` / ``gamma`` of KPCA_CAM), ScoreCAM's
``batch_size`` (an attribute the library reads, default 16), and the call's ``aug_smooth`` / ``eigen_smooth``.

Normalisation: the library's own (ReLU, min-max to [0, 1] per map on the layer's grid inside its call, OpenCV's
bilinear resize), so ``gradcam:GradCAM`` equals ``pytorch_grad_cam.GradCAM`` exactly; to compare magnitudes across
images use the project's ``grad-cam``. A map whose ReLU leaves nothing (or a 1 x 1 grid) is all zeros.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from attr_engine.baselines._grad_cam import import_grad_cam
from attr_engine.baselines.cam import cnn_stage, find_layer, layer_name, vit_layout
from attr_engine.explainer import Explainer

__all__ = ["GradCamMethod", "cam_layer", "gradcam_class", "token_reshape"]

# Constructor parameters the wrapper supplies itself.
_SUPPLIED = {"self", "model", "target_layers", "reshape_transform"}
# Options of every call (BaseCAM.__call__), with the library's defaults.
_CALL_OPTIONS: dict[str, Any] = {"aug_smooth": False, "eigen_smooth": False}
# ScoreCAM reads ``self.batch_size`` if set (16 otherwise): an option here, as AblationCAM's constructor has one.
_SCORECAM_BATCH = 16
# Options whose documented range the library does not check: (low, high, as the docs write it); low excluded.
_DOCUMENTED_RANGES = {
    "ratio_channels_to_ablate": (0.0, 1.0, "(0, 1] (the fraction of the layer's channels AblationCAM ablates)"),
    "k": (0.0, float("inf"), "(0, inf) (FEM's multiple of the standard deviation)"),
}


def gradcam_class(name: str) -> type[Any]:
    """The pytorch-grad-cam CAM class called ``name`` (case-insensitive), or a ValueError listing the known ones."""
    lib = import_grad_cam()
    base = lib.base_cam.BaseCAM
    classes = {
        n.lower(): getattr(lib, n)
        for n in dir(lib)
        if isinstance(getattr(lib, n), type) and issubclass(getattr(lib, n), base) and getattr(lib, n) is not base
    }
    cls = classes.get(name.strip().lower())
    if cls is None:
        known = ", ".join(sorted(c.__name__ for c in classes.values()))
        raise ValueError(f"pytorch_grad_cam has no CAM class {name!r}; known: {known}")
    return cls


def cam_layer(model: nn.Module) -> nn.Module:
    """The default target layer of ``model``: a ViT's last block's first LayerNorm (timm ``blocks[-1].norm1``,
    torchvision ``encoder.layers[-1].ln_1``, transformers ``layers[-1].layernorm_before``), else the last CNN stage
    (:func:`~attr_engine.baselines.cam.cnn_stage`)."""
    layout = vit_layout(model)
    return layout.cam_layer if layout is not None else cnn_stage(model)


def token_reshape(model: nn.Module, height: int, width: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The library's ``reshape_transform`` for a ViT on ``height`` x ``width`` images (None for other models):
    (B, P + h * w, D) tokens -> (B, D, h, w), the P prefix tokens dropped; (B, C, h, w) tensors pass unchanged."""
    layout = vit_layout(model)
    return layout.reshape(height, width) if layout is not None else None


def _init_types(cls: type[Any]) -> dict[str, Any]:
    """The constructor's annotations, resolved where they can be (the library annotates some with ``typing``)."""
    try:
        return typing.get_type_hints(cls.__init__)
    except Exception:  # a forward reference that does not resolve: nothing is checked beyond the defaults' types
        return {}


class GradCamMethod(Explainer):
    """A pytorch-grad-cam CAM class (gradcam:GradCAM, GradCAMPlusPlus, ScoreCAM, ...), maps in [0, 1] per image.

    Args:
        classifier: the explained classifier (the library's ``model``).
        class_name: the ``pytorch_grad_cam`` class, e.g. ``"GradCAM"``, ``"HiResCAM"``, ``"EigenCAM"``.
        layer: the target layer, a module or its name; None takes :func:`cam_layer`'s choice.
        options: the class's constructor options and the call's ``aug_smooth`` / ``eigen_smooth`` (see the module
            doc); every option may also be given per call.

    ``attribute`` returns (B, H, W) float32 maps at the input size, each scaled to [0, 1] by the library.
    """

    def __init__(
        self, classifier: nn.Module, class_name: str, *, layer: nn.Module | str | None = None, **options: Any
    ) -> None:
        cls = gradcam_class(class_name)
        self.cam_cls = cls
        self.name = f"gradcam:{cls.__name__}"
        init = inspect.signature(cls.__init__).parameters
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        self._init_names = [n for n, p in init.items() if n not in _SUPPLIED and p.kind in kinds]
        types = _init_types(cls)
        # Per instance here: the options are read from this class's constructor.
        self.options = {n: init[n].default for n in self._init_names}  # type: ignore[misc]
        self.option_types = {n: types[n] for n in self._init_names if n in types}  # type: ignore[misc]
        self._batch_attribute = cls.__name__ == "ScoreCAM" and "batch_size" not in self.options
        if self._batch_attribute:
            self.options["batch_size"] = _SCORECAM_BATCH
        self.options.update(_CALL_OPTIONS)
        super().__init__(classifier, **options)
        model = getattr(classifier, "model", classifier)
        module = find_layer(classifier, layer) if isinstance(layer, str) else layer
        self._layer_name = layer_name(classifier, module if module is not None else cam_layer(model))
        self._check_constructor()

    def _check_options(self, options: dict[str, Any]) -> None:
        missing = [k for k, v in options.items() if v is inspect.Parameter.empty]
        if missing:
            raise ValueError(f"{self.name} needs the option(s) {', '.join(missing)} (its required arguments)")
        size = options.get("batch_size")  # an int (or None) by now: its type was checked with the others
        if isinstance(size, int) and size < 1:
            raise ValueError(f"{self.name} option 'batch_size' must be at least 1, got {size}")
        # The documented ranges the library's constructors leave unchecked (out of range they run, with NumPy
        # warnings and meaningless maps).
        for key, (low, high, shown) in _DOCUMENTED_RANGES.items():
            value = options.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and not low < value <= high:
                raise ValueError(f"{self.name} option {key!r} must be in {shown}, got {value!r}")

    def _check_constructor(self) -> None:
        """Build the library's object once with the options, so that its own argument checks (SESS's ``pool``,
        ``num_scales``, ...) refuse a bad value when the method is built, not at its first map; its hooks come off
        at once."""
        try:
            cam = self.cam_cls(model=self.classifier, target_layers=[self.layer], **self._init_options(self.defaults,
                               vit=False))  # fmt: skip
        except (TypeError, AssertionError) as err:
            raise ValueError(f"{self.name}: {err}") from None
        hooks = getattr(cam, "activations_and_grads", None)
        if hooks is not None:
            hooks.release()

    @property
    def layer(self) -> nn.Module:
        """The target layer, looked up by name in the current classifier (so :meth:`rebind` follows it)."""
        return find_layer(self.classifier, self._layer_name)

    def _init_options(self, options: dict[str, Any], vit: bool) -> dict[str, Any]:
        """The constructor's options of this call; on a ViT, AblationCAM's default ablation layer is the library's
        ``AblationLayerVit`` (its documented ViT call: the CNN one indexes (B, C, h, w) activations)."""
        init = {k: options[k] for k in self._init_names}
        if vit and "ablation_layer" in init and init["ablation_layer"] is self.options["ablation_layer"]:
            init["ablation_layer"] = import_grad_cam().AblationLayerVit()
        return init

    def _attribute(self, x: torch.Tensor, target: torch.Tensor, **options: Any) -> torch.Tensor:
        lib = import_grad_cam()
        model = getattr(self.classifier, "model", self.classifier)
        reshape = token_reshape(model, *x.shape[-2:])
        layer = self.layer
        init = self._init_options(options, vit=reshape is not None)
        # Where the layer sits: AblationCAM swaps it out of its parent for the call and only puts it back on success.
        slots = [(m, k) for m in self.classifier.modules() for k, c in m._modules.items() if c is layer]
        # Built per call: the library hooks the layer when constructed and unhooks on release, so no hook stays on
        # the classifier between calls (other methods run the same model).
        cam = self.cam_cls(model=self.classifier, target_layers=[layer], reshape_transform=reshape, **init)
        try:
            if self._batch_attribute and options["batch_size"] is not None:
                cam.batch_size = options["batch_size"]
            targets = [lib.utils.model_targets.ClassifierOutputTarget(int(t)) for t in target.tolist()]
            # The input needs a gradient: with the classifier frozen, nothing else makes the layer's output need one.
            maps = cam(
                input_tensor=x.detach().requires_grad_(True),
                targets=targets,
                aug_smooth=options["aug_smooth"],
                eigen_smooth=options["eigen_smooth"],
            )
        finally:
            cam.activations_and_grads.release()
            for parent, key in slots:
                parent._modules[key] = layer
        return torch.from_numpy(np.ascontiguousarray(maps, dtype=np.float32)).to(x.device)
