"""Region pooling of attribution maps and blending of images under grid masks, on one shared grid geometry.

- :func:`region_pool`: (B, H, W) map -> (B, g, g) cell means. Backward: each pixel receives its cell's gradient
  divided by the cell's area.
- :func:`soft_mask_blend`: image x and reference r (B, C, H, W), masks (B, S, g, g) ->
  ``out[b, s] = x + up(m_s) * (r - x)``, (B, S, C, H, W), with ``up`` nearest upsampling onto the same cells,
  optionally followed by the official AHA training's mask smoothing (``smooth_sigma > 0``): a Gaussian blur with
  reflect padding, clamped to [0, 1].

Smoothing (:func:`blur_kernel_size`): a normalised 1-D Gaussian of ``2 * ceil(3 * sigma) + 1`` taps (the official
code's default rule, 7 taps at sigma 1.0) along rows and columns, the image edge reflected (``F.pad`` mode
"reflect"), then ``clamp(0, 1)``. Nearest upsampling and the blur are linear, so the blurred mask is
``A_r @ M @ A_c^T`` with small (H, g) and (W, g) matrices whose row y holds, per cell, the Gaussian weight of the
taps of pixel y that land in that cell after reflection. The reference multiplies by them; the kernels read each
pixel's few non-zero entries (a band of 2D + 1 cells around the pixel's own cell) and combine the grid values
in registers, so no (B, S, H, W) mask is ever written.

Gradient of the clamp (deliberately not the official torch.clamp rule, whose zero gradient at exactly 0 and 1
would make an all-0 or all-1 mask stationary): it passes wherever ``0 <= blur <= 1 + slack``, so cells at 0 or 1
keep their gradient as they do unsmoothed; ``slack`` (:func:`_clamp_slack`) bounds the rounding of a blur of cells
that are all 1, in any summation order. The derivation: docs/kernels.md ("Blend clamp gradient").

Geometry (:func:`cell_index`): pixel row y belongs to grid row ``min(g - 1, floor((y * g + oy * H) / H))``, likewise
for columns: with offset 0 the exact balanced partition ``floor(y * g / H)``; an offset shifts the grid by a
fraction of a cell, shortening the first cell and letting the last absorb the remainder. The index maps are computed
once on the host in float64 (cached per shape, grid, offset and device) and feed both paths (the reference as flat
cell ids and membership matrices, the kernels as int32 maps and cell boundaries), so the reference and Triton agree
exactly on which pixel belongs to which cell and on cell areas.

Layout: geometry -> references -> Triton kernels -> launchers (torch.library ops) -> autograd wiring -> public ops.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import custom_op, triton_op, wrap_triton

from attr_engine_kernels._backend import tl, triton, use_triton
from attr_engine_kernels._tl_helpers import _pid, compute_dtype, tl_compute_dtype
from attr_engine_kernels.validate import check_int_at_least, check_offset, check_same, check_tensor

# ----------------------------------------------------------------------------------------------------------------------
# Grid geometry
# ----------------------------------------------------------------------------------------------------------------------


def cell_index(size: int, g: int, frac: float = 0.0) -> Tensor:
    """Grid cell of every pixel along one axis.

    Args:
        size: number of pixels along the axis (H or W), >= 1.
        g: number of cells along the axis, 1 <= g <= size.
        frac: grid offset as a fraction of a cell, in [0, 1).

    Returns:
        (size,) int64 on the CPU, non-decreasing, from 0 to g - 1; every cell is non-empty.
    """
    size = check_int_at_least(size, "size", 1)
    g = check_int_at_least(g, "g", 1)
    if g > size:
        raise ValueError(f"g must be <= size ({size}), got {g}")
    frac = float(frac)
    if not 0.0 <= frac < 1.0:
        raise ValueError(f"frac must be a fraction of a cell in [0, 1), got {frac!r}")
    pos = torch.arange(size, dtype=torch.float64)
    # float64 keeps y * g exact, and the quotient of two exact integers is correctly rounded, so with frac = 0 the
    # floor lands on the exact cell (float32 scales, as in F.interpolate, sometimes round across a boundary).
    idx = torch.floor((pos * g + frac * size) / size)
    return idx.clamp_(max=g - 1).long()


@dataclass(frozen=True, eq=False)
class _Grid:
    """Everything both paths need to know about one (H, W, g, offset) grid, on one device."""

    g: int
    rows: Tensor  # (H,) int32: grid row of each pixel row (kernels)
    cols: Tensor  # (W,) int32: grid column of each pixel column
    row_start: Tensor  # (g + 1,) int32: first pixel row of each grid row, then H (cells are contiguous ranges)
    col_start: Tensor  # (g + 1,) int32
    cell: Tensor  # (H * W,) int64: flat cell id (row * g + column) of each pixel (reference upsampling)
    max_area: int  # pixels in the largest cell (sizes the kernels' tiles)
    # accumulation dtype -> (row, column) membership matrices, (g, H) and (W, g): 0/1 for cell sums, 1/count for means
    sums: dict[torch.dtype, tuple[Tensor, Tensor]]
    means: dict[torch.dtype, tuple[Tensor, Tensor]]


@functools.lru_cache(maxsize=64)
def _grid(h: int, w: int, g: int, oy: float, ox: float, device: torch.device) -> _Grid:
    rows, cols = cell_index(h, g, oy), cell_index(w, g, ox)
    n_rows, n_cols = torch.bincount(rows, minlength=g), torch.bincount(cols, minlength=g)
    if bool((n_rows == 0).any()) or bool((n_cols == 0).any()):  # only float64 rounding with an offset a hair below 1
        raise ValueError(f"offset {(oy, ox)!r} leaves an empty grid cell for H={h}, W={w}, g={g}")
    zero = torch.zeros(1, dtype=torch.int64)
    row_sum = torch.nn.functional.one_hot(rows, g).T.double()
    col_sum = torch.nn.functional.one_hot(cols, g).double()
    row_mean, col_mean = row_sum / n_rows[:, None], col_sum / n_cols[None, :]
    return _Grid(
        g=g,
        rows=rows.to(device=device, dtype=torch.int32),
        cols=cols.to(device=device, dtype=torch.int32),
        row_start=torch.cat([zero, n_rows.cumsum(0)]).to(device=device, dtype=torch.int32),
        col_start=torch.cat([zero, n_cols.cumsum(0)]).to(device=device, dtype=torch.int32),
        cell=(rows[:, None] * g + cols[None, :]).reshape(-1).to(device),
        max_area=int(n_rows.max()) * int(n_cols.max()),
        sums={dt: (row_sum.to(device, dt), col_sum.to(device, dt)) for dt in (torch.float32, torch.float64)},
        means={dt: (row_mean.to(device, dt), col_mean.to(device, dt)) for dt in (torch.float32, torch.float64)},
    )


def blur_kernel_size(sigma: float) -> int:
    """Taps of the Gaussian mask blur for ``sigma`` > 0: ``2 * ceil(3 * sigma) + 1`` (the official rule; 7 at 1.0)."""
    return 2 * math.ceil(3.0 * sigma) + 1


def gaussian_taps(sigma: float) -> Tensor:
    """(k,) float64 normalised 1-D Gaussian, k = :func:`blur_kernel_size`; tap t sits at offset t - k // 2."""
    k = blur_kernel_size(sigma)
    pos = torch.arange(k, dtype=torch.float64) - (k - 1) / 2.0
    taps = torch.exp(-pos * pos / (2.0 * sigma * sigma))
    return taps / taps.sum()


