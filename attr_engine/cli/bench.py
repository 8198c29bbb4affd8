"""``bench``: the kernel self-check (agreement and timings of every fused op) and engine-step timings, one table each.

Engine steps run on a small untrained timm model at a small size (timings do not depend on the weights): the
classifier passes, one AHA training step, AHA inference with and without refinement, the two Semantic Pullback
attributions and the deletion / insertion metric. Each step is warmed up once, then timed ``--repeats`` times; the
median is reported. Per-op pytest-benchmark modules with memory numbers live in ``benches/``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from attr_engine.cli._common import (
    SMALL_MODELS,
    UsageError,
    add_device_arg,
    machine_summary,
    resolve_device,
    work_started,
)
from attr_engine.guards import check_small_model_side


def register(subparsers: Any) -> dict[str, argparse.ArgumentParser]:
    p = subparsers.add_parser(
        "bench",
        help="kernel self-check and engine micro-benchmarks, with a summary table",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--quick", action="store_true", help="small kernel shapes and one timed repeat")
    p.add_argument("--skip-kernels", action="store_true", help="no kernel self-check")
    p.add_argument("--skip-engine", action="store_true", help="no engine-step timings")
    p.add_argument(
        "--model",
        choices=tuple(SMALL_MODELS),
        default="small-resnet",
        help="model of the engine steps (default small-resnet)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="images per call (default 8)")
    p.add_argument("--img-size", type=int, default=64, help="image side (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per engine step, median reported (default 3)")
    p.add_argument("--out", metavar="FILE", help="also write the engine timings as JSON")
    add_device_arg(p)
    p.set_defaults(run=run_bench)
    return {"bench": p}


if TYPE_CHECKING:
    import torch


def _median_ms(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()  # warm-up: first-call allocations, soft-adjoint patching, cuDNN / Triton autotuning
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def engine_timings(model: str, *, batch: int, img_size: int, repeats: int, device: torch.device) -> list[dict]:
    """Median milliseconds per call (and per image) of each engine step on ``batch`` images."""
    import torch

    from attr_engine.aha import AHA, AHAConfig
    from attr_engine.classifier_training import small_model_config
    from attr_engine.data import ShapesDataset
    from attr_engine.metrics import deletion_insertion
    from attr_engine.pullback import SemanticPullback

    torch.manual_seed(0)
    classifier = small_model_config(SMALL_MODELS[model], img_size).build(6).to(device)
    data = ShapesDataset(batch, img_size=img_size, seed=0, with_masks=False)
    x = torch.stack([data[i][0] for i in range(batch)]).to(device)
    aha = AHA(classifier, AHAConfig(n_fractions=8, targets="pred"))
    pullback = SemanticPullback(classifier)
    maps = aha.attribute(x)

    def input_gradient() -> None:
        xg = x.detach().requires_grad_()
        classifier(xg).max(dim=1).values.sum().backward()

    def no_grad_forward() -> None:
        with torch.no_grad():
            classifier(x)

    steps: list[tuple[str, Callable[[], Any]]] = [
        ("classifier forward", no_grad_forward),
        ("classifier forward + input gradient", input_gradient),
        ("AHA training step (8 fractions)", lambda: aha.fit(data, batch_size=batch, max_steps=1, progress=False)),
        ("AHA attribute (T=0)", lambda: aha.attribute(x)),
        ("AHA attribute (T=3)", lambda: aha.attribute(x, refine_steps=3, generator=0)),
        ("Soft pullback", lambda: pullback.attribute(x, method="soft")),
        ("Pullback ascent (K=5)", lambda: pullback.attribute(x, method="ascent")),
        ("deletion + insertion (21 points)", lambda: deletion_insertion(classifier, x, maps, steps=20)),
    ]
    rows = []
    for name, fn in steps:
        ms = _median_ms(fn, repeats, device)
        rows.append({"step": name, "batch": batch, "ms/call": ms, "ms/image": ms / batch})
    return rows


def run_bench(args: argparse.Namespace) -> int:
    for flag in ("batch_size", "repeats"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    check_small_model_side(args.img_size, SMALL_MODELS[args.model], "--img-size")  # before torch is imported
    import torch

    from attr_engine.checkpoint import save_json

    device = resolve_device(args.device)
    work_started()
    status = 0
    if not args.skip_kernels:
        command = [sys.executable, "-m", "attr_engine_kernels.selfcheck", *(["--quick"] if args.quick else [])]
        print("== kernels: python -m attr_engine_kernels.selfcheck" + (" --quick" if args.quick else ""), flush=True)
        # The self-check runs in its own process (it re-executes itself under the Triton interpreter on a CPU);
        # it gets this process's thread count, so --threads applies to it too.
        env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
        status = subprocess.run(command, check=False, env=env).returncode
    if not args.skip_engine:
        repeats = 1 if args.quick else args.repeats
        print(f"\n== engine steps: {args.model}, {args.batch_size} images of {args.img_size} px on {device}, "
              f"median of {repeats}", flush=True)  # fmt: skip
        rows = engine_timings(args.model, batch=args.batch_size, img_size=args.img_size, repeats=repeats, device=device)
        width = max(len(r["step"]) for r in rows)
        print(f"{'step':<{width}}  {'ms/call':>10}  {'ms/image':>10}")
        print(f"{'-' * width}  {'-' * 10}  {'-' * 10}")
        for r in rows:
            print(f"{r['step']:<{width}}  {r['ms/call']:>10.1f}  {r['ms/image']:>10.2f}")
        if args.out:
            save_json({"machine": machine_summary(device), "model": args.model, "img_size": args.img_size,
                       "engine": rows}, args.out)  # fmt: skip
            print(f"timings written to {args.out}")
    if status:
        print("attr-engine bench: the kernel self-check reported a mismatch", file=sys.stderr)
    return 1 if status else 0
