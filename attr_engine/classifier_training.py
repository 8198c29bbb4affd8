"""Train small classifiers to explain: AdamW with warmup + cosine decay, light augmentation, seeded end to end.

The point is a real, trained timm model to run attribution methods on without downloading weights: e.g. a 4-block
ViT or a narrow ResNet-10 on :class:`~attr_engine.data.ShapesDataset`, trained on a laptop CPU in about a minute
(:func:`small_model_config`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from attr_engine._training import collate_images_labels, warmup_cosine
from attr_engine.classifier import Classifier, load_classifier
from attr_engine.guards import SMALL_VIT_GRID, check_small_model_side
from attr_engine_kernels.validate import check_int_at_least, check_positive

__all__ = ["ModelConfig", "evaluate_accuracy", "small_model_config", "train_classifier"]

# Datasets whose images fit in this many bytes are cached in memory by default (see train_classifier's cache).
_CACHE_LIMIT_BYTES = 1 << 30


@dataclass(frozen=True)
class ModelConfig:
    """A timm architecture: ``timm.create_model(name, img_size=..., **kwargs)`` (img_size only where it applies)."""

    name: str
    img_size: int
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a timm model name, got {self.name!r}")
        check_int_at_least(self.img_size, "img_size", 1)

    def build(self, num_classes: int, *, pretrained: bool = False) -> Classifier:
        """A (frozen, untrained unless ``pretrained``) :class:`Classifier` with this architecture."""
        return load_classifier(
            self.name, pretrained=pretrained, num_classes=num_classes, img_size=self.img_size, **self.kwargs
        )


def small_model_config(kind: str = "vit", img_size: int = 64) -> ModelConfig:
    """Tiny but genuine timm configurations that train on CPU in about a minute at 64 px.

    - ``"vit"``: ``vit_tiny_patch16_224`` rebuilt with an 8 x 8 patch grid (patch ``img_size // 8``), 4 blocks,
      width 96, 3 heads (~0.5 M parameters, ~70 MFLOPs per 64 px image). Class token + absolute position
      embeddings, as in the full model, so ViT-specific attribution code paths are exercised.
    - ``"resnet"``: ``resnet10t`` (tiered stem, one basic block per stage) at half width, channels
      (32, 64, 128, 256) (~1.3 M parameters).

    Args:
        kind: ``"vit"`` or ``"resnet"``.
        img_size: square input side; for ``"vit"`` a multiple of 8 and at least 32.
    """
    if kind == "vit":
        check_small_model_side(img_size, kind)
        kwargs = {"patch_size": img_size // SMALL_VIT_GRID, "depth": 4, "embed_dim": 96, "num_heads": 3}
        return ModelConfig("vit_tiny_patch16_224", img_size, kwargs)
    if kind == "resnet":
        check_small_model_side(img_size, kind)
        return ModelConfig("resnet10t", img_size, {"channels": [32, 64, 128, 256]})
    raise ValueError(f"kind must be 'vit' or 'resnet', got {kind!r}")


def _augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random horizontal flip, translation by up to 1/8 of the side (reflect padding), brightness/contrast.

    ``x: (B, 3, H, W)`` in [0, 1]; random draws come from ``gen`` (CPU) so runs are reproducible on any device.
    """
    b, _, h, w = x.shape
    flip = torch.rand(b, generator=gen) < 0.5
    x = torch.where(flip.to(x.device).view(b, 1, 1, 1), x.flip(-1), x)
    pad = max(1, min(h, w) // 8)
    padded = F.pad(x, (pad, pad, pad, pad), mode="reflect")
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=gen).tolist()
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=gen).tolist()
    x = torch.stack([padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w] for i in range(b)])
    contrast = (0.8 + 0.4 * torch.rand(b, 1, 1, 1, generator=gen)).to(x.device)
    brightness = (0.2 * torch.rand(b, 1, 1, 1, generator=gen) - 0.1).to(x.device)
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    return ((x - mean) * contrast + mean + brightness).clamp(0.0, 1.0)


def _resolve_num_classes(dataset: Dataset, num_classes: int | None) -> int:
    if num_classes is None:
        num_classes = getattr(dataset, "num_classes", None) or len(getattr(dataset, "class_names", ()) or ())
    if num_classes is None or num_classes == 0:
        raise ValueError(
            "cannot tell the number of classes: pass num_classes= (>= 2) or use a dataset with class_names"
        )
    return check_int_at_least(num_classes, "num_classes", 2)


