"""One GPU script that measures the engine: every fused op checked and timed, then end-to-end throughput.

    python benches/gpu_check.py            # on a CUDA machine, realistic sizes, < 8 minutes
    python benches/gpu_check.py --smoke    # anywhere: tiny sizes and models, Triton interpreter on CPU, code paths

Part 1, kernels: for each op (forward + backward at the size an AHA or pullback step uses) the largest forward and
gradient deviation of the fused path from the reference, the median time of eager / reference / Triton
(``triton.testing.do_bench``), Triton's speed-up over eager, the effective bandwidth of the Triton path (bytes of
inputs, outputs and gradients it must move, divided by its time) and peak memory of each provider.

Part 2, engine: images/s of an AHA training step and of AHA attribute (T=0, T=3) on ``vit_base_patch16_224`` and
``convnext_small`` (random init, 224 px, bf16 autocast, batch 32), Semantic Pullback (soft pullback, ascent K=5)
on ``resnet50`` and ``vit_base_patch16_224``, and deletion/insertion (21 points). For each: the engine's share of
the time, i.e. everything but the classifier's own passes (the classifier calls a workload makes are recorded with
a forward hook, then replayed alone with the same batch sizes and grad modes, and timed), and the peak memory. A
workload that runs out of memory is reported as such, not fatal.

Writes the results as JSON (``--out``, default ``benches/results/gpu.json``; ``gpu-smoke.json`` with ``--smoke``)
and prints Markdown tables last; the exit status is non-zero if an op disagrees with its reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attr_engine_kernels as kernels
from attr_engine_kernels.region import soft_mask_blend_reference
from attr_engine_kernels.sinkhorn import sinkhorn_reference
from attr_engine_kernels.soft_gates import soft_gate_reference, soft_maxpool2d_reference
from attr_engine_kernels.soft_rank import _sample_seeds, soft_topk_masks_reference, triton_gumbel_noise
from benches.bench_region import _eager_pool


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
                  lambda x: kernels.sinkhorn(x, t, 0.5), lambda x: sinkhorn_reference(x, t, 0.5)))  # fmt: skip

    b, n, t, s = (2, 25, 4, 4) if smoke else (32, 784, 30, 16)
    fractions = torch.linspace(0, 1, s, device=device)
    seed = int(_sample_seeds(b, 0, torch.device("cpu"))[0])
    # The eager definition gets the exact Philox noise the fused sorter regenerates in-kernel.
    noise = triton_gumbel_noise(seed, b, n, device)
    ops.append(Op("soft_topk_masks", f"B{b} N{n} T{t} S{s}", [rand(b, n)],
                  lambda x: kernels.soft_topk_masks(x, fractions, tau=0.5, n_iters=t, generator=0),
                  lambda x: soft_topk_masks_reference(x, fractions, tau=0.5, n_iters=t, gumbel=noise),
                  check_against_eager=True))  # fmt: skip

    b, h, g = (2, 13, 4) if smoke else (32, 224, 14)
    ops.append(Op("region_pool", f"B{b} {h}x{h} g{g}", [rand(b, h, h)],
                  lambda a: kernels.region_pool(a, g), lambda a: _eager_pool(a, g)))  # fmt: skip

    b, s, h, g = (2, 3, 13, 4) if smoke else (16, 16, 224, 14)
    blend_inputs = [rand(b, 3, h, h), rand(b, 3, h, h), rand(b, s, g, g)]
    ops.append(Op("soft_mask_blend", f"B{b} S{s} 3x{h}x{h} g{g}", blend_inputs, kernels.soft_mask_blend,
                  soft_mask_blend_reference))  # fmt: skip
    ops.append(Op("soft_mask_blend", f"B{b} S{s} 3x{h}x{h} g{g} smooth 1.0", blend_inputs,
                  lambda x, r, m: kernels.soft_mask_blend(x, r, m, smooth_sigma=1.0),
                  lambda x, r, m: soft_mask_blend_reference(x, r, m, smooth_sigma=1.0)))  # fmt: skip

    shape = (2, 3, 5, 7) if smoke else (32, 64, 56, 56)
    ops.append(Op("soft_gate", "x".join(map(str, shape)), [rand(*shape, normal=True)],
                  lambda z: kernels.soft_gate(z, "gelu", 1.0),
                  lambda z: soft_gate_reference(z, "gelu", 1.0)))  # fmt: skip

    shape = (2, 3, 9, 11) if smoke else (32, 64, 112, 112)
    ops.append(Op("soft_maxpool2d", "x".join(map(str, shape)) + " k3s2p1", [rand(*shape, normal=True)],
                  lambda x: kernels.soft_maxpool2d(x, 3, 2, 1, tau=0.3),
                  lambda x: soft_maxpool2d_reference(x, 3, 2, 1, tau=0.3)))  # fmt: skip
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


# --------------------------------------------------------------------------------------------------------------
# Part 2: end-to-end engine throughput
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Workload:
    name: str
    model: str
    images: int  # images explained (or trained on) per call
    run: Callable[[], object]


class _ClassifierCalls:
    """Records (batch size, grad enabled) of every Classifier.forward during a block, to replay them alone."""

    def __init__(self, classifier: torch.nn.Module) -> None:
        self.calls: list[tuple[int, bool]] = []
        self._classifier = classifier

    def __enter__(self) -> _ClassifierCalls:
        def hook(_module: torch.nn.Module, args: tuple, _out: object) -> None:
            self.calls.append((int(args[0].shape[0]), torch.is_grad_enabled()))

        # On the wrapped network, not the Classifier: engine loops call Classifier.forward_trusted, which skips the
        # module hooks of the wrapper but always runs the network's own forward. (AHA's backbone feature pass calls
        # forward_intermediates, so it counts as engine time: it is the explainer's cost.)
        self._handle = self._classifier._model.register_forward_hook(hook)
        return self

    def __exit__(self, *_: object) -> None:
        self._handle.remove()


def _replay(classifier: torch.nn.Module, calls: list[tuple[int, bool]], size: int, device: str, amp: bool) -> None:
    """The classifier's own passes of a workload: the same batches, with an input gradient where it had one."""
    for n, grad in calls:
        x = torch.rand(n, 3, size, size, device=device, requires_grad=grad)
        with torch.set_grad_enabled(grad), torch.autocast("cuda", torch.bfloat16, enabled=amp and device == "cuda"):
            out = classifier(x)
        if grad:
            out.float().sum().backward()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _wall_ms(run: Callable[[], object], device: str, repeats: int) -> float:
    """Median wall time of ``repeats`` calls after one warm-up (first calls compile kernels and patch modules)."""
    run()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def _engine_models(smoke: bool) -> dict[str, str]:
    if smoke:
        return {"vit": "test_vit", "convnext": "test_convnext", "resnet": "test_resnet"}
    return {"vit": "vit_base_patch16_224", "convnext": "convnext_small", "resnet": "resnet50"}


