"""Sinkhorn: the eager definition, the potentials-form reference and the fused Triton kernels (run on the CPU through
Triton's interpreter) must agree forward and backward; plus properties, numerics at extreme scales, input checks."""

import importlib
from collections.abc import Callable

import pytest
import torch

from attr_engine_kernels._backend import set_backend
from attr_engine_kernels.sinkhorn import sinkhorn, sinkhorn_reference
from tests.conftest import requires_cuda
from tests.tolerances import BF16, FP16, FP32, tol

F64 = torch.float64
# The module itself (``attr_engine_kernels.sinkhorn`` the attribute may be the re-exported function).
sk = importlib.import_module("attr_engine_kernels.sinkhorn")


def _run(path: str, log_alpha: torch.Tensor, n_iters: int, tau: float) -> torch.Tensor:
    if path == "eager":
        return sinkhorn_reference(log_alpha, n_iters, tau)
    with set_backend(path):
        return sinkhorn(log_alpha, n_iters, tau)


def _fwd_bwd(
    path: str, log_alpha: torch.Tensor, grad_out: torch.Tensor, n_iters: int, tau: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x = log_alpha.detach().clone().requires_grad_()
    out = _run(path, x, n_iters, tau)
    out.backward(grad_out)
    return out.detach(), x.grad


def _check_against_eager(
    path: str, log_alpha: torch.Tensor, grad_out: torch.Tensor, n_iters: int, tau: float, dtype: torch.dtype
) -> None:
    """``path`` on (log_alpha, grad_out) in their dtype vs the eager definition in float64 on the same values."""
    out, grad = _fwd_bwd(path, log_alpha, grad_out, n_iters, tau)
    assert out.dtype == dtype and grad.dtype == dtype
    want_out, want_grad = _fwd_bwd("eager", log_alpha.double(), grad_out.double(), n_iters, tau)
    torch.testing.assert_close(out.double(), want_out, **tol("sinkhorn", dtype))
    torch.testing.assert_close(grad.double(), want_grad, **tol("sinkhorn", dtype))


def _planted(batch: int, n: int, scale: float) -> torch.Tensor:
    """A random permutation plus small noise, times ``scale``: Sinkhorn converges at any scale and temperature."""
    perm = torch.stack([torch.eye(n)[torch.randperm(n)] for _ in range(batch)])
    return (perm + 0.05 * torch.randn(batch, n, n)) * scale


# ---------------------------------------------------------------------------------------------------------------
# Gradients: float64 gradcheck of the definition and of the reference's hand-written backward
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [3, 4, 5])
@pytest.mark.parametrize("path", ["eager", "reference"])
def test_gradcheck(path: str, n: int) -> None:
    x = torch.randn(2, n, n, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: _run(path, a, 3, 0.7), (x,))


@pytest.mark.parametrize("n", [1, 2, 7, 23, 49])
def test_reference_matches_eager(n: int) -> None:
    la, g = torch.randn(3, n, n), torch.randn(3, n, n)
    _check_against_eager("reference", la, g, 10, 0.5, FP32)


def test_reference_chunked_matches_unchunked(monkeypatch: pytest.MonkeyPatch) -> None:
    la, g = torch.randn(5, 9, 9), torch.randn(5, 9, 9)
    whole = _fwd_bwd("reference", la, g, 6, 0.8)
    monkeypatch.setattr(sk, "_CHUNK_ELEMENTS", 2 * 9 * 9)  # slabs of 2, 2, 1 batch elements
    chunked = _fwd_bwd("reference", la, g, 6, 0.8)
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# Fused Triton kernels (interpreter on CPU): registers for N <= 128, tiles above
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [FP32, FP16, BF16], ids=str)
@pytest.mark.parametrize("n", [1, 7, 33, 65, 130])
def test_triton_matches_eager(n: int, dtype: torch.dtype) -> None:
    la, g = torch.randn(2, n, n).to(dtype), torch.randn(2, n, n).to(dtype)
    _check_against_eager("triton", la, g, 3, 0.7, dtype)


@pytest.mark.parametrize("n", [7, 130])
def test_triton_strided_inputs(n: int) -> None:
    """A transposed log_alpha and a broadcast (stride-0) grad_output go through the kernels' strides."""
    la = torch.randn(2, n, n).transpose(1, 2)
    g = torch.randn(1, n, n).expand(2, n, n)
    _check_against_eager("triton", la, g, 2, 1.3, FP32)


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_single_iteration(path: str) -> None:
    la, g = torch.randn(2, 11, 11), torch.randn(2, 11, 11)
    _check_against_eager(path, la, g, 1, 0.3, FP32)


