"""soft_gate and soft_maxpool2d, forward + backward: eager detach formulation vs our reference vs Triton (CUDA).

- eager: the detach formulations with plain autograd (``soft_gate_reference``; ``soft_maxpool2d_reference``, autograd
  through ``F.unfold``), i.e. what one writes without a custom backward.
- reference: our pure-PyTorch autograd functions (exact forward from torch, hand-written backward, saving only the
  input).
- triton: the fused kernels (CUDA only).

Shapes are ResNet-50-like at batch 32: a 56 x 56 stage activation, and the stem max-pool 3 / 2 / 1 on 112 x 112
(batch 4 on the CPU, where the eager unfold baseline would otherwise need gigabytes and seconds per call).

Run from the repo root: ``python -m pytest benches/bench_soft_gates.py -q --benchmark-min-rounds=3``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from attr_engine_kernels import set_backend
from attr_engine_kernels.soft_gates import soft_gate, soft_gate_reference, soft_maxpool2d, soft_maxpool2d_reference
from benches._common import DEVICE, peak_memory_mb, providers

MODULE = "benches.bench_soft_gates"
ON_CUDA = DEVICE == "cuda"
GATE_SHAPE = {"B": 32, "C": 64, "H": 56, "W": 56}
POOL_SHAPE = {"B": 32 if ON_CUDA else 4, "C": 64, "H": 112, "W": 112}
POOL_ARGS = (3, 2, 1)  # kernel, stride, padding: the ResNet stem


def make_case(
    provider: str, device: str = "cpu", op: str = "soft_gate", B: int = 8, C: int = 64, H: int = 56, W: int = 56
) -> Callable[[], torch.Tensor]:
    """A zero-argument callable running one forward + backward of ``op`` ("soft_gate" or "soft_maxpool2d")."""
    if provider not in ("eager", "reference", "triton"):
        raise ValueError(f"unknown provider {provider!r}")
    x = torch.randn(B, C, H, W, device=device, requires_grad=True)
    if op == "soft_gate":
        fn = soft_gate_reference if provider == "eager" else soft_gate
        forward = lambda: fn(x, "relu")
        out_shape = x.shape
    elif op == "soft_maxpool2d":
        pool = soft_maxpool2d_reference if provider == "eager" else soft_maxpool2d
        forward = lambda: pool(x, *POOL_ARGS)
        # The output shape from a meta tensor: running the op here would raise the peak before it is measured.
        out_shape = F.max_pool2d(torch.empty(B, C, H, W, device="meta"), *POOL_ARGS).shape
    else:
        raise ValueError(f"unknown op {op!r}")
    grad = torch.randn(out_shape, device=device)
    backend = "triton" if provider == "triton" else "reference"

    def run() -> torch.Tensor:
        with set_backend(backend):
            (dx,) = torch.autograd.grad(forward(), x, grad)
        if x.is_cuda:
            torch.cuda.synchronize()
        return dx

    return run


def _bench(benchmark, provider: str, device: str, op: str, shape: dict[str, int]) -> None:
    fn = make_case(provider, device=device, op=op, **shape)
    fn()  # warm-up: Triton compilation and allocator caches stay out of the timings
    benchmark.extra_info["shape"] = [shape["B"], shape["C"], shape["H"], shape["W"]]
    benchmark.extra_info["peak_mem_mb"] = round(peak_memory_mb(MODULE, provider, device, op=op, **shape), 1)
    benchmark(fn)


@pytest.mark.parametrize("provider", providers())
def test_soft_gate_fwd_bwd(benchmark, provider: str, device: str) -> None:
    _bench(benchmark, provider, device, "soft_gate", GATE_SHAPE)


@pytest.mark.parametrize("provider", providers())
def test_soft_maxpool2d_fwd_bwd(benchmark, provider: str, device: str) -> None:
    _bench(benchmark, provider, device, "soft_maxpool2d", POOL_SHAPE)
