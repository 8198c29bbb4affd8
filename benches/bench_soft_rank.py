"""soft_topk_masks forward+backward: eager dense definition vs structured reference vs fused Triton.

Headline case (the AHA training step's sorter): B=32, N=784 (28 x 28 grid), n_iters=30, S=16 fractions.

    python -m pytest benches/bench_soft_rank.py --benchmark-columns=median,mean,rounds
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import attr_engine_kernels as kernels
from attr_engine_kernels.soft_rank import _sample_seeds, gumbel_noise, soft_topk_masks, soft_topk_masks_reference
from benches._common import DEVICE, peak_memory_mb, providers

HEADLINE = {"batch": 32, "n": 784, "n_iters": 30, "n_frac": 16}
CASES = [HEADLINE, {"batch": 32, "n": 196, "n_iters": 30, "n_frac": 16}]


def make_case(
    provider: str, *, device: str = DEVICE, batch: int, n: int, n_iters: int, n_frac: int, tau: float = 0.5
) -> Callable[[], torch.Tensor]:
    """A zero-argument callable running one forward+backward of ``provider`` on fresh random scores."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(batch, n, generator=gen).to(device).requires_grad_()
    fractions = torch.linspace(0, 1, n_frac, device=device)
    grad_out = torch.randn(batch, n_frac, n, generator=gen).to(device)

    if provider == "eager":
        # The definition: noise materialised, dense K, autograd through all iterates.
        noise = gumbel_noise(_sample_seeds(batch, 0, torch.device("cpu")), n, device=device)

        def run() -> torch.Tensor:
            masks = soft_topk_masks_reference(scores, fractions, tau=tau, n_iters=n_iters, gumbel=noise)
            masks.backward(grad_out)
            return masks

        return run

    backend = {"reference": "reference", "triton": "triton"}[provider]

    def run() -> torch.Tensor:
        with kernels.set_backend(backend):
            masks = soft_topk_masks(scores, fractions, tau=tau, n_iters=n_iters, generator=0)
            masks.backward(grad_out)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return masks

    return run


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c['batch']}-N{c['n']}-T{c['n_iters']}-S{c['n_frac']}")
@pytest.mark.parametrize("provider", providers())
def test_soft_topk_masks_fwd_bwd(benchmark, provider: str, case: dict) -> None:
    fn = make_case(provider, **case)
    slow_eager = provider == "eager" and DEVICE == "cpu"  # ~30 s and ~5 GB a call at the headline size
    if not slow_eager:
        fn()  # warm-up: first-call allocation, Triton compilation
    rounds = 1 if slow_eager else 3
    benchmark.pedantic(fn, rounds=rounds, iterations=1)
    benchmark.extra_info["peak_mem_mb"] = round(peak_memory_mb("benches.bench_soft_rank", provider, DEVICE, **case), 1)
    benchmark.extra_info.update(case)
