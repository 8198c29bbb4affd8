"""AHA's test-time refinement, measured: what a step refines, its step size and fractions, against IG-50's cost.

    nice -n 10 python -m benches.bench_aha_refine --img 64 --seed 0 --threads 1   # the embedded benchmark size
    nice -n 10 python -m benches.bench_aha_refine --img 32 --seed 7 --threads 1   # another size and data seed

For each classifier (``small_model_config`` ViT and ResNet at ``--img`` px, trained on :class:`ShapesDataset` as
``benches/bench_aha_defaults.py`` does) one AHA explainer is trained with the defaults (8 sampled fractions and one
target per image: the CPU budget), then scored on the same held-out images without refinement (T=0), with T=3
refinement for each candidate setting, and with Integrated Gradients (50 steps), all in one process so the
ms/image column compares side by side. Columns as in bench_aha_defaults (deletion / insertion: hard pixel ranking,
AHA protocol; energy pointing game; top-k% mask IoU).

A candidate is named ``<mode> f<fractions> lr<rate>``: ``AHAConfig.refine_mode`` ("map": the map's own values at
``refine_map_lr``; "decoder d<depth>": per-image copies of the decoder's last ``refine_depth`` layers at
``refine_lr``) and ``refine_fractions``; every other refinement setting is the default (grids: the lower half of
the training range).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from attr_engine.aha import AHA, AHAConfig
from attr_engine.explainer import get_explainer
from benches.bench_aha_defaults import Rows, bench_main, fmt_row, score, setup

# (refine_mode, refine_depth, refine_fractions, step size): the default first, then the alternatives measured
# against it (the second is the default before issue #31).
CANDIDATES = (("map", 2, 6, 0.1), ("decoder", 2, 6, 1e-3), ("map", 2, 6, 0.05), ("map", 2, 8, 0.1))


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
    for mode, depth, fractions, lr in CANDIDATES:
        # The explainer's config is frozen: each candidate is a changed copy over the same trained decoder.
        rate = {"refine_map_lr": lr} if mode == "map" else {"refine_lr": lr}
        aha.config = dataclasses.replace(trained, refine_mode=mode, refine_depth=depth, refine_fractions=fractions,
                                         **rate)  # fmt: skip
        name = f"AHA T=3, {mode}{f' d{depth}' if mode == 'decoder' else ''} f{fractions} lr{lr:g}"
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
