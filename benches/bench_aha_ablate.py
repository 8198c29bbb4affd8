"""AHA ablations (issue #21): which part of the explainer limits it on CNNs, on real photographs and on the shapes.

    python -u -m benches.bench_aha_ablate --data photos --kind resnet --cache reports/cache --out reports/ablate
    python -u -m benches.bench_aha_ablate --data shapes --kind vit --family refs,image --cache reports/cache
    python -u -m benches.bench_aha_ablate --quick --data photos --kind resnet --out reports/ablate-quick  # smoke
    python -u -m benches.bench_aha_ablate --gap 50 --data photos --kind resnet --cache reports/cache  # issue #31
    python -u -m benches.bench_aha_ablate --data shapes --kind resnet --family flat --cache reports/cache
    python -u -m benches.bench_aha_ablate --data photos --kind vit --family stride --cache reports/cache
    python -u -m benches.bench_aha_ablate --data photos --kind vit --teacher-detail 200 --cache reports/cache

The classifier and the default AHA explainer are the leaderboard's (:func:`benches.bench_leaderboard.train`, same
budget, seed and ``--cache`` key), so the ``default`` row of a table is the leaderboard's AHA (T=0). Every other row
changes one thing against it and is trained with the same seed, data order and number of steps (the ``steps``
family aside): the leaderboard's CPU budget, 8 sampled fractions and the predicted class as the one target.

Families (``--family``, comma-separated; each row's overrides are printed in the table):

- ``refs``: the reference set drawn from during training: the mean colour alone (the evaluation's reference)
  against the official three (black, mean colour, blur).
- ``refs-each``: each reference alone (mean colour, black, blur), to be scored with ``--score-reference`` set to
  each in turn (issue #31: the effect of the choice for users who score with black or blur).
- ``targets``: the target pair: the predicted class and the label (or the runner-up), against the predicted class.
- ``grid``: the grid range: half and double the rule's (clipped to the image side).
- ``image``: the capacity of the full-resolution image encoding (``image_dim``): 64 channels against 32.
- ``taps``: the decoder's taps. CNNs: without the stride-2 stem level, without the deepest stage (at 64 px a
  stride-32 stage is 2 x 2); ViTs: the last two blocks only.
- ``steps``: the training length: twice the steps.
- ``decoder``: the light decoder (``AHAConfig.decoder="light"``, issue #24: 2-3.4x cheaper) against the full one.
- ``budget``: training with ``fit(val=)`` and early stopping (the config's ``val_every`` and ``patience``) on
  ``BUDGET_VAL_IMAGES`` held-out images of the training distribution (another seed), capped at ``BUDGET_CAP``
  times the leaderboard's steps; the notes say where it stopped and where its validation score peaked.
- ``distance``: the reference-distance term (``AHAConfig.reference_distance``, issue #31's sub-cell order): a
  learned multiple of log(|x − r|) added to the map, trained with the rest.
- ``noise``: the sorter's Gumbel noise in training (``AHAConfig.noise``, official 1.0) at 0.3 and 0: the
  per-image optimum that beats every peer ranks without noise, so the noise is a difference between what training
  and the optimum optimise (issue #31's amortization gap).
- ``lr``: the decoder's learning rate (``AHAConfig.lr``, official 3e-4) at 1e-3: the ``budget`` family's
  validation curve still rises long after the leaderboard's 400 steps.
- ``padding``: the decoder's convolutions padding by edge replication, trained with (``AHAConfig.
  decoder_padding="replicate"``), against zeros: issue #31's border mass (the ``--gap`` probe swaps the padding
  into the trained decoder instead).
- ``pullback``: the decoder also sees the classifier's pullback ``v`` for the target class (``AHAConfig.
  pullback_input``: ``v·(x − r)`` and ``|v|`` as two more channels of its image stem), the Soft Pullback or
  (``pullback_method="ascent"``) Pullback Ascent's: the classifier's own pixel-level sensitivity, which the
  ``x·(x−r)`` rankings of the pullbacks win with on photographs; ``skip`` rows also add a learned multiple of the
  ``v·(x − r)`` channel to the map (``pullback_skip``), so that training starts from that ranking; ``refs mean``
  trains that variant against the mean colour alone.
- ``pullback-budget``: the ``budget`` family's early stopping for the pullback input with Pullback Ascent and the
  skip.
- ``flat``: how a training step draws its references (``AHAConfig.reference_draw``): one per step (the default,
  retrained here for its record: the config, seed and data of ``default``, so the same scores), one per image,
  and by signal (a curve the step's reference leaves flat draws one that moves its target probability; curves
  still flat leave the loss's mean); also the two-target pair (``targets="pred+label"``, the config's default)
  per step and by signal. The notes give each row's share of flat steps (every curve's target probability
  moving by less than 0.01) and of flat curves, per reference, and the decoder's median gradient norm on flat
  and other steps (from ``fit``'s per-step record).

- ``stride``: the decoder at 1/4 and 1/8 of the input side (``AHAConfig.decoder_stride``), its map brought to the
  input's by the guided (joint bilateral) or the bilinear upsampling (``decoder_upsample``): what the cheaper
  decoder costs in faithfulness against the full-resolution ``default``.
- ``teacher``: the teacher-student phase (``AHAConfig.teacher_weight`` 0.3 and 1.0; 1.0 with a 3x longer optimum
  and 1.0 at the ``curve`` family's x4 budget; the pixel loss, ``teacher_loss="pixel"``, at 1 and 10, and at 10
  on the first ``TEACHER_FIT_IMAGES`` training images alone: can the decoder fit the teacher at all): the default
  AHA's per-image optimum (``TEACHER_STEPS`` Adam steps from its one-pass maps) over the training set, computed
  once into the cache (:mod:`attr_engine.aha.teacher`), taught beside the soft-AUC loss to a decoder trained from
  scratch. The teacher's time is printed; it is paid once per classifier, not per map. A run with a taught row
  also scores the teacher itself on the test images (``teacher s=N``: the same optimum, computed there) and notes
  each AHA row's ranking and pixel loss against the teacher on training and on test images (what the student
  fits, and whether it carries over).
- ``head``: the classifier head's score of the target at each position of its deepest matching tap as one more
  decoder input (``AHAConfig.head_input``: the class activation map of a pooled linear head), a decoder input
  that costs no backward pass (issue #40 item 4).
- ``prediction``: the classifier's predicted distribution (the softmax of its logits) as a decoder input
  (``AHAConfig.prediction_input``), through a learned matrix onto the class embedding (issue #40 item 4).
- ``curve``: the learning curve (issue #40 item 2): the default config trained for ``CURVE_FACTORS`` times the
  leaderboard's steps (a 64x span of training images seen; the x16 row alone trains 16 times the default), each
  its own run (the warm-up and cosine schedules span its budget) with ``fit(val=)`` keeping the weights of its
  best validation score, never stopping early (the patience covers the whole run); the notes give each row's
  validation curve and training samples/s.

``--gap N`` (issue #31) replaces the families with the gap split on the first N test images: AHA T=0 and T=3,
the per-image optimum of AHA's own objective (:meth:`AHA.optimise_maps`: a free map per image initialised from
T=0, scored after each of ``--gap-steps`` Adam steps, rate ``--gap-lr``) and the peers, all on the same N images.
optimum - T=0 is the amortization gap; best peer - optimum the objective gap (printed in the notes).
``--gap-variant NAME`` runs the same split with a family's cached variant (e.g. ``"pullback input"``) as AHA.
``--teacher-detail N`` replaces the families with where the teacher's lead lives on the first N test images: the
teacher's and the default's maps with their coarse (cell means) and fine parts swapped, blurred, half-way, and the
change alone (:func:`teacher_detail`), and how well inputs a decoder has or could be given correlate with that
change (:func:`sensitivity_notes`).
``--only ROW`` (repeatable) trains and scores only the named rows of the families (e.g. ``"pullback input,
ascent, skip"``).

Scored beside IG-50, gradient x input and the two pullbacks (with their ``x·(x−r)`` rows) on the same held-out
images with :func:`attr_engine.evaluate.evaluate`: deletion / insertion (AHA protocol: mean-colour reference, 21
points, predicted class), their composite insertion - deletion, and on the shapes the energy pointing game and
the top-k% mask IoU.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

import attr_engine_kernels as kernels
from attr_engine.aha import AHA, AHAConfig
from attr_engine.aha.config import grid_rule
from attr_engine.aha.model import standardise_maps
from attr_engine.aha.network import classifier_head_weight, head_level
from attr_engine.aha.teacher import TeacherMaps, compute_teacher_maps, teacher_pixel_loss, teacher_ranking_loss
from attr_engine.aha.trainer import History
from attr_engine.data import PhotoCropsDataset, ShapesDataset
from attr_engine.evaluate import Leaderboard, evaluate
from attr_engine.explainer import Explainer, get_explainer
from attr_engine.imageops import gaussian_blur
from attr_engine.metrics import pearson_similarity
from attr_engine.report import leaderboard_markdown, write_markdown
from attr_engine_kernels.region import cell_index
from benches.bench_leaderboard import FULL, PHOTOS_FULL, PHOTOS_QUICK, QUICK, composite, datasets, train

FAMILIES = (
    "refs",
    "refs-each",
    "targets",
    "grid",
    "image",
    "taps",
    "steps",
    "decoder",
    "budget",
    "distance",
    "noise",
    "lr",
    "padding",
    "pullback",
    "pullback-budget",
    "flat",
    "stride",
    "teacher",
    "head",
    "prediction",
    "curve",
)
# The teacher family's optimum: Adam steps per training image, from the cached default AHA's one-pass maps.
TEACHER_STEPS = 10
# The teacher family's fitting row: the training images it alone trains on, the leaderboard's steps over them.
TEACHER_FIT_IMAGES = 64
# The budget family's cap, in multiples of the leaderboard's steps, and its held-out validation images.
BUDGET_CAP = 4
BUDGET_VAL_IMAGES = 64
# The curve family's budgets, in multiples of the leaderboard's steps (its CPU budget): 100, 200, 400, 1600 and 6400
# steps of 8, a 64x span (the last row alone trains 16x the default: pick rows with --only).
CURVE_FACTORS = (0.25, 0.5, 1, 4, 16)
# Every row's training batch, the leaderboard's (bench_leaderboard.train): images seen = steps x TRAIN_BATCH.
TRAIN_BATCH = 8
PEERS = ("integrated-gradients", "gradient-x-input", "pullback-soft", "pullback-ascent")


# Refinement rows of the gap split (issue #31 item 4): {row: (steps, AHAConfig overrides)}. "AHA (T=3)" and
# "AHA (T=6)" are the default refinement (set explicitly: a cached explainer's config keeps the refinement settings
# it was saved with); "decoder" is the default before issue #31; the others change the rate, or spend more of
# IG-50's budget (T=6 with 6 fractions and T=12 with 4 make 48 classifier passes with backward per image) or take
# finer steps.
_DEFAULT = AHAConfig()
_MAP = {
    "refine_mode": "map",
    "refine_map_lr": _DEFAULT.refine_map_lr,
    "refine_fractions": _DEFAULT.refine_fractions,
    "refine_smooth": _DEFAULT.refine_smooth,
}
REFINEMENTS: dict[str, tuple[int, dict]] = {
    "AHA (T=3)": (3, _MAP),
    "AHA (T=3, decoder)": (3, {"refine_mode": "decoder", "refine_fractions": _DEFAULT.refine_fractions}),
    "AHA (T=3, map lr 0.05)": (3, {**_MAP, "refine_map_lr": 0.05}),
    "AHA (T=3, map lr 0.2)": (3, {**_MAP, "refine_map_lr": 0.2}),
    "AHA (T=3, map smoothed 0.5)": (3, {**_MAP, "refine_smooth": 0.5}),
    "AHA (T=3, map, training grids, 8 fractions)": (
        3,
        {**_MAP, "refine_grid_range": "training", "refine_fractions": 8},
    ),
    "AHA (T=6)": (6, _MAP),
    "AHA (T=6, map lr 0.2)": (6, {**_MAP, "refine_map_lr": 0.2}),
    "AHA (T=6, map smoothed 0.5)": (6, {**_MAP, "refine_smooth": 0.5}),
    "AHA (T=12, map, 4 fractions)": (12, {**_MAP, "refine_fractions": 4}),
}


def variants(family: str, kind: str, img: int, levels: int) -> dict[str, dict]:
    """``{row name: AHAConfig overrides}`` of one family (``"steps"`` rows carry a ``"_steps_factor"`` instead).

    ``levels``: how many levels the default decoder taps (the taps family drops one end or the other).
    """
    if family == "refs":
        return {"refs mean": {"references": ("mean",)}}
    if family == "refs-each":
        return {f"refs {r}": {"references": (r,)} for r in ("mean", "black", "blur")}
    if family == "targets":
        return {"targets pred+label": {"targets": "pred+label"}}
    if family == "grid":
        low, high = grid_rule(img, img)
        half = (max(1, low // 2), max(1, high // 2))
        double = (min(2 * low, img // 2), min(2 * high, img // 2))
        return {
            f"grid {half[0]}..{half[1]}": {"grid_range": half},
            f"grid {double[0]}..{double[1]}": {"grid_range": double},
        }
    if family == "image":
        return {"image_dim 64": {"image_dim": 64}}
    if family == "taps":
        if kind == "vit":
            return {"taps last 2 blocks": {"layers": (levels - 2, levels - 1)}}
        return {
            "taps without stride-2 level": {"layers": tuple(range(1, levels))},
            "taps without deepest stage": {"layers": tuple(range(levels - 1))},
        }
    if family == "steps":
        return {"steps x2": {"_steps_factor": 2}}
    if family == "decoder":
        return {"decoder light": {"decoder": "light"}}
    early_stopping = {"_val": True, "_steps_factor": BUDGET_CAP}
    if family == "budget":
        return {"budget early stopping": early_stopping}
    if family == "curve":  # patience 10**6: the run uses its whole budget and keeps its best validation weights
        return {
            f"curve x{factor}": {"_val": True, "_steps_factor": factor, "patience": 10**6} for factor in CURVE_FACTORS
        }
    if family == "distance":
        return {"reference distance": {"reference_distance": True}}
    if family == "noise":
        return {"noise 0.3": {"noise": 0.3}, "noise 0": {"noise": 0.0}}
    if family == "lr":
        return {"lr 1e-3": {"lr": 1e-3}}
    if family == "padding":
        return {"padding replicate": {"decoder_padding": "replicate"}}
    soft, ascent = {"pullback_input": True}, {"pullback_input": True, "pullback_method": "ascent"}
    if family == "pullback":
        return {
            "pullback input": soft,
            "pullback input, ascent": ascent,
            "pullback input, skip": {**soft, "pullback_skip": True},
            "pullback input, ascent, skip": {**ascent, "pullback_skip": True},
            "pullback input, ascent, skip, refs mean": {**ascent, "pullback_skip": True, "references": ("mean",)},
        }
    if family == "pullback-budget":
        return {"pullback input, ascent, skip, early stopping": {**ascent, "pullback_skip": True, **early_stopping}}
    if family == "flat":
        pair = {"targets": "pred+label"}
        return {
            "reference per step": {"reference_draw": "step"},
            "reference per image": {"reference_draw": "image"},
            "reference by signal": {"reference_draw": "signal"},
            "targets pred+label, reference per step": {**pair, "reference_draw": "step"},
            "targets pred+label, reference by signal": {**pair, "reference_draw": "signal"},
        }
    if family == "stride":
        return {
            f"stride {stride}, {upsample}": {"decoder_stride": stride, "decoder_upsample": upsample}
            for stride in (4, 8)
            for upsample in ("guided", "bilinear")
        }
    if family == "head":
        return {"head input": {"head_input": True}}
    if family == "prediction":
        return {"prediction input": {"prediction_input": True}}
    if family == "teacher":  # the default AHA's per-image optimum (TEACHER_STEPS Adam steps) as the teacher
        rows = {f"teacher {w}": {"teacher_weight": w, "_teacher_steps": TEACHER_STEPS} for w in (0.3, 1.0)}
        # A teacher of 3x the steps (closer to the optimum, 3x its cost), and the taught decoder at the curve
        # family's x4 budget (more passes over the same teacher maps; compare with "curve x4").
        rows[f"teacher 1.0, {3 * TEACHER_STEPS} steps"] = {"teacher_weight": 1.0, "_teacher_steps": 3 * TEACHER_STEPS}
        rows["teacher 1.0, curve x4"] = {**rows["teacher 1.0"], "_val": True, "_steps_factor": 4, "patience": 10**6}
        # The pixel loss (the teacher's lead is a small change finer than the coarse cells: --teacher-detail).
        pixel = {"teacher_loss": "pixel", "_teacher_steps": TEACHER_STEPS}
        for w in (1.0, 10.0):
            rows[f"teacher pixel {w:g}"] = {**pixel, "teacher_weight": w}
        # Can the decoder fit the teacher at all: the same steps on the first TEACHER_FIT_IMAGES training images
        # alone (50 passes over them), its losses against the teacher noted on those images.
        rows[f"teacher pixel 10, {TEACHER_FIT_IMAGES} images"] = {**pixel, "teacher_weight": 10.0,
                                                                   "_images": TEACHER_FIT_IMAGES}  # fmt: skip
        return rows
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")


class _Precomputed:
    """``fn(x, target) -> maps`` that returns maps computed beforehand for the same images (matched by content),
    so that :func:`evaluate` scores them with the same code as every other row."""

    def __init__(self, x: torch.Tensor, maps: torch.Tensor) -> None:
        self.maps = {_key(img): m for img, m in zip(x, maps, strict=True)}

    def __call__(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.maps_of(x).to(x.device)

    def maps_of(self, x: torch.Tensor) -> torch.Tensor:
        """The stored maps (B, H, W) of the images ``x``, on the CPU."""
        return torch.stack([self.maps[_key(img)] for img in x])


def _key(img: torch.Tensor) -> bytes:
    return img.detach().float().cpu().contiguous().numpy().tobytes()


def predicted(classifier, x: torch.Tensor) -> torch.Tensor:
    """The classifier's predicted class of each image: (N, 3, H, W) -> (N,), in batches of 64."""
    with torch.no_grad():
        return torch.cat([classifier(c).argmax(dim=1) for c in x.split(64)])


