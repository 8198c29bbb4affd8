"""region_pool / soft_mask_blend: grid geometry, float64 gradcheck of the references, fused (Triton, through the CPU
interpreter) vs reference for outputs and every input gradient, properties, and input validation."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from attr_engine_kernels._backend import set_backend
from attr_engine_kernels.region import (
    blur_kernel_size,
    cell_index,
    gaussian_taps,
    region_pool,
    soft_mask_blend,
    soft_mask_blend_reference,
)
from tests.conftest import requires_cuda
from tests.tolerances import BF16, FP16, FP32, tol

BACKENDS = ("reference", "triton")
OFFSET = (0.4, 0.7)


def _per_cell(vals: torch.Tensor, h: int, w: int, offset: tuple[float, float]) -> torch.Tensor:
    """(B, g, g) -> (B, H, W) map that is constant on each cell (built from cell_index, independently of the ops)."""
    g = vals.shape[-1]
    rows, cols = cell_index(h, g, offset[0]), cell_index(w, g, offset[1])
    return vals[:, rows][:, :, cols]


# ----------------------------------------------------------------------------------------------------------------------
# Geometry
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size,g", [(13, 3), (10, 3), (9, 9), (224, 14), (6, 1), (100, 7), (31, 5)])
def test_cell_index_is_nearest_source_index(size: int, g: int) -> None:
    src = torch.arange(g, dtype=torch.float32).view(1, 1, g)
    expected = F.interpolate(src, size=size, mode="nearest").view(-1).long()
    assert torch.equal(cell_index(size, g), expected)


def test_cell_index_partitions_every_axis() -> None:
    pairs = [(size, g) for size in range(1, 25) for g in range(1, size + 1)] + [(82, 2), (224, 62), (384, 112)]
    for size, g in pairs:
        for frac in (0.0, 0.37, 0.999999):
            idx = cell_index(size, g, frac)
            steps = idx.diff()
            assert idx.shape == (size,) and idx.dtype == torch.int64
            assert int(idx[0]) == 0 and int(idx[-1]) == g - 1, (size, g, frac)
            assert bool(((steps == 0) | (steps == 1)).all()), (size, g, frac)  # contiguous, every cell non-empty
            if frac == 0.0:  # the exact partition is balanced (F.interpolate's float32 scale is not, e.g. 82 / 2)
                counts = torch.bincount(idx)
                assert int(counts.max() - counts.min()) <= 1, (size, g)


def test_cell_index_offset_shortens_first_cell() -> None:
    # floor((y * 2 + 5) / 10): rows 0..2 in cell 0, the last cell absorbs the remainder.
    assert cell_index(10, 2, 0.5).tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]
    assert cell_index(9, 3, 0.5).tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 2]


# ----------------------------------------------------------------------------------------------------------------------
# Reference gradients (float64)
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("g,offset", [(2, (0.3, 0.6)), (3, (0.0, 0.0))])
def test_region_pool_reference_gradcheck(g: int, offset: tuple[float, float]) -> None:
    amap = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    with set_backend("reference"):
        assert torch.autograd.gradcheck(lambda a: region_pool(a, g, offset), (amap,))


@pytest.mark.parametrize("offset", [(0.0, 0.0), (0.5, 0.2)])
def test_soft_mask_blend_reference_gradcheck(offset: tuple[float, float]) -> None:
    x = torch.randn(2, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    r0 = torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    masks = torch.rand(2, 3, 2, 2, dtype=torch.float64, requires_grad=True)
    with set_backend("reference"):
        assert torch.autograd.gradcheck(
            lambda a, r, m: soft_mask_blend(a, r.expand(2, -1, -1, -1), m, offset), (x, r0, masks)
        )


# ----------------------------------------------------------------------------------------------------------------------
# Fused vs reference
# ----------------------------------------------------------------------------------------------------------------------

# (B, H, W, g, offset, dtype): odd and non-power-of-two sizes, g not dividing H or W, g = H = W, g = 1.
CASES = [
    (2, 13, 10, 3, (0.0, 0.0), FP32),
    (2, 13, 10, 3, OFFSET, FP32),
    (1, 9, 9, 9, (0.0, 0.0), FP32),
    (1, 9, 9, 9, OFFSET, FP32),
    (2, 7, 6, 1, (0.0, 0.0), FP32),
    (2, 11, 17, 4, (0.9, 0.1), FP32),
    (2, 13, 10, 3, OFFSET, FP16),
    (2, 13, 10, 3, OFFSET, BF16),
]


def _grads(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad)]


def _blend_both(
    inputs: list[torch.Tensor], grad: torch.Tensor, offset: tuple[float, float], sigma: float = 0.0
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(float64 reference, fused) results of soft_mask_blend: output, then the gradients of x, reference, masks."""
    fn = lambda *t: soft_mask_blend(*t, offset, smooth_sigma=sigma)
    with set_backend("reference"):
        expected = _grads(fn, [t.double() for t in inputs], grad.double())
    with set_backend("triton"):
        got = _grads(fn, inputs, grad)
    return expected, got


