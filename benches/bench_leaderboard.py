"""Leaderboard on the embedded data: AHA, the Semantic Pullback and every baseline on a trained ViT and ResNet.

    python -m benches.bench_leaderboard --out reports/leaderboard            # full run (2 CPU cores: ~1 hour)
    python -m benches.bench_leaderboard --quick --out reports/leaderboard    # smoke run, about 2 minutes
    python -m benches.bench_leaderboard --data photos --img-size 64 --out reports/leaderboard-photos

``--data shapes`` (default) is the embedded ShapesDataset, with object masks; ``--data photos`` is
:class:`~attr_engine.data.photos.PhotoCropsDataset`, labelled crops of real photographs (scikit-image's sample
photographs; test crops come from regions of each photograph no training crop touches), without masks, so its
board has the perturbation metrics only (deletion, insertion, Pos / Neg) and 200 test images.

For each classifier (``small_model_config`` ViT and ResNet at 64 px, trained on ShapesDataset) an AHA explainer is
trained, then every method - AHA (T=0, T=3), SfP, PA and every registered baseline that applies, DeepLift and Guided
Grad-CAM (Captum) among them - is scored on the same held-out images on deletion / insertion (AHA protocol), Pos /
Neg, infidelity (optimal scaling), max-sensitivity, random logit (Pearson), the pointing games and the top-k% mask
IoU, with ms/image.
Each method is scored with the reductions it declares (``ranked by`` column; the pullbacks also get rows for
``x·(x−r)`` and the signed mean, see ``attr_engine.evaluate``). Written to ``--out``: ``leaderboard_<kind>.md`` /
``.csv`` / ``_curves.png`` / ``_maps.png`` and ``aha_maps_<kind>.png`` (image, object mask, AHA's maps and the two
best other composites) per classifier, and ``summary.md`` with the project's targets:

- AHA T=0 has the best composite (insertion - deletion) and AHA the best energy pointing game and top-k% mask IoU;
- AHA (T=0 or T=3) has the best deletion and the best insertion of all methods, on both classifiers;
- PA infidelity is at most 1/3 of the gradient's;
- SfP random logit is no worse (no higher) than the gradient's.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from attr_engine.aha import AHA, AHAConfig
from attr_engine.classifier import load_classifier, save_classifier
from attr_engine.classifier_training import ModelConfig, evaluate_accuracy, small_model_config, train_classifier
from attr_engine.data.photos import PhotoCropsDataset
from attr_engine.data.shapes import ShapesDataset
from attr_engine.evaluate import Leaderboard, evaluate
from attr_engine.explainer import Explainer, get_explainer, list_explainers
from attr_engine.report import leaderboard_markdown, plot_heatmaps, write_markdown, write_report

IMG = 64  # the default side; --img-size changes it
METRIC_NAMES = (
    "deletion",
    "insertion",
    "pos",
    "neg",
    "infidelity",
    "max_sensitivity",
    "random_logit",
    "pointing_game",
    "energy_pointing_game",
    "mask_iou",
)
MASK_METRICS = ("pointing_game", "energy_pointing_game", "mask_iou")
# Photos: no masks; infidelity, max-sensitivity and random logit are left to the shapes board (their cost is per
# image and per method, and they say nothing about which map ranks pixels best).
PHOTO_METRICS = ("deletion", "insertion", "pos", "neg")


@dataclass(frozen=True)
class Budget:
    n_train: int
    epochs: int
    aha_steps: int
    n_test: int
    rise_masks: int
    ig_steps: int
    smoothgrad_samples: int
    infidelity_samples: int
    sensitivity_samples: int


# CPU-sized: the full run uses 32 test images, RISE with 500 masks and 5 max-sensitivity samples (the SP paper: 10),
# because max-sensitivity re-runs every explainer per sample and RISE / occlusion cost hundreds of passes per image.
# Integrated Gradients takes 50 steps, the budget AHA's refinement (T=3) is held to.
QUICK = Budget(600, 3, 8, 8, 128, 8, 4, 1, 2)
FULL = Budget(3000, 12, 400, 32, 500, 50, 16, 5, 5)
# Photos: 200 crops per class in training, 200 test images (the perturbation metrics are cheap enough for it).
PHOTOS_QUICK = Budget(600, 3, 8, 24, 128, 8, 4, 1, 2)
PHOTOS_FULL = Budget(2400, 12, 400, 200, 500, 50, 16, 5, 5)


def datasets(data: str, budget: Budget, img: int, seed: int) -> tuple:
    """``(train_set, test_set)`` of ``data`` ("shapes" or "photos") at ``img`` px."""
    if data == "photos":
        return (
            PhotoCropsDataset(budget.n_train, split="train", img_size=img, seed=seed),
            PhotoCropsDataset(budget.n_test, split="test", img_size=img, seed=seed),
        )
    return (
        ShapesDataset(budget.n_train, img_size=img, seed=seed, with_masks=False),
        ShapesDataset(budget.n_test, img_size=img, seed=seed + 1000),
    )


def train(
    kind: str, budget: Budget, seed: int, log, data: str = "shapes", img: int = IMG, cache: Path | None = None
) -> tuple:
    """The trained classifier and AHA explainer of one board, with its test set and the classifier's accuracy.

    With ``cache``, both are saved there after training (safetensors) and loaded instead of trained when a run with
    the same data, kind, size, seed and budget left them: an ``--only`` run then scores its rows on the very same
    classifier and explainer as the board it adds to.
    """
    train_set, test_set = datasets(data, budget, img, seed)
    # "tv-resnet": the Semantic Pullback paper's kind of model, torchvision's resnet18 (inplace ReLU, max-pool),
    # trained from scratch like the others; AHA taps its own four stages.
    config = ModelConfig("torchvision:resnet18", img) if kind == "tv-resnet" else small_model_config(kind, img)
    key = f"{data}_{kind}_{img}px_seed{seed}_{budget.n_train}x{budget.epochs}_aha{budget.aha_steps}"
    folder = None if cache is None else cache / key
    start = time.perf_counter()
    if folder is not None and (folder / "aha").is_dir():
        classifier = load_classifier(
            config.name, img_size=config.img_size, checkpoint=folder / "classifier.safetensors", **config.kwargs
        )
        aha = AHA.load(folder / "aha", classifier)
        acc = evaluate_accuracy(classifier, test_set)
        log(f"[{kind}] classifier ({acc:.1%} held-out accuracy) and AHA loaded from {folder}")
        return classifier, aha, test_set, acc
    torch.manual_seed(seed)  # the torchvision model's initial weights (train_classifier seeds its own builds)
    model = (
        load_classifier(config.name, num_classes=len(train_set.class_names), img_size=img)
        if kind == "tv-resnet"
        else config
    )
    classifier = train_classifier(model, train_set, epochs=budget.epochs, seed=seed)
    acc = evaluate_accuracy(classifier, test_set)
    log(f"[{kind}] classifier: {acc:.1%} held-out accuracy ({time.perf_counter() - start:.0f} s)")
    start = time.perf_counter()
    aha = AHA(classifier, AHAConfig(n_fractions=8, targets="pred", seed=seed))
    aha.fit(train_set, batch_size=8, epochs=100, max_steps=budget.aha_steps, progress=False)
    log(f"[{kind}] AHA: {budget.aha_steps} steps ({time.perf_counter() - start:.0f} s)")
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        save_classifier(classifier, folder / "classifier.safetensors")
        aha.save(folder / "aha")  # last: its folder marks a complete cache entry
    return classifier, aha, test_set, acc


# Photos: the peers the AHA target is stated against (issue #21): IG-50, gradient x input, the pullbacks,
# Grad-CAM / rollout and saliency. Occlusion, RISE, SmoothGrad and DeepLift stay on the shapes board: on 200 images
# they would cost more than the rest together.
PHOTO_BASELINES = (
    "pullback-soft",
    "pullback-ascent",
    "integrated-gradients",
    "gradient-x-input",
    "grad-cam",
    "attention-rollout",
    "saliency",
)


# Three of pytorch-grad-cam's CAM family (gradcam:<Class>): gradient-weighted (GradCAM++), element-wise (LayerCAM)
# and gradient-free (ScoreCAM, one forward pass per channel of the target layer).
CAM_FAMILY = ("gradcam:GradCAMPlusPlus", "gradcam:LayerCAM", "gradcam:ScoreCAM")


def methods(
    classifier, aha: AHA, budget: Budget, seed: int, only: tuple[str, ...] | None = None
) -> dict[str, Explainer]:
    """AHA (T=0, T=3), SfP, PA, every registered baseline that applies and :data:`CAM_FAMILY`; with ``only``, the
    AHA rows and the baselines named there."""
    out: dict[str, Explainer] = {
        "AHA (T=0)": get_explainer("aha", classifier, aha=aha),
        "AHA (T=3)": get_explainer("aha", classifier, aha=aha, refine_steps=3, seed=seed),
    }
    if only is None or "pullback-soft" in only:
        out["SfP"] = get_explainer("pullback-soft", classifier)
    if only is None or "pullback-ascent" in only:
        out["PA"] = get_explainer("pullback-ascent", classifier)
    options = {
        "integrated-gradients": {"n_steps": budget.ig_steps},
        "smoothgrad": {"nt_samples": budget.smoothgrad_samples},
        "rise": {"n_masks": budget.rise_masks, "seed": seed},
    }
    for name in [*list_explainers(classifier), *CAM_FAMILY]:
        if name not in ("aha", "pullback-soft", "pullback-ascent") and (only is None or name in only):
            out[name] = get_explainer(name, classifier, **options.get(name, {}))
    return out


def composite(board: Leaderboard) -> dict[str, float]:
    """insertion - deletion of every row that has both."""
    ins, dele = board.column("insertion"), board.column("deletion")
    return {m: ins[m] - dele[m] for m in ins if m in dele}


def aha_figure(board: Leaderboard, masks: torch.Tensor | None, path: Path) -> Path:
    """The kept images (with their object masks, if any), AHA's maps (T=0, T=3) and the two best other methods by
    composite."""
    scores = composite(board)
    others = sorted((m for m in board.maps if not m.startswith("AHA") and m in scores), key=scores.get, reverse=True)
    k = len(board.images)
    maps = {} if masks is None else {"object mask": masks[:k].float()}
    for name in ("AHA (T=0)", "AHA (T=3)", *others[:2]):
        maps[name] = board.maps[name]
    return plot_heatmaps(board.images, maps, path, title=f"{board.title}: AHA and the two best other composites")


def targets(boards: dict[str, Leaderboard]) -> list[str]:
    """The project's targets, each as a 'reached' / 'missed' line with the numbers behind it."""
    lines = []
    for kind, board in boards.items():
        scores = composite(board)
        others = {m: v for m, v in scores.items() if not m.startswith("AHA")}
        runner = max(others, key=others.get)
        ok = scores["AHA (T=0)"] > others[runner]
        lines.append(
            f"- {kind}: AHA T=0 best composite (insertion - deletion): **{'reached' if ok else 'missed'}** "
            f"(AHA T=0 {scores['AHA (T=0)']:.3f}, T=3 {scores['AHA (T=3)']:.3f}; best other: {runner} "
            f"{others[runner]:.3f})"
        )
        best_del = min(board.column("deletion").values())
        t3_del = board.column("deletion")["AHA (T=3)"]
        ok = scores["AHA (T=3)"] >= max(others.values()) and t3_del <= best_del + 0.02
        lines.append(
            f"- {kind}: AHA T=3 best composite and deletion within 0.02 of the best: "
            f"**{'reached' if ok else 'missed'}** (T=3 composite {scores['AHA (T=3)']:.3f} against "
            f"{others[runner]:.3f}; deletion {t3_del:.3f} against the best {best_del:.3f})"
        )
        for metric in ("energy_pointing_game", "mask_iou"):
            if metric not in board.columns:  # a board without masks
                continue
            col = board.column(metric)
            aha = max((m for m in col if m.startswith("AHA")), key=col.get)
            other = max((m for m in col if not m.startswith("AHA")), key=col.get)
            lines.append(
                f"- {kind}: AHA best {metric}: **{'reached' if col[aha] > col[other] else 'missed'}** "
                f"({aha} {col[aha]:.3f}; best other: {other} {col[other]:.3f})"
            )
        for metric in ("deletion", "insertion"):
            col = board.column(metric)
            best = board.best(metric)
            aha = {m: v for m, v in col.items() if m.startswith("AHA")}
            best_aha = min(aha, key=aha.get) if metric == "deletion" else max(aha, key=aha.get)
            others = {m: v for m, v in col.items() if not m.startswith("AHA")}
            runner = min(others, key=others.get) if metric == "deletion" else max(others, key=others.get)
            status = "reached" if best.startswith("AHA") else "missed"
            lines.append(
                f"- {kind}: AHA best {metric}: **{status}** ({best_aha} {aha[best_aha]:.3f}; best other: "
                f"{runner} {others[runner]:.3f})"
            )
        if "infidelity" not in board.columns or "random_logit" not in board.columns:
            continue  # the photo board has the perturbation metrics only
        inf, rl = board.column("infidelity"), board.column("random_logit")
        if not {"PA", "gradient"} <= inf.keys() or not {"SfP", "gradient"} <= rl.keys():
            continue  # an --only run may lack the rows
        ratio = inf["PA"] / inf["gradient"] if inf["gradient"] > 0 else float("inf")
        lines.append(
            f"- {kind}: PA infidelity <= 1/3 of gradient's: **{'reached' if ratio <= 1 / 3 else 'missed'}** "
            f"(PA {inf['PA']:.4g}, gradient {inf['gradient']:.4g}, ratio {ratio:.2f})"
        )
        ok = rl["SfP"] <= rl["gradient"]
        lines.append(
            f"- {kind}: SfP random logit <= gradient's: **{'reached' if ok else 'missed'}** "
            f"(SfP {rl['SfP']:.3f}, gradient {rl['gradient']:.3f})"
        )
    return lines


