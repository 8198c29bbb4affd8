"""AHA's test-time refinement, measured: what a step refines, its step size and fractions, against IG-50's cost.

    nice -n 10 python -m benches.bench_aha_refine --img 64 --seed 0 --threads 1   # the embedded benchmark size
    nice -n 10 python -m benches.bench_aha_refine --img 32 --seed 7 --threads 1   # another size and data seed

For each classifier (``small_model_config`` ViT and ResNet at ``--img`` px, trained on :class:`ShapesDataset` as
``benches/bench_aha_defaults.py`` does) one AHA explainer is trained with the defaults (8 sampled fractions and one
target per image: the CPU budget), then scored on the same held-out images without refinement (T=0), with T=3
refinement for each candidate setting, and with Integrated Gradients (50 steps), all in one process so the
ms/image column compares side by side. Columns as in bench_aha_defaults (deletion / insertion: hard pixel ranking,
AHA protocol; energy pointing game; top-k% mask IoU).

A candidate is named ``d<depth> f<fractions> lr<rate>``: ``AHAConfig.refine_depth``, ``refine_fractions`` and
``refine_lr``; every other refinement setting is the default (grids: the lower half of the training range).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from attr_engine.aha import AHA, AHAConfig
from attr_engine.explainer import get_explainer
from benches.bench_aha_defaults import Rows, bench_main, fmt_row, score, setup

# (refine_depth, refine_fractions, refine_lr): the default first, then the alternatives measured against it.
CANDIDATES = ((2, 6, 1e-3), (2, 8, 1e-3), (2, 8, 3e-3), (1, 8, 3e-2))


def run(kind: str, args: argparse.Namespace) -> Rows:
    train_set, classifier, x, masks, target = setup(kind, args)
    aha = AHA(classifier, AHAConfig(n_fractions=8, targets="pred", seed=args.seed))
    start = time.perf_counter()
    aha.fit(train_set, batch_size=8, epochs=100, max_steps=args.aha_steps, progress=False)
    print(f"[{kind} {args.img}px] AHA: {args.aha_steps} steps ({time.perf_counter() - start:.0f} s)")
    trained = aha.config
    rows: Rows = [
        ("integrated gradients (50)", score(get_explainer("integrated-gradients", classifier, n_steps=50).attribute,
                                            classifier, x, masks, target)),
        ("AHA T=0", score(aha.attribute, classifier, x, masks, target)),
    ]  # fmt: skip
    for depth, fractions, lr in CANDIDATES:
        # The explainer's config is frozen: each candidate is a changed copy over the same trained decoder.
        aha.config = dataclasses.replace(trained, refine_depth=depth, refine_fractions=fractions, refine_lr=lr)
        name = f"AHA T=3, d{depth} f{fractions} lr{lr:g}"
        rows.append((name, score(lambda xb, tb: aha.attribute(xb, tb, refine_steps=3, seed=0), classifier, x,
                                 masks, target)))  # fmt: skip
    aha.config = trained
    for name, r in rows:
        print(f"[{kind} {args.img}px] {name}: {fmt_row(r)}", flush=True)
    return rows


def main() -> None:
    bench_main(__doc__.splitlines()[0], run, aha_steps=200, times=True)


if __name__ == "__main__":
    main()
