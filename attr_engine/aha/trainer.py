"""Training loop of the AHA decoder: AdamW, warm-up + cosine, clipping, checkpoints that resume exactly, DDP.

Determinism: the data order of epoch e is a permutation drawn from ``(config.seed, e)``; every random choice of a
step (grid size, offset, fractions, reference, Gumbel seed) comes from one training generator whose state is saved
in each checkpoint. On the CPU an interrupted run resumed from its last checkpoint therefore ends with the same
weights as an uninterrupted one.

Distributed: under ``torchrun`` (``WORLD_SIZE`` > 1) a process group is started (NCCL on CUDA, gloo on CPU) unless one
exists, each rank takes every world-th example of the epoch's permutation, ``batch_size`` is per process, and only
the decoder is wrapped in DistributedDataParallel (the classifier and backbone are frozen). Rank 0 writes the
checkpoints.

Validation (``fit(..., val=...)``): the hard composite on held-out images every ``config.val_every`` steps, early
stopping and the best weights (:mod:`attr_engine.aha.validation`). Scoring draws nothing from the training
generator, so a run with validation takes the same steps as one without (of the same cap) until it stops; its
checkpoints also hold the curve, the patience count and the best weights so far, so a resumed run continues all
three.

Checkpoints: what goes into one (optimizer, scheduler and generator state, the step) is decided here; the directory
layout, the pointer and the choice of a checkpoint to resume are :mod:`attr_engine.aha.persistence`'s. This module
trains whatever has the :class:`Trainee` attributes (:class:`attr_engine.aha.model.AHA` does) and does not import
the model, which imports it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from attr_engine._training import collate_images_labels, warmup_cosine
from attr_engine.aha.loss import FLAT_SPREAD, curve_spread, flat_curves, soft_auc_loss
from attr_engine.aha.persistence import Checkpointable, latest_training_checkpoint, save_training_checkpoint
from attr_engine.aha.teacher import TeacherMaps, teacher_loss
from attr_engine.aha.validation import EarlyStopping, Scored, ValData, check_val_data, score_validation
from attr_engine.distributed import init_process_group
from attr_engine.guards import check_count
from attr_engine.imageops import reference_image, scaled_blur


class Trainee(Checkpointable, Scored, Protocol):
    """What :func:`fit` trains: an explainer's frozen classifier and backbone, its decoder (trained in place, with
    ``steps_trained`` counted up) and its resolved config, on the classifier's device; its validation scores
    call the explainer itself."""

    @property
    def device(self) -> torch.device: ...

    def features(self, x: torch.Tensor, logits: torch.Tensor | None = None) -> list[torch.Tensor]: ...

    def pullback_input(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None: ...


# The cap of a run with a validation set when neither ``epochs`` nor ``max_steps`` is given (see fit's docstring).
VAL_EPOCHS_CAP = 10
# The per-step lists of fit's history: the batch's mean loss and soft AUCs, the temperature and learning rate, the
# grid side, the share of flat curve pairs (StepRecord.flat_share), the decoder's gradient norm before clipping and
# the teacher's loss (AHAConfig.teacher_loss, unweighted; NaN without a teacher).
STEP_KEYS = ("loss", "deletion", "insertion", "tau", "lr", "grid", "flat_share", "grad_norm", "teacher")


@dataclass(frozen=True)
class StepRecord:
    """What one training step drew, and whether its curves carried a training signal.

    Taken from what the step computed anyway (no extra classifier pass). The per-curve tuples have one entry per
    (target, image) pair, in the loss's order: the batch's images for the predicted class, then (``targets=
    "pred+label"``) the same images for the label or the runner-up.

    Attributes:
        step: the optimiser step (0 = the first of the whole training, a resumed run's earlier steps counted).
        reference: each curve's reference ("black", "mean" or "blur"; one for the whole step by default).
        grid: the region grid side g; offset: its sub-cell shift; fractions: the curves' fractions (S,).
        images: the dataset indices of the batch (None when ``fit`` was given a DataLoader).
        targets: the class each curve explains.
        p_image, p_reference: each curve's first and last point: the target probability of the image (fraction 0)
            and of the reference (fraction 1).
        deletion_spread, insertion_spread: max - min of the target probability along each curve.
        flat: each pair of curves flat (:func:`~attr_engine.aha.loss.flat_curves`): its loss term is 1 whatever
            the map.
        grad_norm: the norm of the decoder's gradient, before clipping.
    """

    step: int
    reference: tuple[str, ...]
    grid: int
    offset: tuple[float, float]
    fractions: tuple[float, ...]
    images: tuple[int, ...] | None
    targets: tuple[int, ...]
    p_image: tuple[float, ...]
    p_reference: tuple[float, ...]
    deletion_spread: tuple[float, ...]
    insertion_spread: tuple[float, ...]
    flat: tuple[bool, ...]
    grad_norm: float

    @property
    def flat_share(self) -> float:
        """The share of the step's curve pairs that are flat; 1.0 makes the step flat (no signal at all)."""
        return sum(self.flat) / len(self.flat)


class History(dict[str, list[float]]):
    """What :func:`fit` returns: per-step lists by name (a dict, see its Returns) and ``steps``, one
    :class:`StepRecord` per step of this run."""

    def __init__(self, lists: dict[str, list[float]]) -> None:
        super().__init__(lists)
        self.steps: list[StepRecord] = []


def fit(
    aha: Trainee,
    data: Dataset | DataLoader,
    *,
    epochs: int | None = None,
    batch_size: int = 32,
    max_steps: int | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = None,
    resume: str | os.PathLike[str] | None = None,
    num_workers: int = 0,
    progress: bool = True,
    val: ValData | None = None,
    teacher: TeacherMaps | None = None,
) -> History:
    """Train ``aha``'s decoder.

    Budget: without ``val``, ``epochs`` passes over the data (default 1), at most ``max_steps`` steps. With ``val``
    the run lasts until the validation score has not improved by more than ``config.min_delta`` for
    ``config.patience`` scores in a row (one every ``config.val_every`` steps, one before the first step and one
    after the last), capped at ``max_steps`` and ``epochs`` (default :data:`VAL_EPOCHS_CAP` = 10), and the decoder
    gets its best weights back. The schedules span the cap (an early stop keeps lr and tau high).

    Args:
        data: a map-style Dataset of ``(image (3, H, W) in [0, 1], label, ...)`` items (label -1 = unknown), or a
            DataLoader yielding ``(images (B, 3, H, W), labels (B,), ...)`` batches (its own order is then used and
            resuming skips the batches already seen in the interrupted epoch).
        epochs: passes over the data; max_steps: stop after this many optimiser steps in total; batch_size: images
            per step and process (a Dataset only; also the images per validation batch).
        checkpoint_dir: where checkpoints go (every ``checkpoint_every`` steps and at the end); resume: one to
            continue from (optimizer, schedule, RNG, data position; with ``val`` the curve, best weights, patience).
        num_workers: DataLoader workers for a Dataset; progress: a tqdm bar (rank 0), the latest val composite shown.
        val: held-out images scored by the hard composite (``aha.validation``): a Dataset or DataLoader as ``data``,
            images (N, 3, H, W) or a tuple of tensors; DDP ranks share it.
        teacher: the :class:`~attr_engine.aha.teacher.TeacherMaps` of a Dataset ``data``; iff teacher_weight > 0.

    Returns:
        A :class:`History`: this run's per-step lists :data:`STEP_KEYS`, a :class:`StepRecord` per step in ``steps``;
        with ``val`` one entry per score of the whole curve (also in ``config.json``'s ``validation``): ``val_step``,
        ``val_composite``, ``val_deletion``, ``val_insertion``, ``val_loss`` (mean training loss since the previous
        score; NaN before the first step).

    Raises:
        ValueError: a bad count or ``val``, a ``val`` run resumed without its ``val``, a wrong or missing teacher.
    """
    _check_fit_args(epochs, batch_size, max_steps, checkpoint_every, checkpoint_dir)
    _check_teacher(aha.config.teacher_weight, teacher, data)
    val_images = check_val_data(val) if val is not None else None
    cfg = aha.config
    rank, world = init_process_group(aha.device)
    per_epoch = _steps_per_epoch(data, batch_size, world)
    if per_epoch == 0:
        raise ValueError(f"not enough data for one batch of {batch_size} per process (world size {world})")
    epochs = epochs if epochs is not None else (VAL_EPOCHS_CAP if val is not None else 1)
    total = epochs * per_epoch if max_steps is None else min(max_steps, epochs * per_epoch)

    decoder = aha.decoder
    decoder.train()
    optimizer = torch.optim.AdamW(decoder.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(total, round(cfg.warmup * total)))
    # Every rank draws the same step choices (grid, offset, fractions, reference): the gradient DDP averages is the
    # one a single process would get on the global batch. Only the Gumbel noise is decorrelated per rank.
    gen = torch.Generator().manual_seed(cfg.seed)
    stopper = EarlyStopping(cfg.patience, cfg.min_delta) if val is not None else None
    step = 0
    # Step directories this run may keep: older ones (another run's, or superseded) go once a newer one is in place.
    lineage: list[Path] = []
    if resume is not None:
        step, resumed_from = _load_trainer_state(aha, Path(resume), optimizer, scheduler, gen, stopper, val_images)
        lineage.append(resumed_from)
    model: torch.nn.Module = decoder
    if world > 1:
        device = aha.device
        model = DistributedDataParallel(decoder, device_ids=[device.index] if device.type == "cuda" else None)
    loop = _Loop(aha, model, optimizer, scheduler, gen, rank, world, total, step, stopper, val, val_images,
                 batch_size, num_workers, None if checkpoint_dir is None else Path(checkpoint_dir),
                 checkpoint_every, lineage, progress, teacher)  # fmt: skip
    try:
        loop.run(data, per_epoch)
    finally:
        loop.bar.close()
        decoder.eval()
    if stopper is not None:
        loop.history.update(stopper.history())
    return loop.history


def _check_fit_args(
    epochs: int | None,
    batch_size: int,
    max_steps: int | None,
    checkpoint_every: int | None,
    checkpoint_dir: str | os.PathLike[str] | None,
) -> None:
    if epochs is not None:
        check_count(epochs, "epochs")
    check_count(batch_size, "batch_size")
    if max_steps is not None:
        check_count(max_steps, "max_steps")
    if checkpoint_every is not None:
        check_count(checkpoint_every, "checkpoint_every")
        if checkpoint_dir is None:
            raise ValueError("checkpoint_every needs a checkpoint_dir")


def _check_teacher(weight: float, teacher: TeacherMaps | None, data: Dataset | DataLoader) -> None:
    if weight > 0 and teacher is None:
        raise ValueError(f"config.teacher_weight is {weight}: fit needs teacher= (attr_engine.aha.teacher)")
    if teacher is None:
        return
    if weight == 0:
        raise ValueError("a teacher was given but config.teacher_weight is 0: set a weight or leave the teacher out")
    if isinstance(data, DataLoader):
        raise ValueError("a teacher is looked up by dataset index: give fit the Dataset, not a DataLoader")
    if len(teacher) != len(data):  # type: ignore[arg-type]
        raise ValueError(f"the teacher holds {len(teacher)} maps, the dataset {len(data)} items")  # type: ignore[arg-type]


class _Loop:
    """One run of :func:`fit` past its set-up: the steps, the validation scores, the checkpoints and the end."""

    def __init__(
        self,
        aha: Trainee,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        gen: torch.Generator,
        rank: int,
        world: int,
        total: int,
        step: int,
        stopper: EarlyStopping | None,
        val: ValData | None,
        val_images: int | None,
        batch_size: int,
        num_workers: int,
        checkpoint_dir: Path | None,
        checkpoint_every: int | None,
        lineage: list[Path],
        progress: bool,
        teacher: TeacherMaps | None,
    ) -> None:
        self.aha, self.model, self.optimizer, self.scheduler, self.gen = aha, model, optimizer, scheduler, gen
        self.rank, self.world, self.total, self.step = rank, world, total, step
        self.stopper, self.val, self.val_images = stopper, val, val_images
        self.batch_size, self.num_workers = batch_size, num_workers
        self.checkpoint_dir, self.checkpoint_every, self.lineage = checkpoint_dir, checkpoint_every, lineage
        self.teacher = teacher
        self.history = History({k: [] for k in STEP_KEYS})
        self.bar = tqdm(total=total, initial=step, desc="AHA", disable=not progress or rank != 0, dynamic_ncols=True)
        self.blur_kernel, self.blur_sigma = scaled_blur(aha.img_size)
        # The bar's figures: the latest step's soft AUCs and, with validation, the latest score (``val``).
        self.postfix: dict[str, str] = {}

    @property
    def done(self) -> bool:
        return self.step >= self.total or (self.stopper is not None and self.stopper.stopped)

    def run(self, data: Dataset | DataLoader, per_epoch: int) -> None:
        """Train until the budget is spent or validation stops the run, then finish (:meth:`finish`)."""
        cfg = self.aha.config
        if self.stopper is not None and not self.stopper.curve:
            self.evaluate()  # the curve starts where this run's training does
        while not self.done:
            epoch, skip = divmod(self.step, per_epoch)
            batches = _epoch_batches(data, epoch, skip, self.batch_size, self.rank, self.world, cfg.seed,
                                     self.num_workers)  # fmt: skip
            for x, labels, indices in batches:
                self.optimise(x, labels, indices)
                if self.stopper is not None and self.step % cfg.val_every == 0:
                    self.evaluate()
                every = self.checkpoint_every
                if self.checkpoint_dir is not None and every and self.step % every == 0 and not self.done:
                    self.save()
                if self.done:
                    break
        self.finish()

    def optimise(self, x: torch.Tensor, labels: torch.Tensor, indices: tuple[int, ...] | None) -> None:
        """One optimiser step on the batch (``indices``: its dataset indices, if known), with its history entry,
        its :class:`StepRecord` and progress."""
        aha, cfg, device = self.aha, self.aha.config, self.aha.device
        x, labels = x.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        tau = cfg.tau_start + (cfg.tau_end - cfg.tau_start) * self.step / max(1, self.total - 1)
        taught = None if self.teacher is None or indices is None else self.teacher.batch(indices, device)
        stats, drawn = _train_step(aha, self.model, x, labels, tau, self.gen, self.rank, self.blur_kernel,
                                   self.blur_sigma, taught)  # fmt: skip
        norm = torch.nn.utils.clip_grad_norm_(aha.decoder.parameters(), cfg.grad_clip or float("inf"))
        record = StepRecord(step=self.step, images=indices, grad_norm=float(norm), **drawn)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        aha.steps_trained += 1
        stats.update(tau=tau, lr=float(self.scheduler.get_last_lr()[0]), grid=float(record.grid),
                     flat_share=record.flat_share, grad_norm=record.grad_norm)  # fmt: skip
        for key, value in stats.items():
            self.history[key].append(value)
        self.history.steps.append(record)
        if self.stopper is not None:
            self.stopper.add_loss(stats["loss"])
        self.bar.update(1)
        self.postfix.update(loss=f"{stats['loss']:.3f}", dele=f"{stats['deletion']:.3f}",
                            ins=f"{stats['insertion']:.3f}")  # fmt: skip
        self.bar.set_postfix(self.postfix)

    def evaluate(self) -> None:
        """Score the validation set at the current step and record it."""
        assert self.stopper is not None and self.val is not None
        scores = score_validation(self.aha, self.val, device=self.aha.device, batch_size=self.batch_size,
                                  rank=self.rank, world=self.world, num_workers=self.num_workers)  # fmt: skip
        self.stopper.record(self.step, scores, self.aha.decoder)
        self.postfix["val"] = f"{self.stopper.curve[-1]['composite']:.3f}"
        self.bar.set_postfix(self.postfix)

    def finish(self) -> None:
        """Score the last step (unless just scored), put the best weights back, write the final checkpoint."""
        stopper = self.stopper
        if stopper is not None:
            if stopper.last_step != self.step:
                self.evaluate()
            assert stopper.best_state is not None  # the first score is always the best so far
            self.aha.decoder.load_state_dict(stopper.best_state)
        if self.checkpoint_dir is not None:
            self.save(restored=stopper is not None)

    def save(self, restored: bool = False) -> None:
        """Checkpoint the explainer with the trainer state it resumes from (see :func:`save_training_checkpoint`);
        ``restored``: the decoder holds the best weights, not the last step's."""
        if self.rank != 0 or self.checkpoint_dir is None:  # the ranks hold identical weights and states
            return
        state: dict[str, Any] = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                                 "rng": self.gen.get_state(), "step": self.step}  # fmt: skip
        extra: dict[str, Any] = {}
        best = None
        if self.stopper is not None:
            validation = self.stopper.state()
            state.update(validation=validation, val_images=self.val_images, restored=restored)
            # The metadata is for readers: the running loss sums only matter to a resumed run (the trainer state).
            shown = {k: v for k, v in validation.items() if not k.startswith("loss_")}
            extra = {"validation": {**shown, "val_images": self.val_images, "restored": restored}}
            best = self.stopper.best_state
        save_training_checkpoint(self.aha, self.checkpoint_dir, state, step=self.step, world=self.world,
                                 lineage=self.lineage, best_state=best, extra_meta=extra)  # fmt: skip


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
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[dict[str, float], dict[str, Any]]:
    """One forward/backward of the soft-AUC objective (plus, with ``teacher``: the batch's teacher maps (B, H, W)
    and their classes (B,), ``config.teacher_weight`` x the teacher's loss); returns batch means for the history and
    the :class:`StepRecord` fields the step knows (all but ``step``, ``images`` and ``grad_norm``)."""
    cfg = aha.config
    classifier = aha.classifier
    lo, hi = cfg.grid_range  # type: ignore[misc]
    # The range was resolved for the explainer's img_size; a grid drawn from it is lowered to the largest one these
    # images allow (their own resolved range), so images of another shape still fit it.
    _, fits = cfg.resolved((x.shape[-2], x.shape[-1])).grid_range  # type: ignore[misc]
    grid = min(int(torch.randint(lo, hi + 1, (1,), generator=gen)), fits)
    offset = tuple(torch.rand(2, generator=gen).tolist()) if cfg.random_offset else (0.0, 0.0)
    fractions = _draw_fractions(cfg.n_fractions, cfg.fraction_sampling, gen).to(x.device)
    kind = int(torch.randint(len(cfg.references), (1,), generator=gen))
    per_image = torch.randint(len(cfg.references), (len(x),), generator=gen) if cfg.reference_draw == "image" else None
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
        # The served distribution is float32: logits under autocast would teach the decoder a rounded one.
        feats = aha.features(x, None if cfg.amp and x.is_cuda else logits)
    n_targets = len(targets)
    target = torch.cat(targets)
    xs = x.repeat(n_targets, 1, 1, 1)
    feats = [f.repeat(n_targets, *(1,) * (f.ndim - 1)) for f in feats]
    blur = (blur_kernel, blur_sigma)
    if cfg.reference_draw == "step":  # one reference for every curve, as drawn
        choice = torch.full((len(xs),), kind)
        reference = reference_image(xs, cfg.references[kind], classifier.norm_mean, blur_kernel=blur_kernel,
                                    blur_sigma=blur_sigma)  # fmt: skip
        endpoints = None
    elif per_image is not None:
        choice = per_image.repeat(n_targets)
        reference, endpoints = _mixed_reference(aha, x, choice.to(x.device), blur), None
    else:
        choice, reference, endpoints = _signal_reference(aha, x, logits, target, kind, sorter_seed, blur)
    maps = model(feats, xs, target, aha.pullback_input(xs, target))
    result = soft_auc_loss(
        classifier, xs, maps, target, reference, grid=grid, fractions=fractions, tau=tau, offset=offset,
        noise=cfg.noise, generator=sorter_seed, endpoints=endpoints, drop_flat=cfg.reference_draw == "signal",
        **cfg.loss_kwargs(),
    )  # fmt: skip
    loss, taught = result.loss, _teacher_term(maps[: len(x)], targets[0], teacher, cfg.teacher_loss, grid, offset)
    if taught is not None:
        loss = loss + cfg.teacher_weight * taught
    loss.backward()
    stats = {
        "loss": loss.item(),
        "deletion": result.deletion.mean().item(),
        "insertion": result.insertion.mean().item(),
        "teacher": float("nan") if taught is None else taught.item(),
    }
    deletion, insertion = result.deletion_curve.detach(), result.insertion_curve.detach()
    record = {
        "reference": tuple(cfg.references[i] for i in choice.tolist()), "grid": grid, "offset": offset,
        "fractions": tuple(fractions.tolist()), "targets": tuple(target.tolist()),
        "p_image": tuple(deletion[:, 0].tolist()), "p_reference": tuple(deletion[:, -1].tolist()),
        "deletion_spread": tuple(curve_spread(deletion).tolist()),
        "insertion_spread": tuple(curve_spread(insertion).tolist()),
        "flat": tuple(flat_curves(deletion, insertion).tolist()),
    }  # fmt: skip
    return stats, record


