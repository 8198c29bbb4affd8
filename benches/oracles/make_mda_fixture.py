"""Record the official MDA's outputs on a tiny seeded ViT as the fixture of tests/test_mda.py.

Official code: github.com/chasewalker26/MDA-Metric-Driven-Attributions-for-ViT at commit
4ec5108261c3d41cebcad819404ed5f474c60384 (the fixture was made from that commit; nothing of it is copied here).
Its dependencies beyond ours: cvxopt (its QP solver) and scikit-image (it imports ``slic``); it ran with cvxopt
1.3.2, scikit-image 0.26.0, scipy 1.17.1, numpy 2.4.6, torch 2.14.1, torchvision 0.29.1.

    python -m benches.oracles.make_mda_fixture /path/to/MDA-Metric-Driven-Attributions-for-ViT

What runs is the official ``MDAFunctions.MDA`` (insertion search, deletion search, both cvxopt fits, the MAS
curves, the three smoothed maps) with the official blur search of ``MDA_results/evaluations/MDATest.py`` (size =
sigma from 31 in steps of 2 until the softmax is at most 1 %), on the CPU, with two substitutions, both recorded in
docs/deviations.md:

- ``slic`` returns the regular 7 x 7 grid of 32 px cells. SLIC at compactness 10000 is a grid too, but its first
  row and column of cells are 33 px and its last 31 px (its centres start at 16 px and ties go to the lower label);
  MDA here uses the regular partition of ``attr_engine_kernels.region``.
- ``np.argsort`` is stable. The MAS curves rank pixels by ``np.flip(np.argsort(map))``, and every cell's pixels tie:
  numpy's default (introsort, AVX-512 / AVX2 sorts on x86) orders ties by platform; stable, a tie goes to the later
  pixel, which is what MDA here does.

The images are chosen so the official code runs as intended (the script checks both): the insertion search reaches
the cutoff within its first ``N - window`` steps (past them the official code writes the cutoff marker at the wrong
index) and no raw probability before it is 0.9 or more (the official ``np.where(MR_ins >= 0.9)`` compares raw
probabilities before that step); and so that its blur search stops early (its full 3 x 3 x 103 x 103 convolution
takes 45 s per call here).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from attr_engine.classifier import Classifier
from attr_engine.explainer import get_explainer
from attr_engine.metrics.faithfulness import patch_grid

OFFICIAL_COMMIT = "4ec5108261c3d41cebcad819404ed5f474c60384"
MODEL = {
    "model_name": "vit_tiny_patch16_224",
    "num_classes": 10,
    "img_size": 224,
    "patch_size": 32,
    "embed_dim": 8,
    "depth": 1,
    "num_heads": 2,
}
MEAN = STD = (0.5, 0.5, 0.5)  # the official ViTs' normalisation
WEIGHT_SEED, WEIGHT_STD = 0, 1.0
IMAGE_SEEDS = (4, 6, 12)  # blur search stops at 37, 31 and 31 px
GRID = 7
CELLS = GRID * GRID


def build_model() -> torch.nn.Module:
    """The tiny ViT: timm's architecture, every weight redrawn (norm gains near 1) so the softmax moves."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model(pretrained=False, **MODEL)
    gen = torch.Generator().manual_seed(WEIGHT_SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name and name.endswith("weight") else WEIGHT_STD * noise)
    return model.eval()


def images() -> torch.Tensor:
    """(3, 3, 224, 224): smooth images, 14 x 14 random cells upsampled bilinearly."""
    cells = [torch.rand(1, 3, 14, 14, generator=torch.Generator().manual_seed(s)) for s in IMAGE_SEEDS]
    return F.interpolate(torch.cat(cells), size=224, mode="bilinear", align_corners=False)


