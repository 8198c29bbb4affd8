"""Kernel self-check: every op, reference vs Triton, forward and gradient agreement and timing, as one table.

    python -m attr_engine_kernels.selfcheck [--quick]

On a CUDA machine the compiled kernels are checked and timed against the references at realistic sizes. Without
CUDA the Triton kernels run through Triton's CPU interpreter (the process re-executes itself with
``TRITON_INTERPRET=1``, which must be set before triton is imported) at small sizes: agreement is real, the Triton
timings are the interpreter's and only say that it ran.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # a run-time import would load triton before main() has set TRITON_INTERPRET
    from attr_engine_kernels._backend import Backend


@dataclass
class Case:
    name: str
    make: Callable[[str], tuple[list[torch.Tensor], Callable[..., torch.Tensor]]]


def _cases(quick: bool, cuda: bool) -> list[Case]:
    import attr_engine_kernels as kernels

    big = cuda and not quick
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen)

    def sinkhorn(device: str):
        b, n = (32, 196) if big else (2, 33)
        return [rand(b, n, n).to(device)], lambda x: kernels.sinkhorn(x, n_iters=20, tau=0.5)

    def soft_topk(device: str):
        b, n = (32, 784) if big else (2, 49)
        return [rand(b, n).to(device)], lambda s: kernels.soft_topk_masks(
            s, torch.linspace(0, 1, 16, device=s.device), tau=0.5, n_iters=30 if big else 8, generator=0, noise=0.0
        )

    def region_pool(device: str):
        b, h = (32, 224) if big else (2, 29)
        return [rand(b, h, h).to(device)], lambda a: kernels.region_pool(a, 14 if big else 5, (0.3, 0.6))

    def blend(device: str):
        b, s, h, g = (8, 16, 224, 14) if big else (2, 3, 13, 4)
        x, r, m = rand(b, 3, h, h).to(device), rand(b, 3, h, h).to(device), rand(b, s, g, g).to(device)
        return [x, r, m], lambda x, r, m: kernels.soft_mask_blend(x, r, m, (0.25, 0.5))

    def blend_smooth(device: str):
        inputs, _ = blend(device)
        return inputs, lambda x, r, m: kernels.soft_mask_blend(x, r, m, (0.25, 0.5), smooth_sigma=1.0)

    def gate(device: str):
        shape = (32, 64, 56, 56) if big else (3, 5, 7, 9)
        return [torch.randn(*shape, generator=gen).to(device)], lambda z: kernels.soft_gate(z, "gelu", 1.0)

    def maxpool(device: str):
        shape = (32, 64, 112, 112) if big else (2, 3, 11, 13)
        return [torch.randn(*shape, generator=gen).to(device)], lambda x: kernels.soft_maxpool2d(x, 3, 2, 1, tau=0.3)

    return [
        Case("sinkhorn", sinkhorn),
        Case("soft_topk_masks", soft_topk),
        Case("region_pool", region_pool),
        Case("soft_mask_blend", blend),
        Case("soft_mask_blend smooth", blend_smooth),
        Case("soft_gate", gate),
        Case("soft_maxpool2d", maxpool),
    ]


def _run(inputs: list[torch.Tensor], fn: Callable[..., torch.Tensor], backend: Backend, grad_out: torch.Tensor | None):
    import attr_engine_kernels as kernels

    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    with kernels.set_backend(backend):
        out = fn(*leaves)
        g = grad_out if grad_out is not None else torch.randn_like(out)
        out.backward(g)
    if out.is_cuda:
        torch.cuda.synchronize()
    return out.detach(), [t.grad for t in leaves], g


def _time(inputs, fn, backend, grad_out, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        _run(inputs, fn, backend, grad_out)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes even on CUDA")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        env = dict(os.environ, TRITON_INTERPRET="1")
        os.execve(sys.executable, [sys.executable, "-m", "attr_engine_kernels.selfcheck", *(argv or sys.argv[1:])], env)
    device = "cuda" if cuda else "cpu"
    mode = f"CUDA ({torch.cuda.get_device_name()})" if cuda else "CPU, Triton interpreter"
    print(f"attr-engine kernel self-check on {mode}")
    header = f"{'op':<22} {'max |fwd diff|':>15} {'max |grad diff|':>16} {'reference ms':>13} {'triton ms':>10}  status"
    print(header)
    print("-" * len(header))
    failures = 0
    for case in _cases(args.quick, cuda):
        inputs, fn = case.make(device)
        ref_out, ref_grads, g = _run(inputs, fn, "reference", None)
        tri_out, tri_grads, _ = _run(inputs, fn, "triton", g)
        fwd = (ref_out.double() - tri_out.double()).abs().max().item()
        scale = max(1.0, max(r.abs().max().item() for r in ref_grads if r is not None))
        grad = max((r.double() - t.double()).abs().max().item() for r, t in zip(ref_grads, tri_grads, strict=True))
        ok = fwd <= 1e-4 * max(1.0, ref_out.abs().max().item()) and grad <= 1e-4 * scale
        failures += not ok
        ref_ms = _time(inputs, fn, "reference", g, 3)
        tri_ms = _time(inputs, fn, "triton", g, 3 if cuda else 1)
        status = "ok" if ok else "MISMATCH"
        print(f"{case.name:<22} {fwd:>15.2e} {grad:>16.2e} {ref_ms:>13.2f} {tri_ms:>10.2f}  {status}")
    print("all ops agree" if not failures else f"{failures} op(s) disagree")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
