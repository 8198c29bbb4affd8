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
from typing import TYPE_CHECKING, Any

import timm
import torch

from attr_engine.aha.network import Decoder
from attr_engine.checkpoint import check_state_shapes, load_json, load_safetensors, save_json, save_safetensors
from attr_engine.classifier import MAX_FILE_IMG_SIZE, Classifier, _accepts_img_size, _check_against_weights, file_int

if TYPE_CHECKING:
    from attr_engine.aha.config import AHAConfig

__all__ = [
    "BACKBONE_PREFIX",
    "CHECKPOINTS_DIR",
    "CONFIG_FILE",
    "FORMAT",
    "POINTER_KEY",
    "WEIGHTS_FILE",
    "check_loadable",
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
# A separate backbone's weights are stored beside the decoder's under this prefix (the classifier's own backbone is
# not stored: it comes from the classifier).
BACKBONE_PREFIX = "backbone."
# Upper bounds of the config sizes the stored weights cannot confirm (the decoder's widths and the classes are
# checked against the weights; grids are clipped to the image). Far above any setting that trains, far below one
# that exhausts memory: a crafted config.json fails here instead of in the allocator.
_CONFIG_BOUNDS = {
    "n_fractions": 1024,
    "refine_fractions": 1024,
    "n_iters": 10_000,
    "peak_kernel": 2 * MAX_FILE_IMG_SIZE,
}
_MAX_CHANNELS = 1 << 16


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
        ``(directory read, metadata, weights on the classifier's device)``; the metadata's ``config`` is as JSON
        gives it (:meth:`AHAConfig.from_dict` turns its lists back into tuples).

    Raises:
        FileNotFoundError: the directory or one of its files is missing.
        ValueError: the files are corrupt, of another format, inconsistent with each other, or were made for
            a different classifier.
    """
    src = checkpoint_dir(path)
    meta = load_json(src / CONFIG_FILE)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{src / CONFIG_FILE} is not an AHA checkpoint config (format {FORMAT})")
    state, weights_meta = load_safetensors(src / WEIGHTS_FILE, device=classifier.norm_mean.device, finite=True)
    steps = str(meta.get("steps_trained", 0))
    same_step = weights_meta.get("steps_trained", steps) == steps
    if weights_meta.get("classifier") != meta.get("classifier") or not same_step:
        raise ValueError(f"{src}: weights and config belong to different checkpoints (torn write?)")
    expected = classifier_fingerprint(classifier)
    if meta["classifier"] != expected:
        raise ValueError(
            f"{src} was trained for another classifier (fingerprint {meta['classifier']}, this one is {expected})"
        )
    return src, meta, state


def _registry_name(name: str) -> bool:
    """Whether timm builds ``name`` from its own registry, offline (not a hub, local-dir or other source)."""
    try:
        return timm.models.parse_model_name(name)[0] is None and timm.is_model(name)
    except ValueError:  # an unknown source prefix ("https://...")
        return False


def check_loadable(
    src: Path,
    meta: dict[str, Any],
    config: AHAConfig,
    classifier: Classifier,
    decoder_state: dict[str, torch.Tensor],
    backbone_state: dict[str, torch.Tensor],
    trust_backbone: bool = False,
) -> int:
    """Check, before anything is built, that the checkpoint in ``src`` can be rebuilt from its own files and
    ``classifier`` alone, with sizes its weights confirm; returns the image side it was trained at.

    A checkpoint is data, never a pointer elsewhere: a separate backbone must be a timm registry name whose weights
    the checkpoint holds (unless ``trust_backbone``), so loading sends no request to a hub and opens no other
    folder. Every size the files set is bounded: the decoder's widths, the classes and the backbone's architecture
    against the stored weights (built on the meta device, no memory), the rest against :data:`_CONFIG_BOUNDS`.

    Raises:
        ValueError: naming the file and the field.
    """
    where = src / CONFIG_FILE
    name = config.backbone
    if name is not None and not trust_backbone:
        if not _registry_name(name):
            raise ValueError(
                f"{where}: refusing backbone {name!r}: a checkpoint may only name a timm registry model (not a hub "
                "name, a local directory or a URL); pass trust_backbone=True to AHA.load if you trust this file"
            )
        if not backbone_state:
            fetch = "download timm's pretrained weights" if config.backbone_pretrained else "make up random weights"
            raise ValueError(
                f"{where}: the checkpoint names backbone {name!r} but does not hold its weights, so loading would "
                f"{fetch}; pass trust_backbone=True to AHA.load if you trust this file"
            )
    if name is None and backbone_state:
        raise ValueError(f"{src / WEIGHTS_FILE}: backbone weights stored for a config without a separate backbone")
    try:
        img_size = file_int(meta["img_size"], "img_size", where, high=MAX_FILE_IMG_SIZE)
        raw_channels = meta["feature_channels"]
    except KeyError as err:
        raise ValueError(f"{where}: corrupt AHA config: missing {err}") from None
    if not isinstance(raw_channels, list) or not raw_channels:
        raise ValueError(f"{where}: corrupt metadata: feature_channels must be a list of ints, got {raw_channels!r}")
    channels = [file_int(c, "feature_channels", where, high=_MAX_CHANNELS) for c in raw_channels]
    for field, high in _CONFIG_BOUNDS.items():
        value = getattr(config, field)
        if value is not None and value > high:
            raise ValueError(f"{where}: corrupt metadata: {field} must be <= {high}, got {value!r}")
    with torch.device("meta"):
        probe = Decoder(channels, classifier.num_classes, config.decoder_dim, config.class_dim)
    what = f"the decoder its config describes ({classifier.num_classes} classes)"
    check_state_shapes(probe, decoder_state, src / WEIGHTS_FILE, what)
    if name is not None and backbone_state and _registry_name(name):
        side = classifier.input_size[1] if classifier.input_size is not None else None
        kwargs = {"img_size": side} if side is not None and _accepts_img_size(name) else {}
        _check_against_weights(name, kwargs, backbone_state, src / WEIGHTS_FILE)
    return img_size
