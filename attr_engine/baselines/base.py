"""The call shape every attribution method shares: ``explainer.attribute(x, target=None) -> (B, H, W)``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from attr_engine.classifier import Classifier, check_device, eval_mode, input_dtype, resolve_targets
from kernels._validate import check_tensor

__all__ = ["Explainer", "FunctionExplainer", "import_captum", "resolve_targets"]


def import_captum() -> Any:
    """``captum.attr``, or a clear error: Captum is an evaluation extra, not a core dependency."""
    try:
        import captum.attr
    except ImportError as err:  # pragma: no cover - exercised only without the extra installed
        raise ImportError(
            "this baseline runs through Captum, which is not installed; pip install 'attr-engine[eval]'"
        ) from err
    return captum.attr


class Explainer:
    """Base class: an attribution method bound to one classifier.

    Subclasses implement ``_attribute(x, target) -> (B, H, W)`` for checked images and resolved targets; the base
    class checks inputs and outputs so every method fails the same way on bad input.

    Attributes:
        name: registry name of the method.
        classifier: the explained classifier (metrics read ``.classifier`` to resolve targets).
        needs_grad: run ``_attribute`` with autograd enabled even inside ``torch.no_grad()``.
    """

    name = "explainer"
    needs_grad = True

    def __init__(self, classifier: nn.Module) -> None:
        if not isinstance(classifier, nn.Module):
            raise ValueError(f"classifier must be a torch.nn.Module (a Classifier), got {type(classifier).__name__}")
        self.classifier = classifier

    @property
    def device(self) -> torch.device:
        if isinstance(self.classifier, Classifier):
            return self.classifier.norm_mean.device
        param = next(self.classifier.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def attribute(self, x: torch.Tensor, target: int | Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
        """Attribution maps.

        Args:
            x: (B, 3, H, W) images in [0, 1], on the classifier's device, any floating dtype (cast to the
                classifier's).
            target: class per image (int, sequence or (B,) tensor); ``None`` explains the predicted class.

        Returns:
            (B, H, W) float32 maps (higher = more important for the target), detached; (0, H, W) for an empty batch.
        """
        if torch.is_inference_mode_enabled() and self.needs_grad:
            raise RuntimeError(f"{self.name} needs autograd and cannot run inside torch.inference_mode()")
        check_device(x, self.classifier)
        check_tensor(x, "x", ndim=4, finite=True)
        if x.shape[1] != 3:
            raise ValueError(f"x must be an RGB batch (B, 3, H, W), got shape {tuple(x.shape)}")
        if x.shape[0] == 0:  # an empty batch (the tail of a filtered loader): an empty result, the target still checked
            if target is not None:
                resolve_targets(self.classifier, x, target)
            return torch.zeros(0, *x.shape[2:], dtype=torch.float32, device=x.device)
        dtype = input_dtype(self.classifier)
        if dtype is not None and x.dtype != dtype:
            x = x.to(dtype)  # fp16 / bf16 / float64 images and a model of another dtype: cast at the boundary
        # Eval mode for the call: a raw model in training mode would update BatchNorm statistics and run dropout.
        with eval_mode(self.classifier):
            target = resolve_targets(self.classifier, x, target)
            with torch.set_grad_enabled(self.needs_grad or torch.is_grad_enabled()):
                maps = self._attribute(x, target)
        if maps.shape != (x.shape[0], *x.shape[2:]):
            raise RuntimeError(f"{self.name} produced maps of shape {tuple(maps.shape)} for images {tuple(x.shape)}")
        return maps.detach().float()

    __call__ = attribute

    def _attribute(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class FunctionExplainer(Explainer):
    """Any ``fn(x, target) -> (B, H, W)`` (or ``(B, C, H, W)``, averaged over channels) as an :class:`Explainer`."""

    def __init__(
        self, classifier: nn.Module, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], name: str = "function"
    ) -> None:
        super().__init__(classifier)
        if not callable(fn):
            raise ValueError(f"fn must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = name

    def _attribute(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        maps = self.fn(x, target)
        if not isinstance(maps, torch.Tensor):
            raise RuntimeError(f"{self.name} must return a tensor, got {type(maps).__name__}")
        return maps.mean(dim=1) if maps.ndim == 4 else maps
