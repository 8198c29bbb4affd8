"""Input checks shared by every op, so each error names the argument and what was wrong with it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_tensor(
    t: object,
    name: str,
    *,
    ndim: int | None = None,
    finite: bool = False,
) -> torch.Tensor:
    """Check that ``t`` is a floating-point tensor of rank ``ndim`` (and finite, if asked).

    Raises:
        ValueError: naming ``name`` and the offending property.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16, bfloat16 or float64, got {t.dtype}")
    if finite and t.numel() > 0 and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or infinite values")
    return t


def check_same(ref: torch.Tensor, ref_name: str, other: torch.Tensor, other_name: str) -> None:
    """Check that two tensors share device and dtype (shapes are checked by each op)."""
    if other.device != ref.device:
        raise ValueError(f"{other_name} is on {other.device} but {ref_name} is on {ref.device}")
    if other.dtype != ref.dtype:
        raise ValueError(f"{other_name} has dtype {other.dtype} but {ref_name} has dtype {ref.dtype}")


def _real(value: object, name: str, what: str) -> float:
    # bool is an int and str converts with float(): both would pass for numbers without a word, so both are refused.
    if isinstance(value, bool | str | bytes):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {what}, got {value!r}") from None


def check_positive(value: float, name: str) -> float:
    """Check a strictly positive, finite real (temperatures, scales); returns it as a float."""
    v = _real(value, name, "a positive finite number")
    if not (v > 0.0 and v < float("inf")):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return v


def check_non_negative(value: float, name: str) -> float:
    """Check a finite real >= 0 (weights, decays, noise scales); returns it as a float."""
    v = _real(value, name, "a finite number >= 0")
    if not (v >= 0.0 and v < float("inf")):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return v


def check_int(value: int, name: str) -> int:
    """Check an integer of any sign (seeds, layer indices); bools are refused."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def check_int_at_least(value: object, name: str, minimum: int) -> int:
    """Check an integer count such as ``n_iters`` or a grid size."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_bool(value: bool, name: str) -> bool:
    """Check a flag: exactly True or False (not 0 / 1, not a string)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def check_offset(offset: Sequence[float], name: str = "offset") -> tuple[float, float]:
    """Check a sub-cell grid offset: two fractions of a cell, each in [0, 1)."""
    try:
        oy, ox = (float(o) for o in offset)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a pair of floats (dy, dx), got {offset!r}") from None
    for o in (oy, ox):
        if not 0.0 <= o < 1.0:
            raise ValueError(f"{name} entries are fractions of a cell in [0, 1), got {offset!r}")
    return oy, ox
