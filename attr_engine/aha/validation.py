"""Validation while the AHA decoder trains: the hard composite on held-out images, and the early-stopping rule.

Score: the validation composite is insertion AUC - deletion AUC (higher is better) of the decoder's maps, from the
project's own hard curves (:func:`attr_engine.metrics.deletion_insertion`) under the AHA protocol: pixels ranked
hard by the map, the classifier's mean colour as the reference for both curves, the class predicted on the clean
image. The curves have ``config.val_fractions`` intervals (8 by default, where reported scores use 20), which keeps
a score at ``2 x (val_fractions - 1) + 2`` classifier passes per image.

Each image's score depends on that image alone: the decoder runs in eval mode and has no batch statistics, the
ranking and the curves are per image, and the composite is the mean over every validation image (sums gathered
across ranks), so neither the batch size, the batching order nor the number of processes changes it beyond float
rounding of the classifier's batched arithmetic.

Rule (:class:`EarlyStopping`): a score counts as an improvement when it beats the best so far by more than
``config.min_delta``; each improvement keeps a CPU copy of the decoder's weights, and training stops once
``config.patience`` scores in a row were no improvement. The trainer (:mod:`attr_engine.aha.trainer`) decides
when to score and restores the best weights at the end; what is saved to resume lives in :meth:`EarlyStopping.state`
(JSON values) and :attr:`EarlyStopping.best_state` (tensors).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from attr_engine._training import collate_images_labels
from attr_engine.aha.config import AHAConfig
from attr_engine.aha.network import Decoder
from attr_engine.classifier import Classifier
from attr_engine.explainer import RANGE_WARNING_ABOVE
from attr_engine.metrics import deletion_insertion

__all__ = ["VAL_KEYS", "EarlyStopping", "ValData", "check_val_data", "score_validation"]

# What a held-out set may be: the forms fit takes for training data, or images as a tensor (N, 3, H, W) or a tuple
# (images, labels, ...) of tensors (the labels are not read: the predicted class is scored).
ValData = Dataset | DataLoader | torch.Tensor | tuple[torch.Tensor, ...]
# The per-evaluation lists fit's history gains with val (one entry per score, the whole curve of the run).
VAL_KEYS = ("val_step", "val_composite", "val_deletion", "val_insertion", "val_loss")


class Scored(Protocol):
    """What scoring reads of an explainer (:class:`attr_engine.aha.model.AHA` has it)."""

    classifier: Classifier
    config: AHAConfig
    decoder: Decoder

    def __call__(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The raw maps (B, H, W) the explainer draws for x (B, 3, H, W) and target (B,): its forward pass."""
        ...


def check_val_data(val: ValData) -> int:
    """The number of images in ``val``; raises a ValueError naming the problem for an empty or unusable set."""
    if isinstance(val, tuple):
        if not val or not isinstance(val[0], torch.Tensor):
            raise ValueError("val as a tuple must be (images (N, 3, H, W), labels, ...) tensors")
        val = val[0]
    if isinstance(val, torch.Tensor):
        if val.ndim != 4 or val.shape[1] != 3:
            raise ValueError(f"val images must be a (N, 3, H, W) tensor, got shape {tuple(val.shape)}")
        count = val.shape[0]
    elif isinstance(val, DataLoader | Dataset):
        sized = val.dataset if isinstance(val, DataLoader) else val
        try:
            count = len(sized)  # type: ignore[arg-type]
        except TypeError:
            raise ValueError("val must have a length (a map-style Dataset, or a DataLoader over one)") from None
    else:
        raise ValueError(f"val must be a Dataset, a DataLoader or a (N, 3, H, W) tensor, got {type(val).__name__}")
    if count == 0:
        raise ValueError("val is empty: a validation set needs at least one image")
    return int(count)


