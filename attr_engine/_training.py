"""Pieces shared by the two training loops: classifier training (:mod:`attr_engine.classifier_training`) and AHA
decoder training (:mod:`attr_engine.aha.trainer`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["collate_images_labels", "warmup_cosine"]


def warmup_cosine(total_steps: int, warmup_steps: int) -> Callable[[int], float]:
    """Learning-rate factor for ``torch.optim.lr_scheduler.LambdaLR``: linear warm-up, then cosine decay to zero.

    Steps ``0 .. warmup_steps - 1`` ramp the factor ``1 / warmup_steps, ..., 1``; afterwards it follows
    ``0.5 * (1 + cos(pi * progress))`` with ``progress`` the fraction of the remaining steps done, held at 0 past
    ``total_steps``. ``warmup_steps = 0`` starts the decay at once.
    """

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def collate_images_labels(items: Sequence[Sequence[Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch dataset items ``(image (3, H, W), label, ...)`` into ``(images (B, 3, H, W), labels (B,) int64)``.

    Items may carry more fields (masks, ...); training needs the first two only, and dropping the rest here keeps
    the default collate from stacking masks nobody reads.
    """
    images = torch.stack([item[0] for item in items])
    labels = torch.as_tensor([int(item[1]) for item in items], dtype=torch.long)
    return images, labels