def _blur_cells(size: int, g: int, frac: float, sigma: float) -> tuple[Tensor, Tensor]:
    """Nearest upsampling followed by the reflect-padded blur, along one axis.

    Returns:
        A: (size, g) float64, ``A[y, c]`` = total weight of pixel y's taps that land in cell c (rows sum to 1).
        band: (size, 2D + 1) float64, ``band[y, d + D] = A[y, cell(y) + d]``: the same weights relative to the
            pixel's own cell, D the farthest cell any pixel reaches.
    """
    taps = gaussian_taps(sigma)
    r = taps.numel() // 2
    cells = cell_index(size, g, frac)
    pos = (torch.arange(size)[:, None] + torch.arange(-r, r + 1)[None, :]).abs()  # reflect at 0: -d -> d
    pos = torch.where(pos > size - 1, 2 * (size - 1) - pos, pos)  # and at the far edge: size - 1 + d -> size - 1 - d
    tap_cells = cells[pos]  # (size, k)
    weights = taps.expand(size, -1)
    a = torch.zeros(size, g, dtype=torch.float64).scatter_add_(1, tap_cells, weights)
    rel = tap_cells - cells[:, None]
    reach = int(rel.abs().max())
    band = torch.zeros(size, 2 * reach + 1, dtype=torch.float64).scatter_add_(1, rel + reach, weights)
    return a, band


@dataclass(frozen=True, eq=False)
class _Smoothing:
    """The blur of one (H, W, g, offset, sigma) grid, on one device: dense matrices (reference), bands (kernels)."""

    # accumulation dtype -> matrices for _reduce_cells: (A_r (H, g), A_c^T (g, W)) up, (A_r^T (g, H), A_c (W, g)) down
    up: dict[torch.dtype, tuple[Tensor, Tensor]]
    down: dict[torch.dtype, tuple[Tensor, Tensor]]
    row_band: dict[torch.dtype, Tensor]  # (H, 2 D_r + 1) contiguous
    col_band: dict[torch.dtype, Tensor]  # (W, 2 D_c + 1) contiguous


@functools.lru_cache(maxsize=64)
def _smoothing(h: int, w: int, g: int, oy: float, ox: float, sigma: float, device: torch.device) -> _Smoothing:
    a_r, band_r = _blur_cells(h, g, oy, sigma)
    a_c, band_c = _blur_cells(w, g, ox, sigma)
    dts = (torch.float32, torch.float64)
    return _Smoothing(
        up={dt: (a_r.to(device, dt), a_c.T.contiguous().to(device, dt)) for dt in dts},
        down={dt: (a_r.T.contiguous().to(device, dt), a_c.to(device, dt)) for dt in dts},
        row_band={dt: band_r.to(device, dt) for dt in dts},
        col_band={dt: band_c.to(device, dt) for dt in dts},
    )


# ----------------------------------------------------------------------------------------------------------------------
# References (pure PyTorch; they define correctness)
# ----------------------------------------------------------------------------------------------------------------------
# On the CPU these are what runs, often on few, shared cores, where every extra parallel op costs more than its
# arithmetic: both are written with as few full-size passes as their memory budget allows.


def _reduce_cells(t: Tensor, mats: tuple[Tensor, Tensor]) -> Tensor:
    """(..., H, W) -> (..., g, g): ``row_mat @ t @ col_mat`` with (g, H) and (W, g) cell-membership matrices.

    Columns first: one (N * H, W) @ (W, g) GEMM reads the input once; the rows then reduce a W / g times smaller
    tensor. Temporaries are (..., H, g) and (..., g, g); BLAS is deterministic and, on the CPU, far faster than
    index_add along an inner dimension. Autograd's backward is the transposed products: each pixel receives its
    cell's gradient times its membership weight, without saving anything of the input's size.
    """
    row_mat, col_mat = mats
    by_cols = (t.reshape(-1, t.shape[-1]) @ col_mat).view(*t.shape[:-1], col_mat.shape[1])
    return row_mat @ by_cols


def _upsample(masks: Tensor, grid: _Grid) -> Tensor:
    """(..., g, g) -> (..., H, W) nearest upsampling: one gather with the flat per-pixel cell id.

    Gathers along dim 1 of a 2-D view: on the CPU much faster than along the last dim of a 3-D one.
    """
    flat = masks.reshape(-1, grid.g * grid.g).index_select(1, grid.cell)
    return flat.view(*masks.shape[:-2], grid.rows.shape[0], -1)


def _region_pool_reference(amap: Tensor, grid: _Grid) -> Tensor:
    """Cell means of ``amap: (B, H, W)`` -> (B, g, g), differentiable through plain autograd.

    Memory: reads the map once (plus one float32 copy for half inputs), writes (B, H, g) and (B, g, g); autograd
    keeps nothing of size (B, H, W).
    """
    acc = compute_dtype(amap.dtype)
    return _reduce_cells(amap.to(acc), grid.means[acc]).to(amap.dtype)


