"""Cost at the floor (issue #24): every method against the classifier passes it needs, side by side in one process.

    python -u -m benches.bench_floor --threads 1                      # 32, 64 and 224 px, three models
    python -u -m benches.bench_floor --threads 2 --sizes 32,64
    python -u -m benches.bench_floor --threads 1 --sizes 32 --models vit --repeats 1   # a smoke run, seconds

Models (untrained, 10 classes, built at each size): ``small_model_config("vit")`` (4 blocks, width 96, an 8 x 8
patch grid at every size), timm ``resnet18`` and ``convnext_tiny``. Batch: 64 images at 32 px, scaled with the
pixel count below that (16 at 64 px, 2 at 224 px). Times are the minimum over ``--repeats`` calls after one warm-up
call, in ms per image; ratios are taken within one model and size, from the same run:

- ``gradient``: one plain input-gradient pass (forward + backward), the floor of every gradient method;
- ``SfP``: one soft-adjoint pass; ``SfP / gradient`` is its overhead over that floor;
- ``PA K=5``: Pullback Ascent, five soft passes; ``IG-50``: Captum Integrated Gradients, 50 steps,
  ``internal_batch_size=512`` (the issue's setting);
- ``AHA T=0``: one backbone pass and the decoder, with the profile of its parts: the backbone, the class embedding,
  each level's projection and fusion, the x2 upsampling convolutions, the full-resolution image stem, the head
  (with the output projection), the rest (resizes, concatenations: the decoder's time not in those modules) and
  the per-image standardisation.

``--step`` profiles one AHA training step instead (issue #24 item 4), on the leaderboard's small ViT and ResNet
(``small_model_config``) at ``--step-size`` px with the default AHAConfig (16 fractions, two targets per image) at
batch ``--step-batch`` and a fixed grid (``--step-grid``; the 64 px rule draws 7..28): the classifier and
backbone passes that pick the targets, the decoder, the engine (region pooling, the sorter, the blend, the loss)
and the classifier passes on the blended images, forward and backward apart. The backward is split where its
gradient reaches the blended images (the classifier's part ends) and the maps (the engine's part ends), by
tensor hooks. Two shares are printed: the engine's (pooling, sorter, blend, loss) and everything that is not a
classifier pass (the engine and the decoder), the issue's measure.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn

import attr_engine_kernels as kernels
from attr_engine.aha import AHA, AHAConfig
from attr_engine.aha.loss import peak_penalty, sorter_scores, target_probabilities, trapezoid_auc
from attr_engine.aha.model import standardise_maps
from attr_engine.classifier import Classifier, load_classifier
from attr_engine.classifier_training import small_model_config
from attr_engine.explainer import get_explainer
from attr_engine.imageops import reference_image

MODELS = ("vit", "resnet18", "convnext_tiny")


def build(model: str, size: int) -> Classifier:
    """An untrained 10-class classifier of ``model`` at ``size`` px, seeded."""
    torch.manual_seed(0)
    if model == "vit":
        config = small_model_config("vit", size)
        return load_classifier(config.name, num_classes=10, img_size=size, **config.kwargs)
    return load_classifier(model, num_classes=10, img_size=size)


def best_ms(fn: Callable[[], object], images: int, repeats: int) -> float:
    """Minimum wall time of ``repeats`` calls after one warm-up, in ms per image."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times) / images


class Profile:
    """Wall time per decoder part, by forward pre-hooks and hooks that exist only inside ``with``."""

    def __init__(self, decoder: nn.Module) -> None:
        self.decoder = decoder
        self.seconds: dict[str, float] = defaultdict(float)
        self._handles: list = []

    def parts(self) -> dict[str, nn.Module]:
        d = self.decoder
        out: dict[str, nn.Module] = {"class embedding": d.class_embed, "upsampling convs": d.up}
        for i, (proj, fuse) in enumerate(zip(d.project, d.fuse, strict=True)):
            out[f"level {i} project"] = proj
            out[f"level {i} fuse"] = fuse
        out["image stem"] = d.image_stem
        out["head"] = d.head
        out["head output"] = d.out
        return out

    def __enter__(self) -> Profile:
        for name, module in self.parts().items():
            started: list[float] = []
            self._handles.append(module.register_forward_pre_hook(lambda *_, s=started: s.append(time.perf_counter())))
            self._handles.append(
                module.register_forward_hook(
                    lambda *_, s=started, n=name: self.seconds.__setitem__(
                        n, self.seconds[n] + time.perf_counter() - s.pop()
                    )
                )
            )
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def aha_profile(aha: AHA, x: torch.Tensor, target: torch.Tensor, repeats: int) -> dict[str, float]:
    """ms/image of each part of one AHA T=0 call (the fastest of ``repeats`` decoder calls)."""
    best: dict[str, float] = {}
    with torch.no_grad():
        aha.backbone(x)
        for _ in range(repeats):
            row: dict[str, float] = {}
            start = time.perf_counter()
            feats = aha.backbone(x)
            row["backbone"] = time.perf_counter() - start
            with Profile(aha.decoder) as prof:
                start = time.perf_counter()
                maps = aha.decoder(feats, x, target)
                total = time.perf_counter() - start
            row.update(prof.seconds)
            row["resizes, concatenations"] = total - sum(prof.seconds.values())
            row["decoder"] = total
            start = time.perf_counter()
            standardise_maps(maps)
            row["standardise"] = time.perf_counter() - start
            if not best or row["decoder"] + row["backbone"] < best["decoder"] + best["backbone"]:
                best = row
    return {k: 1e3 * v / len(x) for k, v in best.items()}