def _val_batches(val: ValData, batch_size: int, rank: int, world: int, num_workers: int) -> Iterator[torch.Tensor]:
    """This rank's share of the validation images, in batches of up to ``batch_size`` (a DataLoader: its own
    batches, every world-th one)."""
    if isinstance(val, tuple):
        val = val[0]
    if isinstance(val, torch.Tensor):
        mine = val[rank::world]
        yield from mine.split(batch_size)
        return
    if isinstance(val, DataLoader):
        for i, batch in enumerate(val):
            if i % world == rank:
                yield batch["image"] if isinstance(batch, dict) else batch[0]
        return
    indices = list(range(rank, len(val), world))  # type: ignore[arg-type]
    batches = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
    loader = DataLoader(val, batch_sampler=batches, collate_fn=collate_images_labels, num_workers=num_workers)
    for x, _ in loader:
        yield x


def _checked_images(x: torch.Tensor) -> torch.Tensor:
    """``x: (B, 3, H, W)`` validation images, refused in one line when non-finite or far outside [0, 1]."""
    if not torch.isfinite(x).all():
        raise ValueError("val images contain NaN or infinite values")
    low, high = (float(v) for v in torch.aminmax(x))  # one pass over the batch, not two
    # Above: the explainer's tolerance for float images (ImageRangeWarning); below: the same margin.
    if low < -0.1 or high > RANGE_WARNING_ABOVE:
        raise ValueError(f"val images must be RGB in [0, 1], got values in [{low:.3g}, {high:.3g}]")
    return x


def _predicted(classifier: Classifier, x: torch.Tensor) -> torch.Tensor:
    """The predicted class of ``x: (B, 3, H, W)``; a size the model refuses (a fixed-size ViT's assert) is one
    ValueError naming the validation images' size."""
    try:
        return classifier(x).argmax(1)
    except (AssertionError, RuntimeError, ValueError) as err:
        raise ValueError(
            f"the classifier refused validation images of size {x.shape[-2]} x {x.shape[-1]}: {err}"
        ) from err


def score_validation(
    aha: Scored,
    val: ValData,
    *,
    device: torch.device,
    batch_size: int,
    rank: int = 0,
    world: int = 1,
    num_workers: int = 0,
) -> dict[str, float]:
    """Mean hard deletion and insertion AUC of ``aha``'s maps over every image of ``val`` (all ranks together).

    Returns:
        ``{"deletion", "insertion", "images"}``: the means and the number of images scored.

    Raises:
        ValueError: ``val`` yielded no image, or images the metric refuses (shape, range, non-finite).
    """
    training = aha.decoder.training
    aha.decoder.eval()
    sums = torch.zeros(3, dtype=torch.float64)
    try:
        for x in _val_batches(val, batch_size, rank, world, num_workers):
            x = _checked_images(x.to(device).float())
            with torch.no_grad():
                target = _predicted(aha.classifier, x)
                # The explainer's own forward, with every input its decoder takes (a pullback input enables
                # autograd for itself inside no_grad).
                maps = aha(x, target)
            if not torch.isfinite(maps).all():
                # A diverged decoder scores NaN (never an improvement: the run stops and restores its best
                # weights) instead of aborting fit with the metric's error.
                sums += torch.tensor((math.nan, math.nan, len(x)), dtype=torch.float64)
                continue
            di = deletion_insertion(
                aha.classifier, x, maps, target, steps=aha.config.val_fractions, reference="mean", protocol="aha"
            )
            sums += torch.stack((di.deletion.sum(), di.insertion.sum(), torch.tensor(len(x)))).double().cpu()
    finally:
        aha.decoder.train(training)
    if world > 1:
        # NCCL reduces CUDA tensors only; gloo takes CPU ones.
        gathered = sums.to(device) if device.type == "cuda" else sums
        dist.all_reduce(gathered)
        sums = gathered.cpu()
    if sums[2] == 0:
        raise ValueError("val yielded no images: a validation set needs at least one image")
    return {"deletion": float(sums[0] / sums[2]), "insertion": float(sums[1] / sums[2]), "images": int(sums[2])}


