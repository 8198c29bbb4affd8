"""soft_topk_masks: the structured reference and the fused Triton sorter against the dense definition."""

import pytest
import torch

import attr_engine_kernels as kernels
from attr_engine_kernels.soft_rank import (
    _sample_seeds,
    gumbel_noise,
    prefix_weights,
    soft_topk_masks,
    soft_topk_masks_reference,
    triton_gumbel_noise,
)
from tests.tolerances import tol


def _reference_noise(bsz: int, n: int, seed: int) -> torch.Tensor:
    """The noise soft_topk_masks draws on the reference backend for ``generator=seed``."""
    return gumbel_noise(_sample_seeds(bsz, seed, torch.device("cpu")), n).double()


def _dense_and_grad(scores, fractions, tau, n_iters, gumbel, grad_out):
    s64 = scores.detach().double().requires_grad_()
    masks = soft_topk_masks_reference(s64, fractions.double(), tau=tau, n_iters=n_iters, gumbel=gumbel)
    (grad,) = torch.autograd.grad((masks * grad_out.double()).sum(), s64)
    return masks, grad


def _op_and_grad(scores, fractions, grad_out, **kwargs):
    s = scores.detach().clone().requires_grad_()
    masks = soft_topk_masks(s, fractions, **kwargs)
    (grad,) = torch.autograd.grad((masks.float() * grad_out.float()).sum(), s)
    return masks, grad


def _hard_topk(scores: torch.Tensor, fractions: torch.Tensor) -> torch.Tensor:
    """(B, S, N) exact top-k membership with the same linear interpolation for fractional k."""
    n = scores.shape[1]
    rank = torch.argsort(torch.argsort(-scores, dim=1), dim=1).double()  # rank 0 = highest score
    k = fractions.double()[None, :, None] * n
    lo = torch.floor(k)
    return (rank[:, None, :] < lo).double() + (rank[:, None, :] == lo).double() * (k - lo)


# ---------------------------------------------------------------------------------------------------------------
# Reference path
# ---------------------------------------------------------------------------------------------------------------


def test_reference_gradcheck_float64():
    scores = torch.rand(2, 5, dtype=torch.float64, requires_grad=True)
    fractions = torch.tensor([0.0, 0.3, 0.5, 1.0], dtype=torch.float64)
    with kernels.set_backend("reference"):
        assert torch.autograd.gradcheck(
            lambda s: soft_topk_masks(s, fractions, tau=0.5, n_iters=6, noise=1.0, generator=3), (scores,)
        )


def test_dense_definition_gradcheck_float64():
    scores = torch.rand(2, 4, dtype=torch.float64, requires_grad=True)
    fractions = torch.tensor([0.25, 0.6], dtype=torch.float64)
    noise = _reference_noise(2, 4, 0)
    assert torch.autograd.gradcheck(
        lambda s: soft_topk_masks_reference(s, fractions, tau=0.7, n_iters=5, gumbel=noise), (scores,)
    )


@pytest.mark.parametrize("n", [1, 7, 49, 196, 784])
@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_reference_matches_dense(n, noise):
    bsz, n_iters = (1, 4) if n == 784 else (3, 12)
    scores = torch.rand(bsz, n, dtype=torch.float64)
    fractions = torch.tensor([0.0, 0.1, 0.37, 0.5, 1.0], dtype=torch.float64)
    gumbel = noise * _reference_noise(bsz, n, 11) if noise else None
    grad_out = torch.randn(bsz, len(fractions), n, dtype=torch.float64)
    want, want_grad = _dense_and_grad(scores, fractions, 0.3, n_iters, gumbel, grad_out)
    with kernels.set_backend("reference"):
        got, got_grad = _op_and_grad(scores, fractions, grad_out, tau=0.3, n_iters=n_iters, noise=noise, generator=11)
    torch.testing.assert_close(got, want, **tol("soft_topk_masks", torch.float64))
    torch.testing.assert_close(got_grad, want_grad, **tol("soft_topk_masks", torch.float64))


# ---------------------------------------------------------------------------------------------------------------
# Fused path (Triton interpreter on CPU)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "bsz", "n_iters"),
    [(1, 2, 3), (7, 3, 5), (49, 2, 4), (196, 1, 2), (784, 1, 1)],
)
def test_fused_matches_dense(n, bsz, n_iters):
    seed = 2024
    scores = torch.rand(bsz, n)
    fractions = torch.tensor([0.0, 0.2, 0.45, 1.0])
    grad_out = torch.randn(bsz, len(fractions), n)
    # The fused path regenerates Philox noise in-kernel; materialise the same numbers for the definition.
    gumbel = triton_gumbel_noise(_sample_seeds(bsz, seed, scores.device)[0].item(), bsz, n, "cpu").double()
    want, want_grad = _dense_and_grad(scores, fractions, 0.5, n_iters, gumbel, grad_out)
    with kernels.set_backend("triton"):
        got, got_grad = _op_and_grad(scores, fractions, grad_out, tau=0.5, n_iters=n_iters, generator=seed)
    t = tol("soft_topk_masks", torch.float32)
    torch.testing.assert_close(got.double(), want, **t)
    torch.testing.assert_close(got_grad.double(), want_grad, **t)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_low_precision_inputs(dtype):
    scores = torch.rand(2, 9).to(dtype)
    fractions = torch.tensor([0.0, 0.5, 1.0])
    grad_out = torch.randn(2, 3, 9)
    want, want_grad = _dense_and_grad(scores, fractions, 0.5, 6, None, grad_out)
    with kernels.set_backend("triton"):
        got, got_grad = _op_and_grad(scores, fractions, grad_out, tau=0.5, n_iters=6, noise=0.0)
    assert got.dtype == dtype and got_grad.dtype == dtype
    torch.testing.assert_close(got.double(), want, **tol("soft_topk_masks", dtype))
    torch.testing.assert_close(got_grad.double(), want_grad, **tol("soft_topk_masks", dtype))