def _build_classifier(
    model: str | ModelConfig | Classifier | nn.Module,
    dataset: Dataset,
    num_classes: int | None,
    model_kwargs: Mapping[str, Any] | None,
) -> Classifier:
    if isinstance(model, Classifier):
        if num_classes is not None and model.num_classes != num_classes:
            raise ValueError(f"classifier has {model.num_classes} outputs but num_classes={num_classes}")
        return model
    if isinstance(model, nn.Module):
        return Classifier(model, num_classes=num_classes)
    k = _resolve_num_classes(dataset, num_classes)
    if isinstance(model, ModelConfig):
        if model_kwargs:
            model = ModelConfig(model.name, model.img_size, {**model.kwargs, **model_kwargs})
        return model.build(k)
    if isinstance(model, str):
        if len(dataset) == 0:  # type: ignore[arg-type]
            raise ValueError("dataset is empty")
        img_size = int(dataset[0][0].shape[-1])
        return load_classifier(model, num_classes=k, img_size=img_size, **dict(model_kwargs or {}))
    raise ValueError(f"model must be a timm name, ModelConfig, Classifier or nn.Module, got {type(model).__name__}")


def _maybe_cache(dataset: Dataset, cache: bool | None) -> Dataset:
    """Materialise ``dataset`` as tensors once (procedural or decoded images are then not re-made every epoch).

    ``cache=None`` caches when the images would take at most ``_CACHE_LIMIT_BYTES`` of memory.
    """
    if cache is False:
        return dataset
    first = dataset[0][0]
    size = first.numel() * first.element_size() * len(dataset)  # type: ignore[arg-type]
    if cache is None and size > _CACHE_LIMIT_BYTES:
        return dataset
    images, labels = collate_images_labels([dataset[i] for i in range(len(dataset))])  # type: ignore[arg-type]
    return TensorDataset(images, labels)


def train_classifier(
    model: str | ModelConfig | Classifier | nn.Module,
    dataset: Dataset,
    *,
    epochs: int = 6,
    batch_size: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    device: str | torch.device = "cpu",
    weight_decay: float = 0.05,
    warmup_epochs: float = 1.0,
    label_smoothing: float = 0.1,
    grad_clip: float | None = 1.0,
    augment: bool = True,
    num_classes: int | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    eval_dataset: Dataset | None = None,
    num_workers: int = 0,
    cache: bool | None = None,
    log: Callable[[dict[str, float]], None] | None = None,
) -> Classifier:
    """Train a classifier on ``dataset`` and return it frozen.

    Args:
        model: a timm model name (built with ``num_classes`` and the dataset's image size, plus
            ``model_kwargs``), a :class:`ModelConfig` (e.g. from :func:`small_model_config`), or an existing
            :class:`Classifier` / ``nn.Module`` to fine-tune *in place* (the returned Classifier wraps it).
        dataset: map-style, items ``(image (3, H, W) in [0, 1], label, ...)``; labels in ``[0, num_classes)``.
        epochs, batch_size, lr: the usual; ``lr`` is the peak AdamW learning rate.
        seed: seeds weight initialisation, shuffling and augmentation. On CPU two runs with the same seed (and
            the same thread count) give identical weights. The global torch RNG is restored afterwards.
        device: where to train; the returned Classifier stays there.
        weight_decay: AdamW decoupled weight decay, applied to weight matrices / kernels only (not to biases,
            norm scales, position embeddings or class tokens, i.e. parameters with fewer than 2 dimensions or
            named ``pos_embed`` / ``cls_token``).
        warmup_epochs: linear warmup length before the cosine decay to zero (per step).
        label_smoothing: cross-entropy label smoothing.
        grad_clip: max global gradient norm, or None.
        augment: random flips, translations and brightness/contrast (see ``_augment``); turn off for data where
            a mirror image changes the class.
        num_classes: defaults to ``dataset.num_classes`` / ``len(dataset.class_names)``.
        model_kwargs: extra ``timm.create_model`` kwargs when ``model`` is a name or a ModelConfig.
        eval_dataset: if given, held-out accuracy is computed after each epoch and logged as ``eval_acc``.
        num_workers: DataLoader workers (0 keeps everything in this process, which is fastest for procedural data).
        cache: hold the dataset's ``(image, label)`` pairs in memory after one pass (augmentation still differs
            every epoch). ``None`` caches when the images take at most 1 GiB.
        log: called after each epoch with ``{"epoch", "loss", "train_acc", "lr", "seconds"[, "eval_acc"]}``.

    Returns:
        The trained model as a frozen :class:`Classifier` (eval mode, no parameter gradients).
    """
    check_int_at_least(epochs, "epochs", 1)
    check_int_at_least(batch_size, "batch_size", 1)
    check_int_at_least(num_workers, "num_workers", 0)
    check_positive(lr, "lr")
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise ValueError("dataset is empty")
    device = torch.device(device)
    rng_devices = []
    if device.type == "cuda":
        rng_devices = [device.index if device.index is not None else torch.cuda.current_device()]

    with torch.random.fork_rng(devices=rng_devices):
        torch.manual_seed(seed)
        classifier = _build_classifier(model, dataset, num_classes, model_kwargs).to(device)
        k = classifier.num_classes
        classifier.model.requires_grad_(True)
        try:
            _fit(
                classifier,
                _maybe_cache(dataset, cache),
                num_classes=k,
                epochs=epochs,
                batch_size=batch_size,
                lr=lr,
                seed=seed,
                device=device,
                weight_decay=weight_decay,
                warmup_epochs=warmup_epochs,
                label_smoothing=label_smoothing,
                grad_clip=grad_clip,
                augment=augment,
                eval_dataset=eval_dataset,
                num_workers=num_workers,
                log=log,
            )
        finally:
            classifier.freeze()
    return classifier


