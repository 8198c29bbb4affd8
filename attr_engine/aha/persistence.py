"""Where an AHA checkpoint lives on disk and how it is written and read: file names, the training-directory layout
(step directories, the pointer, pruning, resuming), the metadata beside the weights and the checked save / load of
the decoder weights with their config.

Both :mod:`attr_engine.aha.model` (``AHA.save`` / ``AHA.load``) and :mod:`attr_engine.aha.trainer` (training
checkpoints) use this module; it imports neither of them (what it reads of an explainer is the
:class:`Checkpointable` protocol), so the three never import each other in a circle.

Layout: ``AHA.save(path)`` writes ``path/explainer.safetensors`` (decoder weights, and a separate backbone's) and
``path/config.json`` (config and provenance, :func:`checkpoint_metadata`). A training output directory ``OUT``
holds whole checkpoints in ``OUT/checkpoints/step-<8 digits>/``, each with those two files and
``trainer.safetensors`` (optimizer, scheduler and RNG state plus the position in the data, pickle-free), and an
``OUT/config.json`` whose ``checkpoint`` key points at the current one. A run with a validation set also keeps
``best.safetensors`` (the decoder's weights at its best validation score so far) in each step directory, and its
curve under ``validation`` in both ``config.json`` files. A step directory is written under a
temporary name and renamed into place whole, then the pointer is switched atomically, then older step directories
are removed (the previous one is kept): a kill at any moment leaves the previous checkpoint intact and loadable.
:func:`checkpoint_dir` follows the pointer; resuming takes the newest complete step directory
(:func:`latest_training_checkpoint`).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import timm
import torch

from attr_engine.aha.config import AHAConfig
from attr_engine.aha.network import Decoder, FeatureBackbone, build_decoder
from attr_engine.atomic import fresh_dir, fsync_dir
from attr_engine.checkpoint import (
    check_state_shapes,
    load_json,
    load_safetensors,
    load_state,
    save_json,
    save_safetensors,
    save_state,
)
from attr_engine.classifier import (
    MAX_FILE_IMG_SIZE,
    Classifier,
    accepts_img_size,
    check_against_weights,
    classifier_fingerprint,
    file_int,
    is_external_name,
)
from attr_engine.guards import AHA_CHECKPOINTS_DIR, AHA_CONFIG_FILE, AHA_FORMAT, AHA_WEIGHTS_FILE, check_aha_dir

__all__ = [
    "BACKBONE_PREFIX",
    "BEST_FILE",
    "CHECKPOINTS_DIR",
    "CONFIG_FILE",
    "FORMAT",
    "POINTER_KEY",
    "TRAINER_FILE",
    "WEIGHTS_FILE",
    "Checkpoint",
    "Checkpointable",
    "check_loadable",
    "checkpoint_dir",
    "checkpoint_metadata",
    "has_checkpoint",
    "latest_training_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "read_training_checkpoint",
    "save_explainer",
    "save_training_checkpoint",
    "step_dirs",
    "write_checkpoint",
]

# The layout's names live in attr_engine.guards, which tells a checkpoint from other paths without torch.
FORMAT = AHA_FORMAT
WEIGHTS_FILE = AHA_WEIGHTS_FILE
CONFIG_FILE = AHA_CONFIG_FILE
TRAINER_FILE = "trainer.safetensors"
# A run with a validation set: the decoder's weights at the best score so far, beside the step's own.
BEST_FILE = "best.safetensors"
# Training checkpoints: OUT/checkpoints/step-<8 digits>/ each hold a whole checkpoint; OUT/config.json points at one.
CHECKPOINTS_DIR = AHA_CHECKPOINTS_DIR
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
    "val_fractions": 1024,
    "n_iters": 10_000,
    "peak_kernel": 2 * MAX_FILE_IMG_SIZE,
}
_MAX_CHANNELS = 1 << 16
# Levels a decoder taps (feature_channels, layers): DPT taps four; each costs three modules even on the meta device.
_MAX_LEVELS = 64
# What a checkpoint written before a config field existed was trained with: loading it fills the field with that
# value, not today's default, so its refinement and a resumed run optimise the objective it was trained on.
_BEFORE_FIELDS: dict[str, Any] = {"score_norm": "raw", "mask_sigma": 0.0}


class Checkpointable(Protocol):
    """What this module reads of an explainer to save it (:class:`attr_engine.aha.model.AHA` has all of it).

    A protocol rather than the class, so the model and the trainer can both hand an explainer here without this
    module importing either of them.
    """

    classifier: Classifier
    config: AHAConfig  # resolved for img_size
    img_size: int
    feature_channels: list[int]
    steps_trained: int
    decoder: Decoder
    backbone: FeatureBackbone


@dataclass(frozen=True)
class Checkpoint:
    """A checked checkpoint, read and not yet built (:func:`load_checkpoint`).

    Attributes:
        src: the directory read (a training directory's current step directory, see :func:`checkpoint_dir`).
        meta: its ``config.json`` (format, classifier fingerprint, img_size, feature_channels, steps_trained).
        config: the config it was trained with, as stored (fields it predates filled from ``_BEFORE_FIELDS``).
        img_size: the image side it was trained at, checked.
        decoder_state: the decoder's weights on the classifier's device, shapes checked against ``config``.
        backbone_state: a separate backbone's weights (``config.backbone``), prefix removed; empty otherwise.
    """

    src: Path
    meta: dict[str, Any]
    config: AHAConfig
    img_size: int
    decoder_state: dict[str, torch.Tensor]
    backbone_state: dict[str, torch.Tensor]


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
        ValueError: ``path`` is a file (its weights, or a classifier checkpoint) or a classifier's directory, named
            with what to pass instead; or the pointer is not a step directory under ``path/checkpoints`` (a
            checkpoint may only point inside itself).
    """
    src = check_aha_dir(path)  # a file, a classifier's directory or nothing at all: named in one line
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


def _refuse_links(root: Path, src: Path) -> None:
    """A checkpoint's files are its own: a step directory or file that is a link (to another folder, or a file
    elsewhere) is refused, so a crafted checkpoint cannot make the loader read outside it."""
    inside = [src, src.parent] if src != root else []  # a step directory and its checkpoints/ folder
    for path in [*inside, src / CONFIG_FILE, src / WEIGHTS_FILE]:
        if path.is_symlink():
            raise ValueError(f"{path} is a link: an AHA checkpoint's directories and files must be its own")


def checkpoint_metadata(explainer: Checkpointable) -> dict[str, Any]:
    """The ``config.json`` of ``explainer``'s checkpoint: format, classifier fingerprint, sizes, steps and config.

    A training directory's pointer file is this plus :data:`POINTER_KEY`.
    """
    return {
        "format": FORMAT,
        "classifier": classifier_fingerprint(explainer.classifier),
        "num_classes": explainer.classifier.num_classes,
        "img_size": explainer.img_size,
        "feature_channels": explainer.feature_channels,
        "steps_trained": explainer.steps_trained,
        "config": explainer.config.to_dict(),
    }


def save_explainer(
    explainer: Checkpointable, path: str | os.PathLike[str], extra_meta: Mapping[str, Any] | None = None
) -> Path:
    """Write ``explainer``'s decoder (and a separate backbone, ``config.backbone``) to directory ``path``.

    The classifier's own backbone is not saved (it comes from the classifier when loading); a separate one is saved
    under :data:`BACKBONE_PREFIX`, so loading never downloads or opens anything else. ``extra_meta`` (JSON values)
    joins :func:`checkpoint_metadata` in ``config.json``.
    """
    weights = dict(explainer.decoder.state_dict())
    if explainer.config.backbone is not None:
        weights.update({BACKBONE_PREFIX + k: v for k, v in explainer.backbone.model.state_dict().items()})
    return write_checkpoint(path, weights, {**checkpoint_metadata(explainer), **(extra_meta or {})})


def write_checkpoint(path: str | os.PathLike[str], weights: Mapping[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write decoder ``weights`` and their metadata ``meta`` (format, classifier fingerprint, steps, config) to
    directory ``path``: :data:`WEIGHTS_FILE` + :data:`CONFIG_FILE`.

    Each file is written atomically, the weights first, so a crash never leaves a config pointing at missing weights.
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file: an AHA checkpoint is a directory (explainer.safetensors, config.json)")
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
    _refuse_links(Path(path), src)
    meta = load_json(src / CONFIG_FILE)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{src / CONFIG_FILE} is not an AHA checkpoint config (format {FORMAT})")
    state, weights_meta = load_safetensors(src / WEIGHTS_FILE, device=classifier.norm_mean.device, finite=True)
    raw_steps = meta.get("steps_trained", 0)
    if not isinstance(raw_steps, int) or isinstance(raw_steps, bool) or not 0 <= raw_steps < 1 << 62:
        raise ValueError(f"{src / CONFIG_FILE}: corrupt metadata: steps_trained must be an int >= 0, got {raw_steps!r}")
    if not isinstance(meta.get("classifier"), str):
        raise ValueError(f"{src / CONFIG_FILE}: corrupt metadata: no classifier fingerprint")
    steps = str(raw_steps)
    same_step = weights_meta.get("steps_trained", steps) == steps
    if weights_meta.get("classifier") != meta.get("classifier") or not same_step:
        raise ValueError(f"{src}: weights and config belong to different checkpoints (torn write?)")
    expected = classifier_fingerprint(classifier)
    if meta["classifier"] != expected:
        raise ValueError(
            f"{src} was trained for another classifier (fingerprint {meta['classifier']}, this one is {expected})"
        )
    return src, meta, state


def load_checkpoint(
    path: str | os.PathLike[str], classifier: Classifier, *, trust_backbone: bool = False
) -> Checkpoint:
    """Read ``path`` (a saved explainer or a training directory) for ``classifier`` and check, before anything is
    built, that it can be rebuilt from its own files and ``classifier`` alone (:func:`check_loadable`).

    Raises:
        FileNotFoundError: the directory or one of its files is missing.
        ValueError: the files are corrupt, of another format, inconsistent with each other, made for a different
            classifier, or name a backbone the loader would have to fetch from elsewhere.
    """
    src, meta, state = read_checkpoint(path, classifier)
    try:
        config = AHAConfig.from_dict({**_BEFORE_FIELDS, **meta["config"]})
    except (KeyError, TypeError) as err:
        raise ValueError(f"{src / CONFIG_FILE}: corrupt AHA config: {err}") from err
    backbone_state = {k[len(BACKBONE_PREFIX) :]: v for k, v in state.items() if k.startswith(BACKBONE_PREFIX)}
    decoder_state = {k: v for k, v in state.items() if not k.startswith(BACKBONE_PREFIX)}
    img_size = check_loadable(src, meta, config, classifier, decoder_state, backbone_state, trust_backbone)
    return Checkpoint(src, meta, config, img_size, decoder_state, backbone_state)


def _registry_name(name: str) -> bool:
    """Whether timm builds ``name`` from its own registry, offline (not a hub, local-dir or other source)."""
    return not is_external_name(name) and timm.is_model(name)


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
    if not isinstance(raw_channels, list) or not 1 <= len(raw_channels) <= _MAX_LEVELS:
        shown = raw_channels if not isinstance(raw_channels, list) else f"{len(raw_channels)} entries"
        raise ValueError(
            f"{where}: corrupt metadata: feature_channels must be a list of 1 to {_MAX_LEVELS} ints, got {shown}"
        )
    layers = config.layers or ()
    if len(layers) > _MAX_LEVELS or len(set(layers)) != len(layers) or any(i < -1000 or i > 1000 for i in layers):
        raise ValueError(f"{where}: corrupt metadata: layers must be up to {_MAX_LEVELS} distinct block indices")
    channels = [file_int(c, "feature_channels", where, high=_MAX_CHANNELS) for c in raw_channels]
    for field, high in _CONFIG_BOUNDS.items():
        value = getattr(config, field)
        if value is not None and value > high:
            raise ValueError(f"{where}: corrupt metadata: {field} must be <= {high}, got {value!r}")
    with torch.device("meta"):
        # The reference colour is not stored (no weight depends on it): any colour builds the same shapes.
        probe = build_decoder(config, channels, classifier, torch.zeros(3))
    what = f"the decoder its config describes ({classifier.num_classes} classes)"
    check_state_shapes(probe, decoder_state, src / WEIGHTS_FILE, what)
    if name is not None and backbone_state and _registry_name(name):
        side = classifier.input_size[1] if classifier.input_size is not None else None
        kwargs = {"img_size": side} if side is not None and accepts_img_size(name) else {}
        check_against_weights(name, kwargs, backbone_state, src / WEIGHTS_FILE)
    return img_size


# ----------------------------------------------------------------------------------------------------------------
# Training directories: whole step directories, the pointer, pruning and resuming
# ----------------------------------------------------------------------------------------------------------------


def save_training_checkpoint(
    explainer: Checkpointable,
    out: Path,
    trainer_state: dict[str, Any],
    *,
    step: int,
    world: int,
    lineage: list[Path],
    best_state: Mapping[str, torch.Tensor] | None = None,
    extra_meta: Mapping[str, Any] | None = None,
) -> None:
    """Write a whole step directory of ``explainer`` and ``trainer_state`` under ``out``, rename it into place,
    switch the pointer, then prune older step directories.

    ``lineage`` lists the step directories this run may keep (updated in place): the new one and the one before it
    stay, older ones (another run's, or superseded) go once the new one is in place. ``best_state``: the decoder's
    best weights so far (a run with a validation set), written as :data:`BEST_FILE` inside the step directory, so
    they are renamed into place with it; ``extra_meta`` joins both ``config.json`` files.
    """
    root = out / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = fresh_dir(root, prefix=f".{final.name}.")
    try:
        save_state(trainer_state, tmp / TRAINER_FILE, {"step": str(step), "world": str(world)})
        if best_state is not None:
            save_safetensors(dict(best_state), tmp / BEST_FILE, {"step": str(trainer_state["validation"]["best_step"])})
        save_explainer(explainer, tmp, extra_meta)
        if final.exists():  # the same step saved again (a resumed run that ends where it started): replace it
            _discard(final, root)
        os.replace(tmp, final)  # the commit point of the checkpoint: one directory rename
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # The pointer is switched only now, so it never names a directory that is not whole.
    pointer = {**checkpoint_metadata(explainer), **(extra_meta or {}), POINTER_KEY: f"{CHECKPOINTS_DIR}/{final.name}"}
    save_json(pointer, out / CONFIG_FILE)
    for legacy in (out / WEIGHTS_FILE, out / TRAINER_FILE):
        legacy.unlink(missing_ok=True)  # a flat checkpoint of an older layout; the pointer supersedes it
    if final not in lineage:
        lineage.append(final)
    keep = set(lineage[-2:])  # the new checkpoint and the one before it
    del lineage[:-2]
    for d in root.iterdir():
        if d not in keep and (d.name.startswith(".step-") or _is_step_dir(d)):
            _discard(d, root)


def _is_step_dir(path: Path) -> bool:
    return path.is_dir() and path.name.startswith("step-") and path.name[5:].isdigit()


def _discard(path: Path, root: Path) -> None:
    # Renamed out of the step namespace first, so a kill during the removal never leaves a half-deleted step-N.
    trash = root / f".trash-{path.name}-{os.getpid()}"
    try:
        os.replace(path, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _resume_candidates(src: Path) -> list[Path]:
    """Directories that may hold a whole training checkpoint, newest first (an older flat layout last)."""
    candidates = [d for d in step_dirs(src) if (d / TRAINER_FILE).is_file()]
    if (src / TRAINER_FILE).is_file() and (src / WEIGHTS_FILE).is_file():
        candidates.append(src)
    return candidates


def has_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a training checkpoint that :func:`attr_engine.aha.trainer.fit` could resume from."""
    return bool(_resume_candidates(Path(path)))


def read_training_checkpoint(explainer: Checkpointable, directory: Path) -> tuple[dict[str, torch.Tensor], Any]:
    """The decoder weights and the trainer state of the training checkpoint in ``directory``, checked to continue
    ``explainer``'s training: the same classifier, the same (resolved) config, weights that fit its decoder and a
    trainer state of the same step. A run with a validation set's best weights (:data:`BEST_FILE`) are checked the
    same way and returned in the state as ``best_decoder``.

    Raises:
        FileNotFoundError, ValueError: naming the directory and what is wrong.
    """
    loaded = load_checkpoint(directory, explainer.classifier)
    steps = int(loaded.meta.get("steps_trained", 0))
    if loaded.config.resolved(loaded.img_size) != explainer.config:
        raise ValueError(f"{directory} was trained with a different AHAConfig; resume with the same configuration")
    check_state_shapes(explainer.decoder, loaded.decoder_state, loaded.src / WEIGHTS_FILE, "the explainer architecture")
    state, meta = load_state(directory / TRAINER_FILE)
    if int(meta.get("step", -1)) != steps or int(state["step"]) != steps:
        raise ValueError(
            f"{directory}: trainer state (step {meta.get('step')}) and weights disagree (torn checkpoint?)"
        )
    validation = state.get("validation") if isinstance(state, dict) else None
    if validation is not None and validation.get("best_step") is not None:
        device = explainer.classifier.norm_mean.device
        best, best_meta = load_safetensors(directory / BEST_FILE, device=device, finite=True)
        check_state_shapes(explainer.decoder, best, directory / BEST_FILE, "the explainer architecture")
        if best_meta.get("step") != str(validation["best_step"]):
            raise ValueError(f"{directory / BEST_FILE} is not the best step the trainer state names (torn checkpoint?)")
        state["best_decoder"] = best
    return loaded.decoder_state, state


def latest_training_checkpoint(
    explainer: Checkpointable, src: Path
) -> tuple[Path, dict[str, torch.Tensor], Any, list[str]]:
    """The newest training checkpoint under ``src`` that :func:`read_training_checkpoint` accepts.

    Returns:
        ``(its directory, decoder weights, trainer state, why each newer one was passed over)``.

    Raises:
        FileNotFoundError: ``src`` holds no training checkpoint.
        ValueError: none of them is usable (each reason listed).
    """
    candidates = _resume_candidates(src)
    if not candidates:
        raise FileNotFoundError(f"no AHA checkpoint to resume in {src}")
    errors: list[str] = []
    for d in candidates:
        try:
            decoder_state, state = read_training_checkpoint(explainer, d)
        except (ValueError, FileNotFoundError) as err:
            errors.append(str(err))
            continue
        return d, decoder_state, state, errors
    raise ValueError(f"no usable AHA checkpoint to resume in {src}: {'; '.join(errors)}")
