"""Splitting batch work across the processes ``torchrun`` starts, without a process group.

Batch attribution needs no communication: every process lists the same inputs in the same (sorted) order and takes
its own round-robin share, so the shares are disjoint, cover every input, and differ in size by at most one. Each
process writes only its own outputs. ``torchrun`` sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; outside it the
process is rank 0 of 1. Training (``AHA.fit``) needs a real process group when ``WORLD_SIZE`` > 1 and starts it with
:func:`init_process_group`, which also gives work done before training (the teacher maps) a barrier.

Example (a Ray/Spark-style map over shards needs nothing more)::

    rank, world = process_rank()
    for path in shard(sorted(paths), rank, world):
        ...
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from attr_engine_kernels.validate import check_int_at_least

__all__ = ["init_process_group", "local_device", "process_rank", "shard"]

T = TypeVar("T")


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def process_rank() -> tuple[int, int]:
    """``(rank, world_size)`` of this process from ``RANK`` / ``WORLD_SIZE`` (``(0, 1)`` when they are unset).

    Raises:
        ValueError: non-integer values, ``WORLD_SIZE`` < 1 or ``RANK`` outside ``[0, WORLD_SIZE)``.
    """
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    if world < 1:
        raise ValueError(f"WORLD_SIZE must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"RANK must be in [0, WORLD_SIZE={world}), got {rank}")
    return rank, world


def init_process_group(device: torch.device) -> tuple[int, int]:
    """``(rank, world_size)`` of this process, with the default process group started when ``WORLD_SIZE`` > 1.

    NCCL on CUDA devices, gloo on the CPU; a group already started (by the caller or an earlier call) is kept.
    Outside ``torchrun`` nothing is started and the answer is ``(0, 1)``.
    """
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def shard(items: Sequence[T], rank: int, world: int) -> list[T]:
    """Round-robin share of ``items`` for ``rank`` of ``world``: items ``rank, rank + world, rank + 2 * world, ...``.

    Over all ranks every item appears exactly once. Round-robin rather than contiguous blocks, so an input list
    sorted by class (ImageFolder order) spreads every class, and its cost, over all ranks.
    """
    check_int_at_least(world, "world", 1)
    if check_int_at_least(rank, "rank", 0) >= world:
        raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")
    return list(items[rank::world])


def local_device(device: str = "auto") -> torch.device:
    """Resolve a device name for this process.

    ``"auto"`` picks ``cuda:LOCAL_RANK`` when CUDA is available and the CPU otherwise; a bare ``"cuda"`` also maps to
    ``cuda:LOCAL_RANK``, so ``torchrun --nproc_per_node=N`` puts one process on each GPU. Explicit ``"cuda:I"`` and
    ``"cpu"`` are taken as given.

    Raises:
        ValueError: an unparsable name, or a CUDA device that this machine does not have.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
        index = dev.index if dev.index is not None else _env_int("LOCAL_RANK", 0)
        if index >= torch.cuda.device_count():
            raise ValueError(f"device cuda:{index} requested but only {torch.cuda.device_count()} GPU(s) are visible")
        dev = torch.device("cuda", index)
    return dev