@dataclass
class EarlyStopping:
    """The validation curve, the best score and weights so far and the patience count (see the module docstring).

    Attributes:
        curve: one record per score: ``step``, ``composite``, ``deletion``, ``insertion`` and ``loss`` (the mean
            training loss of the steps since the previous score; None for a score before any step).
        best_step, best_composite: where the best score so far was reached (None / -inf before the first).
        bad_scores: scores in a row that were no improvement.
        best_state: a CPU copy of the decoder's weights at ``best_step``.
    """

    patience: int
    min_delta: float
    curve: list[dict[str, Any]] = field(default_factory=list)
    best_step: int | None = None
    best_composite: float = -math.inf
    bad_scores: int = 0
    best_state: dict[str, torch.Tensor] | None = None
    # Training losses since the last score, kept in the checkpoint so a resumed run reports the same mean.
    loss_sum: float = 0.0
    loss_steps: int = 0

    @property
    def stopped(self) -> bool:
        """Whether ``patience`` scores in a row were no improvement."""
        return self.bad_scores >= self.patience

    @property
    def last_step(self) -> int | None:
        return int(self.curve[-1]["step"]) if self.curve else None

    def add_loss(self, loss: float) -> None:
        self.loss_sum += loss
        self.loss_steps += 1

    def record(self, step: int, scores: Mapping[str, float], decoder: torch.nn.Module) -> bool:
        """Add the score of ``step``; keep ``decoder``'s weights when it improves on the best. Returns whether it
        did."""
        composite = float(scores["insertion"]) - float(scores["deletion"])
        loss = self.loss_sum / self.loss_steps if self.loss_steps else None
        self.curve.append({"step": step, "composite": composite, "deletion": float(scores["deletion"]),
                           "insertion": float(scores["insertion"]), "loss": loss})  # fmt: skip
        self.loss_sum, self.loss_steps = 0.0, 0
        # A NaN never improves (every comparison with it is False) and is never the best to beat: a first score
        # that is NaN keeps its weights (the run must end with some) at a best of -inf, so any real score beats it.
        improved = composite - self.min_delta > self.best_composite
        if improved or self.best_step is None:
            self.best_step, self.best_composite = step, composite if improved else -math.inf
            self.bad_scores = 0 if improved else 1
            self.best_state = {k: v.detach().to("cpu", copy=True) for k, v in decoder.state_dict().items()}
            return improved
        self.bad_scores += 1
        return False

    def state(self) -> dict[str, Any]:
        """What a checkpoint stores to continue the curve and the patience count (JSON values; the weights are
        :attr:`best_state`)."""
        return {"curve": [dict(p) for p in self.curve], "best_step": self.best_step,
                "best_composite": self.best_composite if self.best_step is not None else None,
                "bad_scores": self.bad_scores, "patience": self.patience, "stopped": self.stopped,
                "loss_sum": self.loss_sum, "loss_steps": self.loss_steps}  # fmt: skip

    def load(self, state: Mapping[str, Any], best_state: dict[str, torch.Tensor] | None) -> None:
        """Continue from :meth:`state` and the best weights a checkpoint held."""
        self.curve = [dict(p) for p in state["curve"]]
        self.best_step = None if state["best_step"] is None else int(state["best_step"])
        best = state["best_composite"]
        self.best_composite = -math.inf if best is None else float(best)
        self.bad_scores = int(state["bad_scores"])
        self.loss_sum, self.loss_steps = float(state["loss_sum"]), int(state["loss_steps"])
        self.best_state = best_state

    def history(self) -> dict[str, list[float]]:
        """The curve as fit's per-score history lists (:data:`VAL_KEYS`; a missing loss is NaN)."""
        loss = [math.nan if p["loss"] is None else float(p["loss"]) for p in self.curve]
        return {"val_step": [int(p["step"]) for p in self.curve],
                "val_composite": [float(p["composite"]) for p in self.curve],
                "val_deletion": [float(p["deletion"]) for p in self.curve],
                "val_insertion": [float(p["insertion"]) for p in self.curve], "val_loss": loss}  # fmt: skip
