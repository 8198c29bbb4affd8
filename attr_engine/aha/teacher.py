"""AHA's teacher: each training image's per-image optimum, computed once and stored, and the loss that teaches it.

The per-image optimum of AHA's objective (:meth:`attr_engine.aha.model.AHA.optimise_maps`: free maps descended on
the image's own soft deletion / insertion) ranks the pixels better than the one-pass decoder does; the difference
is the amortization gap. Training the decoder on that optimum's ranking as well as on the soft AUCs (a noisy
per-example target, as in FastSHAP or Covert et al.'s stochastic amortization) is the teacher-student phase:

1. :func:`compute_teacher_maps` runs the optimum on a map-style dataset, one chunk of ``chunk`` consecutive items
   at a time, and writes each chunk as its own safetensors part (``teacher-<start>-<stop>.safetensors``, written
   atomically, the settings in its metadata). A killed run resumes where it stopped (finished parts are kept) and
   ``rank`` / ``world`` split the chunks between processes, which may write into one folder;
   :func:`compute_teacher_part` is one chunk, the unit :func:`attr_engine.ray.compute_teacher_maps_ray` hands to
   the actors of a Ray Data pool.
2. :meth:`TeacherMaps.load` reads the parts back for a dataset of ``count`` items: every index covered once, every
   part of the same settings and size.
3. ``fit(..., teacher=maps)`` with ``AHAConfig.teacher_weight`` > 0 adds ``teacher_weight`` x
   :func:`teacher_loss` on the predicted class's maps to each step's soft-AUC loss: the region scores' ranking
   (:func:`teacher_ranking_loss`) or the maps pixel by pixel (:func:`teacher_pixel_loss`).

The stored maps are the optimum's standardised maps in float16 ((N, H, W), 2 bytes a pixel): only their order
within an image is used, and float16 keeps three significant digits of a z-score.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
from tqdm.auto import tqdm

import attr_engine_kernels as kernels
from attr_engine._training import collate_images_labels
from attr_engine.aha.config import TEACHER_LOSSES, AHAConfig
from attr_engine.aha.loss import standardise
from attr_engine.checkpoint import load_safetensors, save_safetensors
from attr_engine.classifier import Classifier
from attr_engine_kernels.validate import check_int_at_least, check_positive

__all__ = [
    "TEACHER_PART",
    "TeacherMaps",
    "compute_teacher_maps",
    "compute_teacher_part",
    "teacher_chunks",
    "teacher_loss",
    "teacher_pixel_loss",
    "teacher_ranking_loss",
]

# A part's file name: the dataset indices [start, stop) it holds, zero-padded so the names sort by index.
TEACHER_PART = "teacher-{start:09d}-{stop:09d}.safetensors"
_PART_NAME = re.compile(r"teacher-(\d{9})-(\d{9})\.safetensors")
# The settings each part records (its safetensors metadata): parts made with other settings are not mixed.
_SETTINGS = ("steps", "lr", "seed", "chunk")


class Optimiser(Protocol):
    """What :func:`compute_teacher_maps` needs of an explainer (:class:`attr_engine.aha.model.AHA` has it)."""

    config: AHAConfig
    classifier: Classifier

    @property
    def device(self) -> torch.device: ...

    def optimise_maps(
        self, x: torch.Tensor, target: torch.Tensor | None = None, *, steps: int, lr: float, seed: int | None
    ) -> dict[int, torch.Tensor]: ...


def compute_teacher_maps(
    aha: Optimiser,
    data: Dataset,
    out: str | os.PathLike[str],
    *,
    steps: int = 30,
    lr: float = 0.05,
    chunk: int = 16,
    rank: int = 0,
    world: int = 1,
    progress: bool = True,
) -> list[Path]:
    """Compute and store the per-image optimum of every item of ``data`` this ``rank`` owns.

    Args:
        aha: the explainer whose objective is optimised (its one-pass maps are the starting point, so a trained
            explainer needs fewer ``steps``).
        data: a map-style Dataset of ``(image (3, H, W) in [0, 1], label, ...)`` items of one size, the one
            training will use (the teacher is looked up by dataset index).
        out: the folder of the parts (created; parts already there with these settings are kept).
        steps, lr: :meth:`~attr_engine.aha.model.AHA.optimise_maps`'s Adam steps (at least 1: no step would teach
            the decoder its own maps) and step size.
        chunk: items per part (and per optimise_maps call): chunk ``k`` holds indices ``[k * chunk, (k + 1) *
            chunk)`` and draws its grids from ``config.seed + k``, so the maps do not depend on ``world``.
        rank, world: this process computes the chunks ``k`` with ``k % world == rank``.
        progress: a tqdm bar over this rank's chunks.

    Returns:
        The paths of this rank's parts, in index order.
    """
    check_int_at_least(steps, "steps", 1)
    check_positive(lr, "lr")
    check_int_at_least(world, "world", 1)
    if not 0 <= check_int_at_least(rank, "rank", 0) < world:
        raise ValueError(f"rank must be in [0, world={world}), got {rank}")
    mine = [k for k in range(teacher_chunks(data, chunk)) if k % world == rank]
    return [
        compute_teacher_part(aha, data, out, k, steps=steps, lr=lr, chunk=chunk)[0]
        for k in tqdm(mine, desc="teacher", disable=not progress, dynamic_ncols=True)
    ]


def teacher_chunks(data: Dataset, chunk: int) -> int:
    """The number of parts (chunks of ``chunk`` consecutive items) of ``data``'s teacher maps (at least 1)."""
    check_int_at_least(chunk, "chunk", 1)
    count = len(data)  # type: ignore[arg-type]
    if count == 0:
        raise ValueError("data is empty: there is no image to compute a teacher map for")
    return (count + chunk - 1) // chunk


