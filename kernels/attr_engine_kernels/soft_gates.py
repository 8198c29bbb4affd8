"""Soft gates, the kernel ops of the Semantic Pullback's soft adjoint: exact forward, softened backward gate.

The context manager that swaps them into a model is :func:`attr_engine.pullback.soft_adjoint.soft_adjoint`; this
file holds only the ops it calls.

- :func:`soft_gate`: ``y = act(z)`` exactly (ReLU, GELU, tanh-GELU, SiLU); the backward multiplies the incoming
  gradient by ``Phi(z / tau)`` (standard normal CDF; ReLU and GELU) or ``sigmoid(z / tau)`` (SiLU) instead of
  ``act'(z)``.
- :func:`soft_maxpool2d`: ``y = max_pool2d(x)`` exactly; the backward spreads each output's gradient over its window
  by the detached weights ``softmax(window / tau)`` (padding excluded) instead of routing it all to the arg-max.

Both backward passes are the true gradients of smooth surrogates (``tau * softplus(z / tau)``-like integrals of the
gate, and ``tau * logsumexp(window / tau)``), which is what the tests check with float64 gradcheck.

Layout of this file: references (the detach formulations, then the reference autograd functions) -> Triton kernels
-> launchers registered as ``attr_engine::`` ops with their autograd -> public functions.

The Triton kernels compute in float32 and take float32, float16 and bfloat16 tensors; float64 tensors always run the
reference (a float32 ``tau`` scalar and float32 math would silently lose the precision the caller asked for).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.library import triton_op, wrap_triton

from attr_engine_kernels._backend import tl, triton, use_triton
from attr_engine_kernels._tl_helpers import _pid, compute_dtype
from attr_engine_kernels.validate import check_int_at_least, check_positive, check_tensor

SOFT_GATE_KINDS: tuple[str, ...] = ("relu", "gelu", "gelu_tanh", "silu")
# Defaults from the Semantic Pullback paper (tanh-GELU shares GELU's gate and temperature).
DEFAULT_TAU: dict[str, float] = {"relu": 0.6, "gelu": 1.0, "gelu_tanh": 1.0, "silu": 1.6}
DEFAULT_POOL_TAU = 0.3

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SQRT1_2 = 0.7071067811865476
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
}


# ----------------------------------------------------------------------------------------------------------------
# Argument checks and pooling geometry
# ----------------------------------------------------------------------------------------------------------------


def _check_gate_args(z: torch.Tensor, kind: str, tau: float | None) -> float:
    check_tensor(z, "z")
    if kind not in SOFT_GATE_KINDS:
        raise ValueError(f"kind must be one of {', '.join(SOFT_GATE_KINDS)}; got {kind!r}")
    return check_positive(DEFAULT_TAU[kind] if tau is None else tau, "tau")


def _pair(value: int | Sequence[int], name: str, minimum: int) -> tuple[int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return check_int_at_least(value, name, minimum), value
    if isinstance(value, Sequence) and len(value) == 2:
        return check_int_at_least(value[0], name, minimum), check_int_at_least(value[1], name, minimum)
    raise ValueError(f"{name} must be an integer or a pair of integers >= {minimum}, got {value!r}")


def _pool_out_size(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    # torch's rule: floor (or ceil) division, and with ceil_mode the last window must start inside input + left pad.
    out = (size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _pool_geometry(
    x: torch.Tensor,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] | None,
    padding: int | Sequence[int],
    dilation: int | Sequence[int],
    ceil_mode: bool,
) -> tuple[list[int], int, int]:
    """Validate pooling arguments like ``nn.MaxPool2d``; return ``[kh, kw, sh, sw, ph, pw, dh, dw]``, OH, OW."""
    check_tensor(x, "x", ndim=4)
    kh, kw = _pair(kernel_size, "kernel_size", 1)
    sh, sw = (kh, kw) if stride is None else _pair(stride, "stride", 1)
    ph, pw = _pair(padding, "padding", 0)
    dh, dw = _pair(dilation, "dilation", 1)
    if not isinstance(ceil_mode, bool):
        raise ValueError(f"ceil_mode must be a bool, got {ceil_mode!r}")
    if ph > kh // 2 or pw > kw // 2:
        raise ValueError(f"padding must be at most half the kernel size, got padding {(ph, pw)}, kernel {(kh, kw)}")
    H, W = x.shape[-2:]
    oh = _pool_out_size(H, kh, sh, ph, dh, ceil_mode)
    ow = _pool_out_size(W, kw, sw, pw, dw, ceil_mode)
    if oh < 1 or ow < 1:
        raise ValueError(f"x of spatial size {(H, W)} is too small for this pooling (output size {(oh, ow)})")
    return [kh, kw, sh, sw, ph, pw, dh, dw], oh, ow


# ----------------------------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------------------------


def _gate_reference(z: torch.Tensor, kind: str, tau: float) -> torch.Tensor:
    # Every step after the first writes in place into one fresh tensor (torch.special.ndtr would allocate several
    # temporaries of z's size); Phi(u) = erfc(-u / sqrt(2)) / 2 also keeps the lower tail's relative accuracy.
    cd = compute_dtype(z.dtype)
    if kind == "silu":
        return (z.to(cd) / tau).sigmoid_()
    return (z.to(cd) * (-_SQRT1_2 / tau)).erfc_().mul_(0.5)


def soft_gate_reference(z: torch.Tensor, kind: str = "relu", tau: float | None = None) -> torch.Tensor:
    """The textbook detach formulation ``z * g.detach() - (z * g).detach() + act(z).detach()``, with ``g`` the gate.

    Plain autograd, so it keeps ``g``, ``z * g`` and ``act(z)`` alive and runs about five elementwise passes
    forward. Its forward value is ``act(z)`` only up to floating point: ``-0.0`` becomes ``+0.0`` and an infinite
    ``z`` gives NaN (``inf - inf``), which is why the reference backend of :func:`soft_gate` is a custom autograd
    function. Kept as the independent statement of the intended backward (tests compare against it) and as the
    eager baseline.

    z: any shape; returns the same shape and dtype.
    """
    tau = _check_gate_args(z, kind, tau)
    g = _gate_reference(z.detach(), kind, tau).to(z.dtype)
    return z * g - (z * g).detach() + _ACTIVATIONS[kind](z.detach())


def _soft_gate_backward_reference(z: torch.Tensor, grad: torch.Tensor, kind: str, tau: float) -> torch.Tensor:
    return _gate_reference(z, kind, tau).mul_(grad).to(z.dtype)


class _SoftGateReference(torch.autograd.Function):
    """Forward ``act(z)`` (so the value is torch's own, bit for bit); backward ``grad * gate(z / tau)``.

    Memory traffic: forward reads z and writes y; backward reads z and grad and writes grad_z through one float32
    temporary (three unfused passes instead of one). Only z is saved.
    """

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, kind: str, tau: float) -> torch.Tensor:
        ctx.save_for_backward(z)
        ctx.kind, ctx.tau = kind, tau
        return _ACTIVATIONS[kind](z)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (z,) = ctx.saved_tensors
        return _soft_gate_backward_reference(z, grad, ctx.kind, ctx.tau), None, None


def _soft_gate_pytorch(z: torch.Tensor, kind: str = "relu", tau: float | None = None) -> torch.Tensor:
    """Pure-PyTorch :func:`soft_gate` (same arguments); defines what the Triton path must compute."""
    tau = _check_gate_args(z, kind, tau)
    return _SoftGateReference.apply(z, kind, tau)


def _window_pads(x: torch.Tensor, geom: list[int], oh: int, ow: int) -> tuple[int, int, int, int]:
    """``F.pad`` amounts giving exactly the rows/columns the windows touch (a negative amount crops unused ones)."""
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    H, W = x.shape[-2:]
    bottom = (oh - 1) * sh + dh * (kh - 1) + 1 - H - ph
    right = (ow - 1) * sw + dw * (kw - 1) + 1 - W - pw
    return pw, right, ph, bottom


def _windows(x: torch.Tensor, geom: list[int], oh: int, ow: int, fill: float) -> torch.Tensor:
    """All pooling windows of x: (B, C, KH * KW, OH * OW), positions outside x set to ``fill``."""
    kh, kw, sh, sw, _, _, dh, dw = geom
    B, C = x.shape[:2]
    xp = F.pad(x, _window_pads(x, geom, oh, ow), value=fill)
    cols = F.unfold(xp, (kh, kw), dilation=(dh, dw), stride=(sh, sw))
    return cols.view(B, C, kh * kw, oh * ow)


def soft_maxpool2d_reference(
    x: torch.Tensor,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] | None = None,
    padding: int | Sequence[int] = 0,
    tau: float = DEFAULT_POOL_TAU,
    dilation: int | Sequence[int] = 1,
    ceil_mode: bool = False,
) -> torch.Tensor:
    """Detach formulation of :func:`soft_maxpool2d` with plain autograd through ``F.unfold``.

    ``s = sum_window(softmax(window / tau).detach() * window)``; ``y = s - s.detach() + max_pool2d(x).detach()``.
    Autograd keeps the unfolded windows and their weights (2 x KH*KW x the output size), the eager baseline.
    Forward equals max_pool2d up to the sign of zero.
    """
    geom, oh, ow = _pool_geometry(x, kernel_size, stride, padding, dilation, ceil_mode)
    tau = check_positive(tau, "tau")
    B, C = x.shape[:2]
    logits = _windows(x.detach().to(compute_dtype(x.dtype)), geom, oh, ow, -math.inf) / tau
    weights = torch.softmax(logits, dim=2).to(x.dtype)
    # Padding must be 0 in the values: 0 * -inf would poison the (discarded) forward sum with NaN.
    s = (weights * _windows(x, geom, oh, ow, 0.0)).sum(dim=2).view(B, C, oh, ow)
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    y = F.max_pool2d(x.detach(), (kh, kw), (sh, sw), (ph, pw), (dh, dw), ceil_mode=ceil_mode)
    return s - s.detach() + y


# Smallest window sum the pooled form trusts: below it the window sits too deep under its plane's maximum (about
# 690 tau) for float64 and the unfolded form, shifted by each window's own maximum, is used instead.
_POOLED_TINY = 1e-290


def _soft_maxpool2d_backward_pooled(
    x: torch.Tensor, grad: torch.Tensor, geom: list[int], ceil_mode: bool, tau: float
) -> torch.Tensor | None:
    """The backward of :func:`_soft_maxpool2d_backward_unfolded` through two pooling kernels, or None where it
    cannot be trusted (dilation, or a window whose float64 sum underflows).

    ``softmax(window / tau)_j = E_j / S_i`` with ``E = exp((x - c) / tau)`` for any constant c per (b, c) plane (its
    maximum here, so E <= 1), ``S`` the window sums of E: a sum pooling (``avg_pool2d`` with divisor 1; padding
    adds 0, as a -inf padded window does) and its adjoint (``avg_pool2d_backward``) scatters ``grad / S`` back.
    Nothing window-sized is formed: on the CPU about twice as fast as unfolding (its im2col, col2im and softmax over
    KH * KW x the output size set a ResNet's soft-pass overhead). In float64 whatever the input dtype, so windows
    down to ~690 tau below their plane's maximum keep full precision; deeper ones fall back.
    """
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    if (dh, dw) != (1, 1) or x.numel() == 0:
        return None
    xd = x.to(torch.float64)
    e = (xd - xd.amax(dim=(2, 3), keepdim=True)).div_(tau).exp_()
    sums = F.avg_pool2d(e, (kh, kw), (sh, sw), (ph, pw), ceil_mode, True, 1)
    if sums.shape != grad.shape or not bool((sums > _POOLED_TINY).all()):
        return None
    scattered = torch.ops.aten.avg_pool2d_backward(
        grad.to(torch.float64) / sums, e, [kh, kw], [sh, sw], [ph, pw], ceil_mode, True, 1
    )
    return e.mul_(scattered).to(x.dtype)


def _soft_maxpool2d_backward_reference(
    x: torch.Tensor, grad: torch.Tensor, geom: list[int], ceil_mode: bool, oh: int, ow: int, tau: float
) -> torch.Tensor:
    """``dx_j = sum over windows i holding j of grad_i * softmax(window_i / tau)_j``: pooled where it can be
    trusted, unfolded otherwise (both compute the same sums)."""
    pooled = _soft_maxpool2d_backward_pooled(x, grad, geom, ceil_mode, tau)
    return pooled if pooled is not None else _soft_maxpool2d_backward_unfolded(x, grad, geom, oh, ow, tau)


def _soft_maxpool2d_backward_unfolded(
    x: torch.Tensor, grad: torch.Tensor, geom: list[int], oh: int, ow: int, tau: float
) -> torch.Tensor:
    """The soft max-pool backward by its definition: unfold the -inf padded windows, softmax each, fold back."""
    cd = compute_dtype(x.dtype)
    B, C = x.shape[:2]
    kh, kw, sh, sw, _, _, dh, dw = geom
    # In place where possible: the window-sized temporaries dominate this path's memory.
    weights = torch.softmax(_windows(x.to(cd), geom, oh, ow, -math.inf).div_(tau), dim=2)
    cols = weights.mul_(grad.reshape(B, C, 1, oh * ow)).view(B, C * kh * kw, oh * ow)
    left, right, top, bottom = _window_pads(x, geom, oh, ow)
    H, W = x.shape[-2:]
    gp = F.fold(cols, (top + H + bottom, left + W + right), (kh, kw), dilation=(dh, dw), stride=(sh, sw))
    # Undo the padding: negative amounts crop it off again, positive ones restore rows no window reached (zeros).
    return F.pad(gp, (-left, -right, -top, -bottom)).to(x.dtype)


class _SoftMaxPool2dReference(torch.autograd.Function):
    """Forward ``F.max_pool2d``; backward spreads each output's gradient over its window by the window's softmax.

    Memory traffic: forward reads x and writes y. Backward (pooled form, no dilation): a float64 exp of x, a sum
    pooling and its adjoint, all input- or output-sized; the unfolded form (dilation, or windows too far below their
    plane's maximum) writes a padded copy of x, then the unfolded windows and their softmax weights (each KH*KW x
    the output size) before folding back. Only x is saved.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, geom: list[int], ceil_mode: bool, tau: float) -> torch.Tensor:
        kh, kw, sh, sw, ph, pw, dh, dw = geom
        y = F.max_pool2d(x, (kh, kw), (sh, sw), (ph, pw), (dh, dw), ceil_mode=ceil_mode)
        ctx.save_for_backward(x)
        ctx.geom, ctx.tau, ctx.out_hw, ctx.ceil_mode = geom, tau, y.shape[-2:], ceil_mode
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (x,) = ctx.saved_tensors
        oh, ow = ctx.out_hw
        backward = _soft_maxpool2d_backward_reference(x, grad, ctx.geom, ctx.ceil_mode, oh, ow, ctx.tau)
        return backward, None, None, None


def _soft_maxpool2d_pytorch(
    x: torch.Tensor,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] | None = None,
    padding: int | Sequence[int] = 0,
    tau: float = DEFAULT_POOL_TAU,
    dilation: int | Sequence[int] = 1,
    ceil_mode: bool = False,
) -> torch.Tensor:
    """Pure-PyTorch :func:`soft_maxpool2d` (same arguments); defines what the Triton path must compute."""
    geom, _, _ = _pool_geometry(x, kernel_size, stride, padding, dilation, ceil_mode)
    tau = check_positive(tau, "tau")
    return _SoftMaxPool2dReference.apply(x, geom, ceil_mode, tau)


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------