def test_fused_noise_is_gumbel_distributed():
    noise = triton_gumbel_noise(7, 2, 64, "cpu")
    # Standard Gumbel: mean = Euler-Mascheroni constant, variance = pi^2 / 6.
    assert abs(noise.mean().item() - 0.5772) < 0.02
    assert abs(noise.var().item() - 1.6449) < 0.05
    assert not torch.equal(noise[0], noise[1])


# ---------------------------------------------------------------------------------------------------------------
# Properties (both backends)
# ---------------------------------------------------------------------------------------------------------------

BACKENDS = ["reference", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_masks_are_monotone_and_sum_to_fraction(backend):
    scores = torch.rand(3, 16)
    fractions = torch.linspace(0, 1, 9)
    with kernels.set_backend(backend):
        masks = soft_topk_masks(scores, fractions, tau=1.0, n_iters=60, noise=1.0, generator=0)
    assert (masks[:, 1:] - masks[:, :-1] >= -1e-6).all(), "masks must grow with the fraction"
    torch.testing.assert_close(masks.sum(-1), (fractions * 16).expand(3, -1), atol=1e-3, rtol=1e-4)
    # The last half-step normalises over rank slots, so f = 1 selects every cell fully.
    torch.testing.assert_close(masks[:, -1], torch.ones(3, 16), atol=1e-5, rtol=0)
    torch.testing.assert_close(masks[:, 0], torch.zeros(3, 16), atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_constant_map_gives_uniform_ranking(backend):
    scores = torch.full((2, 10), 0.37)
    fractions = torch.tensor([0.1, 0.35, 0.8])
    with kernels.set_backend(backend):
        masks = soft_topk_masks(scores, fractions, tau=0.3, n_iters=5, noise=0.0)
    torch.testing.assert_close(masks, fractions[None, :, None].expand(2, 3, 10), atol=1e-6, rtol=1e-6)


def test_tau_to_zero_gives_hard_topk():
    n = 12
    scores = torch.linspace(1, 0, n, dtype=torch.float64)[torch.randperm(n)][None]
    fractions = torch.tensor([0.0, 1 / 12, 0.25, 0.5, 0.54, 1.0])
    hard = _hard_topk(scores, fractions)
    errors = []
    for tau in (0.1, 0.01, 1e-4):
        with kernels.set_backend("reference"):
            masks = soft_topk_masks(scores, fractions, tau=tau, n_iters=200, noise=0.0)
        errors.append((masks.double() - hard).abs().max().item())
    assert errors[0] > errors[1] > errors[2]
    assert errors[-1] < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("scale", "tau", "dtype"),
    [(1e-6, 0.3, torch.float32), (1e4, 0.3, torch.float32), (1.0, 0.01, torch.float32),
     (1.0, 0.3, torch.float16), (1.0, 0.3, torch.bfloat16)],
)  # fmt: skip
def test_robust_to_scale_tau_and_dtype(backend, scale, tau, dtype):
    n = 20
    scores = (torch.rand(2, n) * scale).to(dtype).requires_grad_()
    fractions = torch.linspace(0, 1, 5)
    with kernels.set_backend(backend):
        masks = soft_topk_masks(scores, fractions, tau=tau, n_iters=50, noise=1.0, generator=1)
        masks.float().pow(2).sum().backward()
    assert torch.isfinite(masks).all() and torch.isfinite(scores.grad).all()
    assert ((masks >= 0) & (masks <= 1.0 + 1e-3)).all()
    assert (masks[:, 1:].float() - masks[:, :-1].float() >= -1e-3).all()
    # Column marginals hold after any number of iterations: the last half-step normalises over rank slots.
    atol = 2e-2 if dtype != torch.float32 else 1e-3
    torch.testing.assert_close(masks[:, -1].float(), torch.ones(2, n), atol=atol, rtol=0)
    if scale <= 1.0 and tau >= 0.3:
        # Row marginals need convergence, which 50 iterations reach for O(1) scores at tau 0.3; scores of scale 1e4
        # make the soft permutation nearly degenerate and Sinkhorn needs thousands of iterations (documented on the
        # op), and tau = 0.01 needs a few hundred (measured: 50 iterations miss by 1.0-1.5 cells for seeds 0-5).
        torch.testing.assert_close(masks.float().sum(-1), (fractions * n).expand(2, -1), atol=n * 5e-2, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_constant_scores_with_noise_stay_finite(backend):
    scores = torch.zeros(2, 30, requires_grad=True)
    with kernels.set_backend(backend):
        masks = soft_topk_masks(scores, [0.0, 0.5, 1.0], tau=0.01, n_iters=20, generator=4)
        masks.sum().backward()
    assert torch.isfinite(masks).all() and torch.isfinite(scores.grad).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_seed_is_bit_identical(backend):
    scores = torch.rand(2, 25)
    fractions = torch.linspace(0, 1, 4)
    with kernels.set_backend(backend):
        a = soft_topk_masks(scores, fractions, tau=0.5, n_iters=5, generator=123)
        b = soft_topk_masks(scores, fractions, tau=0.5, n_iters=5, generator=123)
        c = soft_topk_masks(scores, fractions, tau=0.5, n_iters=5, generator=124)
        g1 = torch.Generator().manual_seed(9)
        g2 = torch.Generator().manual_seed(9)
        d = soft_topk_masks(scores, fractions, tau=0.5, n_iters=5, generator=g1)
        e = soft_topk_masks(scores, fractions, tau=0.5, n_iters=5, generator=g2)
    assert torch.equal(a, b) and torch.equal(d, e)
    assert not torch.equal(a, c)


def test_prefix_weights_interpolate_fractional_counts():
    w = prefix_weights(torch.tensor([0.0, 0.25, 0.3, 1.0]), 4)
    expected = torch.tensor(
        [[0, 0, 0, 0], [1, 0, 0, 0], [1, 0.2, 0, 0], [1, 1, 1, 1]],
        dtype=torch.float64,
    )
    torch.testing.assert_close(w, expected)


# ---------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scores": torch.rand(4)}, "scores must have 2 dimensions"),
        ({"scores": torch.zeros(2, 3, dtype=torch.int64)}, "scores must be float"),
        ({"scores": torch.tensor([[0.0, float("nan")]])}, "scores contains NaN"),
        ({"scores": torch.zeros(2, 0)}, "1 to 16384 cells"),
        ({"scores": torch.zeros(1, 16385)}, "1 to 16384 cells"),
        ({"fractions": [0.5, 1.2]}, r"fractions must lie in \[0, 1\]"),
        ({"fractions": []}, "fractions must hold 1 to 65536"),
        ({"fractions": [0.5] * 65537}, "fractions must hold 1 to 65536"),
        ({"fractions": torch.zeros(2, 2)}, "fractions must have 1 dimensions"),
        ({"tau": 0.0}, "tau must be a positive"),
        ({"tau": float("nan")}, "tau must be a positive"),
        ({"n_iters": 0}, "n_iters must be an integer >= 1"),
        ({"n_iters": 2.5}, "n_iters must be an integer >= 1"),
        ({"noise": -1.0}, "noise must be a finite number >= 0"),
        ({"generator": "seed"}, "generator must be a torch.Generator"),
    ],
)
def test_bad_input_raises(kwargs, message):
    args = {"scores": torch.rand(2, 5), "fractions": [0.0, 0.5], "tau": 0.5, "n_iters": 3}
    args.update(kwargs)
    scores = args.pop("scores")
    fractions = args.pop("fractions")
    with pytest.raises(ValueError, match=message):
        soft_topk_masks(scores, fractions, **args)