def optimum_rows(
    aha: AHA, x: torch.Tensor, steps: list[int], lr: float, seed: int, log, target: torch.Tensor | None = None
) -> dict[str, _Precomputed]:
    """``{"optimum s=N": maps}`` of :meth:`AHA.optimise_maps` for every N in ``steps`` (chunks of 10 images, the
    same grid draws for every chunk: each map depends on its image alone), for the classes ``target`` (N,)
    (``None``: the predicted ones)."""
    target = predicted(aha.classifier, x) if target is None else target
    chunks: dict[int, list[torch.Tensor]] = {s: [] for s in steps}
    start = time.perf_counter()
    for i in range(0, len(x), 10):
        out = aha.optimise_maps(x[i : i + 10], target[i : i + 10], steps=max(steps), record=steps, lr=lr, seed=seed)
        for s in steps:
            chunks[s].append(out[s].cpu())
        log(f"optimum: {min(i + 10, len(x))}/{len(x)} images ({time.perf_counter() - start:.0f} s)")
    return {f"optimum s={s}": _Precomputed(x, torch.cat(chunks[s])) for s in steps}


def teacher_fit(rows: dict[str, AHA], train: tuple, test: tuple, grids: tuple[int, int]) -> list[str]:
    """Each row's mean :func:`teacher_ranking_loss` and :func:`teacher_pixel_loss` against the teacher's maps, on
    training and on test images.

    ``train`` / ``test``: ``(x (N, 3, H, W), target (N,), teacher maps (N, H, W))``; the ranking loss is averaged
    over the two ends of the training's ``grids`` (no offset), the pixel loss takes no grid. Low on training and
    high on test: the student memorises the teacher; high on both: it cannot fit it.
    """
    notes = []
    for name, aha in rows.items():
        losses = []
        for x, target, teacher in (train, test):
            with torch.no_grad():
                maps = torch.cat([aha(xc, tc) for xc, tc in zip(x.split(32), target.split(32), strict=True)])
            ranking = statistics.mean(teacher_ranking_loss(maps, teacher, g).mean().item() for g in grids)
            losses.append(f"{ranking:.3f} / {teacher_pixel_loss(maps, teacher).mean().item():.3f}")
        notes.append(f"{name}: ranking / pixel loss against the teacher {losses[0]} on {len(train[0])} training "
                     f"images, {losses[1]} on {len(test[0])} test images")  # fmt: skip
    return notes


