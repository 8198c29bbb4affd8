"""Training loop of the AHA decoder: AdamW, warm-up + cosine, clipping, checkpoints that resume exactly, DDP.

Determinism: the data order of epoch e is a permutation drawn from ``(config.seed, e)``; every random choice of a
step (grid size, offset, fractions, reference, Gumbel seed) comes from one training generator whose state is saved
in each checkpoint. On the CPU an interrupted run resumed from its last checkpoint therefore ends with the same
weights as an uninterrupted one.

Distributed: under ``torchrun`` (``WORLD_SIZE`` > 1) a process group is started (NCCL on CUDA, gloo on CPU) unless one
exists, each rank takes every world-th example of the epoch's permutation, ``batch_size`` is per process, and only
the decoder is wrapped in DistributedDataParallel (the classifier and backbone are frozen). Rank 0 writes the
checkpoints.

Checkpoints: what goes into one (optimizer, scheduler and generator state, the step) is decided here; the directory
layout, the pointer and the choice of a checkpoint to resume are :mod:`attr_engine.aha.persistence`'s. This module
trains whatever has the :class:`Trainee` attributes (:class:`attr_engine.aha.model.AHA` does) and does not import
the model, which imports it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from attr_engine._training import collate_images_labels, warmup_cosine
from attr_engine.aha.loss import soft_auc_loss
from attr_engine.aha.persistence import Checkpointable, latest_training_checkpoint, save_training_checkpoint
from attr_engine.imageops import reference_image, scaled_blur
from kernels._validate import check_int_at_least


class Trainee(Checkpointable, Protocol):
    """What :func:`fit` trains: an explainer's frozen classifier and backbone, its decoder (trained in place, with
    ``steps_trained`` counted up) and its resolved config, on the classifier's device."""

    @property
    def device(self) -> torch.device: ...


