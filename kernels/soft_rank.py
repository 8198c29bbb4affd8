"""Soft top-k masks from a Gumbel-Sinkhorn soft ranking: the AHA sorter.

Given region scores s (B, N) and perturbation fractions f (S,), cell i's soft membership in the top ``f_s * N`` cells
is read off a soft permutation P (rank slot j x cell i) obtained by Sinkhorn normalisation of

    K[b, j, i] = (-(s[b, i] - a[j])^2 + G[b, j, i]) / tau,    a = linspace(1, 0, N),

with Gumbel noise G. The masks are prefix sums of P over rank slots, interpolated linearly for fractional counts:

    M[b, s, i] = sum_j W[s, j] P[b, j, i],   W[s, j] = 1 for j < floor(k_s), frac(k_s) for j = floor(k_s), k_s = f_s N.

Three paths, one definition:

- :func:`soft_topk_masks_dense` - the definition: build K densely and differentiate through the Sinkhorn loop with
  autograd. It keeps every iterate, O(n_iters * B * N^2) memory (about 5 GB at B=32, N=784, 30 iterations).
- Structured reference (pure PyTorch, any device): the cost is rank one up to row/column constants, so K is never
  saved. Only the potentials u, v (B, N) of every iteration are kept, O(B * N * n_iters). Per chunk of the batch the
  kernel matrix E = exp(K + u_ref + v_ref) is formed once (float64 for float64 scores, float32 otherwise; potentials
  always float64) and every Sinkhorn half-step becomes a batched matrix-vector product with diagonal rescalings (the
  log-stabilised scaling form); the backward of the unrolled iterations is again matrix-vector products with the
  same E. When potentials drift too far from the reference pair E is re-formed, and a half-step whose sums would
  underflow is done exactly in the log domain, so scores of any scale and tiny tau stay finite. The Gumbel noise is
  regenerated from per-sample seeds in the backward instead of being stored. Registered as a custom op, so
  ``torch.compile`` sees one node. Chunks hold as many samples as fit a cache-sized slab (one at N = 784); with
  several torch threads on the CPU, worker threads take whole chunks (see :func:`_for_each_chunk`), so the masks
  never depend on the thread count.
- Triton (fused): one launch per Sinkhorn half-step over (sample, block of 32 rank slots or cells) programs, the
  potentials in global memory between launches; each program regenerates its K tiles and the Philox Gumbel noise
  on the fly, so neither K nor P is ever written. The masks are accumulated by a last kernel with a small matrix
  product per tile; the backward replays the recurrence from the saved potentials the same way. The arithmetic of
  this decomposition (programs per SM, work per launch) is in the comment above the kernels.

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

from kernels._backend import tl, triton, use_triton
from kernels._tl_helpers import _lse_normaliser, _neg_lse, _online_lse, _pid, compute_dtype
from kernels.sinkhorn import sinkhorn_eager
from kernels.validate import check_int_at_least, check_positive, check_tensor

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

    K stays float64 for every input dtype: a float32 K was measured 13-20 % faster at N = 576-784 but its rounding
    (1e-7, and 1-ulp differences between the vectorised and scalar exp of differently sized chunks) made a refined,
    standardised map depend on its batch mates by 4e-4 (test_a_refined_map_does_not_depend_on_its_batch).
    """
    k = (scores[:, None, :] - anchors[None, :, None]).square_().neg_()
    if noise is not None:
        k = k.add_(noise.to(k.dtype))
    return k.div_(tau)


# ----------------------------------------------------------------------------------------------------------------
# Definition: dense autograd
# ----------------------------------------------------------------------------------------------------------------