def teacher_rows(
    args, aha: AHA, teachers: dict[int, TeacherMaps], rows: dict[str, AHA], train_set, test_set, log, subsets=None
):
    """The teacher itself on the test images (``{"teacher s=N": maps}``, N the taught rows' teacher steps) and the
    notes of :func:`teacher_fit` (the first 200 training and test images; for a row trained on the first N
    training images alone (``subsets``: {row: N}), it and the default also on those N and N test images)."""
    x, _ = test_set.tensors()[:2]
    optimum: dict[str, _Precomputed] = {}
    notes = []
    grids = aha.config.grid_range or grid_rule(*x.shape[-2:])
    target_x = predicted(aha.classifier, x)
    for steps, maps in teachers.items():
        start = time.perf_counter()
        rows_of = optimum_rows(aha, x, [steps], 0.05, args.seed, log, target_x)
        row = optimum[f"teacher s={steps}"] = rows_of[f"optimum s={steps}"]
        seconds = time.perf_counter() - start
        notes.append(f"teacher s={steps}: the teacher's optimum computed on the {len(x)} test images ({seconds:.0f} s; "
                     "its ms/image column is a table look-up)")  # fmt: skip
        n = min(200, len(x), len(maps))
        xs = torch.stack([train_set[i][0] for i in range(n)])
        teacher, target = maps.batch(range(n), "cpu")
        test_target = target_x[:n]
        notes += teacher_fit(rows, (xs, target, teacher), (x[:n], test_target, row(x[:n], test_target)), grids)
        for name, images in (subsets or {}).items():
            k = min(images, n)
            fitted = teacher_fit({"default": rows["default"], name: rows[name]}, (xs[:k], target[:k], teacher[:k]),
                                 (x[:k], test_target[:k], row(x[:k], test_target[:k])), grids)  # fmt: skip
            notes += [f"{line} (on the {name!r} row's own training images)" for line in fitted]
    return optimum, notes