def official_blur(
    mas: Any, model_utils: Any, model: torch.nn.Module, input_tensor: torch.Tensor, target: int
) -> tuple[Any, int]:
    """MDATest.py's blur search, with its own gkern and getPrediction."""
    klen = ksig = 31
    kern = mas.gkern(klen, ksig)

    def blur(x: torch.Tensor, kern: torch.Tensor = kern, klen: int = klen) -> torch.Tensor:
        return F.conv2d(x, kern, padding=klen // 2)

    while model_utils.getPrediction(blur(input_tensor), model, "cpu", target)[0] * 100 > 1 and klen <= 101:
        klen += 2
        ksig += 2
        kern = mas.gkern(klen, ksig)

        def blur(x: torch.Tensor, kern: torch.Tensor = kern, klen: int = klen) -> torch.Tensor:
            return F.conv2d(x, kern, padding=klen // 2)

    return blur, klen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("official", type=Path, help="a checkout of the official MDA repository")
    parser.add_argument("--out", type=Path, default=Path("tests/data/mda_oracle.safetensors"))
    args = parser.parse_args()
    sys.path.insert(0, str(args.official.resolve()))
    from util import model_utils
    from util.attribution_methods import MDAFunctions
    from util.test_methods import MASTestFunctions

    torch.set_num_threads(1)
    grid = patch_grid(224, 224, 224 // GRID).numpy()
    MDAFunctions.slic = lambda *args, **kwargs: grid  # the regular grid (see the module docstring)
    unstable_argsort = np.argsort
    np.argsort = lambda a, axis=-1, kind=None, order=None: unstable_argsort(a, axis=axis, kind="stable", order=order)
    recorded: dict[str, list[Any]] = {"ins": [], "del": [], "fit": []}
    for name, key in (("find_insertion_patches", "ins"), ("find_deletion_patches", "del"), ("normalize_curve", "fit")):
        original = getattr(MDAFunctions, name)

        def wrapper(*a: Any, _original: Any = original, _key: str = key, **kw: Any) -> Any:
            out = _original(*a, **kw)
            recorded[_key].append((a, out))
            return out

        setattr(MDAFunctions, name, wrapper)

    model = build_model()
    clf = Classifier(model, MEAN, STD)
    x = images()
    out: dict[str, torch.Tensor] = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
    prior = get_explainer("integrated-gradients", clf).attribute(x)  # the prior both runs use
    window = min(2 * int(CELLS**0.5), 28)
    centres = np.arange(GRID) * (224 // GRID) + (224 // GRID) // 2
    for i in range(len(x)):
        for key in recorded:
            recorded[key].clear()
        input_tensor = clf.normalize(x[i : i + 1])
        target = int(model_utils.getClass(input_tensor, model, "cpu"))
        blur, klen = official_blur(MASTestFunctions, model_utils, model, input_tensor, target)
        saliency = prior[i].numpy()[:, :, None] * np.ones((224, 224, 3))
        maps = MDAFunctions.MDA(x[i], input_tensor, saliency, CELLS, blur, model, "cpu", 224, max_batch_size=5)
        _, _, order_a, mr_ins = recorded["ins"][0][1]
        steps = int((order_a >= 0).sum())
        end = int(np.where(mr_ins >= 0.9)[0][0])
        if end + 1 != steps or steps > CELLS - window:
            raise SystemExit(f"image {i}: the official insertion search took a path it gets wrong ({steps}, {end})")
        dele = recorded["del"][0][1]
        cells = [dele[2 * g][np.ix_(centres, centres)][:, :, 0].reshape(-1) for g in range(3)]
        for g, full in enumerate(dele[0:6:2]):  # each unsmoothed map is constant on every cell
            assert np.array_equal(full[:, :, 0], cells[g][grid]), (i, g)
        out[f"{i}.target"] = torch.tensor(target)
        out[f"{i}.blur_size"] = torch.tensor(klen)
        out[f"{i}.insertion"] = torch.as_tensor(order_a[:steps]).long()
        out[f"{i}.deletion"] = torch.as_tensor(dele[6]).long()
        out[f"{i}.cells"] = torch.tensor(np.stack(cells), dtype=torch.float32)  # (3, N): gamma 0, 0.5, 1
        out[f"{i}.smooth"] = torch.tensor(np.stack([m[::8, ::8, 0] for m in maps]), dtype=torch.float32)
        for j, (a, fit) in enumerate(recorded["fit"]):
            out[f"{i}.fit{j}.in"] = torch.tensor(np.array(a[0]), dtype=torch.float64)
            out[f"{i}.fit{j}.out"] = torch.tensor(np.array(fit), dtype=torch.float64)
        print(f"image {i}: class {target}, blur {klen}, {steps} insertion steps, {len(recorded['fit'])} fits")
    meta = {"official_commit": OFFICIAL_COMMIT, "model": json.dumps(MODEL), "mean": json.dumps(MEAN)}
    meta |= {"std": json.dumps(STD), "image_seeds": json.dumps(IMAGE_SEEDS), "grid": str(GRID)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(args.out), metadata=meta)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
