"""``explain``: attribution maps for an image file, a folder or an ImageFolder tree, resumable and shardable.

Every input ``root/a/b.jpg`` gets ``OUT/a/b.npy`` (or ``.safetensors``; ``--map-dtype float16`` halves it) and, with
``--png``, ``OUT/a/b.overlay.png``: the overlay with its colour bar and a caption (method, class, probability),
optionally beside the image (``--png-layout side-by-side``), drawn at a display size (``--png-max-side``) while
the map keeps the image's own resolution. ``--format none --png`` writes the pictures alone.
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

Sharding (``torchrun``, or ``RANK`` / ``WORLD_SIZE`` from any launcher: each process takes its round-robin share)
and ``--engine ray`` (a Ray Data actor pool computes, this process writes the same files and journal): see
docs/explain.md.

Unreadable images are reported one line each and listed in the manifest; the others are still written and the exit
status stays 0 (a single unreadable input file is an error). A map with NaN or infinite values (outside the NaN
border of a map in the image's frame) is never written: it is reported and listed as ``failed``, the rest goes on,
and the exit status is 1.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attr_engine.claims import claim_output
from attr_engine.cli._common import (
    UsageError,
    add_classifier_args,
    add_device_arg,
    build_explainer,
    check_cost,
    check_writable_dir,
    load_classifier_args,
    parse_key_values,
    resolve_device,
    resolve_method,
    work_started,
)

# jobs.FORMATS, repeated so the parser can be built without importing the job layer (it imports torch).
FORMATS = ("npy", "safetensors", "none")
MAP_DTYPES = ("float32", "float16")
PNG_LAYOUTS = ("overlay", "side-by-side")
MIN_PNG_MAX_SIDE = 256
ENGINES = ("local", "ray")

# torch and the job layer are imported where they are used: `attr-engine explain --help` must not load them.
if TYPE_CHECKING:
    from attr_engine.jobs import AttributionJob, Item, ItemResult


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
        help="the attribution method: any name 'attr-engine methods' lists (the registry's built-ins, aliases, "
        "captum:<Class>, gradcam:<Class> and plug-ins); aha needs --aha. Default: aha with --aha, pullback (Pullback "
        "Ascent) without.",
    )
    p.add_argument("--aha", metavar="DIR", help="trained AHA checkpoint directory (train-aha or demo output)")
    p.add_argument("--refine-steps", type=int, default=0, help="AHA test-time refinement steps T (default 0)")
    p.add_argument("--option", action="append", metavar="KEY=VALUE", help="method option, e.g. n_masks=2000 for rise")
    p.add_argument(
        "--target",
        default="pred",
        help="class to explain: pred (the predicted class, default), label (the ImageFolder class), or an index",
    )
    _add_output_args(p)
    p.add_argument("--batch-size", type=int, default=16, help="images per explainer call (default 16)")
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
    p.add_argument(
        "--workers", type=int, default=0, help="image-decoding worker processes (default 0: in this process)"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds torch's RNG and AHA refinement (default 0; rise, smoothgrad: --option seed=N)",
    )
    p.add_argument("--overwrite", action="store_true", help="redo maps that already exist")
    p.add_argument("--limit", type=int, help="make at most this many new maps in this run (chunked runs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_device_arg(p)
    _add_engine_args(p)
    p.set_defaults(run=run_explain)
    return {"explain": p}


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="npy",
        help="map file format: npy (default), safetensors, or none (no map files: the --png pictures alone)",
    )
    p.add_argument(
        "--map-dtype",
        choices=MAP_DTYPES,
        default="float32",
        help="dtype of the stored maps: float32 (default) or float16 (half the bytes; about 3 significant digits, "
        "values below 6e-5 lose precision, a map beyond 65504 is refused)",
    )
    p.add_argument(
        "--png",
        action="store_true",
        help="also write a picture per image: the heat-map overlay with a colour bar and a caption (method, class, "
        "probability), at least 256 px on its short side (bilinear resizing)",
    )
    p.add_argument(
        "--png-layout",
        choices=PNG_LAYOUTS,
        default="overlay",
        help="with --png: overlay (default) or side-by-side (the image, then the overlay)",
    )
    p.add_argument(
        "--png-max-side",
        type=int,
        default=2048,
        help="with --png: no side of a picture is longer than this many pixels (default 2048); the map file keeps "
        "the image's own resolution",
    )
    p.add_argument(
        "--cmap",
        help="matplotlib colour map of the overlays (default: RdBu_r, centred at 0, for signed maps; inferno for "
        "non-negative ones)",
    )
    p.add_argument(
        "--alpha", type=float, default=0.7, help="overlay opacity of the strongest values, 0 to 1 (default 0.7)"
    )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
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


def _check_args(args: argparse.Namespace) -> tuple[int, int]:
    """Check the flags that need no model; returns this process's ``(rank, world size)``."""
    from attr_engine.distributed import process_rank

    _check_engine_args(args)
    if args.format == "none" and not args.png:
        raise UsageError("--format none writes no maps: it needs --png (the pictures are then the only output)")
    if args.format == "none" and args.map_dtype != "float32":
        raise UsageError("--map-dtype applies to map files: not with --format none")
    if args.png_max_side < MIN_PNG_MAX_SIDE:
        raise UsageError(f"--png-max-side must be >= {MIN_PNG_MAX_SIDE}, got {args.png_max_side}")
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
    return rank, world


