"""Localisation against ground-truth object masks: the pointing game, its energy-based variant (methods.md
section 4) and the mask IoU of a map's top pixels. All need data with masks, such as
:class:`attr_engine.data.ShapesDataset`.
"""

from __future__ import annotations

import torch

from attr_engine.metrics._checks import check_masks, check_pixel_maps
from attr_engine.metrics.perturbation import pixel_ranks
from attr_engine_kernels.validate import check_non_negative

__all__ = ["energy_pointing_game", "pointing_game", "top_k_mask_iou"]


def _maps_and_masks(maps: torch.Tensor, masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    maps = check_pixel_maps(maps)  # (B, H, W)
    b, h, w = maps.shape
    return maps, check_masks(masks, (b, h, w)).to(maps.device)


def pointing_game(maps: torch.Tensor, masks: torch.Tensor, *, tolerance: float = 0) -> torch.Tensor:
    """Whether each map's maximum lands on the object (Zhang et al., "Top-down neural attention", 2016).

    The map points at its first maximum in row-major order (``argmax`` of the flattened map), so a constant map
    points at the top-left pixel rather than scoring a hit wherever the object is. A hit is a mask pixel within
    Euclidean distance ``tolerance`` of that point, i.e. the point lies in the mask dilated by a disc of radius
    ``tolerance`` (the original game uses 15 px at 224 px).

    Args:
        maps: (B, H, W) attribution maps, or (B, C, H, W) summed over channels.
        masks: (B, H, W) bool object masks, each non-empty; moved to the maps' device.
        tolerance: dilation radius in pixels (>= 0).

    Returns:
        (B,) bool, True for a hit (``.float().mean()`` is the accuracy).

    Raises:
        ValueError: shapes that disagree, NaN/inf maps, non-bool or empty masks, a negative tolerance.
    """
    maps, masks = _maps_and_masks(maps, masks)
    tol = check_non_negative(tolerance, "tolerance")
    width = maps.shape[-1]
    point = maps.flatten(1).argmax(dim=1)
    ys = torch.arange(maps.shape[-2], device=maps.device)[:, None]
    xs = torch.arange(width, device=maps.device)[None, :]
    # Distance from the point to every pixel: (B, H, W); cheaper and exact compared with dilating each mask.
    dist2 = (ys - (point // width)[:, None, None]) ** 2 + (xs - (point % width)[:, None, None]) ** 2
    return (masks & (dist2 <= tol * tol)).flatten(1).any(dim=1)


def energy_pointing_game(maps: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Share of the positive attribution mass that falls on the object (Wang et al., Score-CAM, 2020).

    ``sum(relu(A) * mask) / sum(relu(A))`` per image; negative evidence is ignored. A map with no positive mass
    points nowhere and scores 0.

    Args:
        maps: (B, H, W) attribution maps, or (B, C, H, W) summed over channels.
        masks: (B, H, W) bool object masks, each non-empty; moved to the maps' device.

    Returns:
        (B,) float32 in [0, 1].

    Raises:
        ValueError: shapes that disagree, NaN/inf maps, non-bool or empty masks.
    """
    maps, masks = _maps_and_masks(maps, masks)
    # float32 sums: half-precision maps over many pixels would lose the small share that matters.
    positive = maps.float().clamp_min(0).flatten(1)
    total = positive.sum(dim=1)
    inside = (positive * masks.flatten(1)).sum(dim=1)
    return torch.where(total > 0, inside / total.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(total))


def top_k_mask_iou(maps: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """IoU of each object mask with the map's top pixels, as many as the mask has (top-k%, k% = the object's share).

    A map that ranks exactly the object's pixels first scores 1, one that ranks them last 0; unlike the energy
    pointing game it reads only the map's order, so it is the same for any monotone rescaling of the map. Ties go to
    the lower row-major index (:func:`~attr_engine.metrics.pixel_ranks`).

    Args:
        maps: (B, H, W) attribution maps, or (B, C, H, W) summed over channels.
        masks: (B, H, W) bool object masks, each non-empty; moved to the maps' device.

    Returns:
        (B,) float32 in [0, 1].

    Raises:
        ValueError: shapes that disagree, NaN/inf maps, non-bool or empty masks.
    """
    maps, masks = _maps_and_masks(maps, masks)
    flat = masks.flatten(1)
    area = flat.sum(dim=1, keepdim=True)
    top = pixel_ranks(maps) < area
    inter = (top & flat).sum(dim=1).float()
    return inter / (2 * area[:, 0] - inter).float()
