"""region_pool and soft_mask_blend, forward + backward: naive eager formulation vs our reference vs Triton (CUDA).

- eager: ``F.adaptive_avg_pool2d`` for pooling; ``F.interpolate`` of the masks to H x W, then
  ``x + up * (r - x)`` by broadcasting, with plain autograd (keeps the upsampled masks and output-sized temporaries).
  With mask smoothing (``soft_mask_blend smooth``, sigma 1.0 as AHA trains at 224 px) the eager path is the
  official one: ``F.pad(..., mode="reflect")``, a 7 x 7 ``F.conv2d`` of the upsampled masks and ``clamp(0, 1)``.
- reference: :mod:`attr_engine_kernels.region`'s PyTorch path (segment sums; blend recomputes in its backward).
- triton: the fused kernels (CUDA only).

Shapes are those of one AHA step at 224 px with a 14 x 14 grid (ViT-B/16 patches). Run from the repository root:
``python -m pytest benches/bench_region.py -q --benchmark-min-rounds=3``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from attr_engine_kernels._backend import set_backend
from attr_engine_kernels.region import region_pool, soft_mask_blend, soft_mask_blend_reference
from benches._common import DEVICE, peak_memory_mb, providers

POOL_SHAPE: dict[str, object] = {"op": "region_pool", "batch": 32, "size": 224, "grid": 14}
BLEND_SHAPE: dict[str, object] = {
    "op": "soft_mask_blend",
    "batch": 8,
    "n_masks": 16,
    "channels": 3,
    "size": 224,
    "grid": 14,
}
BLEND_SMOOTH_SHAPE: dict[str, object] = {**BLEND_SHAPE, "sigma": 1.0}


def _eager_pool(amap: torch.Tensor, grid: int) -> torch.Tensor:
    return F.adaptive_avg_pool2d(amap[:, None], grid)[:, 0]


def make_case(
    provider: str,
    device: str = DEVICE,
    op: str = "region_pool",
    batch: int = 32,
    size: int = 224,
    grid: int = 14,
    n_masks: int = 16,
    channels: int = 3,
    sigma: float = 0.0,
) -> Callable[[], object]:
    """Inputs for one case and a zero-argument callable running one forward + backward of ``op`` with ``provider``."""
    if op == "region_pool":
        inputs = [torch.randn(batch, size, size, device=device, requires_grad=True)]
        grad = torch.randn(batch, grid, grid, device=device)
        fn: Callable[..., torch.Tensor] = (
            (lambda a: _eager_pool(a, grid)) if provider == "eager" else (lambda a: region_pool(a, grid))
        )
    elif op == "soft_mask_blend":
        inputs = [
            torch.randn(batch, channels, size, size, device=device, requires_grad=True),
            torch.zeros(1, channels, size, size, device=device).expand(batch, -1, -1, -1).requires_grad_(),
            torch.rand(batch, n_masks, grid, grid, device=device, requires_grad=True),
        ]
        grad = torch.randn(batch, n_masks, channels, size, size, device=device)
        if provider == "eager":
            fn = lambda x, r, m: soft_mask_blend_reference(x, r, m, smooth_sigma=sigma)
        else:
            fn = lambda x, r, m: soft_mask_blend(x, r, m, smooth_sigma=sigma)
    else:
        raise ValueError(f"unknown op {op!r}")
    backend = "triton" if provider == "triton" else "reference"

    def run() -> object:
        with set_backend(backend):
            grads = torch.autograd.grad(fn(*inputs), inputs, grad)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return grads

    return run


def _bench(benchmark: pytest.FixtureRequest, provider: str, device: str, shape: dict[str, object]) -> None:
    benchmark.group = str(shape["op"]) + (" smooth" if shape.get("sigma") else "")
    benchmark.extra_info.update(shape)
    benchmark.extra_info["peak_mem_mb"] = round(peak_memory_mb(__name__, provider, device, **shape), 1)
    fn = make_case(provider, device=device, **shape)
    fn()  # warm-up: Triton compilation and allocator growth stay out of the timing
    benchmark(fn)


@pytest.mark.parametrize("provider", providers())
def test_region_pool(benchmark: pytest.FixtureRequest, provider: str, device: str) -> None:
    _bench(benchmark, provider, device, POOL_SHAPE)


@pytest.mark.parametrize("provider", providers())
def test_soft_mask_blend(benchmark: pytest.FixtureRequest, provider: str, device: str) -> None:
    _bench(benchmark, provider, device, BLEND_SHAPE)


@pytest.mark.parametrize("provider", providers())
def test_soft_mask_blend_smooth(benchmark: pytest.FixtureRequest, provider: str, device: str) -> None:
    _bench(benchmark, provider, device, BLEND_SMOOTH_SHAPE)
