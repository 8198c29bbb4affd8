"""Batched log-domain Sinkhorn normalisation: log_alpha (B, N, N) -> doubly-stochastic P (B, N, N).

Definition (``sinkhorn_eager``): X = log_alpha / tau, then ``n_iters`` times X -= LSE over columns (each row sums to
one), X -= LSE over rows (each column sums to one); P = exp(X).

The fast paths run the same iterations in the dual (potentials) form. Writing K = log_alpha / tau, a row potential
u (B, N) and a column potential v (B, N) stand for the iterate log P = K + u[:, :, None] + v[:, None, :], so only
O(B * N) numbers change between half-steps and the N x N weights are recomputed from K whenever they are needed:

    u^t = -LSE_j(K + v^(t-1)),   v^t = -LSE_i(K + u^t),   v^0 = 0.

For rounding, K is first shifted by its row maxima (u^0 = -max_j K, which the first half-step absorbs exactly, so P
and its gradient are unchanged): the largest entry of every row of K' = K + u^0 is exactly 0, and the sums that
matter stay small. The potentials of every half-step are kept, (B, T + 1, N) each (slot 0: the row shift and v^0),
which is all the exact unrolled backward needs (R = dL/dP * P):

    dK = R;  du^T = rowsum(R);  dv^T = colsum(R)
    for t = T..1:  Q  = exp(K' + u^t + v^t)      (columns sum to 1)   dK -= dv^t[col] Q;   du^t -= Q dv^t
                   Q' = exp(K' + u^t + v^(t-1))  (rows sum to 1)      dK -= du^t[row] Q';  dv^(t-1) = -Q'^T du^t
    d log_alpha = dK / tau

The last half-step writes P = exp(x - m_j) / s_j straight from its column logsumexp (x = K' + u^T, m_j the column max,
s_j the column sum of exp(x - m_j)), so the columns of P sum to one even where v^T itself is rounded. Accuracy: the
potentials are O(max |log_alpha / tau|), so P carries a relative error of about fp32-eps times that spread (1e-7 at
spread 1, ~1e-3 at spread 1e6); the eager form, which keeps the normalised matrix, is the more accurate one there.

Paths: ``sinkhorn_eager`` (definition and gradcheck target), ``_SinkhornReference`` (pure PyTorch, batch-chunked,
recomputing backward) and two fused Triton designs, chosen by :func:`kernels._backend.use_triton`:

- N <= 64: one program per sample keeps the whole padded matrix in registers and runs every iteration (one launch
  forward, one backward); the matrix is read from memory once.
- N > 64, filling the GPU: one launch per half-step over (sample, block of 32 rows or columns) programs, the
  potentials in global memory between launches (a launch boundary is CUDA's only grid-wide barrier). At B = 32,
  N = 784 that is 32 x 25 = 800 programs per launch on an H200's 132 SMs (6 per SM), where one program per sample
  used 32 SMs. A half-step reads log_alpha once (B * N^2 * 4 bytes = 79 MB at fp32, ~20 us at the H200's
  4.8 TB/s), well above a launch's few microseconds, so the 2T + 1 forward and 2T + 1 backward launches stay
  bandwidth-bound; with one program per sample the same read ran at a quarter of the SMs' load bandwidth.
  Tiles are 32 x 64, 16 fp32 values per thread per temporary at 4 warps: no register spills
  (``python -m kernels.aot`` checks it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.library import triton_op, wrap_triton

from kernels._backend import tl, triton, use_triton
from kernels._tl_helpers import _lse, _lse_normaliser, _neg_lse, _online_lse, _pid, compute_dtype
from kernels.validate import check_int_at_least, check_positive, check_tensor

# The reference works on slabs of the batch so that its N x N temporaries stay ~16 MiB (fp32) whatever B is.
_CHUNK_ELEMENTS = 1 << 22
# Largest N whose whole (padded) matrix one program keeps in registers; larger N streams tiles. At N = 128 the
# backward's three live 128 x 128 fp32 tiles spill even at 16 warps (``python -m kernels.aot``), so 64 is the cap.
_MAX_REGISTER_N = 64
_OWN = 32  # rows (or columns) one program of a tiled pass owns
_STREAM = 64  # width of the tiles it streams over the other dimension


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


def sinkhorn_eager(log_alpha: Tensor, n_iters: int = 20, tau: float = 1.0) -> Tensor:
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


class _SinkhornReference(torch.autograd.Function):
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
    tau,
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
    k = k.to(tl.float32) / tau
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
def _k_tile(
    la_b,  # this sample's log_alpha, (N, N) strided
    u0_b,  # this sample's row shift u^0, (N,) fp32
    rows,  # (BLOCK_R,) row indices
    cols,  # (BLOCK_C,) column indices
    N,
    stride_li,
    stride_lj,
    tau,
):
    """K' = log_alpha / tau + u^0 over a (BLOCK_R, BLOCK_C) tile in fp32; -inf outside the matrix."""
    rmask = rows < N
    mask = rmask[:, None] & (cols < N)[None, :]
    k = tl.load(la_b + rows[:, None] * stride_li + cols[None, :] * stride_lj, mask=mask, other=float("-inf"))
    return k.to(tl.float32) / tau + tl.load(u0_b + rows, mask=rmask, other=0.0)[:, None]


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
    tau,
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
    k = _k_tile(la_ptr + b * stride_lb, pot_u, rows, cols, N, stride_li, stride_lj, tau)
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
        dla_ptr + b * N * N + rows[:, None] * N + cols[None, :], (dk / tau).to(dla_ptr.dtype.element_ty), mask=mask
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
        mx = tl.maximum(mx, tl.max(k.to(tl.float32) / tau, axis=1))
    tl.store(u_ptr + b * (T + 1) * N + rows, -mx, mask=rmask)