def soft_topk_masks_dense(
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
    perm = sinkhorn_eager(log_alpha, n_iters, tau)
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
    met ~4 T barriers per sample, which stall whenever another job holds a core (measured 12.4 s against 3.7 s on
    one thread on a loaded 2-core machine). Chunks are handed out as workers free up, so a descheduled worker
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
    """Masks (B, S, N) float64 and the potentials u (B, T, N), v (B, T, N) of every iteration."""
    bsz, n = scores.shape
    s64 = scores.to(torch.float64)
    anchors = rank_anchors(n, dtype=torch.float64, device=scores.device)
    us = torch.empty(bsz, n_iters, n, dtype=torch.float64, device=scores.device)
    vs = torch.empty_like(us)
    masks = torch.empty(bsz, weights.shape[0], n, dtype=torch.float64, device=scores.device)
    work = compute_dtype(scores.dtype)  # the dtype of E

    def chunk(lo: int, hi: int) -> None:
        g = None if seeds is None else noise * gumbel_noise(seeds[lo:hi], n, device=scores.device)
        k = _cost(s64[lo:hi], anchors, g, tau)
        v = torch.zeros(hi - lo, n, dtype=torch.float64, device=scores.device)
        # The first half-step is exact: it fixes a reference pair at which E = exp(K + u) cannot overflow.
        u = _lse_rows(k, v)
        mat = _Stabilised(k, u, v, work)
        for t in range(n_iters):
            if t > 0:
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
    n_iters = us.shape[1]
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
        for t in range(n_iters - 1, -1, -1):
            u_t, v_t = us[lo:hi, t], vs[lo:hi, t]
            v_prev = vs[lo:hi, t - 1] if t > 0 else torch.zeros_like(v_t)
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
    """Structured forward: masks (B, S, N) in scores' dtype, potentials u, v (B, T, N) float64."""
    seeds = _seeds_from_base(scores.shape[0], seed) if noise > 0 else None
    masks, us, vs = _structured_forward(scores, weights, tau, n_iters, noise, seeds)
    return masks.to(scores.dtype), us, vs


@_soft_topk_reference_op.register_fake
def _(scores: torch.Tensor, weights: torch.Tensor, tau: float, n_iters: int, noise: float, seed: int) -> tuple:
    bsz, n = scores.shape
    pot = scores.new_empty(bsz, n_iters, n, dtype=torch.float64)
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
# Triton: fused log-domain sorter; K, the noise and P are recomputed per tile, never stored
# ----------------------------------------------------------------------------------------------------------------
# Work decomposition. Every half-step is one launch over (sample, block of _OWN rows or columns) programs, and the
# potentials live in global memory between launches (a launch boundary is the only grid-wide barrier CUDA offers).
# Arithmetic at the AHA default (B = 32, N = 784, S = 16, T = 30) on an H200 (132 SMs):
# - programs: 32 x ceil(784 / 32) = 800 per launch, 6 per SM; one program per sample (the previous design) was 32
#   programs, a quarter of the SMs, each running all 2T half-steps serially.
# - work: a half-step recomputes B * N^2 = 19.7 M entries of K (Philox Gumbel noise, two logs, one exp): about
#   100 instructions each, ~2 G instructions, ~70 us at the H200's ~30 T simple instructions/s. That is well above
#   the few microseconds a launch costs, so 2T + 1 forward and 2T + 2 backward launches (about 5 ms and 8 ms of
#   GPU time in all) stay compute-bound and a few percent of the 2 S classifier passes they feed (~100 ms for a
#   ViT-B/16 batch of 32).
# - registers: a program holds one (_OWN x _STREAM) = 32 x 64 tile, 16 fp32 values per thread per temporary at 4
#   warps, so Philox and the online logsumexp fit without spills (``python -m kernels.aot`` checks it).
# Storing the noise once (B * N^2 fp32, 79 MB here) would trade the Philox work for one HBM read per half-step;
# recomputation keeps the op's memory O(B * N * T) like the reference.

_OWN = 32  # rows (or columns) owned by one program of a row (column) pass
_STREAM = 64  # width of the tiles a program streams over the other dimension
_MAX_BLOCK_S = 32  # fractions per mask-accumulation tile; larger S is tiled
# The mask kernel holds a (fractions x cells) accumulator and a tl.dot operand besides the K tile: 8 warps keep
# their per-thread share of those tiles in registers (4 warps spill at S = 64).
_DOT_WARPS = 8


@triton.jit
def _gumbel(seed, offsets):
    """Philox Gumbel noise for integer ``offsets`` under ``seed``: the same numbers in the forward and backward."""
    r = tl.maximum(tl.rand(seed, offsets), 1e-10)
    return -tl.log(-tl.log(r))


@triton.jit
def _cost_tile(
    s_row,  # pointer to this sample's scores, (N,)
    offs_j,  # rank-slot indices of the tile, (BLOCK_J,)
    offs_i,  # cell indices of the tile, (BLOCK_I,)
    N,
    anchor_step,  # 1 / (N - 1), or 0 when N == 1: a_j = 1 - j * anchor_step
    seed,  # this sample's Philox seed
    noise,  # Gumbel scale
    inv_tau,
    HAS_NOISE: tl.constexpr,
):
    """K tile (BLOCK_J, BLOCK_I) in fp32; -inf outside the N x N matrix so padded lanes drop out of every sum.

    K[j, i] = (-(s_i - a_j)^2 + noise * G[j, i]) / tau, G Philox Gumbel noise at counter j * N + i.
    """
    mask_j = offs_j < N
    mask_i = offs_i < N
    s = tl.load(s_row + offs_i, mask=mask_i, other=0.0).to(tl.float32)
    a = 1.0 - offs_j.to(tl.float32) * anchor_step
    d = s[None, :] - a[:, None]
    k = -d * d
    if HAS_NOISE:
        k += noise * _gumbel(seed, offs_j[:, None] * N + offs_i[None, :])
    k = k * inv_tau
    return tl.where(mask_j[:, None] & mask_i[None, :], k, float("-inf"))


@triton.jit
def _topk_line_tile(
    s_row,  # pointer to this sample's scores, (N,)
    other,  # pointer to the potential added along the streamed dimension, (N,) fp32
    t,  # iteration index: at t = 0 the row pass sees no column potential yet (v_(-1) = 0)
    own,  # (BLOCK_OWN,) indices of the lines this program owns
    stream,  # (BLOCK_STREAM,) indices of the streamed tile
    N,
    anchor_step,
    seed,
    noise,
    inv_tau,
    HAS_NOISE: tl.constexpr,
    AXIS: tl.constexpr,  # 1: the program owns rank slots (tile (own, stream)); 0: it owns cells (tile (stream, own))
):
    """K + other over one tile, oriented so that AXIS is the streamed (reduced) dimension:

    AXIS = 1: x[j, i] = K[j, i] + v_(t-1)[i] (own = j);  AXIS = 0: x[j, i] = K[j, i] + u[j] (own = i).
    """
    ok = stream < N
    if AXIS == 1:
        k = _cost_tile(s_row, own, stream, N, anchor_step, seed, noise, inv_tau, HAS_NOISE)
        ok = ok & (t > 0)
    else:
        k = _cost_tile(s_row, stream, own, N, anchor_step, seed, noise, inv_tau, HAS_NOISE)
    return k + tl.expand_dims(tl.load(other + stream, mask=ok, other=0.0), 1 - AXIS)


@triton.jit
def _topk_line_lse(
    s_row,
    other,
    t,
    own,
    N,
    anchor_step,
    seed,
    noise,
    inv_tau,
    HAS_NOISE: tl.constexpr,
    AXIS: tl.constexpr,
    BLOCK_OWN: tl.constexpr,
    BLOCK_STREAM: tl.constexpr,
):
    """Streaming logsumexp pair (max, sum) of :func:`_topk_line_tile` along AXIS, over every tile of the line."""
    run_max = tl.full([BLOCK_OWN], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_OWN], tl.float32)
    for s0 in range(0, N, BLOCK_STREAM):
        stream = s0 + tl.arange(0, BLOCK_STREAM)
        x = _topk_line_tile(s_row, other, t, own, stream, N, anchor_step, seed, noise, inv_tau, HAS_NOISE, AXIS)
        run_max, run_sum = _online_lse(run_max, run_sum, x, AXIS)
    return run_max, run_sum