def _check_labels(args: argparse.Namespace, items: list[Item], num_classes: int | None = None) -> None:
    """``--target label`` needs every input in a class folder (and, with ``num_classes``, no more folders)."""
    if args.target != "label":
        return
    unlabelled = sum(item.label < 0 for item in items)
    if unlabelled == len(items):
        raise UsageError("--target label needs an ImageFolder tree (one subfolder per class)")
    if unlabelled:
        raise UsageError(
            f"--target label: {unlabelled} image(s) directly in {args.input} are in no class folder; move them into "
            "one or explain them with another --target"
        )
    if num_classes is not None and any(item.label >= num_classes for item in items):
        raise UsageError(f"--target label: the tree has more class folders than the classifier's {num_classes} classes")


@dataclass
class _Run:
    """One ``explain`` run once its settings are checked: the job, where it writes, and what is left to do."""

    job: AttributionJob
    out: Path
    settings: dict[str, Any]
    mine: list[Item]
    todo: list[Item]
    already: list[str]
    rank: int
    world: int
    limit: int
    classifier: Any = None
    explainer: Any = None
    config: Any = None  # the DataConfig every input is cut with
    gpus_per_actor: float = 0.0
    sharing: int = 0  # other live jobs of the same settings in the output directory
    class_names: dict[int, str] = field(default_factory=dict)  # the captions' names, where known
    written: list[dict[str, Any]] = field(default_factory=list)
    unreadable: list[dict[str, str]] = field(default_factory=list)
    failed: list[dict[str, str]] = field(default_factory=list)


def _build_job(args: argparse.Namespace, stack: contextlib.ExitStack) -> _Run:
    """Everything ``explain`` checks before it starts: flags, cluster, method, inputs, classifier, output."""
    import dataclasses

    from attr_engine import jobs
    from attr_engine.imageops import data_config

    rank, world = _check_args(args)
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
    items = jobs.list_inputs(Path(args.input), args.format)
    _check_labels(args, items)
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
    explainer = build_explainer(
        method, classifier, aha_dir=args.aha, refine_steps=args.refine_steps, seed=args.seed, options=options
    )
    check_cost(explainer, img_size, args.max_cost, method)
    num_classes = classifier.num_classes
    if args.target not in ("pred", "label") and not 0 <= int(args.target) < num_classes:
        raise UsageError(f"--target {args.target} is not a class of this classifier (0 to {num_classes - 1})")
    _check_labels(args, items, num_classes)
    job = jobs.AttributionJob(
        method=method, classifier=args.classifier, model=args.model, pretrained=args.pretrained,
        num_classes=args.num_classes, img_size=args.img_size, preprocess=config, aha=args.aha,
        refine_steps=args.refine_steps, seed=args.seed, options=options,
        target=args.target if args.target in ("pred", "label") else int(args.target),
        frame="model" if args.model_frame else "image", return_images=args.png, device=args.device,
        batch_size=args.batch_size,
    )  # fmt: skip
    run = _claim_output(args, stack, job, classifier, config, rank, world)
    job = dataclasses.replace(job, fingerprint=run.settings["classifier"])
    run.job, run.classifier, run.explainer, run.config = job, classifier, explainer, config
    run.gpus_per_actor = gpus_per_actor
    run.class_names = _class_names(args, items, classifier)
    return _plan(args, run, items)