@triton.jit
def _sinkhorn_line_tile(
    la_b,  # this sample's log_alpha, (N, N) strided
    pot_u,  # this sample's row potentials, (T + 1, N) fp32
    other,  # the potential added along the streamed dimension, (N,) fp32
    own,  # (BLOCK_OWN,) indices of the lines this program owns
    stream,  # (BLOCK_STREAM,) indices of the streamed tile
    N,
    stride_li,
    stride_lj,
    tau,
    AXIS: tl.constexpr,  # 1: the program owns rows (tile (own, stream)); 0: it owns columns (tile (stream, own))
):
    """K' + other over one tile, oriented so that AXIS is the streamed (reduced) dimension."""
    if AXIS == 1:
        x = _k_tile(la_b, pot_u, own, stream, N, stride_li, stride_lj, tau)
    else:
        x = _k_tile(la_b, pot_u, stream, own, N, stride_li, stride_lj, tau)
    return x + tl.expand_dims(tl.load(other + stream, mask=stream < N, other=0.0), 1 - AXIS)


@triton.jit(do_not_specialize=["t"])
def _sinkhorn_half_step_kernel(
    la_ptr,  # (B, N, N) log_alpha, any float dtype, strided
    p_ptr,  # (B, N, N) output P, contiguous, log_alpha's dtype: written by the last v-step
    u_ptr,  # (B, T + 1, N) fp32 row potentials: slot 0 read; slot t written (u-step) or read (v-step)
    v_ptr,  # (B, T + 1, N) fp32 column potentials: slot t - 1 read (u-step) or slot t written (v-step)
    stride_lb,  # log_alpha stride between batch elements
    stride_li,  # log_alpha stride between rows
    stride_lj,  # log_alpha stride between columns
    N,
    T,
    t,  # half-step pair index, 1..T (runtime: one compiled kernel for every iteration)
    tau,
    AXIS: tl.constexpr,  # 1: u-step, the program owns rows; 0: v-step, it owns columns
    BLOCK_OWN: tl.constexpr,  # lines this program owns
    BLOCK_STREAM: tl.constexpr,  # width of the tiles it streams over the other dimension
):
    """One half-step for this program's lines, an online logsumexp over tiles of the other dimension:

        AXIS = 1 (u-step):  u^t_i = -LSE_j(K'_ij + v^(t-1)_j)
        AXIS = 0 (v-step):  v^t_j = -LSE_i(K'_ij + u^t_i);  at t = T also P_ij = exp(x_ij - m_j) / s_j, x = K' + u^T

    P is written from the column max m and sum s themselves, not through the rounded v^T: its columns sum to 1.
    One kernel for both directions (the row and column passes were two copies of this loop); each compiled variant
    is the code of one direction only.
    """
    b = _pid(0)
    own = _pid(1) * BLOCK_OWN + tl.arange(0, BLOCK_OWN)
    la_b = la_ptr + b * stride_lb
    pot_u = u_ptr + b * (T + 1) * N
    pot_v = v_ptr + b * (T + 1) * N
    if AXIS == 1:
        out, other = pot_u + t * N, pot_v + (t - 1) * N
    else:
        out, other = pot_v + t * N, pot_u + t * N
    mx = tl.full([BLOCK_OWN], float("-inf"), dtype=tl.float32)
    acc = tl.zeros([BLOCK_OWN], dtype=tl.float32)
    for s0 in range(0, N, BLOCK_STREAM):
        stream = s0 + tl.arange(0, BLOCK_STREAM)
        x = _sinkhorn_line_tile(la_b, pot_u, other, own, stream, N, stride_li, stride_lj, tau, AXIS)
        mx, acc = _online_lse(mx, acc, x, AXIS)
    tl.store(out + own, _neg_lse(mx, acc), mask=own < N)
    if AXIS == 0:
        if t == T:
            shift, inv_sum = _lse_normaliser(mx, acc)
            for s0 in range(0, N, BLOCK_STREAM):
                rows = s0 + tl.arange(0, BLOCK_STREAM)
                mask = (rows < N)[:, None] & (own < N)[None, :]
                x = _sinkhorn_line_tile(la_b, pot_u, other, own, rows, N, stride_li, stride_lj, tau, AXIS)
                p = tl.exp(x - shift[None, :]) * inv_sum[None, :]
                tl.store(p_ptr + b * N * N + rows[:, None] * N + own[None, :], p.to(p_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sinkhorn_bwd_init_kernel(
    la_ptr,  # (B, N, N) log_alpha, any float dtype, strided
    g_ptr,  # (B, N, N) dL/dP, strided (a broadcast gradient may have zero strides)
    u_ptr,  # (B, T + 1, N) fp32 row potentials saved by the forward
    v_ptr,  # (B, T + 1, N) fp32 column potentials saved by the forward
    dv_ptr,  # (B, N) fp32 out: dv^T = colsum(R), R = dL/dP * P
    stride_lb,  # log_alpha stride between batch elements
    stride_li,  # log_alpha stride between rows
    stride_lj,  # log_alpha stride between columns
    stride_gb,  # dL/dP stride between batch elements
    stride_gi,  # dL/dP stride between rows
    stride_gj,  # dL/dP stride between columns
    N,
    T,
    tau,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Start of the tiled backward for this program's columns: dv^T_j = sum_i R_ij, R = dL/dP * P."""
    b = _pid(0)
    cols = _pid(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < N
    la_b = la_ptr + b * stride_lb
    g_b = g_ptr + b * stride_gb
    pot_u = u_ptr + b * (T + 1) * N
    v_T = tl.load(v_ptr + b * (T + 1) * N + T * N + cols, mask=cmask, other=0.0)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for r0 in range(0, N, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        rmask = rows < N
        x = _k_tile(la_b, pot_u, rows, cols, N, stride_li, stride_lj, tau)
        x += tl.load(pot_u + T * N + rows, mask=rmask, other=0.0)[:, None]
        mask = rmask[:, None] & cmask[None, :]
        g = tl.load(g_b + rows[:, None] * stride_gi + cols[None, :] * stride_gj, mask=mask, other=0.0)
        acc += tl.sum(g.to(tl.float32) * tl.exp(x + v_T[None, :]), axis=0)
    tl.store(dv_ptr + b * N + cols, acc, mask=cmask)


# The two adjoint passes below stay two kernels: the row pass also starts dK' from dL/dP at t = T, the column pass
# also writes d log_alpha at t = 1, and they stream different potentials; merged behind a constexpr they would be two
# bodies under one signature (the forward half-steps share one body, so they are one kernel).
@triton.jit(do_not_specialize=["t"])
def _sinkhorn_bwd_rows_kernel(
    la_ptr,  # (B, N, N) log_alpha, any float dtype, strided
    g_ptr,  # (B, N, N) dL/dP, strided
    u_ptr,  # (B, T + 1, N) fp32 row potentials saved by the forward
    v_ptr,  # (B, T + 1, N) fp32 column potentials saved by the forward
    dk_ptr,  # (B, N, N) fp32 scratch accumulating dL/dK', contiguous: this program's rows
    du_ptr,  # (B, N) fp32 out: adjoint du^t of this program's rows
    dv_ptr,  # (B, N) fp32 adjoint dv^t, read
    stride_lb,  # log_alpha stride between batch elements
    stride_li,  # log_alpha stride between rows
    stride_lj,  # log_alpha stride between columns
    stride_gb,  # dL/dP stride between batch elements
    stride_gi,  # dL/dP stride between rows
    stride_gj,  # dL/dP stride between columns
    N,
    T,
    t,  # half-step pair index, T..1
    tau,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """v-step adjoint: du^t_i = [t = T] rowsum(R)_i - sum_j Q_ij dv^t_j and dK' -= dv^t_j Q_ij, Q = exp(K'+u^t+v^t).

    At t = T, Q is P itself, so R - Q dv = Q (dL/dP - dv) starts dK'.
    """
    b = _pid(0)
    rows = _pid(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    la_b = la_ptr + b * stride_lb
    g_b = g_ptr + b * stride_gb
    pot_u = u_ptr + b * (T + 1) * N
    pot_v = v_ptr + b * (T + 1) * N
    dk_b = dk_ptr + b * N * N
    u_t = tl.load(pot_u + t * N + rows, mask=rmask, other=0.0)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for c0 in range(0, N, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cmask = cols < N
        mask = rmask[:, None] & cmask[None, :]
        tile = rows[:, None] * N + cols[None, :]
        x = _k_tile(la_b, pot_u, rows, cols, N, stride_li, stride_lj, tau) + u_t[:, None]
        q = tl.exp(x + tl.load(pot_v + t * N + cols, mask=cmask, other=0.0)[None, :])
        dv = tl.load(dv_ptr + b * N + cols, mask=cmask, other=0.0)
        if t == T:
            g = tl.load(g_b + rows[:, None] * stride_gi + cols[None, :] * stride_gj, mask=mask, other=0.0)
            w = q * (g.to(tl.float32) - dv[None, :])
            dk = w
        else:
            w = -q * dv[None, :]
            dk = tl.load(dk_b + tile, mask=mask, other=0.0) + w
        tl.store(dk_b + tile, dk, mask=mask)
        acc += tl.sum(w, axis=1)
    tl.store(du_ptr + b * N + rows, acc, mask=rmask)


@triton.jit(do_not_specialize=["t"])
def _sinkhorn_bwd_cols_kernel(
    la_ptr,  # (B, N, N) log_alpha, any float dtype, strided
    u_ptr,  # (B, T + 1, N) fp32 row potentials saved by the forward
    v_ptr,  # (B, T + 1, N) fp32 column potentials saved by the forward
    dk_ptr,  # (B, N, N) fp32 scratch accumulating dL/dK': this program's columns
    du_ptr,  # (B, N) fp32 adjoint du^t, read
    dv_ptr,  # (B, N) fp32 out: adjoint dv^(t-1) of this program's columns
    dla_ptr,  # (B, N, N) output dL/dlog_alpha, contiguous, log_alpha's dtype: written at t = 1
    stride_lb,  # log_alpha stride between batch elements
    stride_li,  # log_alpha stride between rows
    stride_lj,  # log_alpha stride between columns
    N,
    T,
    t,  # half-step pair index, T..1
    tau,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """u-step adjoint: dv^(t-1)_j = -sum_i Q'_ij du^t_i and dK' -= du^t_i Q'_ij, Q' = exp(K' + u^t + v^(t-1))."""
    b = _pid(0)
    cols = _pid(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < N
    la_b = la_ptr + b * stride_lb
    pot_u = u_ptr + b * (T + 1) * N
    dk_b = dk_ptr + b * N * N
    v_prev = tl.load(v_ptr + b * (T + 1) * N + (t - 1) * N + cols, mask=cmask, other=0.0)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for r0 in range(0, N, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        rmask = rows < N
        mask = rmask[:, None] & cmask[None, :]
        tile = rows[:, None] * N + cols[None, :]
        x = _k_tile(la_b, pot_u, rows, cols, N, stride_li, stride_lj, tau)
        x += tl.load(pot_u + t * N + rows, mask=rmask, other=0.0)[:, None]
        w = tl.exp(x + v_prev[None, :]) * tl.load(du_ptr + b * N + rows, mask=rmask, other=0.0)[:, None]
        dk = tl.load(dk_b + tile, mask=mask, other=0.0) - w
        acc -= tl.sum(w, axis=0)
        if t == 1:
            tl.store(dla_ptr + b * N * N + tile, (dk / tau).to(dla_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(dk_b + tile, dk, mask=mask)
    tl.store(dv_ptr + b * N + cols, acc, mask=cmask)


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
            log_alpha, p, u_all, v_all, *log_alpha.stride(), n, n_iters, tau, BLOCK=block, num_warps=warps
        )
    else:
        # One launch per half-step over (sample, block of rows or columns): see "Filling the GPU" above.
        grid = (batch, triton.cdiv(n, _OWN))
        strides = log_alpha.stride()
        v_all[:, 0].zero_()
        wrap_triton(_sinkhorn_rowmax_kernel)[grid](
            log_alpha, u_all, *strides, n, n_iters, tau, BLOCK_R=_OWN, BLOCK_C=_STREAM
        )
        blocks = dict(BLOCK_OWN=_OWN, BLOCK_STREAM=_STREAM)
        for t in range(1, n_iters + 1):
            for axis in (1, 0):  # the u-step (rows), then the v-step (columns)
                wrap_triton(_sinkhorn_half_step_kernel)[grid](
                    log_alpha, p, u_all, v_all, *strides, n, n_iters, t, tau, AXIS=axis, **blocks
                )
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
            tau,
            BLOCK=block,
            num_warps=warps,
        )
    else:
        # dK accumulates over 2T passes: in fp32, in the output itself when that is fp32.
        dk = dla if dla.dtype == torch.float32 else torch.empty((batch, n, n), dtype=torch.float32, device=dla.device)
        du = torch.empty((batch, n), dtype=torch.float32, device=dla.device)
        dv = torch.empty_like(du)
        grid = (batch, triton.cdiv(n, _OWN))
        la_strides, g_strides = log_alpha.stride(), grad_p.stride()
        wrap_triton(_sinkhorn_bwd_init_kernel)[grid](
            log_alpha, grad_p, u_all, v_all, dv, *la_strides, *g_strides, n, n_iters, tau,
            BLOCK_R=_STREAM, BLOCK_C=_OWN,
        )  # fmt: skip
        for t in range(n_iters, 0, -1):
            wrap_triton(_sinkhorn_bwd_rows_kernel)[grid](
                log_alpha, grad_p, u_all, v_all, dk, du, dv, *la_strides, *g_strides, n, n_iters, t, tau,
                BLOCK_R=_OWN, BLOCK_C=_STREAM,
            )  # fmt: skip
            wrap_triton(_sinkhorn_bwd_cols_kernel)[grid](
                log_alpha, u_all, v_all, dk, du, dv, dla, *la_strides, n, n_iters, t, tau,
                BLOCK_R=_STREAM, BLOCK_C=_OWN,
            )  # fmt: skip
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

    Same result as :func:`sinkhorn_eager` (X = log_alpha / tau; ``n_iters`` times: normalise rows, then columns, in
    the log domain; P = exp(X)) without keeping the iterates: the backward recomputes each step's weights from
    log_alpha and the saved (B, n_iters + 1, N) row and column potentials. Runs the fused Triton kernels when
    :func:`kernels._backend.use_triton` says so, the PyTorch reference otherwise.

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
    return _SinkhornReference.apply(log_alpha, n_iters, tau)


__all__ = ["sinkhorn", "sinkhorn_eager"]
