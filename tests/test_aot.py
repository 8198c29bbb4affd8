"""attr_engine_kernels.aot: every Triton kernel compiles for sm_90 and sm_80 at the configurations its launcher picks.

The compile check needs Triton's real front end, so it runs in a subprocess without ``TRITON_INTERPRET`` (this
test-suite's conftest turns the interpreter on for everything else).
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import attr_engine_kernels
from attr_engine_kernels import aot
from attr_engine_kernels._backend import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

ROOT = Path(__file__).resolve().parents[1]


def _all_kernels() -> set[str]:
    """Names of every launchable @triton.jit kernel in the kernels package (helpers end in anything but _kernel)."""
    names = set()
    for info in pkgutil.iter_modules(attr_engine_kernels.__path__):
        module = importlib.import_module(f"attr_engine_kernels.{info.name}")
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)  # a JITFunction (or the interpreter's stand-in) wraps the Python function
            if name.endswith("_kernel") and fn is not None and fn.__module__ == module.__name__:
                names.add(name)
    return names


@pytest.fixture(scope="module")
def compile_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, list[dict]]:
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "attr_engine_kernels.aot", "--check", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    results = json.loads(out.read_text()) if out.exists() else []
    return proc.returncode, proc.stdout + proc.stderr, results


def test_every_kernel_compiles_on_both_targets(compile_report: tuple[int, str, list[dict]]) -> None:
    rc, log, results = compile_report
    assert rc == 0, log[-4000:]
    assert results, log[-4000:]
    errors = [(r["kernel"], r["scenario"], r["arch"], r["error"]) for r in results if r["error"]]
    assert not errors
    for arch in (80, 90):
        compiled = {r["kernel"] for r in results if r["arch"] == arch}
        assert compiled == _all_kernels(), f"sm_{arch}: kernels never compiled: {_all_kernels() - compiled}"


def test_defaults_do_not_spill_and_fit_the_target(compile_report: tuple[int, str, list[dict]]) -> None:
    _, _, results = compile_report
    defaults = [r for r in results if r["default"]]
    assert len(defaults) > 100
    for r in defaults:
        where = f"{r['kernel']} [{r['scenario']}] sm_{r['arch']}"
        assert r["spill_bytes"] == 0, where
        assert 0 < r["registers"] <= aot.MAX_REGISTERS_PER_THREAD, where
        assert r["registers"] * 32 * r["num_warps"] <= aot.REGISTER_FILE, where
    for r in results:
        assert 0 <= r["shared_bytes"] <= aot.SHARED_LIMIT[r["arch"]], f"{r['kernel']} [{r['scenario']}]"


def test_sorter_and_sinkhorn_fill_an_h200_at_the_aha_shape() -> None:
    """At B = 32, N = 784 every launch of the sorter and of Sinkhorn (forward and backward) has >= 4 programs per
    H200 SM, read off the launches the real launchers record."""
    code = (
        "import torch\n"
        "from attr_engine_kernels import aot\n"
        "from attr_engine_kernels.soft_rank import soft_topk_masks\n"
        "from attr_engine_kernels.sinkhorn import sinkhorn\n"
        "def sorter():\n"
        "    s = torch.rand(32, 784, requires_grad=True)\n"
        "    soft_topk_masks(s, [i / 16 for i in range(1, 17)], tau=0.1, n_iters=2, generator=0).sum().backward()\n"
        "def sk():\n"
        "    la = torch.randn(32, 784, 784, requires_grad=True)\n"
        "    sinkhorn(la, n_iters=2).sum().backward()\n"
        "for run in (sorter, sk):\n"
        "    ls = aot.record(aot.Scenario('shape', run))\n"
        "    print(run.__name__, len(ls), min(l.programs for l in ls))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = {line.split()[0]: (int(line.split()[1]), int(line.split()[2])) for line in proc.stdout.splitlines()}
    # The same core for both (T = 2 here): forward 2T half-steps, backward 2 direct passes + 2T; the sorter adds its
    # mask kernel, Sinkhorn its row-shift pass.
    assert counts["sorter"][0] == 2 * 2 + 1 + 2 + 2 * 2
    assert counts["sk"][0] == 1 + 2 * 2 + 2 + 2 * 2
    for name, (_, programs) in counts.items():
        assert programs >= 4 * aot.H200_SMS, name


def test_record_refuses_the_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("only meaningful under the interpreter")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET unset"), aot.record_launches():
        pass


def test_parse_ptxas_reads_registers_and_spills_of_the_named_entry() -> None:
    log = (
        "ptxas info    : 0 bytes gmem\n"
        "ptxas info    : Compiling entry function 'other_kernel' for 'sm_90a'\n"
        "ptxas info    : Function properties for other_kernel\n"
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 12 registers, used 0 barriers\n"
        "ptxas info    : Compiling entry function '_soft_gate_bwd_kernel' for 'sm_90a'\n"
        "ptxas info    : Function properties for _soft_gate_bwd_kernel\n"
        "    8 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 0 barriers, 8 bytes cumulative stack size\n"
    )
    assert aot._parse_ptxas(log, "_soft_gate_bwd_kernel") == (40, 12)
    assert aot._parse_ptxas(log, "missing_kernel") == (-1, -1)