def _fit(
    classifier: Classifier,
    dataset: Dataset,
    *,
    num_classes: int,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    device: torch.device,
    weight_decay: float,
    warmup_epochs: float,
    label_smoothing: float,
    grad_clip: float | None,
    augment: bool,
    eval_dataset: Dataset | None,
    num_workers: int,
    log: Callable[[dict[str, float]], None] | None,
) -> None:
    net = classifier.model
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in net.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        (no_decay if p.ndim < 2 or leaf in ("pos_embed", "cls_token") else decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr
    )
    loader_gen = torch.Generator().manual_seed(seed)
    aug_gen = torch.Generator().manual_seed(seed + 1)
    # Dropping the ragged last batch keeps BatchNorm away from batches of one; tiny datasets keep everything.
    drop_last = len(dataset) >= 2 * batch_size  # type: ignore[arg-type]
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        generator=loader_gen,
        drop_last=drop_last,
        num_workers=num_workers,
        collate_fn=collate_images_labels,
    )
    steps = epochs * len(loader)
    warmup = min(steps, max(1, round(warmup_epochs * len(loader))))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps, warmup))

    for epoch in range(epochs):
        start = time.perf_counter()
        net.train()
        total_loss, correct, seen = 0.0, 0, 0
        for images, labels in loader:
            if labels.min() < 0 or labels.max() >= num_classes:
                raise ValueError(f"labels must be in [0, {num_classes}), got a batch with {labels.tolist()}")
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            if augment:
                images = _augment(images, aug_gen)
            logits = classifier(images)
            loss = F.cross_entropy(logits, labels, label_smoothing=label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip is not None:
                nn.utils.clip_grad_norm_(net.parameters(), grad_clip)
            optimizer.step()
            scheduler.step()
            total_loss += float(loss.detach()) * len(labels)
            correct += int((logits.argmax(-1) == labels).sum())
            seen += len(labels)
        stats = {
            "epoch": float(epoch + 1),
            "loss": total_loss / seen,
            "train_acc": correct / seen,
            "lr": optimizer.param_groups[0]["lr"],
            "seconds": time.perf_counter() - start,
        }
        if eval_dataset is not None:
            net.eval()
            stats["eval_acc"] = evaluate_accuracy(classifier, eval_dataset, batch_size=max(batch_size, 128))
        if log is not None:
            log(stats)


@torch.no_grad()
def evaluate_accuracy(
    classifier: Classifier | nn.Module,
    dataset: Dataset,
    *,
    batch_size: int = 256,
    device: str | torch.device | None = None,
) -> float:
    """Top-1 accuracy of ``classifier`` (taking [0, 1] images) on ``dataset`` items ``(image, label, ...)``.

    ``device`` defaults to the classifier's parameter device. Unlabelled items (label -1) raise ValueError.
    """
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise ValueError("dataset is empty")
    if device is None:
        param = next(classifier.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate_images_labels)
    correct = total = 0
    for images, labels in loader:
        if labels.min() < 0:
            raise ValueError("dataset has unlabelled items (label -1); accuracy needs labels")
        logits = classifier(images.to(device))
        correct += int((logits.argmax(-1).cpu() == labels).sum())
        total += len(labels)
    return correct / total