@pytest.mark.parametrize("b,h,w,g,offset,dtype", CASES)
def test_region_pool_fused_matches_reference(b: int, h: int, w: int, g: int, offset: tuple, dtype: torch.dtype) -> None:
    amap = torch.randn(b, h, w, dtype=dtype)
    grad = torch.randn(b, g, g, dtype=dtype)
    with set_backend("reference"):
        expected = _grads(lambda a: region_pool(a, g, offset), [amap.double()], grad.double())
    with set_backend("triton"):
        got = _grads(lambda a: region_pool(a, g, offset), [amap], grad)
    for e, o in zip(expected, got, strict=True):
        assert o.dtype == dtype and o.shape == e.shape
        assert_close(o.double(), e, **tol("region_pool", dtype))


@pytest.mark.parametrize("b,h,w,g,offset,dtype", CASES)
def test_soft_mask_blend_fused_matches_reference(
    b: int, h: int, w: int, g: int, offset: tuple, dtype: torch.dtype
) -> None:
    n_masks, c = 3, 3 if g < 9 else 2
    mask_dtype = torch.float32 if dtype == FP16 else dtype  # half images with float32 masks: mixed dtypes
    x = torch.randn(b, c, h, w, dtype=dtype)
    r = torch.randn(b, c, h, w, dtype=dtype)
    masks = torch.rand(b, n_masks, g, g, dtype=mask_dtype)
    grad = torch.randn(b, n_masks, c, h, w, dtype=dtype)
    expected, got = _blend_both([x, r, masks], grad, offset)
    names, dtypes = ("out", "dx", "dr", "dmasks"), (dtype, dtype, dtype, mask_dtype)
    for name, e, o, want in zip(names, expected, got, dtypes, strict=True):
        assert o.dtype == want and o.shape == e.shape, name
        assert_close(o.double(), e, **tol("soft_mask_blend", dtype), msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("n_masks,dtype", [(33, FP32), (70, FP32), (70, FP16)])
def test_soft_mask_blend_fused_tiles_many_masks(n_masks: int, dtype: torch.dtype) -> None:
    """More masks than one program's block: the forward tiles S over the grid, the backward sums dx, dr over blocks."""
    b, c, h, w, g = 2, 2, 9, 7, 3
    x, r = torch.randn(b, c, h, w, dtype=dtype), torch.randn(b, c, h, w, dtype=dtype)
    masks = torch.rand(b, n_masks, g, g, dtype=dtype)
    grad = torch.randn(b, n_masks, c, h, w, dtype=dtype)
    expected, got = _blend_both([x, r, masks], grad, OFFSET)
    for name, e, o in zip(("out", "dx", "dr", "dmasks"), expected, got, strict=True):
        assert o.dtype == dtype and o.shape == e.shape, name
        assert_close(o.double(), e, **tol("soft_mask_blend", dtype), msg=lambda m, n=name: f"{n}: {m}")


def test_soft_mask_blend_refuses_too_many_masks() -> None:
    from attr_engine_kernels.region import MAX_BLEND_MASKS

    x = torch.zeros(1, 1, 2, 2)
    masks = torch.zeros(1, MAX_BLEND_MASKS + 1, 1, 1).expand(1, -1, 1, 1)
    with pytest.raises(ValueError, match=f"1 to {MAX_BLEND_MASKS} masks"):
        soft_mask_blend(x, x, masks)


def test_soft_mask_blend_fused_strided_inputs() -> None:
    """A shared baseline expanded over the batch (stride 0) and a non-contiguous image view."""
    b, c, h, w, g = 3, 2, 8, 11, 3
    base = torch.randn(b, c, h, w + 2)
    r0 = torch.randn(1, c, h, w)
    masks = torch.rand(b, 2, g, g)
    grad = torch.randn(b, 2, c, h, w)
    results = []
    for backend in BACKENDS:
        with set_backend(backend):
            results.append(
                _grads(
                    lambda xb, r, m: soft_mask_blend(xb[..., 1:-1], r.expand(b, -1, -1, -1), m, OFFSET),
                    [base, r0, masks],
                    grad,
                )
            )
    for e, o in zip(*results, strict=True):
        assert_close(o, e, **tol("soft_mask_blend", FP32))
    assert results[1][1][..., 0].abs().max() == 0  # columns outside the view get no gradient


@requires_cuda
@pytest.mark.parametrize("g,offset", [(7, (0.0, 0.0)), (28, (0.9, 0.1))])
def test_smoothed_blend_cuda_matches_reference(g: int, offset: tuple[float, float]) -> None:
    b, s, c, h = 2, 16, 3, 224
    x, r = torch.randn(b, c, h, h, device="cuda"), torch.randn(b, c, h, h, device="cuda")
    masks = torch.rand(b, s, g, g, device="cuda")
    grad = torch.randn(b, s, c, h, h, device="cuda")
    expected, got = _blend_both([x, r, masks], grad, offset, 1.0)
    for e, o in zip(expected, got, strict=True):
        assert_close(o.double(), e, **tol("soft_mask_blend", FP32))


@requires_cuda
@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_region_ops_cuda_match_reference(dtype: torch.dtype) -> None:
    b, s, c, h, w, g = 2, 16, 3, 224, 224, 14
    x, r = torch.randn(b, c, h, w, device="cuda", dtype=dtype), torch.randn(b, c, h, w, device="cuda", dtype=dtype)
    masks = torch.rand(b, s, g, g, device="cuda", dtype=dtype)
    grad = torch.randn(b, s, c, h, w, device="cuda", dtype=dtype)
    expected, got = _blend_both([x, r, masks], grad, OFFSET)
    with set_backend("triton"):
        again = _grads(lambda *t: soft_mask_blend(*t, OFFSET), [x, r, masks], grad)
    for e, o, o2 in zip(expected, got, again, strict=True):
        assert_close(o.double(), e, **tol("soft_mask_blend", dtype))
        assert torch.equal(o, o2)  # deterministic backward
    amap = x[:, 0]
    with set_backend("triton"):
        pooled = region_pool(amap, g, OFFSET)
    with set_backend("reference"):
        assert_close(pooled.double(), region_pool(amap.double(), g, OFFSET), **tol("region_pool", dtype))


# ----------------------------------------------------------------------------------------------------------------------
# Mask smoothing (the official AHA training's Gaussian blur of the upsampled masks)
# ----------------------------------------------------------------------------------------------------------------------


def _official_blend(
    x: torch.Tensor, r: torch.Tensor, masks: torch.Tensor, offset: tuple, sigma: float, clamp: bool = True
) -> torch.Tensor:
    """The official formulation, independently of the op's blur matrices: per-pixel masks from cell_index, F.pad
    "reflect", conv2d with the normalised outer product of the 1-D Gaussian, clamp to [0, 1] (``clamp`` False: the
    linear blur alone), torch.lerp."""
    b, _, h, w = x.shape
    g = masks.shape[-1]
    up = masks[:, :, cell_index(h, g, offset[0])][:, :, :, cell_index(w, g, offset[1])]
    k = blur_kernel_size(sigma)
    pos = torch.arange(k, dtype=torch.float64) - (k - 1) / 2.0
    taps = torch.exp(-pos * pos / (2.0 * sigma * sigma))
    kernel = taps[:, None] * taps[None, :]
    kernel = (kernel / kernel.sum()).to(x.dtype).view(1, 1, k, k)
    flat = F.pad(up.reshape(-1, 1, h, w), (k // 2,) * 4, mode="reflect")
    smooth = F.conv2d(flat, kernel).view(b, -1, h, w)
    smooth = smooth.clamp(0.0, 1.0) if clamp else smooth
    return torch.lerp(x[:, None], r[:, None], smooth[:, :, None])


@pytest.mark.parametrize("sigma,taps", [(1.0, 7), (0.5, 5), (64 / 224, 3), (1.01, 9), (2.0, 13)])
def test_blur_kernel_size_is_the_official_rule(sigma: float, taps: int) -> None:
    assert blur_kernel_size(sigma) == taps
    t = gaussian_taps(sigma)
    assert t.shape == (taps,) and abs(float(t.sum()) - 1.0) < 1e-15
    assert torch.equal(t, t.flip(0)) and int(t.argmax()) == taps // 2


# (H, W, g, offset, sigma): 1-px cells (the blur reaches 3 cells each way), g not dividing H or W, a short first
# cell from the offset, a grid of 2 with a wide blur, and a sigma below one pixel (3 taps).
SMOOTH_CASES = [
    (13, 10, 3, (0.0, 0.0), 1.0),
    (13, 10, 3, OFFSET, 1.0),
    (9, 9, 9, OFFSET, 1.0),
    (11, 17, 4, (0.9, 0.1), 0.7),
    (16, 16, 2, (0.0, 0.0), 2.0),
    (12, 14, 5, (0.25, 0.6), 0.3),
]


@pytest.mark.parametrize("h,w,g,offset,sigma", SMOOTH_CASES)
def test_smoothed_reference_matches_the_official_formulation(
    h: int, w: int, g: int, offset: tuple[float, float], sigma: float
) -> None:
    """Forward and every gradient, float64; masks reach outside [0, 1] so the clamp (and its zero gradient) acts."""
    b, s, c = 2, 3, 2
    x, r = torch.randn(b, c, h, w, dtype=torch.float64), torch.randn(b, c, h, w, dtype=torch.float64)
    masks = torch.rand(b, s, g, g, dtype=torch.float64) * 1.4 - 0.2
    grad = torch.randn(b, s, c, h, w, dtype=torch.float64)
    expected = _grads(lambda *t: _official_blend(*t, offset, sigma), [x, r, masks], grad)
    with set_backend("reference"):
        got = _grads(lambda *t: soft_mask_blend(*t, offset, smooth_sigma=sigma), [x, r, masks], grad)
    for name, e, o in zip(("out", "dx", "dr", "dmasks"), expected, got, strict=True):
        assert_close(o, e, atol=1e-12, rtol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("offset", [(0.0, 0.0), (0.6, 0.3)])
def test_smoothed_reference_gradcheck(offset: tuple[float, float]) -> None:
    # Masks inside (0.05, 0.95): the blur stays off the clamp's kinks, where gradcheck's finite differences jump.
    x = torch.randn(2, 2, 8, 7, dtype=torch.float64, requires_grad=True)
    r0 = torch.randn(1, 2, 8, 7, dtype=torch.float64, requires_grad=True)
    masks = (torch.rand(2, 3, 3, 3, dtype=torch.float64) * 0.9 + 0.05).requires_grad_()
    with set_backend("reference"):
        assert torch.autograd.gradcheck(
            lambda a, r, m: soft_mask_blend(a, r.expand(2, -1, -1, -1), m, offset, smooth_sigma=1.0), (x, r0, masks)
        )


@pytest.mark.parametrize("dtype", [FP32, torch.float64])
@pytest.mark.parametrize("backend", BACKENDS)
def test_smoothed_blend_gradient_passes_at_cells_exactly_zero_and_one(backend: str, dtype: torch.dtype) -> None:
    """The clamp after the blur passes the gradient at cells of exactly 0 and 1 (module docstring of
    kernels.region): for masks in [0, 1] the mask gradient is the linear blur's adjoint, on both paths and in both
    dtypes. Pins the rule: torch.clamp's (zero gradient at exactly 0 and 1) fails on the all-zero and all-one
    masks, and a gate that compares the rounded blur with 1 fails where a blur of ones rounds above 1."""
    b, c, h, w, g, sigma = 1, 2, 13, 10, 3, 1.0
    x, r = torch.randn(b, c, h, w, dtype=torch.float64), torch.randn(b, c, h, w, dtype=torch.float64)
    masks = torch.zeros(b, 4, g, g, dtype=torch.float64)  # mask 0: all zero
    masks[0, 1] = 1.0  # all one
    masks[0, 2, 1], masks[0, 2, 2] = 0.4, 1.0  # rows of 0 and of 1 next to a fractional row
    masks[0, 3] = torch.tensor([[0.0, 0.3, 1.0], [1.0, 0.5, 0.0], [0.7, 1.0, 0.0]])
    grad = torch.randn(b, 4, c, h, w, dtype=torch.float64)
    linear = lambda *t: _official_blend(*t, OFFSET, sigma, clamp=False)
    expected = _grads(linear, [x, r, masks], grad)[3]
    inputs = [t.to(dtype) for t in (x, r, masks)]
    with set_backend(backend):
        got = _grads(lambda *t: soft_mask_blend(*t, OFFSET, smooth_sigma=sigma), inputs, grad.to(dtype))[3]
    tolerance = dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else tol("soft_mask_blend", FP32)
    assert_close(got.double(), expected, **tolerance)


@pytest.mark.parametrize("backend", BACKENDS)
def test_smoothing_reflects_at_the_edges(backend: str) -> None:
    """One-pixel cells, one hot cell next to the corner. Reflect padding maps pixel -1 to 1: pixel 0 sees pixel 1
    through its taps at offsets -1 and +1, pixel 1 sees itself at offsets 0 and -2 (zero or replicate padding would
    count one tap each)."""
    n, sigma = 8, 1.0
    t = gaussian_taps(sigma)
    mid = t.numel() // 2
    masks = torch.zeros(1, 1, n, n)
    masks[0, 0, 1, 1] = 1.0
    with set_backend(backend):
        out = soft_mask_blend(torch.zeros(1, 1, n, n), torch.ones(1, 1, n, n), masks, smooth_sigma=sigma)[0, 0, 0]
    w0, w1 = 2 * float(t[mid + 1]), float(t[mid] + t[mid + 2])  # weight of pixel 1 seen from pixel 0, from itself
    assert_close(out[0, 0].item(), w0 * w0, **tol("soft_mask_blend", FP32))
    assert_close(out[0, 1].item(), w0 * w1, **tol("soft_mask_blend", FP32))
    assert_close(out[1, 1].item(), w1 * w1, **tol("soft_mask_blend", FP32))
    assert_close(out, out.T, **tol("soft_mask_blend", FP32))  # the same blur along rows and columns


@pytest.mark.parametrize(
    "b,h,w,g,offset,sigma,dtype",
    [(2, *case, FP32) for case in SMOOTH_CASES] + [(2, 13, 10, 3, OFFSET, 1.0, dt) for dt in (FP16, BF16)],
)
def test_smoothed_blend_fused_matches_reference(
    b: int, h: int, w: int, g: int, offset: tuple, sigma: float, dtype: torch.dtype
) -> None:
    n_masks, c = 3, 2
    mask_dtype = torch.float32 if dtype == FP16 else dtype
    x, r = torch.randn(b, c, h, w, dtype=dtype), torch.randn(b, c, h, w, dtype=dtype)
    masks = (torch.rand(b, n_masks, g, g) * 1.4 - 0.2).to(mask_dtype)
    grad = torch.randn(b, n_masks, c, h, w, dtype=dtype)
    expected, got = _blend_both([x, r, masks], grad, offset, sigma)
    names, dtypes = ("out", "dx", "dr", "dmasks"), (dtype, dtype, dtype, mask_dtype)
    for name, e, o, want in zip(names, expected, got, dtypes, strict=True):
        assert o.dtype == want and o.shape == e.shape, name
        assert_close(o.double(), e, **tol("soft_mask_blend", dtype), msg=lambda m, n=name: f"{n}: {m}")


def test_smoothed_blend_fused_tiles_many_masks() -> None:
    """More masks than one backward block: the partial cell gradients of every block reach their own masks."""
    b, c, h, w, g, n_masks = 1, 2, 9, 7, 3, 40
    x, r = torch.randn(b, c, h, w), torch.randn(b, c, h, w)
    masks = torch.rand(b, n_masks, g, g)
    grad = torch.randn(b, n_masks, c, h, w)
    expected, got = _blend_both([x, r, masks], grad, OFFSET, 1.0)
    for name, e, o in zip(("out", "dx", "dr", "dmasks"), expected, got, strict=True):
        assert_close(o.double(), e, **tol("soft_mask_blend", FP32), msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_smoothing_zero_is_no_smoothing_and_constant_masks_stay_constant(backend: str) -> None:
    b, s, c, h, w, g = 2, 3, 2, 9, 7, 3
    x, r = torch.randn(b, c, h, w), torch.randn(b, c, h, w)
    masks = torch.rand(b, s, g, g)
    with set_backend(backend):
        plain = soft_mask_blend(x, r, masks, OFFSET)
        assert torch.equal(soft_mask_blend(x, r, masks, OFFSET, smooth_sigma=0.0), plain)
        zeros = soft_mask_blend(x, r, torch.zeros(b, s, g, g), OFFSET, smooth_sigma=1.0)
        half = soft_mask_blend(x, r, torch.full((b, s, g, g), 0.5), OFFSET, smooth_sigma=1.0)
        smooth = soft_mask_blend(x, r, masks, OFFSET, smooth_sigma=1.0)
    assert torch.equal(zeros, x[:, None].expand_as(zeros))  # a blur of zeros is exactly zero
    assert_close(half, torch.lerp(x, r, 0.5)[:, None].expand_as(half), **tol("soft_mask_blend", FP32))
    assert not torch.allclose(smooth, plain)  # the blur moved mask values across cell edges


# ----------------------------------------------------------------------------------------------------------------------
# Properties (both backends)
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_region_pool_of_constant_is_constant(backend: str) -> None:
    with set_backend(backend):
        pooled = region_pool(torch.full((2, 13, 10), 3.25), 3, OFFSET)
    assert_close(pooled, torch.full((2, 3, 3), 3.25), **tol("region_pool", FP32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset", [(0.0, 0.0), OFFSET])
def test_pool_then_blend_recovers_per_cell_map(backend: str, offset: tuple[float, float]) -> None:
    b, h, w, g = 2, 13, 10, 3
    vals = torch.rand(b, g, g)
    amap = _per_cell(vals, h, w, offset)
    with set_backend(backend):
        pooled = region_pool(amap, g, offset)
        up = soft_mask_blend(torch.zeros(b, 1, h, w), torch.ones(b, 1, h, w), pooled[:, None], offset)
    assert_close(pooled, vals, **tol("region_pool", FP32))
    assert_close(up[:, 0, 0], amap, **tol("soft_mask_blend", FP32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [FP32, FP16])
def test_blend_with_zero_masks_is_x_and_ones_is_reference(backend: str, dtype: torch.dtype) -> None:
    b, s, c, h, w, g = 2, 3, 3, 9, 7, 3
    x, r = torch.randn(b, c, h, w, dtype=dtype), torch.randn(b, c, h, w, dtype=dtype)
    with set_backend(backend):
        zeros = soft_mask_blend(x, r, torch.zeros(b, s, g, g), OFFSET)
        ones = soft_mask_blend(x, r, torch.ones(b, s, g, g), OFFSET)
    assert zeros.dtype == dtype and zeros.shape == (b, s, c, h, w)
    assert torch.equal(zeros, x[:, None].expand_as(zeros))  # bitwise
    assert torch.equal(ones, r[:, None].expand_as(ones))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset", [(0.0, 0.0), (0.25, 0.8)])
def test_area_weighted_pool_mean_is_map_mean(backend: str, offset: tuple[float, float]) -> None:
    b, h, w, g = 3, 13, 10, 4
    amap = torch.randn(b, h, w, dtype=torch.float64 if backend == "reference" else torch.float32)
    area = torch.bincount(cell_index(h, g, offset[0]))[:, None] * torch.bincount(cell_index(w, g, offset[1]))[None, :]
    with set_backend(backend):
        pooled = region_pool(amap, g, offset)
    assert_close((pooled * area).sum((1, 2)) / (h * w), amap.mean((1, 2)), **tol("region_pool", FP32))


# ----------------------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------------------

_X, _R, _M = torch.zeros(2, 3, 6, 5), torch.zeros(2, 3, 6, 5), torch.zeros(2, 4, 3, 3)
_BAD_POOL = [
    (lambda: region_pool(torch.zeros(6, 5), 2), "amap must have 3 dimensions"),
    (lambda: region_pool(torch.zeros(1, 6, 5, dtype=torch.int64), 2), "amap must be float"),
    (lambda: region_pool(torch.zeros(1, 6, 5), 0), "grid must be an integer >= 1"),
    (lambda: region_pool(torch.zeros(1, 6, 5), 2.0), "grid must be an integer"),
    (lambda: region_pool(torch.zeros(1, 6, 5), 6), r"grid must be <= min\(H, W\) = 5"),
    (lambda: region_pool(torch.zeros(1, 6, 5), 2, (1.0, 0.0)), r"offset entries .* \[0, 1\)"),
    (lambda: region_pool(torch.zeros(1, 6, 5), 2, (-0.1, 0.0)), r"offset entries .* \[0, 1\)"),
    (lambda: region_pool(torch.zeros(1, 6, 5), 2, (0.1,)), "offset must be a pair"),
    (lambda: cell_index(5, 6), r"g must be <= size"),
    (lambda: cell_index(5, 2, 1.5), r"frac must be .* \[0, 1\)"),
]
_BAD_BLEND = [
    (lambda: soft_mask_blend(_X[0], _R, _M), "x must have 4 dimensions"),
    (lambda: soft_mask_blend(_X, _R[:, :2], _M), "reference must have x's shape"),
    (lambda: soft_mask_blend(_X, _R.half(), _M), "reference has dtype"),
    (lambda: soft_mask_blend(_X, _R, _M[0]), "masks must have 4 dimensions"),
    (lambda: soft_mask_blend(_X, _R, _M.long()), "masks must be float"),
    (lambda: soft_mask_blend(_X, _R, _M[:1]), "masks must have x's batch size 2"),
    (lambda: soft_mask_blend(_X, _R, _M[:, :0]), "1 to 65536 masks"),
    (lambda: soft_mask_blend(_X, _R, _M[..., :2]), "square grid"),
    (lambda: soft_mask_blend(_X, _R, torch.zeros(2, 4, 6, 6)), r"masks grid size must be <= min\(H, W\) = 5"),
    (lambda: soft_mask_blend(_X, _R, torch.full((2, 4, 3, 3), float("nan"))), "masks contains NaN"),
    (lambda: soft_mask_blend(_X, _R, _M, (0.5, 1.0)), r"offset entries .* \[0, 1\)"),
    (lambda: soft_mask_blend(_X, _R, _M, smooth_sigma=-0.5), "smooth_sigma must be a finite number >= 0"),
    (lambda: soft_mask_blend(_X, _R, _M, smooth_sigma=float("nan")), "smooth_sigma must be a finite number"),
    (lambda: soft_mask_blend(_X, _R, _M, smooth_sigma=True), "smooth_sigma must be a finite number"),
    (lambda: soft_mask_blend(_X, _R, _M, smooth_sigma=2.0), r"13-tap blur .* \(6 px\) .* min\(H, W\) = 5"),
]


@pytest.mark.parametrize("call,match", _BAD_POOL + _BAD_BLEND)
def test_bad_inputs_raise_value_error(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("sigma", [0.0, 1.0])
def test_blend_matches_its_plain_autograd_reference(sigma: float) -> None:
    """soft_mask_blend (reference backend) against soft_mask_blend_reference where their cells coincide (g | H, W)."""
    x = torch.randn(2, 3, 24, 16, dtype=torch.float64, requires_grad=True)
    r = torch.randn(2, 3, 24, 16, dtype=torch.float64, requires_grad=True)
    m = torch.rand(2, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 3, 3, 24, 16, dtype=torch.float64)
    with set_backend("reference"):
        got = soft_mask_blend(x, r, m, smooth_sigma=sigma)
    want = soft_mask_blend_reference(x, r, m, smooth_sigma=sigma)
    assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, (x, r, m), g), torch.autograd.grad(want, (x, r, m), g), strict=True):
        assert_close(a, b)
