"""An attribution job as data, and the settings an output directory records for it.

An :class:`AttributionJob` holds plain values (paths, names, options, a seed), so it pickles in bytes and every
engine rebuilds the same classifier and method from it (:meth:`AttributionJob.load_classifier`,
:meth:`AttributionJob.get_explainer`). :func:`job_settings` is what an output directory records of a job
(``explain.json``) and :func:`settings_digest` its short hash, which every journal line carries.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attr_engine.guards import (
    check_aha_dir,
    check_checkpoint_file,
    check_count,
    check_crop_pct,
    check_img_size,
    check_num_classes,
)

if TYPE_CHECKING:
    import torch

    from attr_engine.classifier import Classifier
    from attr_engine.explainer import Explainer
    from attr_engine.imageops import DataConfig

__all__ = [
    "FORMATS",
    "FRAMES",
    "MAP_DTYPES",
    "SETTINGS_FILE",
    "AttributionJob",
    "check_recorded_settings",
    "job_settings",
    "settings_digest",
]

SETTINGS_FILE = "explain.json"
# "none": pictures only (explain --png), no map files.
FORMATS = ("npy", "safetensors", "none")
# float16 halves a map's bytes (about 3 significant digits, |values| up to 65504).
MAP_DTYPES = ("float32", "float16")
FRAMES = ("model", "image")


@dataclass(frozen=True)
class AttributionJob:
    """What every engine needs to rebuild the classifier and the method: plain values, so it pickles in bytes.

    Attributes:
        method: ``aha``, ``pullback`` (Pullback Ascent), ``pullback-soft`` or any name of
            :func:`attr_engine.list_explainers` (resolved to its canonical name by :meth:`get_explainer`).
        classifier: a classifier checkpoint (``.safetensors``, from ``train-classifier`` / ``demo``), or ``None``.
        model: a timm model name: the architecture of ``classifier``, or a model of its own (``pretrained`` for
            timm's weights; without, random weights, the same in every process: the build is seeded with
            ``seed``).
        num_classes: classes of a ``model`` without checkpoint.
        img_size: the classifier's input side (default: its own, else 224).
        crop_pct: the centre crop's fraction (default: timm's for ``model``, 1.0 for a ``classifier`` checkpoint,
            which was trained on whole frames); ignored when ``preprocess`` is given.
        preprocess: the exact :class:`~attr_engine.imageops.DataConfig` to cut inputs with (the CLI passes its own).
        aha: the AHA checkpoint directory (``method="aha"``); ``refine_steps``: its test-time refinement steps.
        seed: seeds the classifier's build, torch before the first batch, and AHA's refinement.
        options: the method's own options (``{"n_masks": 2000}`` for rise).
        target: ``"pred"`` (the predicted class), ``"label"`` (the input's class folder or ``label`` column) or a
            class index (``0 <= target < num_classes``, checked once the classifier is built).
        frame: ``"model"`` (maps at the classifier's input size) or ``"image"`` (on the original image).
        scores: add deletion / insertion AUCs of each map (AHA protocol, 21 points, mean-colour reference).
        return_images: add the picture an overlay is drawn on (the original, or the classifier's input).
        device: ``auto`` (a GPU when there is one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``.
        fingerprint: when set, the built classifier must have this
            :func:`~attr_engine.classifier.classifier_fingerprint` (a checkpoint replaced mid-job fails loudly).
        batch_size: images per batch: the local engine's and the Ray engine's batches are the same.
    """

    method: str = "pullback"
    classifier: str | None = None
    model: str | None = None
    pretrained: bool = False
    num_classes: int | None = None
    img_size: int | None = None
    crop_pct: float | None = None
    preprocess: DataConfig | None = None
    aha: str | None = None
    refine_steps: int = 0
    seed: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)
    target: str | int = "pred"
    frame: str = "model"
    scores: bool = False
    return_images: bool = False
    device: str = "auto"
    fingerprint: str | None = None
    batch_size: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method.strip():
            raise ValueError(f"method must be a method name, got {self.method!r}")
        if self.classifier is None and self.model is None:
            raise ValueError("no classifier: pass a checkpoint (classifier=...) or a timm model name (model=...)")
        if self.classifier is not None:
            check_checkpoint_file(self.classifier)  # a directory or an AHA checkpoint named as such
        if self.aha is not None:
            check_aha_dir(self.aha)
        if self.frame not in FRAMES:
            raise ValueError(f"frame must be one of {', '.join(FRAMES)}, got {self.frame!r}")
        # A class index's range is checked where the classifier is known (explain, the engines).
        valid_index = isinstance(self.target, int) and not isinstance(self.target, bool)
        if self.target not in ("pred", "label") and not valid_index:
            raise ValueError(f"target must be 'pred', 'label' or a class index, got {self.target!r}")
        check_count(self.refine_steps, "refine_steps")
        check_count(self.batch_size, "batch_size")
        # The command line's bounds (attr_engine.guards): a job is what every engine builds from.
        if self.num_classes is not None:
            check_num_classes(self.num_classes)
        if self.img_size is not None:
            check_img_size(self.img_size)
        if self.crop_pct is not None:
            check_crop_pct(self.crop_pct)

    def load_classifier(self, device: torch.device | str = "cpu") -> Classifier:
        """The job's classifier on ``device``: :func:`attr_engine.classifier.load_classifier` of its checkpoint (the
        architecture read from the file, or ``model``) or of ``model`` (``pretrained`` weights, or random ones seeded
        with ``seed``, the same in every process).

        Raises:
            ValueError: what :func:`~attr_engine.classifier.load_classifier` refuses, or a classifier whose
                fingerprint is not the job's ``fingerprint`` (a checkpoint replaced mid-job).
            FileNotFoundError: the checkpoint is missing.
        """
        from attr_engine.classifier import classifier_fingerprint, load_classifier

        clf = load_classifier(
            self.model, pretrained=self.pretrained, num_classes=self.num_classes, img_size=self.img_size,
            checkpoint=self.classifier, seed=self.seed,
        )  # fmt: skip
        if self.fingerprint is not None and classifier_fingerprint(clf) != self.fingerprint:
            raise ValueError(
                f"the classifier loaded here ({self.classifier or self.model}) is not the one the job was set up "
                "with (its weights differ): was the checkpoint replaced?"
            )
        if self.classifier is None and not self.pretrained:
            # Maps of an untrained network explain nothing; say so once instead of silently using random weights.
            warnings.warn(
                f"--model {self.model} without --pretrained or --classifier uses random weights; its maps explain "
                "an untrained network",
                stacklevel=2,
            )
        return clf.to(device)

    def data_config(self, classifier: Classifier) -> DataConfig:
        """How every input is cut for ``classifier``: ``preprocess`` when set, else timm's evaluation transform at
        ``img_size`` (default: the classifier's, else 224) with ``crop_pct`` (default: 1.0 for a ``classifier``
        checkpoint, which learnt on whole frames; timm's for a ``model``).

        Raises:
            ValueError: a ``crop_pct`` the transform refuses.
        """
        from attr_engine.imageops import data_config

        if self.preprocess is not None:
            return self.preprocess
        img_size = self.img_size or (classifier.input_size[1] if classifier.input_size else 224)
        crop_pct = self.crop_pct if self.crop_pct is not None else (1.0 if self.classifier else None)
        try:
            return data_config(classifier, img_size=img_size, crop_pct=crop_pct)
        except ValueError as err:
            raise ValueError(f"--crop-pct: {err}") from None

    def get_explainer(self, classifier: Classifier) -> Explainer:
        """The job's method for ``classifier`` (``attribute(x (B, 3, H, W), target (B,)) -> (B, H, W)``):
        :func:`attr_engine.explainer.get_explainer` with the job's options (``aha``: the trained explainer loaded
        from the job's directory, with ``refine_steps`` and ``seed``).

        Raises:
            ValueError: an unknown method (with close matches), AHA without a checkpoint, refinement for another
                method, or options the method refuses (a wrong option name is a ValueError here too).
            FileNotFoundError: no AHA checkpoint in ``aha``.
        """
        from attr_engine.explainer import get_explainer, resolve_explainer

        key = resolve_explainer(self.method)
        kwargs = dict(self.options)
        if key == "aha":
            if self.aha is None:
                raise ValueError("--method aha needs --aha DIR, the directory train-aha (or demo) wrote")
            kwargs.update(aha=self.aha, refine_steps=self.refine_steps, seed=self.seed)
        elif self.refine_steps:
            raise ValueError("--refine-steps applies to --method aha only")
        try:
            return get_explainer(key, classifier, **kwargs)
        except TypeError as err:
            raise ValueError(f"method {self.method!r} does not take these options: {err}") from None


def job_settings(
    job: AttributionJob,
    fmt: str,
    classifier: Classifier,
    config: DataConfig,
    map_dtype: str = "float32",
    explainer: Explainer | None = None,
) -> dict[str, Any]:
    """What an output directory records (``explain.json``) and every journal line's digest stands for: the
    method, its options (with ``explainer``: every option's value as the method resolved it, defaults included,
    so ``explain.json`` says what was used; else the job's own), target, format, preprocessing, frame, the
    classifier's weights and, for AHA, its weights and refinement; ``map_dtype`` only when it is not float32 (so
    directories written before it existed keep their digest). Two runs with the same settings make the same maps."""
    if map_dtype not in MAP_DTYPES:
        raise ValueError(f"map_dtype must be one of {', '.join(MAP_DTYPES)}, got {map_dtype!r}")
    from attr_engine.classifier import classifier_fingerprint
    from attr_engine.explainer import resolve_explainer

    method = resolve_explainer(job.method)
    settings: dict[str, Any] = {
        "method": method,
        "options": _resolved_options(job, explainer),
        "target": str(job.target),
        "format": fmt,
        "img_size": config.input_size[0],
        "preprocess": config.to_dict(),
        "frame": job.frame,
        "classifier": classifier_fingerprint(classifier),
    }
    if map_dtype != "float32":
        settings["map_dtype"] = map_dtype
    if method == "aha":
        from attr_engine.aha.persistence import WEIGHTS_FILE, checkpoint_dir

        assert job.aha is not None  # get_explainer refused AHA without a checkpoint
        # The explainer's identity is its weights, not its path: a moved checkpoint still matches, a retrained not.
        digest = hashlib.sha256()
        with open(checkpoint_dir(job.aha) / WEIGHTS_FILE, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        settings["aha"] = digest.hexdigest()[:16]
        settings["refine_steps"] = job.refine_steps
    return settings


def settings_digest(settings: dict[str, Any]) -> str:
    """A short hash of the settings, recorded with every output in the journal."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def check_recorded_settings(out: Path, settings: dict[str, Any], overwrite: bool) -> None:
    """Refuse to add maps made with other settings to ``out`` (unless ``overwrite``); nothing is written here.

    Raises:
        ValueError: ``out`` records other settings (naming what changed).
    """
    from attr_engine.checkpoint import load_json

    path = out / SETTINGS_FILE
    if path.is_file() and not overwrite:
        try:
            previous = load_json(path)
        except ValueError:
            previous = None  # unreadable: the journal still tells which maps match these settings
        if not isinstance(previous, dict):
            return
        # Keys either side: a setting recorded only when it is not the default (map_dtype) counts when it is gone.
        keys = [*settings, *(k for k in previous if k not in settings)]
        changed = [k for k in keys if previous.get(k) != settings.get(k)]
        if changed:
            diff = ", ".join(f"{k} {previous.get(k)!r} -> {settings.get(k)!r}" for k in changed)
            raise ValueError(
                f"{out} holds maps made with other settings ({diff}); use another --out, or --overwrite to redo them"
            )


def _resolved_options(job: AttributionJob, explainer: Explainer | None) -> dict[str, Any]:
    """The options ``explainer`` runs with (its defaults merged with the job's), as JSON values; the job's own
    options where the explainer keeps none (a plug-in that is not an :class:`~attr_engine.explainer.Explainer`)."""
    defaults = getattr(explainer, "defaults", None)
    if not isinstance(defaults, Mapping):
        return dict(job.options)
    # Tuples become lists, as they would in the JSON file: the digest is the same before and after a round trip.
    return json.loads(json.dumps({k: v for k, v in defaults.items() if _plain(v)}, default=str))


def _plain(value: Any) -> bool:
    """Whether an option's value is a setting (numbers, names, lists of them), not an object (a model, a tensor)."""
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))