def _workloads(smoke: bool, device: str) -> list[tuple[Any, int, bool, list[Workload]]]:
    """(classifier, image size, bf16 autocast, workloads) per model."""
    from torch.utils.data import TensorDataset

    from attr_engine import AHA, AHAConfig, load_classifier
    from attr_engine.metrics import deletion_insertion
    from attr_engine.pullback import SemanticPullback

    size, batch = (32, 2) if smoke else (224, 32)
    fractions = 4 if smoke else 16
    names = _engine_models(smoke)
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(batch, 3, size, size, generator=gen).to(device)
    out = []
    for key in ("vit", "convnext", "resnet"):
        clf = load_classifier(names[key], pretrained=False, img_size=size).to(device)
        loads: list[Workload] = []
        if key in ("vit", "convnext"):
            cfg = AHAConfig(n_fractions=fractions, targets="pred", amp=True)
            aha = AHA(clf, cfg)
            data = TensorDataset(x.cpu(), torch.zeros(batch, dtype=torch.long))
            loads += [
                Workload("AHA training step", names[key], batch,
                         lambda aha=aha, data=data: aha.fit(data, batch_size=batch, max_steps=1, progress=False)),
                Workload("AHA attribute T=0", names[key], batch, lambda aha=aha: aha.attribute(x)),
                Workload("AHA attribute T=3", names[key], batch,
                         lambda aha=aha: aha.attribute(x, refine_steps=3, generator=0)),
            ]  # fmt: skip
        if key in ("vit", "resnet"):
            sp = SemanticPullback(clf)
            loads += [
                Workload("Soft pullback (SfP)", names[key], batch, lambda sp=sp: sp.attribute(x, method="soft")),
                Workload("Pullback ascent K=5", names[key], batch,
                         lambda sp=sp: sp.attribute(x, method="ascent", steps=5)),
            ]  # fmt: skip
        if key == "vit":
            maps = torch.rand(batch, size, size, generator=gen).to(device)
            loads.append(Workload("deletion + insertion (21 points)", names[key], batch,
                                  lambda clf=clf, maps=maps: deletion_insertion(clf, x, maps, steps=20)))  # fmt: skip
        out.append((clf, size, key != "resnet", loads))
    return out


