"""``explain``: attribution maps for an image file, a folder or an ImageFolder tree, resumable and shardable.

Every input ``root/a/b.jpg`` gets ``OUT/a/b.npy`` (or ``.safetensors``) and, with ``--png``, ``OUT/a/b.overlay.png``.
The classifier sees the image as timm's evaluation transform cuts it (resize the shorter side to
``input / crop_pct``, centre crop, the model's interpolation: :func:`attr_engine.imageops.data_config`); the map
is then written in the original image's frame, pixel for pixel aligned with it, the border the crop cut away
``NaN`` (and left uncoloured in the overlay). ``--model-frame`` keeps the map at the classifier's input size.
Every output is written atomically (temporary file, then rename), so a killed run leaves nothing half-written, and
running the same command again does only what is missing. An input counts as done when its outputs exist, read back
as valid files of the expected shape, *and* the journal says they were made with the current settings: after each
input's outputs are in place, a line naming them and a digest of the settings is appended to
``OUT/_manifest/rank<R>-of-<N>.jsonl``. So an interrupted ``--overwrite`` with other settings never passes old maps
off as new ones, and an output damaged after the fact is redone. Temporary files a killed run left next to this
process's outputs are removed on start.

``OUT/explain.json`` records the settings once the first map of a run exists (a run that fails before leaves no
record to block a corrected rerun); a later run with other settings is refused instead of silently mixing maps
(``--overwrite`` redoes everything).

Under ``torchrun --nproc_per_node=N -m attr_engine explain ...`` (or with ``RANK`` / ``WORLD_SIZE`` set by any
launcher) every process lists the same inputs and takes its round-robin share (:mod:`attr_engine.distributed`), so no
image is done twice or missed; no process group is needed. Each process writes its own maps and its own manifest,
``OUT/_manifest/rank<R>-of-<N>.json`` (inputs of its share, maps written, inputs already done, unreadable files).

With ``--engine ray`` (:mod:`attr_engine.ray`) a Ray Data actor pool computes the maps (``--actors``,
``--gpus-per-actor``; ``--address`` joins a running cluster) and this process writes them with the same code: the
same files, the same journal and settings, so either engine resumes the other's run. The actors get the batches
this loop would form, so deterministic methods give the same maps bit for bit.

Unreadable images are reported one line each and listed in the manifest; the others are still written and the exit
status stays 0 (a single unreadable input file is an error). A map with NaN or infinite values (outside the NaN
border of a map in the image's frame) is never written: it is reported and listed as ``failed``, the rest goes on,
and the exit status is 1.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attr_engine.claims import claim_output
from attr_engine.cli._common import (
    UsageError,
    add_classifier_args,
    add_device_arg,
    build_explainer,
    check_writable_dir,
    load_classifier_args,
    parse_key_values,
    resolve_device,
    resolve_method,
    work_started,
)

SETTINGS_FILE = "explain.json"
MANIFEST_DIR = "_manifest"
JOURNAL_SUFFIX = ".jsonl"
FORMATS = ("npy", "safetensors")
ENGINES = ("local", "ray")

# numpy and torch are imported where they are used: `attr-engine explain --help` must not load them.
if TYPE_CHECKING:
    import torch


def register(subparsers: Any) -> dict[str, argparse.ArgumentParser]:
    p = subparsers.add_parser(
        "explain",
        help="attribution maps for an image, a folder or an ImageFolder tree (resumable, shards under torchrun)",
        description="Attribution maps for an image file, a folder or an ImageFolder tree: one .npy / .safetensors "
        "map per image (plus an overlay PNG with --png), mirroring the input tree under --out. Each image is "
        "preprocessed as the classifier expects (timm's data config: resize, centre crop of crop_pct, "
        "interpolation) and its map is written at the image's own size, aligned with it; pixels the crop cut "
        "away are NaN (uncoloured in the overlay). Maps already written are skipped, so an interrupted run "
        "resumes; under torchrun every process takes its share.",
    )
    p.add_argument("input", metavar="INPUT", help="an image file, a folder of images, or an ImageFolder tree")
    p.add_argument("--out", "-o", default="attributions", help="output directory (default: ./attributions)")
    add_classifier_args(p)
    p.add_argument(
        "--method",
        default=None,
        help="aha (needs --aha), pullback (= pullback-ascent), pullback-soft, or any baseline: gradient, "
        "saliency, gradient-x-input, integrated-gradients, smoothgrad, occlusion, grad-cam, rise, "
        "attention-rollout, deeplift, guided-grad-cam, captum:<Class>; or a method registered with "
        "attr_engine.register_explainer or a plugin (entry-point group attr_engine.explainers). "
        "Default: aha with --aha, pullback without.",
    )
    p.add_argument("--aha", metavar="DIR", help="trained AHA checkpoint directory (train-aha or demo output)")
    p.add_argument("--refine-steps", type=int, default=0, help="AHA test-time refinement steps T (default 0)")
    p.add_argument("--option", action="append", metavar="KEY=VALUE", help="method option, e.g. n_masks=2000 for rise")
    p.add_argument(
        "--target",
        default="pred",
        help="class to explain: pred (the predicted class, default), label (the ImageFolder class), or an index",
    )
    p.add_argument("--format", choices=FORMATS, default="npy", help="map file format: npy (default) or safetensors")
    p.add_argument("--png", action="store_true", help="also write a heat-map overlay PNG per image")
    p.add_argument(
        "--cmap",
        help="matplotlib colour map of the overlays (default: RdBu_r, centred at 0, for signed maps; inferno for "
        "non-negative ones)",
    )
    p.add_argument(
        "--alpha", type=float, default=0.7, help="overlay opacity of the strongest values, 0 to 1 (default 0.7)"
    )
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--img-size", type=int, help="input side (default: the classifier's, else 224)")
    p.add_argument(
        "--crop-pct",
        type=float,
        help="fraction of the resized image the centre crop keeps (default: timm's for --model, e.g. 0.95 for "
        "ResNets, 0.9 for ViTs; 1.0 for a --classifier checkpoint, trained on whole frames)",
    )
    p.add_argument(
        "--model-frame",
        action="store_true",
        help="write maps at the classifier's input size (the cropped square) instead of the image's frame",
    )
    p.add_argument("--workers", type=int, default=0, help="image-decoding worker processes")
    p.add_argument(
        "--seed", type=int, default=0, help="seeds torch's RNG and AHA refinement (rise, smoothgrad: --option seed=N)"
    )
    p.add_argument("--overwrite", action="store_true", help="redo maps that already exist")
    p.add_argument("--limit", type=int, help="make at most this many new maps in this run (chunked runs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_device_arg(p)
    scale = p.add_argument_group("engine (Ray Data: pip install 'attr-engine[ray]')")
    scale.add_argument(
        "--engine",
        choices=ENGINES,
        default="local",
        help="local (default: this process, or one process per rank under torchrun) or ray (a Ray Data job: an "
        "actor pool loads the classifier and method once per actor; same outputs, same resume)",
    )
    scale.add_argument(
        "--address",
        metavar="ADDR",
        help="with --engine ray: the Ray cluster to join (e.g. ray://head:10001, or auto); default: $RAY_ADDRESS, "
        "else a local cluster on this machine. INPUT must be readable at the same path on every node",
    )
    scale.add_argument("--actors", type=int, help="with --engine ray: actors in the pool (default 1)")
    scale.add_argument(
        "--verbose",
        action="store_true",
        help="with --engine ray: show Ray's own start-up and progress messages (hidden by default)",
    )
    scale.add_argument(
        "--gpus-per-actor",
        type=float,
        help="with --engine ray: GPUs each actor reserves; 0.5 runs two actors per GPU (default: 1 when the "
        "cluster has GPUs and --device is not cpu, else 0)",
    )
    p.set_defaults(run=run_explain)
    return {"explain": p}


@dataclass(frozen=True)
class Item:
    """One input image and where its outputs go (paths relative to the output directory)."""

    path: Path
    name: str
    label: int
    map_file: Path
    png_file: Path


def list_inputs(src: Path, fmt: str) -> tuple[list[Item], Any]:
    """Every input image under ``src`` in a stable order, and the dataset object that decodes them.

    Output names mirror the input tree with the image suffix replaced; inputs that would collide (``a.png`` and
    ``a.jpg`` in one folder) keep their suffix in the name instead (``a.png.npy``).
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
        items.append(
            Item(path, r.as_posix(), label, Path(f"{base.as_posix()}.{fmt}"), Path(f"{base.as_posix()}.overlay.png"))
        )
    return items, reader


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

    def __init__(self, items: list[Item], reader: Any, config: Any, keep_original: bool) -> None:
        self.items, self.reader, self.config, self.keep_original = items, reader, config, keep_original

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> _Input:
        item = self.items[i]
        try:
            img = self.reader._decode(item.path)
        except ValueError as err:
            return _Input(item, None, error=str(err))
        from attr_engine.imageops import prepare_input

        return _Input(item, *prepare_input(img, self.config, self.keep_original))


