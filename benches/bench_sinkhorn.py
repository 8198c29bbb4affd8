"""Sinkhorn forward+backward: eager definition vs potentials-form reference (vs fused Triton on CUDA).

Shape of the AHA sorter: B = 32 images, N = 196 cells (14 x 14 grid), 20 iterations; N = 784 (28 x 28) on CUDA only,
where the eager formulation's saved iterates (~3 GB) are still affordable and the CPU run would take minutes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from attr_engine_kernels._backend import set_backend
from attr_engine_kernels.sinkhorn import sinkhorn, sinkhorn_reference
from benches._common import DEVICE, peak_memory_mb, providers

SHAPES: list[dict[str, int]] = [{"B": 32, "N": 196, "n_iters": 20}] + (
    [{"B": 32, "N": 784, "n_iters": 20}] if DEVICE == "cuda" else []
)


def make_case(
    provider: str, device: str = DEVICE, B: int = 32, N: int = 196, n_iters: int = 20, tau: float = 1.0
) -> Callable[[], torch.Tensor]:
    """Build inputs once; return a callable running one forward+backward of ``provider`` on them."""
    gen = torch.Generator().manual_seed(0)
    log_alpha = torch.randn(B, N, N, generator=gen).to(device).requires_grad_()
    grad_out = torch.randn(B, N, N, generator=gen).to(device)

    def run() -> torch.Tensor:
        log_alpha.grad = None
        if provider == "eager":
            out = sinkhorn_reference(log_alpha, n_iters, tau)
        else:
            with set_backend(provider):
                out = sinkhorn(log_alpha, n_iters, tau)
        out.backward(grad_out)
        if log_alpha.is_cuda:
            torch.cuda.synchronize()
        return log_alpha.grad

    return run


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
@pytest.mark.parametrize("provider", providers())
def test_sinkhorn_fwd_bwd(benchmark: Any, provider: str, shape: dict[str, int], device: str) -> None:
    # Memory first: on CPU the measuring subprocess is forked from this one, whose resident set it inherits.
    benchmark.extra_info["peak_mem_mb"] = peak_memory_mb("benches.bench_sinkhorn", provider, device, **shape)
    benchmark.group = "sinkhorn " + " ".join(f"{k}={v}" for k, v in shape.items())
    fn = make_case(provider, device=device, **shape)
    fn()  # warm-up: Triton compilation, allocator
    grad = benchmark(fn)
    assert torch.isfinite(grad).all()