def run(
    kinds: list[str],
    *,
    quick: bool,
    out: Path,
    seed: int = 0,
    batch_size: int = 16,
    data: str = "shapes",
    img: int = IMG,
    only: tuple[str, ...] | None = None,
    cache: Path | None = None,
) -> dict[str, Leaderboard]:
    photos = data == "photos"
    budget = (PHOTOS_QUICK if quick else PHOTOS_FULL) if photos else (QUICK if quick else FULL)
    boards: dict[str, Leaderboard] = {}
    notes: list[str] = []
    for kind in kinds:
        torch.manual_seed(seed)
        classifier, aha, test_set, acc = train(kind, budget, seed, print, data, img, cache)
        start = time.perf_counter()
        metrics: dict[str, dict] = {name: {} for name in (PHOTO_METRICS if photos else METRIC_NAMES)}
        if not photos:
            metrics["infidelity"] = {"n_samples": budget.infidelity_samples}
            metrics["max_sensitivity"] = {"n_samples": budget.sensitivity_samples}
        board = evaluate(
            classifier,
            methods(classifier, aha, budget, seed, only or (PHOTO_BASELINES if photos else None)),
            test_set,
            metrics,
            batch_size=batch_size,
            seed=seed,
            title=f"{kind} on {data} ({acc:.0%} accuracy), {budget.n_test} images at {img} px",
            log=lambda line, k=kind: print(f"[{k}] {line}"),
            extra_rankings=True,
        )
        print(f"[{kind}] evaluated in {time.perf_counter() - start:.0f} s")
        boards[kind] = board
        for path in write_report(board, out, stem=f"leaderboard_{kind}").values():
            print(f"[{kind}] wrote {path}")
        masks = None if photos else test_set.tensors()[2]
        print(f"[{kind}] wrote {aha_figure(board, masks, out / f'aha_maps_{kind}.png')}")
        notes.append(leaderboard_markdown(board))
    summary = "\n".join(
        [
            f"# Leaderboard on {data} at {img} px ({'quick' if quick else 'full'} run, seed {seed})\n",
            *notes,
            "## Targets\n",
            *targets(boards),
            "",
        ]
    )
    print(summary)
    write_markdown(summary, out / "summary.md")
    return boards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("vit", "resnet", "tv-resnet", "both"), default="both")
    parser.add_argument("--quick", action="store_true", help="smoke run (about 2 minutes on 2 CPU cores)")
    parser.add_argument("--out", type=Path, default=Path("reports/leaderboard"))
    parser.add_argument("--data", choices=("shapes", "photos"), default="shapes")
    parser.add_argument("--img-size", type=int, default=IMG, help=f"square input side (default {IMG})")
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated baselines to score beside AHA (e.g. legrad,mda,integrated-gradients): a run that "
        "adds rows to a board, reproducing its classifier and AHA from the same seed",
    )
    parser.add_argument(
        "--cache", type=Path, default=None, help="keep the trained classifiers and AHA explainers here, and reuse them"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kinds = ["vit", "resnet"] if args.kind == "both" else [args.kind]
    start = time.perf_counter()
    only = tuple(name.strip() for name in args.only.split(",")) if args.only else None
    run(
        kinds,
        quick=args.quick,
        out=args.out,
        seed=args.seed,
        data=args.data,
        img=args.img_size,
        only=only,
        cache=args.cache,
    )
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
