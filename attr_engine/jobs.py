"""Attribution jobs as data: what to explain, with which classifier and method, and where the maps go.

An :class:`AttributionJob` holds plain values (paths, names, options, a seed), so it pickles in bytes and every
engine rebuilds the same classifier and method from it: :func:`build_classifier` and :func:`build_explainer`.
:func:`run` is the local engine, a generator of one :class:`ItemResult` per input; the Ray engine
(:mod:`attr_engine.ray`) maps the same job over batches of the same inputs and yields the same results. One
:class:`OutputWriter` turns results into files for both: maps (``.npy`` / ``.safetensors``, float32 or float16, or
none), per-input pictures (:func:`attr_engine.visualize.save_map_figure`), a journal line per finished input and
the recorded settings (:func:`job_settings`), each written atomically. The command
line (:mod:`attr_engine.cli`) only parses arguments into a job and prints; nothing here imports it.

Inputs are the images under a folder, a file or an ImageFolder tree (:func:`list_inputs`): each image's outputs
mirror its path under the output directory. torch is imported by the functions that need it, so defining a job
costs nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from kernels.validate import check_int_at_least

if TYPE_CHECKING:
    import torch

    from attr_engine.classifier import Classifier
    from attr_engine.imageops import DataConfig

__all__ = [
    "FORMATS",
    "FRAMES",
    "JOURNAL_SUFFIX",
    "MANIFEST_DIR",
    "MAP_DTYPES",
    "SETTINGS_FILE",
    "AttributionJob",
    "Item",
    "ItemResult",
    "OutputWriter",
    "build_classifier",
    "build_explainer",
    "check_recorded_settings",
    "hub_reachable_or_offline",
    "job_settings",
    "list_inputs",
    "load_error",
    "make_explainer",
    "read_journal",
    "remove_stale_temporaries",
    "run",
    "settings_digest",
    "valid_output",
]

SETTINGS_FILE = "explain.json"
MANIFEST_DIR = "_manifest"
JOURNAL_SUFFIX = ".jsonl"
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
            :func:`attr_engine.list_explainers` (resolved to its canonical name by :func:`build_explainer`).
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
            class index.
        frame: ``"model"`` (maps at the classifier's input size) or ``"image"`` (on the original image).
        scores: add deletion / insertion AUCs of each map (AHA protocol, 21 points, mean-colour reference).
        return_images: add the picture an overlay is drawn on (the original, or the classifier's input).
        device: ``auto`` (a GPU when there is one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``.
        fingerprint: when set, the built classifier must have this
            :func:`~attr_engine.aha.persistence.classifier_fingerprint` (a checkpoint replaced mid-job fails loudly).
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
        if self.classifier is not None and not Path(self.classifier).is_file():
            raise FileNotFoundError(f"classifier checkpoint not found: {self.classifier}")
        if self.aha is not None and not Path(self.aha).is_dir():
            raise FileNotFoundError(f"AHA checkpoint directory not found: {self.aha}")
        if self.frame not in FRAMES:
            raise ValueError(f"frame must be one of {', '.join(FRAMES)}, got {self.frame!r}")
        valid_index = isinstance(self.target, int) and not isinstance(self.target, bool) and self.target >= 0
        if self.target not in ("pred", "label") and not valid_index:
            raise ValueError(f"target must be 'pred', 'label' or a class index >= 0, got {self.target!r}")
        check_int_at_least(self.refine_steps, "refine_steps", 0)
        check_int_at_least(self.batch_size, "batch_size", 1)
        for name in ("num_classes", "img_size"):
            if getattr(self, name) is not None:
                check_int_at_least(getattr(self, name), name, 1)
        if self.crop_pct is not None and not 0.0 < self.crop_pct <= 1.0:
            raise ValueError(f"crop_pct must be in (0, 1], got {self.crop_pct!r}")


# ---------------------------------------------------------------------------------------------------------------
# From a job to a classifier and a method
# ---------------------------------------------------------------------------------------------------------------


def _checkpoint_model_name(path: Path) -> str | None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("model_name")
    except (SafetensorError, OSError, RuntimeError) as err:
        raise ValueError(f"{path} is not a valid classifier checkpoint (safetensors): {err}") from None


def build_classifier(job: AttributionJob, device: torch.device | str = "cpu") -> Classifier:
    """The job's classifier on ``device``: its checkpoint (architecture read from the file, or ``job.model``) or
    a timm model (``pretrained`` weights, or random ones seeded with ``job.seed``).

    A name read from a checkpoint must be in timm's registry: a file may not send the loader to the hub or to
    another directory on its own (``job.model`` confirms such a name). The build is seeded, torch's global
    generator left as it was, so random weights are the same in every process that builds them.

    Raises:
        ValueError: an unknown model, a checkpoint that is corrupt or names an external model, a pretrained
            download that cannot be made (offline, with the weights not in the cache), a fingerprint mismatch.
        FileNotFoundError: the checkpoint is missing.
    """
    import torch

    from attr_engine.classifier import is_external_name, load_classifier

    checkpoint = Path(job.classifier) if job.classifier else None
    name = job.model
    if checkpoint is not None:
        if job.pretrained:
            raise ValueError(
                "pretrained and a classifier checkpoint exclude each other (the checkpoint holds the weights)"
            )
        saved = _checkpoint_model_name(checkpoint)
        if name is None and saved is not None and is_external_name(saved):
            raise ValueError(
                f"{checkpoint} names the model {saved!r}, which is not in timm's registry; pass --model to confirm it"
            )
        name = name or saved
        if name is None:
            raise ValueError(f"{checkpoint} does not record its architecture; name it with --model NAME")
    assert name is not None  # AttributionJob requires a checkpoint or a model
    if job.pretrained:
        hub_reachable_or_offline()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(job.seed)
        try:
            clf = load_classifier(
                name, pretrained=job.pretrained, num_classes=job.num_classes, img_size=job.img_size,
                checkpoint=checkpoint,
            )  # fmt: skip
        except (RuntimeError, OSError) as err:
            raise load_error(name, job.pretrained, err) from None
    if job.fingerprint is not None:
        from attr_engine.aha.persistence import classifier_fingerprint

        if classifier_fingerprint(clf) != job.fingerprint:
            raise ValueError(
                f"the classifier loaded here ({job.classifier or job.model}) is not the one the job was set up with "
                "(its weights differ): was the checkpoint replaced?"
            )
    if checkpoint is None and not job.pretrained:
        # Maps of an untrained network explain nothing; say so once instead of silently using random weights.
        warnings.warn(
            f"--model {name} without --pretrained or --classifier uses random weights; its maps explain an "
            "untrained network",
            stacklevel=2,
        )
    return clf.to(device)


def load_error(name: str, pretrained: bool, err: BaseException) -> Exception:
    """What a failed build of the timm model ``name`` means to a user, as one line.

    Pretrained downloads fail as RuntimeError / OSError (no network, no such tag on the hub); the hub's offline
    miss is a FileNotFoundError too.
    """
    if pretrained and os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        return ValueError(
            f"cannot load {name!r} with --pretrained: the Hugging Face hub is unreachable (offline) and its weights "
            "are not in the local cache"
        )
    if isinstance(err, FileNotFoundError):
        return FileNotFoundError(str(err))
    return ValueError(f"cannot load {name!r}: {' '.join(str(err).split())[:300]}")


HUB_HOST = ("huggingface.co", 443)


def hub_reachable_or_offline(timeout: float = 3.0) -> bool:
    """Probe the Hugging Face hub once; when it cannot be reached, switch the hub client to offline mode.

    Offline, weights already in the local cache still load and missing ones fail at once with one error, instead
    of the client's retries (about 45 s of them). Returns whether the hub answered.
    """
    import socket
    import sys

    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        return False
    try:
        with socket.create_connection(HUB_HOST, timeout=timeout):
            return True
    except OSError:
        os.environ["HF_HUB_OFFLINE"] = "1"
        constants = sys.modules.get("huggingface_hub.constants")
        if constants is not None:  # already imported: it read the variable at import time
            constants.HF_HUB_OFFLINE = True  # type: ignore[attr-defined]  # a module's globals are not typed
        return False


def build_explainer(job: AttributionJob, classifier: Classifier) -> Any:
    """The job's method for ``classifier`` (``attribute(x (B, 3, H, W), target (B,)) -> (B, H, W)``): see
    :func:`make_explainer`."""
    return make_explainer(
        job.method, classifier, aha=job.aha, refine_steps=job.refine_steps, seed=job.seed, options=job.options
    )


def make_explainer(
    method: str,
    classifier: Classifier,
    *,
    aha: str | os.PathLike[str] | None = None,
    refine_steps: int = 0,
    seed: int = 0,
    options: Mapping[str, Any] | None = None,
) -> Any:
    """The method ``method`` for ``classifier``, from the registry.

    The name is resolved once to its canonical one (:func:`attr_engine.explainer.resolve_explainer`); ``aha``
    loads the trained explainer from the directory ``aha`` with ``refine_steps`` and ``seed``.

    Raises:
        ValueError: an unknown method (with close matches), AHA without a checkpoint, refinement for another
            method, or options the method refuses.
        FileNotFoundError: no AHA checkpoint in ``aha``.
    """
    from attr_engine.explainer import get_explainer, resolve_explainer

    key = resolve_explainer(method)
    kwargs = dict(options or {})
    if key == "aha":
        from attr_engine.aha import AHA

        if aha is None:
            raise ValueError("--method aha needs --aha DIR, the directory train-aha (or demo) wrote")
        try:
            kwargs.update(aha=AHA.load(aha, classifier), refine_steps=refine_steps, seed=seed)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"no AHA checkpoint in {aha}: {err}") from None
    elif refine_steps:
        raise ValueError("--refine-steps applies to --method aha only")
    return get_explainer(key, classifier, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    """One input image and where its outputs go (paths relative to the output directory)."""

    path: Path
    name: str
    label: int
    map_file: Path
    png_file: Path


def list_inputs(src: Path, fmt: str) -> list[Item]:
    """Every input image under ``src`` in a stable order.

    Output names mirror the input tree with the image suffix replaced; inputs that would collide (``a.png`` and
    ``a.jpg`` in one folder) keep their suffix in the name instead (``a.png.npy``). With ``fmt="none"`` (pictures
    only) an item's ``map_file`` is its ``png_file``: the one output the journal and the manifest name.
    """
    from attr_engine.data import ImageFolderDataset

    if src.is_dir():
        # Images next to class folders are explained too (label -1): nothing under the input is silently dropped.
        reader = ImageFolderDataset(src, include_unclassified=True)
        rel = [(p.relative_to(src), label) for p, label in reader.samples]
    else:
        # A one-file "folder": the reader lists the parent (cheaply, nothing decoded) and is pointed at the file.
        reader = ImageFolderDataset(src.parent, extensions=(src.suffix or ".",), include_unclassified=True)
        reader.samples = [(src, -1)]
        rel = [(Path(src.name), -1)]
    stems = Counter(r.with_suffix("") for r, _ in rel)
    items = []
    for (r, label), (path, _) in zip(rel, reader.samples, strict=True):
        base = r.with_suffix("") if stems[r.with_suffix("")] == 1 else r
        png = Path(f"{base.as_posix()}.overlay.png")
        items.append(Item(path, r.as_posix(), label, png if fmt == "none" else Path(f"{base.as_posix()}.{fmt}"), png))
    return items


@dataclass
class ItemResult:
    """One input's outcome: its map in the output frame and the overlay's picture, or why it has none.

    ``error`` is ``None``, why the image could not be read, or :data:`attr_engine.explainer.NONFINITE_MAP` when the
    method's map had NaN or infinite values (:attr:`failed`: the input was good, the method was not).
    ``probability`` is the classifier's softmax probability of ``target`` (NaN when unknown), for the caption.
    """

    item: Item
    map: torch.Tensor | None = None
    shown: torch.Tensor | None = None
    target: int = -1
    error: str | None = None
    probability: float = float("nan")

    @property
    def failed(self) -> bool:
        from attr_engine.explainer import NONFINITE_MAP

        return self.error == NONFINITE_MAP


@dataclass
class _Input:
    """A decoded input: the classifier's view ``x (3, H, W)``, the original's ``(h, w)`` and, for overlays, the
    original as ``(3, h, w)`` uint8 (uint8 because a batch of 12-megapixel photos in float32 is gigabytes)."""

    item: Item
    x: torch.Tensor | None
    size: tuple[int, int] = (0, 0)
    original: torch.Tensor | None = None
    error: str | None = None


class _Decoded:
    """Decodes and preprocesses items; a file that fails comes back as its error message, not an exception.

    A map-style dataset (``__len__`` and ``__getitem__`` are all a DataLoader needs), not a ``torch`` subclass, so
    that defining it imports nothing.
    """

    def __init__(self, items: list[Item], config: DataConfig, keep_original: bool) -> None:
        self.items, self.config, self.keep_original = items, config, keep_original

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> _Input:
        item = self.items[i]
        from attr_engine.imageops import decode_image, prepare_input

        try:
            img = decode_image(item.path)
        except ValueError as err:
            return _Input(item, None, error=str(err))

        return _Input(item, *prepare_input(img, self.config, self.keep_original))


def _target_tensor(target: str | int, items: list[Item]) -> torch.Tensor | None:
    import torch

    if target == "pred":
        return None
    if target == "label":
        return torch.tensor([item.label for item in items])
    return torch.full((len(items),), int(target))


# ---------------------------------------------------------------------------------------------------------------
# The local engine
# ---------------------------------------------------------------------------------------------------------------


def run(
    job: AttributionJob,
    items: list[Item],
    *,
    classifier: Classifier,
    explainer: Any,
    config: DataConfig,
    limit: int | None = None,
    workers: int = 0,
) -> Iterator[ItemResult]:
    """The local engine: each input's :class:`ItemResult`, in order, from batches of ``job.batch_size`` inputs.

    Args:
        job: the job (target, frame, overlays, batch size, seed).
        items: the inputs (:func:`list_inputs`), decoded by :func:`~attr_engine.imageops.decode_image`.
        classifier, explainer: built from the job (:func:`build_classifier`, :func:`build_explainer`).
        config: the preprocessing every input is cut with.
        limit: yield at most this many maps (unreadable inputs do not count): a batch is cut to the maps still
            allowed before it is explained, so the maps of a run stopped at its limit are those a run without
            one makes of the same batches.
        workers: image-decoding worker processes.
    """
    import torch
    from torch.utils.data import DataLoader

    from attr_engine.explainer import NONFINITE_MAP, explain_batch_with_probability, finite_maps
    from attr_engine.imageops import to_image_frame

    keep_original = job.return_images and job.frame == "image"
    decoded = _Decoded(items, config, keep_original=keep_original)
    # _Decoded is map-style by protocol (see its docstring), not a torch Dataset subclass.
    loader: DataLoader[Any] = DataLoader(
        decoded,  # type: ignore[arg-type]
        batch_size=job.batch_size,
        num_workers=workers,
        collate_fn=list,
    )
    left = len(items) if limit is None else limit
    torch.manual_seed(job.seed)
    device = classifier.norm_mean.device
    for batch in loader:
        if left <= 0:
            return
        good = []
        for entry in batch:
            if entry.error is None:
                good.append(entry)
            else:
                yield ItemResult(entry.item, error=entry.error)
        good = good[:left]
        if not good:
            continue
        x = torch.stack([entry.x for entry in good]).to(device)
        target = _target_tensor(job.target, [entry.item for entry in good])
        maps, target, probability = explain_batch_with_probability(classifier, explainer, x, target)
        finite = finite_maps(maps)
        rows = zip(good, x.cpu(), maps, target.tolist(), probability.tolist(), finite, strict=True)
        for entry, image, amap, t, p, ok in rows:
            if not ok:
                yield ItemResult(entry.item, target=t, error=NONFINITE_MAP, probability=p)
                continue
            if job.frame == "image":
                amap = to_image_frame(amap, entry.size, config)
            shown = None
            if job.return_images:
                shown = image if job.frame == "model" else entry.original.float().div_(255)
            yield ItemResult(entry.item, amap, shown, t, probability=p)
        left -= sum(finite)  # --limit counts maps written


# ---------------------------------------------------------------------------------------------------------------
# Outputs: settings, journal, the writer
# ---------------------------------------------------------------------------------------------------------------


def job_settings(
    job: AttributionJob, fmt: str, classifier: Classifier, config: DataConfig, map_dtype: str = "float32"
) -> dict[str, Any]:
    """What an output directory records (``explain.json``) and every journal line's digest stands for: the
    method, its options, target, format, preprocessing, frame, the classifier's weights and, for AHA, its weights
    and refinement; ``map_dtype`` only when it is not float32 (so directories written before it existed keep
    their digest). Two runs with the same settings make the same maps."""
    if map_dtype not in MAP_DTYPES:
        raise ValueError(f"map_dtype must be one of {', '.join(MAP_DTYPES)}, got {map_dtype!r}")
    from attr_engine.aha.persistence import classifier_fingerprint
    from attr_engine.explainer import resolve_explainer

    method = resolve_explainer(job.method)
    settings: dict[str, Any] = {
        "method": method,
        "options": dict(job.options),
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

        assert job.aha is not None  # build_explainer refused AHA without a checkpoint
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


def read_journal(out: Path) -> dict[str, str]:
    """``{map output: settings digest}`` from every journal under ``out`` (the newest entry per output wins).

    A torn last line (a kill during the append) or a malformed one is ignored: its output is simply redone.
    """
    newest: dict[str, tuple[int, str]] = {}
    for path in sorted((out / MANIFEST_DIR).glob(f"*{JOURNAL_SUFFIX}")):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        for line in lines:
            try:
                entry = json.loads(line)
                key, digest, stamp = entry["output"], entry["digest"], int(entry["time_ns"])
            except (ValueError, KeyError, TypeError):
                continue
            if isinstance(key, str) and isinstance(digest, str) and stamp >= newest.get(key, (-1, ""))[0]:
                newest[key] = (stamp, digest)
    return {key: digest for key, (_, digest) in newest.items()}


def valid_output(path: Path, fmt: str, shape: tuple[int, int] | None = None, dtype: str = "float32") -> bool:
    """Whether ``path`` reads back as a complete 2-D map of ``dtype`` (``fmt`` ``"npy"`` / ``"safetensors"``) - of
    ``shape`` when given (maps in an image's frame take that image's size) - or a complete PNG (``"png"``, and
    ``"none"``: a pictures-only run's one output is its picture)."""

    def fits(got: tuple[int, ...]) -> bool:
        return len(got) == 2 and (shape is None or got == tuple(shape))

    import numpy as np

    if not path.is_file():
        return False
    try:
        if fmt == "npy":
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
            return fits(arr.shape) and arr.dtype == np.dtype(dtype)
        if fmt == "safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                if "map" not in f.keys():
                    return False
                stored = f.get_slice("map")
                return fits(tuple(stored.get_shape())) and stored.get_dtype() == _SAFETENSORS_DTYPES[dtype]
        from PIL import Image

        with Image.open(path) as im:
            im.verify()  # reads every chunk and checks its CRC: a truncated or damaged file fails
        return True
    except Exception:  # any failure to read it back means "not a usable output"
        return False


_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16"}


def remove_stale_temporaries(out: Path, items: list[Item], rank: int, world: int) -> int:
    """Delete temporaries a killed run left for this process's outputs (never another live process's)."""
    from attr_engine.checkpoint import TMP_SUFFIX, stale_temporaries

    mine = {out / item.map_file for item in items} | {out / item.png_file for item in items}
    mine.add(out / MANIFEST_DIR / f"rank{rank}-of-{world}.json")
    if world == 1:
        mine.add(out / SETTINGS_FILE)  # with other processes about, one of them may be writing it right now
    removed = 0
    for tmp in stale_temporaries(out):
        # .<target name>.<8 hex digits>.tmp -> <target name>
        target = tmp.with_name(tmp.name[1 : -len(TMP_SUFFIX)].rsplit(".", 1)[0])
        if target in mine:
            tmp.unlink(missing_ok=True)
            removed += 1
    return removed


class OutputWriter:
    """Writes one input's outputs (map, picture) atomically, then its journal line: the same for both engines.

    Args:
        out: the output directory.
        settings: :func:`job_settings` (recorded in ``explain.json`` once the first map exists).
        journal: the open journal file (``OUT/_manifest/rank<R>-of-<N>.jsonl``).
        fmt: map format (:data:`FORMATS`; ``"none"``: no map file, the picture alone); ``map_dtype``: the map's
            stored dtype (:data:`MAP_DTYPES`).
        png: also the per-input picture (:func:`attr_engine.visualize.save_map_figure`); ``cmap`` / ``alpha``: its
            colours, ``layout`` (``"overlay"`` / ``"side-by-side"``) and ``max_side``: its arrangement and size.
        class_names: ``{class id: name}`` for the captions, where the names are known to be the classifier's
            (the caption says ``class 3`` otherwise).
    """

    def __init__(
        self,
        out: Path,
        settings: dict[str, Any],
        journal: IO[str],
        *,
        fmt: str,
        png: bool,
        cmap: str | None = None,
        alpha: float = 0.7,
        map_dtype: str = "float32",
        layout: str = "overlay",
        max_side: int = 2048,
        class_names: Mapping[int, str] | None = None,
    ) -> None:
        if fmt == "none" and not png:
            raise ValueError("format 'none' writes pictures only: it needs png=True")
        self.out, self.settings, self.journal = out, settings, journal
        self.fmt, self.png, self.cmap, self.alpha = fmt, png, cmap, alpha
        self.map_dtype, self.layout, self.max_side = map_dtype, layout, max_side
        self.class_names = dict(class_names or {})
        self.digest = settings_digest(settings)
        self.written: list[dict[str, Any]] = []
        self.recorded = False

    def write(self, result: ItemResult) -> None:
        """``result.map``: the map in its output frame, ``(h, w)`` (image) or ``(H, W)`` (model); ``result.shown``:
        the ``(3, ., .)`` float picture in [0, 1] its overlay is drawn on (needed with ``png``)."""
        from attr_engine.checkpoint import save_json

        item, amap = result.item, result.map
        assert amap is not None  # only results with a map are written
        if self.fmt != "none":
            meta = {"input": item.name, "method": self.settings["method"], "target": str(result.target)}
            if self.settings["frame"] == "image":
                meta["frame"] = "image"
            _write_map(_stored(amap.contiguous(), self.map_dtype, item.name), self.out / item.map_file, self.fmt, meta)
        if self.png:
            self._picture(result)
        # One line per finished input, after its files are in place: a kill before it redoes the input.
        line = {"output": item.map_file.as_posix(), "digest": self.digest, "time_ns": time.time_ns()}
        self.journal.write(json.dumps(line) + "\n")
        self.journal.flush()
        if not self.recorded:
            # Recorded once a map exists: a run that fails before leaves nothing to block a rerun.
            save_json(self.settings, self.out / SETTINGS_FILE)
            self.recorded = True
        self.written.append({"input": item.name, "output": item.map_file.as_posix(), "target": result.target})

    def _picture(self, result: ItemResult) -> None:
        """The input's picture: overlay, colour bar and the caption (method, class, probability)."""
        from attr_engine.visualize import figure_caption, save_map_figure

        assert result.shown is not None and result.map is not None  # the engines return the shown image with png
        name = self.class_names.get(result.target)
        caption = figure_caption(self.settings["method"], result.target, result.probability, name)
        save_map_figure(
            result.shown, result.map, self.out / result.item.png_file, caption=caption, layout=self.layout,
            cmap=self.cmap, alpha=self.alpha, max_side=self.max_side,
        )  # fmt: skip


def _stored(amap: torch.Tensor, dtype: str, name: str) -> torch.Tensor:
    """``amap (h, w)`` float32 as it is stored: itself, or float16 (NaN stays NaN); a map whose finite values
    overflow float16 is refused rather than stored as infinities."""
    import torch

    if dtype == "float32":
        return amap
    half = amap.half()
    if not torch.equal(torch.isfinite(half), torch.isfinite(amap)):
        big = float(amap[torch.isfinite(amap)].abs().max())
        raise ValueError(f"{name}: map values up to {big:.3g} exceed float16's range (65504): use --map-dtype float32")
    return half


def _write_map(amap: torch.Tensor, path: Path, fmt: str, meta: dict[str, str]) -> None:
    import numpy as np

    from attr_engine.checkpoint import atomic_write, save_safetensors

    if fmt == "npy":
        with atomic_write(path, "wb") as f:
            np.save(f, amap.numpy())
    else:
        save_safetensors({"map": amap}, path, meta)
