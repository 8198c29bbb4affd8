"""Write the real-photograph benchmark set as two ImageFolder trees, for the command line.

    python -m benches.photo_crops --out data/photos                 # 2400 train + 240 test images, 128 px
    attr-engine train-classifier --data data/photos/train --model small-vit --img-size 64 --out runs/photos-vit
    attr-engine train-aha --classifier runs/photos-vit/classifier.safetensors --data data/photos/train \
        --out runs/photos-aha
    attr-engine evaluate --classifier runs/photos-vit/classifier.safetensors --aha runs/photos-aha \
        --data data/photos/test --methods aha,integrated-gradients --metrics deletion,insertion --out runs/photos-eval

The images are :class:`attr_engine.data.photos.PhotoCropsDataset` items (labelled crops of scikit-image's sample
photographs; the test crops come from regions of each photograph that no training crop touches), the same ones
``benches.bench_leaderboard --data photos`` builds in memory. Needs scikit-image (``pip install
'attr-engine[photos]'``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from attr_engine.data.photos import write_photo_folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="root of the train/ and test/ folders")
    parser.add_argument("--n-train", type=int, default=2400)
    parser.add_argument("--n-test", type=int, default=240)
    parser.add_argument("--img-size", type=int, default=128, help="side of the written images (default 128)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    counts = write_photo_folder(
        args.out, n_train=args.n_train, n_test=args.n_test, img_size=args.img_size, seed=args.seed
    )
    print(f"wrote {counts['train']} training and {counts['test']} test images under {args.out}")


if __name__ == "__main__":
    main()
