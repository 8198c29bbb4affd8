"""Peak host memory of ``explain`` and ``train-aha`` on a CPU at 224 px (resnet18, untrained: memory does not depend
on the weights), with the classifier calls grouped as shipped and with the former ungrouped behaviour.

Each case is one command-line run (``attr_engine.cli.main``) in a fresh Python process; its peak resident set is the
child's own ``ru_maxrss`` from ``os.wait4`` (what the process and the children it waited for held at their highest,
imports and model included). The former behaviour is the same run with ``CPU_PIXELS_PER_CALL`` raised so high that
nothing is grouped (``train-aha``), or with the former ``internal_batch_size=256`` (``explain``). Run from the
repository root, one case at a time (each is heavy on a small machine):

    nice -n 10 python -m benches.bench_memory
    nice -n 10 python -m benches.bench_memory --cases explain-ig train-aha
    nice -n 10 python -m benches.bench_memory --cases train-aha --images-per-call 16   # another limit
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

SIDE = 224
# Runs attr_engine's command line in the child with the per-call pixel limit given as its first argument (0: the
# shipped limit).
_RUNNER = (
    "import sys\n"
    "import attr_engine.classifier as c\n"
    "if int(sys.argv[1]):\n"
    "    c.CPU_PIXELS_PER_CALL = int(sys.argv[1])\n"
    "from attr_engine.cli import main\n"
    "sys.exit(main(sys.argv[2:]))\n"
)
# A limit no batch reaches: the ungrouped behaviour.
UNLIMITED = 10**12


def _images(folder: Path, count: int) -> Path:
    """``count`` random 256 x 256 PNGs (centre-cropped to 224 by the classifier's preprocessing)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
    return folder


def _cases(work: Path) -> dict[str, tuple[int, list[str]]]:
    """name -> (pixel limit, command-line arguments)."""
    images = str(_images(work / "images", 8))
    model = ["--model", "resnet18", "--num-classes", "10", "--img-size", str(SIDE), "--device", "cpu"]
    explain = ["explain", images, *model, "--batch-size", "8", "--no-progress", "--overwrite"]
    train = ["train-aha", *model, "--num-images", "16", "--batch-size", "8", "--max-steps", "2", "--no-progress"]
    return {
        "explain-ig": (0, [*explain, "--method", "integrated-gradients", "--out", str(work / "ig")]),
        "explain-ig-256": (
            0,
            [
                *explain,
                "--method",
                "integrated-gradients",
                "--option",
                "internal_batch_size=256",
                "--out",
                str(work / "ig256"),
            ],
        ),
        "explain-saliency": (0, [*explain, "--method", "saliency", "--out", str(work / "sal")]),
        "train-aha": (0, [*train, "--out", str(work / "aha"), "--overwrite"]),
        "train-aha-ungrouped": (UNLIMITED, [*train, "--out", str(work / "aha-all"), "--overwrite"]),
    }


def peak_rss(limit: int, argv: list[str]) -> tuple[float, float, int]:
    """(peak resident set in MiB, wall seconds, exit status) of one command-line run in a fresh process."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", _RUNNER, str(limit), *argv], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss / 1024, time.perf_counter() - start, proc.returncode  # ru_maxrss is in KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", help="names of the cases to run (default: all)")
    parser.add_argument(
        "--images-per-call", type=int, default=0, help="224 px images per classifier call (default: as shipped)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cases = _cases(Path(tmp))
        print("| case | peak RSS | wall | exit |")
        print("|---|---|---|---|")
        for name in args.cases or list(cases):
            limit, argv = cases[name]
            if args.images_per_call and not limit:
                limit = args.images_per_call * SIDE * SIDE
            peak, wall, code = peak_rss(limit, argv)
            print(f"| {name} | {peak:.0f} MiB | {wall:.0f} s | {code} |", flush=True)


if __name__ == "__main__":
    main()