_GATE_BLOCK = 1024
_POOL_BLOCK = 256


@triton.jit
def _soft_gate_bwd_kernel(
    z_ptr,  # pre-activation z: n elements of dense storage, walked in memory order
    g_ptr,  # incoming gradient dL/dy: same strides as z, so the same flat offsets address it
    dz_ptr,  # outgoing gradient dL/dz: same strides as z
    n,
    inv_tau,
    SIGMOID: tl.constexpr,  # True: sigmoid(z / tau) (SiLU); False: Phi(z / tau) (ReLU, GELU)
    BLOCK: tl.constexpr,
):
    """``dz = g * gate(z / tau)``, gate = sigmoid (SiLU) or Phi, the standard normal CDF (ReLU, GELU)."""
    offs = _pid(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    u = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32) * inv_tau
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SIGMOID:
        gate = tl.sigmoid(u)
    else:
        # The literal, not the module's _SQRT1_2: the compiler only reads tl.constexpr globals (the interpreter
        # reads any), and a plain-float global made this kernel fail to compile for every ReLU and GELU network.
        gate = 0.5 + 0.5 * tl.math.erf(u * 0.7071067811865476)
    tl.store(dz_ptr + offs, (g * gate).to(dz_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _soft_maxpool2d_fwd_kernel(
    x_ptr,  # input x (B, C, H, W)
    y_ptr,  # output max (B, C, OH, OW), x's dtype
    lse_ptr,  # float32 logsumexp over each window of x / tau (B, C, OH, OW), same strides as y
    C,
    H,
    W,
    OH,
    OW,
    n_out,  # B * C * OH * OW
    stride_xb,  # x stride over B
    stride_xc,  # x stride over C
    stride_xh,  # x stride over H
    stride_xw,  # x stride over W
    stride_yb,  # y and lse stride over B
    stride_yc,  # y and lse stride over C
    stride_yh,  # y and lse stride over OH
    stride_yw,  # y and lse stride over OW
    inv_tau,
    KH: tl.constexpr,
    KW: tl.constexpr,
    SH: tl.constexpr,
    SW: tl.constexpr,
    PH: tl.constexpr,
    PW: tl.constexpr,
    DH: tl.constexpr,
    DW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``y = max_{k in window} x_k`` (torch's NaN and tie rules) and ``lse = log sum_{k in window} exp(x_k / tau)``.

    One lane per output element; the window loop is unrolled (KH * KW is small). The logsumexp is two passes over
    the window per lane (max, then sum), not the tile helper of ``._tl_helpers``: the max pass is also the
    exact forward, with torch's NaN rule, and each lane's window is a handful of scattered loads, not a tile.
    """
    offs = _pid(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n_out
    ow = offs % OW
    t = offs // OW
    oh = t % OH
    t = t // OH
    c = t % C
    b = t // C
    x_base = x_ptr + b * stride_xb + c * stride_xc
    h0 = oh * SH - PH
    w0 = ow * SW - PW
    # torch's rule (take v if v > max or v is NaN; ties keep the first), so y is bit-identical to max_pool2d. The
    # comparison runs on the exact float32 copy mf (the interpreter compares bfloat16 as raw bits); m keeps the
    # winning element's own bits for the store.
    mf = tl.full([BLOCK], float("-inf"), tl.float32)
    m = mf.to(x_ptr.dtype.element_ty)
    for kh in tl.static_range(KH):
        ih = h0 + kh * DH
        for kw in tl.static_range(KW):
            iw = w0 + kw * DW
            inside = valid & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            v = tl.load(x_base + ih * stride_xh + iw * stride_xw, mask=inside, other=float("-inf"))
            vf = v.to(tl.float32)
            take = inside & ((vf > mf) | (vf != vf))
            m = tl.where(take, v, m)
            mf = tl.where(take, vf, mf)
    # Second pass over the (cached) window for the stable sum; padding loads -inf and contributes exp(-inf) = 0.
    # Lanes past the end hold -inf: give them a zero shift and a unit sum, so they compute quietly (no NaN, no
    # log(0)) before their store is masked off.
    mt = tl.where(valid, mf * inv_tau, 0.0)
    s = tl.where(valid, 0.0, 1.0)
    for kh in tl.static_range(KH):
        ih = h0 + kh * DH
        for kw in tl.static_range(KW):
            iw = w0 + kw * DW
            inside = valid & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            v = tl.load(x_base + ih * stride_xh + iw * stride_xw, mask=inside, other=float("-inf")).to(tl.float32)
            s += tl.exp(v * inv_tau - mt)
    y_off = b * stride_yb + c * stride_yc + oh * stride_yh + ow * stride_yw
    tl.store(y_ptr + y_off, m, mask=valid)
    tl.store(lse_ptr + y_off, mt + tl.log(s), mask=valid)


@triton.jit
def _soft_maxpool2d_bwd_kernel(
    x_ptr,  # input x (B, C, H, W) saved from the forward
    lse_ptr,  # float32 per-window logsumexp of x / tau (B, C, OH, OW)
    g_ptr,  # incoming gradient dL/dy (B, C, OH, OW), any strides (expanded zeros included)
    dx_ptr,  # outgoing gradient dL/dx (B, C, H, W), x's dtype
    C,
    H,
    W,
    OH,
    OW,
    n_in,  # B * C * H * W
    stride_xb,  # x stride over B
    stride_xc,  # x stride over C
    stride_xh,  # x stride over H
    stride_xw,  # x stride over W
    stride_lb,  # lse stride over B
    stride_lc,  # lse stride over C
    stride_lh,  # lse stride over OH
    stride_lw,  # lse stride over OW
    stride_gb,  # grad stride over B
    stride_gc,  # grad stride over C
    stride_gh,  # grad stride over OH
    stride_gw,  # grad stride over OW
    stride_db,  # dx stride over B
    stride_dc,  # dx stride over C
    stride_dh,  # dx stride over H
    stride_dw,  # dx stride over W
    inv_tau,
    KH: tl.constexpr,
    KW: tl.constexpr,
    SH: tl.constexpr,
    SW: tl.constexpr,
    PH: tl.constexpr,
    PW: tl.constexpr,
    DH: tl.constexpr,
    DW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``dx_k = sum_{windows o containing k} g_o * exp(x_k / tau - lse_o)``: softmax(window / tau) weights.

    One lane per input pixel, gathering from every output whose window covers it: each dx element is written once
    by one lane in a fixed order, so there are no atomics and the result is deterministic.
    """
    offs = _pid(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n_in
    iw = offs % W
    t = offs // W
    ih = t % H
    t = t // H
    c = t % C
    b = t // C
    u = (
        tl.load(x_ptr + b * stride_xb + c * stride_xc + ih * stride_xh + iw * stride_xw, mask=valid, other=0.0).to(
            tl.float32
        )
        * inv_tau
    )
    lse_base = lse_ptr + b * stride_lb + c * stride_lc
    g_base = g_ptr + b * stride_gb + c * stride_gc
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for kh in tl.static_range(KH):
        # Output row oh sees this pixel at kernel row kh iff oh * SH - PH + kh * DH == ih.
        nh = ih + PH - kh * DH
        oh = nh // SH
        ok_h = (nh >= 0) & (nh == oh * SH) & (oh < OH)
        for kw in tl.static_range(KW):
            nw = iw + PW - kw * DW
            ow = nw // SW
            ok = valid & ok_h & (nw >= 0) & (nw == ow * SW) & (ow < OW)
            # A lane whose window does not cover the pixel loads lse = +inf: weight exp(-inf) = 0, times g = 0.
            lse = tl.load(lse_base + oh * stride_lh + ow * stride_lw, mask=ok, other=float("inf"))
            g = tl.load(g_base + oh * stride_gh + ow * stride_gw, mask=ok, other=0.0).to(tl.float32)
            acc += tl.exp(u - lse) * g
    tl.store(
        dx_ptr + b * stride_db + c * stride_dc + ih * stride_dh + iw * stride_dw,
        acc.to(dx_ptr.dtype.element_ty),
        mask=valid,
    )


# ----------------------------------------------------------------------------------------------------------------
# Launchers, registered as ops so torch.compile sees through them, and their autograd
# ----------------------------------------------------------------------------------------------------------------


@triton_op("attr_engine::soft_gate", mutates_args=())
def _soft_gate_op(z: torch.Tensor, kind: str, tau: float) -> torch.Tensor:
    # The forward is torch's own activation, not a Triton kernel: bit-identity with torch.relu / F.gelu / F.silu is
    # the contract, and a re-implementation cannot promise it (erf/exp codegen, FMA contraction and division
    # rounding differ between Triton and ATen). It is one elementwise kernel either way; the fusion is in the backward.
    return _ACTIVATIONS[kind](z)


def _dense_same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Both tensors cover one dense block in the same memory order, so flat offsets address matching elements."""
    if a.stride() != b.stride():
        return False
    return a.is_contiguous() or (a.ndim == 4 and a.is_contiguous(memory_format=torch.channels_last))


@triton_op("attr_engine::soft_gate_backward", mutates_args=())
def _soft_gate_backward_op(z: torch.Tensor, grad: torch.Tensor, kind: str, tau: float) -> torch.Tensor:
    if not _dense_same_layout(z, grad):  # e.g. an expanded gradient or a sliced z: pay one copy, then walk flat
        z, grad = z.contiguous(), grad.contiguous()
    dz = torch.empty_like(z)
    n = z.numel()
    if n > 0:
        grid = (triton.cdiv(n, _GATE_BLOCK),)
        wrap_triton(_soft_gate_bwd_kernel)[grid](z, grad, dz, n, 1.0 / tau, SIGMOID=kind == "silu", BLOCK=_GATE_BLOCK)
    return dz


def _soft_gate_setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    z, kind, tau = inputs
    ctx.save_for_backward(z)
    ctx.kind, ctx.tau = kind, tau


def _soft_gate_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    (z,) = ctx.saved_tensors
    return torch.ops.attr_engine.soft_gate_backward(z, grad, ctx.kind, ctx.tau), None, None


_soft_gate_op.register_autograd(_soft_gate_backward, setup_context=_soft_gate_setup_context)


def _pool_output_format(x: torch.Tensor) -> torch.memory_format:
    # Follow max_pool2d: a channels-last input gives a channels-last output.
    channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    return torch.channels_last if channels_last else torch.contiguous_format


@triton_op("attr_engine::soft_maxpool2d", mutates_args=())
def _soft_maxpool2d_op(
    x: torch.Tensor, geom: list[int], out_hw: list[int], tau: float
) -> tuple[torch.Tensor, torch.Tensor]:
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    B, C, H, W = x.shape
    oh, ow = out_hw
    y = torch.empty((B, C, oh, ow), device=x.device, dtype=x.dtype, memory_format=_pool_output_format(x))
    lse = torch.empty_like(y, dtype=torch.float32)
    n_out = y.numel()
    if n_out > 0:
        grid = (triton.cdiv(n_out, _POOL_BLOCK),)
        wrap_triton(_soft_maxpool2d_fwd_kernel)[grid](
            x, y, lse, C, H, W, oh, ow, n_out, *x.stride(), *y.stride(), 1.0 / tau,
            KH=kh, KW=kw, SH=sh, SW=sw, PH=ph, PW=pw, DH=dh, DW=dw, BLOCK=_POOL_BLOCK,
        )  # fmt: skip
    return y, lse


@triton_op("attr_engine::soft_maxpool2d_backward", mutates_args=())
def _soft_maxpool2d_backward_op(
    x: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, geom: list[int], tau: float
) -> torch.Tensor:
    kh, kw, sh, sw, ph, pw, dh, dw = geom
    _, C, H, W = x.shape
    oh, ow = lse.shape[-2:]
    dx = torch.empty_like(x)
    n_in = x.numel()
    if n_in > 0:
        grid = (triton.cdiv(n_in, _POOL_BLOCK),)
        wrap_triton(_soft_maxpool2d_bwd_kernel)[grid](
            x, lse, grad, dx, C, H, W, oh, ow, n_in, *x.stride(), *lse.stride(), *grad.stride(), *dx.stride(),
            1.0 / tau, KH=kh, KW=kw, SH=sh, SW=sw, PH=ph, PW=pw, DH=dh, DW=dw, BLOCK=_POOL_BLOCK,
        )  # fmt: skip
    return dx


def _soft_maxpool2d_setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, geom, _, tau = inputs
    _, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(x, lse)
    ctx.geom, ctx.tau = geom, tau


def _soft_maxpool2d_backward(ctx: Any, grad: torch.Tensor, _grad_lse: torch.Tensor | None) -> tuple[Any, ...]:
    x, lse = ctx.saved_tensors
    return torch.ops.attr_engine.soft_maxpool2d_backward(x, lse, grad, ctx.geom, ctx.tau), None, None, None


_soft_maxpool2d_op.register_autograd(_soft_maxpool2d_backward, setup_context=_soft_maxpool2d_setup_context)


# ----------------------------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------------------------


def soft_gate(z: torch.Tensor, kind: str = "relu", tau: float | None = None) -> torch.Tensor:
    """Exact activation with a soft backward gate (the Semantic Pullback soft adjoint of ReLU / GELU / SiLU).

    Forward: ``torch.relu(z)``, ``F.gelu(z)``, ``F.gelu(z, approximate="tanh")`` or ``F.silu(z)``, bit for bit.
    Backward: ``grad * Phi(z / tau)`` for "relu", "gelu" and "gelu_tanh", ``grad * sigmoid(z / tau)`` for "silu".

    Args:
        z: (any shape) pre-activation, float32 / float16 / bfloat16 / float64.
        kind: "relu", "gelu", "gelu_tanh" (timm's tanh-approximate GELU) or "silu".
        tau: gate temperature > 0; None takes the paper's default for ``kind`` (:data:`DEFAULT_TAU`).

    Returns:
        (same shape and dtype as z) ``act(z)``.
    """
    tau = _check_gate_args(z, kind, tau)
    if z.dtype in _KERNEL_DTYPES and use_triton(z):
        return torch.ops.attr_engine.soft_gate(z, kind, tau)
    return _SoftGateReference.apply(z, kind, tau)


def soft_maxpool2d(
    x: torch.Tensor,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] | None = None,
    padding: int | Sequence[int] = 0,
    tau: float = DEFAULT_POOL_TAU,
    dilation: int | Sequence[int] = 1,
    ceil_mode: bool = False,
) -> torch.Tensor:
    """Exact 2-D max pooling whose backward spreads each output's gradient by ``softmax(window / tau)``.

    Arguments follow ``nn.MaxPool2d`` (int or (h, w) pairs; ``stride=None`` means ``kernel_size``; padding at most
    half the kernel). Padding positions get weight 0, so ``grad_x.sum() == grad_y.sum()``. Small ``tau`` tends to the
    ordinary max-pool gradient, large ``tau`` to an even split over the window.

    Args:
        x: (B, C, H, W) float32 / float16 / bfloat16 / float64.
        tau: softmax temperature > 0 (the paper's default is 0.3).

    Returns:
        (B, C, OH, OW) exactly ``F.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode)``.
    """
    geom, oh, ow = _pool_geometry(x, kernel_size, stride, padding, dilation, ceil_mode)
    tau = check_positive(tau, "tau")
    if x.dtype in _KERNEL_DTYPES and use_triton(x):
        y, _ = torch.ops.attr_engine.soft_maxpool2d(x, geom, [oh, ow], tau)
        return y
    return _SoftMaxPool2dReference.apply(x, geom, ceil_mode, tau)


__all__ = [
    "DEFAULT_POOL_TAU",
    "DEFAULT_TAU",
    "SOFT_GATE_KINDS",
    "soft_gate",
    "soft_gate_reference",
    "soft_maxpool2d",
    "soft_maxpool2d_reference",
]
