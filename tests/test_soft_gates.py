"""soft_gate and soft_maxpool2d: exact forwards, softened backwards, references vs the Triton kernels (interpreter)."""

import math

import pytest
import torch
import torch.nn.functional as F

from attr_engine_kernels import set_backend
from attr_engine_kernels.soft_gates import (
    DEFAULT_TAU,
    SOFT_GATE_KINDS,
    _soft_gate_pytorch,
    _soft_maxpool2d_pytorch,
    soft_gate,
    soft_gate_reference,
    soft_maxpool2d,
    soft_maxpool2d_reference,
)
from tests.conftest import requires_cuda
from tests.tolerances import tol

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPE = (3, 5, 7, 9)
ACT = {
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
}
POOLS = {
    "resnet": dict(kernel_size=3, stride=2, padding=1),
    "vgg": dict(kernel_size=2, stride=2),
    "ceil": dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
    "rect_dilated": dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
}
_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT_VIEW[t.dtype])


def _value_and_grad(fn, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_(True)
    y = fn(x)
    (dx,) = torch.autograd.grad(y, x, g)
    return y.detach(), dx


def _special_values(dtype: torch.dtype) -> torch.Tensor:
    """A (3, 5, 7, 9) tensor with signed zeros, tiny and huge values and non-finite entries in its first row."""
    z = torch.randn(SHAPE) * 3
    special = torch.tensor([-0.0, 0.0, 1e-30, -1e-30, 60.0, -60.0, -200.0, math.inf, -math.inf, math.nan])
    z.view(-1)[: special.numel()] = special
    return z.to(dtype)


# ------------------------------------------------------------------------------------------------ soft_gate


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("kind", SOFT_GATE_KINDS)
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
def test_soft_gate_forward_is_bit_identical(backend: str, kind: str, dtype: torch.dtype) -> None:
    z = _special_values(dtype)
    with set_backend(backend):
        y = soft_gate(z, kind, 0.5)
    assert y.dtype == dtype
    assert torch.equal(_bits(y), _bits(ACT[kind](z)))


@pytest.mark.parametrize("kind", SOFT_GATE_KINDS)
def test_soft_gate_backward_is_the_gate(kind: str) -> None:
    tau = 0.7
    z, g = torch.randn(SHAPE, dtype=torch.float64) * 2, torch.randn(SHAPE, dtype=torch.float64)
    gate = torch.sigmoid(z / tau) if kind == "silu" else torch.special.ndtr(z / tau)
    for fn in (_soft_gate_pytorch, soft_gate_reference, soft_gate):
        _, dz = _value_and_grad(lambda t, fn=fn: fn(t, kind, tau), z, g)
        torch.testing.assert_close(dz, g * gate, atol=1e-14, rtol=1e-12)


@pytest.mark.parametrize("kind", SOFT_GATE_KINDS)
def test_soft_gate_gradcheck_against_smooth_surrogate(kind: str) -> None:
    # The soft backward is the true derivative of S(z) = integral of the gate: tau * softplus(z / tau) for the
    # sigmoid gate, tau * (u Phi(u) + phi(u)) with u = z / tau for the Phi gate. Swapping the forward value for S
    # (detached, so the backward is untouched) lets gradcheck compare our backward with finite differences of S.
    tau = 0.8

    def surrogate(z: torch.Tensor) -> torch.Tensor:
        u = z / tau
        if kind == "silu":
            return tau * F.softplus(u)
        return tau * (u * torch.special.ndtr(u) + torch.exp(-0.5 * u * u) / math.sqrt(2 * math.pi))

    def f(z: torch.Tensor) -> torch.Tensor:
        return _soft_gate_pytorch(z, kind, tau) - ACT[kind](z).detach() + surrogate(z).detach()

    z = (torch.randn(2, 3, 4, dtype=torch.float64) * 2).requires_grad_(True)
    assert torch.autograd.gradcheck(f, (z,), eps=1e-6, atol=1e-7)


def test_soft_gate_default_tau_follows_kind() -> None:
    z, g = torch.randn(4, 6), torch.randn(4, 6)
    for kind in SOFT_GATE_KINDS:
        _, d_default = _value_and_grad(lambda t, k=kind: soft_gate(t, k), z, g)
        _, d_explicit = _value_and_grad(lambda t, k=kind: soft_gate(t, k, DEFAULT_TAU[k]), z, g)
        assert torch.equal(d_default, d_explicit)
    assert DEFAULT_TAU["relu"] != DEFAULT_TAU["silu"]


@pytest.mark.parametrize("kind", SOFT_GATE_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_soft_gate_triton_matches_reference(kind: str, dtype: torch.dtype) -> None:
    tau = 0.6
    z, g = (torch.randn(SHAPE) * 2).to(dtype), torch.randn(SHAPE).to(dtype)
    with set_backend("triton"):
        y, dz = _value_and_grad(lambda t: soft_gate(t, kind, tau), z, g)
    _, dz_ref = _value_and_grad(lambda t: _soft_gate_pytorch(t, kind, tau), z.double(), g.double())
    assert torch.equal(_bits(y), _bits(ACT[kind](z)))
    assert dz.dtype == dtype
    torch.testing.assert_close(dz.double(), dz_ref, **tol("soft_gate", dtype))


def test_soft_gate_triton_layouts() -> None:
    # channels-last z and grad (flat fast path), a transposed z, and the expanded gradient of y.sum().
    z = torch.randn(2, 6, 5, 3)
    cases = [
        (z.to(memory_format=torch.channels_last), torch.randn(2, 6, 5, 3).to(memory_format=torch.channels_last)),
        (z.transpose(1, 3), torch.randn(2, 3, 5, 6)),
        (z, torch.ones(()).expand(2, 6, 5, 3)),
    ]
    for zc, gc in cases:
        with set_backend("triton"):
            _, dz = _value_and_grad(lambda t: soft_gate(t, "gelu", 0.9), zc, gc)
        _, dz_ref = _value_and_grad(lambda t: _soft_gate_pytorch(t, "gelu", 0.9), zc, gc)
        torch.testing.assert_close(dz, dz_ref, **tol("soft_gate", torch.float32))
    # The fast path keeps the caller's memory format for the gradient.
    with set_backend("triton"):
        _, dz = _value_and_grad(lambda t: soft_gate(t, "relu"), cases[0][0], cases[0][1])
    assert dz.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_soft_gate_small_tau_gives_relu_gradient(backend: str) -> None:
    z = torch.randn(SHAPE)
    z = torch.where(z.abs() < 0.05, torch.full_like(z, 0.5), z)  # stay away from the kink
    g = torch.randn(SHAPE)
    with set_backend(backend):
        _, dz = _value_and_grad(lambda t: soft_gate(t, "relu", 1e-4), z, g)
    _, dz_true = _value_and_grad(torch.relu, z, g)
    assert torch.equal(dz, dz_true)


def test_soft_gate_detach_formulation_agrees_on_finite_inputs() -> None:
    z, g = torch.randn(SHAPE) * 3, torch.randn(SHAPE)
    for kind in SOFT_GATE_KINDS:
        y_d, dz_d = _value_and_grad(lambda t, k=kind: soft_gate_reference(t, k, 0.5), z, g)
        y_r, dz_r = _value_and_grad(lambda t, k=kind: _soft_gate_pytorch(t, k, 0.5), z, g)
        assert torch.equal(y_d, y_r)  # equal as numbers (the detach sum only loses the sign of zero)
        torch.testing.assert_close(dz_d, dz_r, atol=0.0, rtol=0.0)


def test_soft_gate_rejects_bad_inputs() -> None:
    z = torch.randn(3, 4)
    with pytest.raises(ValueError, match="relu, gelu, gelu_tanh, silu"):
        soft_gate(z, "tanh")
    for bad_tau in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="tau"):
            soft_gate(z, "relu", bad_tau)
    with pytest.raises(ValueError, match="z must be float32"):
        soft_gate(torch.ones(3, dtype=torch.int64), "relu")
    with pytest.raises(ValueError, match=r"z must be a torch\.Tensor"):
        soft_gate([1.0, 2.0], "relu")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- soft_maxpool2d


def _pairs(cfg: dict) -> tuple[tuple[int, int], ...]:
    def pair(v: object) -> tuple[int, int]:
        return (v, v) if isinstance(v, int) else tuple(v)  # type: ignore[return-value]

    k = pair(cfg["kernel_size"])
    return k, pair(cfg.get("stride", k)), pair(cfg.get("padding", 0)), pair(cfg.get("dilation", 1))


def _smooth_max_pool(x: torch.Tensor, cfg: dict, tau: float) -> torch.Tensor:
    """tau * logsumexp(window / tau) over each window's in-bounds pixels, window by window (no unfold, no padding).

    Its true gradient is exactly the softmax spreading soft_maxpool2d's backward promises.
    """
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = _pairs(cfg)
    oh, ow = F.max_pool2d(x.detach(), **cfg).shape[-2:]
    rows = []
    for i in range(oh):
        hs = [i * sh - ph + a * dh for a in range(kh) if 0 <= i * sh - ph + a * dh < x.shape[-2]]
        cols = []
        for j in range(ow):
            ws = [j * sw - pw + b * dw for b in range(kw) if 0 <= j * sw - pw + b * dw < x.shape[-1]]
            window = x[:, :, hs][:, :, :, ws].flatten(2)
            cols.append(tau * torch.logsumexp(window / tau, dim=2))
        rows.append(torch.stack(cols, dim=-1))
    return torch.stack(rows, dim=-2)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_soft_maxpool2d_forward_is_bit_identical(backend: str, pool: str, dtype: torch.dtype) -> None:
    x = (torch.randn(SHAPE) * 4).round().to(dtype)  # rounding makes ties inside windows
    x[0, 0, 0, 0] = math.nan
    x[1, 1, 2, 2] = -math.inf
    with set_backend(backend):
        y = soft_maxpool2d(x, **POOLS[pool])
    assert torch.equal(_bits(y), _bits(F.max_pool2d(x, **POOLS[pool])))


@pytest.mark.parametrize("pool", list(POOLS))
def test_soft_maxpool2d_backward_is_softmax_spreading(pool: str) -> None:
    tau = 0.3
    x = torch.randn(2, 3, 7, 6, dtype=torch.float64)
    g = torch.randn_like(F.max_pool2d(x, **POOLS[pool]))
    _, expected = _value_and_grad(lambda t: _smooth_max_pool(t, POOLS[pool], tau), x, g)
    for fn in (_soft_maxpool2d_pytorch, soft_maxpool2d_reference, soft_maxpool2d):
        _, dx = _value_and_grad(lambda t, fn=fn: fn(t, **POOLS[pool], tau=tau), x, g)
        torch.testing.assert_close(dx, expected, atol=1e-13, rtol=1e-12)


@pytest.mark.parametrize("pool", ["resnet", "vgg", "ceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_soft_maxpool2d_pooled_backward_equals_the_unfolded_one(pool: str, dtype: torch.dtype) -> None:
    """The reference's fast form (a sum pooling and its adjoint) against the unfolded softmax it replaces."""
    from attr_engine_kernels.soft_gates import (
        _pool_geometry,
        _soft_maxpool2d_backward_pooled,
        _soft_maxpool2d_backward_unfolded,
    )

    cfg, tau = POOLS[pool], 0.3
    x = torch.randn(2, 3, 9, 7, dtype=dtype) * 4
    geom, oh, ow = _pool_geometry(
        x, cfg["kernel_size"], cfg.get("stride"), cfg.get("padding", 0), 1, cfg.get("ceil_mode", False)
    )
    g = torch.randn(2, 3, oh, ow, dtype=dtype)
    pooled = _soft_maxpool2d_backward_pooled(x, g, geom, cfg.get("ceil_mode", False), tau)
    assert pooled is not None and pooled.dtype == dtype
    unfolded = _soft_maxpool2d_backward_unfolded(x, g, geom, oh, ow, tau)
    torch.testing.assert_close(pooled, unfolded, **({"atol": 1e-12, "rtol": 1e-10} if dtype == torch.float64 else {}))


def test_soft_maxpool2d_windows_far_below_their_plane_maximum_fall_back_to_the_unfolded_form() -> None:
    """A plane whose maximum sits 1000 tau above a window underflows the pooled form's float64 sums: the reference
    must notice and still give the exact softmax spreading, not NaN."""
    from attr_engine_kernels.soft_gates import _pool_geometry, _soft_maxpool2d_backward_pooled

    cfg, tau = POOLS["resnet"], 0.3
    x = torch.randn(1, 2, 8, 8, dtype=torch.float64)
    x[0, 0, 0, 0] = 300.0
    geom, _, _ = _pool_geometry(x, 3, 2, 1, 1, False)
    g = torch.randn_like(F.max_pool2d(x, **cfg))
    assert _soft_maxpool2d_backward_pooled(x, g, geom, False, tau) is None
    _, expected = _value_and_grad(lambda t: _smooth_max_pool(t, cfg, tau), x, g)
    _, dx = _value_and_grad(lambda t: _soft_maxpool2d_pytorch(t, **cfg, tau=tau), x, g)
    assert torch.isfinite(dx).all()
    torch.testing.assert_close(dx, expected, atol=1e-13, rtol=1e-12)


@pytest.mark.parametrize("pool", ["resnet", "ceil", "rect_dilated"])
def test_soft_maxpool2d_gradcheck_against_smooth_surrogate(pool: str) -> None:
    cfg, tau = POOLS[pool], 0.5

    def f(x: torch.Tensor) -> torch.Tensor:
        swap = _smooth_max_pool(x, cfg, tau) - F.max_pool2d(x, **cfg)
        return _soft_maxpool2d_pytorch(x, **cfg, tau=tau) + swap.detach()

    x = torch.randn(1, 2, 5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_soft_maxpool2d_triton_matches_reference(pool: str, dtype: torch.dtype) -> None:
    cfg, tau = POOLS[pool], 0.3
    x = torch.randn(SHAPE).to(dtype)
    g = torch.randn_like(F.max_pool2d(x, **cfg))
    with set_backend("triton"):
        y, dx = _value_and_grad(lambda t: soft_maxpool2d(t, **cfg, tau=tau), x, g)
    _, dx_ref = _value_and_grad(lambda t: _soft_maxpool2d_pytorch(t, **cfg, tau=tau), x.double(), g.double())
    assert torch.equal(_bits(y), _bits(F.max_pool2d(x, **cfg)))
    assert dx.dtype == dtype
    torch.testing.assert_close(dx.double(), dx_ref, **tol("soft_maxpool2d", dtype))


def test_soft_maxpool2d_triton_layouts() -> None:
    # A channels-last x with the expanded gradient of y.sum(), and a transposed (non-contiguous) x.
    cfg = POOLS["resnet"]
    x = torch.randn(2, 4, 9, 7)
    x_cl, x_t = x.to(memory_format=torch.channels_last), x.transpose(2, 3)
    g_t = torch.randn(2, 4, 4, 5)
    with set_backend("triton"):
        y = soft_maxpool2d(x_cl, **cfg)
        _, dx_cl = _value_and_grad(lambda t: soft_maxpool2d(t, **cfg).sum(), x_cl, torch.ones(()))
        _, dx_t = _value_and_grad(lambda t: soft_maxpool2d(t, **cfg), x_t, g_t)
    y_torch = F.max_pool2d(x_cl, **cfg)
    assert torch.equal(y, y_torch)
    assert y.stride() == y_torch.stride()
    assert dx_cl.is_contiguous(memory_format=torch.channels_last)
    _, dx_cl_ref = _value_and_grad(lambda t: _soft_maxpool2d_pytorch(t, **cfg).sum(), x, torch.ones(()))
    _, dx_t_ref = _value_and_grad(lambda t: _soft_maxpool2d_pytorch(t, **cfg), x_t, g_t)
    torch.testing.assert_close(dx_cl, dx_cl_ref, **tol("soft_maxpool2d", torch.float32))
    torch.testing.assert_close(dx_t, dx_t_ref, **tol("soft_maxpool2d", torch.float32))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("pool", list(POOLS))
def test_soft_maxpool2d_small_tau_gives_max_pool_gradient(backend: str, pool: str) -> None:
    cfg = POOLS[pool]
    n = math.prod(SHAPE)
    x = (torch.randperm(n).float() * 0.01 - 4.0).view(SHAPE)  # distinct values: no ties, gaps of 0.01 >> tau
    g = torch.randn_like(F.max_pool2d(x, **cfg))
    with set_backend(backend):
        _, dx = _value_and_grad(lambda t: soft_maxpool2d(t, **cfg, tau=1e-4), x, g)
    _, dx_true = _value_and_grad(lambda t: F.max_pool2d(t, **cfg), x, g)
    torch.testing.assert_close(dx, dx_true, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("pool", ["resnet", "vgg", "ceil"])
def test_soft_maxpool2d_large_tau_spreads_evenly(backend: str, pool: str) -> None:
    # Equal weights over the in-bounds pixels of each window is average pooling without the padding in the count.
    cfg = POOLS[pool]
    x = torch.randn(SHAPE)
    g = torch.randn_like(F.max_pool2d(x, **cfg))
    with set_backend(backend):
        _, dx = _value_and_grad(lambda t: soft_maxpool2d(t, **cfg, tau=1e6), x, g)
    _, dx_avg = _value_and_grad(lambda t: F.avg_pool2d(t, **cfg, count_include_pad=False), x, g)
    torch.testing.assert_close(dx, dx_avg, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("pool", list(POOLS))
def test_soft_maxpool2d_conserves_gradient_mass(backend: str, pool: str) -> None:
    # Every window's weights sum to one (padding gets none), so each channel passes on exactly its gradient mass,
    # with or without padding.
    cfg = POOLS[pool]
    x = torch.randn(SHAPE)
    g = torch.randn_like(F.max_pool2d(x, **cfg))
    with set_backend(backend):
        _, dx = _value_and_grad(lambda t: soft_maxpool2d(t, **cfg), x, g)
    torch.testing.assert_close(dx.sum(dim=(2, 3)), g.sum(dim=(2, 3)), atol=1e-5, rtol=1e-5)


def test_soft_maxpool2d_defaults_and_pairs() -> None:
    x, tau = torch.randn(2, 3, 8, 8), 0.3
    g = torch.randn(2, 3, 4, 4)
    _, d_int = _value_and_grad(lambda t: soft_maxpool2d(t, 2), x, g)
    _, d_pair = _value_and_grad(lambda t: soft_maxpool2d(t, (2, 2), (2, 2), (0, 0), tau, (1, 1), False), x, g)
    assert torch.equal(d_int, d_pair)


def test_soft_maxpool2d_rejects_bad_inputs() -> None:
    x = torch.randn(1, 2, 6, 6)
    bad = [
        (dict(kernel_size=3, padding=2), "padding must be at most half"),
        (dict(kernel_size=2, padding=(0, 2)), "padding must be at most half"),
        (dict(kernel_size=0), "kernel_size"),
        (dict(kernel_size=True), "kernel_size"),
        (dict(kernel_size=(3, 3, 3)), "kernel_size"),
        (dict(kernel_size=2.0), "kernel_size"),
        (dict(kernel_size=2, stride=0), "stride"),
        (dict(kernel_size=2, padding=-1), "padding"),
        (dict(kernel_size=2, dilation=0), "dilation"),
        (dict(kernel_size=2, ceil_mode=1), "ceil_mode"),
        (dict(kernel_size=7), "too small"),
        (dict(kernel_size=2, tau=0.0), "tau"),
        (dict(kernel_size=2, tau=-0.3), "tau"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            soft_maxpool2d(x, **kwargs)
    with pytest.raises(ValueError, match="x must have 4 dimensions"):
        soft_maxpool2d(torch.randn(2, 6, 6), 2)
    with pytest.raises(ValueError, match="x must be float32"):
        soft_maxpool2d(torch.ones(1, 1, 4, 4, dtype=torch.int32), 2)


# ---------------------------------------------------------------------------------------------------- both


@requires_cuda
def test_ops_compile_without_graph_breaks() -> None:
    # CUDA only: under TRITON_INTERPRET, wrap_triton hands back the interpreted kernel itself, so tracing the ops
    # with fake tensors would run the interpreter on them.
    def step(z: torch.Tensor) -> torch.Tensor:
        return soft_maxpool2d(soft_gate(z, "silu"), 3, 2, 1).sum()

    z = torch.randn(2, 3, 17, 19, device="cuda")
    with set_backend("triton"):
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        _, dz = _value_and_grad(compiled, z, torch.ones(()))
        _, dz_eager = _value_and_grad(step, z, torch.ones(()))
    torch.testing.assert_close(dz, dz_eager, atol=0.0, rtol=0.0)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_match_reference(dtype: torch.dtype) -> None:
    x = torch.randn(4, 16, 57, 43, device="cuda").to(dtype)
    for kind in SOFT_GATE_KINDS:
        g = torch.randn_like(x)
        y, dz = _value_and_grad(lambda t, k=kind: soft_gate(t, k), x, g)
        _, dz_ref = _value_and_grad(lambda t, k=kind: _soft_gate_pytorch(t, k), x.double(), g.double())
        assert torch.equal(_bits(y), _bits(ACT[kind](x)))
        torch.testing.assert_close(dz.double(), dz_ref, **tol("soft_gate", dtype))
    for cfg in POOLS.values():
        g = torch.randn_like(F.max_pool2d(x, **cfg))
        y, dx = _value_and_grad(lambda t, c=cfg: soft_maxpool2d(t, **c), x, g)
        _, dx_ref = _value_and_grad(lambda t, c=cfg: _soft_maxpool2d_pytorch(t, **c), x.double(), g.double())
        assert torch.equal(_bits(y), _bits(F.max_pool2d(x, **cfg)))
        torch.testing.assert_close(dx.double(), dx_ref, **tol("soft_maxpool2d", dtype))