def compute_teacher_part(
    aha: Optimiser,
    data: Dataset,
    out: str | os.PathLike[str],
    k: int,
    *,
    steps: int = 30,
    lr: float = 0.05,
    chunk: int = 16,
) -> tuple[Path, bool]:
    """Compute and store chunk ``k`` of ``data``'s teacher maps (items ``[k * chunk, (k + 1) * chunk)``), unless a
    part of these settings is there already: the unit of work :func:`compute_teacher_maps` (one process, or one
    torchrun rank) and :func:`attr_engine.ray.compute_teacher_maps_ray` (a Ray actor) hand out.

    Returns:
        The part's path, and whether it was computed now (False: an earlier run had written it).
    """
    check_int_at_least(steps, "steps", 1)
    check_positive(lr, "lr")
    chunks = teacher_chunks(data, chunk)
    if not 0 <= k < chunks:
        raise ValueError(f"chunk index must be in [0, {chunks}) for {len(data)} items of {chunk}, got {k}")  # type: ignore[arg-type]
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    settings = {"steps": str(steps), "lr": repr(float(lr)), "seed": str(aha.config.seed), "chunk": str(chunk)}
    start, stop = k * chunk, min(len(data), (k + 1) * chunk)  # type: ignore[arg-type]
    path = folder / TEACHER_PART.format(start=start, stop=stop)
    if path.exists() and _part_settings(path) == settings:
        return path, False  # written by an earlier (interrupted) run
    x, _ = collate_images_labels([data[i] for i in range(start, stop)])
    with torch.no_grad():
        target = aha.classifier(x.to(aha.device)).argmax(dim=1)
    maps = aha.optimise_maps(x, target, steps=steps, lr=lr, seed=aha.config.seed + k)[steps]
    save_safetensors({"maps": maps.to(torch.float16), "targets": target.long()}, path, metadata=settings)
    return path, True


def _part_settings(path: Path) -> dict[str, str]:
    _, meta = load_safetensors(path)
    return {k: meta.get(k, "") for k in _SETTINGS}


