"""The one place that decides whether an op runs its Triton kernel or its pure-PyTorch reference.

Policy:
- ``"reference"``: always the PyTorch reference (works on every device).
- ``"triton"``: always the Triton kernel; the tensors must be on CUDA, or ``TRITON_INTERPRET=1`` must have been set
  before triton was imported (then the kernels run on CPU tensors through Triton's interpreter, which is how the
  test-suite checks them on machines without a GPU).
- ``"auto"`` (default): Triton for CUDA tensors when Triton imports, the reference otherwise.

The initial choice comes from the ``ATTR_ENGINE_BACKEND`` environment variable, read once at import; afterwards
:func:`set_backend` changes it, either for good or, used as a context manager, for a ``with`` block.

Importing this module never initialises CUDA: Triton is imported lazily and only queried for its presence.
"""

from __future__ import annotations

import os
import threading
from types import TracebackType
from typing import Any, Literal

import torch

Backend = Literal["auto", "reference", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "triton")

try:  # Triton ships with the Linux builds of torch; elsewhere every op falls back to its reference.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on platforms without Triton
    HAS_TRITON = False

    class _JitStub:
        """Stands in for ``triton.jit`` so kernel definitions still import; launching them is never attempted."""

        @staticmethod
        def jit(fn: Any = None, **_: Any) -> Any:
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(0, (n - 1).bit_length())

    class _LangStub:
        constexpr = int

    triton = _JitStub()
    tl = _LangStub()


def _check_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")
    return name


_state = threading.local()
_default: str = _check_name(os.environ.get("ATTR_ENGINE_BACKEND", "auto").strip().lower() or "auto")


def get_backend() -> str:
    """The backend in force for the calling thread: ``"auto"``, ``"reference"`` or ``"triton"``."""
    return getattr(_state, "backend", _default)


class set_backend:
    """Select the kernel backend.

    ``attr_engine_kernels.set_backend("reference")`` switches for the rest of the thread's life;
    ``with kernels.set_backend("triton"): ...`` switches for the block and restores the previous choice on exit.
    """

    def __init__(self, name: Backend) -> None:
        self._previous = get_backend()
        _state.backend = _check_name(name)

    def __enter__(self) -> set_backend:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _state.backend = self._previous


def interpreter_enabled() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """Decide, for an op about to run on ``tensors``, whether to take its Triton path.

    Raises:
        RuntimeError: the backend is forced to ``"triton"`` but the kernels cannot run on these tensors.
    """
    if getattr(_state, "recording", False):  # attr_engine_kernels.aot records the launches the Triton path would make
        return True
    backend = get_backend()
    if backend == "reference":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    runnable = HAS_TRITON and (on_cuda or (interpreter_enabled() and not any(t.is_cuda for t in tensors)))
    if backend == "triton":
        if not HAS_TRITON:
            raise RuntimeError("backend 'triton' requested but triton is not installed")
        if not runnable:
            devices = sorted({str(t.device) for t in tensors})
            raise RuntimeError(
                f"backend 'triton' needs CUDA tensors (got {', '.join(devices)}); "
                "set TRITON_INTERPRET=1 before importing triton to run the kernels on the CPU"
            )
        return True
    # auto: the interpreter is a correctness tool, far slower than the reference, so it is only used when asked for.
    return on_cuda and HAS_TRITON


__all__ = [
    "BACKENDS",
    "HAS_TRITON",
    "Backend",
    "get_backend",
    "interpreter_enabled",
    "set_backend",
    "tl",
    "triton",
    "use_triton",
]
