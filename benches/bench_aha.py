"""AHA end to end on the embedded data: train a classifier, train AHA, score it against gradient baselines.

    python -m benches.bench_aha --kind vit            # ViT classifier (default settings, ~10 min on 2 CPU cores)
    python -m benches.bench_aha --kind resnet
    python -m benches.bench_aha --kind vit --quick    # a smoke run in about a minute

Prints one table per classifier: hard deletion / insertion AUC (AHA protocol: mean-colour reference, 21 points,
pixel-level ranking), pointing game and ms/image for AHA (T=0 and T=3 refinement steps), the input gradient
(|grad| summed over channels) and gradient x input, all on the same held-out images. Lower deletion and higher
insertion are better.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from attr_engine.aha import AHA, AHAConfig
from attr_engine.classifier import Classifier
from attr_engine.classifier_training import evaluate_accuracy, small_model_config, train_classifier
from attr_engine.data.shapes import ShapesDataset
from attr_engine.metrics import deletion_insertion, energy_pointing_game, pointing_game


def input_gradient(classifier: Classifier, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """d logit_target / d x, (B, 3, H, W)."""
    with torch.enable_grad():
        x = x.detach().requires_grad_()
        logits = classifier(x)
        (grad,) = torch.autograd.grad(logits.gather(1, target[:, None]).sum(), x)
    return grad


def saliency(classifier: Classifier, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return input_gradient(classifier, x, target).abs().sum(1)


def gradient_x_input(classifier: Classifier, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (input_gradient(classifier, x, target) * x).sum(1)


def _score(
    name: str,
    explain: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    classifier: Classifier,
    x: torch.Tensor,
    masks: torch.Tensor,
    target: torch.Tensor,
    batch: int,
) -> dict[str, float | str]:
    maps, seconds = [], 0.0
    for i in range(0, len(x), batch):
        start = time.perf_counter()
        maps.append(explain(x[i : i + batch], target[i : i + batch]).detach())
        seconds += time.perf_counter() - start
    amap = torch.cat(maps)
    di = deletion_insertion(classifier, x, amap, target, steps=20, protocol="aha")
    return {
        "method": name,
        "deletion": di.deletion.mean().item(),
        "insertion": di.insertion.mean().item(),
        "pointing": pointing_game(amap, masks).float().mean().item(),
        "energy": energy_pointing_game(amap, masks).mean().item(),
        "ms/image": 1e3 * seconds / len(x),
    }


def run(kind: str, *, quick: bool, seed: int = 0) -> list[dict[str, float | str]]:
    torch.manual_seed(seed)
    img = 64
    n_train, n_test, epochs, aha_steps = (600, 32, 3, 30) if quick else (3000, 128, 12, 400)
    train_set = ShapesDataset(n_train, img_size=img, seed=seed, with_masks=False)
    start = time.perf_counter()
    classifier = train_classifier(small_model_config(kind, img), train_set, epochs=epochs, seed=seed)
    test_set = ShapesDataset(n_test, img_size=img, seed=seed + 1000)
    acc = evaluate_accuracy(classifier, test_set)
    print(f"[{kind}] classifier: {acc:.1%} held-out accuracy, trained in {time.perf_counter() - start:.0f} s")

    # CPU budget: 8 sampled fractions and one target per image keep a step near a second; the rest is the default.
    config = AHAConfig(n_fractions=8, targets="pred", seed=seed)
    aha = AHA(classifier, config)
    start = time.perf_counter()
    history = aha.fit(train_set, batch_size=8, epochs=100, max_steps=aha_steps, progress=False)
    print(
        f"[{kind}] AHA: {aha_steps} steps in {time.perf_counter() - start:.0f} s; soft deletion "
        f"{sum(history['deletion'][:10]) / 10:.3f} -> {sum(history['deletion'][-10:]) / 10:.3f}, soft insertion "
        f"{sum(history['insertion'][:10]) / 10:.3f} -> {sum(history['insertion'][-10:]) / 10:.3f}"
    )

    x, _, masks = test_set.tensors()
    with torch.no_grad():
        target = classifier(x).argmax(1)
    methods: list[tuple[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]] = [
        ("AHA (T=0)", lambda xb, tb: aha.attribute(xb, tb)),
        ("AHA (T=3)", lambda xb, tb: aha.attribute(xb, tb, refine_steps=3, generator=seed)),
        ("input gradient", lambda xb, tb: saliency(classifier, xb, tb)),
        ("gradient x input", lambda xb, tb: gradient_x_input(classifier, xb, tb)),
    ]
    return [_score(name, fn, classifier, x, masks, target, batch=16) for name, fn in methods]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("vit", "resnet"), default="vit")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = run(args.kind, quick=args.quick, seed=args.seed)
    print(f"\n| {args.kind} | deletion (lower) | insertion (higher) | pointing | energy pointing | ms/image |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['deletion']:.3f} | {r['insertion']:.3f} | {r['pointing']:.2f} | "
            f"{r['energy']:.2f} | {r['ms/image']:.1f} |"
        )


if __name__ == "__main__":
    main()
