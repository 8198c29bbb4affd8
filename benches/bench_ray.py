"""Images per second of dataset-scale attribution on Ray Data (attr_engine.ray) for 1, 2, ... CPU workers.

    python -m benches.bench_ray              # resnet18 at 128 px, gradient, 96 images; 1 and 2 workers
    python -m benches.bench_ray --workers 1 2 4 --images 256 --method pullback

Writes a folder of random PNG photos (160 x 120), saves an untrained timm model as a classifier checkpoint (the
speed of a map does not depend on the weights), starts a local Ray cluster with one CPU per worker, and runs the
job of ``attr-engine explain --engine ray`` (``path`` rows, decoded and cut by the actors, maps in the image's
frame) once per worker count; the rows are consumed, not written. For reference the same images run through the
local engine's steps in this process on one thread.

Per row of the table: ``end to end`` counts everything from submitting the job to its last map (actor start-up
and model loading included), ``steady`` the second half of the maps only (from the middle map's arrival to the
last: the rate a long job approaches). The machine's load average is printed before and after: on a shared
machine the numbers move with it.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def _write_images(root: Path, n: int, size: tuple[int, int]) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        path = root / f"img{i:05d}.png"
        Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype(np.uint8)).save(path)
        paths.append(path)
    return paths


def _local(paths: list[Path], checkpoint: Path, args: argparse.Namespace) -> tuple[float, float]:
    """The local engine's steps on one thread: decode, cut, explain in batches, map back to the image frame."""
    from attr_engine.ray import AttributionJob, BatchAttributor

    torch.set_num_threads(1)
    start = time.perf_counter()
    worker = BatchAttributor(AttributionJob(method=args.method, classifier=str(checkpoint), frame="image"))
    arrivals = []
    for i in range(0, len(paths), args.batch_size):
        chunk = paths[i : i + args.batch_size]
        worker({"path": np.array([str(p) for p in chunk])})
        arrivals += [time.perf_counter()] * len(chunk)
    return _rates(start, arrivals)


def _rates(start: float, arrivals: list[float]) -> tuple[float, float]:
    """Images/s from submission to the last map, and over the second half of the maps (start-up long over)."""
    half = len(arrivals) // 2
    steady = (len(arrivals) - half) / max(arrivals[-1] - arrivals[half - 1], 1e-9)
    return len(arrivals) / (arrivals[-1] - start), steady


def _ray(paths: list[Path], checkpoint: Path, workers: int, args: argparse.Namespace) -> tuple[float, float]:
    import pandas as pd
    import ray.data

    from attr_engine.ray import attribute_dataset

    size = args.batch_size
    blocks = [pd.DataFrame({"path": [str(p) for p in paths[i : i + size]]}) for i in range(0, len(paths), size)]
    ds = attribute_dataset(ray.data.from_pandas(blocks), args.method, checkpoint, frame="image", batch_size=size,
                           concurrency=workers)  # fmt: skip
    start = time.perf_counter()
    arrivals = [time.perf_counter() for _ in ds.iter_rows()]
    assert len(arrivals) == len(paths), f"{len(arrivals)} rows for {len(paths)} images"
    return _rates(start, arrivals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="Ray actors (one CPU each)")
    parser.add_argument("--images", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--model", default="resnet18", help="timm model (untrained)")
    parser.add_argument("--img-size", type=int, default=128)
    parser.add_argument("--method", default="gradient")
    args = parser.parse_args()

    import ray

    from attr_engine.classifier import load_classifier, save_classifier

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "images").mkdir()
        paths = _write_images(root / "images", args.images, (160, 120))
        checkpoint = root / "classifier.safetensors"
        torch.manual_seed(0)
        save_classifier(load_classifier(args.model, num_classes=10, img_size=args.img_size), checkpoint)

        rows = [("local engine (this process, 1 thread)", *_local(paths, checkpoint, args))]
        start = time.perf_counter()
        ray.init(num_cpus=max(args.workers), include_dashboard=False, configure_logging=False, log_to_driver=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        started = time.perf_counter() - start
        try:
            for workers in args.workers:
                name = f"Ray, {workers} CPU worker{'s' * (workers > 1)}"
                rows.append((name, *_ray(paths, checkpoint, workers, args)))
        finally:
            ray.shutdown()
    load_after = os.getloadavg()

    print(
        f"\n{args.model} at {args.img_size} px, {args.method}, {args.images} images of 160 x 120, batch "
        f"{args.batch_size}; {os.cpu_count()} cores, load average {load_before[0]:.1f} before, {load_after[0]:.1f} "
        f"after; Ray start-up {started:.1f} s (not counted)\n"
    )
    print("| engine | end to end, images/s | steady, images/s |")
    print("|---|---|---|")
    for name, total, steady in rows:
        print(f"| {name} | {total:.1f} | {steady:.1f} |")


if __name__ == "__main__":
    main()