def _settings(args: argparse.Namespace, method: str, options: dict[str, Any], classifier: Any, config: Any) -> dict:
    from attr_engine.aha.persistence import classifier_fingerprint

    settings = {
        "method": method,
        "options": options,
        "target": args.target,
        "format": args.format,
        "img_size": config.input_size[0],
        "preprocess": config.to_dict(),
        "frame": "model" if args.model_frame else "image",
        "classifier": classifier_fingerprint(classifier),
    }
    if method == "aha":
        from attr_engine.aha.persistence import WEIGHTS_FILE, checkpoint_dir

        # The explainer's identity is its weights, not its path: a moved checkpoint still matches, a retrained not.
        digest = hashlib.sha256()
        with open(checkpoint_dir(args.aha) / WEIGHTS_FILE, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        settings["aha"] = digest.hexdigest()[:16]
        settings["refine_steps"] = args.refine_steps
    return settings


def _check_settings(out: Path, settings: dict[str, Any], overwrite: bool) -> None:
    """Refuse to add maps made with other settings to ``out`` (unless ``overwrite``); nothing is written here."""
    from attr_engine.checkpoint import load_json

    path = out / SETTINGS_FILE
    if path.is_file() and not overwrite:
        try:
            previous = load_json(path)
        except ValueError:
            previous = None  # unreadable: the journal still tells which maps match these settings
        if not isinstance(previous, dict):
            return
        changed = [k for k in settings if previous.get(k) != settings[k]]
        if changed:
            diff = ", ".join(f"{k} {previous.get(k)!r} -> {settings[k]!r}" for k in changed)
            raise UsageError(
                f"{out} holds maps made with other settings ({diff}); use another --out, or --overwrite to redo them"
            )


def settings_digest(settings: dict[str, Any]) -> str:
    """A short hash of the settings, recorded with every output in the journal."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


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


def valid_output(path: Path, fmt: str, shape: tuple[int, int] | None = None) -> bool:
    """Whether ``path`` reads back as a complete 2-D float32 map (``fmt``) - of ``shape`` when given (maps in an
    image's frame take that image's size) - or a complete PNG (``"png"``)."""

    def fits(got: tuple[int, ...]) -> bool:
        return len(got) == 2 and (shape is None or got == tuple(shape))

    import numpy as np

    if not path.is_file():
        return False
    try:
        if fmt == "npy":
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
            return fits(arr.shape) and arr.dtype == np.float32
        if fmt == "safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                return "map" in f.keys() and fits(tuple(f.get_slice("map").get_shape()))
        from PIL import Image

        with Image.open(path) as im:
            im.verify()  # reads every chunk and checks its CRC: a truncated or damaged file fails
        return True
    except Exception:  # any failure to read it back means "not a usable output"
        return False


def _remove_stale_temporaries(out: Path, items: list[Item], rank: int, world: int) -> int:
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


def _target_tensor(spec: str, items: list[Item]) -> torch.Tensor | None:
    import torch

    if spec == "pred":
        return None
    if spec == "label":
        return torch.tensor([item.label for item in items])
    return torch.full((len(items),), int(spec))


def _write_map(amap: torch.Tensor, path: Path, fmt: str, meta: dict[str, str]) -> None:
    import numpy as np

    from attr_engine.checkpoint import atomic_write, save_safetensors

    if fmt == "npy":
        with atomic_write(path, "wb") as f:
            np.save(f, amap.numpy())
    else:
        save_safetensors({"map": amap}, path, meta)


class _Outputs:
    """Writes one input's outputs (map, overlay) atomically, then its journal line: the same for both engines."""

    def __init__(self, args: argparse.Namespace, out: Path, method: str, settings: dict, journal_file: Any) -> None:
        self.args, self.out, self.method, self.settings, self.journal_file = args, out, method, settings, journal_file
        self.digest = settings_digest(settings)
        self.written: list[dict[str, Any]] = []
        self.recorded = False

    def write(self, item: Item, amap: torch.Tensor, shown: torch.Tensor | None, target: int) -> None:
        """``amap``: the map in its output frame, ``(h, w)`` (image) or ``(H, W)`` (model); ``shown``: the
        ``(3, ., .)`` float picture in [0, 1] its overlay is drawn on (needed with ``--png``)."""
        from attr_engine.checkpoint import save_json
        from attr_engine.visualize import save_overlay

        args = self.args
        meta = {"input": item.name, "method": self.method, "target": str(target)}
        if not args.model_frame:
            meta["frame"] = "image"
        _write_map(amap.contiguous(), self.out / item.map_file, args.format, meta)
        if args.png:
            assert shown is not None  # the callers decode the shown image exactly when --png asks for it
            save_overlay(shown, amap, self.out / item.png_file, cmap=args.cmap, alpha=args.alpha)
        # One line per finished input, after its files are in place: a kill before it redoes the input.
        line = {"output": item.map_file.as_posix(), "digest": self.digest, "time_ns": time.time_ns()}
        self.journal_file.write(json.dumps(line) + "\n")
        self.journal_file.flush()
        if not self.recorded:
            # Recorded once a map exists: a run that fails before leaves nothing to block a rerun.
            save_json(self.settings, self.out / SETTINGS_FILE)
            self.recorded = True
        self.written.append({"input": item.name, "output": item.map_file.as_posix(), "target": target})


def _check_engine_args(args: argparse.Namespace) -> None:
    if args.engine != "ray":
        for flag in ("address", "actors", "gpus_per_actor"):
            if getattr(args, flag) is not None:
                raise UsageError(f"--{flag.replace('_', '-')} applies to --engine ray only")
        if args.verbose:
            raise UsageError("--verbose applies to --engine ray only")
        return
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise UsageError("--engine ray needs Ray Data: pip install 'attr-engine[ray]' (or 'ray[data]')")
    if args.actors is None:
        args.actors = 1
    if args.actors < 1:
        raise UsageError(f"--actors must be >= 1, got {args.actors}")
    if args.gpus_per_actor is not None and not args.gpus_per_actor >= 0:
        raise UsageError(f"--gpus-per-actor must be >= 0, got {args.gpus_per_actor}")


def run_explain(args: argparse.Namespace) -> int:
    # The stack holds the claim on the output directory (attr_engine.claims) from the settings check to the end.
    with contextlib.ExitStack() as stack:
        return _run_explain(args, stack)


def _run_explain(args: argparse.Namespace, stack: contextlib.ExitStack) -> int:
    import torch
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    from attr_engine.checkpoint import save_json
    from attr_engine.distributed import process_rank, shard
    from attr_engine.explainer import NONFINITE_MAP, explain_batch, finite_maps
    from attr_engine.imageops import data_config, to_image_frame

    _check_engine_args(args)
    if not 0.0 <= args.alpha <= 1.0:
        raise UsageError(f"--alpha must be between 0 and 1, got {args.alpha}")
    if args.cmap is not None:
        from matplotlib import colormaps

        if args.cmap not in colormaps:
            raise UsageError(f"--cmap: unknown matplotlib colour map {args.cmap!r} (e.g. RdBu_r, inferno, viridis)")
    for flag in ("batch_size", "limit", "img_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.target not in ("pred", "label") and not args.target.lstrip("-").isdigit():
        raise UsageError(f"--target must be pred, label or a class index, got {args.target!r}")
    try:
        rank, world = process_rank()
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.engine == "ray" and world > 1:
        raise UsageError("--engine ray schedules its own workers: run it once, not under torchrun (RANK / WORLD_SIZE)")
    src, out = Path(args.input), Path(args.out)
    if not src.exists():
        raise UsageError(f"input not found: {src}")
    if src.is_dir() and (out.resolve() == src.resolve() or src.resolve() in out.resolve().parents):
        raise UsageError(f"--out {out} lies inside the input folder {src}; its maps would be read as inputs")
    gpus_per_actor = 0.0
    if args.engine == "ray":
        from attr_engine.ray import plan_actors, ray_session

        # Connected before anything is loaded or written: an unreachable cluster, a cluster without the GPUs or
        # CPUs asked for, or --device cuda without GPUs fails here in one line, with nothing left behind.
        stack.enter_context(ray_session(args.address, verbose=args.verbose))
        local_cluster = not (args.address or os.environ.get("RAY_ADDRESS"))
        gpus_per_actor = plan_actors(args.actors, args.gpus_per_actor, args.device, strict=local_cluster)
    # Resolved once: the canonical name is what the settings record and every check below compares.
    method = resolve_method(args.method or ("aha" if args.aha else "pullback"))
    options = parse_key_values(args.option, "--option")

    items, reader = list_inputs(src, args.format)
    unlabelled = sum(item.label < 0 for item in items)
    if args.target == "label" and unlabelled == len(items):
        raise UsageError("--target label needs an ImageFolder tree (one subfolder per class)")
    if args.target == "label" and unlabelled:
        raise UsageError(
            f"--target label: {unlabelled} image(s) directly in {src} are in no class folder; move them into one or "
            "explain them with another --target"
        )
    # With Ray the driver only checks the settings and writes: the actors hold the classifier on their devices. The
    # build is seeded as every actor's is, so random weights (--model alone) are the same everywhere.
    device = resolve_device("cpu" if args.engine == "ray" else args.device)
    classifier = load_classifier_args(args, device, img_size=args.img_size, seed=args.seed)
    img_size = args.img_size or (classifier.input_size[1] if classifier.input_size else 224)
    # A train-classifier / demo checkpoint learnt on whole frames (resized, crop_pct 1.0); a timm model on timm's crop.
    crop_pct = args.crop_pct if args.crop_pct is not None else (1.0 if args.classifier else None)
    try:
        config = data_config(classifier, img_size=img_size, crop_pct=crop_pct)
    except ValueError as err:
        raise UsageError(f"--crop-pct: {err}") from None
    model_shape = config.input_size if args.model_frame else None
    explainer = build_explainer(
        method, classifier, aha_dir=args.aha, refine_steps=args.refine_steps, seed=args.seed, options=options
    )
    num_classes = classifier.num_classes
    if args.target not in ("pred", "label") and not 0 <= int(args.target) < num_classes:
        raise UsageError(f"--target {args.target} is not a class of this classifier (0 to {num_classes - 1})")
    if args.target == "label" and any(item.label >= num_classes for item in items):
        raise UsageError(f"--target label: the tree has more class folders than the classifier's {num_classes} classes")
    out = check_writable_dir(out)
    settings = _settings(args, method, options, classifier, config)
    digest = settings_digest(settings)
    # One directory, one digest: a live job with other settings refuses this one, and the recorded settings are
    # compared under the same lock, so two jobs started together cannot both pass.
    sharing = stack.enter_context(
        claim_output(out, digest, f"method {method}", check=lambda: _check_settings(out, settings, args.overwrite))
    )

    mine = shard(items, rank, world)
    if world > 1 or not sharing:
        # Alone (or one of disjoint shards): temporaries of this process's outputs are a killed run's leftovers. A
        # job with the same settings in the same directory may be writing them right now: left alone then.
        _remove_stale_temporaries(out, mine, rank, world)
    journal = {} if args.overwrite else read_journal(out)

    def done(item: Item) -> bool:
        if journal.get(item.map_file.as_posix()) != digest:
            return False  # missing, or made with other settings (an interrupted --overwrite)
        if not valid_output(out / item.map_file, args.format, model_shape):
            return False
        return not args.png or valid_output(out / item.png_file, "png")

    finished = [False] * len(mine) if args.overwrite else [done(item) for item in mine]
    todo = [item for item, f in zip(mine, finished, strict=True) if not f]
    already = [item.name for item, f in zip(mine, finished, strict=True) if f]
    # --limit counts maps written: unreadable files among the inputs do not use it up (the loop stops at the limit).
    limit = len(todo) if args.limit is None else args.limit

    unreadable: list[dict[str, str]] = []
    failed: list[dict[str, str]] = []
    keep_original = args.png and not args.model_frame
    start = time.perf_counter()
    bar = tqdm(total=min(len(todo), limit), desc=f"explain [{rank}/{world}]" if world > 1 else "explain", unit="img",
               disable=args.no_progress or not todo, dynamic_ncols=True)  # fmt: skip
    work_started()
    torch.manual_seed(args.seed)
    journal_path = out / MANIFEST_DIR / f"rank{rank}-of-{world}{JOURNAL_SUFFIX}"
    journal_path.parent.mkdir(parents=True, exist_ok=True)

    def failure(item: Item, error: str) -> None:
        # Not an unreadable input: the method failed on a good one. Reported, never written, and the exit status.
        failed.append({"input": item.name, "reason": error})
        bar.write(f"attr-engine explain: error: {item.name}: {error}; not written", file=sys.stderr)

    def skipped(item: Item, error: str) -> None:
        unreadable.append({"input": item.name, "reason": error})
        if src.is_dir():  # a single input file that cannot be read is the error reported below
            bar.write(f"attr-engine explain: warning: skipped unreadable input: {error}", file=sys.stderr)

    with bar, open(journal_path, "a", encoding="utf-8") as journal_file:
        outputs = _Outputs(args, out, method, settings, journal_file)
        written = outputs.written
        if args.engine == "ray" and todo and limit > 0:
            from attr_engine.ray import explain_items

            # The actors get exactly the batches the local engine forms (chunks of `todo`), so their maps are the
            # local engine's bit for bit; the outputs are written here, by the same code.
            results = explain_items(
                todo,
                args,
                method=method,
                options=options,
                config=config,
                fingerprint=settings["classifier"],
                num_gpus=gpus_per_actor,
            )
            for result in results:
                if result.error == NONFINITE_MAP:
                    failure(result.item, result.error)
                elif result.error is not None:
                    skipped(result.item, result.error)
                else:
                    assert result.map is not None  # an ItemResult without an error carries its map
                    outputs.write(result.item, result.map, result.shown, result.target)
                    bar.update(1)
                if len(written) >= limit:
                    break
        elif args.engine == "local":
            decoded = _Decoded(todo, reader, config, keep_original=keep_original)
            # _Decoded is map-style by protocol (see its docstring), not a torch Dataset subclass.
            loader: DataLoader[Any] = DataLoader(
                decoded,  # type: ignore[arg-type]
                batch_size=args.batch_size,
                num_workers=args.workers,
                collate_fn=list,
            )
            for batch in loader:
                if len(written) >= limit:
                    break
                good = []
                for entry in batch:
                    if entry.error is None:
                        good.append(entry)
                    else:
                        skipped(entry.item, entry.error)
                good = good[: limit - len(written)]
                if good:
                    x = torch.stack([entry.x for entry in good]).to(device)
                    target = _target_tensor(args.target, [entry.item for entry in good])
                    maps, target = explain_batch(classifier, explainer, x, target)
                    finite = finite_maps(maps)
                    for entry, image, amap, t, ok in zip(good, x.cpu(), maps, target.tolist(), finite, strict=True):
                        if not ok:
                            failure(entry.item, NONFINITE_MAP)
                            continue
                        if not args.model_frame:
                            amap = to_image_frame(amap, entry.size, config)
                        shown = (image if args.model_frame else entry.original.float().div_(255)) if args.png else None
                        outputs.write(entry.item, amap, shown, t)
                bar.update(len(good))

    if src.is_file() and unreadable:
        raise UsageError(unreadable[0]["reason"])
    seconds = time.perf_counter() - start
    save_json(
        {
            "rank": rank,
            "world_size": world,
            "inputs": [item.name for item in mine],
            "written": written,
            "already_done": already,
            "unreadable": unreadable,
            "failed": failed,
            "seconds": round(seconds, 3),
        },
        out / MANIFEST_DIR / f"rank{rank}-of-{world}.json",
    )
    who = f"rank {rank}/{world}: " if world > 1 else ""
    notes = [f"{len(already)} already done"] if already else []
    if unreadable:
        notes.append(f"{len(unreadable)} unreadable")
    if failed:
        notes.append(f"{len(failed)} failed: non-finite maps, not written")
    left = len(mine) - len(already) - len(written) - len(unreadable) - len(failed)
    if left > 0:
        notes.append(f"{left} left for a later run")
    note = f" ({', '.join(notes)})" if notes else ""
    print(f"{who}{len(written)} {method} map(s) written to {out}{note} in {seconds:.1f} s")
    return 1 if failed else 0
