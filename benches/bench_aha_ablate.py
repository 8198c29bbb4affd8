"""AHA ablations (issue #21): which part of the explainer limits it on CNNs, on real photographs and on the shapes.

    python -u -m benches.bench_aha_ablate --data photos --kind resnet --cache reports/cache --out reports/ablate
    python -u -m benches.bench_aha_ablate --data shapes --kind vit --family refs,image --cache reports/cache
    python -u -m benches.bench_aha_ablate --quick --data photos --kind resnet --out reports/ablate-quick  # smoke

The classifier and the default AHA explainer are the leaderboard's (:func:`benches.bench_leaderboard.train`, same
budget, seed and ``--cache`` key), so the ``default`` row of a table is the leaderboard's AHA (T=0). Every other row
changes one thing against it and is trained with the same seed, data order and number of steps (the ``steps``
family aside): the leaderboard's CPU budget, 8 sampled fractions and the predicted class as the one target.

Families (``--family``, comma-separated; each row's overrides are printed in the table):

- ``refs``: the reference set drawn from during training: the mean colour alone (the evaluation's reference)
  against the official three (black, mean colour, blur).
- ``targets``: the target pair: the predicted class and the label (or the runner-up), against the predicted class.
- ``grid``: the grid range: half and double the rule's (clipped to the image side).
- ``image``: the capacity of the full-resolution image encoding (``image_dim``): 64 channels against 32.
- ``taps``: the decoder's taps. CNNs: without the stride-2 stem level, without the deepest stage (at 64 px a
  stride-32 stage is 2 x 2); ViTs: the last two blocks only.
- ``steps``: the training length: twice the steps.
- ``decoder``: the light decoder (``AHAConfig.decoder="light"``, issue #24: 2-3.4x cheaper) against the full one.

Scored beside IG-50, gradient x input and the two pullbacks (with their ``x·(x−r)`` rows) on the same held-out
images with :func:`attr_engine.evaluate.evaluate`: deletion / insertion (AHA protocol: mean-colour reference, 21
points, predicted class), their composite insertion - deletion, and on the shapes the energy pointing game and
the top-k% mask IoU.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from attr_engine.aha import AHA, AHAConfig
from attr_engine.aha.config import grid_rule
from attr_engine.evaluate import Leaderboard, evaluate
from attr_engine.explainer import Explainer, get_explainer
from attr_engine.report import leaderboard_markdown, write_markdown
from benches.bench_leaderboard import FULL, PHOTOS_FULL, PHOTOS_QUICK, QUICK, composite, datasets, train

FAMILIES = ("refs", "targets", "grid", "image", "taps", "steps", "decoder")
PEERS = ("integrated-gradients", "gradient-x-input", "pullback-soft", "pullback-ascent")


def variants(family: str, kind: str, img: int, levels: int) -> dict[str, dict]:
    """``{row name: AHAConfig overrides}`` of one family (``"steps"`` rows carry a ``"_steps_factor"`` instead).

    ``levels``: how many levels the default decoder taps (the taps family drops one end or the other).
    """
    if family == "refs":
        return {"refs mean": {"references": ("mean",)}}
    if family == "targets":
        return {"targets pred+label": {"targets": "pred+label"}}
    if family == "grid":
        low, high = grid_rule(img, img)
        half = (max(1, low // 2), max(1, high // 2))
        double = (min(2 * low, img // 2), min(2 * high, img // 2))
        return {
            f"grid {half[0]}..{half[1]}": {"grid_range": half},
            f"grid {double[0]}..{double[1]}": {"grid_range": double},
        }
    if family == "image":
        return {"image_dim 64": {"image_dim": 64}}
    if family == "taps":
        if kind == "vit":
            return {"taps last 2 blocks": {"layers": (levels - 2, levels - 1)}}
        return {
            "taps without stride-2 level": {"layers": tuple(range(1, levels))},
            "taps without deepest stage": {"layers": tuple(range(levels - 1))},
        }
    if family == "steps":
        return {"steps x2": {"_steps_factor": 2}}
    if family == "decoder":
        return {"decoder light": {"decoder": "light"}}
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")


def run(args: argparse.Namespace) -> Leaderboard:
    budget = (PHOTOS_QUICK if args.quick else PHOTOS_FULL) if args.data == "photos" else (QUICK if args.quick else FULL)
    torch.manual_seed(args.seed)
    classifier, aha, _, acc = train(args.kind, budget, args.seed, print, args.data, args.img, args.cache)
    levels = len(aha.backbone.indices)
    base = AHAConfig(n_fractions=8, targets="pred", seed=args.seed)  # the leaderboard's (bench_leaderboard.train)
    # The leaderboard's train and test sets; --n-test takes more images of the same test distribution.
    train_set, test_set = datasets(args.data, dataclasses.replace(budget, n_test=args.n_test or budget.n_test),
                                   args.img, args.seed)  # fmt: skip
    methods: dict[str, Explainer] = {"default": get_explainer("aha", classifier, aha=aha)}
    notes = [f"default: the leaderboard's AHA, {budget.aha_steps} steps of 8, taps {aha.backbone.indices}"]
    for family in args.family:
        for name, overrides in variants(family, args.kind, args.img, levels).items():
            factor = overrides.pop("_steps_factor", 1)
            config = dataclasses.replace(base, **overrides)
            steps = budget.aha_steps * factor
            # Each trained variant is kept beside the leaderboard's cache entry, so a later run (another family,
            # or one stopped half-way) reuses it.
            folder = None
            if args.cache is not None:
                key = f"{args.data}_{args.kind}_{args.img}px_seed{args.seed}_{budget.n_train}x{budget.epochs}"
                folder = args.cache / "ablations" / key / name.replace(" ", "_").replace("+", "-")
            start = time.perf_counter()
            if folder is not None and folder.is_dir():
                variant = AHA.load(folder, classifier)
                print(f"[{args.kind}] {name}: loaded from {folder}", flush=True)
            else:
                variant = AHA(classifier, config)
                variant.fit(train_set, batch_size=8, epochs=100, max_steps=steps, progress=False)
                if folder is not None:
                    variant.save(folder)
            seconds = time.perf_counter() - start
            print(f"[{args.kind}] {name}: {steps} steps in {seconds:.0f} s", flush=True)
            methods[name] = get_explainer("aha", classifier, aha=variant)
            notes.append(f"{name}: {overrides or ''} {steps} steps ({seconds:.0f} s)".replace("  ", " "))
    options = {"integrated-gradients": {"n_steps": budget.ig_steps}}
    for name in PEERS:
        methods[name] = get_explainer(name, classifier, **options.get(name, {}))
    metrics = ["deletion", "insertion"] + ([] if args.data == "photos" else ["energy_pointing_game", "mask_iou"])
    board = evaluate(
        classifier,
        methods,
        test_set,
        metrics,
        batch_size=16,
        seed=args.seed,
        title=f"{args.kind} on {args.data} ({acc:.0%} accuracy), {len(test_set)} images at {args.img} px: ablations",
        log=lambda line: print(f"[{args.kind}] {line}", flush=True),
        extra_rankings=True,
    )
    board.notes.extend(notes)
    scores = composite(board)
    board.notes.append("composite (insertion - deletion): " + ", ".join(f"{m} {v:.3f}" for m, v in scores.items()))
    return board


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", choices=("shapes", "photos"), default="photos")
    parser.add_argument("--kind", choices=("vit", "resnet"), default="resnet")
    parser.add_argument("--img", type=int, default=64)
    parser.add_argument("--family", default=",".join(FAMILIES), help=f"comma-separated, from {FAMILIES}")
    parser.add_argument("--n-test", type=int, default=None, help="held-out images (default: the leaderboard's)")
    parser.add_argument("--quick", action="store_true", help="the leaderboard's smoke budget")
    parser.add_argument("--cache", type=Path, default=None, help="the leaderboard's cache of trained models")
    parser.add_argument("--out", type=Path, default=Path("reports/ablate"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    args.family = [f.strip() for f in args.family.split(",") if f.strip()]
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    board = run(args)
    text = leaderboard_markdown(board)
    print(text)
    path = write_markdown(text, args.out / f"ablate_{args.data}_{args.kind}_{args.img}px.md")
    print(f"wrote {path}; total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
