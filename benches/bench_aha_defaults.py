"""AHA's size-dependent defaults, measured: grid rules and score scalings against IG and saliency on masked data.

    nice -n 10 python -m benches.bench_aha_defaults --img 64 --seed 0 --threads 2   # the embedded benchmark size
    nice -n 10 python -m benches.bench_aha_defaults --img 32 --seed 7 --threads 2   # another size and data seed

For each classifier (``small_model_config`` ViT and ResNet at ``--img`` px, trained on :class:`ShapesDataset` as
``benches/bench_leaderboard.py`` does, through the same ``attr_engine.classifier_training`` helpers) one AHA
explainer is trained per candidate setting, each with the same seed, data order and number of steps, and scored
with Integrated Gradients (50 steps) and saliency on the same held-out images:

- deletion / insertion AUC (hard pixel ranking, AHA protocol: mean-colour reference, 21 points) and their
  composite insertion - deletion (higher is better);
- energy pointing game (share of positive map mass on the object mask);
- top-k% mask IoU: IoU of the object mask with the map's top pixels, k% being the object's own share of the image
  (so a map that ranks exactly the object first scores 1).

Candidates: the grid rule before this bench (``(side / 32, side / 8)``), the current rule
(:func:`attr_engine.aha.config.grid_rule`), and each with z-scored region scores (anchors spanning [-2, 2]).
The seed of the data generator differs between train and test (``seed`` and ``seed + 1000``), as in the leaderboard.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from attr_engine.aha import AHA, AHAConfig
from attr_engine.aha.config import grid_rule
from attr_engine.classifier import Classifier
from attr_engine.classifier_training import evaluate_accuracy, small_model_config, train_classifier
from attr_engine.data.shapes import ShapesDataset
from attr_engine.explainer import get_explainer
from attr_engine.metrics import deletion_insertion, energy_pointing_game, top_k_mask_iou


def old_grid_rule(side: int) -> tuple[int, int]:
    """The grid range of the rule this bench replaced: the official cell sizes (8..32 px at 224 px) scaled."""
    return min(max(1, round(side / 32)), side), min(max(1, round(side / 8)), side)


def candidates(side: int) -> dict[str, dict]:
    """Named AHAConfig overrides; every other setting is the default (the CPU budget aside, see ``run``)."""
    old, new = old_grid_rule(side), grid_rule(side)
    return {
        f"AHA old grid {old[0]}..{old[1]}, raw": {"grid_range": old},
        f"AHA old grid {old[0]}..{old[1]}, z-score": {"grid_range": old, "score_norm": "zscore"},
        f"AHA grid {new[0]}..{new[1]}, raw": {"grid_range": new, "score_norm": "raw"},
        f"AHA grid {new[0]}..{new[1]}, z-score": {"grid_range": new, "score_norm": "zscore"},
    }


def score(
    explain: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    classifier: Classifier,
    x: torch.Tensor,
    masks: torch.Tensor,
    target: torch.Tensor,
    batch: int = 16,
) -> dict[str, float]:
    start = time.perf_counter()
    maps = torch.cat([explain(x[i : i + batch], target[i : i + batch]).detach() for i in range(0, len(x), batch)])
    seconds = time.perf_counter() - start
    di = deletion_insertion(classifier, x, maps, target, steps=20, protocol="aha")
    deletion, insertion = di.deletion.mean().item(), di.insertion.mean().item()
    return {
        "deletion": deletion,
        "insertion": insertion,
        "composite": insertion - deletion,
        "energy": energy_pointing_game(maps, masks).mean().item(),
        "iou": top_k_mask_iou(maps, masks).mean().item(),
        "ms": 1e3 * seconds / len(x),
    }


Rows = list[tuple[str, dict[str, float]]]


def setup(
    kind: str, args: argparse.Namespace
) -> tuple[ShapesDataset, Classifier, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training set, a classifier trained on it, and the held-out images (N, 3, H, W), their object masks
    (N, H, W) and the classifier's predictions (N,), which every method explains."""
    torch.manual_seed(args.seed)
    train_set = ShapesDataset(args.n_train, img_size=args.img, seed=args.seed, with_masks=False)
    start = time.perf_counter()
    classifier = train_classifier(small_model_config(kind, args.img), train_set, epochs=args.epochs, seed=args.seed)
    test_set = ShapesDataset(args.n_test, img_size=args.img, seed=args.seed + 1000)
    acc = evaluate_accuracy(classifier, test_set)
    print(f"[{kind} {args.img}px] classifier: {acc:.1%} held-out accuracy ({time.perf_counter() - start:.0f} s)")
    x, _, masks = test_set.tensors()
    with torch.no_grad():
        target = classifier(x).argmax(1)
    return train_set, classifier, x, masks, target


