"""Semantic Pullback on a small trained ResNet: faithfulness next to the plain gradient, and speed next to IG.

Classifier: ``small_model_config("resnet", 64)`` (ResNet-10t at half width) trained for a short run on
:class:`~attr_engine.data.shapes.ShapesDataset`; the weights are written to a temporary directory once per session
and loaded back from there. Targets are the classes predicted on the clean held-out images.

- Infidelity, optimal-scaling variant (methods.md section 4): for every patch size, patches of the image are
  replaced *cumulatively* (row by row) by uniform noise in [0, 1]; per replacement ``a = sum(A * (x - x'))`` and
  ``b = logit(x) - logit(x')``; per image ``beta = E[ab] / E[a^2]`` and the score is ``mean((beta a - b)^2)``,
  averaged over 5 noise samples and the patch sizes 32 and 16 (the paper's 112 and 56 at 224 px, scaled to 64 px).
  Lower is better. ``A`` is the signed (3, H, W) attribution.
- Max-sensitivity: ``max_d ||A(x + d) - A(x)|| / ||A(x)||`` over 10 draws of ``d ~ U[-r, r]^(3 x H x W)``,
  ``r = 0.02`` in [-1, 1] units (0.01 in our [0, 1] pixel units). Lower is better.
- Speed: ms/image at batch 16 (best of the rounds: the least disturbed by other processes on a shared CPU) for the
  plain gradient, SfP, PA (K = 5) and Captum's IntegratedGradients (n_steps = 50, zero baseline; needs
  ``pip install captum``, skipped otherwise).

The metric helpers here are deliberately minimal (to be replaced by attr_engine's evaluation module).

Run from the repository root (``-s`` prints the summary tables):
``OMP_NUM_THREADS=1 python -m pytest benches/bench_pullback.py -q -s --benchmark-min-rounds=5``
(one intra-op thread: on a CPU shared with other processes, OpenMP threads that get preempted make timings swing
by 10-50x; with one thread they are stable.)
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from attr_engine.classifier import Classifier, load_classifier, save_classifier
from attr_engine.classifier_training import evaluate_accuracy, small_model_config, train_classifier
from attr_engine.data.shapes import ShapesDataset
from attr_engine.pullback import SemanticPullback
from benches._common import DEVICE, peak_memory_mb

MODULE = "benches.bench_pullback"
IMG = 64
N_TRAIN, EPOCHS = 1536, 6
N_EVAL = 64
TIME_BATCH = 16
PATCH_SIZES = (IMG // 2, IMG // 4)
N_NOISE = 5
SENS_RADIUS = 0.01  # 0.02 in [-1, 1] units
SENS_SAMPLES = 10

Explain = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def input_gradient(classifier: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Plain d logit_target / d x: (B, 3, H, W)."""
    with torch.enable_grad():
        x = x.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(classifier(x).gather(1, target[:, None]).sum(), x)
    return grad


def explainers(classifier: torch.nn.Module) -> dict[str, Explain]:
    """Signed (B, 3, H, W) attributions: the plain gradient, SfP and PA (K = 5, default step)."""
    sp = SemanticPullback(classifier)
    return {
        "gradient": lambda x, t: input_gradient(classifier, x, t),
        "SfP": lambda x, t: sp.attribute(x, t, method="soft", reduce=None),
        "PA (K=5)": lambda x, t: sp.attribute(x, t, method="ascent", steps=5, reduce=None),
    }


@torch.no_grad()
def infidelity(
    classifier: torch.nn.Module,
    x: torch.Tensor,
    target: torch.Tensor,
    attribution: torch.Tensor,
    gen: torch.Generator,
) -> torch.Tensor:
    """Optimal-scaling infidelity per image (B,), cumulative patch replacement by uniform noise (see module doc)."""
    B, C, H, W = x.shape
    logit = classifier(x).gather(1, target[:, None])[:, 0]
    scores = []
    for _ in range(N_NOISE):
        for p in PATCH_SIZES:
            steps, current = [], x
            for top in range(0, H, p):
                for left in range(0, W, p):
                    current = current.clone()
                    h, w = min(p, H - top), min(p, W - left)
                    current[..., top : top + h, left : left + w] = torch.rand(B, C, h, w, generator=gen)
                    steps.append(current)
            perturbed = torch.stack(steps, dim=1)  # (B, P, C, H, W), P patch positions
            n_pos = perturbed.shape[1]
            logits = classifier(perturbed.flatten(0, 1)).view(B, n_pos, -1)
            b = logit[:, None] - logits.gather(2, target.view(B, 1, 1).expand(B, n_pos, 1))[..., 0]
            a = (attribution[:, None] * (x[:, None] - perturbed)).flatten(2).sum(2)
            beta = (a * b).sum(1) / (a * a).sum(1).clamp_min(torch.finfo(a.dtype).tiny)
            scores.append(((beta[:, None] * a - b) ** 2).mean(1))
    return torch.stack(scores).mean(0)