def run(model: str, size: int, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    classifier = build(model, size)
    batch = max(2, round(64 * (32 / size) ** 2))
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(batch, 3, size, size, generator=gen)
    target = torch.randint(0, 10, (batch,), generator=gen)
    aha = AHA(classifier, AHAConfig())
    methods = {
        "gradient": get_explainer("gradient", classifier),
        "SfP": get_explainer("pullback-soft", classifier),
        "PA K=5": get_explainer("pullback-ascent", classifier, steps=5),
        "IG-50": get_explainer("integrated-gradients", classifier, n_steps=50, internal_batch_size=512),
        "AHA T=0": get_explainer("aha", classifier, aha=aha),
    }
    if "decoder" in AHAConfig.__dataclass_fields__:  # the light decoder (absent before issue #24)
        light = AHA(classifier, AHAConfig(decoder="light"))
        methods["AHA T=0 light"] = get_explainer("aha", classifier, aha=light)
    ms = {}
    for name, explainer in methods.items():
        reps = 1 if name == "IG-50" and size >= 224 else repeats
        ms[name] = best_ms(lambda e=explainer: e.attribute(x, target), batch, reps)
    return ms, aha_profile(aha, x, target, repeats)


def step_parts(aha: AHA, x: torch.Tensor, grid: int, gen: torch.Generator) -> dict[str, float]:
    """Seconds of each part of one training step of ``aha`` on images ``x`` (as ``trainer._train_step`` runs it:
    the same calls in the same order, with the grid, the reference and the fractions fixed)."""
    cfg = aha.config.resolved(x.shape[-1])
    clf = aha.classifier
    row: dict[str, float] = {}
    start = time.perf_counter()
    with torch.no_grad():
        top2 = clf(x).topk(2, dim=1).indices
        feats = aha.backbone(x)
    target = torch.cat((top2[:, 0], top2[:, 1]))  # "pred+label" with labels unknown: the runner-up
    xs = x.repeat(2, 1, 1, 1)
    feats = [f.repeat(2, 1, 1, 1) for f in feats]
    row["targets: classifier + backbone (no grad)"] = time.perf_counter() - start
    start = time.perf_counter()
    maps = aha.decoder(feats, xs, target)
    row["decoder forward"] = time.perf_counter() - start
    start = time.perf_counter()
    reference = reference_image(xs, "mean", clf.norm_mean)
    fractions = torch.linspace(0, 1, cfg.n_fractions)
    scores = sorter_scores(kernels.region_pool(maps, grid, (0.3, 0.6)).flatten(1), cfg.score_norm, cfg.anchor_span)
    masks = kernels.soft_topk_masks(
        torch.cat((scores, -scores)), fractions, tau=0.5, n_iters=cfg.n_iters, noise=cfg.noise, generator=int(
            torch.randint(0, 2**30, (1,), generator=gen)), validate=False,
    ).view(2 * len(xs), -1, grid, grid)  # fmt: skip
    images = kernels.soft_mask_blend(
        torch.cat((xs, xs)), torch.cat((reference, reference)), masks, (0.3, 0.6), smooth_sigma=cfg.mask_sigma,
        validate=False,
    )  # fmt: skip
    row["engine forward: pool, sorter, blend"] = time.perf_counter() - start
    start = time.perf_counter()
    curves = target_probabilities(clf, images, torch.cat((target, target)))
    row["classifier forward (blends)"] = time.perf_counter() - start
    start = time.perf_counter()
    aucs = trapezoid_auc(curves, fractions)
    loss = aucs[: len(xs)].mean() + (1 - aucs[len(xs) :]).mean() + cfg.peak_weight * peak_penalty(maps, cfg.peak_kernel)
    row["engine forward: loss"] = time.perf_counter() - start
    marks: dict[str, float] = {}

    def mark(name: str) -> Callable[[torch.Tensor], None]:
        def hook(_grad: torch.Tensor) -> None:
            marks.setdefault(name, time.perf_counter())

        return hook

    images.register_hook(mark("images"))
    maps.register_hook(mark("maps"))
    start = time.perf_counter()
    loss.backward()
    end = time.perf_counter()
    row["classifier backward (blends)"] = marks["images"] - start
    row["engine backward: blend, sorter, pool, loss"] = marks["maps"] - marks["images"]
    row["decoder backward"] = end - marks["maps"]
    aha.decoder.zero_grad(set_to_none=True)
    return row


def step_profile(kind: str, size: int, batch: int, grid: int, repeats: int, decoder: str = "full") -> dict[str, float]:
    """ms per training step of each part (the fastest of ``repeats`` steps after one warm-up)."""
    config = small_model_config(kind, size)
    torch.manual_seed(0)
    classifier = load_classifier(config.name, num_classes=10, img_size=size, **config.kwargs)
    aha = AHA(classifier, AHAConfig(decoder=decoder) if decoder != "full" else AHAConfig())
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(batch, 3, size, size, generator=gen)
    step_parts(aha, x, grid, gen)
    rows = [step_parts(aha, x, grid, gen) for _ in range(repeats)]
    best = min(rows, key=lambda r: sum(r.values()))
    return {k: 1e3 * v for k, v in best.items()}


def print_step_profiles(args: argparse.Namespace) -> None:
    profiles = {kind: step_profile(kind, args.step_size, args.step_batch, args.step_grid, args.repeats,
                                   args.decoder) for kind in ("vit", "resnet")}  # fmt: skip
    print(
        f"\n{torch.get_num_threads()} threads; one AHA training step, {args.step_size} px, batch {args.step_batch} "
        f"(x2 targets), grid {args.step_grid}, {AHAConfig().n_fractions} fractions, {args.decoder} decoder; ms (min of "
        f"{args.repeats})\n"
    )
    print("| part | " + " | ".join(profiles) + " |")
    print("|---|" + "---|" * len(profiles))
    for part in next(iter(profiles.values())):
        print(f"| {part} | " + " | ".join(f"{p[part]:.1f}" for p in profiles.values()) + " |")
    totals = {k: sum(p.values()) for k, p in profiles.items()}
    print("| total | " + " | ".join(f"{t:.1f}" for t in totals.values()) + " |")
    shares = {k: sum(v for n, v in p.items() if n.startswith("engine")) / totals[k] for k, p in profiles.items()}
    print("| engine share (pool, sorter, blend, loss) | " + " | ".join(f"{s:.1%}" for s in shares.values()) + " |")
    # The measure: everything that is not a classifier pass (the decoder included).
    rest = {k: sum(v for n, v in p.items() if "classifier" not in n) / totals[k] for k, p in profiles.items()}
    print("| **not a classifier pass** | " + " | ".join(f"**{s:.1%}**" for s in rest.values()) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--sizes", default="32,64,224")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--step", action="store_true", help="profile one AHA training step instead")
    parser.add_argument("--step-size", type=int, default=64)
    parser.add_argument("--step-batch", type=int, default=8)
    parser.add_argument("--step-grid", type=int, default=16)
    parser.add_argument("--decoder", choices=("full", "light"), default="full", help="the decoder of --step")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.step:
        print_step_profiles(args)
        return
    models = [m.strip() for m in args.models.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    method_rows, profile_rows = [], []
    for model in models:
        for size in sizes:
            ms, prof = run(model, size, args.repeats)
            method_rows.append((model, size, ms))
            profile_rows.append((model, size, prof))
            print(f"{model} {size}px: " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()), flush=True)
    print(f"\n{torch.get_num_threads()} threads; ms/image (min of {args.repeats}); ratios within a row\n")
    print("| model | px | gradient | SfP | PA K=5 | IG-50 | AHA T=0 | AHA T=0 light | SfP / gradient | PA / gradient |"
          " IG-50 / PA | IG-50 / AHA | IG-50 / AHA light |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model, size, ms in method_rows:
        g, s, pa, ig, aha = (ms[k] for k in ("gradient", "SfP", "PA K=5", "IG-50", "AHA T=0"))
        light = ms.get("AHA T=0 light")
        cells = (f"{light:.2f}", f"{ig / light:.1f}x") if light else ("-", "-")
        print(
            f"| {model} | {size} | {g:.2f} | {s:.2f} | {pa:.2f} | {ig:.1f} | {aha:.2f} | {cells[0]} | {s / g:.2f} | "
            f"{pa / g:.2f} | {ig / pa:.1f}x | {ig / aha:.1f}x | {cells[1]} |"
        )
    parts = list(profile_rows[0][2])
    print("\nAHA T=0 profile, ms/image\n")
    print("| part | " + " | ".join(f"{m} {s}" for m, s, _ in profile_rows) + " |")
    print("|---|" + "---|" * len(profile_rows))
    names = sorted({k for _, _, p in profile_rows for k in p}, key=lambda k: parts.index(k) if k in parts else 99)
    for part in names:
        print(f"| {part} | " + " | ".join(f"{p.get(part, 0.0):.3f}" for _, _, p in profile_rows) + " |")


if __name__ == "__main__":
    main()
