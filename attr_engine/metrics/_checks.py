"""Input checks shared by the metrics, so every metric rejects bad input the same way and names the argument.

Maps are reduced to one value per pixel here, once: a metric only ever sees ``(B, H, W)``.
"""

from __future__ import annotations

import torch

from attr_engine.classifier import Classifier, resolve_targets
from attr_engine.guards import not_a_classifier_hint
from attr_engine_kernels.validate import check_tensor

__all__ = ["check_classifier", "check_images", "check_masks", "check_pixel_maps", "resolve_target"]


def check_classifier(classifier: object, x: torch.Tensor) -> Classifier:
    """Check that ``classifier`` is a :class:`Classifier` living on ``x``'s device (metrics never move models)."""
    if not isinstance(classifier, Classifier):
        raise ValueError(
            f"classifier must be an attr_engine Classifier, got {type(classifier).__name__}"
            f"{not_a_classifier_hint(classifier)}"
        )
    if classifier.norm_mean.device != x.device:
        raise ValueError(f"classifier is on {classifier.norm_mean.device} but x is on {x.device}")
    return classifier


def check_images(x: object, name: str = "x") -> torch.Tensor:
    """Check a finite floating-point RGB batch ``(B, 3, H, W)`` with at least one image."""
    x = check_tensor(x, name, ndim=4, finite=True)
    if x.shape[1] != 3:
        raise ValueError(f"{name} must be RGB images (B, 3, H, W), got shape {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError(f"{name} must hold at least one image, got shape {tuple(x.shape)}")
    return x


def check_pixel_maps(maps: object, shape: tuple[int, int, int] | None = None, name: str = "maps") -> torch.Tensor:
    """Check attribution maps (against a batch shape ``(B, H, W)`` if given) and return one value per pixel.

    Accepts ``(B, H, W)`` or ``(B, C, H, W)``; channel maps (e.g. a signed pullback of shape ``(B, 3, H, W)``) are
    summed over channels, which ranks pixels exactly as the channel mean used for display does.

    Returns:
        ``(B, H, W)`` finite maps (same dtype; a view when no reduction was needed).
    """
    if isinstance(maps, torch.Tensor) and maps.ndim not in (3, 4):
        raise ValueError(f"{name} must be (B, H, W) or (B, C, H, W), got shape {tuple(maps.shape)}")
    maps = check_tensor(maps, name, finite=True)
    if maps.ndim == 4:
        maps = maps.sum(dim=1)
    if shape is not None and tuple(maps.shape) != tuple(shape):
        raise ValueError(
            f"{name} must cover the images pixel for pixel: expected (B, H, W) = {tuple(shape)}, got "
            f"{tuple(maps.shape)} (after summing channels)"
        )
    return maps


def check_masks(masks: object, shape: tuple[int, int, int], name: str = "masks") -> torch.Tensor:
    """Check boolean object masks ``(B, H, W)`` of the given shape, each with at least one pixel set.

    An empty mask has no location to point at, so localisation scores are undefined for it: it is an error, naming
    the offending images, rather than a silent 0 that would look like a miss.
    """
    if not isinstance(masks, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(masks).__name__}")
    if masks.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor (use masks.bool() or masks > 0.5), got {masks.dtype}")
    if tuple(masks.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape (B, H, W) = {tuple(shape)} like the maps, got {tuple(masks.shape)}")
    empty = (~masks.flatten(1).any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"{name} is empty (no object pixel) for image(s) {empty[:10]}; localisation is undefined")
    return masks


def resolve_target(target: int | torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
    """The class to score for each image: ``None`` takes the prediction on the clean images.

    The package's one resolver (:func:`~attr_engine.classifier.resolve_targets`) with the clean logits, so metrics
    accept and refuse targets exactly as the methods do.

    Args:
        target: ``None``, one class index for the whole batch, or ``(B,)`` integer class indices.
        logits: ``(B, K)`` logits of the clean images.

    Returns:
        ``(B,)`` int64 on ``logits``' device.
    """
    return resolve_targets(None, logits, target, logits=logits)
