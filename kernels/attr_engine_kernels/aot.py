"""Ahead-of-time compile check: every Triton kernel compiled for real NVIDIA targets, with no GPU and no driver.

Triton's CPU interpreter (``TRITON_INTERPRET=1``, what the test-suite runs) executes kernels as Python: it accepts
code the compiler rejects and says nothing about registers, spills or shared memory. This module runs the real
compiler instead: Triton's front end, its MLIR passes and the ``ptxas`` shipped in the triton wheel, for sm_90
(H100/H200) and sm_80 (A100).

What is compiled is what runs. Each :class:`Scenario` drives a public op (forward and backward) on small CPU tensors
inside :func:`record_launches`, which makes the ops take their Triton path and records every launch
(kernel, grid, arguments, options) instead of executing it. So the launcher code itself picks the BLOCK sizes, warps
and dtypes. Each distinct recorded launch is then bound the way ``JITFunction.run`` binds it (same specialisation:
16-divisibility of integers and pointers, integers equal to 1 folded) and compiled for each target.

The outputs of a recorded op are uninitialised memory: only the launches are meaningful, never the values.

Run ``python -m attr_engine_kernels.aot`` for the table (kernel, configuration, arch, warps, registers, spill bytes,
shared memory, programs). ``--check`` exits 1 if a kernel fails to compile, overflows shared memory or the register
file, or spills in a scenario marked as a default configuration. The Triton cache lives in a fresh temporary
directory per run: its key does not cover every switch, and a cache hit would hide the ptxas report this check reads.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from attr_engine_kernels import _backend

# Per-block limits of the targets: opt-in shared memory per block and the register file of one SM.
SHARED_LIMIT: dict[int, int] = {90: 232448, 80: 166912}
REGISTER_FILE = 65536
MAX_REGISTERS_PER_THREAD = 255
DEFAULT_ARCHS: tuple[int, ...] = (90, 80)
# An H200 has 132 SMs; the "fill the GPU" target is 4 programs per SM at the AHA default shape.
H200_SMS = 132

_PTXAS_INFO = re.compile(r"Compiling entry function '(?P<name>[^']+)'")
_PTXAS_REGS = re.compile(r"Used (?P<regs>\d+) registers")
_PTXAS_SPILL = re.compile(r"(?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes spill loads")


@dataclass(frozen=True)
class Launch:
    """One recorded kernel launch: the JIT function, its grid and the arguments the launcher passed."""

    kernel: Any  # triton.runtime.jit.JITFunction
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    @property
    def programs(self) -> int:
        n = 1
        for g in self.grid:
            n *= int(g)
        return n


@dataclass
class CompileResult:
    """What the compiler reported for one distinct launch on one target."""

    kernel: str
    scenario: str
    arch: int
    default: bool  # inside the envelope that must not spill
    num_warps: int
    programs: int
    constexprs: str
    registers: int = -1
    spill_bytes: int = -1
    shared_bytes: int = -1
    seconds: float = 0.0
    error: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class Scenario:
    """A named drive of public ops; ``default`` marks the configurations that must compile without spills."""

    name: str
    run: Callable[[], None]
    default: bool = False


# ----------------------------------------------------------------------------------------------------------------
# Recording launches
# ----------------------------------------------------------------------------------------------------------------

_record_lock = threading.Lock()


@contextlib.contextmanager
def record_launches() -> Iterator[list[Launch]]:
    """Within the block, ops take their Triton path on any tensors and kernel launches are recorded, not run.

    Patches ``JITFunction.run`` for the duration (one recording at a time per process) and always restores it.
    Needs the real compiler front end, so ``TRITON_INTERPRET`` must not be 1 in this process.
    """
    if not _backend.HAS_TRITON:
        raise RuntimeError("the compile check needs triton, which is not installed")
    if _backend.interpreter_enabled():
        raise RuntimeError("the compile check needs TRITON_INTERPRET unset (it compiles for GPUs, not the interpreter)")
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        if callable(grid):
            raise NotImplementedError(f"{self.fn.__name__}: callable grids are not recorded")
        grid_t = tuple(int(g) for g in grid)
        launches.append(Launch(self, grid_t, args, dict(kwargs)))

    with _record_lock:
        original = JITFunction.run
        JITFunction.run = run
        _backend._state.recording = True
        try:
            yield launches
        finally:
            JITFunction.run = original
            _backend._state.recording = False


# ----------------------------------------------------------------------------------------------------------------
# Compiling a recorded launch
# ----------------------------------------------------------------------------------------------------------------


def _bind(launch: Launch, arch: int) -> tuple[Any, dict[str, Any], dict[Any, Any], dict[Any, Any], Any]:
    """Specialise the recorded arguments exactly as ``JITFunction.run`` would on a GPU of ``arch``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = dict(launch.kwargs)
    kwargs.setdefault("debug", False)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return target, signature, constexprs, attrs, options


