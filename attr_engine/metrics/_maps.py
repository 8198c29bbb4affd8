"""Attribution-map preparation shared by the Quantus-style metrics (infidelity, max-sensitivity, random logit).

Unlike ``check_pixel_maps`` these keep a channel axis: Quantus broadcasts an attribution of shape (B, 1, H, W) or
(B, C, H, W) against the input, so a per-channel map and its channel sum are different explanations there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attr_engine_kernels.validate import check_bool, check_tensor

__all__ = ["NORMALISATIONS", "Explain", "call_explainer", "prepare_maps"]

# None: raw maps. "max": each map divided by its own max |value|. "batch_max": every map divided by the max |value|
# over the whole batch, which is what Quantus 0.6.0's ``normalise=True`` (normalise_by_max over all axes) does.
NORMALISATIONS: tuple[str | None, ...] = (None, "max", "batch_max")

# Anything that maps (images (N, 3, H, W), targets (N,)) to maps (N, H, W) or (N, C, H, W).
Explain = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def prepare_maps(
    maps: object,
    x: torch.Tensor,
    *,
    abs: bool = False,
    normalise: str | None = None,
    name: str = "maps",
) -> torch.Tensor:
    """Check maps against images and apply Quantus' optional preprocessing (normalise first, then abs).

    Args:
        maps: (B, H, W), (B, 1, H, W) or (B, C, H, W) attributions for ``x``.
        x: (B, C, H, W) images the maps explain.
        abs: take absolute values (after normalising, as Quantus does).
        normalise: one of :data:`NORMALISATIONS`. All-zero maps (or an all-zero batch for ``"batch_max"``) are left
            as they are, as Quantus does.

    Returns:
        (B, 1 or C, H, W) maps on ``x``'s device, in float32 or float64 (float64 stays float64).
    """
    if isinstance(maps, torch.Tensor) and maps.ndim not in (3, 4):
        raise ValueError(f"{name} must be (B, H, W) or (B, C, H, W), got shape {tuple(maps.shape)}")
    maps = check_tensor(maps, name, finite=True)
    if maps.ndim == 3:
        maps = maps.unsqueeze(1)
    batch, channels = x.shape[:2]
    if maps.shape[0] != batch or maps.shape[2:] != x.shape[2:] or maps.shape[1] not in (1, channels):
        raise ValueError(
            f"{name} must be (B, H, W), (B, 1, H, W) or (B, C, H, W) for x of shape {tuple(x.shape)}, "
            f"got {tuple(maps.shape)}"
        )
    if normalise not in NORMALISATIONS:
        raise ValueError(f"normalise must be one of {NORMALISATIONS}, got {normalise!r}")
    check_bool(abs, "abs")
    maps = maps.to(device=x.device, dtype=torch.float64 if maps.dtype == torch.float64 else torch.float32)
    if normalise == "max":
        peak = maps.abs().amax(dim=(1, 2, 3), keepdim=True)
        maps = maps / torch.where(peak > 0, peak, torch.ones_like(peak))
    elif normalise == "batch_max":
        peak = maps.abs().max()
        maps = maps / peak if bool(peak > 0) else maps
    return maps.abs() if abs else maps


def call_explainer(explain: Explain, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Run an explainer on a chunk and check it returned one map per image at the images' resolution."""
    out = explain(x, target)
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"the explainer must return a torch.Tensor, got {type(out).__name__}")
    if out.ndim == 3:
        out = out.unsqueeze(1)
    if out.ndim != 4 or out.shape[0] != x.shape[0] or out.shape[2:] != x.shape[2:]:
        raise ValueError(
            f"the explainer must return (N, H, W) or (N, C, H, W) maps for images {tuple(x.shape)}, "
            f"got {tuple(out.shape)}"
        )
    return out.detach()
