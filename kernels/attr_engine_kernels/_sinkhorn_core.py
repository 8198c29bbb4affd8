"""The tiled Sinkhorn core that :func:`.sinkhorn.sinkhorn` and :func:`.soft_rank.soft_topk_masks` launch.

A cost K (B, N, N) is normalised in the dual (potentials) form: log P = K' + u[:, :, None] + v[:, None, :], with

    u^t = -LSE_c(K' + v^(t-1)),   v^t = -LSE_r(K' + u^t),   t = 1..T,   v^0 = 0.

Conventions (both ops):

- Potentials ``u``, ``v``: (B, T + 1, N) fp32. Slot 0 is the start: u^0 the row shift K' = K + u^0 (the dense op
  shifts each row's maximum to 0; the sorter's cost needs no shift and leaves it 0), v^0 = 0. Slot t holds u^t, v^t.
- Rows are indexed r (the sorter's rank slots), columns c (its cells). A program owns ``BLOCK_OWN`` lines and streams
  tiles of ``BLOCK_STREAM`` over the other dimension; the backward kernels name their tile ``BLOCK_R x BLOCK_C``.
- The cost has two sources, chosen by the ``SCORES`` constexpr of every kernel (the one place they differ):
  ``SCORES=False``: K = log_alpha / tau read from a strided (B, N, N) tensor;
  ``SCORES=True``: K[r, c] = (-(s_c - a_r)^2 + noise * G[r, c]) / tau from scores s (B, N), anchors
  a_r = 1 - r * anchor_step and Philox Gumbel noise G regenerated at counter r * N + c, so K is never stored.

Backward of the unrolled iterations (R = dL/dP * P, Q^t = exp(K' + u^t + v^t), Q'^t = exp(K' + u^t + v^(t-1))):

    dK = R;  du^T = rowsum(R);  dv^T = colsum(R)                                   (direct kernel, both axes)
    for t = T..1:  du^t = [t = T] du^T - Q^t dv^t                                 (rows kernel)
                   dv^(t-1) = -Q'^t^T du^t;  dK -= dv^t_c Q^t + du^t_r Q'^t          (columns kernel)

The columns kernel owns whole columns, so it applies both half-steps' dK terms of its columns: the dense op keeps
dK (B, N, N) and writes d log_alpha = dK / tau at t = 1; the sorter contracts dK on the fly with
dK[r, c] / ds_c = -2 (s_c - a_r) / tau into a (B, N) accumulator and writes ds at t = 1. Weights are computed as
exp(min(x, 0)): every entry of Q, Q' and P is <= 1, and the clamp keeps rounded potentials from overflowing.
Launch counts and the arithmetic of the decomposition: benches/README.md ("Sinkhorn core").
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor
from torch.library import wrap_triton

from attr_engine_kernels._backend import tl, triton
from attr_engine_kernels._tl_helpers import _lse_normaliser, _neg_lse, _online_lse, _pid

OWN = 32  # lines one program owns
STREAM = 64  # width of the tiles it streams over the other dimension
# The direct kernels of the sorter also hold a (W^T dM) tile from tl.dot; they stream thinner tiles of 16 lines at
# 4 warps, the configuration ``python -m attr_engine_kernels.aot`` finds spill-free on sm_80 and sm_90.
THIN = 16


@dataclass(frozen=True)
class Cost:
    """Where the kernels read K from, and the scalars of that source.

    ``src`` is log_alpha (B, N, N) when ``scores`` is False, the sorter's scores (B, N) fp32 when it is True.
    """

    src: Tensor
    inv_tau: float
    scores: bool = False
    anchor_step: float = 0.0
    seed: int = 0
    noise: float = 0.0

    def args(self) -> tuple[int | float, ...]:
        """(stride_xb, stride_xr, stride_xc, inv_tau, anchor_step, seed, noise): the cost arguments of every kernel."""
        strides: tuple[int, ...] = (self.src.stride(0), 0, self.src.stride(1)) if self.scores else self.src.stride()
        return (*strides, self.inv_tau, self.anchor_step, self.seed, self.noise)

    def flags(self) -> dict[str, bool]:
        return {"SCORES": self.scores, "HAS_NOISE": self.scores and self.noise > 0}


# ----------------------------------------------------------------------------------------------------------------
# Tiles
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _gumbel(seed, offsets):
    """Philox Gumbel noise for integer ``offsets`` under ``seed``: the same numbers in the forward and backward."""
    r = tl.maximum(tl.rand(seed, offsets), 1e-10)
    return -tl.log(-tl.log(r))


@triton.jit
def _cost_tile(
    src_b,  # this sample's log_alpha (N, N) strided, or its scores (N,)
    pot_u,  # this sample's row potentials (T + 1, N) fp32: slot 0, the row shift u^0, is added to log_alpha / tau
    rows,  # (BLOCK_R,) row indices
    cols,  # (BLOCK_C,) column indices
    N,
    stride_xr,  # log_alpha's row stride (0 for scores)
    stride_xc,  # log_alpha's column stride, or the scores' stride
    inv_tau,
    anchor_step,  # scores: a_r = 1 - r * anchor_step
    seed,  # scores: this sample's Philox seed
    noise,  # scores: Gumbel scale
    SCORES: tl.constexpr,
    HAS_NOISE: tl.constexpr,
):
    """K' over a (BLOCK_R, BLOCK_C) tile in fp32; -inf outside the N x N matrix so padded lanes drop out of sums."""
    rmask = rows < N
    mask = rmask[:, None] & (cols < N)[None, :]
    if SCORES:
        s = tl.load(src_b + cols * stride_xc, mask=cols < N, other=0.0).to(tl.float32)
        d = s[None, :] - (1.0 - rows.to(tl.float32) * anchor_step)[:, None]
        k = -d * d
        if HAS_NOISE:
            k += noise * _gumbel(seed, rows[:, None] * N + cols[None, :])
        k = tl.where(mask, k * inv_tau, float("-inf"))
    else:
        k = tl.load(src_b + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=float("-inf"))
        k = k.to(tl.float32) * inv_tau + tl.load(pot_u + rows, mask=rmask, other=0.0)[:, None]
    return k