@triton.jit(do_not_specialize=["t"])
def _topk_half_step_kernel(
    s_ptr,  # scores, (B, N) fp32 contiguous
    u_ptr,  # row potentials of every iteration, (B, T, N) fp32: slot t written (AXIS = 1) or read (AXIS = 0)
    v_ptr,  # column potentials of every iteration, (B, T, N) fp32: slot t - 1 read (AXIS = 1) or slot t written
    N,
    T,
    t,  # iteration index (runtime, so one compiled kernel serves every iteration)
    anchor_step,
    seed,
    noise,
    inv_tau,
    HAS_NOISE: tl.constexpr,
    AXIS: tl.constexpr,  # 1: row half-step, the program owns rank slots; 0: column half-step, it owns cells
    BLOCK_OWN: tl.constexpr,  # lines this program owns
    BLOCK_STREAM: tl.constexpr,  # width of the tiles it streams over the other dimension
):
    """One Sinkhorn half-step for this program's block of lines:

        AXIS = 1 (rows):     u_t[j] = -LSE_i(K[j, i] + v_(t-1)[i])   (v_(-1) = 0)
        AXIS = 0 (columns):  v_t[i] = -LSE_j(K[j, i] + u_t[j])

    One kernel for both directions (the row and column passes were two copies of this loop); each compiled variant
    is the code of one direction only.
    """
    b = _pid(0)
    own = _pid(1) * BLOCK_OWN + tl.arange(0, BLOCK_OWN)
    pot = b * T * N + t * N
    if AXIS == 1:
        out, other = u_ptr + pot, v_ptr + pot - N
    else:
        out, other = v_ptr + pot, u_ptr + pot
    run_max, run_sum = _topk_line_lse(
        s_ptr + b * N, other, t, own, N, anchor_step, seed + b, noise, inv_tau, HAS_NOISE, AXIS, BLOCK_OWN,
        BLOCK_STREAM,
    )  # fmt: skip
    tl.store(out + own, _neg_lse(run_max, run_sum), mask=own < N)


