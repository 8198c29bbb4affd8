"""Classifiers from outside timm: torchvision's model registry and Hugging Face ``transformers`` image classifiers.

:func:`~attr_engine.classifier.load_classifier` reads the source from the name's prefix:

- ``"torchvision:<builder>"``: a classification model of ``torchvision.models`` (``torchvision.models.list_models
  (module=torchvision.models)``: ``resnet50``, ``vgg11_bn``, ``convnext_tiny``, ``vit_b_16``, ...), built with
  ``torchvision.models.get_model(builder, weights="DEFAULT" if pretrained else None, ...)``. The normalisation and
  crop are those of the builder's default weights (``weights.transforms()``: every torchvision classification model
  uses the ImageNet mean and std).
- ``"hf:<repo id or directory>"``: ``transformers.AutoModelForImageClassification`` (the ``hf`` extra), loaded with
  ``from_pretrained(..., use_safetensors=True, trust_remote_code=False)`` - safetensors only, never a pickle, and no
  code from the hub - or, without ``pretrained``, built from its config with random weights. The model's output
  object gives the logits; mean, std and input size come from its image processor config
  (``preprocessor_config.json``). ``hf:`` is transformers; ``hf-hub:`` stays timm's own hub prefix.

The preprocessing a source publishes is stored on the built module as a timm-style ``pretrained_cfg`` dict
(``input_size``, ``mean``, ``std``, ``crop_pct``, ``interpolation``), so :class:`~attr_engine.classifier.Classifier`
and :func:`~attr_engine.imageops.data_config` read it exactly as they read a timm model's. torchvision and
transformers are imported only when such a name is built: ``import attr_engine`` imports neither.
"""

from __future__ import annotations

import difflib
import inspect
import os
import socket
import sys
from types import ModuleType
from typing import Any

import torch
from torch import nn

from attr_engine._optional import optional_import
from attr_engine.guards import HF_PREFIX, TORCHVISION_PREFIX, split_source

__all__ = [
    "HF_PREFIX",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "TORCHVISION_PREFIX",
    "HFImageClassifier",
    "as_hf_adapter",
    "build_torchvision",
    "check_torchvision_name",
    "hub_reachable_or_offline",
    "import_transformers",
    "is_hf_classifier",
    "is_torchvision_vit",
    "load_hf",
    "split_source",
    "torchvision_names",
]

# TORCHVISION_PREFIX, HF_PREFIX and split_source live in attr_engine.guards (a name is read there without torch).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# PIL resampling codes (what an HF image processor's ``resample`` holds) -> timm's interpolation names.
_PIL_RESAMPLE = {0: "nearest", 2: "bilinear", 3: "bicubic"}


# ----------------------------------------------------------------------------------------------------------------
# torchvision
# ----------------------------------------------------------------------------------------------------------------


def _torchvision_models() -> ModuleType:
    import torchvision.models

    return torchvision.models


def torchvision_names() -> list[str]:
    """The builders of torchvision's classification models (not detection, segmentation, video, ...)."""
    models = _torchvision_models()
    return list(models.list_models(module=models))


def is_torchvision_vit(model: nn.Module) -> bool:
    """Whether ``model`` is a torchvision ``VisionTransformer``: encoder blocks over a class token and patches."""
    layers = getattr(getattr(model, "encoder", None), "layers", None)
    return (
        isinstance(layers, nn.Sequential)
        and len(layers) > 0
        and hasattr(model, "class_token")
        and isinstance(getattr(model, "patch_size", None), int)
    )


def check_torchvision_name(builder: str) -> None:
    """Raise a ValueError with close matches unless ``builder`` is a torchvision classification model."""
    names = torchvision_names()
    if builder in names:
        return
    close = difflib.get_close_matches(builder, names, n=6, cutoff=0.6)
    hint = f" Close matches: {', '.join(close)}." if close else ""
    raise ValueError(
        f"unknown torchvision classification model {builder!r}.{hint} See "
        "torchvision.models.list_models(module=torchvision.models)."
    )


def _torchvision_cfg(builder: str, input_size: tuple[int, int, int] | None) -> dict[str, Any]:
    """The preprocessing of ``builder``'s default weights (read from torchvision's metadata: no download)."""
    models = _torchvision_models()
    cfg: dict[str, Any] = {"mean": IMAGENET_MEAN, "std": IMAGENET_STD, "interpolation": "bilinear", "crop_pct": 1.0}
    weights = models.get_model_weights(builder).DEFAULT
    transforms = weights.transforms()
    crop, resize = getattr(transforms, "crop_size", None), getattr(transforms, "resize_size", None)
    if crop and resize:
        cfg["crop_pct"] = float(crop[0]) / float(resize[0])
    if getattr(transforms, "mean", None) is not None:
        cfg["mean"], cfg["std"] = tuple(transforms.mean), tuple(transforms.std)
    mode = getattr(getattr(transforms, "interpolation", None), "value", None)
    if mode in ("bilinear", "bicubic", "nearest"):
        cfg["interpolation"] = mode
    if input_size is None:
        side = int(crop[0]) if crop else 224
        input_size = (3, side, side)
    cfg["input_size"] = input_size
    return cfg


