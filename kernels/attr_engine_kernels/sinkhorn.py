"""Batched log-domain Sinkhorn normalisation: log_alpha (B, N, N) -> doubly-stochastic P (B, N, N).

Definition (``sinkhorn_reference``): X = log_alpha / tau, then ``n_iters`` times X -= LSE over columns (each row sums to
one), X -= LSE over rows (each column sums to one); P = exp(X).

The fast paths run the same iterations in the dual (potentials) form. Writing K = log_alpha / tau, a row potential
u (B, N) and a column potential v (B, N) stand for the iterate log P = K + u[:, :, None] + v[:, None, :], so only
O(B * N) numbers change between half-steps and the N x N weights are recomputed from K whenever they are needed:

    u^t = -LSE_j(K + v^(t-1)),   v^t = -LSE_i(K + u^t),   v^0 = 0.

For rounding, K is first shifted by its row maxima (u^0 = -max_j K, absorbed exactly by the first half-step, so P
and its gradient are unchanged): every row of K' = K + u^0 peaks at 0. The potentials of every half-step, (B, T + 1,
N) each, are all the exact unrolled backward needs; its recurrence is written out in :mod:`._sinkhorn_core`.

The last half-step writes P = exp(x - m_j) / s_j straight from its column logsumexp (x = K' + u^T, m_j the column max,
s_j the column sum of exp(x - m_j)), so the columns of P sum to one even where v^T itself is rounded. Accuracy: the
potentials are O(max |log_alpha / tau|), so P carries a relative error of about fp32-eps times that spread (1e-7 at
spread 1, ~1e-3 at spread 1e6); the eager form, which keeps the normalised matrix, is the more accurate one there.

Paths: ``sinkhorn_reference`` (definition and gradcheck target), ``_SinkhornPotentials`` (pure PyTorch, batch-chunked,
recomputing backward) and two fused Triton designs, chosen by :func:`attr_engine_kernels._backend.use_triton`:

- N <= 64: one program per sample keeps the whole padded matrix in registers and runs every iteration (one launch
  forward, one backward); the matrix is read from memory once.
- N > 64: the tiled core of :mod:`attr_engine_kernels._sinkhorn_core`, shared with the soft-rank sorter: one launch per
  half-step over (sample, block of 32 rows or columns) programs, the potentials in global memory between launches
  (a launch boundary is CUDA's only grid-wide barrier), after one pass that writes the row shift u^0. The arithmetic
  of this decomposition is in benches/README.md ("Sinkhorn core").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.library import triton_op, wrap_triton

from attr_engine_kernels import _sinkhorn_core as core
from attr_engine_kernels._backend import tl, triton, use_triton
from attr_engine_kernels._sinkhorn_core import _cost_tile
from attr_engine_kernels._tl_helpers import _lse, _pid, compute_dtype
from attr_engine_kernels.validate import check_int_at_least, check_positive, check_tensor

# The reference works on slabs of the batch so that its N x N temporaries stay ~16 MiB (fp32) whatever B is.
_CHUNK_ELEMENTS = 1 << 22
# Largest N whose whole (padded) matrix one program keeps in registers; larger N streams tiles. At N = 128 the
# backward's three live 128 x 128 fp32 tiles spill even at 16 warps (``python -m attr_engine_kernels.aot``), so 64
# is the cap.
_MAX_REGISTER_N = 64


def _check_inputs(log_alpha: Tensor, n_iters: int, tau: float, validate: bool = True) -> float:
    check_tensor(log_alpha, "log_alpha", ndim=3)
    if log_alpha.shape[1] != log_alpha.shape[2]:
        raise ValueError(f"log_alpha must be (B, N, N) with square last two dims, got shape {tuple(log_alpha.shape)}")
    if log_alpha.shape[1] < 1:
        raise ValueError(f"log_alpha needs N >= 1, got shape {tuple(log_alpha.shape)}")
    check_int_at_least(n_iters, "n_iters", 1)
    tau = check_positive(tau, "tau")
    check_tensor(log_alpha, "log_alpha", finite=validate)  # last: the only check that reads the data
    return tau


# ----------------------------------------------------------------------------------------------------------------
# Definition: plain autograd through the dense loop
# ----------------------------------------------------------------------------------------------------------------


def sinkhorn_reference(log_alpha: Tensor, n_iters: int = 20, tau: float = 1.0) -> Tensor:
    """Sinkhorn by its definition, differentiated by autograd through every iterate.

    Memory traffic: 2 * n_iters logsumexp-and-subtract passes, each reading and writing B * N^2 floats, and autograd
    keeps every iterate, O(n_iters * B * N^2) saved memory. This is the correctness definition of :func:`sinkhorn`.

    Args:
        log_alpha: (B, N, N) float scores.
        n_iters: number of (row, column) normalisation pairs, >= 1.
        tau: temperature, > 0.

    Returns:
        (B, N, N) doubly-stochastic P in the dtype of ``log_alpha`` (fp32 math for half precision inputs).
    """
    tau = _check_inputs(log_alpha, n_iters, tau)
    x = log_alpha.to(compute_dtype(log_alpha.dtype)) / tau
    for _ in range(n_iters):
        x = x - torch.logsumexp(x, dim=-1, keepdim=True)
        x = x - torch.logsumexp(x, dim=-2, keepdim=True)
    return torch.exp(x).to(log_alpha.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Reference: potentials form in plain PyTorch, recomputing backward
# ----------------------------------------------------------------------------------------------------------------


def _batch_chunks(batch: int, n: int) -> list[slice]:
    step = max(1, _CHUNK_ELEMENTS // (n * n))
    return [slice(i, min(i + step, batch)) for i in range(0, batch, step)]


class _SinkhornPotentials(torch.autograd.Function):
    """Potentials-form Sinkhorn; saves log_alpha and the (B, T + 1, N) potentials, recomputes weights in backward.

    Memory: saved state O(B * T * N); temporaries a few chunk x N x N slabs in forward and backward. Traffic: each
    half-step still reads the chunk's K and makes a shifted copy and its exponential (no fusion in plain PyTorch).
    """

    @staticmethod
    def forward(ctx: Any, log_alpha: Tensor, n_iters: int, tau: float) -> Tensor:
        batch, n, _ = log_alpha.shape
        cdtype = compute_dtype(log_alpha.dtype)
        u_all = torch.empty((batch, n_iters + 1, n), dtype=cdtype, device=log_alpha.device)
        v_all = torch.empty_like(u_all)
        p = torch.empty_like(log_alpha)
        for sl in _batch_chunks(batch, n):
            k = log_alpha[sl].to(cdtype) / tau
            u0 = -k.amax(dim=2)
            k = k + u0[:, :, None]
            v = torch.zeros_like(u0)
            u_all[sl, 0], v_all[sl, 0] = u0, v
            for t in range(1, n_iters + 1):
                u = -torch.logsumexp(k + v[:, None, :], dim=2)
                x = k + u[:, :, None]
                m = x.amax(dim=1, keepdim=True)
                e = x.sub_(m).exp_()
                s = e.sum(dim=1, keepdim=True)
                v = -(m + s.log()).squeeze(1)
                u_all[sl, t], v_all[sl, t] = u, v
            p[sl] = e.div_(s)
        ctx.save_for_backward(log_alpha, u_all, v_all)
        ctx.tau = tau
        return p

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_p: Tensor) -> tuple[Tensor | None, None, None]:
        log_alpha, u_all, v_all = ctx.saved_tensors
        tau = ctx.tau
        n_iters = u_all.shape[1] - 1
        cdtype = u_all.dtype
        grad = torch.empty_like(log_alpha)
        for sl in _batch_chunks(log_alpha.shape[0], log_alpha.shape[1]):
            k = log_alpha[sl].to(cdtype) / tau + u_all[sl, 0, :, None]
            u_t, v_t = u_all[sl, n_iters, :, None], v_all[sl, n_iters, None, :]
            dk = grad_p[sl].to(cdtype) * torch.exp(k + u_t + v_t)  # R = dL/dP * P
            du_direct = dk.sum(dim=2)
            dv = dk.sum(dim=1)
            for t in range(n_iters, 0, -1):
                x = k + u_all[sl, t, :, None]
                q = torch.exp(x + v_all[sl, t, None, :])  # weights of the v-step, column-normalised
                du = -torch.bmm(q, dv[:, :, None]).squeeze(2)
                if t == n_iters:
                    du += du_direct
                dk.sub_(q.mul_(dv[:, None, :]))
                q = torch.exp(x.add_(v_all[sl, t - 1, None, :]))  # weights of the u-step, row-normalised
                dv = -torch.bmm(du[:, None, :], q).squeeze(1)
                dk.sub_(q.mul_(du[:, :, None]))
            grad[sl] = dk.div_(tau)
        return grad, None, None


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels. N <= 64: one program per batch element runs every iteration on a register-resident matrix.
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _sinkhorn_fwd_block_kernel(
    la_ptr,  # (B, N, N) log_alpha, any float dtype, strided
    p_ptr,  # (B, N, N) output P, contiguous, log_alpha's dtype
    u_ptr,  # (B, T + 1, N) fp32 row potentials, contiguous: slot 0 the row shift, slot t u^t
    v_ptr,  # (B, T + 1, N) fp32 column potentials, contiguous: slot 0 zeros, slot t v^t
    stride_lb,  # log_alpha stride between batch elements
    stride_li,  # log_alpha stride between rows
    stride_lj,  # log_alpha stride between columns
    N,
    T,
    inv_tau,
    BLOCK: tl.constexpr,  # padded N (power of two >= 16)
):
    """The whole forward of one sample with its (BLOCK x BLOCK) matrix in registers:

    K' = log_alpha / tau + u^0,  u^0_i = -max_j log_alpha_ij / tau,  v^0 = 0
    for t = 1..T:  u^t_i = -LSE_j(K'_ij + v^(t-1)_j);  v^t_j = -LSE_i(K'_ij + u^t_i)
    P_ij = exp(x_ij - m_j) / s_j,  x = K' + u^T, m_j and s_j its column max and sum of exp(x - m_j)
    """
    b = _pid(0)
    rows = tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK)
    rmask = rows < N
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    pot_u = u_ptr + b * (T + 1) * N
    pot_v = v_ptr + b * (T + 1) * N
    # Padding lanes hold -inf, so they carry no weight in any logsumexp; their potentials are pinned to 0.
    k = tl.load(
        la_ptr + b * stride_lb + rows[:, None] * stride_li + cols[None, :] * stride_lj, mask=mask, other=float("-inf")
    )
    k = k.to(tl.float32) * inv_tau
    u0 = tl.where(rmask, -tl.max(k, axis=1), 0.0)
    k = k + u0[:, None]
    u = tl.zeros([BLOCK], dtype=tl.float32)
    v = tl.zeros([BLOCK], dtype=tl.float32)
    tl.store(pot_u + rows, u0, mask=rmask)
    tl.store(pot_v + cols, v, mask=cmask)
    for t in range(1, T + 1):
        u = -_lse(k + v[None, :], 1)
        v = -_lse(k + u[:, None], 0)
        tl.store(pot_u + t * N + rows, u, mask=rmask)
        tl.store(pot_v + t * N + cols, v, mask=cmask)
    # Normalise the last iterate's columns directly (not through the rounded v^T): columns sum to 1.
    x = k + u[:, None]
    m = tl.max(x, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    e = tl.exp(x - m[None, :])
    s = tl.sum(e, axis=0)
    p = e / tl.where(s > 0.0, s, 1.0)[None, :]
    tl.store(p_ptr + b * N * N + rows[:, None] * N + cols[None, :], p.to(p_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sinkhorn_bwd_block_kernel(
    la_ptr,  # (B, N, N) log_alpha, any float dtype, strided
    g_ptr,  # (B, N, N) dL/dP, strided (a broadcast gradient may have zero strides)
    u_ptr,  # (B, T + 1, N) fp32 row potentials saved by the forward, contiguous
    v_ptr,  # (B, T + 1, N) fp32 column potentials saved by the forward, contiguous
    dla_ptr,  # (B, N, N) output dL/dlog_alpha, contiguous, log_alpha's dtype
    stride_lb,  # log_alpha stride between batch elements
    stride_li,  # log_alpha stride between rows
    stride_lj,  # log_alpha stride between columns
    stride_gb,  # dL/dP stride between batch elements
    stride_gi,  # dL/dP stride between rows
    stride_gj,  # dL/dP stride between columns
    N,
    T,
    inv_tau,
    BLOCK: tl.constexpr,  # padded N (power of two >= 16)
):
    """The whole unrolled backward of one sample in registers (R = dL/dP * P):

    dK = R;  du^T = rowsum(R);  dv^T = colsum(R)
    for t = T..1:  Q = exp(K' + u^t + v^t):        dK -= dv^t_j Q_ij;   du^t_i -= sum_j Q_ij dv^t_j
                   Q' = exp(K' + u^t + v^(t-1)):   dK -= du^t_i Q'_ij;  dv^(t-1)_j = -sum_i Q'_ij du^t_i
    d log_alpha = dK / tau
    """
    b = _pid(0)
    rows = tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK)
    rmask = rows < N
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    pot_u = u_ptr + b * (T + 1) * N
    pot_v = v_ptr + b * (T + 1) * N
    k = _cost_tile(
        la_ptr + b * stride_lb, pot_u, rows, cols, N, stride_li, stride_lj, inv_tau, 0.0, 0, 0.0, False, False
    )
    g = tl.load(g_ptr + b * stride_gb + rows[:, None] * stride_gi + cols[None, :] * stride_gj, mask=mask, other=0.0)
    u_T = tl.load(pot_u + T * N + rows, mask=rmask, other=0.0)
    v_T = tl.load(pot_v + T * N + cols, mask=cmask, other=0.0)
    dk = g.to(tl.float32) * tl.exp((k + u_T[:, None]) + v_T[None, :])  # R = dL/dP * P
    du_direct = tl.sum(dk, axis=1)
    dv = tl.sum(dk, axis=0)
    for s in range(0, T):
        t = T - s
        x = k + tl.load(pot_u + t * N + rows, mask=rmask, other=0.0)[:, None]
        w = tl.exp(x + tl.load(pot_v + t * N + cols, mask=cmask, other=0.0)[None, :]) * dv[None, :]
        du = du_direct - tl.sum(w, axis=1)
        dk -= w
        w = tl.exp(x + tl.load(pot_v + (t - 1) * N + cols, mask=cmask, other=0.0)[None, :]) * du[:, None]
        dk -= w
        dv = -tl.sum(w, axis=0)
        du_direct = du_direct * 0.0  # the loss sees u^T directly, earlier u^t only through v^t
    tl.store(
        dla_ptr + b * N * N + rows[:, None] * N + cols[None, :], (dk * inv_tau).to(dla_ptr.dtype.element_ty), mask=mask
    )


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels. N > 64: one launch per half-step over (sample, block of rows or columns) programs.
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _sinkhorn_rowmax_kernel(
    la_ptr,  # (B, N, N) log_alpha, any float dtype, strided
    u_ptr,  # (B, T + 1, N) fp32 row potentials: slot 0 (the row shift u^0 = -max_j K) written here
    stride_lb,  # log_alpha stride between batch elements
    stride_li,  # log_alpha stride between rows
    stride_lj,  # log_alpha stride between columns
    N,
    T,
    tau,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Row shift of this program's rows: u^0_i = -max_j log_alpha_ij / tau."""
    b = _pid(0)
    rows = _pid(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    la_b = la_ptr + b * stride_lb
    mx = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    for c0 in range(0, N, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = rmask[:, None] & (cols < N)[None, :]
        k = tl.load(la_b + rows[:, None] * stride_li + cols[None, :] * stride_lj, mask=mask, other=float("-inf"))
        # Divided by tau (the core multiplies by 1 / tau): the multiply spilled 12 B here on sm_90
        # (attr_engine_kernels.aot).
        mx = tl.maximum(mx, tl.max(k.to(tl.float32) / tau, axis=1))
    tl.store(u_ptr + b * (T + 1) * N + rows, -mx, mask=rmask)


# ----------------------------------------------------------------------------------------------------------------
# Launchers (torch.library ops, so torch.compile traces through them) and autograd wiring
# ----------------------------------------------------------------------------------------------------------------


def _block_config(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for the register kernels: ~32 fp32 values of each N x N tile per thread."""
    block = max(16, triton.next_power_of_2(n))
    return block, max(1, min(16, block * block // 1024))


@triton_op("attr_engine::sinkhorn_fwd", mutates_args=())
def _sinkhorn_fwd_op(log_alpha: Tensor, n_iters: int, tau: float) -> tuple[Tensor, Tensor, Tensor]:
    batch, n, _ = log_alpha.shape
    p = torch.empty((batch, n, n), dtype=log_alpha.dtype, device=log_alpha.device)
    u_all = torch.empty((batch, n_iters + 1, n), dtype=torch.float32, device=log_alpha.device)
    v_all = torch.empty_like(u_all)
    if batch == 0:
        return p, u_all, v_all
    if n <= _MAX_REGISTER_N:
        block, warps = _block_config(n)
        wrap_triton(_sinkhorn_fwd_block_kernel)[(batch,)](
            log_alpha, p, u_all, v_all, *log_alpha.stride(), n, n_iters, 1.0 / tau, BLOCK=block, num_warps=warps
        )
    else:
        # The tiled core (attr_engine_kernels._sinkhorn_core), after the row shift u^0 of slot 0.
        v_all[:, 0].zero_()
        wrap_triton(_sinkhorn_rowmax_kernel)[(batch, triton.cdiv(n, core.OWN))](
            log_alpha, u_all, *log_alpha.stride(), n, n_iters, tau, BLOCK_R=core.OWN, BLOCK_C=core.STREAM
        )
        core.forward(core.Cost(log_alpha, 1.0 / tau), u_all, v_all, p)
    return p, u_all, v_all


@triton_op("attr_engine::sinkhorn_bwd", mutates_args=())
def _sinkhorn_bwd_op(grad_p: Tensor, log_alpha: Tensor, u_all: Tensor, v_all: Tensor, tau: float) -> Tensor:
    batch, n, _ = log_alpha.shape
    n_iters = u_all.shape[1] - 1
    dla = torch.empty((batch, n, n), dtype=log_alpha.dtype, device=log_alpha.device)
    if batch == 0:
        return dla
    if n <= _MAX_REGISTER_N:
        block, warps = _block_config(n)
        wrap_triton(_sinkhorn_bwd_block_kernel)[(batch,)](
            log_alpha,
            grad_p,
            u_all,
            v_all,
            dla,
            *log_alpha.stride(),
            *grad_p.stride(),
            n,
            n_iters,
            1.0 / tau,
            BLOCK=block,
            num_warps=warps,
        )
    else:
        # dK accumulates over 2T passes: in fp32, in the output itself when that is fp32.
        dk = dla if dla.dtype == torch.float32 else torch.empty((batch, n, n), dtype=torch.float32, device=dla.device)
        core.backward(core.Cost(log_alpha, 1.0 / tau), grad_p, None, u_all, v_all, dk, dla)
    return dla


def _sinkhorn_setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    log_alpha, _, tau = inputs
    _, u_all, v_all = output
    ctx.save_for_backward(log_alpha, u_all, v_all)
    ctx.tau = tau


def _sinkhorn_backward(ctx: Any, grad_p: Tensor, _grad_u: Tensor, _grad_v: Tensor) -> tuple[Tensor, None, None]:
    log_alpha, u_all, v_all = ctx.saved_tensors
    return torch.ops.attr_engine.sinkhorn_bwd(grad_p, log_alpha, u_all, v_all, ctx.tau), None, None


_sinkhorn_fwd_op.register_autograd(_sinkhorn_backward, setup_context=_sinkhorn_setup_context)


# ----------------------------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------------------------


def sinkhorn(log_alpha: Tensor, n_iters: int = 20, tau: float = 1.0, *, validate: bool = True) -> Tensor:
    """Batched log-domain Sinkhorn normalisation, differentiable w.r.t. ``log_alpha``.

    Same result as :func:`sinkhorn_reference` (X = log_alpha / tau; ``n_iters`` times: normalise rows, then columns, in
    the log domain; P = exp(X)) without keeping the iterates: the backward recomputes each step's weights from
    log_alpha and the saved (B, n_iters + 1, N) row and column potentials. Runs the fused Triton kernels when
    :func:`attr_engine_kernels._backend.use_triton` says so, the PyTorch reference otherwise.

    Args:
        log_alpha: (B, N, N) finite float scores (float32, float16, bfloat16 or float64), N >= 1.
        n_iters: number of (row, column) normalisation pairs, >= 1.
        tau: temperature, > 0; smaller is sharper (and needs more iterations to converge).
        validate: also check that log_alpha is finite (reads the data: a host-device synchronisation on a GPU;
            engine loops that validated their inputs once pass False).

    Returns:
        (B, N, N) P in the dtype of ``log_alpha`` (math in fp32, or float64 for float64 input). Columns sum to 1
        (the last half-step normalises them); rows sum to 1 once the iterations have converged.

    Raises:
        ValueError: log_alpha is not a finite float (B, N, N) tensor with N >= 1, n_iters < 1, or tau <= 0.
    """
    tau = _check_inputs(log_alpha, n_iters, tau, validate)
    if use_triton(log_alpha):
        return torch.ops.attr_engine.sinkhorn_fwd(log_alpha, n_iters, tau)[0]
    return _SinkhornPotentials.apply(log_alpha, n_iters, tau)


__all__ = ["sinkhorn", "sinkhorn_reference"]
