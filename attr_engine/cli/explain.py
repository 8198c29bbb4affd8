"""``explain``: attribution maps for an image file, a folder or an ImageFolder tree, resumable and shardable.

Every input ``root/a/b.jpg`` gets ``OUT/a/b.npy`` (or ``.safetensors``; ``--map-dtype float16`` halves it) and, with
``--png``, ``OUT/a/b.overlay.png``: the overlay with its colour bar and a caption (method, class, probability),
optionally beside the image (``--png-layout side-by-side``), drawn at a display size (``--png-max-side``) while
the map keeps the image's own resolution. ``--format none --png`` writes the pictures alone.
The classifier sees the image as timm's evaluation transform cuts it (resize the shorter side to
``input / crop_pct``, centre crop, the model's interpolation: :func:`attr_engine.imageops.data_config`); the map
is then written in the original image's frame, pixel for pixel aligned with it, the border the crop cut away
``NaN`` (and left uncoloured in the overlay). ``--model-frame`` keeps the map at the classifier's input size.
The run itself is :func:`attr_engine.jobs.explain`: this module parses the flags into a job, opens the engine, calls
it and prints. Every output is written atomically, so a killed run leaves nothing half-written and the same command
does only what is missing: an input is done when its outputs read back as valid files *and* the journal
(``OUT/_manifest/rank<R>-of-<N>.jsonl``, a line per input with a digest of the settings) says they were made with
the current settings, so an interrupted ``--overwrite`` never passes old maps off as new ones.

``OUT/explain.json`` records the settings once the first map of a run exists (a run that fails before leaves no
record to block a corrected rerun); a later run with other settings is refused instead of silently mixing maps
(``--overwrite`` redoes everything).

Sharding (``torchrun``, or ``RANK`` / ``WORLD_SIZE`` from any launcher: each process takes its round-robin share)
and ``--engine ray`` (a Ray Data actor pool computes, this process writes the same files and journal): see
docs/explain.md.

Unreadable images are reported one line each and listed in the manifest; the others are still written and the exit
status stays 0, unless every input was unreadable: nothing written is an error (one line, status 2). A map with
NaN or infinite values (outside the NaN border of a map in the image's frame) is never written: it is reported and
listed as ``failed``, the rest goes on, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attr_engine.cli._common import (
    UsageError,
    add_classifier_args,
    add_device_arg,
    check_classifier_args,
    check_cost,
    check_input_side,
    check_ray_pool,
    check_writable_dir,
    parse_key_values,
    ray_actor_gpus,
    reset_phase,
    resolve_device,
    resolve_method,
    work_started,
)
from attr_engine.guards import check_aha_dir, check_count, check_crop_pct
from attr_engine.jobs.job import FORMATS, MAP_DTYPES  # the job layer imports torch only where it runs a job

PNG_LAYOUTS = ("overlay", "side-by-side")
MIN_PNG_MAX_SIDE = 256
ENGINES = ("local", "ray")

# torch and the job layer are imported where they are used: `attr-engine explain --help` must not load them.
if TYPE_CHECKING:
    from attr_engine.jobs import AttributionJob, Item, ItemResult, Summary


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
    args.actors = check_ray_pool("--engine ray", args.actors, args.gpus_per_actor,
                                 flags=("--actors", "--gpus-per-actor"))  # fmt: skip


def _check_args(args: argparse.Namespace) -> None:
    """Check the flags and paths that need no model, before torch is imported: a refusal here is immediate."""
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
    for flag in ("limit", "img_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    check_count(args.batch_size, "batch_size", flag="--batch-size")  # the bounds the job checks too
    check_count(args.refine_steps, "refine_steps", flag="--refine-steps")
    if args.crop_pct is not None:
        check_crop_pct(args.crop_pct, "--crop-pct")
    if args.target not in ("pred", "label") and not args.target.lstrip("-").isdigit():
        raise UsageError(f"--target must be pred, label or a class index, got {args.target!r}")
    src, out = Path(args.input), Path(args.out)
    if not src.exists():
        raise UsageError(f"input not found: {src}")
    if not os.access(src, os.R_OK | (os.X_OK if src.is_dir() else 0)):
        raise UsageError(f"input {src} is not readable (permission denied)")
    if src.is_dir() and (out.resolve() == src.resolve() or src.resolve() in out.resolve().parents):
        raise UsageError(f"--out {out} lies inside the input folder {src}; its maps would be read as inputs")
    if args.aha is not None:
        check_aha_dir(args.aha, cli=True)
    check_classifier_args(args)


def _rank(args: argparse.Namespace) -> tuple[int, int]:
    """This process's ``(rank, world size)`` (torchrun's variables), refused with ``--engine ray``."""
    from attr_engine.distributed import process_rank

    try:
        rank, world = process_rank()
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.engine == "ray" and world > 1:
        raise UsageError("--engine ray schedules its own workers: run it once, not under torchrun (RANK / WORLD_SIZE)")
    return rank, world


def _check_labels(args: argparse.Namespace, items: list[Item]) -> None:
    """``--target label`` needs every input in a class folder."""
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


def _job(args: argparse.Namespace) -> AttributionJob:
    """The job the flags describe (the method resolved once to its canonical name)."""
    from attr_engine.jobs import AttributionJob

    method = resolve_method(args.method or ("aha" if args.aha else "pullback"))
    return AttributionJob(
        method=method, classifier=args.classifier, model=args.model, pretrained=args.pretrained,
        num_classes=args.num_classes, img_size=args.img_size, crop_pct=args.crop_pct, aha=args.aha,
        refine_steps=args.refine_steps, seed=args.seed, options=parse_key_values(args.option, "--option"),
        target=args.target if args.target in ("pred", "label") else int(args.target),
        frame="model" if args.model_frame else "image", return_images=args.png, device=args.device,
        batch_size=args.batch_size,
    )  # fmt: skip


def _engine(args: argparse.Namespace, stack: contextlib.ExitStack) -> Any:
    """``"local"``, or the Ray engine with its session open: connected before anything is loaded or written, so an
    unreachable cluster, a cluster without the GPUs or CPUs asked for, or --device cuda without GPUs fails here in
    one line, with nothing left behind."""
    if args.engine != "ray":
        return "local"
    from attr_engine.ray import RayEngine, ray_session

    stack.enter_context(ray_session(args.address, verbose=args.verbose))
    gpus = ray_actor_gpus(args.address, args.actors, args.gpus_per_actor, args.device)
    return RayEngine(actors=args.actors, num_gpus=gpus, address=args.address, verbose=args.verbose)


def run_explain(args: argparse.Namespace) -> int:
    _check_args(args)
    rank, world = _rank(args)
    if args.engine == "local":  # with Ray the actors hold the classifier: the cluster is checked for the device
        resolve_device(args.device)
    job = _job(args)
    # The stack holds the Ray session to the end.
    with contextlib.ExitStack() as stack:
        engine = _engine(args, stack)
        out = check_writable_dir(Path(args.out))
        progress = _Progress(args, rank, world)
        try:
            summary = _explain(args, job, out, engine, progress, rank, world)
        finally:
            progress.close()
    return _report(summary)


def _explain(
    args: argparse.Namespace, job: AttributionJob, out: Path, engine: Any, progress: _Progress, rank: int, world: int
) -> Summary:
    from attr_engine.jobs import NoMapWrittenError, explain, list_inputs

    items = list_inputs(Path(args.input), args.format)
    _check_labels(args, items)
    # Built here, before any work, for the bounds (cli._common): the image side the model takes and the method's
    # cost. With Ray the driver's copy is on the CPU (the settings only); the actors build their own.
    classifier = job.load_classifier(resolve_device("cpu" if engine != "local" else args.device))
    side = args.img_size or (classifier.input_size[1] if classifier.input_size else 224)
    check_input_side(classifier, side)
    explainer = job.get_explainer(classifier)
    check_cost(explainer, side, args.max_cost, job.method)
    try:
        return explain(
            job, items, out, engine=engine, fmt=args.format, map_dtype=args.map_dtype, png=args.png, cmap=args.cmap,
            alpha=args.alpha, png_layout=args.png_layout, png_max_side=args.png_max_side, overwrite=args.overwrite,
            limit=args.limit, rank=rank, world=world, workers=args.workers, progress=progress,
            classifier=classifier, explainer=explainer,
        )  # fmt: skip
    except NoMapWrittenError as err:
        reset_phase()  # nothing was written: no "what was finished is kept"
        raise UsageError(str(err)) from None


class _Progress:
    """The progress bar and the one line per input without a map; the job's work starts with the first result."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int) -> None:
        self.args, self.bar = args, None
        self.name = f"explain [{rank}/{world}]" if world > 1 else "explain"
        self.folder = Path(args.input).is_dir()

    def __call__(self, result: ItemResult | None, finished: int, total: int) -> None:
        from tqdm.auto import tqdm

        if result is None:  # the settings, inputs and outputs are checked: the work starts
            work_started()
            disable = self.args.no_progress or not total
            self.bar = tqdm(total=total, desc=self.name, unit="img", disable=disable, dynamic_ncols=True)
            return
        assert self.bar is not None
        if result.failed:
            # Not an unreadable input: the method failed on a good one. Reported, never written, and the exit status.
            self.bar.write(
                f"attr-engine explain: error: {result.item.name}: {result.error}; not written", file=sys.stderr
            )
        elif result.error is not None:
            if self.folder:  # a single input file that cannot be read is the error reported at the end
                self.bar.write(
                    f"attr-engine explain: warning: skipped unreadable input: {result.error}", file=sys.stderr
                )
        else:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _report(summary: Summary) -> int:
    """The one summary line; the exit status."""
    who = f"rank {summary.rank}/{summary.world}: " if summary.world > 1 else ""
    notes = [f"{len(summary.already)} already done"] if summary.already else []
    if summary.unreadable:
        notes.append(f"{len(summary.unreadable)} unreadable")
    if summary.failed:
        notes.append(f"{len(summary.failed)} failed: non-finite maps, not written")
    if summary.left > 0:
        notes.append(f"{summary.left} left for a later run")
    note = f" ({', '.join(notes)})" if notes else ""
    print(
        f"{who}{len(summary.written)} {summary.method} map(s) written to {summary.out}{note} in {summary.seconds:.1f} s"
    )
    return 1 if summary.failed else 0