def build_torchvision(
    builder: str,
    *,
    pretrained: bool = False,
    num_classes: int | None = None,
    img_size: int | None = None,
    **kwargs: Any,
) -> nn.Module:
    """``torchvision.models.get_model(builder, weights="DEFAULT" if pretrained else None, ...)``, its preprocessing
    recorded as ``pretrained_cfg`` (see the module doc).

    ``img_size`` becomes the ``image_size`` of models whose architecture depends on it (torchvision's
    VisionTransformer); for the others (CNNs) it is only recorded as the input size.

    Raises:
        ValueError: an unknown builder, or arguments the builder refuses (a ``num_classes`` the pretrained weights
            do not have, an unknown keyword).
    """
    check_torchvision_name(builder)
    models = _torchvision_models()
    build_kwargs = dict(kwargs)
    if num_classes is not None:
        build_kwargs["num_classes"] = num_classes
    weights = "DEFAULT" if pretrained else None
    try:
        if img_size is None:
            model = models.get_model(builder, weights=weights, **build_kwargs)
        else:
            try:
                model = models.get_model(builder, weights=weights, image_size=img_size, **build_kwargs)
            except TypeError as err:
                if "image_size" not in str(err):
                    raise
                model = models.get_model(builder, weights=weights, **build_kwargs)  # a CNN runs at any size
    except (TypeError, ValueError) as err:
        raise ValueError(f"cannot build torchvision:{builder} with {build_kwargs}: {err}") from err
    side = img_size or getattr(model, "image_size", None)
    model.pretrained_cfg = _torchvision_cfg(builder, (3, int(side), int(side)) if side else None)
    return model


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face transformers
# ----------------------------------------------------------------------------------------------------------------


def import_transformers() -> ModuleType:
    """``transformers``, or an ImportError saying how to install it (the ``hf`` extra)."""
    return optional_import(
        "transformers",
        "hf: models need Hugging Face transformers: pip install 'attr-engine[hf]' (or pip install transformers)",
    )


def is_hf_classifier(model: nn.Module) -> bool:
    """Whether ``model`` is the :class:`HFImageClassifier` adapter (``Classifier.model`` of an ``hf:`` model)."""
    return isinstance(model, HFImageClassifier)


def _is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel``, read from its class ancestry (no import)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.") for c in type(model).mro())


def as_hf_adapter(model: nn.Module) -> nn.Module:
    """``model`` itself, or a raw transformers image classifier wrapped in :class:`HFImageClassifier`.

    A transformers model takes ``pixel_values`` and returns an output object (its logits in ``.logits``), so it
    cannot be called as a logits module; ``*ForImageClassification`` models (ViT, DeiT, BEiT, ConvNeXt, Swin, ...:
    transformers' naming for the image-classification heads) are wrapped. Any other transformers model
    (``ViTModel``, a text model) has no class logits to explain.

    Raises:
        ValueError: a transformers model that is not an image classifier, in one line naming HFImageClassifier.
    """
    if not _is_transformers_model(model) or isinstance(model, HFImageClassifier):
        return model
    if "ForImageClassification" not in type(model).__name__:
        raise ValueError(
            f"{type(model).__name__} is a transformers model without an image-classification head; Classifier "
            "wraps *ForImageClassification models in HFImageClassifier (AutoModelForImageClassification)"
        )
    return HFImageClassifier(model)