def fit(
    aha: Trainee,
    data: Dataset | DataLoader,
    *,
    epochs: int = 1,
    batch_size: int = 32,
    max_steps: int | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = None,
    resume: str | os.PathLike[str] | None = None,
    num_workers: int = 0,
    progress: bool = True,
) -> dict[str, list[float]]:
    """Train ``aha``'s decoder.

    Args:
        data: a map-style Dataset of ``(image (3, H, W) in [0, 1], label, ...)`` items (label -1 = unknown), or a
            DataLoader yielding ``(images (B, 3, H, W), labels (B,), ...)`` batches (its own order is then used and
            resuming skips the batches already seen in the interrupted epoch).
        epochs: passes over the data; max_steps: stop after this many optimiser steps in total.
        batch_size: images per step and process (a Dataset only).
        checkpoint_dir: where checkpoints go (written every ``checkpoint_every`` steps and at the end).
        resume: a checkpoint directory to continue from (optimizer, schedule, RNG and data position included).
        num_workers: DataLoader workers for a Dataset.
        progress: show a tqdm bar (rank 0 only).

    Returns:
        Per-step history: ``loss``, ``deletion``, ``insertion``, ``tau``, ``lr``.
    """
    check_int_at_least(epochs, "epochs", 1)
    check_int_at_least(batch_size, "batch_size", 1)
    if max_steps is not None:
        check_int_at_least(max_steps, "max_steps", 1)
    if checkpoint_every is not None:
        check_int_at_least(checkpoint_every, "checkpoint_every", 1)
        if checkpoint_dir is None:
            raise ValueError("checkpoint_every needs a checkpoint_dir")
    cfg = aha.config
    device = aha.device
    rank, world = _init_distributed(device)

    per_epoch = _steps_per_epoch(data, batch_size, world)
    if per_epoch == 0:
        raise ValueError(f"not enough data for one batch of {batch_size} per process (world size {world})")
    total = epochs * per_epoch if max_steps is None else min(max_steps, epochs * per_epoch)

    decoder = aha.decoder
    decoder.train()
    optimizer = torch.optim.AdamW(decoder.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warmup = round(cfg.warmup * total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(total, warmup))
    # Every rank draws the same step choices (grid, offset, fractions, reference): the gradient DDP averages is the
    # one a single process would get on the global batch. Only the Gumbel noise is decorrelated per rank.
    gen = torch.Generator().manual_seed(cfg.seed)
    step = 0
    # Step directories this run may keep: older ones (another run's, or superseded) go once a newer one is in place.
    lineage: list[Path] = []
    if resume is not None:
        step, resumed_from = _load_trainer_state(aha, Path(resume), optimizer, scheduler, gen)
        lineage.append(resumed_from)
    model: torch.nn.Module = decoder
    if world > 1:
        model = DistributedDataParallel(decoder, device_ids=[device.index] if device.type == "cuda" else None)

    history: dict[str, list[float]] = {k: [] for k in ("loss", "deletion", "insertion", "tau", "lr")}
    bar = tqdm(total=total, initial=step, desc="AHA", disable=not progress or rank != 0, dynamic_ncols=True)
    blur_kernel, blur_sigma = scaled_blur(aha.img_size)
    try:
        while step < total:
            epoch, skip = divmod(step, per_epoch)
            for x, labels in _epoch_batches(data, epoch, skip, batch_size, rank, world, cfg.seed, num_workers):
                x, labels = x.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                tau = cfg.tau_start + (cfg.tau_end - cfg.tau_start) * step / max(1, total - 1)
                stats = _train_step(aha, model, x, labels, tau, gen, rank, blur_kernel, blur_sigma)
                torch.nn.utils.clip_grad_norm_(decoder.parameters(), cfg.grad_clip or float("inf"))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                aha.steps_trained += 1
                for key, value in (*stats.items(), ("tau", tau), ("lr", float(scheduler.get_last_lr()[0]))):
                    history[key].append(value)
                bar.update(1)
                bar.set_postfix(loss=f"{stats['loss']:.3f}", dele=f"{stats['deletion']:.3f}",
                                ins=f"{stats['insertion']:.3f}")  # fmt: skip
                if checkpoint_dir is not None and checkpoint_every and step % checkpoint_every == 0 and step < total:
                    _save_checkpoint(aha, Path(checkpoint_dir), optimizer, scheduler, gen, step, rank, world, lineage)
                if step >= total:
                    break
        if checkpoint_dir is not None:
            _save_checkpoint(aha, Path(checkpoint_dir), optimizer, scheduler, gen, step, rank, world, lineage)
    finally:
        bar.close()
        decoder.eval()
    return history


def _train_step(
    aha: Trainee,
    model: torch.nn.Module,
    x: torch.Tensor,
    labels: torch.Tensor,
    tau: float,
    gen: torch.Generator,
    rank: int,
    blur_kernel: int,
    blur_sigma: float,
) -> dict[str, float]:
    """One forward/backward of the soft-AUC objective; returns batch means for the history."""
    cfg = aha.config
    classifier = aha.classifier
    lo, hi = cfg.grid_range  # type: ignore[misc]
    # The range was resolved for the explainer's img_size; a grid drawn from it is lowered to the largest one these
    # images allow (their own resolved range), so images of another shape still fit it.
    _, fits = cfg.resolved((x.shape[-2], x.shape[-1])).grid_range  # type: ignore[misc]
    grid = min(int(torch.randint(lo, hi + 1, (1,), generator=gen)), fits)
    offset = tuple(torch.rand(2, generator=gen).tolist()) if cfg.random_offset else (0.0, 0.0)
    fractions = _draw_fractions(cfg.n_fractions, cfg.fraction_sampling, gen).to(x.device)
    kind = cfg.references[int(torch.randint(len(cfg.references), (1,), generator=gen))]
    # Per-sample noise seeds are consecutive from this one; ranks are spaced 2^20 apart so they never share noise.
    sorter_seed = int(torch.randint(0, 2**30, (1,), generator=gen)) + rank * 2**20

    with torch.no_grad():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cfg.amp and x.is_cuda):
            logits = classifier(x).float()
        top2 = logits.topk(2, dim=1).indices
        targets = [top2[:, 0]]
        if cfg.targets == "pred+label":
            # The label where it is known and differs from the prediction, otherwise the runner-up.
            known = (labels >= 0) & (labels < classifier.num_classes) & (labels != top2[:, 0])
            targets.append(torch.where(known, labels, top2[:, 1]))
        feats = aha.backbone(x)
    n_targets = len(targets)
    target = torch.cat(targets)
    xs = x.repeat(n_targets, 1, 1, 1)
    feats = [f.repeat(n_targets, 1, 1, 1) for f in feats]
    reference = reference_image(xs, kind, classifier.norm_mean, blur_kernel=blur_kernel, blur_sigma=blur_sigma)
    maps = model(feats, xs, target)
    result = soft_auc_loss(
        classifier, xs, maps, target, reference, grid=grid, fractions=fractions, tau=tau, offset=offset,
        noise=cfg.noise, generator=sorter_seed, **cfg.loss_kwargs(),
    )  # fmt: skip
    result.loss.backward()
    return {
        "loss": result.loss.item(),
        "deletion": result.deletion.mean().item(),
        "insertion": result.insertion.mean().item(),
    }


