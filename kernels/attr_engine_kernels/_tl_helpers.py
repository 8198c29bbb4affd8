"""Pieces shared by several kernel files: the compute dtype, int64 program ids and the logsumexp blocks.

Conventions every kernel file follows:

- Arithmetic in float32 for every I/O dtype, float64 only for float64 inputs where a kernel supports them
  (:func:`compute_dtype` on the host, :func:`tl_compute_dtype` for a kernel's ``ACC`` constexpr).
- Program ids are read with :func:`_pid`, as int64: every offset derived from them (``pid * BLOCK``, ``b * stride``)
  is int64 too and cannot overflow int32 at large B * S * C * H * W.
- Strides are named ``stride_<tensor><dim>`` (``stride_xb, stride_xc, stride_xh, stride_xw`` for an image x), one
  argument per dimension, in the order of ``tensor.stride()``, as in the Triton tutorials.
"""

from __future__ import annotations

from typing import Any

import torch

from attr_engine_kernels._backend import tl, triton


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 arithmetic for every I/O dtype except float64, which stays float64 (so gradcheck sees an exact
    function)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tl_compute_dtype(dtype: torch.dtype) -> Any:
    """:func:`compute_dtype` as a Triton dtype, for a kernel's ``ACC: tl.constexpr``."""
    return tl.float64 if dtype == torch.float64 else tl.float32


@triton.jit
def _pid(axis: tl.constexpr):
    """This program's id along grid ``axis`` as int64 (see the module docstring)."""
    return tl.program_id(axis).to(tl.int64)


@triton.jit
def _online_lse(run_max, run_sum, x, AXIS: tl.constexpr):
    """One step of a streaming logsumexp along ``AXIS`` of tile x: returns the updated (max, sum of exp(x - max)).

    run_max' = max(run_max, max_AXIS x);  run_sum' = run_sum * exp(run_max - run_max') + sum_AXIS exp(x - run_max').
    A lane that has seen only -inf keeps max -inf and sum 0 (its shift is taken as 0, so no inf - inf appears).
    """
    new_max = tl.maximum(run_max, tl.max(x, axis=AXIS))
    safe = tl.where(new_max == float("-inf"), 0.0, new_max)
    run_sum = run_sum * tl.exp(run_max - safe) + tl.sum(tl.exp(x - tl.expand_dims(safe, AXIS)), axis=AXIS)
    return new_max, run_sum


@triton.jit
def _lse_normaliser(run_max, run_sum):
    """(shift, 1 / sum) of a finished streaming pair: ``exp(x - shift) * inv`` are the normalised weights.

    Writing the weights from these two (rather than through ``exp(x + potential)``) keeps them summing to one where
    ``max + log(sum)`` no longer fits fp32. Lanes that saw only -inf (padding) get (0, 1).
    """
    shift = tl.where(run_max == float("-inf"), 0.0, run_max)
    inv_sum = 1.0 / tl.where(run_sum > 0.0, run_sum, 1.0)
    return shift, inv_sum


@triton.jit
def _neg_lse(run_max, run_sum):
    """-logsumexp from a finished streaming pair: -(max + log(sum)). Padding lanes (max -inf, sum 0) give +inf,
    which is never stored."""
    return -(run_max + tl.log(tl.where(run_sum > 0.0, run_sum, 1.0)))


@triton.jit
def _lse(x, AXIS: tl.constexpr):
    """logsumexp of a whole tile along ``AXIS`` in one pass; a padding lane (-inf throughout) gives 0.

    Used where a potential must stay finite on padding lanes because it is added to the next half-step's tile (the
    register-resident Sinkhorn); the streaming kernels mask their stores instead.
    """
    m = tl.max(x, axis=AXIS)
    m = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp(x - tl.expand_dims(m, AXIS)), axis=AXIS)
    return m + tl.log(tl.where(s > 0.0, s, 1.0))