def _teacher_term(
    maps: torch.Tensor,
    predicted: torch.Tensor,
    teacher: tuple[torch.Tensor, torch.Tensor] | None,
    kind: str,
    grid: int,
    offset: tuple[float, float],
) -> torch.Tensor | None:
    """The mean teacher's loss ``kind`` (``AHAConfig.teacher_loss``) of the predicted class's maps (B, H, W)
    against the teacher's, over the images whose teacher explains that class (a teacher made with another
    classifier, or augmented images, may not); None without a teacher."""
    if teacher is None:
        return None
    teacher_maps, teacher_targets = teacher
    if teacher_maps.shape != maps.shape:
        raise ValueError(f"the teacher's maps are {tuple(teacher_maps.shape[1:])}, the training images "
                         f"{tuple(maps.shape[1:])}: compute them on the images fit is given")  # fmt: skip
    same = (teacher_targets == predicted).to(maps.dtype)
    per_image = teacher_loss(maps, teacher_maps, kind, grid, offset)
    return (per_image * same).sum() / same.sum().clamp_min(1.0)


def _reference_images(aha: Trainee, x: torch.Tensor, blur: tuple[int, float]) -> torch.Tensor:
    """Every configured reference of each image: (R, B, C, H, W) for x (B, C, H, W), R = len(references)."""
    mean, (kernel, sigma) = aha.classifier.norm_mean, blur
    refs = aha.config.references
    return torch.stack([reference_image(x, k, mean, blur_kernel=kernel, blur_sigma=sigma) for k in refs])