@triton.jit
def _line_tile(
    src_b, pot_u, other, own, stream, N, stride_xr, stride_xc, inv_tau, anchor_step, seed, noise,
    SCORES: tl.constexpr, HAS_NOISE: tl.constexpr,
    AXIS: tl.constexpr,  # 1: the program owns rows (tile (own, stream)); 0: it owns columns (tile (stream, own))
):  # fmt: skip
    """K' + other over one tile, ``other`` (N,) the potential along the streamed (reduced) dimension AXIS."""
    if AXIS == 1:
        x = _cost_tile(src_b, pot_u, own, stream, N, stride_xr, stride_xc, inv_tau, anchor_step, seed, noise,
                       SCORES, HAS_NOISE)  # fmt: skip
    else:
        x = _cost_tile(src_b, pot_u, stream, own, N, stride_xr, stride_xc, inv_tau, anchor_step, seed, noise,
                       SCORES, HAS_NOISE)  # fmt: skip
    return x + tl.expand_dims(tl.load(other + stream, mask=stream < N, other=0.0), 1 - AXIS)


@triton.jit
def _line_lse(
    src_b, pot_u, other, own, N, stride_xr, stride_xc, inv_tau, anchor_step, seed, noise,
    SCORES: tl.constexpr, HAS_NOISE: tl.constexpr, AXIS: tl.constexpr,
    BLOCK_OWN: tl.constexpr, BLOCK_STREAM: tl.constexpr,
):  # fmt: skip
    """Streaming logsumexp pair (max, sum) of :func:`_line_tile` along AXIS over every tile of the owned lines."""
    run_max = tl.full([BLOCK_OWN], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_OWN], tl.float32)
    for s0 in range(0, N, BLOCK_STREAM):
        stream = s0 + tl.arange(0, BLOCK_STREAM)
        x = _line_tile(src_b, pot_u, other, own, stream, N, stride_xr, stride_xc, inv_tau, anchor_step, seed, noise,
                       SCORES, HAS_NOISE, AXIS)  # fmt: skip
        run_max, run_sum = _online_lse(run_max, run_sum, x, AXIS)
    return run_max, run_sum


