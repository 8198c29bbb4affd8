"""``demo``: the whole engine end to end on a fresh machine, offline, in minutes on a laptop CPU.

Generates the embedded shapes dataset, trains a small timm classifier on it, trains AHA for that classifier, then
explains held-out images with AHA (with and without test-time refinement), Semantic Pullback (ascent and soft) and
baselines, scores every map the same way (deletion / insertion under the AHA protocol, pointing game and energy
pointing game against the object masks, time per image) and writes a report directory:

    report.md          the tables, the setup and the timings
    overlays.png       held-out images and every method's map side by side
    curves.png         mean deletion and insertion curves
    leaderboard.csv    the table; results.json: everything, machine-readable
    checkpoints/       classifier.safetensors and aha/ (reusable by explain, evaluate, train-aha --resume)

Everything is seeded (data, initialisations, data order, the AHA step draws, the baselines' randomness): two runs
with the same ``--seed`` and thread count give the same checkpoints and scores; only the times differ. The demo runs
on one CPU thread unless ``attr-engine --threads N demo`` asks for more.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from attr_engine.cli._common import (
    HELD_OUT_SEED,
    SMALL_MODELS,
    UsageError,
    add_device_arg,
    check_writable_dir,
    machine_summary,
    resolve_device,
    work_started,
)
from attr_engine.cli.evaluate import markdown, plain_table, row_labels, run_leaderboard, write_board
from attr_engine.guards import check_count, check_small_model_side


@dataclass(frozen=True)
class DemoSizes:
    """How much work the demo does; the presets are sized for 2 CPU cores."""

    num_train: int
    epochs: int
    aha_steps: int
    aha_batch: int
    num_eval: int
    num_show: int
    refine_steps: int
    img_size: int = 64


DEFAULT = DemoSizes(num_train=2000, epochs=4, aha_steps=200, aha_batch=8, num_eval=64, num_show=6, refine_steps=3)
QUICK = DemoSizes(num_train=800, epochs=3, aha_steps=20, aha_batch=8, num_eval=16, num_show=4, refine_steps=1)

# Display name -> registry name of the methods scored next to AHA (grad-cam fits CNN stages and ViT tokens alike).
COMPARED = {
    "Pullback ascent": "pullback-ascent",
    "Soft pullback": "pullback-soft",
    "Grad-CAM": "grad-cam",
    "Integrated gradients": "integrated-gradients",
    "Saliency": "saliency",
}
METRICS = ("deletion", "insertion", "pointing_game", "energy_pointing_game")


def register(subparsers: Any) -> dict[str, argparse.ArgumentParser]:
    p = subparsers.add_parser(
        "demo",
        help="train a classifier and AHA on embedded data, explain and evaluate, write a report (no download)",
        description=__doc__.split("\n\n")[0] + " --quick is a smaller run of the same pipeline; the README quotes "
        "both runs' times with the machine and its load.",
    )
    p.add_argument("--out", "-o", default="attr-engine-demo", help="report directory (default: ./attr-engine-demo)")
    p.add_argument(
        "--quick", action="store_true", help="a smaller run: fewer images, epochs and AHA steps (the sizes below)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of everything (default 0)")
    p.add_argument(
        "--model", choices=tuple(SMALL_MODELS), default="small-resnet", help="classifier to train (small-resnet)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_device_arg(p)
    sizes = p.add_argument_group("sizes (override the preset)")
    sizes.add_argument("--num-train", type=int, help="training images (default 2000, quick 800)")
    sizes.add_argument("--epochs", type=int, help="classifier epochs (default 4, quick 3)")
    sizes.add_argument("--aha-steps", type=int, help="AHA training steps (default 200, quick 20)")
    sizes.add_argument("--aha-batch", type=int, help="images per AHA step (default 8)")
    sizes.add_argument("--num-eval", type=int, help="held-out images scored (default 64, quick 16)")
    sizes.add_argument("--num-show", type=int, help="images in overlays.png (default 6, quick 4)")
    sizes.add_argument("--refine-steps", type=int, help="AHA test-time refinement steps T (default 3, quick 1)")
    sizes.add_argument("--img-size", type=int, help="image side, a multiple of 8 >= 32 (default 64)")
    p.add_argument("--methods", help=argparse.SUPPRESS)  # comma-separated subset of COMPARED (tests, experiments)
    p.set_defaults(run=run_demo)
    return {"demo": p}


# Grad-CAM's map is as coarse as its layer: at 64 px the small ResNet's last stage is 2 x 2 (four blocks, pointing
# game near 0 by construction). The demo takes the deepest CNN stage with at least this many cells per side.
GRADCAM_MIN_SIDE = 8


def gradcam_layer(classifier: Any, img_size: int) -> tuple[str | None, int]:
    """The CNN stage Grad-CAM reads on the demo classifier, and its side in cells (``None``: the method's default,
    a ViT's last block on its token grid)."""
    from attr_engine.baselines.cam import is_vit

    model = classifier.model
    if is_vit(model) or not getattr(model, "feature_info", None):
        patch = getattr(getattr(model, "patch_embed", None), "grid_size", (0,))[0]
        return None, int(patch)
    stages = [f for f in model.feature_info if img_size // f["reduction"] >= GRADCAM_MIN_SIDE]
    stage = stages[-1] if stages else model.feature_info[0]
    return stage["module"], img_size // stage["reduction"]


def _sizes(args: argparse.Namespace) -> DemoSizes:
    preset = QUICK if args.quick else DEFAULT
    overrides = {}
    for field in ("num_train", "epochs", "aha_steps", "aha_batch", "num_eval", "num_show", "refine_steps", "img_size"):
        value = getattr(args, field)
        if value is not None:
            flag = f"--{field.replace('_', '-')}"
            if field in ("refine_steps", "epochs"):
                check_count(value, field, flag=flag)
            elif value < 1:
                raise UsageError(f"{flag} must be >= 1, got {value}")
            overrides[field] = value
    sizes = replace(preset, **overrides)
    # The stricter of the two presets' sides (the small ViT's), so --model may name either.
    check_small_model_side(sizes.img_size, "vit", "--img-size")
    if sizes.num_train < sizes.aha_batch:
        raise UsageError(f"--num-train must be at least the AHA batch ({sizes.aha_batch})")
    return replace(sizes, num_show=min(sizes.num_show, sizes.num_eval))


def _count(n: int, noun: str) -> str:
    """``1 thread``, ``2 threads``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


class _Stages:
    """Numbered stage headers on stderr (next to the progress bars) and the time each stage took."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.quiet, self.count = total, quiet, 0
        self.seconds: dict[str, float] = {}
        self._name, self._start = "", 0.0

    def start(self, name: str, detail: str) -> None:
        self._close()
        self.count += 1
        self._name, self._start = name, time.perf_counter()
        if not self.quiet:
            print(f"[{self.count}/{self.total}] {detail}", file=sys.stderr, flush=True)

    def _close(self) -> None:
        if self._name:
            self.seconds[self._name] = time.perf_counter() - self._start
            self._name = ""

    def finish(self) -> dict[str, float]:
        self._close()
        return self.seconds


def run_demo(args: argparse.Namespace) -> int:
    sizes = _sizes(args)  # the flags, before torch is imported
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    compared = _compared(args)
    import torch

    from attr_engine.classifier import save_classifier
    from attr_engine.classifier_training import evaluate_accuracy
    from attr_engine.data import ShapesDataset

    if getattr(args, "threads", None) is None:
        # One thread unless --threads says otherwise: the demo's 64 px models gain little from more, the numbers are
        # then the same on any core count, and other jobs' threads cannot stall ours at every barrier (two threads
        # on a busy 2-core machine ran the quick demo 7x slower than one).
        torch.set_num_threads(1)
    device = resolve_device(args.device)
    out = check_writable_dir(args.out)
    work_started()
    ckpt = out / "checkpoints"
    wall = time.perf_counter()
    stages = _Stages(4, args.no_progress)
    torch.manual_seed(args.seed)

    stages.start("data", f"generating {sizes.num_train} training and {sizes.num_eval} held-out images")
    train_set = ShapesDataset(sizes.num_train, img_size=sizes.img_size, seed=args.seed, with_masks=False)
    eval_set = ShapesDataset(sizes.num_eval, img_size=sizes.img_size, seed=args.seed + HELD_OUT_SEED)
    x, labels, masks = eval_set.tensors()

    stages.start("classifier", f"training the {args.model} classifier ({sizes.epochs} epochs)")
    classifier, epochs_log = _demo_classifier(args, sizes, train_set, device)
    save_classifier(classifier, ckpt / "classifier.safetensors")
    accuracy = evaluate_accuracy(classifier, eval_set)

    stages.start("aha", f"training AHA ({sizes.aha_steps} steps of {sizes.aha_batch} images)")
    aha, history = _demo_aha(args, sizes, classifier, train_set, ckpt / "aha")

    n_methods = 2 + len(compared) if sizes.refine_steps else 1 + len(compared)
    stages.start("evaluate", f"explaining and scoring {sizes.num_eval} held-out images with {n_methods} methods")
    methods, cam_layer, cam_side = _demo_methods(args, sizes, classifier, aha, compared)
    board = run_leaderboard(
        classifier,
        methods,
        (x, labels, masks),
        list(METRICS),
        progress=not args.no_progress,
        batch_size=16,
        seed=args.seed,
        keep=sizes.num_show,
    )
    seconds = stages.finish()
    total = time.perf_counter() - wall

    tail = max(1, min(10, len(history["loss"]) // 2))
    results = {
        "seed": args.seed,
        "model": args.model,
        "sizes": asdict(sizes),
        "classifier_accuracy": accuracy,
        "classifier_epochs": epochs_log,
        # The soft AUCs AHA trained on, averaged over its first and its last steps.
        "aha_soft_auc": {
            key: {"first_steps": sum(history[key][:tail]) / tail, "last_steps": sum(history[key][-tail:]) / tail}
            for key in ("deletion", "insertion")
        },
        "gradcam_layer": {"layer": cam_layer or "last block (tokens)", "side": cam_side},
        "stage_seconds": {k: round(v, 2) for k, v in seconds.items()},
        "total_seconds": round(total, 2),
        "machine": machine_summary(device),
    }
    row_names = row_labels(classifier, board.images, eval_set.class_names) if board.images is not None else None
    files = write_board(board, out, results=results, labels=row_names)
    _write_report(out, args, sizes, board, results, files)

    _print_summary(args, sizes, results, board, files, out)
    return 0


def _demo_aha(
    args: argparse.Namespace, sizes: DemoSizes, classifier: Any, train_set: Any, checkpoints: Path
) -> tuple[Any, dict[str, list[float]]]:
    """AHA trained for the demo's classifier, checkpointed in ``checkpoints``, and its training history."""
    from attr_engine.aha import AHA, AHAConfig

    # CPU budget: 8 sampled fractions and one target per image keep a step near a second; the rest is the default.
    config = AHAConfig(n_fractions=8, targets="pred", seed=args.seed)
    aha = AHA(classifier, config)
    history = aha.fit(
        train_set,
        batch_size=sizes.aha_batch,
        epochs=-(-sizes.aha_steps // (sizes.num_train // sizes.aha_batch)),
        max_steps=sizes.aha_steps,
        checkpoint_dir=checkpoints,
        checkpoint_every=50,
        progress=not args.no_progress,
    )
    return aha, history


def _compared(args: argparse.Namespace) -> dict[str, str]:
    """The methods compared with AHA: every one of :data:`COMPARED`, or those ``--methods`` names."""
    if args.methods is None:
        return dict(COMPARED)
    wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
    return {name: key for name, key in COMPARED.items() if key in wanted}


def _demo_classifier(
    args: argparse.Namespace, sizes: DemoSizes, train_set: Any, device: Any
) -> tuple[Any, list[dict[str, float]]]:
    """The demo's classifier trained on ``train_set``, with its per-epoch log."""
    from tqdm.auto import tqdm

    from attr_engine.classifier_training import small_model_config, train_classifier

    epochs_log: list[dict[str, float]] = []
    with tqdm(total=sizes.epochs, desc="classifier", unit="epoch", disable=args.no_progress,
              dynamic_ncols=True) as bar:  # fmt: skip

        def on_epoch(stats: dict[str, float]) -> None:
            epochs_log.append(stats)
            bar.update(1)
            bar.set_postfix(loss=f"{stats['loss']:.3f}", acc=f"{stats['train_acc']:.3f}")

        classifier = train_classifier(
            small_model_config(SMALL_MODELS[args.model], sizes.img_size),
            train_set,
            epochs=sizes.epochs,
            seed=args.seed,
            device=device,
            log=on_epoch,
        )
    return classifier, epochs_log


def _demo_methods(
    args: argparse.Namespace, sizes: DemoSizes, classifier: Any, aha: Any, compared: dict[str, str]
) -> tuple[dict[str, Any], str | None, int]:
    """The methods the demo compares (AHA, refined AHA, the others), the Grad-CAM layer and its side."""
    from attr_engine.explainer import get_explainer

    methods: dict[str, Any] = {"AHA": get_explainer("aha", classifier, aha=aha)}
    if sizes.refine_steps:
        methods[f"AHA (T={sizes.refine_steps})"] = get_explainer(
            "aha", classifier, aha=aha, refine_steps=sizes.refine_steps, seed=args.seed
        )
    cam_layer, cam_side = gradcam_layer(classifier, sizes.img_size)
    for name, key in compared.items():
        extra = {"layer": cam_layer} if key == "grad-cam" and cam_layer is not None else {}
        methods[name] = get_explainer(key, classifier, **extra)
    return methods, cam_layer, cam_side


def _print_summary(
    args: argparse.Namespace, sizes: DemoSizes, results: dict[str, Any], board: Any, files: dict[str, Path], out: Path
) -> None:
    ckpt = out / "checkpoints"
    seconds, total, accuracy = results["stage_seconds"], results["total_seconds"], results["classifier_accuracy"]
    setting = f"seed {args.seed}, {args.model}, {sizes.img_size} px, {results['machine']['device']}"
    print(f"\nattr-engine demo finished in {_clock(total)} ({setting})")
    print(f"  classifier: {accuracy:.1%} held-out accuracy ({_clock(seconds['classifier'])})")
    trend = results["aha_soft_auc"]
    d, i = trend["deletion"], trend["insertion"]
    print(f"  AHA: {sizes.aha_steps} steps ({_clock(seconds['aha'])}): soft deletion {d['first_steps']:.3f} -> "
          f"{d['last_steps']:.3f}, soft insertion {i['first_steps']:.3f} -> {i['last_steps']:.3f}")  # fmt: skip
    print(f"  {sizes.num_eval} held-out images, scored in {_clock(seconds['evaluate'])}:\n")
    print(plain_table(board))
    print(f"\n  report:      {out / 'report.md'}")
    print(f"  pictures:    {files.get('overlays', '-')}  {files.get('curves', '-')}")
    print(f"  checkpoints: {ckpt}")
    explain = f"attr-engine explain IMAGES --classifier {ckpt / 'classifier.safetensors'} --aha {ckpt / 'aha'} --png"
    print(f"  next:        {explain}")


def _write_report(
    out: Path, args: argparse.Namespace, sizes: DemoSizes, board: Any, results: dict[str, Any], files: dict[str, Path]
) -> None:
    from attr_engine.atomic import atomic_write

    machine = results["machine"]
    secs = results["stage_seconds"]
    d, i = (results["aha_soft_auc"][k] for k in ("deletion", "insertion"))
    command = "attr-engine " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else "attr-engine demo"
    lines = [
        "# attr-engine demo report",
        "",
        f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {machine['processor']}, {machine['cpu_count']} "
        f"CPU(s), torch {machine['torch']} with {_count(machine['torch_threads'], 'thread')}, "
        f"device `{machine['device']}`"
        + (f" ({machine['gpu']})" if "gpu" in machine else "")
        + f". Seed {args.seed}. Total {_clock(results['total_seconds'])}.",
        "",
        "## Setup",
        "",
        "| stage | what | time |",
        "|---|---|---|",
        f"| data | embedded shapes, {sizes.img_size} px: {sizes.num_train} training images, {sizes.num_eval} held-out "
        f"images (another seed) with object masks | {_clock(secs['data'])} |",
        f"| classifier | `{args.model}` trained from scratch, {sizes.epochs} epoch(s): "
        f"**{results['classifier_accuracy']:.1%}** held-out accuracy | {_clock(secs['classifier'])} |",
        f"| AHA | {sizes.aha_steps} steps of {sizes.aha_batch} images, 8 fractions per curve, predicted class; soft "
        f"deletion {d['first_steps']:.3f} -> {d['last_steps']:.3f}, soft insertion {i['first_steps']:.3f} -> "
        f"{i['last_steps']:.3f} (first vs last steps) | {_clock(secs['aha'])} |",
        f"| evaluate | {len(board.rows)} methods on the held-out images | {_clock(secs['evaluate'])} |",
        "",
        "## Results",
        "",
        markdown(board),
        "Deletion / insertion: AUC of the predicted-class probability as pixels are replaced by the mean colour "
        "in the map's order, most important first (deletion, lower is better) or least important first (insertion, "
        "higher is better); 21 points, pixel-level ranking (the AHA protocol). Pointing game: the map's maximum lies "
        "on the object; energy pointing game: share of the positive map mass on the object. ms/image: attribution "
        f"time per image in batches of 16 on `{machine['device']}`. AHA (T=k) refines a per-image copy of the "
        "decoder's last layers for k steps on each image's own objective. Grad-CAM reads "
        f"`{results['gradcam_layer']['layer']}` ({results['gradcam_layer']['side']} x "
        f"{results['gradcam_layer']['side']} cells at {sizes.img_size} px)"
        + (
            ": the last stage of this small network is too coarse for objects this size."
            if results["gradcam_layer"]["layer"] != "last block (tokens)"
            else "."
        ),
        "",
    ]
    if "overlays" in files:
        lines += ["## Maps", "", "![held-out images and every method's map](overlays.png)", ""]
    if "curves" in files:
        lines += ["## Deletion and insertion curves", "", "![mean curves](curves.png)", ""]
    lines += [
        "## Files",
        "",
        "- `checkpoints/classifier.safetensors`: the classifier (`--classifier` of explain / evaluate / train-aha)",
        "- `checkpoints/aha/`: the AHA explainer (`--aha`); its whole training checkpoints (`checkpoints/step-N/`) "
        "let `train-aha --resume` go on",
        "- `leaderboard.csv`, `results.json`: the numbers",
        "",
        f"Reproduce: `{command}` (same seed, same thread count: same checkpoints and scores).",
        "",
    ]
    with atomic_write(out / "report.md", "w") as f:
        f.write("\n".join(lines))


# ---------------------------------------------------------------------------------------------------------------
# The README's demo tables, generated from a run (docs/demo_table.py writes them; tests/test_readme.py checks them)
# ---------------------------------------------------------------------------------------------------------------

README_COMMANDS = {"quick": "attr-engine demo --quick", "full": "attr-engine demo"}
_README_HEADERS = {"pointing_game": "pointing game", "energy_pointing_game": "energy pointing game"}


def readme_record(results: dict[str, Any], command: str) -> dict[str, Any]:
    """What the README's table shows of a demo run (``results.json``), with what reproduces it: the command, the
    seed, torch's version and thread count, the CPU (:func:`cpu_model`: training on another CPU model or vector
    width moves the last digits). Scores at full precision; ``ms/image`` apart (it is measured, not reproduced)."""
    rows = [{k: v for k, v in row.items() if k != "ms/image"} for row in results["leaderboard"]]
    return {
        "command": command,
        "seed": results["seed"],
        "sizes": results["sizes"],
        "torch": results["machine"]["torch"],
        "torch_threads": results["machine"]["torch_threads"],
        "cpu": results["machine"]["cpu"],
        "classifier_accuracy": results["classifier_accuracy"],
        "rows": rows,
        "ms_per_image": {row["method"]: row["ms/image"] for row in results["leaderboard"]},
        "total_seconds": results["total_seconds"],
    }


def readme_table(record: dict[str, Any]) -> str:
    """The Markdown table of a :func:`readme_record`: scores to 3 decimals with the best in bold, ms/image to 0.1."""
    from attr_engine.tables import markdown_table

    metrics = [k for k in record["rows"][0] if k not in ("method", "ranked by")]
    times = record["ms_per_image"]
    rows = [
        {**{_README_HEADERS.get(k, k): v for k, v in row.items()}, "ms/image": f"{times[row['method']]:.1f}"}
        for row in record["rows"]
    ]
    directions = {_README_HEADERS.get(m, m): "lower" if m == "deletion" else "higher" for m in metrics}
    columns = ["method", "ranked by", *directions, "ms/image"]
    return markdown_table(rows, columns, directions={**directions, "ms/image": "lower"}, digits=3)


def replace_readme_block(text: str, name: str, block: str) -> str:
    """``text`` with what lies between ``<!-- demo-<name>:start -->`` and ``<!-- demo-<name>:end -->`` replaced."""
    start, end = f"<!-- demo-{name}:start -->\n", f"<!-- demo-{name}:end -->"
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"the README must hold one {start.strip()} ... {end} block")
    head, rest = text.split(start)
    return head + start + block + end + rest.split(end, 1)[1]


def readme_block(text: str, name: str) -> str:
    """What lies between the README's ``demo-<name>`` markers."""
    start, end = f"<!-- demo-{name}:start -->\n", f"<!-- demo-{name}:end -->"
    return text.split(start, 1)[1].split(end, 1)[0]
