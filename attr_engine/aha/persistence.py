"""Where an AHA checkpoint lives on disk and how it is written and read: file names, the training-directory layout
and the checked save / load of the decoder weights with their config.

Both :mod:`attr_engine.aha.model` (``AHA.save`` / ``AHA.load``) and :mod:`attr_engine.aha.trainer` (training
checkpoints) use this module; it imports neither of them, so the two do not import each other.

Layout: ``AHA.save(path)`` writes ``path/explainer.safetensors`` (decoder weights) and ``path/config.json``
(config and provenance). A training output directory ``OUT`` holds whole checkpoints in
``OUT/checkpoints/step-<8 digits>/`` and an ``OUT/config.json`` whose ``checkpoint`` key points at the current one.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from attr_engine.checkpoint import load_json, load_safetensors, save_json, save_safetensors
from attr_engine.classifier import Classifier

__all__ = [
    "CHECKPOINTS_DIR",
    "CONFIG_FILE",
    "FORMAT",
    "POINTER_KEY",
    "WEIGHTS_FILE",
    "checkpoint_dir",
    "classifier_fingerprint",
    "read_checkpoint",
    "step_dirs",
    "write_checkpoint",
]

FORMAT = "attr_engine.aha/1"
WEIGHTS_FILE = "explainer.safetensors"
CONFIG_FILE = "config.json"
# Training checkpoints: OUT/checkpoints/step-<8 digits>/ each hold a whole checkpoint; OUT/config.json points at one.
CHECKPOINTS_DIR = "checkpoints"
POINTER_KEY = "checkpoint"
_STEP_DIR = re.compile(r"step-(\d{8,})")


def step_dirs(path: str | os.PathLike[str]) -> list[Path]:
    """Training checkpoint directories ``path/checkpoints/step-N`` that hold weights and a config, newest first.

    A step directory is written under a temporary name and renamed into place whole, so one that exists is complete
    unless its files were damaged afterwards (callers that load it still check).
    """
    root = Path(path) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        match = _STEP_DIR.fullmatch(d.name)
        if match and d.is_dir() and (d / WEIGHTS_FILE).is_file() and (d / CONFIG_FILE).is_file():
            found.append((int(match.group(1)), d))
    return [d for _, d in sorted(found, reverse=True)]


def checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    """The directory whose weights :meth:`AHA.load` reads for ``path``.

    ``path`` is either what :meth:`AHA.save` wrote (weights and config side by side) or a training output directory,
    whose ``config.json`` names the current step directory (the pointer, switched last). A pointer to a missing or
    incomplete step directory falls back to the newest complete one.

    Raises:
        FileNotFoundError: ``path`` holds no checkpoint.
        ValueError: the pointer is not a step directory under ``path/checkpoints`` (a checkpoint may only point
            inside itself).
    """
    src = Path(path)
    if not src.is_dir():
        raise FileNotFoundError(f"AHA checkpoint directory not found: {src}")
    top = src / CONFIG_FILE
    pointer = None
    if top.is_file():
        meta = load_json(top)
        pointer = meta.get(POINTER_KEY) if isinstance(meta, dict) else None
        if pointer is None and (src / WEIGHTS_FILE).is_file():
            return src
    if pointer is not None:
        parts = Path(pointer).parts if isinstance(pointer, str) else ()
        if len(parts) != 2 or parts[0] != CHECKPOINTS_DIR or not _STEP_DIR.fullmatch(parts[1]):
            raise ValueError(f"{top}: {POINTER_KEY!r} must name a {CHECKPOINTS_DIR}/step-N directory, got {pointer!r}")
        target = src / pointer
        if (target / WEIGHTS_FILE).is_file() and (target / CONFIG_FILE).is_file():
            return target
    newest = step_dirs(src)
    if newest:
        return newest[0]
    raise FileNotFoundError(f"no AHA checkpoint in {src} (no {CONFIG_FILE} with {WEIGHTS_FILE}, no {CHECKPOINTS_DIR}/)")


def classifier_fingerprint(classifier: Classifier) -> str:
    """A short hash of the classifier's architecture and weights: a checkpoint records the one it was trained for.

    Parameter names, shapes and per-tensor float64 sums (rounded, so the same weights on another device or after a
    save/load round trip give the same hash) identify a model without hashing every byte.
    """
    digest = hashlib.sha256()
    for name, value in classifier.model.state_dict().items():
        digest.update(name.encode())
        digest.update(str(tuple(value.shape)).encode())
        if value.is_floating_point() and value.numel():
            v = value.detach().double()
            digest.update(f"{v.sum().item():.6e}/{v.abs().sum().item():.6e}".encode())
    return digest.hexdigest()[:16]


def write_checkpoint(path: str | os.PathLike[str], weights: Mapping[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write decoder ``weights`` and their metadata ``meta`` (format, classifier fingerprint, steps, config) to
    directory ``path``: :data:`WEIGHTS_FILE` + :data:`CONFIG_FILE`.

    Each file is written atomically, the weights first, so a crash never leaves a config pointing at missing weights.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(
        dict(weights),
        out / WEIGHTS_FILE,
        {"format": FORMAT, "classifier": meta["classifier"], "steps_trained": str(meta["steps_trained"])},
    )
    save_json(meta, out / CONFIG_FILE)
    return out


def read_checkpoint(
    path: str | os.PathLike[str], classifier: Classifier
) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor]]:
    """Read and check the checkpoint for ``path`` (a saved explainer or a training directory, see
    :func:`checkpoint_dir`) for ``classifier``.

    Returns:
        ``(directory read, metadata, decoder weights on the classifier's device)``; the metadata's ``config`` has
        its JSON lists turned back into tuples.

    Raises:
        FileNotFoundError: the directory or one of its files is missing.
        ValueError: the files are corrupt, of another format, inconsistent with each other, or were made for
            a different classifier.
    """
    src = checkpoint_dir(path)
    meta = load_json(src / CONFIG_FILE)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{src / CONFIG_FILE} is not an AHA checkpoint config (format {FORMAT})")
    state, weights_meta = load_safetensors(src / WEIGHTS_FILE, device=classifier.norm_mean.device)
    steps = str(meta.get("steps_trained", 0))
    same_step = weights_meta.get("steps_trained", steps) == steps
    if weights_meta.get("classifier") != meta.get("classifier") or not same_step:
        raise ValueError(f"{src}: weights and config belong to different checkpoints (torn write?)")
    expected = classifier_fingerprint(classifier)
    if meta["classifier"] != expected:
        raise ValueError(
            f"{src} was trained for another classifier (fingerprint {meta['classifier']}, this one is {expected})"
        )
    if isinstance(meta.get("config"), dict):
        # JSON turns tuples into lists; the config's tuple fields are restored so equality and hashing behave.
        meta["config"] = {k: tuple(v) if isinstance(v, list) else v for k, v in meta["config"].items()}
    return src, meta, state