def _mixed_reference(
    aha: Trainee, x: torch.Tensor, choice: torch.Tensor, blur: tuple[int, float], stack: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference of each curve: ``references[choice[i]]`` of image ``i % B``. x: (B, C, H, W), choice: (B',)
    on x's device, ``stack``: :func:`_reference_images` if already made -> (B', C, H, W)."""
    stack = _reference_images(aha, x, blur) if stack is None else stack
    return stack[choice, torch.arange(len(choice), device=x.device) % len(x)]


def _signal_reference(
    aha: Trainee,
    x: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    kind: int,
    seed: int,
    blur: tuple[int, float],
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """``reference_draw="signal"``: the step's reference ``kind`` for every curve it moves, another one for a curve
    it leaves flat.

    A curve runs from the image's target probability to the reference's, so a reference within
    :data:`~attr_engine.aha.loss.FLAT_SPREAD` of the image for that target leaves it (nearly) flat: such a curve
    draws again among the references that differ by more (keeping ``kind`` where none does). One classifier pass
    per image and reference, without autograd; the curves' ends then come from these passes (``endpoints``), which
    spares the loss four passes per curve. The redraw's generator is seeded from ``seed``, so the training
    generator draws as with "step".

    Args:
        x: (B, C, H, W) images; logits: (B, K) their logits; target: (B',) the class of each curve (B' = n B).

    Returns:
        ``(choice (B',) reference index per curve, reference (B', C, H, W), endpoints or None)``.
    """
    cfg, classifier = aha.config, aha.classifier
    stack = _reference_images(aha, x, blur)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=cfg.amp and x.is_cuda):
        ref_logits = classifier.forward_trusted(stack.flatten(0, 1)).float()
    n_refs, image = len(cfg.references), torch.arange(len(target), device=x.device) % len(x)
    p_refs = ref_logits.softmax(-1).view(n_refs, len(x), -1)[:, image, target]  # (R, B')
    p_image = logits.softmax(-1)[image, target]
    moves = (p_refs - p_image).abs() >= FLAT_SPREAD
    noise = torch.rand(len(target), n_refs, generator=torch.Generator().manual_seed(seed)).to(x.device)
    # Among the references that move a curve, the one with the largest uniform draw: a uniform choice.
    other = (noise * moves.T).argmax(dim=1)
    choice = torch.where(~moves[kind] & moves.any(dim=0), other, torch.full_like(other, kind))
    reference = _mixed_reference(aha, x, choice, blur, stack)
    # A curve of two points is only its ends: the loss then needs them from the blends.
    ends = (p_image, p_refs[choice, torch.arange(len(target), device=x.device)])
    return choice, reference, ends if cfg.n_fractions > 2 else None


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
) -> Iterator[tuple[torch.Tensor, torch.Tensor, tuple[int, ...] | None]]:
    """The batches ``(images, labels, dataset indices)`` of ``epoch`` from batch ``skip`` on, for this rank (the
    indices None for a DataLoader, whose order is its own)."""
    if isinstance(data, DataLoader):
        for i, batch in enumerate(data):
            if i >= skip:
                yield (*_split_batch(batch), None)
        return
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed + 7919 * epoch))  # type: ignore[arg-type]
    usable = (len(order) // world) // batch_size * batch_size * world
    mine = order[:usable][rank::world].tolist()
    batches = [mine[i : i + batch_size] for i in range(skip * batch_size, len(mine), batch_size)]
    loader = DataLoader(data, batch_sampler=batches, collate_fn=collate_images_labels, num_workers=num_workers)
    for indices, (x, labels) in zip(batches, loader, strict=True):
        yield x, labels, tuple(indices)


def _split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, dict):
        return batch["image"], batch["label"]
    if not isinstance(batch, list | tuple) or len(batch) < 2:
        raise ValueError("a DataLoader for AHA.fit must yield (images, labels, ...) batches")
    return batch[0], torch.as_tensor(batch[1]).long()


# ----------------------------------------------------------------------------------------------------------------
# Distributed and checkpoints
# ----------------------------------------------------------------------------------------------------------------


def _load_trainer_state(
    aha: Trainee,
    src: Path,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    gen: torch.Generator,
    stopper: EarlyStopping | None,
    val_images: int | None,
) -> tuple[int, Path]:
    """Load the newest complete checkpoint under ``src``; returns the step it ends at and its directory.

    A checkpoint of a run with a validation set continues its curve, best weights and patience count in
    ``stopper``; one without starts the curve at its step.
    """
    d, decoder_state, state, errors = latest_training_checkpoint(aha, src)
    if errors:
        warnings.warn(f"resuming from {d}: newer checkpoint(s) unusable: {'; '.join(errors)}", stacklevel=3)
    if "validation" in state:
        if stopper is None:
            raise ValueError(f"{d} is a run with a validation set (fit(val=...), --val-fraction); resume it with one")
        if int(state["val_images"]) != val_images:
            raise ValueError(
                f"{d} was validated on {state['val_images']} images, this val has {val_images}: resume with the same "
                "validation set"
            )
        stopper.load(state["validation"], state.get("best_decoder"))
    aha.decoder.load_state_dict(decoder_state)
    aha.steps_trained = int(state["step"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    gen.set_state(state["rng"].contiguous())
    return int(state["step"]), d