def run(kind: str, args: argparse.Namespace) -> Rows:
    train_set, classifier, x, masks, target = setup(kind, args)
    rows: Rows = []
    for name, overrides in candidates(args.img).items():
        # As the leaderboard: 8 sampled fractions and one target per image keep a CPU step near a second.
        config = AHAConfig(n_fractions=8, targets="pred", seed=args.seed, **overrides)
        aha = AHA(classifier, config)
        start = time.perf_counter()
        aha.fit(train_set, batch_size=8, epochs=100, max_steps=args.aha_steps, progress=False)
        train_s = time.perf_counter() - start
        rows.append((name, score(lambda xb, tb, a=aha: a.attribute(xb, tb), classifier, x, masks, target)))
        print(f"[{kind} {args.img}px] {name}: trained {train_s:.0f} s; {fmt_row(rows[-1][1])}", flush=True)
    for name, explainer in (
        ("integrated gradients (50)", get_explainer("integrated-gradients", classifier, n_steps=50)),
        ("saliency", get_explainer("saliency", classifier)),
    ):
        rows.append((name, score(explainer.attribute, classifier, x, masks, target)))
        print(f"[{kind} {args.img}px] {name}: {fmt_row(rows[-1][1])}", flush=True)
    return rows


def fmt_row(r: dict[str, float]) -> str:
    """One row's scores as 'name value' pairs, for the progress lines."""
    return " ".join(f"{k} {v:.3f}" for k, v in r.items())


def table(kind: str, rows: Rows, *, times: bool = False) -> str:
    """A Markdown table of ``rows`` (best of each column in bold); ``times`` adds the ms/image column."""
    head = f"| {kind} | deletion (lower) | insertion (higher) | composite (higher) | energy pointing | top-k% IoU |"
    lines = [head + (" ms/image |" if times else ""), "|---|---|---|---|---|---|" + ("---|" if times else "")]
    best = {k: (min if k == "deletion" else max)(r[k] for _, r in rows) for k in rows[0][1] if k != "ms"}
    for name, r in rows:
        cells = [f"**{r[k]:.3f}**" if r[k] == best[k] else f"{r[k]:.3f}" for k in best]
        if times:
            cells.append(f"{r['ms']:.0f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bench_main(
    description: str, run_one: Callable[[str, argparse.Namespace], Rows], *, aha_steps: int, times: bool = False
) -> None:
    """The command line of this bench and of ``bench_aha_refine``: parse, run ``run_one`` per classifier, print the
    tables (``times``: with the ms/image column)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--kind", choices=("vit", "resnet", "both"), default="both")
    parser.add_argument("--img", type=int, default=64, help="image side (a multiple of 8, >= 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generator, the classifier and AHA")
    parser.add_argument("--n-train", type=int, default=1500)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--aha-steps", type=int, default=aha_steps, help="AHA optimiser steps per explainer (batch 8)")
    parser.add_argument("--n-test", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    kinds = ["vit", "resnet"] if args.kind == "both" else [args.kind]
    tables = [table(f"{kind} {args.img}px", run_one(kind, args), times=times) for kind in kinds]
    print(
        f"\n{args.n_train} training images, {args.epochs} classifier epochs, {args.aha_steps} AHA steps of batch 8, "
        f"{args.n_test} held-out images, seed {args.seed}, {torch.get_num_threads()} threads\n"
    )
    print("\n\n".join(tables))
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


def main() -> None:
    bench_main(__doc__.splitlines()[0], run, aha_steps=80)


if __name__ == "__main__":
    main()