def validation_set(data: str, img: int, seed: int):
    """The budget family's validation images: ``BUDGET_VAL_IMAGES`` of the training distribution, drawn with
    another seed than the training and test sets (photos: crops of the training region of each photograph)."""
    if data == "photos":
        return PhotoCropsDataset(BUDGET_VAL_IMAGES, split="train", img_size=img, seed=seed + 7919)
    return ShapesDataset(BUDGET_VAL_IMAGES, img_size=img, seed=seed + 7919)


def stopping_note(name: str, history: dict, trained: int, cap: int) -> str:
    """Where an early-stopped run stopped, and its validation curve (step: hard composite)."""
    curve = list(zip(history["val_step"], history["val_composite"], strict=True))
    best = max(curve, key=lambda point: point[1])
    points = ", ".join(f"{int(s)}: {c:.3f}" for s, c in curve)
    return (
        f"{name}: stopped after {trained} of at most {cap} steps; validation composite best {best[1]:.3f} at step "
        f"{int(best[0])} (weights of that step kept); curve {points}"
    )


def training_step_flops(classifier, config: AHAConfig, train_set) -> str:
    """One line: the FLOPs of one training step of ``TRAIN_BATCH`` images (forward and backward, the classifier's
    passes in the loss included), counted by ``torch.utils.flop_counter`` (matrix products and convolutions) on a
    fresh explainer, so that a budget in images converts to accelerator hours."""
    probe = AHA(classifier, config)
    with FlopCounterMode(display=False) as counter:
        probe.fit(train_set, batch_size=TRAIN_BATCH, epochs=1, max_steps=1, progress=False)
    flops = counter.get_total_flops()
    step, image = flops / 1e9, flops / TRAIN_BATCH / 1e9
    return f"one training step of {TRAIN_BATCH} images: {step:.1f} GFLOPs ({image:.2f} GFLOPs a training image)"


