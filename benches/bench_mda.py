"""MDA's cost per image next to integrated gradients', on tiny timm ViTs (untrained, seeded), one thread.

    python -m benches.bench_mda [--threads 1] [--images 2]

MDA at its defaults (grid = the token grid, window 2 floor(sqrt N) capped at 28, prior integrated gradients); the
three configurations are 32 px with 8 px patches (4 x 4 cells), 224 px with 32 px patches (7 x 7, ViT-B/32's
grid) and 224 px with 16 px patches (14 x 14, ViT-B/16's grid). Wall time of one call on ``--images`` images
after a warm-up call on one, divided by the images.
"""

from __future__ import annotations

import argparse
import time

import torch

from attr_engine.classifier import load_classifier
from attr_engine.explainer import get_explainer

CONFIGS = ((32, 8), (224, 32), (224, 16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--images", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for size, patch in CONFIGS:
        torch.manual_seed(0)
        clf = load_classifier(
            "vit_tiny_patch16_224", num_classes=10, img_size=size, patch_size=patch, depth=2, embed_dim=32, num_heads=2
        )
        x = torch.rand(args.images, 3, size, size, generator=torch.Generator().manual_seed(0))
        for name in ("integrated-gradients", "mda"):
            explainer = get_explainer(name, clf)
            explainer.attribute(x[:1])
            start = time.perf_counter()
            explainer.attribute(x)
            per_image = (time.perf_counter() - start) / args.images
            grid = size // patch
            print(f"{size} px, {grid} x {grid} cells, {name}: {per_image:.3f} s/image", flush=True)


if __name__ == "__main__":
    main()