class HFImageClassifier(nn.Module):
    """A transformers image classifier as a plain ``(B, 3, H, W) -> (B, K)`` logits module.

    Args:
        model: a ``transformers`` ``PreTrainedModel`` for image classification (``ViTForImageClassification``, ...).

    ``forward`` reads ``.logits`` from the model's output object. Inputs of another size than the config's
    ``image_size`` are passed with ``interpolate_pos_encoding=True`` where the model takes it (ViT, DeiT, BEiT), so
    its position embeddings are interpolated to the grid as transformers does. :meth:`hidden_states` gives the
    model's own ``output_hidden_states`` (what AHA taps).
    """

    pretrained_cfg: dict[str, Any]  # set by load_hf: the image processor's preprocessing, in timm's keys

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        config = getattr(model, "config", None)
        if config is None or not isinstance(getattr(config, "num_labels", None), int):
            raise ValueError(f"{type(model).__name__} is not a transformers image classifier (no config.num_labels)")
        self.hf = model
        self.num_classes: int = int(config.num_labels)
        self._interpolates = "interpolate_pos_encoding" in inspect.signature(model.forward).parameters

    @property
    def config(self) -> Any:
        """The transformers config of the wrapped model."""
        return self.hf.config

    def _call(self, x: torch.Tensor, **kwargs: Any) -> Any:
        size = getattr(self.hf.config, "image_size", None)
        expected = (size, size) if isinstance(size, int) else tuple(size) if size else None
        if self._interpolates and expected is not None and tuple(x.shape[-2:]) != expected:
            kwargs["interpolate_pos_encoding"] = True
        return self.hf(pixel_values=x, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, 3, H, W) normalised images -> (B, K) logits."""
        out = self._call(x)
        return out.logits if hasattr(out, "logits") else out[0]

    def hidden_states(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: (B, 3, H, W) -> the model's hidden states: the embeddings, then one per layer or stage, each
        (B, N, D) tokens (transformers) or (B, C, h, w) maps (CNNs, and hierarchical transformers such as Swin,
        whose ``reshaped_hidden_states`` are taken: their stages' tokens lie on grids coarser than the patches)."""
        return self.logits_and_hidden_states(x)[1]

    def logits_and_hidden_states(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """x: (B, 3, H, W) -> ((B, K) logits, :meth:`hidden_states`), both from one pass of the model."""
        out = self._call(x, output_hidden_states=True)
        states = getattr(out, "reshaped_hidden_states", None) or getattr(out, "hidden_states", None)
        if not states:
            raise ValueError(f"{type(self.hf).__name__} returns no hidden_states")
        return (out.logits if hasattr(out, "logits") else out[0]), tuple(states)


def _hf_processor_cfg(processor: Any, ident: str, img_size: int | None) -> dict[str, Any]:
    """mean / std / input size / crop / interpolation of an HF image processor, as timm's cfg keys."""
    mean, std = getattr(processor, "image_mean", None), getattr(processor, "image_std", None)
    if mean is None or std is None:
        raise ValueError(f"hf:{ident}: its image processor sets no image_mean / image_std")

    def side(size: Any) -> int | None:
        get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
        value = get("height") or get("shortest_edge")
        return int(value) if value else None

    resized = side(getattr(processor, "size", None) or {})
    crop = side(getattr(processor, "crop_size", None) or {}) if getattr(processor, "do_center_crop", False) else None
    native = crop or resized or 224
    cfg: dict[str, Any] = {"mean": tuple(mean), "std": tuple(std), "crop_pct": 1.0}
    cfg["input_size"] = (3, img_size or native, img_size or native)
    if crop and resized:
        cfg["crop_pct"] = crop / resized
    cfg["interpolation"] = _PIL_RESAMPLE.get(int(getattr(processor, "resample", 3) or 3), "bicubic")
    return cfg


def load_hf(
    ident: str,
    *,
    pretrained: bool = False,
    num_classes: int | None = None,
    img_size: int | None = None,
    **kwargs: Any,
) -> HFImageClassifier:
    """The transformers image classifier ``ident`` (a hub repo id or a ``save_pretrained`` directory), wrapped.

    ``pretrained`` loads its weights (``from_pretrained``, safetensors only); otherwise its config is read and the
    model built with random weights (``from_config``). ``num_classes`` replaces the head when it differs from the
    model's (``ignore_mismatched_sizes``, a new head as timm gives); ``img_size`` sets the config's ``image_size``
    of a model built from its config, and otherwise only the recorded input size (the adapter interpolates the
    position embeddings). ``kwargs`` go to ``from_pretrained`` / the config.

    Raises:
        ImportError: transformers is not installed.
        ValueError: no image processor config, or a model that is not an image classifier.
        OSError: transformers cannot find or fetch ``ident``.
    """
    transformers = import_transformers()
    safe = {"trust_remote_code": False}
    config = transformers.AutoConfig.from_pretrained(ident, **safe)
    if pretrained:
        extra: dict[str, Any] = {}
        if num_classes is not None and num_classes != config.num_labels:
            extra = {"num_labels": num_classes, "ignore_mismatched_sizes": True}
        model = transformers.AutoModelForImageClassification.from_pretrained(
            ident, use_safetensors=True, **safe, **extra, **kwargs
        )
    else:
        for key, value in kwargs.items():
            setattr(config, key, value)
        if num_classes is not None:
            config.num_labels = num_classes
        if img_size is not None and hasattr(config, "image_size"):
            config.image_size = img_size
        model = transformers.AutoModelForImageClassification.from_config(config, **safe)
    try:
        processor = transformers.AutoImageProcessor.from_pretrained(ident, **safe)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"hf:{ident} has no image processor config (preprocessor_config.json) to read mean, std and size from: "
            f"{' '.join(str(err).split())[:200]}"
        ) from err
    adapter = HFImageClassifier(model)
    adapter.pretrained_cfg = _hf_processor_cfg(processor, ident, img_size)
    return adapter


HUB_HOST = ("huggingface.co", 443)


def hub_reachable_or_offline(timeout: float = 3.0) -> bool:
    """Probe the Hugging Face hub once; when it cannot be reached, switch the hub client to offline mode.

    Offline, weights already in the local cache still load and missing ones fail at once with one error, instead
    of the client's retries (about 45 s of them). Returns whether the hub answered.
    """
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        return False
    try:
        with socket.create_connection(HUB_HOST, timeout=timeout):
            return True
    except OSError:
        os.environ["HF_HUB_OFFLINE"] = "1"
        constants = sys.modules.get("huggingface_hub.constants")
        if constants is not None:  # already imported: it read the variable at import time
            constants.HF_HUB_OFFLINE = True  # type: ignore[attr-defined]  # a module's globals are not typed
        return False