def _pixel_masks(
    masks: Tensor, grid: _Grid, smooth: _Smoothing | None, acc: torch.dtype, gate: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Per-pixel masks (B, S, H, W) in ``acc``: nearest upsampling, or its blur ``A_r @ M @ A_c^T`` clamped to
    [0, 1]. With the blur and ``gate``, also where the clamp lets the gradient through, ``0 <= blur <= 1 + slack``
    (module docstring); None otherwise."""
    if smooth is None:
        return _upsample(masks.to(acc), grid), None
    raw = _reduce_cells(masks.to(acc), smooth.up[acc])
    keep = None
    if gate:
        slack = _clamp_slack(acc, smooth.row_band[acc].shape[1], smooth.col_band[acc].shape[1])
        keep = (raw >= 0.0) & (raw <= 1.0 + slack)
    return raw.clamp_(0.0, 1.0), keep


def _clamp_slack(acc: torch.dtype, nbr: int, nbc: int) -> float:
    """Rounding allowance of the clamp's upper gate for a blur reaching ``nbr`` x ``nbc`` cells (module docstring):
    ``(n + 4) * eps`` bounds the rounding of n non-negative products, from weights rounded to ``acc``, in any order."""
    return (nbr * nbc + 4) * torch.finfo(acc).eps


def _blend_reference_forward(
    x: Tensor, reference: Tensor, masks: Tensor, grid: _Grid, smooth: _Smoothing | None = None
) -> Tensor:
    """``x + up(m_s) * (r - x)`` for every mask: (B, S, C, H, W); the backward saves only the inputs.

    Memory: writes the (B, S, C, H, W) output once, with one (B, S, H, W) upsampled mask as its only temporary (plus
    one float32 (B, C, H, W) slice at a time for half inputs). The naive broadcast formulation keeps the upsampled
    masks for autograd and creates several output-sized temporaries in both directions.
    """
    acc = compute_dtype(x.dtype)
    xa, ra = x.to(acc), reference.to(acc)
    up, _ = _pixel_masks(masks, grid, smooth, acc)  # (B, S, H, W)
    b, c, h, w = x.shape
    out = torch.empty((b, up.shape[1], c, h, w), dtype=x.dtype, device=x.device)
    # lerp switches to r - (r - x) * (1 - m) for m >= 0.5, so m = 0 gives x and m = 1 gives r exactly.
    if acc == x.dtype:
        torch.lerp(xa[:, None], ra[:, None], up[:, :, None], out=out)
    else:
        for s in range(up.shape[1]):
            out[:, s].copy_(torch.lerp(xa, ra, up[:, s, None]))
    return out


def _blend_reference_backward(
    grad_out: Tensor,
    x: Tensor,
    reference: Tensor,
    masks: Tensor,
    grid: _Grid,
    need_masks: bool,
    smooth: _Smoothing | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(dx, dr, dmasks or None). Recomputes the upsampled masks and r - x and works one channel at a time, so its
    temporaries are (B, S, H, W)-sized (1 / C of the output). With smoothing, the per-pixel mask gradient passes
    the clamp where the blur is in [0, 1], ends included (``_pixel_masks``), and goes back to the cells through the
    transposed blur ``A_r^T @ . @ A_c``."""
    acc = compute_dtype(x.dtype)
    up, keep = _pixel_masks(masks, grid, smooth, acc, gate=need_masks)  # (B, S, H, W)
    diff = reference.to(acc) - x.to(acc)
    dr = torch.empty_like(diff)
    dup = torch.zeros_like(up) if need_masks else None
    for c in range(x.shape[1]):
        g_c = grad_out[:, :, c].to(acc)  # (B, S, H, W)
        torch.sum(g_c * up, 1, out=dr[:, c])
        if dup is not None:
            dup.addcmul_(g_c, diff[:, c, None])
    dx = grad_out.sum(1, dtype=acc).sub_(dr)  # sum_s g_s * (1 - m_s)
    dm = None
    if dup is not None and smooth is None:
        dm = _reduce_cells(dup, grid.sums[acc]).to(masks.dtype)
    elif dup is not None and smooth is not None:
        assert keep is not None  # _pixel_masks returns the clamp gate whenever it smooths with gate=True
        dm = _reduce_cells(dup.mul_(keep), smooth.down[acc]).to(masks.dtype)
    return dx.to(x.dtype), dr.to(reference.dtype), dm


# The references registered as ops, like the Triton paths: torch.compile sees one opaque node each instead of the
# geometry's host-side set-up (cached per shape), and fullgraph=True traces the ops' callers.


@custom_op("attr_engine::region_pool_reference", mutates_args=())
def _region_pool_reference_op(amap: Tensor, g: int, oy: float, ox: float) -> Tensor:
    return _region_pool_reference(amap, _grid(amap.shape[1], amap.shape[2], g, oy, ox, amap.device))


@_region_pool_reference_op.register_fake
def _(amap: Tensor, g: int, oy: float, ox: float) -> Tensor:
    return amap.new_empty(amap.shape[0], g, g)


@custom_op("attr_engine::region_pool_reference_backward", mutates_args=())
def _region_pool_reference_backward_op(grad: Tensor, h: int, w: int, oy: float, ox: float) -> Tensor:
    """Each pixel receives its cell's gradient / area: ``row_mean^T @ grad @ col_mean^T``, (B, g, g) -> (B, H, W)."""
    geo = _grid(h, w, grad.shape[-1], oy, ox, grad.device)
    acc = compute_dtype(grad.dtype)
    row_mean, col_mean = geo.means[acc]
    return (row_mean.T @ grad.to(acc) @ col_mean.T).to(grad.dtype)


@_region_pool_reference_backward_op.register_fake
def _(grad: Tensor, h: int, w: int, oy: float, ox: float) -> Tensor:
    return grad.new_empty(grad.shape[0], h, w)


def _region_pool_reference_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    amap, _, oy, ox = inputs
    ctx.hw, ctx.offset = amap.shape[1:], (oy, ox)


def _region_pool_reference_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    dmap = torch.ops.attr_engine.region_pool_reference_backward(grad, *ctx.hw, *ctx.offset)
    return dmap, None, None, None


_region_pool_reference_op.register_autograd(_region_pool_reference_backward, setup_context=_region_pool_reference_setup)


def _reference_geometry(
    x: Tensor, masks: Tensor, oy: float, ox: float, sigma: float
) -> tuple[_Grid, _Smoothing | None]:
    h, w, g = x.shape[2], x.shape[3], masks.shape[2]
    smooth = _smoothing(h, w, g, oy, ox, sigma, x.device) if sigma > 0 else None
    return _grid(h, w, g, oy, ox, x.device), smooth


@custom_op("attr_engine::soft_mask_blend_reference", mutates_args=())
def _soft_mask_blend_reference_op(
    x: Tensor, reference: Tensor, masks: Tensor, oy: float, ox: float, sigma: float
) -> Tensor:
    return _blend_reference_forward(x, reference, masks, *_reference_geometry(x, masks, oy, ox, sigma))


@_soft_mask_blend_reference_op.register_fake
def _(x: Tensor, reference: Tensor, masks: Tensor, oy: float, ox: float, sigma: float) -> Tensor:
    b, c, h, w = x.shape
    return x.new_empty(b, masks.shape[1], c, h, w)


@custom_op("attr_engine::soft_mask_blend_reference_backward", mutates_args=())
def _soft_mask_blend_reference_backward_op(
    grad: Tensor, x: Tensor, reference: Tensor, masks: Tensor, oy: float, ox: float, sigma: float, need_masks: bool
) -> tuple[Tensor, Tensor, Tensor]:
    geo, smooth = _reference_geometry(x, masks, oy, ox, sigma)
    dx, dr, dm = _blend_reference_backward(grad, x, reference, masks, geo, need_masks, smooth)
    return dx, dr, dm if dm is not None else masks.new_empty(0)


@_soft_mask_blend_reference_backward_op.register_fake
def _(
    grad: Tensor, x: Tensor, reference: Tensor, masks: Tensor, oy: float, ox: float, sigma: float, need_masks: bool
) -> tuple:
    dm = torch.empty_like(masks) if need_masks else masks.new_empty(0)
    return torch.empty_like(x), torch.empty(x.shape, dtype=reference.dtype, device=x.device), dm


def _soft_mask_blend_reference_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    x, reference, masks, oy, ox, sigma = inputs
    ctx.save_for_backward(x, reference, masks)
    ctx.offset, ctx.sigma = (oy, ox), sigma


def _soft_mask_blend_reference_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    x, reference, masks = ctx.saved_tensors
    need_x, need_r, need_m = ctx.needs_input_grad[:3]
    dx, dr, dm = torch.ops.attr_engine.soft_mask_blend_reference_backward(
        grad, x, reference, masks, *ctx.offset, ctx.sigma, bool(need_m)
    )
    return dx if need_x else None, dr if need_r else None, dm if need_m else None, None, None, None


_soft_mask_blend_reference_op.register_autograd(
    _soft_mask_blend_reference_backward, setup_context=_soft_mask_blend_reference_setup
)


# ----------------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit
def _pool_fwd_kernel(
    amap_ptr,  # (B, H, W) input map, any strides
    out_ptr,  # (B, g, g) contiguous cell means, amap's dtype
    row_start_ptr,  # (g + 1,) int32: first pixel row of each grid row, then H
    col_start_ptr,  # (g + 1,) int32: first pixel column of each grid column, then W
    stride_ab,  # amap stride over the batch, in elements
    stride_ah,  # amap stride over rows
    stride_aw,  # amap stride over columns
    G,  # grid size g
    ACC: tl.constexpr,  # accumulation dtype (float32, or float64 for float64 maps)
    BLOCK: tl.constexpr,  # pixels of the cell summed per step
):
    """Cell mean ``out[b, cy, cx] = sum_{(y, x) in cell} amap[b, y, x] / area(cell)`` for one (image, cell).

    One program owns one (image, cell): the sum is a plain in-register reduction, no atomics, deterministic.
    """
    cell = _pid(0)
    b = _pid(1)
    cy = cell // G
    cx = cell % G
    y0 = tl.load(row_start_ptr + cy)
    x0 = tl.load(col_start_ptr + cx)
    cw = tl.load(col_start_ptr + cx + 1) - x0
    n = (tl.load(row_start_ptr + cy + 1) - y0) * cw
    base = amap_ptr + b * stride_ab
    acc = tl.zeros([BLOCK], dtype=ACC)
    for start in range(0, n, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        yy = y0 + idx // cw
        xx = x0 + idx % cw
        acc += tl.load(base + yy * stride_ah + xx * stride_aw, mask=idx < n, other=0.0).to(ACC)
    mean = tl.sum(acc, axis=0) / n.to(ACC)
    tl.store(out_ptr + b * G * G + cell, mean.to(out_ptr.dtype.element_ty))


@triton.jit
def _pool_bwd_kernel(
    grad_ptr,  # (B, g, g) contiguous gradient of the cell means
    dmap_ptr,  # (B, H, W) contiguous gradient of the map, written once per pixel
    rows_ptr,  # (H,) int32 grid row of each pixel row
    cols_ptr,  # (W,) int32 grid column of each pixel column
    row_start_ptr,  # (g + 1,) int32 cell row boundaries (for the cell area)
    col_start_ptr,  # (g + 1,) int32 cell column boundaries
    H,  # map height
    W,  # map width
    G,  # grid size g
    ACC: tl.constexpr,  # arithmetic dtype
    BLOCK: tl.constexpr,  # pixels per program
):
    """Adjoint of the cell mean: ``dmap[b, y, x] = grad[b, cell(y, x)] / area(cell(y, x))``.

    One program owns a block of pixels and gathers from the tiny grid: every output element is written once.
    """
    b = _pid(1)
    p = _pid(0) * BLOCK + tl.arange(0, BLOCK)
    ok = p < H * W
    cy = tl.load(rows_ptr + p // W, mask=ok, other=0)
    cx = tl.load(cols_ptr + p % W, mask=ok, other=0)
    area = (tl.load(row_start_ptr + cy + 1) - tl.load(row_start_ptr + cy)) * (
        tl.load(col_start_ptr + cx + 1) - tl.load(col_start_ptr + cx)
    )
    g = tl.load(grad_ptr + b * G * G + cy * G + cx, mask=ok, other=0.0).to(ACC)
    tl.store(dmap_ptr + b * H * W + p, (g / area.to(ACC)).to(dmap_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _blend_fwd_kernel(
    x_ptr,  # (B, C, H, W) image, any strides
    r_ptr,  # (B, C, H, W) reference, any strides (0 over the batch for one shared baseline)
    m_ptr,  # (B, S, g, g) contiguous masks, any float dtype
    out_ptr,  # (B, S, C, H, W) contiguous output, x's dtype
    rows_ptr,  # (H,) int32 grid row of each pixel row
    cols_ptr,  # (W,) int32 grid column of each pixel column
    rband_ptr,  # SMOOTH: (H, NBR) blur weights of each pixel row per cell row, relative to its own (else unused)
    cband_ptr,  # SMOOTH: (W, NBC) blur weights of each pixel column per cell column (else unused)
    stride_xb,  # x stride over the batch
    stride_xc,  # x stride over channels
    stride_xh,  # x stride over rows
    stride_xw,  # x stride over columns
    stride_rb,  # reference stride over the batch
    stride_rc,  # reference stride over channels
    stride_rh,  # reference stride over rows
    stride_rw,  # reference stride over columns
    S,  # number of masks
    C,  # channels
    H,  # height
    W,  # width
    G,  # grid size g
    ACC: tl.constexpr,  # arithmetic dtype
    SMOOTH: tl.constexpr,  # blur the upsampled masks (then clamp them to [0, 1])
    NBR: tl.constexpr,  # SMOOTH: cell rows a pixel's blur reaches, 2 D_r + 1 (1 otherwise)
    NBC: tl.constexpr,  # SMOOTH: cell columns a pixel's blur reaches, 2 D_c + 1 (1 otherwise)
    BLOCK_S: tl.constexpr,  # masks per program (power of two); grid axis 2 tiles S
    BLOCK_P: tl.constexpr,  # pixels per program
):
    """``out[b, s, c, y, x] = x + m~[b, s, y, x] * (r - x)`` (torch.lerp's two-sided form), where

        m~ = m[b, s, cell(y, x)]                                                      (SMOOTH False)
        m~ = clamp(sum_{a, e} Wr[y, a] Wc[x, e] m[b, s, cy(y) + a - D_r, cx(x) + e - D_c], 0, 1)    (SMOOTH)

    Wr, Wc are the bands of the blur matrices (see the module docstring): the blurred mask of a pixel is a weighted
    sum of the NBR x NBC grid cells around its own, gathered from the tiny grid in registers.

    A program owns (image, pixel block, mask block) for every channel: the mask values of each pixel are computed
    once, and each output element is written once.
    """
    b = _pid(1)
    p = _pid(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = p < H * W
    h = p // W
    w = p % W
    s = _pid(2) * BLOCK_S + tl.arange(0, BLOCK_S)
    ok = (s < S)[:, None] & p_ok[None, :]
    m_b = m_ptr + b * S * G * G + s[:, None] * G * G
    cy = tl.load(rows_ptr + h, mask=p_ok, other=0)
    cx = tl.load(cols_ptr + w, mask=p_ok, other=0)
    if SMOOTH:
        # Runtime loops over the taps, not static_range: unrolled, ptxas kept every tap's loads live (221-245
        # registers forward, 24-32 B spilled backward); looped, one tap at a time (see the launchers' tiles).
        m = tl.zeros([BLOCK_S, BLOCK_P], dtype=ACC)
        for a in range(NBR):
            wy = tl.load(rband_ptr + h * NBR + a, mask=p_ok, other=0.0).to(ACC)
            ry = cy + (a - NBR // 2)
            for e in range(NBC):
                wx = tl.load(cband_ptr + w * NBC + e, mask=p_ok, other=0.0).to(ACC)
                rx = cx + (e - NBC // 2)
                near = p_ok & (ry >= 0) & (ry < G) & (rx >= 0) & (rx < G)
                mv = tl.load(m_b + (ry * G + rx)[None, :], mask=ok & near[None, :], other=0.0).to(ACC)
                m += mv * (wy * wx)[None, :]
        m = tl.minimum(tl.maximum(m, 0.0), 1.0)
    else:
        m = tl.load(m_b + (cy * G + cx)[None, :], mask=ok, other=0.0).to(ACC)
    # torch.lerp's two-sided form: exact x at m = 0 and exact r at m = 1.
    low = tl.abs(m) < 0.5
    coeff = tl.where(low, m, m - 1.0)
    hw = H * W
    out_base = out_ptr + b * S * C * hw + s[:, None] * C * hw + p[None, :]
    for c in range(0, C):
        xv = tl.load(x_ptr + b * stride_xb + c * stride_xc + h * stride_xh + w * stride_xw, mask=p_ok, other=0.0)
        rv = tl.load(r_ptr + b * stride_rb + c * stride_rc + h * stride_rh + w * stride_rw, mask=p_ok, other=0.0)
        xv, rv = xv.to(ACC), rv.to(ACC)
        d = (rv - xv)[None, :]
        val = coeff * d + tl.where(low, xv[None, :], rv[None, :])
        tl.store(out_base + c * hw, val.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _blend_bwd_kernel(
    g_ptr,  # (B, S, C, H, W) contiguous gradient of the output
    x_ptr,  # (B, C, H, W) image, any strides
    r_ptr,  # (B, C, H, W) reference, any strides
    m_ptr,  # (B, S, g, g) contiguous masks
    dx_ptr,  # (B, C, H, W) contiguous gradient of x, x's dtype
    dr_ptr,  # (B, C, H, W) contiguous gradient of the reference, its dtype
    dm_ptr,  # (B, S, g, g) contiguous gradient of the masks, their dtype; SMOOTH: (B, S, g, g, NBR, NBC) partials
    row_start_ptr,  # (g + 1,) int32 cell row boundaries
    col_start_ptr,  # (g + 1,) int32 cell column boundaries
    rband_ptr,  # SMOOTH: (H, NBR) blur weights of each pixel row, relative to its own cell row (else unused)
    cband_ptr,  # SMOOTH: (W, NBC) blur weights of each pixel column (else unused)
    stride_xb,  # x stride over the batch
    stride_xc,  # x stride over channels
    stride_xh,  # x stride over rows
    stride_xw,  # x stride over columns
    stride_rb,  # reference stride over the batch
    stride_rc,  # reference stride over channels
    stride_rh,  # reference stride over rows
    stride_rw,  # reference stride over columns
    S,  # number of masks
    C,  # channels
    H,  # height
    W,  # width
    G,  # grid size g
    ACC: tl.constexpr,  # accumulation dtype
    SMOOTH: tl.constexpr,  # the forward blurred and clamped the masks
    NBR: tl.constexpr,  # SMOOTH: cell rows a pixel's blur reaches (1 otherwise)
    NBC: tl.constexpr,  # SMOOTH: cell columns a pixel's blur reaches (1 otherwise)
    SLACK: tl.constexpr,  # SMOOTH: _clamp_slack, the clamp gate's rounding allowance above 1 (a constant)
    NB_POW2: tl.constexpr,  # next power of two of NBR * NBC (the partials' register tile)
    BLOCK_S: tl.constexpr,  # masks per step (power of two); larger S loops over mask blocks
    BLOCK_P: tl.constexpr,  # pixels of the cell per step
):
    """Adjoint of the blend for one (image, cell), g = dL/dout, m~ the per-pixel mask of the forward:

        dx[b, c, y, x] = sum_s g[b, s, c, y, x] * (1 - m~[b, s, y, x]);   dr = sum_s g * m~
        e[b, s, y, x]  = sum_c g[b, s, c, y, x] * (r - x)[b, c, y, x]
        dm[b, s, cell] = sum_{(y, x) in cell} e                                         (SMOOTH False)
        SMOOTH: part[b, s, cell, a, e'] = sum_{(y, x) in cell} keep e Wr[y, a] Wc[x, e'], the share of the cell's
                pixels in the gradient of cell (cy + a - D_r, cx + e' - D_c); the launcher adds the shifted partials
                up (dm = A_r^T (e * keep) A_c). keep = [0 <= m~raw <= 1 + SLACK], the clamp's gate: the gradient
                passes at exactly 0 and 1 whatever the rounding (see the module docstring).

    The program reduces the cell's mask gradients in registers and writes dx, dr for the cell's pixels, which no
    other program touches. No atomics, deterministic, and the output gradient (the big tensor) is read exactly
    once, with smoothing too (the partials carry the halo instead of a second read). Mask blocks are the outer loop
    so one block's dm stays in registers; dx and dr then collect their sums over S in place across the blocks (the
    launcher gives them a float32 buffer when there is more than one block, so half-precision outputs round once).
    """
    cell = _pid(0)
    b = _pid(1)
    cy = cell // G
    cx = cell % G
    y0 = tl.load(row_start_ptr + cy)
    x0 = tl.load(col_start_ptr + cx)
    cw = tl.load(col_start_ptr + cx + 1) - x0
    n = (tl.load(row_start_ptr + cy + 1) - y0) * cw
    hw = H * W
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S).to(tl.int64)
        s_ok = s < S
        m_b = m_ptr + b * S * G * G + s * G * G
        if SMOOTH:
            part = tl.zeros([BLOCK_S, NB_POW2], dtype=ACC)
            slot = tl.arange(0, NB_POW2)
        else:
            m = tl.load(m_b + cell, mask=s_ok, other=0.0).to(ACC)[:, None]
            dm = tl.zeros([BLOCK_S], dtype=ACC)
        for start in range(0, n, BLOCK_P):
            idx = start + tl.arange(0, BLOCK_P)
            p_ok = idx < n
            h = y0 + idx // cw
            w = x0 + idx % cw
            p = h * W + w
            ok = s_ok[:, None] & p_ok[None, :]
            if SMOOTH:
                raw = tl.zeros([BLOCK_S, BLOCK_P], dtype=ACC)
                for a in range(NBR):
                    wy = tl.load(rband_ptr + h * NBR + a, mask=p_ok, other=0.0).to(ACC)
                    ry = cy + (a - NBR // 2)
                    for e in range(NBC):
                        wx = tl.load(cband_ptr + w * NBC + e, mask=p_ok, other=0.0).to(ACC)
                        rx = cx + (e - NBC // 2)
                        near = (ry >= 0) & (ry < G) & (rx >= 0) & (rx < G)
                        mv = tl.load(m_b + ry * G + rx, mask=s_ok & near, other=0.0).to(ACC)
                        raw += mv[:, None] * (wy * wx)[None, :]
                mt = tl.minimum(tl.maximum(raw, 0.0), 1.0)
                gm = tl.zeros([BLOCK_S, BLOCK_P], dtype=ACC)
            else:
                mt = m
            for c in range(0, C):
                xv = tl.load(
                    x_ptr + b * stride_xb + c * stride_xc + h * stride_xh + w * stride_xw, mask=p_ok, other=0.0
                )
                rv = tl.load(
                    r_ptr + b * stride_rb + c * stride_rc + h * stride_rh + w * stride_rw, mask=p_ok, other=0.0
                )
                xv, rv = xv.to(ACC), rv.to(ACC)
                offs = b * S * C * hw + s[:, None] * C * hw + c * hw + p[None, :]
                g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(ACC)
                if SMOOTH:
                    gm += g * (rv - xv)[None, :]
                else:
                    dm += tl.sum(g * (rv - xv)[None, :], axis=1)
                out = b * C * hw + c * hw + p
                # The first block starts the sums (the masked load reads nothing), later blocks add to them.
                dx = tl.load(dx_ptr + out, mask=p_ok & (s0 > 0), other=0.0).to(ACC) + tl.sum(g * (1.0 - mt), axis=0)
                dr = tl.load(dr_ptr + out, mask=p_ok & (s0 > 0), other=0.0).to(ACC) + tl.sum(g * mt, axis=0)
                tl.store(dx_ptr + out, dx.to(dx_ptr.dtype.element_ty), mask=p_ok)
                tl.store(dr_ptr + out, dr.to(dr_ptr.dtype.element_ty), mask=p_ok)
            if SMOOTH:
                # raw - 1 <= SLACK, not raw <= 1 + SLACK: a float constexpr is fp32, where 1 + SLACK rounds to 1.
                gm = tl.where((raw >= 0.0) & (raw - 1.0 <= SLACK), gm, 0.0)
                for a in range(NBR):
                    wy = tl.load(rband_ptr + h * NBR + a, mask=p_ok, other=0.0).to(ACC)
                    for e in range(NBC):
                        wx = tl.load(cband_ptr + w * NBC + e, mask=p_ok, other=0.0).to(ACC)
                        share = tl.sum(gm * (wy * wx)[None, :], axis=1)
                        part += tl.where(slot[None, :] == a * NBC + e, share[:, None], 0.0)
        if SMOOTH:
            nb = NBR * NBC
            dst = dm_ptr + ((b * S + s[:, None]) * G * G + cell) * nb + slot[None, :]
            tl.store(dst, part.to(dm_ptr.dtype.element_ty), mask=s_ok[:, None] & (slot[None, :] < nb))
        else:
            tl.store(dm_ptr + b * S * G * G + s * G * G + cell, dm.to(dm_ptr.dtype.element_ty), mask=s_ok)


# ----------------------------------------------------------------------------------------------------------------------
# Launchers (torch.library ops, so torch.compile sees them as opaque Triton calls instead of graph-breaking)
# ----------------------------------------------------------------------------------------------------------------------

_MAX_BLOCK = 1024  # elements per program step: enough to saturate a memory-bound loop, small enough for registers
_BLEND_FWD_TILE = 4096  # BLOCK_S * BLOCK_P of the blend forward (~32 values per thread per temporary at 4 warps)
_BLEND_BWD_TILE = 2048  # the backward keeps more tiles live (g, m, two products): half the forward's tile
# With smoothing the backward also holds the blurred mask tile, the per-pixel mask gradient and its clamp gate:
# at 2048 it spilled 144-240 B on both targets, at 1024 none (``python -m attr_engine_kernels.aot``). The forward
# keeps its tile (the tap loops are runtime loops, so only one tap's tiles are live at a time: 128-160 registers, no
# spills).
_BLEND_BWD_SMOOTH_TILE = 1024
_MAX_BLEND_S = 64  # masks per program of the forward (grid axis 2 tiles S)
_MAX_BLEND_BWD_S = 32  # masks per step of the backward (it loops over mask blocks)
# Largest S accepted: grid axis 2 of the forward holds at most 65535 blocks, and beyond this the output (S blended
# copies of every image) no longer fits any GPU at useful sizes anyway.
MAX_BLEND_MASKS = 65536


def _cell_block(max_area: int) -> int:
    return max(16, min(_MAX_BLOCK, triton.next_power_of_2(max_area)))


def _blend_blocks(n_masks: int, cap: int, tile: int) -> tuple[int, int]:
    block_s = min(cap, triton.next_power_of_2(max(1, n_masks)))
    return block_s, max(16, min(_MAX_BLOCK, tile // block_s))


@triton_op("attr_engine::region_pool", mutates_args=())
def _region_pool_op(
    amap: Tensor, rows: Tensor, cols: Tensor, row_start: Tensor, col_start: Tensor, g: int, block: int
) -> Tensor:
    # rows / cols are not needed here; they ride along so the backward finds them in its inputs.
    b = amap.shape[0]
    out = torch.empty((b, g, g), dtype=amap.dtype, device=amap.device)
    if out.numel() > 0:
        wrap_triton(_pool_fwd_kernel)[(g * g, b)](
            amap, out, row_start, col_start, *amap.stride(), g, ACC=tl_compute_dtype(amap.dtype), BLOCK=block
        )
    return out


@triton_op("attr_engine::region_pool_backward", mutates_args=())
def _region_pool_backward_op(
    grad: Tensor, rows: Tensor, cols: Tensor, row_start: Tensor, col_start: Tensor, g: int
) -> Tensor:
    b, h, w = grad.shape[0], rows.shape[0], cols.shape[0]
    grad = grad.contiguous()  # the gradient of a sum arrives as a stride-0 expansion
    dmap = torch.empty((b, h, w), dtype=grad.dtype, device=grad.device)
    if dmap.numel() > 0:
        grid = (triton.cdiv(h * w, _MAX_BLOCK), b)
        wrap_triton(_pool_bwd_kernel)[grid](
            grad, dmap, rows, cols, row_start, col_start, h, w, g, ACC=tl_compute_dtype(grad.dtype), BLOCK=_MAX_BLOCK
        )
    return dmap


def _region_pool_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    _, rows, cols, row_start, col_start, g, _ = inputs
    ctx.save_for_backward(rows, cols, row_start, col_start)
    ctx.g = g


def _region_pool_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    dmap = torch.ops.attr_engine.region_pool_backward(grad, *ctx.saved_tensors, ctx.g)
    return dmap, None, None, None, None, None, None


_region_pool_op.register_autograd(_region_pool_backward, setup_context=_region_pool_setup)


def _band_args(rows: Tensor, cols: Tensor, row_band: Tensor, col_band: Tensor) -> tuple[Tensor, Tensor, dict]:
    """Band pointers and constexprs of the blend kernels. Without smoothing the bands are empty and the kernels
    never read them: the int32 index maps stand in for the pointers (an empty tensor may have no address)."""
    if row_band.numel() == 0:
        return rows, cols, dict(SMOOTH=False, NBR=1, NBC=1)
    return row_band, col_band, dict(SMOOTH=True, NBR=row_band.shape[1], NBC=col_band.shape[1])


def _sum_band_partials(part: Tensor, g: int) -> Tensor:
    """(B, S, g, g, NBR, NBC) partials -> (B, S, g, g): ``part[..., cy, cx, a, e]`` belongs to cell
    (cy + a - D_r, cx + e - D_c); shares that land outside the grid have zero weight and are cropped."""
    b, n_masks, _, _, nbr, nbc = part.shape
    dr_, dc_ = nbr // 2, nbc // 2
    out = part.new_zeros(b, n_masks, g + 2 * dr_, g + 2 * dc_)
    for a in range(nbr):
        for e in range(nbc):
            out[:, :, a : a + g, e : e + g] += part[..., a, e]
    return out[:, :, dr_ : dr_ + g, dc_ : dc_ + g]


@triton_op("attr_engine::soft_mask_blend", mutates_args=())
def _soft_mask_blend_op(
    x: Tensor,
    reference: Tensor,
    masks: Tensor,
    rows: Tensor,
    cols: Tensor,
    row_start: Tensor,
    col_start: Tensor,
    max_area: int,
    row_band: Tensor,
    col_band: Tensor,
) -> Tensor:
    # row_start / col_start / max_area serve the backward, which finds them in its inputs. row_band / col_band:
    # (H, 2 D_r + 1) and (W, 2 D_c + 1) blur bands in the accumulation dtype, empty without smoothing.
    b, c, h, w = x.shape
    n_masks, g = masks.shape[1], masks.shape[2]
    masks = masks.contiguous()
    out = torch.empty((b, n_masks, c, h, w), dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        rband, cband, smooth = _band_args(rows, cols, row_band, col_band)
        block_s, block_p = _blend_blocks(n_masks, _MAX_BLEND_S, _BLEND_FWD_TILE)
        wrap_triton(_blend_fwd_kernel)[(triton.cdiv(h * w, block_p), b, triton.cdiv(n_masks, block_s))](
            x, reference, masks, out, rows, cols, rband, cband, *x.stride(), *reference.stride(), n_masks, c, h, w,
            g, ACC=tl_compute_dtype(x.dtype), BLOCK_S=block_s, BLOCK_P=block_p, **smooth,
        )  # fmt: skip
    return out


@triton_op("attr_engine::soft_mask_blend_backward", mutates_args=())
def _soft_mask_blend_backward_op(
    grad: Tensor,
    x: Tensor,
    reference: Tensor,
    masks: Tensor,
    rows: Tensor,
    cols: Tensor,
    row_start: Tensor,
    col_start: Tensor,
    max_area: int,
    row_band: Tensor,
    col_band: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    b, c, h, w = x.shape
    n_masks, g = masks.shape[1], masks.shape[2]
    grad, masks = grad.contiguous(), masks.contiguous()
    rband, cband, smooth = _band_args(rows, cols, row_band, col_band)
    tile = _BLEND_BWD_SMOOTH_TILE if smooth["SMOOTH"] else _BLEND_BWD_TILE
    block_s, block_p = _blend_blocks(n_masks, _MAX_BLEND_BWD_S, tile)
    # More than one mask block sums dx and dr in place over the blocks: in the accumulation dtype, cast once after.
    multi = n_masks > block_s
    acc = compute_dtype(x.dtype)
    dx = torch.empty((b, c, h, w), dtype=acc if multi else x.dtype, device=x.device)
    dr = torch.empty((b, c, h, w), dtype=compute_dtype(reference.dtype) if multi else reference.dtype, device=x.device)
    nbr, nbc = smooth["NBR"], smooth["NBC"]
    # With smoothing the kernel writes each cell's shares of its neighbours' gradients, summed here.
    dm = torch.empty((b, n_masks, g, g, nbr, nbc), dtype=acc, device=x.device) if smooth["SMOOTH"] else None
    dm_out = torch.empty_like(masks) if dm is None else dm
    # A per-pixel test with a runtime bound (a loaded neighbourhood maximum) spilled registers: the bound is constant.
    slack = _clamp_slack(acc, nbr, nbc) if smooth["SMOOTH"] else 0.0
    if grad.numel() > 0:
        wrap_triton(_blend_bwd_kernel)[(g * g, b)](
            grad, x, reference, masks, dx, dr, dm_out, row_start, col_start, rband, cband, *x.stride(),
            *reference.stride(), n_masks, c, h, w, g, ACC=tl_compute_dtype(x.dtype), BLOCK_S=block_s,
            BLOCK_P=min(block_p, _cell_block(max_area)), NB_POW2=triton.next_power_of_2(nbr * nbc), SLACK=slack,
            **smooth,
        )  # fmt: skip
    else:
        dm_out.zero_()
    if multi:
        dx, dr = dx.to(x.dtype), dr.to(reference.dtype)
    if dm is not None:
        dm_out = _sum_band_partials(dm, g).to(masks.dtype)
    return dx, dr, dm_out


def _soft_mask_blend_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    x, reference, masks, rows, cols, row_start, col_start, max_area, row_band, col_band = inputs
    ctx.save_for_backward(x, reference, masks, rows, cols, row_start, col_start, row_band, col_band)
    ctx.max_area = max_area


def _soft_mask_blend_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    x, reference, masks, rows, cols, row_start, col_start, row_band, col_band = ctx.saved_tensors
    dx, dr, dm = torch.ops.attr_engine.soft_mask_blend_backward(
        grad, x, reference, masks, rows, cols, row_start, col_start, ctx.max_area, row_band, col_band
    )
    return dx, dr, dm, None, None, None, None, None, None, None


_soft_mask_blend_op.register_autograd(_soft_mask_blend_backward, setup_context=_soft_mask_blend_setup)


# ----------------------------------------------------------------------------------------------------------------------
# Public ops
# ----------------------------------------------------------------------------------------------------------------------


def _check_grid(grid: int, h: int, w: int, name: str) -> int:
    g = check_int_at_least(grid, name, 1)
    if g > min(h, w):
        raise ValueError(f"{name} must be <= min(H, W) = {min(h, w)} so that no cell is empty, got {g}")
    return g


def region_pool(amap: Tensor, grid: int, offset: Sequence[float] = (0.0, 0.0)) -> Tensor:
    """Mean of ``amap`` over each cell of a ``grid`` x ``grid`` partition of the image.

    Args:
        amap: (B, H, W) float map (attribution or saliency).
        grid: g, cells per side, 1 <= g <= min(H, W); cells differ in size by at most one pixel row/column when g
            does not divide H or W (see :func:`cell_index`).
        offset: (oy, ox), each in [0, 1): shift of the grid by that fraction of a cell (grid augmentation).

    Returns:
        (B, g, g) cell means in ``amap``'s dtype (float32 accumulation for half inputs). Differentiable: each pixel
        receives its cell's gradient divided by the cell's area.

    Raises:
        ValueError: bad rank or dtype, grid out of range, or offset outside [0, 1).
    """
    check_tensor(amap, "amap", ndim=3)
    _, h, w = amap.shape
    g = _check_grid(grid, h, w, "grid")
    oy, ox = check_offset(offset)
    if use_triton(amap):
        geo = _grid(h, w, g, oy, ox, amap.device)
        return torch.ops.attr_engine.region_pool(
            amap, geo.rows, geo.cols, geo.row_start, geo.col_start, g, _cell_block(geo.max_area)
        )
    return torch.ops.attr_engine.region_pool_reference(amap, g, oy, ox)


def _check_sigma(sigma: float, h: int, w: int) -> float:
    """A finite ``smooth_sigma`` >= 0 whose reflect padding (k // 2 px) fits inside the image, as F.pad requires."""
    # Comparisons, not math.isfinite: torch.compile traces comparisons of a Python float argument, not isfinite.
    if isinstance(sigma, bool) or not isinstance(sigma, int | float) or not 0.0 <= sigma < float("inf"):
        raise ValueError(f"smooth_sigma must be a finite number >= 0 (0 = no smoothing), got {sigma!r}")
    sigma = float(sigma)
    if sigma > 0:
        k = blur_kernel_size(sigma)
        if k // 2 >= min(h, w):
            raise ValueError(
                f"smooth_sigma {sigma} needs a {k}-tap blur whose reflect padding ({k // 2} px) must be smaller than "
                f"the image side min(H, W) = {min(h, w)}"
            )
    return sigma


def soft_mask_blend_reference(x: Tensor, reference: Tensor, masks: Tensor, *, smooth_sigma: float = 0.0) -> Tensor:
    """Plain-autograd statement of :func:`soft_mask_blend` at offset (0, 0): nearest upsampling, then blend.

    ``up = interpolate(masks, (H, W), nearest)``; with ``smooth_sigma > 0`` the official AHA smoothing of ``up``:
    reflect padding, a separable Gaussian :func:`gaussian_taps` convolution and ``clamp(0, 1)``; then
    ``x + up[:, :, None] * (reference - x)[:, None]``. Nearest upsampling puts a pixel in the same cell as
    :func:`region_pool` when g divides H and W. Autograd keeps the upsampled masks and output-sized temporaries
    (the eager baseline of ``benches/bench_region.py``).

    x, reference: (B, C, H, W); masks: (B, S, g, g). Returns (B, S, C, H, W).
    """
    up = F.interpolate(masks, size=x.shape[-2:], mode="nearest")
    if smooth_sigma > 0:
        taps = gaussian_taps(smooth_sigma).to(x)
        k = taps.numel()
        flat = F.pad(up.flatten(0, 1)[:, None], (k // 2,) * 4, mode="reflect")
        up = F.conv2d(flat, (taps[:, None] * taps[None, :])[None, None]).view_as(up).clamp(0.0, 1.0)
    return x[:, None] + up[:, :, None] * (reference - x)[:, None]


def soft_mask_blend(
    x: Tensor,
    reference: Tensor,
    masks: Tensor,
    offset: Sequence[float] = (0.0, 0.0),
    *,
    smooth_sigma: float = 0.0,
    validate: bool = True,
) -> Tensor:
    """Blend each image towards its reference under S grid masks: ``out[b, s] = x + up(m_s) * (reference - x)``.

    Args:
        x: (B, C, H, W) images.
        reference: (B, C, H, W) baseline, same dtype and device as ``x``; may be an expanded view (e.g. stride 0
            over the batch for one shared baseline).
        masks: (B, S, g, g) finite soft masks (any float dtype; arithmetic in float32, float64 for float64 ``x``),
            with 1 <= g <= min(H, W); ``up`` is nearest upsampling onto the same cells as :func:`region_pool`.
        offset: (oy, ox) grid offset, each in [0, 1), as in :func:`region_pool`.
        smooth_sigma: 0 (default) blends with the upsampled masks as they are. > 0 smooths them as the official AHA
            training does: a Gaussian blur of standard deviation ``smooth_sigma`` px with
            :func:`blur_kernel_size` taps (``2 * ceil(3 * sigma) + 1``: 7 at 1.0), reflect padding, then
            ``clamp(0, 1)``; ``up(m_s)`` above is then that blurred mask. Needs ``k // 2 < min(H, W)``. The
            clamp passes the gradient wherever the blur is in [0, 1], ends included, so cells at exactly 0
            or 1 keep theirs (torch.clamp and the official code stop it there; see the module docstring).
        validate: also check that the masks are finite. That check reads them, a host-device synchronisation on a
            GPU: engine loops validate once at their entry point and pass False.

    Returns:
        (B, S, C, H, W) in ``x``'s dtype. For finite x and reference, a mask value of exactly 0 returns x and
        exactly 1 returns the reference, bit for bit (up to the sign of a zero); with smoothing, where the blurred
        mask is exactly 0 or 1. Differentiable with respect to x, reference and masks.

    Raises:
        ValueError: bad ranks, dtypes, devices, shapes, grid size, non-finite masks, offset outside [0, 1), or a
            negative, non-finite or (for the image) too wide ``smooth_sigma``.
    """
    check_tensor(x, "x", ndim=4)
    check_tensor(reference, "reference", ndim=4)
    check_same(x, "x", reference, "reference")
    if reference.shape != x.shape:
        raise ValueError(f"reference must have x's shape {tuple(x.shape)}, got {tuple(reference.shape)}")
    check_tensor(masks, "masks", ndim=4)
    if masks.device != x.device:
        raise ValueError(f"masks is on {masks.device} but x is on {x.device}")
    b, _, h, w = x.shape
    if masks.shape[0] != b:
        raise ValueError(f"masks must have x's batch size {b}, got shape {tuple(masks.shape)}")
    if not 1 <= masks.shape[1] <= MAX_BLEND_MASKS:
        raise ValueError(f"masks must hold 1 to {MAX_BLEND_MASKS} masks (S), got shape {tuple(masks.shape)}")
    if masks.shape[2] != masks.shape[3]:
        raise ValueError(f"masks must be (B, S, g, g) on a square grid, got shape {tuple(masks.shape)}")
    g = _check_grid(masks.shape[2], h, w, "masks grid size")
    sigma = _check_sigma(smooth_sigma, h, w)
    check_tensor(masks, "masks", finite=validate)
    oy, ox = check_offset(offset)
    if use_triton(x, reference, masks):
        geo = _grid(h, w, g, oy, ox, x.device)
        if sigma > 0:
            blur, acc = _smoothing(h, w, g, oy, ox, sigma, x.device), compute_dtype(x.dtype)
            row_band, col_band = blur.row_band[acc], blur.col_band[acc]
        else:
            row_band = col_band = geo.rows.new_empty(0, 1, dtype=compute_dtype(x.dtype))
        return torch.ops.attr_engine.soft_mask_blend(
            x, reference, masks, geo.rows, geo.cols, geo.row_start, geo.col_start, geo.max_area, row_band, col_band
        )
    return torch.ops.attr_engine.soft_mask_blend_reference(x, reference, masks, oy, ox, sigma)


__all__ = [
    "MAX_BLEND_MASKS",
    "blur_kernel_size",
    "cell_index",
    "gaussian_taps",
    "region_pool",
    "soft_mask_blend",
    "soft_mask_blend_reference",
]