def _draw_fractions(count: int, sampling: str, gen: torch.Generator) -> torch.Tensor:
    if sampling == "linspace":
        return torch.linspace(0.0, 1.0, count)
    inner = torch.sort(torch.rand(count - 2, generator=gen)).values
    return torch.cat((torch.zeros(1), inner, torch.ones(1)))


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------


def _steps_per_epoch(data: Dataset | DataLoader, batch_size: int, world: int) -> int:
    if isinstance(data, DataLoader):
        return len(data)
    return (len(data) // world) // batch_size  # type: ignore[arg-type]


def _epoch_batches(
    data: Dataset | DataLoader,
    epoch: int,
    skip: int,
    batch_size: int,
    rank: int,
    world: int,
    seed: int,
    num_workers: int,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of ``epoch`` from batch ``skip`` on, for this rank."""
    if isinstance(data, DataLoader):
        for i, batch in enumerate(data):
            if i >= skip:
                yield _split_batch(batch)
        return
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed + 7919 * epoch))  # type: ignore[arg-type]
    usable = (len(order) // world) // batch_size * batch_size * world
    mine = order[:usable][rank::world].tolist()
    batches = [mine[i : i + batch_size] for i in range(skip * batch_size, len(mine), batch_size)]
    loader = DataLoader(data, batch_sampler=batches, collate_fn=collate_images_labels, num_workers=num_workers)
    yield from loader


def _split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, dict):
        return batch["image"], batch["label"]
    if not isinstance(batch, list | tuple) or len(batch) < 2:
        raise ValueError("a DataLoader for AHA.fit must yield (images, labels, ...) batches")
    return batch[0], torch.as_tensor(batch[1]).long()


# ----------------------------------------------------------------------------------------------------------------
# Distributed and checkpoints
# ----------------------------------------------------------------------------------------------------------------


def _init_distributed(device: torch.device) -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def _save_checkpoint(
    aha: Trainee,
    out: Path,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    gen: torch.Generator,
    step: int,
    rank: int,
    world: int,
    lineage: list[Path],
) -> None:
    """Checkpoint the explainer with the trainer state it resumes from (see :func:`save_training_checkpoint`)."""
    if rank != 0:  # the ranks hold identical weights, optimizer state and generator state
        return
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": gen.get_state(),
             "step": step}  # fmt: skip
    save_training_checkpoint(aha, out, state, step=step, world=world, lineage=lineage)


def _load_trainer_state(
    aha: Trainee,
    src: Path,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    gen: torch.Generator,
) -> tuple[int, Path]:
    """Load the newest complete checkpoint under ``src``; returns the step it ends at and its directory."""
    d, decoder_state, state, errors = latest_training_checkpoint(aha, src)
    if errors:
        warnings.warn(f"resuming from {d}: newer checkpoint(s) unusable: {'; '.join(errors)}", stacklevel=3)
    aha.decoder.load_state_dict(decoder_state)
    aha.steps_trained = int(state["step"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    gen.set_state(state["rng"].contiguous())
    return int(state["step"]), d