def test_dispatch() -> None:
    x = torch.randn(2, 5, 5, requires_grad=True)
    with set_backend("auto"):
        assert type(sinkhorn(x).grad_fn).__name__ == "_SinkhornPotentialsBackward"  # CPU tensors: the reference
    with set_backend("triton"):
        assert type(sinkhorn(x).grad_fn).__name__ != "_SinkhornPotentialsBackward"


# ---------------------------------------------------------------------------------------------------------------
# Properties and numerics
# ---------------------------------------------------------------------------------------------------------------


def _assert_sums_to_one(p: torch.Tensor, dim: int, dtype: torch.dtype) -> None:
    sums = p.double().sum(dim)
    torch.testing.assert_close(sums, torch.ones_like(sums), **tol("sinkhorn", dtype))


@pytest.mark.parametrize("path", ["eager", "reference", "triton"])
def test_doubly_stochastic(path: str) -> None:
    p = _run(path, torch.randn(3, 20, 20), 40, 1.0)
    assert bool((p >= 0).all())
    _assert_sums_to_one(p, -1, FP32)
    _assert_sums_to_one(p, -2, FP32)


_CONVERGING: dict[str, tuple[Callable[[], torch.Tensor], float]] = {
    "tiny-1e-6": (lambda: 1e-6 * torch.randn(2, 12, 12), 1.0),
    "constant": (lambda: torch.full((2, 12, 12), 3.7), 1.0),
    "planted-1": (lambda: _planted(2, 12, 1.0), 1.0),
    "planted-1e4": (lambda: _planted(2, 12, 1e4), 1.0),
    "planted-tau0.01": (lambda: _planted(2, 12, 1.0), 0.01),
    "planted-1e4-tau0.01": (lambda: _planted(2, 12, 1e4), 0.01),
}
# Sinkhorn itself has not converged on these in 30 iterations (rows are off even in float64): only the columns,
# which the last half-step normalises, and finiteness can be asked for.
_SHARP: dict[str, tuple[Callable[[], torch.Tensor], float]] = {
    "randn-1e4": (lambda: 1e4 * torch.randn(2, 12, 12), 1.0),
    "randn-tau0.01": (lambda: torch.randn(2, 12, 12), 0.01),
    "randn-1e4-tau0.01": (lambda: 1e4 * torch.randn(2, 12, 12), 0.01),
}


@pytest.mark.parametrize("dtype", [FP32, FP16, BF16], ids=str)
@pytest.mark.parametrize("path", ["reference", "triton"])
@pytest.mark.parametrize("case", [*_CONVERGING, *_SHARP])
def test_robust_inputs(case: str, path: str, dtype: torch.dtype) -> None:
    make, tau = {**_CONVERGING, **_SHARP}[case]
    la = make().to(dtype)
    out, grad = _fwd_bwd(path, la, torch.randn(la.shape).to(dtype), 30, tau)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(grad).all())
    _assert_sums_to_one(out, -2, dtype)
    if case in _CONVERGING:
        _assert_sums_to_one(out, -1, dtype)
        torch.testing.assert_close(out.double(), sinkhorn_reference(la.double(), 30, tau), **tol("sinkhorn", dtype))


@pytest.mark.parametrize("n", [5, 130])
@pytest.mark.parametrize("path", ["eager", "reference", "triton"])
def test_empty_batch(path: str, n: int) -> None:
    x = torch.randn(0, n, n, requires_grad=True)
    out = _run(path, x, 3, 1.0)
    out.sum().backward()
    assert out.shape == x.grad.shape == (0, n, n)