def flat_record(history: History) -> dict:
    """What the ``flat`` notes need of a run's per-step record, as JSON (kept in the variant's history.json):
    each step's flat share and gradient norm, and flat and all curves per reference."""
    by_reference: dict[str, list[int]] = {}
    for record in history.steps:
        for name, flat in zip(record.reference, record.flat, strict=True):
            counts = by_reference.setdefault(name, [0, 0])
            counts[0] += flat
            counts[1] += 1
    return {"flat_share": history["flat_share"], "grad_norm": history["grad_norm"], "flat_by_reference": by_reference}


def flat_note(name: str, record: dict) -> str:
    """One line: the share of flat steps and curves (per reference) and the median gradient norm of flat and other
    steps, from :func:`flat_record`."""
    shares, norms = record["flat_share"], record["grad_norm"]
    flat = [g for s, g in zip(shares, norms, strict=True) if s == 1.0]
    other = [g for s, g in zip(shares, norms, strict=True) if s < 1.0]
    refs = ", ".join(f"{r} {f / n:.1%} of {n}" for r, (f, n) in sorted(record["flat_by_reference"].items()))

    def median(values: list[float]) -> str:
        return f"{statistics.median(values):.3g}" if values else "-"

    return (
        f"{name}: flat steps {len(flat)} of {len(shares)} ({len(flat) / max(1, len(shares)):.1%}), flat curves "
        f"{statistics.fmean(shares) if shares else 0.0:.1%} (by reference: {refs}); median decoder gradient norm "
        f"{median(flat)} on flat steps, {median(other)} on the others"
    )


def border_shares(maps: torch.Tensor, band: int, top: float = 0.1) -> tuple[float, float, float]:
    """``(area, mass, top)`` shares of the outer ``band`` pixel rows and columns of maps (N, H, W): the band's
    share of the pixels, of the positive map mass (maps standardised per image) and of each map's top ``top``
    fraction of pixels (what deletion removes first); a map without a border preference has all three equal."""
    maps = maps.float()
    edge = torch.ones(maps.shape[-2:], dtype=torch.bool)
    edge[band:-band, band:-band] = False
    z = (maps - maps.mean(dim=(1, 2), keepdim=True)) / maps.std(dim=(1, 2), keepdim=True).clamp_min(1e-12)
    pos = z.clamp_min(0)
    mass = float((pos[:, edge].sum(1) / pos.flatten(1).sum(1).clamp_min(1e-12)).mean())
    k = max(1, round(top * edge.numel()))
    idx = z.flatten(1).topk(k, dim=1).indices
    top_share = float(edge.flatten()[idx].float().mean())
    return float(edge.float().mean()), mass, top_share


def replicate_padded(aha: AHA) -> AHA:
    """A copy of ``aha`` whose decoder convolutions pad by replicating the edge instead of with zeros (the trained
    weights unchanged): a probe of how much of the border mass the zero padding draws."""
    probe = aha.with_options()
    probe.decoder = copy.deepcopy(aha.decoder)
    for module in probe.decoder.modules():
        if isinstance(module, torch.nn.Conv2d) and module.padding != (0, 0):
            module.padding_mode = "replicate"
    return probe