def test_the_reference_gives_the_same_masks_and_gradients_with_any_number_of_threads():
    """Worker threads take whole chunks (kernels.soft_rank._for_each_chunk): a sample's result never depends on the
    thread count, and the count in force comes back, also when two sorters run at once."""
    import threading

    n = 64  # 8 x 8 grid: chunks of many samples; the small batch below still spans several chunks at N = 1100
    results = {}
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for size in (n, 1100):
                scores = torch.randn(3, size, generator=torch.Generator().manual_seed(size), requires_grad=True)
                masks = soft_topk_masks(scores, [0.0, 0.3, 1.0], tau=0.5, n_iters=4, generator=7)
                (grad,) = torch.autograd.grad(masks.square().sum(), scores)
                results[threads, size] = (masks.detach(), grad)
            assert torch.get_num_threads() == threads
        for size in (n, 1100):
            assert torch.equal(results[1, size][0], results[2, size][0])
            assert torch.equal(results[1, size][1], results[2, size][1])
        # Two sorters at once, each in its own thread: the count set before both comes back after both.
        torch.set_num_threads(2)
        scores = torch.randn(3, 1100, requires_grad=True)

        def sort() -> None:
            soft_topk_masks(scores, [0.5], tau=0.5, n_iters=4, generator=1).sum().backward()

        workers = [threading.Thread(target=sort) for _ in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
