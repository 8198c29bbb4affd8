"""Triton device helpers shared by several kernel files (the streaming logsumexp of the Sinkhorn-type passes)."""

from __future__ import annotations

from kernels._backend import tl, triton


@triton.jit
def _online_lse(run_max, run_sum, x, AXIS: tl.constexpr):
    """One step of a streaming logsumexp along ``AXIS`` of tile x: returns the updated (max, sum of exp(x - max)).

    A lane that has seen only -inf keeps max -inf and sum 0 (its shift is taken as 0, so no inf - inf appears).
    """
    new_max = tl.maximum(run_max, tl.max(x, axis=AXIS))
    safe = tl.where(new_max == float("-inf"), 0.0, new_max)
    run_sum = run_sum * tl.exp(run_max - safe) + tl.sum(tl.exp(x - tl.expand_dims(safe, AXIS)), axis=AXIS)
    return new_max, run_sum


@triton.jit
def _neg_lse(run_max, run_sum):
    """-logsumexp from a finished streaming pair (padding lanes, sum 0, give a finite value that is never stored)."""
    return -(run_max + tl.log(tl.where(run_sum > 0.0, run_sum, 1.0)))