def _key(launch: Launch, arch: int) -> str:
    _, signature, constexprs, attrs, options = _bind(launch, arch)
    return repr((launch.name, arch, signature, sorted(constexprs.items(), key=repr), sorted(attrs.items()), options))


def _parse_ptxas(log: str, kernel: str) -> tuple[int, int]:
    """(registers, spill bytes) of ``kernel``'s entry from a ptxas -v log."""
    regs, spills, current = -1, -1, None
    for line in log.splitlines():
        m = _PTXAS_INFO.search(line)
        if m:
            current = m.group("name")
            continue
        if current is None or not current.startswith(kernel):
            continue
        if (s := _PTXAS_SPILL.search(line)) is not None:
            spills = int(s.group("stores")) + int(s.group("loads"))
        if (r := _PTXAS_REGS.search(line)) is not None:
            regs = int(r.group("regs"))
    return regs, spills


def compile_launch(launch: Launch, arch: int, scenario: str = "", default: bool = False) -> CompileResult:
    """Compile one recorded launch for ``sm_<arch>`` and check it against the target's limits."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    num_warps = int(launch.kwargs.get("num_warps", 4))
    consts = {k: v for k, v in launch.kwargs.items() if k not in ("num_warps", "num_stages", "num_ctas")}
    res = CompileResult(
        kernel=launch.name,
        scenario=scenario,
        arch=arch,
        default=default,
        num_warps=num_warps,
        programs=launch.programs,
        constexprs=", ".join(f"{k}={_short(v)}" for k, v in consts.items()),
    )
    start = time.perf_counter()
    buf = io.StringIO()
    try:
        target, signature, constexprs, attrs, options = _bind(launch, arch)
        src = ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        previous = knobs.nvidia.dump_ptxas_log
        knobs.nvidia.dump_ptxas_log = True
        try:
            with contextlib.redirect_stdout(buf):
                compiled = triton.compile(src, target=target, options=options.__dict__)
        finally:
            knobs.nvidia.dump_ptxas_log = previous
        res.shared_bytes = int(compiled.metadata.shared)
        res.registers, res.spill_bytes = _parse_ptxas(buf.getvalue(), launch.name)
    except Exception as exc:  # every compiler failure is a finding to report
        res.error = f"{type(exc).__name__}: {_first_line(str(exc))}"
    res.seconds = time.perf_counter() - start
    res.problems = _problems(res)
    return res


def _problems(res: CompileResult) -> list[str]:
    if res.error:
        return [f"does not compile ({res.error})"]
    out = []
    if res.shared_bytes > SHARED_LIMIT[res.arch]:
        out.append(f"shared memory {res.shared_bytes} B > {SHARED_LIMIT[res.arch]} B")
    if res.registers < 0 or res.spill_bytes < 0:
        out.append("no ptxas report (registers / spills unknown)")
    elif res.registers * 32 * res.num_warps > REGISTER_FILE:
        out.append(f"{res.registers} registers x {32 * res.num_warps} threads exceed the register file")
    if res.default and res.spill_bytes > 0:
        out.append(f"spills {res.spill_bytes} B at a default configuration")
    return out


def _short(v: Any) -> str:
    s = str(v)
    return s.removeprefix("triton.language.")


def _first_line(msg: str) -> str:
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    text = " / ".join(lines[:3]).replace("|", "/")  # keeps the Markdown table intact
    return text[:300]


# ----------------------------------------------------------------------------------------------------------------
# The scenarios: default and extreme configurations of every public op
# ----------------------------------------------------------------------------------------------------------------

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _grad_of(out: torch.Tensor, *inputs: torch.Tensor) -> None:
    torch.autograd.grad(out, inputs, torch.ones_like(out), allow_unused=True)


def _sorter(n: int, s: int, dtype: torch.dtype, noise: float, batch: int = 2) -> Callable[[], None]:
    def run() -> None:
        from attr_engine_kernels.soft_rank import soft_topk_masks

        scores = torch.rand(batch, n, dtype=dtype, requires_grad=True)
        fractions = torch.linspace(0.0, 1.0, s).tolist()
        m = soft_topk_masks(scores, fractions, tau=0.1, n_iters=3, noise=noise, generator=0)
        _grad_of(m, scores)

    return run


def _sinkhorn(n: int, dtype: torch.dtype, batch: int = 2) -> Callable[[], None]:
    def run() -> None:
        from attr_engine_kernels.sinkhorn import sinkhorn

        la = torch.randn(batch, n, n, dtype=dtype, requires_grad=True)
        _grad_of(sinkhorn(la, n_iters=3, tau=0.5), la)

    return run


def _pool(size: int, g: int, dtype: torch.dtype, offset: tuple[float, float]) -> Callable[[], None]:
    def run() -> None:
        from attr_engine_kernels.region import region_pool

        amap = torch.rand(2, size, size, dtype=dtype, requires_grad=True)
        _grad_of(region_pool(amap, g, offset), amap)

    return run


def _blend(
    size: int,
    g: int,
    s: int,
    dtype: torch.dtype,
    batch: int = 2,
    sigma: float = 0.0,
    offset: tuple[float, float] = (0.0, 0.0),
) -> Callable[[], None]:
    def run() -> None:
        from attr_engine_kernels.region import soft_mask_blend

        x = torch.rand(batch, 3, size, size, dtype=dtype, requires_grad=True)
        ref = torch.zeros(1, 3, size, size, dtype=dtype).expand(batch, -1, -1, -1).requires_grad_(True)
        masks = torch.rand(batch, s, g, g, dtype=dtype, requires_grad=True)
        _grad_of(soft_mask_blend(x, ref, masks, offset, smooth_sigma=sigma), x, ref, masks)

    return run


def _gate(kind: str, dtype: torch.dtype) -> Callable[[], None]:
    def run() -> None:
        from attr_engine_kernels.soft_gates import soft_gate

        z = torch.randn(4, 8, 14, 14, dtype=dtype, requires_grad=True)
        _grad_of(soft_gate(z, kind), z)

    return run


def _maxpool(k: int, s: int, p: int, dtype: torch.dtype) -> Callable[[], None]:
    def run() -> None:
        from attr_engine_kernels.soft_gates import soft_maxpool2d

        x = torch.randn(2, 8, 56, 56, dtype=dtype, requires_grad=True)
        _grad_of(soft_maxpool2d(x, k, s, p), x)

    return run


def _gumbel() -> None:
    from attr_engine_kernels.soft_rank import triton_gumbel_noise

    triton_gumbel_noise(0, 2, 49, "cpu")


def scenarios(quick: bool = False) -> list[Scenario]:
    """Every configuration the check compiles. ``quick`` keeps the defaults and the largest accepted sizes."""
    from attr_engine_kernels.region import MAX_BLEND_MASKS
    from attr_engine_kernels.soft_rank import MAX_FRACTIONS, MAX_SORT_CELLS

    out: list[Scenario] = []
    # AHA's sorter: default envelope N <= 1024, S <= 64.
    for n in (1, 49, 196, 784, 1024):
        for s in (2, 16, 64):
            if quick and (n, s) not in ((784, 16), (1024, 64), (1, 2)):
                continue
            out.append(Scenario(f"soft_topk N={n} S={s}", _sorter(n, s, torch.float32, 1.0), default=True))
    out.append(Scenario("soft_topk N=784 S=16 noise=0", _sorter(784, 16, torch.float32, 0.0), default=True))
    for dt in (torch.float16, torch.bfloat16):
        out.append(Scenario(f"soft_topk N=784 S=16 {_dt(dt)}", _sorter(784, 16, dt, 1.0), default=True))
    big_s = _sorter(196, MAX_FRACTIONS, torch.float32, 1.0, batch=1)
    out.append(Scenario(f"soft_topk N=196 S={MAX_FRACTIONS} (max S)", big_s))
    big_n = _sorter(MAX_SORT_CELLS, 16, torch.float32, 1.0, batch=1)
    out.append(Scenario(f"soft_topk N={MAX_SORT_CELLS} S=16 (max N)", big_n))
    # Sinkhorn: default envelope N <= 1024.
    for n in (1, 49, 128, 196, 784, 1024):
        for dt in _DTYPES:
            if dt != torch.float32 and (quick or n not in (49, 196, 784)):
                continue
            out.append(Scenario(f"sinkhorn N={n} {_dt(dt)}", _sinkhorn(n, dt), default=True))
    # Region pooling and blending at 224 px, g = 7..28: the default envelope.
    grids = (7, 14, 28) if quick else tuple(range(7, 29))
    for g in grids:
        out.append(Scenario(f"region_pool 224px g={g}", _pool(224, g, torch.float32, (0.0, 0.0)), default=True))
        out.append(Scenario(f"soft_mask_blend 224px g={g} S=16", _blend(224, g, 16, torch.float32), default=True))
    out.append(Scenario("region_pool 224px g=16 offset", _pool(224, 16, torch.float32, (0.3, 0.7)), default=True))
    for dt in (torch.float16, torch.bfloat16):
        out.append(Scenario(f"region_pool 224px g=14 {_dt(dt)}", _pool(224, 14, dt, (0.0, 0.0)), default=True))
        out.append(Scenario(f"soft_mask_blend 224px g=14 S=16 {_dt(dt)}", _blend(224, 14, 16, dt), default=True))
    for s in (2, 64):
        out.append(Scenario(f"soft_mask_blend 224px g=28 S={s}", _blend(224, 28, s, torch.float32), default=True))
    # The largest S on a small image: the kernels' configuration does not depend on the image size.
    big = _blend(8, 2, MAX_BLEND_MASKS, torch.float32, batch=1)
    out.append(Scenario(f"soft_mask_blend 8px g=2 S={MAX_BLEND_MASKS} (max S)", big))
    # Mask smoothing as AHA trains (sigma 1.0 at 224 px, scaled with the side): every grid at 224 px, offsets (a
    # short first cell widens the band of cells a pixel reaches), half dtypes, S = 2 / 64, and 64 / 32 px.
    for g in grids:
        sc = _blend(224, g, 16, torch.float32, sigma=1.0)
        out.append(Scenario(f"soft_mask_blend 224px g={g} S=16 smooth", sc, default=True))
    for g, off in ((7, (0.5, 0.5)), (28, (0.9, 0.1)), (28, (0.99, 0.99))):
        sc = _blend(224, g, 16, torch.float32, sigma=1.0, offset=off)
        out.append(Scenario(f"soft_mask_blend 224px g={g} S=16 smooth offset {off}", sc, default=True))
    for dt in (torch.float16, torch.bfloat16):
        sc = _blend(224, 14, 16, dt, sigma=1.0)
        out.append(Scenario(f"soft_mask_blend 224px g=14 S=16 smooth {_dt(dt)}", sc, default=True))
    for s in (2, 64):
        sc = _blend(224, 28, s, torch.float32, sigma=1.0)
        out.append(Scenario(f"soft_mask_blend 224px g=28 S={s} smooth", sc, default=True))
    for size, g in ((64, 16), (32, 8)):
        sc = _blend(size, g, 16, torch.float32, sigma=size / 224)
        out.append(Scenario(f"soft_mask_blend {size}px g={g} S=16 smooth", sc, default=True))
    big = _blend(8, 2, MAX_BLEND_MASKS, torch.float32, batch=1, sigma=1.0)
    out.append(Scenario(f"soft_mask_blend 8px g=2 S={MAX_BLEND_MASKS} smooth (max S)", big))
    # Soft adjoint: every gate kind and dtype, the common pooling shapes.
    for kind in ("relu", "gelu", "gelu_tanh", "silu"):
        for dt in _DTYPES:
            if quick and dt != torch.float32:
                continue
            out.append(Scenario(f"soft_gate {kind} {_dt(dt)}", _gate(kind, dt), default=True))
    for k, s, p in ((3, 2, 1), (2, 2, 0)):
        for dt in _DTYPES:
            if quick and dt != torch.float32:
                continue
            out.append(Scenario(f"soft_maxpool2d k={k} s={s} p={p} {_dt(dt)}", _maxpool(k, s, p, dt), default=True))
    out.append(Scenario("gumbel_fill (test helper)", _gumbel, default=True))
    return out


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------------------------------------
# Driving the check
# ----------------------------------------------------------------------------------------------------------------


def record(scenario: Scenario) -> list[Launch]:
    """The launches one scenario makes (forward and backward)."""
    with record_launches() as launches:
        scenario.run()
    if not launches:
        raise RuntimeError(f"scenario {scenario.name!r} launched no Triton kernel")
    return launches


def run_check(
    archs: tuple[int, ...] = DEFAULT_ARCHS,
    quick: bool = False,
    only: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[CompileResult]:
    """Record every scenario (those whose name contains ``only``), compile each distinct launch once per arch."""
    results: list[CompileResult] = []
    seen: dict[str, CompileResult] = {}
    chosen = [sc for sc in scenarios(quick) if only is None or only in sc.name]
    if not chosen:
        raise ValueError(f"no scenario matches {only!r}")
    with _private_cache():
        for sc in chosen:
            for launch in record(sc):
                for arch in archs:
                    key = _key(launch, arch)
                    if key in seen:
                        # Same compiled kernel as an earlier scenario: a default scenario still asks for no spills.
                        prev = seen[key]
                        if sc.default and not prev.default:
                            prev.default = True
                            prev.problems = _problems(prev)
                        continue
                    res = compile_launch(launch, arch, sc.name, sc.default)
                    seen[key] = res
                    results.append(res)
                    if progress is not None:
                        progress(_row(res))
    return results


@contextlib.contextmanager
def _private_cache() -> Iterator[None]:
    from triton import knobs

    previous = knobs.cache.dir
    with tempfile.TemporaryDirectory(prefix="attr-engine-aot-") as d:
        knobs.cache.dir = d
        try:
            yield
        finally:
            knobs.cache.dir = previous


_HEADER = (
    "| kernel | scenario | constexprs | arch | warps | programs | registers | spill B | shared B | s | status |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


def _row(r: CompileResult) -> str:
    status = "ok" if r.ok else "; ".join(r.problems)
    return (
        f"| {r.kernel} | {r.scenario} | {r.constexprs} | sm_{r.arch} | {r.num_warps} | {r.programs} | {r.registers} "
        f"| {r.spill_bytes} | {r.shared_bytes} | {r.seconds:.1f} | {status} |"
    )


def format_table(results: list[CompileResult]) -> str:
    """A Markdown table, one row per distinct (kernel launch, arch)."""
    return "\n".join([_HEADER, *(_row(r) for r in results)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attr_engine_kernels.aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=list(DEFAULT_ARCHS), help="SM versions (90, 80)")
    parser.add_argument("--quick", action="store_true", help="defaults and the largest sizes only")
    parser.add_argument("--check", action="store_true", help="exit 1 on any failure, overflow or default spill")
    parser.add_argument("--only", metavar="TEXT", help="only the scenarios whose name contains TEXT")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    for arch in args.arch:
        if arch not in SHARED_LIMIT:
            parser.error(f"--arch {arch}: known targets are {sorted(SHARED_LIMIT)}")
    start = time.perf_counter()
    print(_HEADER, flush=True)
    results = run_check(tuple(args.arch), quick=args.quick, only=args.only, progress=lambda row: print(row, flush=True))
    elapsed = time.perf_counter() - start
    bad = [r for r in results if not r.ok]
    print(f"\n{len(results)} compiles ({len({r.kernel for r in results})} kernels) in {elapsed:.0f} s; "
          f"{len(bad)} problem(s)")  # fmt: skip
    for r in bad:
        print(f"  {r.kernel} [{r.scenario}] sm_{r.arch}: {'; '.join(r.problems)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 1 if (args.check and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
