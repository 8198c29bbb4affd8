"""Metric throughput against Quantus 0.6.0 on the same inputs, with the results compared.

    python -m benches.bench_metrics                 # 16 images, 64 px, small ViT and ResNet
    python -m benches.bench_metrics --quick         # 4 images, fewer samples (about a minute)
    python -m benches.bench_metrics --device cuda   # on a GPU

Each row times one metric on the same classifier, images, maps and explainer (our Captum-backed input gradient,
handed to Quantus through ``quantus_explain_func``), with randomness shared, and reports both scores' largest
relative difference:

- infidelity, Quantus' defaults (4 px patches, "black" baseline, 10 samples);
- infidelity with uniform baselines (the Semantic Pullback paper's kind; 16 and 32 px patches, 5 samples; the same
  draws fed to both);
- max-sensitivity (radius 0.02, the same noise fed to both);
- random logit, SSIM (Quantus' default) and Pearson.

The classifiers are untrained: throughput does not depend on the weights. The timing is wall time of one call; the
explainer and classifier are warmed up once beforehand (lazy imports, allocator) so neither side pays for that.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import quantus
import torch

from attr_engine.adapters import quantus_explain_func
from attr_engine.baselines import Gradient
from attr_engine.classifier_training import small_model_config
from attr_engine.metrics import infidelity, max_sensitivity, random_logit

IMG = 64


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def rel_diff(ours: torch.Tensor, ref: Any) -> float:
    ref_t = torch.as_tensor(np.asarray(ref, dtype=np.float64))
    ours = ours.detach().double().cpu()
    return float(((ours - ref_t).abs() / ref_t.abs().clamp_min(1e-12)).max())


def cases(clf, x: torch.Tensor, y: torch.Tensor, quick: bool) -> list[tuple[str, Callable, Callable]]:
    """(name, ours(), quantus()) pairs that compute the same numbers."""
    explainer = Gradient(clf)
    explainer.attribute(x[:1], y[:1])  # warm-up, shared by both sides
    maps = explainer.attribute(x, y)
    xn, yn, an = x.cpu().numpy(), y.cpu().numpy(), maps.cpu().numpy()[:, None]
    common = {"model": clf, "x_batch": xn, "y_batch": yn, "a_batch": an, "device": str(x.device)}
    explain_func = quantus_explain_func(explainer)
    batch = len(x)
    n_inf = 2 if quick else 10
    n_uni = 2 if quick else 5
    n_sens = 3 if quick else 10
    out = []

    out.append(
        (
            f"infidelity (Quantus defaults: 4 px, black, {n_inf} samples)",
            lambda: infidelity(clf, x, maps, y, patch_sizes=(4,), n_samples=n_inf, baseline="black"),
            lambda: quantus.Infidelity(n_perturb_samples=n_inf, disable_warnings=True)(**common),
        )
    )

    patches = (IMG // 4, IMG // 2)
    n_patches = sum((IMG // p) ** 2 for p in patches)
    np.random.seed(0)  # noqa: NPY002 - Quantus draws from numpy's legacy global RNG
    draws = np.random.uniform(0.0, 1.0, size=(n_uni, n_patches, batch))  # noqa: NPY002

    def quantus_uniform() -> Any:
        np.random.seed(0)  # noqa: NPY002
        metric = quantus.Infidelity(
            perturb_baseline="uniform",
            perturb_patch_sizes=list(patches),
            n_perturb_samples=n_uni,
            disable_warnings=True,
        )
        return metric(**common)

    out.append(
        (
            f"infidelity (uniform, {patches[0]}+{patches[1]} px, {n_uni} samples)",
            lambda: infidelity(
                clf,
                x,
                maps,
                y,
                patch_sizes=patches,
                n_samples=n_uni,
                baseline="uniform",
                baseline_values=torch.from_numpy(draws),
            ),
            quantus_uniform,
        )
    )

    np.random.seed(1)  # noqa: NPY002
    noise = np.random.uniform(-0.02, 0.02, size=(n_sens, batch, x[0].numel()))  # noqa: NPY002
    shared = torch.from_numpy(noise).float().view(n_sens, *x.shape).to(x.device)

    def quantus_sensitivity() -> Any:
        np.random.seed(1)  # noqa: NPY002
        metric = quantus.MaxSensitivity(nr_samples=n_sens, lower_bound=0.02, disable_warnings=True)
        return metric(**common, explain_func=explain_func)

    out.append(
        (
            f"max-sensitivity (r 0.02, {n_sens} samples)",
            lambda: max_sensitivity(explainer, x, y, maps=maps, noise=shared, batch_size=256),
            quantus_sensitivity,
        )
    )

    num_classes = clf.num_classes
    np.random.seed(42)  # noqa: NPY002 - RandomLogit reseeds with its seed (42) per batch
    r = torch.from_numpy(np.random.randint(0, num_classes - 1, batch)).to(x.device)  # noqa: NPY002
    off = r + (r >= y).long()
    for sim, func in (("ssim", quantus.similarity_func.ssim), ("pearson", quantus.similarity_func.correlation_pearson)):
        out.append(
            (
                f"random logit ({sim})",
                lambda sim=sim: random_logit(
                    explainer, x, y, maps=maps, similarity=sim, off_target=off, normalise="batch_max", batch_size=256
                ),
                lambda func=func: quantus.RandomLogit(
                    num_classes=num_classes, similarity_func=func, disable_warnings=True
                )(**common, explain_func=explain_func),
            )
        )
    return out


def run(kind: str, n: int, quick: bool, device: torch.device) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    clf = small_model_config(kind, IMG).build(num_classes=6).to(device)
    x = torch.rand(n, 3, IMG, IMG, generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        y = clf(x).argmax(1)
    rows = []
    for name, ours, theirs in cases(clf, x, y, quick):
        ours_out, ours_s = timed(ours, device)
        ref_out, ref_s = timed(theirs, device)
        rows.append(
            {
                "model": kind,
                "metric": name,
                "ours_s": ours_s,
                "quantus_s": ref_s,
                "speedup": ref_s / ours_s,
                "max_rel_diff": rel_diff(ours_out, ref_out),
            }
        )
        r = rows[-1]
        print(
            f"| {kind} | {name} | {r['ours_s']:.2f} | {r['quantus_s']:.2f} | {r['speedup']:.1f}x | "
            f"{r['max_rel_diff']:.1e} |",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--images", type=int, default=None, help="images per metric call (default 16; quick 4)")
    parser.add_argument("--kind", choices=("vit", "resnet", "both"), default="both")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    n = args.images or (4 if args.quick else 16)
    print(f"{n} images of {IMG} px on {device}, torch threads {torch.get_num_threads()}")
    print("| model | metric | ours (s) | Quantus (s) | speedup | max rel. diff |")
    print("|---|---|---|---|---|---|")
    kinds = ["vit", "resnet"] if args.kind == "both" else [args.kind]
    rows = [row for kind in kinds for row in run(kind, n, args.quick, device)]
    speedups = [r["speedup"] for r in rows]
    print(f"geometric-mean speedup {float(np.exp(np.mean(np.log(speedups)))):.1f}x over {len(rows)} rows")


if __name__ == "__main__":
    main()
