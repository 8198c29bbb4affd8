"""One-shot GPU check: every fused op against its reference, then timed against eager and the reference.

    python benches/gpu_check.py            # on a CUDA machine, realistic sizes, < 8 minutes
    python benches/gpu_check.py --smoke    # anywhere: tiny sizes, Triton interpreter on CPU, code-path check only

For each op (forward + backward at the size an AHA or pullback step uses) it prints: the largest forward and
gradient deviation of the fused path from the reference, the median time of eager / reference / Triton
(``triton.testing.do_bench``), Triton's speed-up over eager, the effective bandwidth of the Triton path (bytes of
inputs, outputs and gradients it must move, divided by its time) and peak memory of each provider. The table is
printed last; the exit status is non-zero if an op disagrees with its reference.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels
from benches.bench_region import _eager_blend, _eager_pool
from kernels.sinkhorn import sinkhorn_eager
from kernels.soft_adjoint import soft_gate_detach, soft_maxpool2d_detach
from kernels.soft_rank import _sample_seeds, soft_topk_masks_dense, triton_gumbel_noise


@dataclass
class Op:
    name: str
    size: str
    inputs: list[torch.Tensor]
    fused: Callable[..., torch.Tensor]  # runs under the chosen backend
    eager: Callable[..., torch.Tensor]
    # The fused path is checked against the reference backend, except where the backends draw different random
    # numbers by design (the sorter's Gumbel noise): there the eager definition fed the kernel's own noise is the truth.
    check_against_eager: bool = False


def _ops(device: str, smoke: bool) -> list[Op]:
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, normal: bool = False) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen) if normal else torch.rand(*shape, generator=gen)
        return t.to(device)

    ops = []
    b, n, t = (2, 16, 5) if smoke else (32, 196, 20)
    ops.append(Op("sinkhorn", f"B{b} N{n} T{t}", [rand(b, n, n)],
                  lambda x: kernels.sinkhorn(x, t, 0.5), lambda x: sinkhorn_eager(x, t, 0.5)))  # fmt: skip

    b, n, t, s = (2, 25, 4, 4) if smoke else (32, 784, 30, 16)
    fractions = torch.linspace(0, 1, s, device=device)
    seed = int(_sample_seeds(b, 0, torch.device("cpu"))[0])
    # The eager definition gets the exact Philox noise the fused sorter regenerates in-kernel.
    noise = triton_gumbel_noise(seed, b, n, device)
    ops.append(Op("soft_topk_masks", f"B{b} N{n} T{t} S{s}", [rand(b, n)],
                  lambda x: kernels.soft_topk_masks(x, fractions, tau=0.5, n_iters=t, generator=0),
                  lambda x: soft_topk_masks_dense(x, fractions, tau=0.5, n_iters=t, gumbel=noise),
                  check_against_eager=True))  # fmt: skip

    b, h, g = (2, 13, 4) if smoke else (32, 224, 14)
    ops.append(Op("region_pool", f"B{b} {h}x{h} g{g}", [rand(b, h, h)],
                  lambda a: kernels.region_pool(a, g), lambda a: _eager_pool(a, g)))  # fmt: skip

    b, s, h, g = (2, 3, 13, 4) if smoke else (16, 16, 224, 14)
    blend_inputs = [rand(b, 3, h, h), rand(b, 3, h, h), rand(b, s, g, g)]
    ops.append(Op("soft_mask_blend", f"B{b} S{s} 3x{h}x{h} g{g}", blend_inputs, kernels.soft_mask_blend, _eager_blend))

    shape = (2, 3, 5, 7) if smoke else (32, 64, 56, 56)
    ops.append(Op("soft_gate", "x".join(map(str, shape)), [rand(*shape, normal=True)],
                  lambda z: kernels.soft_gate(z, "gelu", 1.0), lambda z: soft_gate_detach(z, "gelu", 1.0)))  # fmt: skip

    shape = (2, 3, 9, 11) if smoke else (32, 64, 112, 112)
    ops.append(Op("soft_maxpool2d", "x".join(map(str, shape)) + " k3s2p1", [rand(*shape, normal=True)],
                  lambda x: kernels.soft_maxpool2d(x, 3, 2, 1, tau=0.3),
                  lambda x: soft_maxpool2d_detach(x, 3, 2, 1, tau=0.3)))  # fmt: skip
    return ops


def _fwd_bwd(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad: torch.Tensor | None, backend: str):
    leaves = [x.detach().requires_grad_() for x in inputs]
    with kernels.set_backend(backend):
        out = fn(*leaves)
        g = torch.randn_like(out) if grad is None else grad
        grads = torch.autograd.grad(out, leaves, g)
    return out.detach(), grads, g


def _time_ms(run: Callable[[], object], device: str) -> float:
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(run, warmup=5, rep=40, return_mode="median"))
    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) * 1e3


def _peak_mb(run: Callable[[], object], device: str) -> float:
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description="Check and time every fused kernel on a CUDA device.")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes through the CPU interpreter")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check needs a CUDA device (use --smoke to exercise the code paths on the CPU)")
        return 2
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    started = time.time()
    rows, failures = [], 0
    for op in _ops(device, args.smoke):
        truth = op.eager if op.check_against_eager else op.fused
        ref_out, ref_grads, g = _fwd_bwd(truth, op.inputs, None, "reference")
        tri_out, tri_grads, _ = _fwd_bwd(op.fused, op.inputs, g, "triton")
        fwd_err = (ref_out.double() - tri_out.double()).abs().max().item()
        grad_err = max((a.double() - b.double()).abs().max().item() for a, b in zip(ref_grads, tri_grads, strict=True))
        scale = max(1.0, ref_out.abs().max().item(), *(a.abs().max().item() for a in ref_grads))
        ok = fwd_err <= 2e-4 * scale and grad_err <= 2e-4 * scale
        failures += not ok

        runs = {
            "eager": lambda op=op, g=g: _fwd_bwd(op.eager, op.inputs, g, "reference"),
            "reference": lambda op=op, g=g: _fwd_bwd(op.fused, op.inputs, g, "reference"),
            "triton": lambda op=op, g=g: _fwd_bwd(op.fused, op.inputs, g, "triton"),
        }
        ms = {k: _time_ms(r, device) for k, r in runs.items()}
        mem = {k: _peak_mb(r, device) for k, r in runs.items()}
        moved = sum(x.numel() * x.element_size() for x in op.inputs) * 2  # inputs read, their gradients written
        moved += ref_out.numel() * ref_out.element_size() * 2  # output written, its gradient read
        rows.append((op.name, op.size, fwd_err, grad_err, ms, mem, moved / (ms["triton"] * 1e-3) / 1e9, ok))

    print(f"\nattr-engine gpu_check on {name}, torch {torch.__version__}, {time.time() - started:.0f} s")
    head = (f"{'op':<16} {'size':<24} {'fwd err':>8} {'grad err':>8} {'eager ms':>9} {'ref ms':>8} {'triton ms':>9} "
            f"{'x eager':>8} {'GB/s':>7} {'mem MB e/r/t':>18}  ok")  # fmt: skip
    print(head)
    print("-" * len(head))
    for name_, size, fe, ge, ms, mem, gbs, ok in rows:
        mems = "/".join(f"{mem[k]:.0f}" for k in ("eager", "reference", "triton"))
        print(f"{name_:<16} {size:<24} {fe:>8.1e} {ge:>8.1e} {ms['eager']:>9.2f} {ms['reference']:>8.2f} "
              f"{ms['triton']:>9.2f} {ms['eager'] / ms['triton']:>8.1f} {gbs:>7.1f} {mems:>18}  "
              f"{'yes' if ok else 'NO'}")  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