def _engine_rows(smoke: bool, device: str) -> list[dict[str, Any]]:
    repeats = 1 if smoke else 3
    rows = []
    for clf, size, amp, loads in _workloads(smoke, device):
        for w in loads:
            row: dict[str, Any] = {"workload": w.name, "model": w.model, "batch": w.images, "img_size": size}
            try:
                if device == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                total = _wall_ms(w.run, device, repeats)
                peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else float("nan")
                with _ClassifierCalls(clf) as rec:
                    w.run()
                replay = lambda clf=clf, rec=rec, size=size, amp=amp: _replay(clf, rec.calls, size, device, amp)
                own = _wall_ms(replay, device, repeats)
                row.update(
                    ms=total, images_per_s=w.images / (total * 1e-3), classifier_ms=own,
                    classifier_images=sum(n for n, _ in rec.calls), engine_share=max(0.0, 1.0 - own / total),
                    peak_mb=peak,
                )  # fmt: skip
            except torch.OutOfMemoryError:
                row["error"] = "out of memory"
            print(_engine_line(row), flush=True)
            rows.append(row)
    return rows


def _engine_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"| {r['workload']} | {r['model']} | {r['batch']} | {r['error']} | | | | |"
    return (
        f"| {r['workload']} | {r['model']} | {r['batch']} | {r['ms']:.1f} | {r['images_per_s']:.1f} "
        f"| {r['classifier_images']} | {100 * r['engine_share']:.1f}% | {r['peak_mb']:.0f} |"
    )


_ENGINE_HEAD = (
    "| workload | model | batch | ms/call | images/s | classifier images/call | engine share | peak MiB |\n"
    "|---|---|---|---|---|---|---|---|"
)


def main() -> int:
    parser = argparse.ArgumentParser(description="Check and time every fused kernel on a CUDA device.")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes through the CPU interpreter")
    parser.add_argument("--skip-engine", action="store_true", help="kernels only")
    parser.add_argument("--out", metavar="FILE", help="JSON results (default benches/results/gpu[-smoke].json)")
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

    engine = [] if args.skip_engine else _engine_rows(args.smoke, device)
    elapsed = time.time() - started
    print(f"\nattr-engine gpu_check on {name}, torch {torch.__version__}, {elapsed:.0f} s")
    head = (f"{'op':<16} {'size':<24} {'fwd err':>8} {'grad err':>8} {'eager ms':>9} {'ref ms':>8} {'triton ms':>9} "
            f"{'x eager':>8} {'GB/s':>7} {'mem MB e/r/t':>18}  ok")  # fmt: skip
    print(head)
    print("-" * len(head))
    for name_, size, fe, ge, ms, mem, gbs, ok in rows:
        mems = "/".join(f"{mem[k]:.0f}" for k in ("eager", "reference", "triton"))
        print(f"{name_:<16} {size:<24} {fe:>8.1e} {ge:>8.1e} {ms['eager']:>9.2f} {ms['reference']:>8.2f} "
              f"{ms['triton']:>9.2f} {ms['eager'] / ms['triton']:>8.1f} {gbs:>7.1f} {mems:>18}  "
              f"{'yes' if ok else 'NO'}")  # fmt: skip
    if engine:
        print(f"\n{_ENGINE_HEAD}")
        print("\n".join(_engine_line(r) for r in engine))
    out = Path(args.out or f"benches/results/gpu{'-smoke' if args.smoke else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "device": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "seconds": round(elapsed, 1),
        "kernels": [
            {"op": r[0], "size": r[1], "fwd_err": r[2], "grad_err": r[3], "ms": r[4], "peak_mb": r[5], "gbps": r[6],
             "ok": r[7]} for r in rows
        ],
        "engine": engine,
    }  # fmt: skip
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=float))
    tmp.replace(out)
    print(f"results written to {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
