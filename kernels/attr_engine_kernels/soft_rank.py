"""Soft top-k masks from a Gumbel-Sinkhorn soft ranking: the AHA sorter.

Given region scores s (B, N) and perturbation fractions f (S,), cell i's soft membership in the top ``f_s * N`` cells
is read off a soft permutation P (rank slot j x cell i) obtained by Sinkhorn normalisation of

    K[b, j, i] = (-(s[b, i] - a[j])^2 + G[b, j, i]) / tau,    a = linspace(1, 0, N),

with Gumbel noise G. The masks are prefix sums of P over rank slots, interpolated linearly for fractional counts:

    M[b, s, i] = sum_j W[s, j] P[b, j, i],   W[s, j] = 1 for j < floor(k_s), frac(k_s) for j = floor(k_s), k_s = f_s N.

Three paths, one definition:

- :func:`soft_topk_masks_reference` - the definition: build K densely and differentiate through the Sinkhorn loop with
  autograd. It keeps every iterate, O(n_iters * B * N^2) memory.
- Structured reference (pure PyTorch, any device): K is never saved, only the potentials u, v (B, T + 1, N). Per
  chunk of the batch E = exp(K + u_ref + v_ref) is formed once and every half-step (and every step of the unrolled
  backward) is a batched matrix-vector product with diagonal rescalings; E is re-formed when the potentials drift,
  and a half-step whose sums would underflow is done in the log domain, so any score scale and tiny tau stay
  finite. The noise is regenerated from per-sample seeds; worker threads take whole chunks (:func:`_for_each_chunk`),
  so the masks never depend on the thread count. A custom op: ``torch.compile`` sees one node.
- Triton (fused): the tiled Sinkhorn core of :mod:`._sinkhorn_core` (the one :func:`.sinkhorn.sinkhorn`
  runs) with the cost computed from the scores: each program regenerates its K tiles and the Philox Gumbel noise on
  the fly, so neither K nor P is ever written. A last kernel accumulates the masks with a small matrix product per
  tile; the backward replays the recurrence from the saved (B, T + 1, N) potentials.

Noise reproducibility: the same ``generator`` (or integer seed) gives bit-identical masks on a given backend. The
structured reference draws per-sample noise from torch's CPU generator; the Triton path uses Philox in the kernel;
the two backends draw different (equally distributed) noise for the same seed.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch
from torch.library import custom_op, triton_op, wrap_triton

from attr_engine_kernels import _sinkhorn_core as core
from attr_engine_kernels._backend import tl, triton, use_triton
from attr_engine_kernels._sinkhorn_core import _gumbel, _line_lse, _line_tile
from attr_engine_kernels._tl_helpers import _lse_normaliser, _pid, compute_dtype
from attr_engine_kernels.sinkhorn import sinkhorn_reference
from attr_engine_kernels.validate import check_int_at_least, check_positive, check_tensor

# Smallest uniform draw before the double log of the Gumbel transform: keeps G finite (G >= -log(-log(1e-10)) ~ -3.1).
_U_MIN = 1e-10
# Largest accepted sizes, checked before any kernel is compiled: N bounds the Philox counters j * N + i (int32) and
# S the mask kernel's grid axis 2 (S / 32 blocks <= 65535); both are far above AHA's N <= 1024, S <= 64.
MAX_SORT_CELLS = 16384
MAX_FRACTIONS = 65536
# Potentials may drift this many nats from the reference pair before E is re-formed: e^150 keeps every product of a
# stabilised entry (<= 1) and a rescaling inside float64's range, and entries that underflow below e^-745 stay
# negligible next to the e^-150 floor of what is still resolved. A float32 E (float32 and half inputs) allows
# e^40 (N e^40 stays far below float32's 3e38 and e^-40 far above its 1e-38 floor).
_DRIFT = {torch.float64: 150.0, torch.float32: 40.0}
# A row or column sum below this is too deep in the dtype's tail to trust; that half-step is redone exactly.
_TINY_SUM = {torch.float64: 1e-200, torch.float32: 1e-30}
_CHUNK_BYTES = 1 << 23


# ----------------------------------------------------------------------------------------------------------------
# Shared pieces: anchors, prefix weights, noise
# ----------------------------------------------------------------------------------------------------------------


def rank_anchors(n: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """Anchor values a (N,) of the rank slots: linspace(1, 0, N); slot 0 is the most important."""
    return torch.linspace(1.0, 0.0, n, dtype=dtype, device=device)


def prefix_weights(fractions: torch.Tensor, n: int) -> torch.Tensor:
    """W (S, N) with M = W @ P: ones over the first floor(f N) slots and the fractional remainder on the next one."""
    k = fractions.to(torch.float64) * n
    lo = torch.floor(k)
    slots = torch.arange(n, dtype=torch.float64, device=fractions.device)
    full = (slots[None, :] < lo[:, None]).to(torch.float64)
    part = (slots[None, :] == lo[:, None]).to(torch.float64) * (k - lo)[:, None]
    return full + part


def _seed_base(batch: int, generator: torch.Generator | int | None) -> int:
    """First of ``batch`` consecutive 31-bit per-sample seeds, from ``generator`` (an int seed, or torch's default).

    An integer seed maps to the base by plain integer arithmetic, no generator and no tensor read, so the call
    traces under ``torch.compile(fullgraph=True)`` and never synchronises with a GPU. A ``torch.Generator`` (or
    None: the global one) is drawn from once, on its own device.
    """
    span = 2**31 - 1 - batch
    if isinstance(generator, int) and not isinstance(generator, bool):
        return generator % span
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, an int seed or None, got {type(generator).__name__}")
    gen_device = generator.device if generator is not None else torch.device("cpu")
    return int(torch.randint(0, span, (1,), generator=generator, device=gen_device).item())


def _seeds_from_base(batch: int, base: int) -> torch.Tensor:
    """Per-sample noise seeds (B,) int64 on the CPU: ``base`` plus the sample's index."""
    return torch.arange(batch, dtype=torch.int64) + base


def _sample_seeds(batch: int, generator: torch.Generator | int | None, device: torch.device) -> torch.Tensor:
    """One 31-bit seed per sample (B,) int64 on the CPU: ``_seed_base`` plus the sample's index."""
    return _seeds_from_base(batch, _seed_base(batch, generator))


def gumbel_noise(seeds: torch.Tensor, n: int, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """Gumbel noise G (B, N, N) of the structured reference: sample b is drawn from a CPU generator seeded seeds[b].

    Generated per sample so the backward can regenerate any chunk of the batch without storing B x N x N floats.
    """
    out = torch.empty(len(seeds), n, n, dtype=torch.float32)
    gen = torch.Generator(device="cpu")
    for b, seed in enumerate(seeds.tolist()):
        gen.manual_seed(int(seed))
        u = torch.rand(n, n, generator=gen, dtype=torch.float32).clamp_min_(_U_MIN)
        out[b] = u.log_().neg_().log_().neg_()
    return out.to(device)


def _check_inputs(
    scores: torch.Tensor,
    fractions: torch.Tensor | Sequence[float],
    tau: float,
    n_iters: int,
    noise: float,
    validate: bool,
) -> torch.Tensor:
    # Shapes, dtypes and scalars are always checked (no tensor is read); ``validate`` adds the checks that read the
    # scores and fractions, each a host-device synchronisation on a GPU.
    check_tensor(scores, "scores", ndim=2, finite=validate)
    if not 1 <= scores.shape[1] <= MAX_SORT_CELLS:
        raise ValueError(f"scores must have 1 to {MAX_SORT_CELLS} cells, got shape {tuple(scores.shape)}")
    listed = not isinstance(fractions, torch.Tensor)
    if isinstance(fractions, torch.Tensor):
        frac = fractions
    else:
        try:
            values = [float(f) for f in fractions]
        except (TypeError, ValueError):
            raise ValueError(f"fractions must be a 1-D sequence or tensor of floats, got {fractions!r}") from None
        if not all(0.0 <= f <= 1.0 for f in values):  # plain floats: checking costs no synchronisation
            raise ValueError(f"fractions must lie in [0, 1], got min {min(values)}, max {max(values)}")
        frac = torch.tensor(values, dtype=torch.float64)
    check_tensor(frac, "fractions", ndim=1, finite=validate and not listed)
    if not 1 <= frac.numel() <= MAX_FRACTIONS:
        raise ValueError(f"fractions must hold 1 to {MAX_FRACTIONS} values, got {frac.numel()}")
    if validate and not listed and bool(((frac < 0) | (frac > 1)).any()):
        raise ValueError(f"fractions must lie in [0, 1], got min {frac.min().item()}, max {frac.max().item()}")
    check_positive(tau, "tau")
    check_int_at_least(n_iters, "n_iters", 1)
    if not (float(noise) >= 0.0 and math.isfinite(float(noise))):
        raise ValueError(f"noise must be a finite number >= 0, got {noise!r}")
    return frac.to(device=scores.device)


def _cost(scores: torch.Tensor, anchors: torch.Tensor, noise: torch.Tensor | None, tau: float) -> torch.Tensor:
    """K (B, N, N) = (-(s_i - a_j)^2 + G_ji) / tau in the dtype of ``scores``, in place on one N x N temporary.

    K stays float64 for every input dtype: float32 rounding (1-ulp differences between the vectorised and scalar exp
    of differently sized chunks) made a refined, standardised map depend on its batch mates
    (test_a_refined_map_does_not_depend_on_its_batch). The float32 timing: benches/README.md ("Cost at the floor").
    """
    k = (scores[:, None, :] - anchors[None, :, None]).square_().neg_()
    if noise is not None:
        k = k.add_(noise.to(k.dtype))
    return k.div_(tau)


# ----------------------------------------------------------------------------------------------------------------
# Definition: dense autograd
# ----------------------------------------------------------------------------------------------------------------


def soft_topk_masks_reference(
    scores: torch.Tensor,
    fractions: torch.Tensor,
    *,
    tau: float,
    n_iters: int,
    gumbel: torch.Tensor | None = None,
) -> torch.Tensor:
    """The naive definition: dense K, autograd through every Sinkhorn iterate. O(n_iters * B * N^2) memory.

    Args:
        scores: (B, N) cell scores.
        fractions: (S,) perturbation fractions in [0, 1].
        gumbel: optional (B, N, N) noise G[b, j, i] (rank slot j, cell i), added before dividing by tau.

    Returns:
        (B, S, N) soft top-k masks in the dtype of ``scores``.
    """
    n = scores.shape[1]
    anchors = rank_anchors(n, dtype=scores.dtype, device=scores.device)
    log_alpha = -(scores[:, None, :] - anchors[None, :, None]).square()
    if gumbel is not None:
        log_alpha = log_alpha + gumbel.to(log_alpha.dtype)
    perm = sinkhorn_reference(log_alpha, n_iters, tau)
    return prefix_weights(fractions, n).to(perm.dtype) @ perm


# ----------------------------------------------------------------------------------------------------------------
# Structured reference: log-stabilised scaling Sinkhorn with a matrix-vector backward
# ----------------------------------------------------------------------------------------------------------------


def _lse_rows(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """-LSE_i(K_ji + v_i): the exact log-domain row update, (c, N)."""
    return -torch.logsumexp(k + v[:, None, :], dim=2)


def _lse_cols(k: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """-LSE_j(K_ji + u_j): the exact log-domain column update, (c, N)."""
    return -torch.logsumexp(k + u[:, :, None], dim=1)


class _Stabilised:
    """The kernel matrix of a chunk held as E = exp(K + u_ref + v_ref), re-formed when potentials drift.

    ``E`` is only ever formed at a consistent pair (the potentials right after a half-step), where either its rows or
    its columns sum to one, so every entry is <= 1 and a rescaling by at most e^drift cannot overflow. The
    potentials and K stay float64; E is float64 for float64 scores and float32 otherwise: every half-step and
    every backward step streams E once through a matrix-vector product, so its size is the cost of this path (the
    float32 E halves it; its products sum N terms <= 1 with ~1e-7 relative error, well inside the float32 output).
    """

    def __init__(self, k: torch.Tensor, u: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> None:
        self.k = k
        self.dtype = dtype
        self.drift, self.tiny = _DRIFT[dtype], _TINY_SUM[dtype]
        self.u_ref = u.clone()
        self.v_ref = v.clone()
        self.e = torch.exp(k + u[:, :, None] + v[:, None, :]).to(dtype)

    def refresh(self, u: torch.Tensor, v: torch.Tensor, *, force: bool = False) -> None:
        """Re-form E for the samples whose potentials left the drift window (all of them when ``force``)."""
        drift = torch.maximum((u - self.u_ref).abs().amax(1), (v - self.v_ref).abs().amax(1))
        stale = torch.ones_like(drift, dtype=torch.bool) if force else drift > self.drift
        if bool(stale.any()):
            idx = stale.nonzero().squeeze(1)
            self.u_ref[idx] = u[idx]
            self.v_ref[idx] = v[idx]
            self.e[idx] = torch.exp(self.k[idx] + u[idx, :, None] + v[idx, None, :]).to(self.dtype)

    def _scale(self, delta: torch.Tensor) -> torch.Tensor:
        return torch.exp(delta).to(self.dtype)

    def row_update(self, v: torch.Tensor) -> torch.Tensor:
        """u = -LSE_i(K_ji + v_i) via one matrix-vector product; exact fallback where sums underflow."""
        sums = torch.bmm(self.e, self._scale(v - self.v_ref)[:, :, None]).squeeze(2)
        u = self.u_ref - torch.log(sums.to(torch.float64))
        bad = ~(sums > self.tiny).all(1)
        if bool(bad.any()):
            idx = bad.nonzero().squeeze(1)
            u[idx] = _lse_rows(self.k[idx], v[idx])
        return u

    def col_update(self, u: torch.Tensor) -> torch.Tensor:
        """v = -LSE_j(K_ji + u_j) via one transposed matrix-vector product; exact fallback where sums underflow."""
        sums = torch.bmm(self._scale(u - self.u_ref)[:, None, :], self.e).squeeze(1)
        v = self.v_ref - torch.log(sums.to(torch.float64))
        bad = ~(sums > self.tiny).all(1)
        if bool(bad.any()):
            idx = bad.nonzero().squeeze(1)
            v[idx] = _lse_cols(self.k[idx], u[idx])
        return v

    def left(self, u: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Q @ x for Q = exp(K + u + v_ref) scaled on the right by x's own factors: returns diag(e^(u-u_ref)) E x."""
        return torch.exp(u - self.u_ref)[:, :, None] * torch.bmm(self.e, x.to(self.dtype)).to(torch.float64)

    def right(self, u: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """E^T diag(e^(u-u_ref)) y: (c, N, m) -> (c, N, m); the caller applies the column factors."""
        scaled = (torch.exp(u - self.u_ref)[:, :, None] * y).to(self.dtype)
        return torch.bmm(self.e.transpose(1, 2), scaled).to(torch.float64)


def _chunk_size(n: int) -> int:
    """Samples per chunk of the structured path: as many as keep the chunk's float64 K (and its E) within
    _CHUNK_BYTES, so the matrix-vector products stream them from cache (at N = 784 one sample; larger chunks
    measured slower, DRAM-bound). Independent of the thread count, so a sample's masks never depend on it."""
    return max(1, _CHUNK_BYTES // (8 * n * n))


_THREADS_LOCK = threading.Lock()
_THREADS_USERS = 0
_THREADS_SAVED = 1


@contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """torch's intra-op threads set to one while at least one caller is inside (reference counted: concurrent
    sorters nest, and the count in force before the first comes back after the last)."""
    global _THREADS_USERS, _THREADS_SAVED
    with _THREADS_LOCK:
        if _THREADS_USERS == 0:
            _THREADS_SAVED = torch.get_num_threads()
            torch.set_num_threads(1)
        _THREADS_USERS += 1
    try:
        yield
    finally:
        with _THREADS_LOCK:
            _THREADS_USERS -= 1
            if _THREADS_USERS == 0:
                torch.set_num_threads(_THREADS_SAVED)


def _for_each_chunk(bsz: int, n: int, device: torch.device, work: Callable[[int, int], None]) -> None:
    """Run ``work(lo, hi)`` on every chunk of the batch: in turn, or on the CPU with several torch threads, one
    chunk per worker thread at a time, each worker single-threaded inside.

    Samples, not products, are split between threads: each core then streams its own sample's kernel matrix from
    its own cache, and nothing waits at a barrier inside a product. Splitting each product across threads instead
    met ~4 T barriers per sample, which stall whenever another job holds a core (benches/README.md, "Sinkhorn
    core"). Chunks are handed out as workers free up, so a descheduled worker
    delays only its own chunk. Chunks write disjoint slices of the outputs.
    """
    step = _chunk_size(n)
    chunks = [(lo, min(bsz, lo + step)) for lo in range(0, bsz, step)]
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads <= 1 or len(chunks) <= 1:
        for lo, hi in chunks:
            work(lo, hi)
        return
    with _one_intra_op_thread(), ThreadPoolExecutor(min(threads, len(chunks))) as pool:
        for future in [pool.submit(work, lo, hi) for lo, hi in chunks]:
            future.result()


def _structured_forward(
    scores: torch.Tensor, weights: torch.Tensor, tau: float, n_iters: int, noise: float, seeds: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masks (B, S, N) float64 and the potentials u, v (B, T + 1, N) of every iteration (slot 0: zeros, the start)."""
    bsz, n = scores.shape
    s64 = scores.to(torch.float64)
    anchors = rank_anchors(n, dtype=torch.float64, device=scores.device)
    us = torch.empty(bsz, n_iters + 1, n, dtype=torch.float64, device=scores.device)
    vs = torch.empty_like(us)
    us[:, 0] = 0.0
    vs[:, 0] = 0.0
    masks = torch.empty(bsz, weights.shape[0], n, dtype=torch.float64, device=scores.device)
    work = compute_dtype(scores.dtype)  # the dtype of E

    def chunk(lo: int, hi: int) -> None:
        g = None if seeds is None else noise * gumbel_noise(seeds[lo:hi], n, device=scores.device)
        k = _cost(s64[lo:hi], anchors, g, tau)
        v = torch.zeros(hi - lo, n, dtype=torch.float64, device=scores.device)
        # The first half-step is exact: it fixes a reference pair at which E = exp(K + u) cannot overflow.
        u = _lse_rows(k, v)
        mat = _Stabilised(k, u, v, work)
        for t in range(1, n_iters + 1):
            if t > 1:
                mat.refresh(u, v)
                u = mat.row_update(v)
            mat.refresh(u, v)
            v = mat.col_update(u)
            us[lo:hi, t] = u
            vs[lo:hi, t] = v
        # P = diag(e^(u - u_ref)) E diag(e^(v - v_ref)); masks are W P, so rows of W are scaled before the product.
        mat.refresh(u, v, force=True)
        masks[lo:hi] = torch.matmul(weights.to(work), mat.e)

    _for_each_chunk(bsz, n, scores.device, chunk)
    return masks, us, vs


def _structured_backward(
    grad_masks: torch.Tensor,
    scores: torch.Tensor,
    weights: torch.Tensor,
    tau: float,
    noise: float,
    seeds: torch.Tensor | None,
    us: torch.Tensor,
    vs: torch.Tensor,
) -> torch.Tensor:
    """d loss / d scores (B, N) float64 by reverse-mode through the unrolled potentials.

    With K = (-(s_i - a_j)^2 + G_ji)/tau, every dK term enters ds only through sum_j dK_ji (s_i - a_j) * (-2/tau), so
    each step needs the products Q x and Q^T [1, a, du, du*a], never an N x N gradient.
    """
    bsz, n = scores.shape
    n_iters = us.shape[1] - 1
    s64 = scores.to(torch.float64)
    anchors = rank_anchors(n, dtype=torch.float64, device=scores.device)
    gm = grad_masks.to(torch.float64)
    work = compute_dtype(scores.dtype)  # the dtype of E
    grad = torch.zeros(bsz, n, dtype=torch.float64, device=scores.device)

    def chunk(lo: int, hi: int) -> None:
        s = s64[lo:hi]
        g = None if seeds is None else noise * gumbel_noise(seeds[lo:hi], n, device=scores.device)
        k = _cost(s, anchors, g, tau)
        u_t, v_t = us[lo:hi, -1], vs[lo:hi, -1]
        mat = _Stabilised(k, u_t, v_t, work)
        # Direct term: R = dL/dP * P with dL/dP = W^T dM.
        r = (torch.matmul(weights.transpose(0, 1).to(work), gm[lo:hi].to(work)) * mat.e).to(torch.float64)
        du = r.sum(2)
        dv = r.sum(1)
        # sum_j dK_ji (s_i - a_j) accumulates in acc; ds = -2/tau * acc.
        acc = s * dv - torch.matmul(anchors, r)
        for t in range(n_iters, 0, -1):
            u_t, v_t, v_prev = us[lo:hi, t], vs[lo:hi, t], vs[lo:hi, t - 1]
            # E must cover both Q_t (u_t, v_t) and Q'_t (u_t, v_(t-1)) within the drift window.
            mat.refresh(u_t, v_t)
            if bool(((v_prev - mat.v_ref).abs().amax(1) > mat.drift).any()):
                mat.refresh(u_t, v_t, force=True)
            col_v = torch.exp(v_t - mat.v_ref)
            col_vp = torch.exp(v_prev - mat.v_ref)
            # v-step: v_t = -LSE_j(K + u_t). dK -= dv_i Q_ji, du_t -= Q dv.
            du = du - mat.left(u_t, (col_v * dv)[:, :, None]).squeeze(2)
            ones = torch.ones_like(du)
            y = torch.stack((ones, anchors.expand_as(du), du, du * anchors), dim=2)
            prod = mat.right(u_t, y)
            colsum_q = col_v * prod[:, :, 0]
            a_q = col_v * prod[:, :, 1]
            acc = acc - dv * (s * colsum_q - a_q)
            # u-step: u_t = -LSE_i(K + v_(t-1)). dK -= du_j Q'_ji, dv_(t-1) = -Q'^T du.
            qt_du = col_vp * prod[:, :, 2]
            qt_dua = col_vp * prod[:, :, 3]
            acc = acc - (s * qt_du - qt_dua)
            dv = -qt_du
            # u_(t-1) is used only by v_(t-1): its adjoint starts from zero there.
            du = torch.zeros_like(du)
        grad[lo:hi] = acc * (-2.0 / tau)

    _for_each_chunk(bsz, n, scores.device, chunk)
    return grad


# Registered as ops (like the Triton path) so that torch.compile sees one opaque node instead of breaking the graph
# at the data-dependent refresh and underflow branches inside; the seed travels as an int, the noise is regenerated.


@custom_op("attr_engine::soft_topk_reference", mutates_args=())
def _soft_topk_reference_op(
    scores: torch.Tensor, weights: torch.Tensor, tau: float, n_iters: int, noise: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Structured forward: masks (B, S, N) in scores' dtype, potentials u, v (B, T + 1, N) float64."""
    seeds = _seeds_from_base(scores.shape[0], seed) if noise > 0 else None
    masks, us, vs = _structured_forward(scores, weights, tau, n_iters, noise, seeds)
    return masks.to(scores.dtype), us, vs


@_soft_topk_reference_op.register_fake
def _(scores: torch.Tensor, weights: torch.Tensor, tau: float, n_iters: int, noise: float, seed: int) -> tuple:
    bsz, n = scores.shape
    pot = scores.new_empty(bsz, n_iters + 1, n, dtype=torch.float64)
    return scores.new_empty(bsz, weights.shape[0], n), pot, torch.empty_like(pot)


@custom_op("attr_engine::soft_topk_reference_backward", mutates_args=())
def _soft_topk_reference_backward_op(
    grad_masks: torch.Tensor,
    scores: torch.Tensor,
    weights: torch.Tensor,
    us: torch.Tensor,
    vs: torch.Tensor,
    tau: float,
    noise: float,
    seed: int,
) -> torch.Tensor:
    """Structured backward: d loss / d scores (B, N) in scores' dtype."""
    seeds = _seeds_from_base(scores.shape[0], seed) if noise > 0 else None
    return _structured_backward(grad_masks, scores, weights, tau, noise, seeds, us, vs).to(scores.dtype)


@_soft_topk_reference_backward_op.register_fake
def _(grad_masks: torch.Tensor, scores: torch.Tensor, *_: object) -> torch.Tensor:
    return torch.empty_like(scores)


def _soft_topk_reference_setup(
    ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> None:
    scores, weights, tau, _, noise, seed = inputs
    _, us, vs = output
    ctx.mark_non_differentiable(us, vs)
    ctx.save_for_backward(scores, weights, us, vs)
    ctx.tau, ctx.noise, ctx.seed = tau, noise, seed


def _soft_topk_reference_backward(
    ctx: Any, grad_masks: torch.Tensor, *_: object
) -> tuple[torch.Tensor, None, None, None, None, None]:
    scores, weights, us, vs = ctx.saved_tensors
    grad = torch.ops.attr_engine.soft_topk_reference_backward(
        grad_masks.contiguous(), scores, weights, us, vs, ctx.tau, ctx.noise, ctx.seed
    )
    return grad, None, None, None, None, None


_soft_topk_reference_op.register_autograd(_soft_topk_reference_backward, setup_context=_soft_topk_reference_setup)


# ----------------------------------------------------------------------------------------------------------------
# Triton: the tiled Sinkhorn core (_sinkhorn_core) with the sorter's cost, plus the mask accumulation
# ----------------------------------------------------------------------------------------------------------------
# K, the noise and P are recomputed per tile and never stored: the op's memory is O(B * N * T) like the reference's.
# The arithmetic of this decomposition at the AHA shape is in benches/README.md ("Sinkhorn core").

_MAX_BLOCK_S = 32  # fractions per mask-accumulation tile; larger S is tiled
# The mask kernel holds a (fractions x cells) accumulator and a tl.dot operand besides the K tile: 8 warps keep
# their per-thread share of those tiles in registers (4 warps spill at S = 64).
_DOT_WARPS = 8


@triton.jit
def _topk_masks_kernel(
    s_ptr,  # scores, (B, N) fp32 contiguous
    w_ptr,  # prefix weights W, (S, N) fp32 contiguous
    u_ptr,  # row potentials, (B, T + 1, N) fp32; slot T is read
    m_ptr,  # out: masks, (B, S, N) fp32 contiguous
    N,
    S,
    T,
    inv_tau,
    anchor_step,
    seed,
    noise,
    HAS_NOISE: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rank slots per streamed tile
    BLOCK_C: tl.constexpr,  # cells this program owns
    BLOCK_S: tl.constexpr,  # fractions this program owns
):
    """M[s, c] = sum_r W[s, r] P[r, c] for this program's (fractions, cells) block.

    The last column half-step is redone here and P = exp(x - m_c) / s_c is written from its own column max m and sum
    s (x = K + u^T), not through the stored v^T = -(m + log s): at extreme score scales (|K| ~ 1e8) fp32 cannot hold
    m + log s, and the columns of P, hence M at fraction 1, would no longer sum to one.
    """
    b = _pid(0)
    offs_c = _pid(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_s = _pid(2) * BLOCK_S + tl.arange(0, BLOCK_S)
    s_row = s_ptr + b * N
    u_last = u_ptr + b * (T + 1) * N + T * N
    run_max, run_sum = _line_lse(s_row, u_last, u_last, offs_c, N, 0, 1, inv_tau, anchor_step, seed + b, noise,
                                 True, HAS_NOISE, 0, BLOCK_C, BLOCK_R)  # fmt: skip
    shift, inv_sum = _lse_normaliser(run_max, run_sum)
    acc = tl.zeros([BLOCK_S, BLOCK_C], tl.float32)
    for r0 in range(0, N, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        x = _line_tile(s_row, u_last, u_last, offs_c, offs_r, N, 0, 1, inv_tau, anchor_step, seed + b, noise,
                       True, HAS_NOISE, 0)  # fmt: skip
        p = tl.exp(x - shift[None, :]) * inv_sum[None, :]
        w = tl.load(
            w_ptr + offs_s[:, None] * N + offs_r[None, :], mask=(offs_s[:, None] < S) & (offs_r[None, :] < N), other=0.0
        )
        acc += tl.dot(w, p, input_precision="ieee")
    out_ok = (offs_s[:, None] < S) & (offs_c[None, :] < N)
    tl.store(m_ptr + b * S * N + offs_s[:, None] * N + offs_c[None, :], acc, mask=out_ok)


@triton.jit
def _gumbel_fill_kernel(
    g_ptr,  # out: noise, (B, N, N) fp32
    N,
    seed,
    BLOCK: tl.constexpr,
):
    b = _pid(0)
    offs = _pid(1) * BLOCK + tl.arange(0, BLOCK)
    tl.store(g_ptr + b * N * N + offs, _gumbel(seed + b, offs), mask=offs < N * N)


def _block_s(n_frac: int) -> int:
    # tl.dot needs every dimension >= 16; more than _MAX_BLOCK_S fractions are tiled (grid axis 2, or a loop).
    return max(16, min(_MAX_BLOCK_S, triton.next_power_of_2(n_frac)))


def _scores_cost(scores: torch.Tensor, tau: float, noise: float, seed: int) -> core.Cost:
    n = scores.shape[1]
    return core.Cost(
        scores, 1.0 / tau, scores=True, anchor_step=1.0 / (n - 1) if n > 1 else 0.0, seed=seed, noise=noise
    )


@triton_op("attr_engine::soft_topk_fwd", mutates_args=())
def _soft_topk_fwd_op(
    scores: torch.Tensor, weights: torch.Tensor, tau: float, n_iters: int, noise: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused forward. scores (B, N) fp32, weights (S, N) fp32 -> masks (B, S, N), u and v (B, T + 1, N), all fp32."""
    bsz, n = scores.shape
    n_frac = weights.shape[0]
    masks = scores.new_empty(bsz, n_frac, n)
    us = scores.new_empty(bsz, n_iters + 1, n)
    vs = scores.new_empty(bsz, n_iters + 1, n)
    if bsz == 0:
        return masks, us, vs
    us[:, 0].zero_()  # the sorter's cost needs no row shift
    vs[:, 0].zero_()
    cost = _scores_cost(scores, tau, noise, seed)
    core.forward(cost, us, vs, us)  # P is not written (``us`` stands in for its pointer): the mask kernel reads it
    block_s = _block_s(n_frac)
    wrap_triton(_topk_masks_kernel)[(bsz, triton.cdiv(n, core.OWN), triton.cdiv(n_frac, block_s))](
        scores, weights, us, masks, n, n_frac, n_iters, *cost.args()[3:], HAS_NOISE=noise > 0,
        BLOCK_R=core.STREAM, BLOCK_C=core.OWN, BLOCK_S=block_s, num_warps=_DOT_WARPS,
    )  # fmt: skip
    return masks, us, vs


@triton_op("attr_engine::soft_topk_bwd", mutates_args=())
def _soft_topk_bwd_op(
    grad_masks: torch.Tensor,
    scores: torch.Tensor,
    weights: torch.Tensor,
    us: torch.Tensor,
    vs: torch.Tensor,
    tau: float,
    noise: float,
    seed: int,
) -> torch.Tensor:
    """Fused backward: d loss / d scores (B, N) fp32 from the mask gradient (B, S, N) and the saved potentials."""
    grad = torch.empty_like(scores)
    if scores.shape[0] == 0:
        return grad
    acc = torch.empty_like(scores)
    core.backward(_scores_cost(scores, tau, noise, seed), grad_masks, weights, us, vs, acc, grad)
    return grad


def _soft_topk_setup_context(
    ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> None:
    scores, weights, tau, _, noise, seed = inputs
    _, us, vs = output
    ctx.save_for_backward(scores, weights, us, vs)
    ctx.tau, ctx.noise, ctx.seed = tau, noise, seed


def _soft_topk_backward(
    ctx: Any, grad_masks: torch.Tensor, *_: torch.Tensor
) -> tuple[torch.Tensor, None, None, None, None, None]:
    scores, weights, us, vs = ctx.saved_tensors
    grad = torch.ops.attr_engine.soft_topk_bwd(
        grad_masks.contiguous(), scores, weights, us, vs, ctx.tau, ctx.noise, ctx.seed
    )
    return grad, None, None, None, None, None


_soft_topk_fwd_op.register_autograd(_soft_topk_backward, setup_context=_soft_topk_setup_context)


def triton_gumbel_noise(seed: int, batch: int, n: int, device: torch.device | str) -> torch.Tensor:
    """The Gumbel noise (B, N, N) the fused sorter regenerates in-kernel for ``seed``, materialised (for tests)."""
    out = torch.empty(batch, n, n, dtype=torch.float32, device=device)
    block = 1024
    _gumbel_fill_kernel[(batch, triton.cdiv(n * n, block))](out, n, seed, BLOCK=block)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Public op
# ----------------------------------------------------------------------------------------------------------------


def soft_topk_masks(
    scores: torch.Tensor,
    fractions: torch.Tensor | Sequence[float],
    *,
    tau: float,
    n_iters: int,
    noise: float = 1.0,
    generator: torch.Generator | int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Soft top-k membership masks of N cells for S fractions, through a Gumbel-Sinkhorn soft permutation.

    Args:
        scores: (B, N) region scores (higher = more important). float32/float16/bfloat16/float64, finite.
        fractions: (S,) fractions in [0, 1]; fraction f selects the top f * N cells (linear interpolation between
            the neighbouring integer counts).
        tau: Sinkhorn temperature (> 0); lower is closer to a hard ranking and needs more iterations. The cost is
            measured against anchors in [0, 1], so scores of order one (e.g. a normalised map) make tau meaningful;
            scores of scale 1e4 give a nearly degenerate problem whose rank-slot marginals converge only after
            thousands of iterations (the output stays finite and every cell's memberships still sum to one).
        n_iters: Sinkhorn iterations (>= 1); each normalises over cells, then over rank slots.
        noise: scale of the Gumbel noise (0 gives the deterministic Sinkhorn sort).
        generator: a ``torch.Generator`` or an integer seed for the noise; ``None`` draws from torch's global
            generator. The same seed gives bit-identical masks on the same backend. An integer seed costs no tensor
            read, so the op traces under ``torch.compile(fullgraph=True)``.
        validate: also check that the scores (and a tensor of fractions) are finite and in range. These checks read
            the data, a host-device synchronisation on a GPU: engine loops validate once at their entry point and
            pass False. Shapes, dtypes and scalars are checked either way.

    Returns:
        M: (B, S, N) in the dtype of ``scores``; M[b, s, i] is cell i's soft membership in the top fractions[s] * N.
        Every cell's memberships over rank slots sum to one, so M[:, s].sum(-1) ~= fractions[s] * N.
        Differentiable with respect to ``scores``.
    """
    fractions = _check_inputs(scores, fractions, tau, n_iters, noise, validate)
    bsz, n = scores.shape
    seed = _seed_base(bsz, generator) if noise > 0 else 0
    weights = prefix_weights(fractions, n)
    if use_triton(scores):
        fp32 = torch.float32
        masks, _, _ = torch.ops.attr_engine.soft_topk_fwd(
            scores.to(fp32).contiguous(), weights.to(fp32).contiguous(), tau, n_iters, noise, seed
        )
        return masks.to(scores.dtype)
    masks, _, _ = torch.ops.attr_engine.soft_topk_reference(
        scores, weights, float(tau), int(n_iters), float(noise), seed
    )
    return masks
