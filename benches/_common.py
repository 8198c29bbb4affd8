"""Shared benchmark plumbing: the device, the provider list, and peak-memory measurement on CPU and CUDA.

A benchmark module exposes ``make_case(provider: str, **shape) -> Callable[[], object]`` which builds its inputs and
returns a zero-argument callable running one forward+backward. :func:`peak_memory_mb` measures what that callable
adds at its peak:

- CUDA: ``torch.cuda.max_memory_allocated`` around the call, in-process.
- CPU: torch has no resettable CPU allocator statistic, so the case runs in a fresh Python process whose peak
  resident set (``VmHWM``) is reset just before the call (``/proc/self/clear_refs``) and read after it. The inputs
  are built before the reset, so the number is the op's working memory, not its inputs. (``ru_maxrss`` would not
  do: a child inherits the launching process's resident size in it.)
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Callable

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def providers() -> list[str]:
    """Providers every op benchmark compares: the naive eager formulation, our reference, and Triton on CUDA."""
    return ["eager", "reference"] + (["triton"] if DEVICE == "cuda" else [])


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # reported in kB
    raise RuntimeError(f"{field} missing from /proc/self/status")


def peak_memory_mb(module: str, provider: str, device: str = "cpu", **shape: object) -> float:
    """Peak extra memory (MiB) of one call of ``module.make_case(provider, device=device, **shape)``."""
    if device.startswith("cuda"):
        fn: Callable[[], object] = importlib.import_module(module).make_case(provider, device=device, **shape)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    payload = json.dumps({"module": module, "provider": provider, "device": device, "shape": shape})
    out = subprocess.run([sys.executable, "-m", "benches._common", payload], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _main(payload: str) -> None:
    spec = json.loads(payload)
    fn = importlib.import_module(spec["module"]).make_case(spec["provider"], device=spec["device"], **spec["shape"])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    base = _status_mb("VmRSS")
    fn()
    print(max(0.0, _status_mb("VmHWM") - base))


if __name__ == "__main__":
    _main(sys.argv[1])
