"""Smaller artifacts: float16 and int8 decoder weights and saved graph optimisations against the float32 export.

    python -u -m benches.bench_artifact_precision --img 64                         # the README's run (quiet machine)
    nice -n 19 python -u -m benches.bench_artifact_precision --img 32 --n-train 200 --epochs 1 --aha-steps 5 \
        --n-test 16 --repeats 3                                                      # smoke

A ResNet classifier (``small_model_config("resnet")``) trained on :class:`ShapesDataset` and an AHA trained on it,
as ``benches/bench_aha_defaults.py`` builds them, is exported once (float32) and converted by
:func:`attr_engine.artifact_precision.convert_artifact` to every precision x graph optimisation level. For each
file, on ``--n-test`` held-out images:

- ``MB``: the file's size; ``load ms``: creating its onnxruntime session (1 thread, the best of 3);
- ``ms/batch @ t``: one call at batch ``--batch`` (images and target -1) with ``t`` intra-op threads, the minimum of
  ``--repeats`` calls after one warm-up (CPU provider);
- ``Spearman mean / min``: per-image rank correlation of the file's maps with the float32 file's (the pixel ranks
  deletion / insertion perturb by), each map explaining the classifier's eager prediction;
- ``same pred``: the share of images whose argmax of the file's logits equals the float32 file's;
- ``deletion``, ``insertion``, ``composite`` = insertion - deletion (AHA protocol, 20 steps, mean-colour reference,
  scored by the eager classifier for every file); ``offered``: composite within ``--tolerance`` of float32's and
  every prediction unchanged.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from attr_engine.aha import AHA, AHAConfig
from attr_engine.artifact_precision import OPTIMIZATIONS, PRECISIONS, convert_artifact
from attr_engine.classifier import Classifier
from attr_engine.metrics import deletion_insertion, pearson_similarity, pixel_ranks
from benches.bench_aha_defaults import setup
from benches.bench_floor import best_ms
from benches.bench_serve import session


def trained_artifact(args: argparse.Namespace, root: Path) -> tuple[Classifier, torch.Tensor, torch.Tensor, Path]:
    """The classifier, held-out images (N, 3, H, W), their eager predictions (N,) and the float32 export of an AHA
    trained for ``--aha-steps`` steps of batch 8."""
    train_set, classifier, x, _, target = setup("resnet", args)
    aha = AHA(classifier, AHAConfig(n_fractions=8, targets="pred", seed=args.seed))
    start = time.perf_counter()
    aha.fit(train_set, batch_size=8, epochs=100, max_steps=args.aha_steps, progress=False)
    print(f"AHA: {args.aha_steps} steps in {time.perf_counter() - start:.0f} s", flush=True)
    return classifier, x, target, aha.export(root / "float32.onnx")


def run_file(path: Path, x: torch.Tensor, target: torch.Tensor, threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``(logits (N, K) with target -1, maps (N, H, W) explaining ``target``)`` of the file at ``path``."""
    s = session(path, threads)
    logits = s.run(["logits"], {"images": x.numpy(), "target": np.full(len(x), -1, np.int64)})[0]
    maps = s.run(["maps"], {"images": x.numpy(), "target": target.numpy()})[0]
    return logits, maps


def measure(
    path: Path, reference: tuple[np.ndarray, np.ndarray], classifier: Classifier, x: torch.Tensor,
    target: torch.Tensor, args: argparse.Namespace,
) -> dict[str, float]:  # fmt: skip
    """One row of the table for the file at ``path`` (``reference``: the float32 file's logits and maps)."""
    row = {"MB": path.stat().st_size / 1e6, "load ms": best_ms(lambda: session(path, 1), 1, 3)}
    feed = {"images": x[: args.batch].numpy(), "target": np.full(min(args.batch, len(x)), -1, np.int64)}
    for threads in args.threads:
        row[f"ms/batch @ {threads}"] = best_ms(partial(session(path, threads).run, None, feed), 1, args.repeats)
    logits, maps = run_file(path, x, target)
    rho = pearson_similarity(pixel_ranks(torch.from_numpy(maps)), pixel_ranks(torch.from_numpy(reference[1])))
    row["Spearman mean"], row["Spearman min"] = float(rho.mean()), float(rho.min())
    row["same pred"] = float((logits.argmax(1) == reference[0].argmax(1)).mean())
    scores = deletion_insertion(classifier, x, torch.from_numpy(maps), target, steps=20, protocol="aha")
    row["deletion"], row["insertion"] = float(scores.deletion.mean()), float(scores.insertion.mean())
    row["composite"] = row["insertion"] - row["deletion"]
    return row


def table(rows: dict[tuple[str, str], dict[str, float]], tolerance: float) -> str:
    """The Markdown table of ``rows`` ({(precision, level): row}) with the composite's change and the verdict."""
    base = rows["float32", "none"]["composite"]
    keys = list(next(iter(rows.values())))
    lines = [
        "| precision | optimize | " + " | ".join(keys) + " | Δ composite | offered |",
        "|" + "---|" * (len(keys) + 4),
    ]
    for (precision, level), row in rows.items():
        delta = row["composite"] - base
        offered = abs(delta) <= tolerance and row["same pred"] == 1.0
        cells = [f"{row[k]:.4f}" if k.startswith(("Spearman", "deletion", "insertion", "composite")) else
                 f"{row[k]:.2f}" for k in keys]  # fmt: skip
        lines.append(
            f"| {precision} | {level} | " + " | ".join(cells) + f" | {delta:+.4f} | {'yes' if offered else 'no'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--img", type=int, default=64, help="image side (a multiple of 8, >= 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-train", type=int, default=800)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--aha-steps", type=int, default=60, help="AHA optimiser steps (batch 8)")
    parser.add_argument("--n-test", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="images per timed onnxruntime call")
    parser.add_argument("--threads", type=lambda s: [int(t) for t in s.split(",")], default=[1, 2])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tolerance", type=float, default=0.005, help="largest composite change offered")
    args = parser.parse_args()
    torch.set_num_threads(max(args.threads))
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        classifier, x, target, source = trained_artifact(args, Path(tmp))
        torch.set_num_threads(1)  # the scoring's classifier calls stay off the timed sessions' cores
        reference = run_file(source, x, target)
        rows = {}
        for precision in PRECISIONS:
            for level in OPTIMIZATIONS:
                path = convert_artifact(source, Path(tmp) / f"{precision}-{level}.onnx", precision=precision,
                                        optimize=level)  # fmt: skip
                rows[precision, level] = measure(path, reference, classifier, x, target, args)
                print(f"{precision} {level}: " + " ".join(f"{k} {v:.4g}" for k, v in rows[precision, level].items()),
                      flush=True)  # fmt: skip
    print(f"\n{args.img} px, {args.n_test} held-out images, batch {args.batch}, threads {args.threads}, "
          f"load average at the end {os.getloadavg()}\n")  # fmt: skip
    print(table(rows, args.tolerance))


if __name__ == "__main__":
    main()