def times_distance(aha: AHA):
    """``fn(x, target)``: AHA's T=0 map shifted to be non-negative, times each pixel's distance ``|x - r|`` (over the
    channels) from the mean-colour reference: a post-hoc, untrained probe of the sub-cell order ``x·(x−r)``
    rankings exploit (pixels near the reference change nothing when deleted, so they go last)."""
    explainer = get_explainer("aha", aha.classifier, aha=aha)

    def explain(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        maps = explainer.attribute(x, target)
        shifted = maps - maps.flatten(1).min(dim=1).values[:, None, None]
        return shifted * (x - aha.classifier.norm_mean.view(1, -1, 1, 1)).norm(dim=1)

    return explain


def variant_folder(args: argparse.Namespace, budget, name: str) -> Path | None:
    """Where a family's trained variant ``name`` is cached (None without ``--cache``)."""
    if args.cache is None:
        return None
    key = f"{args.data}_{args.kind}_{args.img}px_seed{args.seed}_{budget.n_train}x{budget.epochs}"
    return args.cache / "ablations" / key / name.replace(" ", "_").replace("+", "-")


_TEMPORARY_TEACHERS: dict[int, Path] = {}


def teacher_maps(args: argparse.Namespace, budget, aha: AHA, train_set, steps: int) -> TeacherMaps:
    """The default AHA's per-image optimum over the training set (``steps`` Adam steps each), computed once into
    the cache (or a temporary folder without ``--cache``) and resumed there if a run stops half-way."""
    folder = variant_folder(args, budget, f"teacher maps {steps}")
    if folder is None:  # one temporary folder per run and budget, so the rows share one computation
        folder = _TEMPORARY_TEACHERS.setdefault(steps, Path(tempfile.mkdtemp(prefix="teacher-")))
    start = time.perf_counter()
    compute_teacher_maps(aha, train_set, folder, steps=steps, chunk=32, progress=False)
    print(f"[{args.kind}] teacher maps: {len(train_set)} images, {steps} steps, {time.perf_counter() - start:.0f} s "
          f"(0 if cached) in {folder}", flush=True)  # fmt: skip
    return TeacherMaps.load(folder, len(train_set))


def _pooled(maps: torch.Tensor, grid: int) -> torch.Tensor:
    """Each (B, H, W) map's mean over each cell of the training's ``grid`` x ``grid`` partition
    (:func:`~attr_engine_kernels.region.cell_index`, no offset), at its own size: a map that keeps only the cells'
    order, and whose fine part ``maps - _pooled(maps, grid)`` averages to zero in every cell."""
    rows, cols = (cell_index(n, grid).to(maps.device) for n in maps.shape[-2:])
    cells = kernels.region_pool(maps.float(), grid).reshape(len(maps), grid, grid)
    return cells[:, rows][:, :, cols]


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over images of the Pearson correlation (:func:`~attr_engine.metrics.pearson_similarity`) of two
    (B, H, W) maps, ``a`` brought to ``b``'s size."""
    if a.shape[-2:] != b.shape[-2:]:
        a = torch.nn.functional.interpolate(a[:, None], size=b.shape[-2:], mode="bilinear", align_corners=False)[:, 0]
    return pearson_similarity(a.flatten(1), b.flatten(1)).mean().item()


def _class_token_attention(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The class token's attention to the patches in a timm ViT's last block, mean over heads: (B, h, w); None
    for a model without one. Recomputed from the block's input with its own qkv weights (timm's fused attention
    never forms the weights)."""
    from timm.models.vision_transformer import Block

    blocks, prefix = getattr(model, "blocks", None), getattr(model, "num_prefix_tokens", 0)
    if blocks is None or not prefix or type(blocks[-1]) is not Block:  # a pre-norm block: attn(norm1(x))
        return None
    block, seen = blocks[-1], []
    handle = block.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0]))
    try:
        model(x)
    finally:
        handle.remove()
    attn, tokens = block.attn, block.norm1(seen[0])
    b, n = tokens.shape[:2]
    qkv = attn.qkv(tokens).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k = attn.q_norm(qkv[0]), attn.k_norm(qkv[1])
    weights = (q[:, :, :1] @ k.transpose(-2, -1) * attn.scale).softmax(dim=-1)[:, :, 0, prefix:].mean(dim=1)
    side = round((n - prefix) ** 0.5)
    return weights.reshape(b, side, side)


def sensitivity_notes(classifier, aha: AHA, x: torch.Tensor, target: torch.Tensor, change: torch.Tensor) -> list[str]:
    """How well inputs a decoder could be given predict the teacher's change ``change`` (T - D, (B, H, W)): each
    one's mean Pearson correlation with it. Forward-only: the head's score at the deepest tap of its width
    (``head_input``'s channel), the class token's attention (ViTs), ``|x - r|``; with a backward pass: gradient x
    (x - r), the first-order change of the target's logit (r the mean colour). (D's own correlation with the change
    follows from corr(T, D) alone, for z-scored maps: -sqrt((1 - rho) / 2).)"""
    mean = classifier.norm_mean.to(x.device).reshape(1, -1, 1, 1)
    signals: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        feats = aha.backbone(x)
        weight = classifier_head_weight(classifier.model, classifier.num_classes)
        level = head_level([f.shape[1] for f in feats], weight)
        signals["head score at the deepest tap"] = torch.einsum("bchw,bc->bhw", feats[level], weight[target])
        attention = _class_token_attention(classifier.model, classifier.normalize(x))
        if attention is not None:
            signals["class-token attention, last block"] = attention
        signals["|x - r|"] = (x - mean).abs().sum(dim=1)
    xg = x.clone().requires_grad_(True)
    classifier(xg).gather(1, target[:, None]).sum().backward()
    signals["gradient x (x - r) (one backward pass)"] = (xg.grad * (x - mean)).sum(dim=1)
    return ["correlation with T - D: " + ", ".join(f"{name} {_pearson(m, change):+.3f}" for name, m in signals.items())]


def teacher_detail(args: argparse.Namespace, classifier, aha: AHA, test_set, budget, acc: float) -> Leaderboard:
    """Where the teacher's lead over the one-pass map lives, on the first ``args.teacher_detail`` test images.

    The teacher T is the per-image optimum the teacher family teaches (``TEACHER_STEPS`` Adam steps from the
    default's map D, rate 0.05, both z-scored per image). Rows split each map into its coarse part (the mean over
    a g x g partition, g the two ends of the training's grids) and its fine part (the rest) and swap them: "T
    coarse + D fine" scores what a student that learned the teacher's cell order alone would reach; "D coarse + T
    fine" what the fine detail alone is worth. Also the teacher blurred, half-way from D to T, and the change
    T - D alone as a map. The notes give the change's size and its correlation with what a decoder could be given
    (:func:`sensitivity_notes`).
    """
    data = tuple(t[: args.teacher_detail] for t in test_set.tensors())
    x = data[0]
    log = lambda line: print(f"[{args.kind}] {line}", flush=True)
    target = predicted(classifier, x)
    with torch.no_grad():
        default = standardise_maps(torch.cat([aha(c, t) for c, t in zip(x.split(32), target.split(32), strict=True)]))
    start = time.perf_counter()
    rows_of = optimum_rows(aha, x, [TEACHER_STEPS], 0.05, args.seed, log, target)
    teacher = standardise_maps(rows_of[f"optimum s={TEACHER_STEPS}"].maps_of(x))
    seconds = time.perf_counter() - start
    rows = {"default (D)": default, f"teacher s={TEACHER_STEPS} (T)": teacher}
    for g in sorted(set(aha.config.grid_range or grid_rule(*x.shape[-2:]))):
        rows[f"T coarse + D fine, g={g}"] = _pooled(teacher, g) + default - _pooled(default, g)
        rows[f"D coarse + T fine, g={g}"] = _pooled(default, g) + teacher - _pooled(teacher, g)
    rows["T blurred (sigma 1 px)"] = gaussian_blur(teacher[:, None], 5, 1.0)[:, 0]
    rows["D + (T - D) / 2"] = default + (teacher - default) / 2
    rows["T - D"] = teacher - default
    methods: dict[str, object] = {name: _Precomputed(x, maps) for name, maps in rows.items()}
    methods["PA"] = get_explainer("pullback-ascent", classifier)
    board = evaluate(
        classifier, methods, data, ["deletion", "insertion"], batch_size=16, seed=args.seed,
        title=f"{args.kind} on {args.data} ({acc:.0%} accuracy), first {len(x)} of {budget.n_test} test images at "
        f"{args.img} px: where the teacher's lead lives", log=log, extra_rankings=True,
    )  # fmt: skip
    change = (teacher - default).abs().mean().item()
    corr = _pearson(teacher, default)
    board.notes += sensitivity_notes(classifier, aha, x, target, teacher - default)
    board.notes += [
        f"T: AHA.optimise_maps, {TEACHER_STEPS} Adam steps at lr 0.05 from D ({seconds:.0f} s for {len(x)} images; "
        "every precomputed row's ms/image column is a table look-up); maps z-scored per image",
        f"mean |T - D| {change:.3f} standard deviations per pixel; mean Pearson correlation of T and D {corr:.3f}",
        "composite (insertion - deletion): " + ", ".join(f"{m} {v:.3f}" for m, v in composite(board).items()),
    ]
    return board


def gap(args: argparse.Namespace, classifier, aha: AHA, test_set, budget, acc: float) -> Leaderboard:
    """The gap split (issue #31, item 1) on the first ``args.gap`` test images; see the module docstring."""
    # Shapes carry masks: their localisation columns (the energy pointing game, mask IoU) ride along.
    data = tuple(t[: args.gap] for t in test_set.tensors())
    x = data[0]
    metrics = ["deletion", "insertion"] + (["energy_pointing_game", "mask_iou"] if len(data) == 3 else [])
    log = lambda line: print(f"[{args.kind}] {line}", flush=True)
    start = time.perf_counter()
    methods: dict[str, object] = {"AHA (T=0)": get_explainer("aha", classifier, aha=aha)}
    for name, (steps, overrides) in REFINEMENTS.items():
        variant = aha.with_options()
        if overrides.get("refine_grid_range") == "training":
            overrides = {**overrides, "refine_grid_range": aha.config.grid_range}
        variant.config = dataclasses.replace(aha.config, **overrides)
        methods[name] = get_explainer("aha", classifier, aha=variant, refine_steps=steps, seed=args.seed)
    methods.update(optimum_rows(aha, x, args.gap_steps, args.gap_lr, args.seed, log))
    seconds = time.perf_counter() - start
    methods["AHA (T=0), decoder replicate-padded"] = get_explainer("aha", classifier, aha=replicate_padded(aha))
    methods["AHA (T=0) x |x-r|"] = times_distance(aha)
    methods["IG-50"] = get_explainer("integrated-gradients", classifier, n_steps=budget.ig_steps)
    methods["SfP"] = get_explainer("pullback-soft", classifier)
    methods["PA"] = get_explainer("pullback-ascent", classifier)
    of = f" of AHA {args.gap_variant!r}" if args.gap_variant else ""
    board = evaluate(
        classifier, methods, data, metrics, batch_size=16, seed=args.seed,
        title=f"{args.kind} on {args.data} ({acc:.0%} accuracy), first {len(x)} of {budget.n_test} test images at "
        f"{args.img} px: gap split{of}", log=log, extra_rankings=True, keep=len(x),
    )  # fmt: skip
    scores = composite(board)
    optimum = max((m for m in scores if m.startswith("optimum")), key=scores.get)
    peers = {m: v for m, v in scores.items() if not m.startswith(("AHA", "optimum"))}
    peer = max(peers, key=peers.get)
    board.notes += [
        f"optimum: AHA.optimise_maps, {max(args.gap_steps)} Adam steps at lr {args.gap_lr} ({seconds:.0f} s for "
        f"{len(x)} images; its ms/image column is a table look-up), grids {aha.config.grid_range}, "
        f"{aha.config.n_fractions} fractions, tau {aha.config.tau_end}, mean-colour reference",
        "composite (insertion - deletion): " + ", ".join(f"{m} {v:.3f}" for m, v in scores.items()),
        f"amortization gap (best optimum row {optimum} - T=0): {scores[optimum] - scores['AHA (T=0)']:+.3f}; "
        f"objective gap (best peer {peer} - {optimum}): {peers[peer] - scores[optimum]:+.3f}",
    ]
    for band in (2, 4):
        shares = {m: border_shares(maps, band) for m, maps in board.maps.items()}
        area = next(iter(shares.values()))[0]
        board.notes.append(
            f"outer {band} px ({area:.1%} of the pixels), share of positive mass / of the top 10 %: "
            + ", ".join(f"{m} {v[1]:.1%} / {v[2]:.1%}" for m, v in shares.items())
        )
    return board


def run(args: argparse.Namespace) -> Leaderboard:
    budget = (PHOTOS_QUICK if args.quick else PHOTOS_FULL) if args.data == "photos" else (QUICK if args.quick else FULL)
    torch.manual_seed(args.seed)
    classifier, aha, _, acc = train(args.kind, budget, args.seed, print, args.data, args.img, args.cache)
    if args.teacher_detail:
        if args.gap or args.score_reference != "mean":
            raise SystemExit("--teacher-detail scores against the mean colour, alone (no --gap, no --score-reference)")
        _, test_set = datasets(args.data, budget, args.img, args.seed)
        return teacher_detail(args, classifier, aha, test_set, budget, acc)
    if args.gap:
        if args.score_reference != "mean":
            raise SystemExit("--gap scores against the mean colour, the reference of AHA's objective")
        if args.gap_variant:
            # A variant a family run trained and cached (e.g. "pullback input") takes the default AHA's place.
            folder = variant_folder(args, budget, args.gap_variant)
            if folder is None or not folder.is_dir():
                raise SystemExit(f"--gap-variant {args.gap_variant!r}: no cached variant at {folder}; run its family")
            aha = AHA.load(folder, classifier)
        _, test_set = datasets(args.data, budget, args.img, args.seed)
        return gap(args, classifier, aha, test_set, budget, acc)
    levels = len(aha.backbone.indices)
    base = AHAConfig(n_fractions=8, targets="pred", seed=args.seed)  # the leaderboard's (bench_leaderboard.train)
    # The leaderboard's train and test sets; --n-test takes more images of the same test distribution.
    train_set, test_set = datasets(args.data, dataclasses.replace(budget, n_test=args.n_test or budget.n_test),
                                   args.img, args.seed)  # fmt: skip
    methods: dict[str, Explainer] = {"default": get_explainer("aha", classifier, aha=aha)}
    notes = [f"default: the leaderboard's AHA, {budget.aha_steps} steps of 8, taps {aha.backbone.indices}"]
    trained: dict[str, AHA] = {"default": aha}
    teachers: dict[int, TeacherMaps] = {}
    subsets: dict[str, int] = {}  # rows trained on the first N training images alone
    rows = [row for family in args.family for row in variants(family, args.kind, args.img, levels).items()]
    if unknown := [name for name in args.only if name not in dict(rows)]:
        raise SystemExit(f"--only names no row of {args.family}: {unknown}; the rows: {sorted(dict(rows))}")
    for name, overrides in rows:
        if args.only and name not in args.only:
            continue
        factor = overrides.pop("_steps_factor", 1)
        teacher_steps = overrides.pop("_teacher_steps", None)
        images = overrides.pop("_images", None)
        val = validation_set(args.data, args.img, args.seed) if overrides.pop("_val", False) else None
        config = dataclasses.replace(base, **overrides)
        steps = round(budget.aha_steps * factor)
        # Each trained variant is kept beside the leaderboard's cache entry, so a later run (another family,
        # or one stopped half-way) reuses it.
        folder = variant_folder(args, budget, name)
        if teacher_steps and teacher_steps not in teachers:  # computed once into the cache, before the row's clock
            teachers[teacher_steps] = teacher_maps(args, budget, aha, train_set, teacher_steps)
        start = time.perf_counter()
        history: dict = {}
        if folder is not None and folder.is_dir():
            variant = AHA.load(folder, classifier)
            if (folder / "history.json").is_file():
                history = json.loads((folder / "history.json").read_text())
            print(f"[{args.kind}] {name}: loaded from {folder}", flush=True)
        else:
            variant = AHA(classifier, config)
            teacher = teachers[teacher_steps] if teacher_steps else None
            data = train_set
            if images:  # the first `images` training images alone, and their teacher maps
                data = torch.utils.data.Subset(train_set, range(images))
                if teacher is not None:
                    teacher = TeacherMaps(teacher.maps[:images], teacher.targets[:images], teacher.settings)
            fitted = variant.fit(data, batch_size=TRAIN_BATCH, epochs=10**6, max_steps=steps, progress=False,
                                 val=val, teacher=teacher)  # fmt: skip
            history = {**{k: v for k, v in fitted.items() if "val" in k}, "flat": flat_record(fitted),
                       "train_seconds": time.perf_counter() - start}  # fmt: skip
            if folder is not None:
                variant.save(folder)
                (folder / "history.json").write_text(json.dumps(history))
        seconds = time.perf_counter() - start
        print(f"[{args.kind}] {name}: {variant.steps_trained} steps in {seconds:.0f} s", flush=True)
        methods[name] = get_explainer("aha", classifier, aha=variant)
        trained[name] = variant
        if images:
            subsets[name] = images
        notes.append(f"{name}: {overrides or ''} {steps} steps ({seconds:.0f} s)".replace("  ", " "))
        if history.get("val_step"):
            notes.append(stopping_note(name, history, variant.steps_trained, steps))
        if history.get("train_seconds"):  # the training's own time (validation included), also for a cached row
            seen = variant.steps_trained * TRAIN_BATCH
            notes.append(f"{name}: {seen} training images seen, {seen / history['train_seconds']:.1f} images/s")
        if "reference_draw" in overrides:
            notes.append(flat_note(name, history["flat"]) if "flat" in history else f"{name}: no step record kept")
    if "curve" in args.family:
        notes.append(training_step_flops(classifier, base, train_set))
    log = lambda line: print(f"[{args.kind}] {line}", flush=True)
    if teachers:
        optimum, fit = teacher_rows(args, aha, teachers, trained, train_set, test_set, log, subsets)
        methods |= optimum
        notes += fit
    options = {"integrated-gradients": {"n_steps": budget.ig_steps}}
    for name in PEERS:
        methods[name] = get_explainer(name, classifier, **options.get(name, {}))
    # --score-reference: deletion and insertion against that reference (the x·(x−r) rows keep r = the mean colour).
    ref = {"reference": args.score_reference}
    metrics = {"deletion": ref, "insertion": ref}
    if args.data != "photos":
        metrics |= {"energy_pointing_game": {}, "mask_iou": {}}
    board = evaluate(
        classifier,
        methods,
        test_set,
        metrics,
        batch_size=16,
        seed=args.seed,
        title=f"{args.kind} on {args.data} ({acc:.0%} accuracy), {len(test_set)} images at {args.img} px: ablations"
        f" (scored against the {args.score_reference} reference)",
        log=log,
        extra_rankings=True,
    )
    board.notes.extend(notes)
    scores = composite(board)
    board.notes.append("composite (insertion - deletion): " + ", ".join(f"{m} {v:.3f}" for m, v in scores.items()))
    return board


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", choices=("shapes", "photos"), default="photos")
    parser.add_argument("--kind", choices=("vit", "resnet", "tv-resnet"), default="resnet")
    parser.add_argument("--img", type=int, default=64)
    parser.add_argument("--family", default=",".join(FAMILIES), help=f"comma-separated, from {FAMILIES}")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="ROW",
        help="train and score only this row of the families (repeatable), e.g. 'pullback input, skip'",
    )
    parser.add_argument("--n-test", type=int, default=None, help="held-out images (default: the leaderboard's)")
    refs = ("mean", "black", "blur")
    parser.add_argument("--score-reference", choices=refs, default="mean", help="deletion / insertion reference")
    parser.add_argument("--gap", type=int, default=0, help="the gap split on the first N test images (issue #31)")
    parser.add_argument("--teacher-detail", type=int, default=0, metavar="N",
                        help="where the teacher's lead lives, on the first N test images")  # fmt: skip
    parser.add_argument("--gap-steps", default="0,3,10,30,100", help="optimum steps scored (comma-separated)")
    parser.add_argument("--gap-lr", type=float, default=0.05, help="the optimum's Adam step size")
    parser.add_argument("--gap-variant", default=None, help="a cached family row (e.g. 'pullback input') as AHA")
    parser.add_argument("--quick", action="store_true", help="the leaderboard's smoke budget")
    parser.add_argument("--cache", type=Path, default=None, help="the leaderboard's cache of trained models")
    parser.add_argument("--out", type=Path, default=Path("reports/ablate"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    args.family = [f.strip() for f in args.family.split(",") if f.strip()]
    args.gap_steps = sorted({int(s) for s in args.gap_steps.split(",")})
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    board = run(args)
    text = leaderboard_markdown(board)
    print(text)
    variant = f"_{args.gap_variant.replace(' ', '_')}" if args.gap and args.gap_variant else ""
    stem = (
        "teacher_detail"
        if args.teacher_detail
        else f"gap{variant}"
        if args.gap
        else "ablate" + ("" if args.score_reference == "mean" else f"_{args.score_reference}")
    )
    path = write_markdown(text, args.out / f"{stem}_{args.data}_{args.kind}_{args.img}px.md")
    print(f"wrote {path}; total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
