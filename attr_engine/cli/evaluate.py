"""``evaluate``: a leaderboard of attribution methods on held-out images, and the report files it shares with demo
(written by :func:`attr_engine.report.write_report`, the one leaderboard writer)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attr_engine.cli._common import (
    EMBEDDED,
    HELD_OUT_SEED,
    UsageError,
    add_classifier_args,
    add_device_arg,
    check_classifier_args,
    check_cost,
    check_input_side,
    check_writable_dir,
    classifier_args,
    resolve_device,
    resolve_method,
    warn_if_untrained,
    work_started,
)
from attr_engine.guards import check_aha_dir, check_count, check_data_dir

CHEAP_METRICS = ("deletion", "insertion")
MASK_METRICS = ("pointing_game", "energy_pointing_game")
# The leaderboard files of evaluate --out and demo, by attr_engine.report.write_report's kinds; report.md is theirs.
CLI_REPORT_FILES: dict[str, str | None] = {
    "markdown": None,
    "csv": "leaderboard.csv",
    "curves": "curves.png",
    "maps": "overlays.png",
    "results": "results.json",
}

if TYPE_CHECKING:
    import torch


def register(subparsers: Any) -> dict[str, argparse.ArgumentParser]:
    p = subparsers.add_parser(
        "evaluate",
        help="score attribution methods on the same images (deletion/insertion, pointing game, time, ...)",
        description="Explain the same held-out images with every method and score each map with the same metrics "
        "and randomness (attr_engine.evaluate). Prints a table; with --out also writes report.md, "
        "leaderboard.csv, results.json, overlays.png and curves.png.",
    )
    add_classifier_args(p)
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated method names (see explain --method); default: aha (with --aha), pullback-ascent, "
        "pullback-soft, gradient, integrated-gradients",
    )
    p.add_argument("--aha", metavar="DIR", help="trained AHA checkpoint directory")
    p.add_argument(
        "--refine-steps", type=int, default=0, help="also score AHA with T test-time refinement steps (default 0: not)"
    )
    p.add_argument("--data", default=EMBEDDED, help=f"'{EMBEDDED}' (embedded, with object masks) or an image folder")
    p.add_argument("--num-images", type=int, default=64, help="images to score (default 64)")
    p.add_argument("--img-size", type=int, help="input side (default: the classifier's, else 224)")
    p.add_argument(
        "--metrics",
        default=None,
        help="comma-separated metrics: deletion, insertion, pos, neg, infidelity, infidelity_quantus, "
        "max_sensitivity, random_logit, random_logit_ssim, pointing_game, energy_pointing_game, mask_iou (the last "
        "three need the embedded data's masks); default: deletion, insertion and, with masks, the pointing games",
    )
    p.add_argument(
        "--target", choices=("pred", "label"), default="pred", help="class explained and scored (default pred)"
    )
    p.add_argument("--batch-size", type=int, default=16, help="images per explainer call (default 16)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the data, a fresh model and the random metrics (default 0)"
    )
    p.add_argument("--out", help="directory for the report files")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_device_arg(p)
    p.set_defaults(run=run_evaluate)
    return {"evaluate": p}


def evaluation_data(data: str, *, num_images: int, img_size: int, seed: int) -> tuple[torch.Tensor, ...]:
    """``(x, labels, masks)`` held-out embedded images, or ``(x, labels)`` spread evenly over an image folder."""
    import torch

    from attr_engine.data import ImageFolderDataset, ShapesDataset

    if num_images < 1:
        raise UsageError(f"--num-images must be >= 1, got {num_images}")
    if data == EMBEDDED:
        return ShapesDataset(num_images, img_size=img_size, seed=seed + HELD_OUT_SEED, with_masks=True).tensors()
    root = check_data_dir(data, embedded=EMBEDDED)
    assert root is not None  # data is not the embedded set's name
    ds = ImageFolderDataset(root, img_size=img_size, skip_unreadable=True)
    # Evenly spaced picks cover every class of a sorted ImageFolder, not just the first one.
    picks = sorted(set(torch.linspace(0, len(ds) - 1, min(num_images, len(ds))).round().long().tolist()))
    images, labels = zip(*(ds[i] for i in picks), strict=True)
    return torch.stack(images), torch.tensor(labels)


def markdown(board: Any) -> str:
    """The leaderboard's table for ``report.md``: :func:`attr_engine.report.leaderboard_markdown` (its notes under
    it, saying what each method's pixel ranking read), as the library's reports have it."""
    from attr_engine.report import leaderboard_markdown

    return leaderboard_markdown(board)


def plain_table(board: Any) -> str:
    """The leaderboard as fixed-width text for the terminal."""
    columns = board.columns
    cells = [[_fmt(row.get(c, ""), c) for c in columns] for row in board.rows]
    header = [f"{c} {'↓' if board.directions.get(c) == 'lower' else '↑'}" if c in board.directions else c
              for c in columns]  # fmt: skip
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]

    def line(values: list[str]) -> str:
        # Method names left-aligned, numbers right-aligned.
        pairs = enumerate(zip(values, widths, strict=True))
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in pairs)

    lines = [line(header), "  ".join("-" * w for w in widths), *(line(r) for r in cells)]
    return "\n".join(lines)


def _fmt(value: Any, column: str) -> str:
    if isinstance(value, float):
        return "nan" if value != value else f"{value:.1f}" if column == "ms/image" else f"{value:.3f}"
    return str(value)


def row_labels(classifier: Any, images: torch.Tensor, class_names: Any = None) -> list[str]:
    """``"circle, p = 0.97"`` per image: the predicted class (by name when known) and its probability."""
    import torch

    with torch.no_grad():
        probs = classifier(images.to(next(classifier.parameters()).device)).softmax(1).cpu()
    p, k = probs.max(1)
    names = list(class_names or ())
    pairs = zip(p.tolist(), k.tolist(), strict=True)
    return [f"{names[c] if c < len(names) else f'class {c}'}, p = {q:.2f}" for q, c in pairs]


def write_board(board: Any, out: Path, *, results: dict[str, Any], labels: list[str] | None = None) -> dict[str, Path]:
    """``leaderboard.csv``, ``overlays.png`` (kept images, every method side by side, ``labels`` per row),
    ``curves.png`` and ``results.json`` (``results`` plus the table rows and mean curves) in ``out``: the files of
    :data:`CLI_REPORT_FILES`, by :func:`attr_engine.report.write_report`.

    Returns:
        ``{"csv", "results"[, "overlays"][, "curves"]}`` -> written paths (``"overlays"`` is write_report's
        ``"maps"``).
    """
    from attr_engine.report import write_report

    files = write_report(board, out, files=CLI_REPORT_FILES, row_labels=labels, record=results)
    if "maps" in files:
        files["overlays"] = files.pop("maps")
    return files


def run_leaderboard(
    classifier: Any,
    methods: dict[str, Any],
    data: tuple[torch.Tensor, ...],
    metrics: list[str],
    *,
    progress: bool = True,
    **kwargs: Any,
) -> Any:
    """:func:`attr_engine.evaluate.evaluate` with a progress bar over its steps (each method's maps, then each
    metric), the step running named beside it: a slow metric shows which it is (a cost warning precedes it)."""
    from tqdm.auto import tqdm

    from attr_engine.evaluate import evaluate

    total = len(methods) * (1 + len(metrics))
    with tqdm(total=total, desc="evaluate", unit="step", disable=not progress, dynamic_ncols=True) as bar:
        started = [0]  # steps begun: each one begun after the first means the one before it is done

        def step(name: str) -> None:
            if started[0]:
                bar.update(1)
            started[0] += 1
            bar.set_postfix_str(name)

        board = evaluate(classifier, methods, data, metrics, step=step, **kwargs)
        bar.update(max(0, total - started[0] + 1))  # the last step
        return board


def _check_args(args: argparse.Namespace) -> None:
    """The flags and paths that need no model, checked before torch is imported."""
    check_count(args.batch_size, "batch_size", flag="--batch-size")
    if args.num_images < 1:
        raise UsageError(f"--num-images must be >= 1, got {args.num_images}")
    check_count(args.refine_steps, "refine_steps", flag="--refine-steps")
    check_data_dir(args.data, embedded=EMBEDDED)
    if args.aha is not None:
        check_aha_dir(args.aha, cli=True)
    check_classifier_args(args)


def run_evaluate(args: argparse.Namespace) -> int:
    _check_args(args)
    from attr_engine.atomic import atomic_write
    from attr_engine.evaluate import METRICS

    out = check_writable_dir(args.out) if args.out else None
    device = resolve_device(args.device)
    from attr_engine.classifier import load_classifier
    from attr_engine.explainer import get_explainer

    classifier = load_classifier(**classifier_args(args, img_size=args.img_size, seed=args.seed)).to(device)
    warn_if_untrained(args)
    img_size = args.img_size or (classifier.input_size[1] if classifier.input_size else 224)
    check_input_side(classifier, img_size)
    data = evaluation_data(args.data, num_images=args.num_images, img_size=img_size, seed=args.seed)
    has_masks = len(data) == 3

    if args.methods:
        names = [m.strip() for m in args.methods.split(",") if m.strip()]
    else:
        names = (["aha"] if args.aha else []) + ["pullback-ascent", "pullback-soft", "gradient", "integrated-gradients"]
    methods: dict[str, Any] = {}
    for name in names:
        key = resolve_method(name)
        if key == "aha" and args.aha is None:
            raise UsageError("--method aha needs --aha DIR, the directory train-aha (or demo) wrote")
        options = {"aha": args.aha, "seed": args.seed} if key == "aha" else {}
        methods[name] = get_explainer(key, classifier, **options)
        check_cost(methods[name], img_size, args.max_cost, name)
        if key == "aha" and args.refine_steps:
            methods[f"aha (T={args.refine_steps})"] = methods[name].with_options(refine_steps=args.refine_steps)
    if args.metrics:
        metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
        unknown = [m for m in metrics if m not in METRICS]
        if unknown:
            raise UsageError(f"unknown metric(s) {', '.join(unknown)}; available: {', '.join(METRICS)}")
        if not has_masks and any(METRICS[m].needs_masks for m in metrics):
            raise UsageError("pointing-game metrics need object masks, which only the embedded data has")
    else:
        metrics = [*CHEAP_METRICS, *(MASK_METRICS if has_masks else ())]

    work_started()
    board = run_leaderboard(
        classifier,
        methods,
        data,
        metrics,
        progress=not args.no_progress,
        target=args.target,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    print(plain_table(board))
    if out is not None:
        setup = {"data": args.data, "images": len(data[0]), "img_size": img_size, "target": args.target,
                 "seed": args.seed, "methods": list(methods), "metrics": metrics}  # fmt: skip
        labels = row_labels(classifier, board.images) if board.images is not None else None
        files = write_board(board, out, results={"setup": setup}, labels=labels)
        text = [f"# attr-engine evaluation\n\n{len(data[0])} images from `{args.data}`, {img_size} px, target: "
                f"{args.target}, seed {args.seed}.\n", markdown(board)]  # fmt: skip
        if "overlays" in files:
            text.append("\n![maps](overlays.png)\n")
        if "curves" in files:
            text.append("\n![deletion and insertion curves](curves.png)\n")
        with atomic_write(out / "report.md", "w") as f:
            f.write("\n".join(text))
        print(f"report: {out / 'report.md'}")
    return 0