@pytest.mark.parametrize("path", ["eager", "reference", "triton"])
def test_deterministic(path: str) -> None:
    la, g = torch.randn(2, 10, 10), torch.randn(2, 10, 10)
    first, second = _fwd_bwd(path, la, g, 5, 0.5), _fwd_bwd(path, la, g, 5, 0.5)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_saved_state_is_potentials_only(path: str) -> None:
    """Autograd keeps log_alpha and the (B, T + 1, N) potentials, never an N x N iterate per step."""
    batch, n, n_iters = 2, 16, 8
    saved: dict[int, int] = {}  # storage address -> bytes (a tensor may be packed more than once)

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(batch, n, n, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _run(path, x, n_iters, 1.0)
    assert 0 < sum(saved.values()) <= x.numel() * 4 + 2 * batch * (n_iters + 1) * n * 4
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _run("eager", x, n_iters, 1.0)
    assert sum(saved.values()) >= n_iters * x.numel() * 4  # what the definition keeps, for contrast


# ---------------------------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------------------------

_BAD: list[tuple[object, int, float, str]] = [
    ([[1.0]], 5, 1.0, "log_alpha must be a torch.Tensor"),
    (torch.zeros(4, 4), 5, 1.0, "log_alpha must have 3 dimensions"),
    (torch.zeros(2, 3, 4), 5, 1.0, "log_alpha must be .* square"),
    (torch.zeros(2, 0, 0), 5, 1.0, "N >= 1"),
    (torch.zeros(2, 3, 3, dtype=torch.int64), 5, 1.0, "log_alpha must be float"),
    (torch.tensor([[[0.0, float("nan")], [0.0, 0.0]]]), 5, 1.0, "log_alpha contains NaN"),
    (torch.tensor([[[0.0, float("inf")], [0.0, 0.0]]]), 5, 1.0, "log_alpha contains NaN or infinite"),
    (torch.zeros(2, 3, 3), 0, 1.0, "n_iters must be an integer >= 1"),
    (torch.zeros(2, 3, 3), 2.0, 1.0, "n_iters must be an integer"),
    (torch.zeros(2, 3, 3), True, 1.0, "n_iters must be an integer"),
    (torch.zeros(2, 3, 3), 5, 0.0, "tau must be a positive"),
    (torch.zeros(2, 3, 3), 5, -1.0, "tau must be a positive"),
    (torch.zeros(2, 3, 3), 5, float("inf"), "tau must be a positive finite"),
]


@pytest.mark.parametrize("fn", [sinkhorn, sinkhorn_reference], ids=["sinkhorn", "sinkhorn_reference"])
@pytest.mark.parametrize(("log_alpha", "n_iters", "tau", "match"), _BAD)
def test_bad_inputs(fn: Callable[..., torch.Tensor], log_alpha: object, n_iters: int, tau: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fn(log_alpha, n_iters, tau)


# ---------------------------------------------------------------------------------------------------------------
# CUDA: the compiled kernels on real device tensors ("auto" picks Triton for CUDA tensors)
# ---------------------------------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("dtype", [FP32, FP16, BF16], ids=str)
@pytest.mark.parametrize("n", [7, 128, 196])
def test_cuda_auto_matches_eager(n: int, dtype: torch.dtype) -> None:
    la = torch.randn(3, n, n, device="cuda").to(dtype)
    g = torch.randn(3, n, n, device="cuda").to(dtype)
    _check_against_eager("auto", la, g, 5, 0.5, dtype)


# ---------------------------------------------------------------------------------------------------------------
# The shared tiled core (attr_engine_kernels._sinkhorn_core): both cost sources on one cost matrix
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [5, 70])
def test_core_cost_sources_agree(n: int) -> None:
    """The core driven by the sorter's scores (noise 0) and by log_alpha = -(s_c - a_r)^2 (no row shift) runs the same
    iterations: equal potentials, and the sorter's ds is the chain rule of the dense d log_alpha."""
    from attr_engine_kernels import _sinkhorn_core as core
    from attr_engine_kernels.soft_rank import prefix_weights, rank_anchors

    batch, n_iters, tau = 2, 3, 0.4
    scores = torch.rand(batch, n)
    anchors = rank_anchors(n)
    log_alpha = -(scores[:, None, :] - anchors[None, :, None]).square()
    weights = prefix_weights(torch.tensor([0.25, 0.5, 1.0]), n).float()
    grad_masks = torch.randn(batch, 3, n)
    sources = {
        "dense": core.Cost(log_alpha, 1.0 / tau),
        "scores": core.Cost(scores, 1.0 / tau, scores=True, anchor_step=1.0 / (n - 1)),
    }
    pots = {}
    for name, cost in sources.items():
        u_all, v_all = torch.zeros(2, batch, n_iters + 1, n).unbind(0)
        core.forward(cost, u_all, v_all, torch.empty(batch, n, n))
        pots[name] = (u_all, v_all)
    for a, b in zip(pots["dense"], pots["scores"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    dla = torch.empty(batch, n, n)
    grad_p = weights.t() @ grad_masks  # dL/dP for M = W P
    core.backward(sources["dense"], grad_p, None, *pots["dense"], torch.empty(batch, n, n), dla)
    ds = torch.empty(batch, n)
    core.backward(sources["scores"], grad_masks, weights, *pots["scores"], torch.empty(batch, n), ds)
    chain = (dla * -2.0 * (scores[:, None, :] - anchors[None, :, None])).sum(1)
    torch.testing.assert_close(ds, chain, rtol=1e-4, atol=1e-5)
    # And against autograd through the definition.
    s = scores.double().requires_grad_()
    la = -(s[:, None, :] - anchors.double()[None, :, None]).square()
    (weights.double() @ sinkhorn_reference(la, n_iters, tau)).backward(grad_masks.double())
    torch.testing.assert_close(ds.double(), s.grad, rtol=1e-4, atol=1e-5)