@triton.jit
def _topk_masks_kernel(
    s_ptr,  # scores, (B, N) fp32 contiguous
    w_ptr,  # prefix weights W, (S, N) fp32 contiguous
    u_ptr,  # row potentials, (B, T, N) fp32; the last slot is read
    m_ptr,  # out: masks, (B, S, N) fp32 contiguous
    N,
    S,
    T,
    anchor_step,
    seed,
    noise,
    inv_tau,
    HAS_NOISE: tl.constexpr,
    BLOCK_J: tl.constexpr,  # rank slots per streamed tile
    BLOCK_I: tl.constexpr,  # cells this program owns
    BLOCK_S: tl.constexpr,  # fractions this program owns
):
    """M[s, i] = sum_j W[s, j] P[j, i] for this program's (cells, fractions) block.

    The last column half-step is redone here and P = exp(x - m_i) / s_i is written from its own column max m and sum
    s (x = K + u_T), not through the stored v_T = -(m + log s): at extreme score scales (|K| ~ 1e8) fp32 cannot hold
    m + log s, and the columns of P, hence M at fraction 1, would no longer sum to one.
    """
    b = _pid(0)
    offs_i = _pid(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_s = _pid(2) * BLOCK_S + tl.arange(0, BLOCK_S)
    s_row = s_ptr + b * N
    u_last = u_ptr + b * T * N + (T - 1) * N
    run_max, run_sum = _topk_line_lse(
        s_row, u_last, T - 1, offs_i, N, anchor_step, seed + b, noise, inv_tau, HAS_NOISE, 0, BLOCK_I, BLOCK_J
    )
    shift, inv_sum = _lse_normaliser(run_max, run_sum)
    acc = tl.zeros([BLOCK_S, BLOCK_I], tl.float32)
    for j0 in range(0, N, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        x = _topk_line_tile(
            s_row, u_last, T - 1, offs_i, offs_j, N, anchor_step, seed + b, noise, inv_tau, HAS_NOISE, 0
        )
        p = tl.exp(x - shift[None, :]) * inv_sum[None, :]
        w = tl.load(
            w_ptr + offs_s[:, None] * N + offs_j[None, :], mask=(offs_s[:, None] < S) & (offs_j[None, :] < N), other=0.0
        )
        acc += tl.dot(w, p, input_precision="ieee")
    out_ok = (offs_s[:, None] < S) & (offs_i[None, :] < N)
    tl.store(m_ptr + b * S * N + offs_s[:, None] * N + offs_i[None, :], acc, mask=out_ok)


@triton.jit
def _direct_tile(
    w_ptr,  # prefix weights W, (S, N) fp32
    gm_row,  # this sample's mask gradient, (S, N) fp32
    offs_j,  # (BLOCK_J,) rank slots
    offs_i,  # (BLOCK_I,) cells
    N,
    S,
    BLOCK_J: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """dL/dP tile (BLOCK_J, BLOCK_I) = (W^T dM)[j, i], accumulated over fraction tiles of BLOCK_S."""
    acc = tl.zeros([BLOCK_J, BLOCK_I], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        w_t = tl.load(
            w_ptr + offs_s[None, :] * N + offs_j[:, None], mask=(offs_s[None, :] < S) & (offs_j[:, None] < N), other=0.0
        )
        gm_ok = (offs_s[:, None] < S) & (offs_i[None, :] < N)
        gm = tl.load(gm_row + offs_s[:, None] * N + offs_i[None, :], mask=gm_ok, other=0.0)
        acc += tl.dot(w_t, gm, input_precision="ieee")
    return acc


@triton.jit
def _topk_bwd_direct_kernel(
    s_ptr,  # scores, (B, N) fp32
    w_ptr,  # prefix weights W, (S, N) fp32
    u_ptr,  # saved row potentials, (B, T, N) fp32
    v_ptr,  # saved column potentials, (B, T, N) fp32
    gm_ptr,  # incoming gradient of the masks, (B, S, N) fp32 contiguous
    line_ptr,  # out: line sums of R, (B, N) fp32: du (AXIS = 1) or dv (AXIS = 0)
    acc_ptr,  # out (AXIS = 0 only): sum_j R[j, i] (s_i - a_j), the score accumulator, (B, N) fp32
    N,
    S,
    T,
    anchor_step,
    seed,
    noise,
    inv_tau,
    HAS_NOISE: tl.constexpr,
    AXIS: tl.constexpr,  # 1: the program owns BLOCK_J rank slots; 0: it owns BLOCK_I cells
    BLOCK_J: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """The direct term R = (W^T dM) * P, P = exp(K + u_last + v_last), summed over this program's lines:

        AXIS = 1 (rank slots):  du[j] = sum_i R[j, i]
        AXIS = 0 (cells):       dv[i] = sum_j R[j, i];  acc[i] = s_i dv[i] - sum_j a_j R[j, i]

    One kernel for both directions (they were two copies of this loop); each compiled variant is one direction.
    """
    b = _pid(0)
    s_row = s_ptr + b * N
    last = b * T * N + (T - 1) * N
    if AXIS == 1:
        offs_j = _pid(1) * BLOCK_J + tl.arange(0, BLOCK_J)
        own = offs_j
        u_last = tl.load(u_ptr + last + offs_j, mask=offs_j < N, other=0.0)
        line = tl.zeros([BLOCK_J], tl.float32)
    else:
        offs_i = _pid(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        own = offs_i
        v_last = tl.load(v_ptr + last + offs_i, mask=offs_i < N, other=0.0)
        line = tl.zeros([BLOCK_I], tl.float32)
        line_a = tl.zeros([BLOCK_I], tl.float32)
    for s0 in range(0, N, BLOCK_I if AXIS == 1 else BLOCK_J):
        if AXIS == 1:
            offs_i = s0 + tl.arange(0, BLOCK_I)
            v_last = tl.load(v_ptr + last + offs_i, mask=offs_i < N, other=0.0)
        else:
            offs_j = s0 + tl.arange(0, BLOCK_J)
            u_last = tl.load(u_ptr + last + offs_j, mask=offs_j < N, other=0.0)
        k = _cost_tile(s_row, offs_j, offs_i, N, anchor_step, seed + b, noise, inv_tau, HAS_NOISE)
        p = tl.exp(tl.minimum(k + u_last[:, None] + v_last[None, :], 0.0))
        r = _direct_tile(w_ptr, gm_ptr + b * S * N, offs_j, offs_i, N, S, BLOCK_J, BLOCK_I, BLOCK_S) * p
        line += tl.sum(r, axis=AXIS)
        if AXIS == 0:
            a = 1.0 - offs_j.to(tl.float32) * anchor_step
            line_a += tl.sum(r * a[:, None], axis=0)
    tl.store(line_ptr + b * N + own, line, mask=own < N)
    if AXIS == 0:
        s = tl.load(s_row + own, mask=own < N, other=0.0)
        tl.store(acc_ptr + b * N + own, s * line - line_a, mask=own < N)


# The two adjoint passes below stay two kernels: the row pass is one matrix-vector product (Q dv), the column pass
# four (colsum Q, a-weighted colsum, Q'^T du, Q'^T (du a)) plus the score accumulation. A constexpr-mode merge, as
# for the forward half-steps and the direct terms, would put two unrelated bodies behind one signature.
@triton.jit(do_not_specialize=["t"])
def _topk_bwd_rows_kernel(
    s_ptr,  # scores, (B, N) fp32
    u_ptr,  # saved row potentials, (B, T, N) fp32
    v_ptr,  # saved column potentials, (B, T, N) fp32
    du_ptr,  # adjoint of u_t, (B, N) fp32: the direct row sums on entry at t = T - 1, overwritten
    dv_ptr,  # adjoint of v_t, (B, N) fp32, read
    N,
    T,
    t,  # iteration index
    anchor_step,
    seed,
    noise,
    inv_tau,
    HAS_NOISE: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    """v-step adjoint, rows: du_t[j] = [t = T - 1] du[j] - sum_i Q[j, i] dv_t[i], Q = exp(K + u_t + v_t)."""
    b = _pid(0)
    offs_j = _pid(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    s_row = s_ptr + b * N
    pot = b * T * N + t * N
    u_t = tl.load(u_ptr + pot + offs_j, mask=offs_j < N, other=0.0)
    row = tl.zeros([BLOCK_J], tl.float32)
    for i0 in range(0, N, BLOCK_I):
        offs_i = i0 + tl.arange(0, BLOCK_I)
        k = _cost_tile(s_row, offs_j, offs_i, N, anchor_step, seed + b, noise, inv_tau, HAS_NOISE)
        v_t = tl.load(v_ptr + pot + offs_i, mask=offs_i < N, other=0.0)
        dv = tl.load(dv_ptr + b * N + offs_i, mask=offs_i < N, other=0.0)
        q = tl.exp(tl.minimum(k + u_t[:, None] + v_t[None, :], 0.0))
        row += tl.sum(q * dv[None, :], axis=1)
    base = tl.load(du_ptr + b * N + offs_j, mask=(offs_j < N) & (t == T - 1), other=0.0)
    tl.store(du_ptr + b * N + offs_j, base - row, mask=offs_j < N)


@triton.jit(do_not_specialize=["t"])
def _topk_bwd_cols_kernel(
    s_ptr,  # scores, (B, N) fp32
    u_ptr,  # saved row potentials, (B, T, N) fp32
    v_ptr,  # saved column potentials, (B, T, N) fp32
    du_ptr,  # adjoint of u_t, (B, N) fp32, read
    dv_ptr,  # adjoint of v_t on entry, of v_(t-1) on exit, (B, N) fp32
    acc_ptr,  # score accumulator sum_j dK[j, i] (s_i - a_j), (B, N) fp32
    ds_ptr,  # out at t = 0: gradient of the scores, (B, N) fp32
    N,
    T,
    t,  # iteration index
    anchor_step,
    seed,
    noise,
    inv_tau,
    HAS_NOISE: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    """Columns: the v-step's dK term, then the u-step (Q' = exp(K + u_t + v_(t-1))) and dv_(t-1) = -Q'^T du_t.

    acc[i] -= dv_t[i] (s_i colsum(Q) - sum_j a_j Q[j, i]) + (s_i (Q'^T du)[i] - (Q'^T (du * a))[i]); at t = 0 the
    program also writes ds = -2 / tau * acc.
    """
    b = _pid(0)
    offs_i = _pid(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    s_row = s_ptr + b * N
    pot = b * T * N + t * N
    s = tl.load(s_row + offs_i, mask=offs_i < N, other=0.0)
    v_t = tl.load(v_ptr + pot + offs_i, mask=offs_i < N, other=0.0)
    v_prev = tl.load(v_ptr + pot - N + offs_i, mask=(offs_i < N) & (t > 0), other=0.0)
    q_col = tl.zeros([BLOCK_I], tl.float32)
    q_col_a = tl.zeros([BLOCK_I], tl.float32)
    qp_du = tl.zeros([BLOCK_I], tl.float32)
    qp_du_a = tl.zeros([BLOCK_I], tl.float32)
    for j0 in range(0, N, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        k = _cost_tile(s_row, offs_j, offs_i, N, anchor_step, seed + b, noise, inv_tau, HAS_NOISE)
        u_t = tl.load(u_ptr + pot + offs_j, mask=offs_j < N, other=0.0)
        du = tl.load(du_ptr + b * N + offs_j, mask=offs_j < N, other=0.0)
        a = 1.0 - offs_j.to(tl.float32) * anchor_step
        x = k + u_t[:, None]
        q = tl.exp(tl.minimum(x + v_t[None, :], 0.0))
        qp = tl.exp(tl.minimum(x + v_prev[None, :], 0.0))
        q_col += tl.sum(q, axis=0)
        q_col_a += tl.sum(q * a[:, None], axis=0)
        qp_du += tl.sum(qp * du[:, None], axis=0)
        qp_du_a += tl.sum(qp * (du * a)[:, None], axis=0)
    dv = tl.load(dv_ptr + b * N + offs_i, mask=offs_i < N, other=0.0)
    acc = tl.load(acc_ptr + b * N + offs_i, mask=offs_i < N, other=0.0)
    acc = acc - dv * (s * q_col - q_col_a) - (s * qp_du - qp_du_a)
    tl.store(acc_ptr + b * N + offs_i, acc, mask=offs_i < N)
    tl.store(dv_ptr + b * N + offs_i, -qp_du, mask=offs_i < N)
    tl.store(ds_ptr + b * N + offs_i, acc * (-2.0 * inv_tau), mask=(offs_i < N) & (t == 0))


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


def _anchor_step(n: int) -> float:
    return 1.0 / (n - 1) if n > 1 else 0.0


@triton_op("attr_engine::soft_topk_fwd", mutates_args=())
def _soft_topk_fwd_op(
    scores: torch.Tensor, weights: torch.Tensor, tau: float, n_iters: int, noise: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused forward. scores (B, N) fp32, weights (S, N) fp32 -> masks (B, S, N), u and v (B, T, N), all fp32."""
    bsz, n = scores.shape
    n_frac = weights.shape[0]
    masks = scores.new_empty(bsz, n_frac, n)
    us = scores.new_empty(bsz, n_iters, n)
    vs = scores.new_empty(bsz, n_iters, n)
    if bsz == 0:
        return masks, us, vs
    half = dict(HAS_NOISE=noise > 0, BLOCK_OWN=_OWN, BLOCK_STREAM=_STREAM)
    grid = (bsz, triton.cdiv(n, _OWN))
    step, inv_tau = _anchor_step(n), 1.0 / tau
    for t in range(n_iters):
        for axis in (1, 0):  # the row half-step, then the column half-step
            wrap_triton(_topk_half_step_kernel)[grid](
                scores, us, vs, n, n_iters, t, step, seed, noise, inv_tau, AXIS=axis, **half
            )
    block_s = _block_s(n_frac)
    wrap_triton(_topk_masks_kernel)[(bsz, triton.cdiv(n, _OWN), triton.cdiv(n_frac, block_s))](
        scores, weights, us, masks, n, n_frac, n_iters, step, seed, noise, inv_tau, HAS_NOISE=noise > 0,
        BLOCK_J=_STREAM, BLOCK_I=_OWN, BLOCK_S=block_s, num_warps=_DOT_WARPS,
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
    bsz, n = scores.shape
    n_frac, n_iters = weights.shape[0], us.shape[1]
    grad = torch.empty_like(scores)
    if bsz == 0:
        return grad
    du, dv, acc = scores.new_empty(3, bsz, n).unbind(0)
    rows = dict(HAS_NOISE=noise > 0, BLOCK_J=_OWN, BLOCK_I=_STREAM)
    cols = dict(HAS_NOISE=noise > 0, BLOCK_J=_STREAM, BLOCK_I=_OWN)
    grid = (bsz, triton.cdiv(n, _OWN))
    # The direct-term kernels loop over fractions in tiles of 16, whatever S is (a loop costs nothing extra here).
    step, inv_tau, block_s = _anchor_step(n), 1.0 / tau, 16
    direct = (scores, weights, us, vs, grad_masks)
    # The direct terms also hold a (W^T dM) tile from tl.dot: they own 32 rows (columns) and stream 16 columns
    # (rows) at a time, at 4 warps. This is the configuration without spills on both sm_80 and sm_90 for every N
    # and S checked; 32 x 32 tiles, or 8 warps, spilled a few bytes on one of the two (ptxas' choices, measured
    # with ``python -m kernels.aot``).
    thin = 16
    for axis, line, blocks in ((1, du, dict(BLOCK_J=_OWN, BLOCK_I=thin)), (0, dv, dict(BLOCK_J=thin, BLOCK_I=_OWN))):
        wrap_triton(_topk_bwd_direct_kernel)[grid](
            *direct, line, acc, n, n_frac, n_iters, step, seed, noise, inv_tau, HAS_NOISE=noise > 0, AXIS=axis,
            BLOCK_S=block_s, **blocks,
        )  # fmt: skip
    for t in range(n_iters - 1, -1, -1):
        wrap_triton(_topk_bwd_rows_kernel)[grid](
            scores, us, vs, du, dv, n, n_iters, t, step, seed, noise, inv_tau, **rows
        )
        wrap_triton(_topk_bwd_cols_kernel)[grid](
            scores, us, vs, du, dv, acc, grad, n, n_iters, t, step, seed, noise, inv_tau, **cols
        )
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