def _class_names(args: argparse.Namespace, items: list[Item], classifier: Any) -> dict[int, str]:
    """``{class id: name}`` for the captions, only where the names are known to be the classifier's classes.

    With ``--target label`` the explained class *is* an ImageFolder label, so its folder's name is that class's
    name (the user asserts the folders are the classifier's classes by asking for labels). A ``--classifier``
    checkpoint written by ``train-classifier`` has a ``train.json`` beside it listing the classes it was trained
    on: used when it names this model and as many classes as the classifier has. Otherwise none: the caption
    says ``class 3``.
    """
    if not args.png:
        return {}
    if args.target == "label":
        return {item.label: Path(item.name).parts[0] for item in items if item.label >= 0}
    if args.classifier:
        import json

        try:
            record = json.loads((Path(args.classifier).parent / "train.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        classes = record.get("classes") if isinstance(record, dict) else None
        if (
            isinstance(classes, list)
            and len(classes) == classifier.num_classes
            and all(isinstance(c, str) for c in classes)
            and record.get("model") == getattr(classifier, "model_name", None)
        ):
            return dict(enumerate(classes))
    return {}


def _claim_output(
    args: argparse.Namespace,
    stack: contextlib.ExitStack,
    job: AttributionJob,
    classifier: Any,
    config: Any,
    rank: int,
    world: int,
) -> _Run:
    """Make the output directory this job's: writable, with no other settings recorded or being written."""
    from attr_engine import jobs

    out = check_writable_dir(Path(args.out))
    settings = jobs.job_settings(job, args.format, classifier, config, map_dtype=args.map_dtype)
    digest = jobs.settings_digest(settings)
    # One directory, one digest: a live job with other settings refuses this one, and the recorded settings are
    # compared under the same lock, so two jobs started together cannot both pass.
    check = functools.partial(_refuse_other_settings, out, settings, args.overwrite)
    sharing = stack.enter_context(claim_output(out, digest, f"method {settings['method']}", check=check))
    return _Run(job, out, settings, mine=[], todo=[], already=[], rank=rank, world=world, limit=0, sharing=sharing)


def _refuse_other_settings(out: Path, settings: dict[str, Any], overwrite: bool) -> None:
    from attr_engine import jobs

    try:
        jobs.check_recorded_settings(out, settings, overwrite)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _plan(args: argparse.Namespace, run: _Run, items: list[Item]) -> _Run:
    """This process's share of the inputs, the stale temporaries removed, and what is still to do."""
    from attr_engine import jobs
    from attr_engine.distributed import shard

    run.mine = shard(items, run.rank, run.world)
    if run.world > 1 or not run.sharing:
        # Alone (or one of disjoint shards): temporaries of this process's outputs are a killed run's leftovers. A
        # job with the same settings in the same directory may be writing them right now: left alone then.
        jobs.remove_stale_temporaries(run.out, run.mine, run.rank, run.world)
    journal = {} if args.overwrite else jobs.read_journal(run.out)
    digest = jobs.settings_digest(run.settings)
    model_shape = run.config.input_size if args.model_frame else None

    def done(item: Item) -> bool:
        if journal.get(item.map_file.as_posix()) != digest:
            return False  # missing, or made with other settings (an interrupted --overwrite)
        if not jobs.valid_output(run.out / item.map_file, args.format, model_shape, args.map_dtype):
            return False
        return not args.png or jobs.valid_output(run.out / item.png_file, "png")

    finished = [False] * len(run.mine) if args.overwrite else [done(item) for item in run.mine]
    run.todo = [item for item, f in zip(run.mine, finished, strict=True) if not f]
    run.already = [item.name for item, f in zip(run.mine, finished, strict=True) if f]
    # --limit counts maps written: unreadable files among the inputs do not use it up.
    run.limit = len(run.todo) if args.limit is None else args.limit
    return run


def run_explain(args: argparse.Namespace) -> int:
    # The stack holds the Ray session and the claim on the output directory (attr_engine.claims) to the end.
    with contextlib.ExitStack() as stack:
        run = _build_job(args, stack)
        work_started()
        seconds = _work(args, run)
        return _report(args, run, seconds)


def _results(args: argparse.Namespace, run: _Run) -> Any:
    """The engine's results for the inputs still to do: the local loop, or the Ray job over the same batches."""
    from attr_engine import jobs

    if not run.todo or run.limit <= 0:
        return iter(())
    if args.engine == "ray":
        from attr_engine.ray import explain_items

        return explain_items(
            run.job, run.todo, actors=args.actors, num_gpus=run.gpus_per_actor, address=args.address,
            verbose=args.verbose,
        )  # fmt: skip
    return jobs.run(
        run.job, run.todo, classifier=run.classifier, explainer=run.explainer,
        config=run.config, limit=run.limit, workers=args.workers,
    )  # fmt: skip


def _work(args: argparse.Namespace, run: _Run) -> float:
    """Write every result of the engine (one writer for both engines); returns the seconds it took."""
    from tqdm.auto import tqdm

    from attr_engine import jobs

    start = time.perf_counter()
    name = f"explain [{run.rank}/{run.world}]" if run.world > 1 else "explain"
    bar = tqdm(total=min(len(run.todo), run.limit), desc=name, unit="img",
               disable=args.no_progress or not run.todo, dynamic_ncols=True)  # fmt: skip
    journal_path = run.out / jobs.MANIFEST_DIR / f"rank{run.rank}-of-{run.world}{jobs.JOURNAL_SUFFIX}"
    journal_path.parent.mkdir(parents=True, exist_ok=True)
    with bar, open(journal_path, "a", encoding="utf-8") as journal:
        writer = jobs.OutputWriter(
            run.out, run.settings, journal, fmt=args.format, png=args.png, cmap=args.cmap, alpha=args.alpha,
            map_dtype=args.map_dtype, layout=args.png_layout, max_side=args.png_max_side,
            class_names=run.class_names,
        )  # fmt: skip
        run.written = writer.written
        for result in _results(args, run):
            _take(result, run, writer, bar, Path(args.input).is_dir())
            if len(writer.written) >= run.limit:
                break
    return time.perf_counter() - start


def _take(result: ItemResult, run: _Run, writer: Any, bar: Any, folder: bool) -> None:
    """Write one result, or report why it has no map."""
    if result.failed:
        # Not an unreadable input: the method failed on a good one. Reported, never written, and the exit status.
        run.failed.append({"input": result.item.name, "reason": str(result.error)})
        bar.write(f"attr-engine explain: error: {result.item.name}: {result.error}; not written", file=sys.stderr)
    elif result.error is not None:
        run.unreadable.append({"input": result.item.name, "reason": result.error})
        if folder:  # a single input file that cannot be read is the error reported at the end
            bar.write(f"attr-engine explain: warning: skipped unreadable input: {result.error}", file=sys.stderr)
    else:
        writer.write(result)
        bar.update(1)


def _report(args: argparse.Namespace, run: _Run, seconds: float) -> int:
    """The manifest of this process's share and the one summary line; the exit status."""
    from attr_engine import jobs
    from attr_engine.checkpoint import save_json

    if Path(args.input).is_file() and run.unreadable:
        raise UsageError(run.unreadable[0]["reason"])
    written = run.written
    save_json(
        {
            "rank": run.rank,
            "world_size": run.world,
            "inputs": [item.name for item in run.mine],
            "written": written,
            "already_done": run.already,
            "unreadable": run.unreadable,
            "failed": run.failed,
            "seconds": round(seconds, 3),
        },
        run.out / jobs.MANIFEST_DIR / f"rank{run.rank}-of-{run.world}.json",
    )
    who = f"rank {run.rank}/{run.world}: " if run.world > 1 else ""
    notes = [f"{len(run.already)} already done"] if run.already else []
    if run.unreadable:
        notes.append(f"{len(run.unreadable)} unreadable")
    if run.failed:
        notes.append(f"{len(run.failed)} failed: non-finite maps, not written")
    left = len(run.mine) - len(run.already) - len(written) - len(run.unreadable) - len(run.failed)
    if left > 0:
        notes.append(f"{left} left for a later run")
    note = f" ({', '.join(notes)})" if notes else ""
    print(f"{who}{len(written)} {run.settings['method']} map(s) written to {run.out}{note} in {seconds:.1f} s")
    return 1 if run.failed else 0