@triton.jit
def _grad_tile(
    g_b,  # this sample's dL/dP (N, N) strided, or its mask gradient dM (S, N)
    w_ptr,  # scores: prefix weights W (S, N) fp32 contiguous, dL/dP = W^T dM
    rows,
    cols,
    N,
    S,
    stride_gr,  # dL/dP's row stride, or dM's stride between fractions
    stride_gc,  # dL/dP's column stride, or dM's stride between cells
    SCORES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """dL/dP over a (BLOCK_R, BLOCK_C) tile in fp32: loaded, or (W^T dM)[r, c] summed over fraction tiles."""
    if SCORES:
        g = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
        for s0 in range(0, S, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            w_t = tl.load(
                w_ptr + offs_s[None, :] * N + rows[:, None], mask=(offs_s[None, :] < S) & (rows[:, None] < N), other=0.0
            )
            gm_ok = (offs_s[:, None] < S) & (cols[None, :] < N)
            gm = tl.load(g_b + offs_s[:, None] * stride_gr + cols[None, :] * stride_gc, mask=gm_ok, other=0.0)
            g += tl.dot(w_t, gm, input_precision="ieee")
    else:
        mask = (rows < N)[:, None] & (cols < N)[None, :]
        g = tl.load(g_b + rows[:, None] * stride_gr + cols[None, :] * stride_gc, mask=mask, other=0.0)
        g = g.to(tl.float32)
    return g


@triton.jit
def _weights(x):
    """exp(x) for an entry known to be <= 1 (of Q, Q' or P): clamped so a rounded potential cannot overflow it."""
    return tl.exp(tl.minimum(x, 0.0))


# ----------------------------------------------------------------------------------------------------------------
# Forward: one launch per half-step
# ----------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["t"])
def _half_step_kernel(
    src_ptr,  # log_alpha (B, N, N) strided, or scores (B, N)
    p_ptr,  # (B, N, N) output P, contiguous, log_alpha's dtype: written by the last v-step (SCORES False only)
    u_ptr,  # (B, T + 1, N) fp32 row potentials: slot t written (AXIS = 1) or read (AXIS = 0)
    v_ptr,  # (B, T + 1, N) fp32 column potentials: slot t - 1 read (AXIS = 1) or slot t written (AXIS = 0)
    N,
    T,
    t,  # half-step pair index, 1..T (runtime: one compiled kernel for every iteration)
    stride_xb,  # cost source stride between samples
    stride_xr,  # log_alpha's row stride (0 for scores)
    stride_xc,  # log_alpha's column stride, or the scores' stride
    inv_tau,
    anchor_step,
    seed,  # Philox seed of sample 0; sample b uses seed + b
    noise,
    SCORES: tl.constexpr,
    HAS_NOISE: tl.constexpr,
    AXIS: tl.constexpr,  # 1: u-step, the program owns rows; 0: v-step, it owns columns
    BLOCK_OWN: tl.constexpr,
    BLOCK_STREAM: tl.constexpr,
):
    """One half-step for this program's lines, an online logsumexp over tiles of the other dimension:

        AXIS = 1 (u-step):  u^t_r = -LSE_c(K'_rc + v^(t-1)_c)
        AXIS = 0 (v-step):  v^t_c = -LSE_r(K'_rc + u^t_r)
        dense, AXIS = 0, t = T:  also P_rc = exp(x_rc - m_c) / s_c,  x = K' + u^T

    P is written from the column max m and sum s themselves, not through the rounded v^T: its columns sum to 1.
    """
    b = _pid(0)
    own = _pid(1) * BLOCK_OWN + tl.arange(0, BLOCK_OWN)
    src_b = src_ptr + b * stride_xb
    pot_u = u_ptr + b * (T + 1) * N
    pot_v = v_ptr + b * (T + 1) * N
    if AXIS == 1:
        out, other = pot_u + t * N, pot_v + (t - 1) * N
    else:
        out, other = pot_v + t * N, pot_u + t * N
    mx, acc = _line_lse(src_b, pot_u, other, own, N, stride_xr, stride_xc, inv_tau, anchor_step, seed + b, noise,
                        SCORES, HAS_NOISE, AXIS, BLOCK_OWN, BLOCK_STREAM)  # fmt: skip
    tl.store(out + own, _neg_lse(mx, acc), mask=own < N)
    if not SCORES and AXIS == 0:
        if t == T:
            shift, inv_sum = _lse_normaliser(mx, acc)
            for s0 in range(0, N, BLOCK_STREAM):
                rows = s0 + tl.arange(0, BLOCK_STREAM)
                mask = (rows < N)[:, None] & (own < N)[None, :]
                x = _line_tile(src_b, pot_u, other, own, rows, N, stride_xr, stride_xc, inv_tau, anchor_step,
                               seed + b, noise, SCORES, HAS_NOISE, AXIS)  # fmt: skip
                p = tl.exp(x - shift[None, :]) * inv_sum[None, :]
                tl.store(p_ptr + b * N * N + rows[:, None] * N + own[None, :], p.to(p_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------------
# Backward: the direct term, then per pair t = T..1 a rows and a columns launch
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _bwd_direct_kernel(
    src_ptr,  # log_alpha (B, N, N) strided, or scores (B, N)
    g_ptr,  # dL/dP (B, N, N) strided (a broadcast gradient may have zero strides), or dM (B, S, N)
    w_ptr,  # scores: prefix weights W (S, N) fp32 contiguous (unused for log_alpha)
    u_ptr,  # (B, T + 1, N) fp32 row potentials saved by the forward
    v_ptr,  # (B, T + 1, N) fp32 column potentials saved by the forward
    line_ptr,  # out (B, N) fp32: du^T = rowsum(R) (AXIS = 1) or dv^T = colsum(R) (AXIS = 0)
    dk_ptr,  # out (AXIS = 0): dense dK = R (B, N, N) fp32 contiguous; scores: acc_c = sum_r R_rc (s_c - a_r), (B, N)
    N,
    S,  # fractions of dM (1 for dL/dP)
    T,
    stride_gb,
    stride_gr,
    stride_gc,
    stride_xb,
    stride_xr,
    stride_xc,
    inv_tau,
    anchor_step,
    seed,
    noise,
    SCORES: tl.constexpr,
    HAS_NOISE: tl.constexpr,
    AXIS: tl.constexpr,  # 1: the program owns BLOCK_R rows; 0: it owns BLOCK_C columns
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """The direct term R = dL/dP * P, P = exp(K' + u^T + v^T), summed over this program's lines (see module doc)."""
    b = _pid(0)
    src_b = src_ptr + b * stride_xb
    g_b = g_ptr + b * stride_gb
    pot_u = u_ptr + b * (T + 1) * N
    pot_v = v_ptr + b * (T + 1) * N + T * N
    if AXIS == 1:
        rows = _pid(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        own = rows
        u_last = tl.load(pot_u + T * N + rows, mask=rows < N, other=0.0)
        line = tl.zeros([BLOCK_R], tl.float32)
    else:
        cols = _pid(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        own = cols
        v_last = tl.load(pot_v + cols, mask=cols < N, other=0.0)
        line = tl.zeros([BLOCK_C], tl.float32)
        line_a = tl.zeros([BLOCK_C], tl.float32)
    for s0 in range(0, N, BLOCK_C if AXIS == 1 else BLOCK_R):
        if AXIS == 1:
            cols = s0 + tl.arange(0, BLOCK_C)
            v_last = tl.load(pot_v + cols, mask=cols < N, other=0.0)
        else:
            rows = s0 + tl.arange(0, BLOCK_R)
            u_last = tl.load(pot_u + T * N + rows, mask=rows < N, other=0.0)
        k = _cost_tile(src_b, pot_u, rows, cols, N, stride_xr, stride_xc, inv_tau, anchor_step, seed + b, noise,
                       SCORES, HAS_NOISE)  # fmt: skip
        r = _grad_tile(g_b, w_ptr, rows, cols, N, S, stride_gr, stride_gc, SCORES, BLOCK_R, BLOCK_C, BLOCK_S)
        r = r * _weights(k + u_last[:, None] + v_last[None, :])
        line += tl.sum(r, axis=AXIS)
        if AXIS == 0:
            if SCORES:
                line_a += tl.sum(r * (1.0 - rows.to(tl.float32) * anchor_step)[:, None], axis=0)
            else:
                mask = (rows < N)[:, None] & (cols < N)[None, :]
                tl.store(dk_ptr + b * N * N + rows[:, None] * N + cols[None, :], r, mask=mask)
    tl.store(line_ptr + b * N + own, line, mask=own < N)
    if SCORES and AXIS == 0:
        s = tl.load(src_b + own * stride_xc, mask=own < N, other=0.0).to(tl.float32)
        tl.store(dk_ptr + b * N + own, s * line - line_a, mask=own < N)


@triton.jit(do_not_specialize=["t"])
def _bwd_rows_kernel(
    src_ptr,  # log_alpha (B, N, N) strided, or scores (B, N)
    u_ptr,  # (B, T + 1, N) fp32 row potentials saved by the forward
    v_ptr,  # (B, T + 1, N) fp32 column potentials saved by the forward
    du_ptr,  # (B, N) fp32 adjoint of u^t: rowsum(R) on entry at t = T, overwritten with du^t
    dv_ptr,  # (B, N) fp32 adjoint dv^t, read
    N,
    T,
    t,  # half-step pair index, T..1
    stride_xb,
    stride_xr,
    stride_xc,
    inv_tau,
    anchor_step,
    seed,
    noise,
    SCORES: tl.constexpr,
    HAS_NOISE: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rows this program owns
    BLOCK_C: tl.constexpr,  # columns per streamed tile
):
    """v-step adjoint of this program's rows: du^t_r = [t = T] du^T_r - sum_c Q_rc dv^t_c, Q = exp(K' + u^t + v^t)."""
    b = _pid(0)
    rows = _pid(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    src_b = src_ptr + b * stride_xb
    pot_u = u_ptr + b * (T + 1) * N
    pot_v = v_ptr + b * (T + 1) * N + t * N
    u_t = tl.load(pot_u + t * N + rows, mask=rows < N, other=0.0)
    acc = tl.zeros([BLOCK_R], tl.float32)
    for c0 in range(0, N, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        k = _cost_tile(src_b, pot_u, rows, cols, N, stride_xr, stride_xc, inv_tau, anchor_step, seed + b, noise,
                       SCORES, HAS_NOISE)  # fmt: skip
        q = _weights(k + u_t[:, None] + tl.load(pot_v + cols, mask=cols < N, other=0.0)[None, :])
        acc += tl.sum(q * tl.load(dv_ptr + b * N + cols, mask=cols < N, other=0.0)[None, :], axis=1)
    base = tl.load(du_ptr + b * N + rows, mask=(rows < N) & (t == T), other=0.0)
    tl.store(du_ptr + b * N + rows, base - acc, mask=rows < N)


@triton.jit(do_not_specialize=["t"])
def _bwd_cols_kernel(
    src_ptr,  # log_alpha (B, N, N) strided, or scores (B, N)
    u_ptr,  # (B, T + 1, N) fp32 row potentials saved by the forward
    v_ptr,  # (B, T + 1, N) fp32 column potentials saved by the forward
    du_ptr,  # (B, N) fp32 adjoint du^t, read
    dv_ptr,  # (B, N) fp32 adjoint: dv^t on entry, dv^(t-1) on exit, this program's columns
    dk_ptr,  # dense: dK (B, N, N) fp32 contiguous, this program's columns; scores: the (B, N) accumulator acc
    out_ptr,  # written at t = 1: dense d log_alpha (B, N, N) contiguous in its dtype; scores ds (B, N) fp32
    N,
    T,
    t,  # half-step pair index, T..1
    stride_xb,
    stride_xr,
    stride_xc,
    inv_tau,
    anchor_step,
    seed,
    noise,
    SCORES: tl.constexpr,
    HAS_NOISE: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rows per streamed tile
    BLOCK_C: tl.constexpr,  # columns this program owns
):
    """u-step adjoint and both dK terms of pair t for this program's columns, Q' = exp(K' + u^t + v^(t-1)):

    dv^(t-1)_c = -sum_r Q'_rc du^t_r;  dK_rc -= w_rc = dv^t_c Q_rc + du^t_r Q'_rc
    dense:  dK updated in place; at t = 1 d log_alpha = dK / tau is written instead
    scores: acc_c -= sum_r w_rc (s_c - a_r);  at t = 1 ds_c = -2 / tau * acc_c
    """
    b = _pid(0)
    cols = _pid(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < N
    src_b = src_ptr + b * stride_xb
    pot_u = u_ptr + b * (T + 1) * N
    pot_v = v_ptr + b * (T + 1) * N
    v_t = tl.load(pot_v + t * N + cols, mask=cmask, other=0.0)
    v_prev = tl.load(pot_v + (t - 1) * N + cols, mask=cmask, other=0.0)
    dv = tl.load(dv_ptr + b * N + cols, mask=cmask, other=0.0)
    qp_du = tl.zeros([BLOCK_C], tl.float32)
    w_sum = tl.zeros([BLOCK_C], tl.float32)
    w_a = tl.zeros([BLOCK_C], tl.float32)
    for r0 in range(0, N, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        rmask = rows < N
        du = tl.load(du_ptr + b * N + rows, mask=rmask, other=0.0)
        x = _cost_tile(src_b, pot_u, rows, cols, N, stride_xr, stride_xc, inv_tau, anchor_step, seed + b, noise,
                       SCORES, HAS_NOISE)  # fmt: skip
        x += tl.load(pot_u + t * N + rows, mask=rmask, other=0.0)[:, None]
        qp = _weights(x + v_prev[None, :]) * du[:, None]
        w = _weights(x + v_t[None, :]) * dv[None, :] + qp
        qp_du += tl.sum(qp, axis=0)
        if SCORES:
            w_sum += tl.sum(w, axis=0)
            w_a += tl.sum(w * (1.0 - rows.to(tl.float32) * anchor_step)[:, None], axis=0)
        else:
            mask = rmask[:, None] & cmask[None, :]
            tile = b * N * N + rows[:, None] * N + cols[None, :]
            dk = tl.load(dk_ptr + tile, mask=mask, other=0.0) - w
            if t == 1:
                tl.store(out_ptr + tile, (dk * inv_tau).to(out_ptr.dtype.element_ty), mask=mask)
            else:
                tl.store(dk_ptr + tile, dk, mask=mask)
    tl.store(dv_ptr + b * N + cols, -qp_du, mask=cmask)
    if SCORES:
        s = tl.load(src_b + cols * stride_xc, mask=cmask, other=0.0).to(tl.float32)
        acc = tl.load(dk_ptr + b * N + cols, mask=cmask, other=0.0) - (s * w_sum - w_a)
        tl.store(dk_ptr + b * N + cols, acc, mask=cmask)
        tl.store(out_ptr + b * N + cols, acc * (-2.0 * inv_tau), mask=cmask & (t == 1))


# ----------------------------------------------------------------------------------------------------------------
# Launch sequences (called inside the ops' torch.library launchers)
# ----------------------------------------------------------------------------------------------------------------


def forward(cost: Cost, u_all: Tensor, v_all: Tensor, p: Tensor) -> None:
    """Run the T half-step pairs: fills slots 1..T of ``u_all`` and ``v_all`` (B, T + 1, N), whose slot 0 (the row
    shift, v^0 = 0) the caller has set; the dense op's last v-step also writes P (B, N, N) into ``p``."""
    batch, slots, n = u_all.shape
    n_iters = slots - 1
    grid = (batch, triton.cdiv(n, OWN))
    for t in range(1, n_iters + 1):
        for axis in (1, 0):  # the u-step (rows), then the v-step (columns)
            wrap_triton(_half_step_kernel)[grid](
                cost.src, p, u_all, v_all, n, n_iters, t, *cost.args(), **cost.flags(), AXIS=axis,
                BLOCK_OWN=OWN, BLOCK_STREAM=STREAM,
            )  # fmt: skip


def backward(
    cost: Cost, grad: Tensor, weights: Tensor | None, u_all: Tensor, v_all: Tensor, dk: Tensor, out: Tensor
) -> None:
    """The unrolled backward from the saved potentials (B, T + 1, N) into ``out``.

    grad: dL/dP (B, N, N) for log_alpha, dM (B, S, N) fp32 contiguous for scores (then ``weights`` W (S, N) fp32).
    dk: dense dK scratch (B, N, N) fp32 (may be ``out`` itself when that is fp32), or the sorter's (B, N) fp32
    accumulator. out: d log_alpha (B, N, N), or ds (B, N) fp32.
    """
    batch, slots, n = u_all.shape
    n_iters = slots - 1
    n_frac = 1 if weights is None else weights.shape[0]
    du, dv = u_all.new_empty(2, batch, n).unbind(0)
    grid = (batch, triton.cdiv(n, OWN))
    stream = THIN if cost.scores else STREAM
    for axis, line, blocks in ((1, du, (OWN, stream)), (0, dv, (stream, OWN))):
        wrap_triton(_bwd_direct_kernel)[grid](
            cost.src, grad, grad if weights is None else weights, u_all, v_all, line, dk, n, n_frac, n_iters,
            *grad.stride(), *cost.args(),
            **cost.flags(), AXIS=axis, BLOCK_R=blocks[0], BLOCK_C=blocks[1], BLOCK_S=THIN,
        )  # fmt: skip
    for t in range(n_iters, 0, -1):
        wrap_triton(_bwd_rows_kernel)[grid](
            cost.src, u_all, v_all, du, dv, n, n_iters, t, *cost.args(), **cost.flags(), BLOCK_R=OWN, BLOCK_C=STREAM
        )
        wrap_triton(_bwd_cols_kernel)[grid](
            cost.src, u_all, v_all, du, dv, dk, out, n, n_iters, t, *cost.args(), **cost.flags(),
            BLOCK_R=STREAM, BLOCK_C=OWN,
        )  # fmt: skip
