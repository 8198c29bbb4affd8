"""Grad-CAM, the project's ``grad-cam`` against pytorch-grad-cam's ``GradCAM`` (``gradcam:GradCAM``), side by side.

- ``grad-cam``: Captum's ``LayerGradCam`` on the layer, ReLU, ``F.interpolate`` (bilinear) on the device.
- ``gradcam:GradCAM``: the project's wrapper of the library (builds the library's object per call).
- ``library``: ``pytorch_grad_cam.GradCAM`` called directly, one object reused (the wrapper's overhead is the
  difference).

Both compute one forward and one backward pass; the library then copies the layer's activations and gradients to
the host and finishes in NumPy (weights, ReLU, per-image min-max, ``cv2.resize``). Rounds are interleaved so the
three sides see the same machine load; the minimum and median of each are printed. Untrained weights: the cost does
not depend on them. Run from the repository root (one thread, as the README rows were measured):

    OMP_NUM_THREADS=1 python -m benches.bench_cam --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

IMAGENET = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}


def _cases(model: str, batch: int, size: int) -> dict[str, Callable[[], object]]:
    """The three callables for one model: each computes Grad-CAM maps of a (batch, 3, size, size) batch."""
    import pytorch_grad_cam
    import timm
    import torchvision
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    from attr_engine.classifier import Classifier
    from attr_engine.explainer import get_explainer

    torch.manual_seed(0)
    if model == "tv_resnet18":
        clf = Classifier(torchvision.models.resnet18(), **IMAGENET)
    else:
        clf = Classifier(timm.create_model(model, pretrained=False))
    x = torch.rand(batch, 3, size, size)
    target = torch.arange(batch) % 10
    ours = get_explainer("grad-cam", clf)
    wrapped = get_explainer("gradcam:GradCAM", clf, layer=ours.layer)  # the same layer on both sides
    lib = pytorch_grad_cam.GradCAM(model=clf, target_layers=[ours.layer])
    targets = [ClassifierOutputTarget(int(t)) for t in target]
    return {
        "grad-cam": lambda: ours.attribute(x, target),
        "gradcam:GradCAM": lambda: wrapped.attribute(x, target),
        "library": lambda: lib(input_tensor=x.clone().requires_grad_(True), targets=targets),
    }


def measure(model: str, batch: int, size: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each side, ``rounds`` interleaved rounds after one warm-up call each."""
    cases = _cases(model, batch, size)
    for fn in cases.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tv_resnet18,resnet50", help="tv_resnet18 or timm names, comma-separated")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args: Any = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), batch {args.batch}, {args.size} px")
    print("| model | method | min (ms) | median (ms) | vs grad-cam (min) |")
    print("|---|---|---|---|---|")
    for model in args.models.split(","):
        times = measure(model, args.batch, args.size, args.rounds)
        base = min(times["grad-cam"])
        for name, ts in times.items():
            row = f"| {model} | {name} | {1e3 * min(ts):.1f} | {1e3 * statistics.median(ts):.1f} |"
            print(f"{row} {min(ts) / base:.2f}x |")


if __name__ == "__main__":
    main()
