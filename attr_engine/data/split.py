"""A held-out split of a dataset that depends on the seed and the items' names, never on the order files are listed.

Items are named by their path relative to the dataset's root where the dataset has one (``ImageFolderDataset``:
``samples`` and ``root``), by their index otherwise (``ShapesDataset``, whose item ``i`` is a function of its seed
and ``i``). The names are sorted, a permutation seeded by ``seed`` is drawn over the sorted list, and its first
``round(fraction * N)`` names are held out: the same files and seed give the same split on any machine, in any
directory listing order, on every rank of a distributed run.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from attr_engine_kernels.validate import check_int

__all__ = ["holdout_split", "item_names"]


def item_names(dataset: Any) -> list[str]:
    """One name per item of ``dataset``, in its order: ``root``-relative POSIX paths of ``samples`` where it has
    both, zero-padded indices otherwise."""
    samples, root = getattr(dataset, "samples", None), getattr(dataset, "root", None)
    if samples is not None and root is not None:
        base = Path(root)
        return [Path(path).relative_to(base).as_posix() for path, *_ in samples]
    return [f"{i:012d}" for i in range(len(dataset))]


def holdout_split(dataset: Any, fraction: float, *, seed: int) -> tuple[list[int], list[int]]:
    """Indices ``(kept, held_out)`` of ``dataset`` (each ascending), ``round(fraction * N)`` of them held out.

    Raises:
        ValueError: ``fraction`` not in (0, 1), or a split that would leave either side empty.
    """
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction < 1:
        raise ValueError(f"the validation fraction must be in (0, 1), got {fraction!r}")
    check_int(seed, "seed")
    names = item_names(dataset)
    count = len(names)
    held = math.floor(fraction * count + 0.5)  # halves round up, not to even: 0.5 of 5 items holds out 3
    if held < 1 or held > count - 1:
        raise ValueError(
            f"a validation fraction of {fraction} of {count} item(s) holds out {held}: both the training and the "
            "validation part need at least one"
        )
    by_name = sorted(range(count), key=lambda i: names[i])
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
    held_out = sorted(by_name[j] for j in order[:held])
    chosen = set(held_out)
    return [i for i in range(count) if i not in chosen], held_out