@dataclass(frozen=True)
class TeacherMaps:
    """The teacher maps of a whole dataset, by dataset index.

    Attributes:
        maps: (N, H, W) float16, each image's optimum map (standardised; only its order is used).
        targets: (N,) int64, the class each map explains (the classifier's prediction).
        settings: the optimum's settings the parts recorded (``steps``, ``lr``, ``seed``, ``chunk``).
    """

    maps: torch.Tensor
    targets: torch.Tensor
    settings: dict[str, str]

    @classmethod
    def load(cls, folder: str | os.PathLike[str], count: int) -> TeacherMaps:
        """Read the parts in ``folder`` for a dataset of ``count`` items.

        Raises:
            ValueError: naming the problem: no parts, an index covered twice or not at all (a rank that has not
                finished), parts of different settings or map sizes, or a part whose tensors do not match its name.
        """
        check_int_at_least(count, "count", 1)
        root = Path(folder)
        names = sorted(p for p in root.glob("teacher-*.safetensors") if _PART_NAME.fullmatch(p.name))
        if not names:
            raise ValueError(f"no teacher parts ({TEACHER_PART.format(start=0, stop=0)} ...) in {root}")
        spans = [(int(m[1]), int(m[2]), p) for p in names if (m := _PART_NAME.fullmatch(p.name))]
        maps: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        settings: dict[str, str] | None = None
        expected = 0
        for start, stop, path in spans:
            if start != expected:
                what = "missing" if start > expected else "covered twice"
                raise ValueError(f"teacher parts in {root}: indices from {min(start, expected)} are {what} (next "
                                 f"part {path.name}); finish every rank's compute_teacher_maps first")  # fmt: skip
            tensors, meta = load_safetensors(path, finite=True)
            got = {k: meta.get(k, "") for k in _SETTINGS}
            if settings is not None and got != settings:
                raise ValueError(f"teacher part {path.name} was made with {got}, the others with {settings}")
            part_maps, part_targets = tensors.get("maps"), tensors.get("targets")
            if part_maps is None or part_targets is None or part_maps.ndim != 3 or len(part_maps) != stop - start:
                raise ValueError(f"teacher part {path.name} does not hold maps (n, H, W) and targets of its span")
            if maps and part_maps.shape[1:] != maps[0].shape[1:]:
                raise ValueError(f"teacher part {path.name} holds {tuple(part_maps.shape[1:])} maps, the others "
                                 f"{tuple(maps[0].shape[1:])}")  # fmt: skip
            settings, expected = got, stop
            maps.append(part_maps.to(torch.float16))
            targets.append(part_targets.long())
        if expected < count:
            raise ValueError(f"teacher parts in {root}: indices from {expected} are missing (the dataset has "
                             f"{count}); finish every rank's compute_teacher_maps first")  # fmt: skip
        if expected > count:
            raise ValueError(f"teacher parts in {root} cover indices [0, {expected}), the dataset has {count}")
        assert settings is not None
        return cls(torch.cat(maps), torch.cat(targets), settings)

    def __len__(self) -> int:
        return len(self.maps)

    def batch(self, indices: Sequence[int], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """The maps (B, H, W) float32 and targets (B,) of the dataset items ``indices``, on ``device``."""
        index = torch.as_tensor(list(indices), dtype=torch.long)
        return self.maps[index].to(device, torch.float32), self.targets[index].to(device)


def teacher_ranking_loss(
    maps: torch.Tensor,
    teacher: torch.Tensor,
    grid: int,
    offset: tuple[float, float] = (0.0, 0.0),
) -> torch.Tensor:
    """Listwise ranking loss of the maps' region scores against the teacher's: (B, H, W) each -> (B,).

    Both maps are pooled over the step's ``grid`` x ``grid`` regions (with its sub-cell ``offset``, as the soft-AUC
    loss pools them), the scores z-scored per image, and the loss is ListNet's top-one KL divergence
    ``KL(softmax(z_teacher) || softmax(z_maps))``: 0 when the two z-scored score lists are equal, and it weighs the
    regions the teacher ranks first most, the ones that decide a deletion curve's start. Standardising both sides
    makes it blind to the map's scale and shift, as the ranking is.
    """
    if maps.shape != teacher.shape or maps.ndim != 3:
        raise ValueError(f"maps and teacher must both be (B, H, W), got {tuple(maps.shape)} and {tuple(teacher.shape)}")
    student = standardise(kernels.region_pool(maps.float(), grid, offset).flatten(1), dim=1)
    target = standardise(kernels.region_pool(teacher.float(), grid, offset).flatten(1), dim=1)
    log_p = F.log_softmax(target, dim=1)
    return (log_p.exp() * (log_p - F.log_softmax(student, dim=1))).sum(dim=1)


def teacher_pixel_loss(maps: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean squared difference of the maps and the teacher's, each z-scored over its pixels: (B, H, W) each -> (B,).

    The teacher starts from the one-pass map, and what its descent changes may lie within the regions the
    ranking loss pools over (benches/README.md, "Where the teacher's lead lives"): a pixel-wise difference sees
    such a change, the ranking of region scores does not. Standardising both sides makes it blind to the map's
    scale and shift, as the ranking is: 0 for maps equal up to those, 4 for a reversed map.
    """
    if maps.shape != teacher.shape or maps.ndim != 3:
        raise ValueError(f"maps and teacher must both be (B, H, W), got {tuple(maps.shape)} and {tuple(teacher.shape)}")
    student = standardise(maps.float().flatten(1), dim=1)
    target = standardise(teacher.float().flatten(1), dim=1)
    return (student - target).square().mean(dim=1)


def teacher_loss(
    maps: torch.Tensor,
    teacher: torch.Tensor,
    kind: str,
    grid: int,
    offset: tuple[float, float] = (0.0, 0.0),
) -> torch.Tensor:
    """The teacher's loss ``kind`` (``AHAConfig.teacher_loss``): "ranking" (:func:`teacher_ranking_loss` over the
    step's ``grid`` and ``offset``) or "pixel" (:func:`teacher_pixel_loss`, which takes no grid); (B,)."""
    if kind == "ranking":
        return teacher_ranking_loss(maps, teacher, grid, offset)
    if kind == "pixel":
        return teacher_pixel_loss(maps, teacher)
    raise ValueError(f"the teacher's loss must be one of {TEACHER_LOSSES}, got {kind!r}")