def max_sensitivity(explain: Explain, x: torch.Tensor, target: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Max-sensitivity per image (B,): worst relative change of the attribution under uniform input noise."""
    base = explain(x, target).flatten(1)
    worst = torch.zeros(len(x))
    for _ in range(SENS_SAMPLES):
        noise = (torch.rand(x.shape, generator=gen) * 2 - 1) * SENS_RADIUS
        change = (explain(x + noise, target).flatten(1) - base).norm(dim=1) / base.norm(dim=1)
        worst = torch.maximum(worst, change)
    return worst


@pytest.fixture(scope="session")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Classifier:
    """The trained ResNet, cached as safetensors in a session temp dir and loaded back from there."""
    path = tmp_path_factory.mktemp("bench_pullback") / "resnet10t_shapes64.safetensors"
    train_set = ShapesDataset(N_TRAIN, img_size=IMG, seed=0, with_masks=False)
    start = time.perf_counter()
    trained = train_classifier(small_model_config("resnet", IMG), train_set, epochs=EPOCHS, seed=0)
    save_classifier(trained, path)
    clf = load_classifier("resnet10t", checkpoint=path)
    acc = evaluate_accuracy(clf, ShapesDataset(256, img_size=IMG, seed=1, with_masks=False))
    seconds = time.perf_counter() - start
    print(f"\n[bench_pullback] resnet10t/64px: {acc:.1%} held-out accuracy, trained in {seconds:.0f} s")
    return clf


@pytest.fixture(scope="session")
def eval_batch(classifier: Classifier) -> tuple[torch.Tensor, torch.Tensor]:
    x, _, _ = ShapesDataset(N_EVAL, img_size=IMG, seed=1000).tensors()
    with torch.no_grad():
        return x, classifier(x).argmax(1)


def test_faithfulness(benchmark, classifier: Classifier, eval_batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Infidelity and max-sensitivity of the gradient, SfP and PA on the same images (means over images)."""
    x, target = eval_batch

    def measure() -> dict[str, dict[str, float]]:
        gen = torch.Generator().manual_seed(0)
        table = {}
        for name, explain in explainers(classifier).items():
            inf = infidelity(classifier, x, target, explain(x, target), gen)
            sens = max_sensitivity(explain, x, target, gen)
            table[name] = {"infidelity": inf.mean().item(), "infidelity_median": inf.median().item()}
            table[name]["max_sensitivity"] = sens.mean().item()
        return table

    table = benchmark.pedantic(measure, rounds=1, iterations=1)
    ratio = table["PA (K=5)"]["infidelity"] / table["gradient"]["infidelity"]
    benchmark.extra_info.update({"images": len(x), "metrics": table, "pa_over_gradient_infidelity": ratio})
    print(f"\n{'method':10s} {'infidelity':>11s} {'(median)':>9s} {'max-sens':>9s}")
    for name, row in table.items():
        print(f"{name:10s} {row['infidelity']:11.3f} {row['infidelity_median']:9.3f} {row['max_sensitivity']:9.3f}")
    print(f"PA / gradient infidelity: {ratio:.2f} (target <= 0.33)")
    # What the paper's ranking asserts robustly at any scale: PA more faithful than the gradient, SfP more stable.
    assert ratio < 1.0
    assert table["SfP"]["max_sensitivity"] < table["gradient"]["max_sensitivity"]


def _timed_cases(classifier: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> dict[str, Callable[[], object]]:
    cases: dict[str, Callable[[], object]] = {
        name: (lambda f=f: f(x, target)) for name, f in explainers(classifier).items()
    }
    try:
        from captum.attr import IntegratedGradients
    except ImportError:
        return cases
    ig = IntegratedGradients(classifier)
    cases["IG (n_steps=50)"] = lambda: ig.attribute(x, target=target, n_steps=50)
    return cases


def make_case(provider: str, device: str = "cpu", batch: int = TIME_BATCH) -> Callable[[], object]:
    """One attribution call of ``provider`` on an untrained classifier of the same architecture (peak memory)."""
    torch.manual_seed(0)
    clf = small_model_config("resnet", IMG).build(6).to(device)
    x = torch.rand(batch, 3, IMG, IMG, device=device)
    return _timed_cases(clf, x, torch.zeros(batch, dtype=torch.long, device=device))[provider]


@pytest.mark.parametrize("method", ["gradient", "SfP", "PA (K=5)", "IG (n_steps=50)"])
def test_speed(benchmark, method: str, classifier: Classifier, eval_batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, target = (t[:TIME_BATCH].to(DEVICE) for t in eval_batch)
    cases = _timed_cases(classifier.to(DEVICE), x, target)
    if method not in cases:
        pytest.skip("captum is not installed (pip install captum)")
    fn = cases[method]
    fn()  # warm-up
    benchmark.extra_info["batch"] = TIME_BATCH
    benchmark.extra_info["peak_mem_mb"] = round(peak_memory_mb(MODULE, method, DEVICE, batch=TIME_BATCH), 1)
    benchmark(fn)
    # The minimum is the least disturbed by other processes on a shared CPU; the median is kept for reference.
    benchmark.extra_info["ms_per_image_min"] = 1e3 * benchmark.stats.stats.min / TIME_BATCH
    benchmark.extra_info["ms_per_image_median"] = 1e3 * benchmark.stats.stats.median / TIME_BATCH


def test_pa_speedup_over_integrated_gradients(classifier: Classifier, eval_batch: tuple[torch.Tensor, torch.Tensor]):
    """PA with K = 5 does 5 forward + backward passes, IG-50 does 50: PA must be at least 8x faster."""
    pytest.importorskip("captum")
    x, target = (t[:TIME_BATCH].to(DEVICE) for t in eval_batch)
    cases = _timed_cases(classifier.to(DEVICE), x, target)
    ms = {}
    for name in ("gradient", "PA (K=5)", "IG (n_steps=50)"):
        cases[name]()
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            cases[name]()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            runs.append(time.perf_counter() - start)
        ms[name] = 1e3 * min(runs) / TIME_BATCH  # min: robust to other processes on a shared CPU
    print("\n" + "  ".join(f"{name}: {v:.2f} ms/image" for name, v in ms.items()))
    print(f"IG-50 / PA: {ms['IG (n_steps=50)'] / ms['PA (K=5)']:.1f}x (target >= 8x)")
    assert ms["IG (n_steps=50)"] >= 8 * ms["PA (K=5)"]
