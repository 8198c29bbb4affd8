"""MDA, metric-driven attribution (Walker, Jha & Ewetz, ICLR 2025): a per-image search for the map that scores best
on the perturbation curves themselves.

Official code: github.com/chasewalker26/MDA-Metric-Driven-Attributions-for-ViT (``util/attribution_methods/
MDAFunctions.py``: ``MDA`` -> ``find_insertion_patches`` -> ``find_deletion_patches``). The image is cut into
``N = g x g`` cells (the ViT's token grid in the paper: 7 x 7 for ViT-B/32, 14 x 14 for /16) and every cell is one
step of the curves. A prior map (Bi-Attn in the paper) only orders the candidates of a greedy search:

1. **Insertion order.** From a blurred image, cells of ``x`` are put back one at a time; each step tries the
   ``window`` highest-prior cells not yet inserted (``window = min(2 floor(sqrt N), 28)``) and keeps the one that
   raises the target probability most. It stops once the normalised score ``(p - p_blur) / |p_x - p_blur|``
   reaches ``cutoff`` (0.9): those ``L`` cells are the most important ones.
2. **Deletion order.** From the substrate (zero in normalised space: the classifier's mean colour), cells are
   inserted so as to *lower* the probability most (the ``window`` lowest-prior cells not taken, the argmin), the
   ``L`` cells of step 1 last (the most important one at the very end). Read backwards this is the best deletion
   order. Its curve, normalised to [0, 1] and made monotone (running minimum), is projected onto convex curves
   (:func:`convex_fit`, the official ``normalize_curve``: a small QP) and each cell gets the drop its deletion
   causes, ``T_i / area_i + T_i (N - i) / N``.
3. **Magnitudes.** That first map is scored with pixel-level MAS insertion (from the blur) and deletion (to the
   mean colour) curves at ``H`` steps of ``W`` pixels; ``1 - mean(insertion, 1 - deletion)``, resampled to the
   ``N + 1`` cell steps and projected again, gives the final drops ``T_i``. The sparse map puts
   ``T_i / area_i + T_i (N - i) / N`` on each cell; the dense map puts ``(N - i) / N`` where that value reaches
   ``kappa`` (the value itself elsewhere), rescaled to the sparse map's maximum; ``gamma`` mixes them
   (``(1 - gamma) sparse + gamma dense``) and ``smooth`` resamples the cell map bilinearly (antialiased) down to the
   grid and back up, as the official ``MDA()`` returns it.

The insertion substrate is the official blur of the image (the first of a series of Gaussian kernels that brings
the target's probability to 1 % or less). MDA needs nothing of a ViT but its token grid (default 7 x 7 without one);
every step is a batched forward pass of perturbed images, about ``N * window + 2 H + 40`` per image. Details of the
substrate and the cost: docs/mda.md; differences from the official code: docs/deviations.md ("MDA").
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from attr_engine.baselines.cam import is_vit, token_grid
from attr_engine.classifier import Classifier
from attr_engine.explainer import Explainer, get_explainer, resolve_explainer
from attr_engine.metrics.curves import batched_logits, perturbation_curve, target_probability
from attr_engine.metrics.perturbation import pixel_ranks
from attr_engine_kernels.region import cell_index
from attr_engine_kernels.validate import check_int_at_least

__all__ = ["MDA", "convex_fit", "default_grid", "mda_blur", "mda_blur_kernel", "search_window"]

# The official blur search (MDA_results/evaluations/MDATest.py): size = sigma from 31 px in steps of 2 while the
# target's softmax is above 1 % and the size is at most 101, so the last size tried is 103.
BLUR_SIZES: tuple[int, ...] = tuple(range(31, 104, 2))
BLUR_CONFIDENCE_PERCENT = 1.0
WINDOW_CAP = 28  # the official subsearch_len: 2 floor(sqrt(N)), at most 28
DEFAULT_GRID = 7  # ViT-B/32's token grid, for classifiers without one
# The convex fit stops once the mean complementarity s * lambda and the residuals are below these (float64, curves
# in [0, 1]). The dual residual bounds the error of the fit (the projection is 1-Lipschitz in the target); it
# cannot go much below 1e-8: the reduced Newton system has the weights lambda / s ~ 1 / mu, whose round-off sets
# that floor. cvxopt, the official solver, stops at a relative gap of 1e-6.
_QP_TOL_MU = 1e-10
_QP_TOL_PRIMAL = 1e-9
_QP_TOL_DUAL = 1e-7
_QP_FAIL = 1e3  # a best merit above this (a dual residual of 1e-4) is a failure, not round-off
_QP_MAX_ITER = 100


# ---------------------------------------------------------------------------------------------------------------
# The substrates
# ---------------------------------------------------------------------------------------------------------------


def mda_blur_kernel(size: int, sigma: float) -> torch.Tensor:
    """The 1-D factor of the official blur kernel: ``scipy.ndimage.gaussian_filter`` (truncate 4, mode "reflect")
    of a delta at the centre of ``size`` samples, so the Gaussian's tails fold back into the window.

    Returns:
        (size,) float64, summing to 1; the official 2-D kernel is its outer product with itself.
    """
    size = check_int_at_least(size, "size", 1)
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma!r}")
    radius = int(4.0 * float(sigma) + 0.5)  # scipy's truncate=4.0
    offsets = torch.arange(-radius, radius + 1, dtype=torch.float64)
    weights = torch.exp(-0.5 / float(sigma) ** 2 * offsets**2)
    weights = weights / weights.sum()
    centre = size // 2
    # correlate1d: out[i] = sum_t w[t] * in[reflect(i + t)], the delta at the centre; "reflect" mirrors about the
    # array's edges (d c b a | a b c d | d c b a), period 2 * size.
    pos = torch.arange(size)[:, None] + torch.arange(-radius, radius + 1)[None, :]
    pos = pos.remainder(2 * size)
    pos = torch.where(pos < size, pos, 2 * size - 1 - pos)
    return ((pos == centre).double() * weights[None, :]).sum(dim=1)


def mda_blur(x: torch.Tensor, mean: torch.Tensor, size: int) -> torch.Tensor:
    """The official insertion substrate: the blur of ``mda_blur_kernel(size, size)`` in normalised space with zero
    padding, i.e. ``mean + conv(x - mean)`` on [0, 1] pixels.

    Args:
        x: (B, 3, H, W) images in [0, 1].
        mean: the classifier's normalisation mean, broadcastable to (1, 3, 1, 1).
        size: kernel size and sigma in pixels.

    Returns:
        (B, 3, H, W) in ``x``'s dtype.
    """
    taps = mda_blur_kernel(size, float(size)).to(device=x.device, dtype=x.dtype)
    mean = mean.to(device=x.device, dtype=x.dtype).reshape(1, -1, 1, 1)
    channels = x.shape[1]
    # The 2-D kernel is an outer product: two 1-D passes cost 2 * size taps per pixel instead of size ** 2.
    out = F.conv2d(x - mean, taps.view(1, 1, 1, -1).expand(channels, 1, 1, -1), padding=(0, size // 2), groups=channels)
    out = F.conv2d(out, taps.view(1, 1, -1, 1).expand(channels, 1, -1, 1), padding=(size // 2, 0), groups=channels)
    return mean + out


def _search_blur(
    classifier: Classifier, x: torch.Tensor, target: torch.Tensor, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per image, the first official blur that brings the target's probability to 1 % or less (else the last).

    Several kernel sizes are classified per call while few images are still searching, so a small batch does not
    cost one call per size. Returns the (B, 3, H, W) blurred images, their (B,) kernel sizes and their (B,) float32
    target probabilities.
    """
    mean = classifier.norm_mean
    blurred = torch.empty_like(x)
    sizes = torch.full((x.shape[0],), BLUR_SIZES[-1], dtype=torch.long, device=x.device)
    p_blur = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    searching = torch.arange(x.shape[0], device=x.device)
    first = 0
    while len(searching) and first < len(BLUR_SIZES):
        group = BLUR_SIZES[first : first + max(1, batch_size // len(searching))]
        first += len(group)
        tries = torch.stack([mda_blur(x[searching], mean, size) for size in group])  # (S, R, 3, H, W)
        logits = batched_logits(classifier, tries.flatten(0, 1), batch_size)
        prob = target_probability(logits, target[searching].repeat(len(group))).view(len(group), -1)
        # The official test is on the percentage in float32: softmax * 100 > 1 keeps searching.
        done = (prob * 100) <= BLUR_CONFIDENCE_PERCENT
        last = first >= len(BLUR_SIZES)
        pick = torch.where(done.any(0), done.float().argmax(0), torch.full_like(searching, len(group) - 1))
        keep = done.any(0) | last
        column = torch.arange(len(searching), device=x.device)
        blurred[searching] = tries[pick, column]
        p_blur[searching] = prob[pick, column]
        sizes[searching[keep]] = torch.tensor(group, device=x.device)[pick[keep]]
        searching = searching[~keep]
    return blurred, sizes, p_blur


# ---------------------------------------------------------------------------------------------------------------
# The convex projection of a curve (the official normalize_curve, type 0)
# ---------------------------------------------------------------------------------------------------------------


def _second_difference(v: torch.Tensor) -> torch.Tensor:
    """(B, k) -> (B, k): ``v[i-1] - 2 v[i] + v[i+1]``, zero beyond the ends (the symmetric matrix D of the fit)."""
    padded = F.pad(v, (1, 1))
    return padded[:, :-2] - 2 * v + padded[:, 2:]


def convex_fit(curve: torch.Tensor) -> torch.Tensor:
    """The least-squares convex curve with the same end points: the official ``normalize_curve(r, type=0)``.

    Solves ``min ||y - r||^2`` subject to ``y_0 = r_0``, ``y_n = r_n``, ``0 <= y <= 1`` and
    ``y_i - 2 y_{i+1} + y_{i+2} >= 0`` for every row, with a batched primal-dual interior-point method
    (Mehrotra's predictor-corrector) on the curve's device, where the official code calls cvxopt once per curve.
    The upper bound is left out: a convex sequence lies below its chord, so with end points in [0, 1] it never
    binds. Rows whose end points are both 0 have one feasible point, zero.

    Args:
        curve: (B, n) curves with end points in [0, 1].

    Returns:
        (B, n) float64 on ``curve``'s device.

    Raises:
        ValueError: a curve that is not (B, n), has NaN / inf values, or end points outside [0, 1].
        RuntimeError: the solver did not converge (it does in about 20 iterations on such problems).
    """
    if curve.ndim != 2:
        raise ValueError(f"curve must be (B, n), got shape {tuple(curve.shape)}")
    r = curve.double()
    if not bool(torch.isfinite(r).all()):
        raise ValueError("curve contains NaN or infinite values")
    ends = r[:, [0, -1]]
    if r.shape[1] and not bool(((ends >= 0) & (ends <= 1)).all()):
        raise ValueError("the curve's end points must lie in [0, 1]")
    k = r.shape[1] - 2
    if k < 1 or r.shape[0] == 0:
        return r.clone()
    e = torch.zeros_like(r[:, 1:-1])
    e[:, 0] += r[:, 0]
    e[:, -1] += r[:, -1]
    z, slack, dual = _interior_point(r[:, 1:-1], e)
    y = _polish(r, torch.cat([r[:, :1], z, r[:, -1:]], dim=1), slack, dual)
    return torch.where((ends == 0).all(1, keepdim=True), torch.zeros_like(y), y)


def _g_mul(v: torch.Tensor) -> torch.Tensor:
    """G v for G = [-I; -D]: (B, k) -> (B, 2k)."""
    return torch.cat([-v, -_second_difference(v)], dim=1)


def _gt_mul(v: torch.Tensor) -> torch.Tensor:
    """G^T v for G = [-I; -D]: (B, 2k) -> (B, k)."""
    k = v.shape[1] // 2
    return -v[:, :k] - _second_difference(v[:, k:])


def _newton(
    chol: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    lam: torch.Tensor,
    residuals: tuple[torch.Tensor, torch.Tensor],
    r_comp: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Newton direction (dz, dlambda, ds) of the KKT system, reduced to ``(I + G^T W G) dz = rhs``.

    chol: (B, k, k) Cholesky factor of the reduced matrix; w = lambda / s, s, lam: (B, 2k); residuals: the dual
    (B, k) and primal (B, 2k) residuals; r_comp: (B, 2k) the target of ``lambda ds + s dlambda``.
    """
    r_dual, r_prim = residuals
    rhs = -r_dual - _gt_mul(w * r_prim + r_comp / s)
    dz = torch.cholesky_solve(rhs[:, :, None], chol)[:, :, 0]
    dlam = w * (_g_mul(dz) + r_prim) + r_comp / s
    return dz, dlam, (r_comp - s * dlam) / lam


def _interior_point(target: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """min 1/2 ||z - target||^2 s.t. G z <= h, G = [-I; -D], h = [0; e] (z >= 0 and D z + e >= 0), per row.

    target, e: (B, k); D is :func:`_second_difference`. Returns each row's best iterate: z (B, k), slacks s and
    duals lambda (B, 2k). A row stops at its best point once its residuals and mean complementarity are below the
    tolerances (past that round-off floor the iterates wander off again).
    """
    k = target.shape[1]
    h = torch.cat([torch.zeros_like(e), e], dim=1)
    z = target.clone()
    s = (h - _g_mul(z)).clamp_min(1.0)
    lam = torch.ones_like(s)
    best_z, best_s, best_lam = z.clone(), s.clone(), lam.clone()
    best = torch.full_like(z[:, 0], math.inf)
    frozen = torch.zeros_like(z[:, 0], dtype=torch.bool)
    for _ in range(_QP_MAX_ITER):
        residuals = (z - target + _gt_mul(lam), _g_mul(z) + s - h)
        mu = (s * lam).mean(1, keepdim=True)
        merit = torch.stack(
            [
                residuals[0].abs().amax(1) / _QP_TOL_DUAL,
                residuals[1].abs().amax(1) / _QP_TOL_PRIMAL,
                mu[:, 0] / _QP_TOL_MU,
            ]
        ).amax(0)
        better = merit < best
        best_z = torch.where(better[:, None], z, best_z)
        best_s, best_lam = torch.where(better[:, None], s, best_s), torch.where(better[:, None], lam, best_lam)
        best = torch.where(better, merit, best)
        frozen |= best < 1
        if bool(frozen.all()):
            break
        w = torch.where(frozen[:, None], torch.ones_like(s), lam / s)  # unit weights: frozen rows stay well posed
        chol, info = torch.linalg.cholesky_ex(_normal_matrix(w, k))
        if bool((info != 0).any()):  # so ill-conditioned that round-off broke it: that row is done
            frozen |= info != 0
            w = torch.where(frozen[:, None], torch.ones_like(s), w)
            chol = torch.linalg.cholesky(_normal_matrix(w, k))
        # Mehrotra: an affine-scaling predictor sets the centring sigma = (mu_aff / mu)^3 of the corrector.
        _, dlam_a, ds_a = _newton(chol, w, s, lam, residuals, -s * lam)
        alpha = _step_to_boundary(s, ds_a, lam, dlam_a, 1.0)
        sigma = (((s + alpha * ds_a) * (lam + alpha * dlam_a)).mean(1, keepdim=True) / mu) ** 3
        dz, dlam, ds = _newton(chol, w, s, lam, residuals, -s * lam - ds_a * dlam_a + sigma * mu)
        alpha = _step_to_boundary(s, ds, lam, dlam, 0.99) * (~frozen[:, None])
        z, s, lam = z + alpha * dz, s + alpha * ds, lam + alpha * dlam
    if bool((best > _QP_FAIL).any()):
        raise RuntimeError(f"the convex fit of MDA's curves did not converge in {_QP_MAX_ITER} iterations")
    return best_z, best_s, best_lam


def _polish(r: torch.Tensor, y: torch.Tensor, slack: torch.Tensor, dual: torch.Tensor) -> torch.Tensor:
    """The exact optimum on the active set the interior point found (OSQP's "solution polishing").

    An interior point stops with every constraint a little inside (``s * lambda ~ mu``): where a constraint is
    active but degenerate (``s`` and ``lambda`` both tend to 0, common in convex regression) the fit is only
    ``sqrt(mu)`` accurate. On the active set the optimum is a least-squares fit of a piecewise-linear curve: knots
    where the convexity constraint is inactive, zero where the bound is active, the end points fixed. Each row
    takes it where it is feasible and no worse than the interior point, which it is whenever the active set is
    right (a degenerate constraint may fall on either side: with a zero multiplier both give the optimum).

    r, y: (B, n) the curves and the interior-point fits; slack, dual: (B, 2 (n - 2)). Returns (B, n).
    """
    batch, n = r.shape
    k = n - 2
    bound = slack[:, :k] < dual[:, :k]  # y_{i+1} = 0
    knot = torch.ones_like(r, dtype=torch.bool)
    knot[:, 1:-1] = (slack[:, k:] >= dual[:, k:]) | bound  # where the curve may bend
    fixed = torch.zeros_like(knot)
    fixed[:, [0, -1]] = True
    fixed[:, 1:-1] = bound
    values = torch.zeros_like(r)
    values[:, [0, -1]] = r[:, [0, -1]]
    idx = torch.arange(n, device=r.device).expand(batch, n)
    before = torch.where(knot, idx, 0).cummax(1).values
    after = torch.where(knot, idx, n - 1).flip(1).cummin(1).values.flip(1)
    frac = (idx - before).to(r.dtype) / (after - before).clamp_min(1).to(r.dtype)
    # hats (B, n, n): each point is the linear interpolation of its two neighbouring knots (itself, at a knot)
    hats = torch.zeros(batch, n, n, dtype=r.dtype, device=r.device)
    hats.scatter_add_(2, before[..., None], (1 - frac)[..., None])
    hats.scatter_add_(2, after[..., None], frac[..., None])
    free = (knot & ~fixed).to(r.dtype)
    free_hats = hats * free[:, None, :]
    gram = free_hats.mT @ free_hats + torch.diag_embed(1 - free)
    rhs = free_hats.mT @ (r - (hats @ values[..., None])[..., 0])[..., None]
    coef = torch.cholesky_solve(rhs, torch.linalg.cholesky(gram))[..., 0]
    polished = (hats @ (coef * free + values)[..., None])[..., 0]
    curvature = polished[:, :-2] - 2 * polished[:, 1:-1] + polished[:, 2:]
    feasible = (curvature.amin(1) >= -1e-12) & (polished.amin(1) >= -1e-12)
    no_worse = ((polished - r) ** 2).sum(1) <= ((y - r) ** 2).sum(1) + 1e-15
    return torch.where((feasible & no_worse)[:, None], polished, y)


def _normal_matrix(w: torch.Tensor, k: int) -> torch.Tensor:
    """(B, k, k) ``I + G^T diag(w) G`` for G = [-I; -D]: ``I + diag(w1) + D diag(w2) D``, pentadiagonal, assembled
    band by band (a dense product would cost k^3 per row)."""
    w1, w2 = w[:, :k], w[:, k:]
    pad = F.pad(w2, (1, 1))  # w2 with zeros beyond the ends
    main = 1 + w1 + pad[:, :-2] + 4 * w2 + pad[:, 2:]
    normal = torch.diag_embed(main)
    if k > 1:
        off1 = -2 * (w2[:, :-1] + w2[:, 1:])
        normal = normal + torch.diag_embed(off1, 1) + torch.diag_embed(off1, -1)
    if k > 2:
        off2 = w2[:, 1:-1]
        normal = normal + torch.diag_embed(off2, 2) + torch.diag_embed(off2, -2)
    return normal


def _step_to_boundary(
    s: torch.Tensor, ds: torch.Tensor, lam: torch.Tensor, dlam: torch.Tensor, fraction: float
) -> torch.Tensor:
    """(B, 1) largest step in [0, 1] that keeps s and lambda positive, times ``fraction`` (capped at 1)."""
    ratios = torch.cat([-s / ds.clamp(max=-1e-300), -lam / dlam.clamp(max=-1e-300)], dim=1)
    ratios = torch.where(torch.cat([ds, dlam], dim=1) < 0, ratios, torch.full_like(ratios, math.inf))
    return (fraction * ratios.amin(1, keepdim=True)).clamp(max=1.0)


# ---------------------------------------------------------------------------------------------------------------
# The cell grid and the greedy searches
# ---------------------------------------------------------------------------------------------------------------


def default_grid(model: nn.Module, height: int, width: int) -> tuple[int, int]:
    """The official cell grid: the ViT's token grid (the paper's 14 x 14 for /16 and 7 x 7 for /32 models), else
    7 x 7; at most one cell per pixel."""
    rows, cols = token_grid(model, height, width) if is_vit(model) else (DEFAULT_GRID, DEFAULT_GRID)
    return min(rows, height), min(cols, width)


def search_window(cells: int) -> int:
    """The official candidates per greedy step: ``2 floor(sqrt(N))``, at most 28."""
    return min(2 * math.isqrt(cells), WINDOW_CAP)


def _cell_of_pixel(height: int, width: int, grid: tuple[int, int], device: torch.device) -> torch.Tensor:
    """(H * W,) row-major cell id of every pixel: the regular ``gh x gw`` partition of
    ``attr_engine_kernels.region``."""
    rows = cell_index(height, grid[0]).to(device)
    cols = cell_index(width, grid[1]).to(device)
    return (rows[:, None] * grid[1] + cols[None, :]).flatten()


def _candidates(order: torch.Tensor, taken: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Each row's first ``window`` cells of ``order`` not yet ``taken``.

    order: (B, N) cell ids in search order; taken: (B, N) bool by cell id; window: (B,) candidates per row
    (0 for a row that has stopped). Returns (B, max(window)) cell ids, -1 past a row's own window.
    """
    width = int(window.max())
    free = ~taken.gather(1, order)  # in search order
    within = free & (free.cumsum(1) <= window[:, None])
    positions = torch.arange(order.shape[1], device=order.device).expand_as(order)
    # The picked positions first, in search order (the others sort behind them).
    first = torch.where(within, positions, order.shape[1]).sort(1).values[:, :width]
    picked = order.gather(1, first.clamp(max=order.shape[1] - 1))
    return torch.where(first < order.shape[1], picked, -1)


def _score_candidates(
    classifier: Classifier,
    current: torch.Tensor,
    source: torch.Tensor,
    pixel_cell: torch.Tensor,
    candidates: torch.Tensor,
    target: torch.Tensor,
    batch_size: int,
) -> torch.Tensor:
    """Target probability of each row's ``current`` image with one candidate cell taken from ``source``.

    current, source: (B, 3, H, W); pixel_cell: (H * W,); candidates: (B, W) cell ids, -1 for none. The (image,
    candidate) pairs are classified ``batch_size`` at a time. Returns (B, W) float32, NaN where there is none.
    """
    height, width = current.shape[-2:]
    scores = torch.full(candidates.shape, math.nan, dtype=torch.float32, device=current.device)
    pairs = (candidates >= 0).nonzero()
    for chunk in pairs.split(batch_size):
        b, w = chunk[:, 0], chunk[:, 1]
        mask = (pixel_cell[None, :] == candidates[b, w][:, None]).view(-1, 1, height, width)
        images = torch.where(mask, source[b], current[b])
        scores[b, w] = target_probability(classifier.forward_trusted(images), target[b])
    return scores


def _greedy_insertion(
    classifier: Classifier,
    start: torch.Tensor,
    end: torch.Tensor,
    pixel_cell: torch.Tensor,
    order: torch.Tensor,
    taken: torch.Tensor,
    steps: torch.Tensor,
    window: int,
    target: torch.Tensor,
    batch_size: int,
    *,
    maximise: bool,
    stop: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The official greedy search: cells of ``end`` go into ``start`` one per step, each the best of the first
    ``min(window, cells left)`` of ``order`` not yet taken (highest probability with ``maximise``, else lowest;
    the first of equals, as ``torch.argmax`` / ``argmin``).

    Args:
        start, end: (B, 3, H, W); pixel_cell: (H * W,) cell of each pixel; order: (B, N) search order.
        taken: (B, N) bool, cells excluded from the start (updated in place).
        steps: (B,) steps per row (at most its cells not taken).
        stop: ``(p_start, p_end, cutoff)``: a row stops after the step whose normalised probability
            ``(p - p_start) / |p_end - p_start|`` reaches ``cutoff`` (the insertion phase).

    Returns:
        (B, max(steps)) the cells in the order they went in (-1 after a row's last step) and the (B,) number of
        steps each row took.
    """
    current = start.clone()
    batch, cells = taken.shape
    picked = torch.full((batch, int(steps.max()) if batch else 0), -1, dtype=torch.long, device=start.device)
    done = torch.zeros(batch, dtype=torch.long, device=start.device)
    rows = torch.arange(batch, device=start.device)
    for step in range(picked.shape[1]):
        active = done < steps
        if not bool(active.any()):
            break
        left = cells - taken.sum(1)
        sizes = torch.where(active, torch.minimum(left, torch.full_like(left, window)), 0)
        cand = _candidates(order, taken, sizes)
        scores = _score_candidates(classifier, current, end, pixel_cell, cand, target, batch_size)
        scores = torch.where(cand >= 0, scores, -math.inf if maximise else math.inf)
        best = scores.argmax(1) if maximise else scores.argmin(1)
        cell = torch.where(active, cand[rows, best], -1)
        picked[:, step] = cell
        taken[rows[active], cell[active]] = True
        mask = (pixel_cell[None, :] == cell[:, None]).view(batch, 1, *start.shape[-2:])
        current = torch.where(mask, end, current)
        done += active.long()
        if stop is not None:
            p_start, p_end, cutoff = stop
            # float32, as the official test: (p - p_blur) / |p_x - p_blur| >= cutoff
            reached = (scores[rows, best] - p_start) / (p_end - p_start).abs() >= cutoff
            steps = torch.where(active & reached, done, steps)
    return picked, done


# ---------------------------------------------------------------------------------------------------------------
# Curves and magnitudes
# ---------------------------------------------------------------------------------------------------------------


def _normalised(curve: torch.Tensor, p_x: torch.Tensor, p_ref: torch.Tensor, *, falling: bool) -> torch.Tensor:
    """The official monotone normalisation: ``clip((p - p_ref) / |p_x - p_ref|, 0, 1)``, then the running minimum
    (a falling, deletion curve) or maximum (a rising, insertion curve). curve: (B, n); p_x, p_ref: (B,).
    Returns (B, n) float64."""
    base = p_ref.double()[:, None]
    scale = (p_x.double()[:, None] - base).abs()
    # A reference the classifier scores exactly like x leaves nothing to normalise by (the official code divides
    # by zero there): the curve then reads 0 wherever it is not above the reference.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    value = ((curve.double() - base) / scale).clamp(0, 1)
    return value.cummin(1).values if falling else value.cummax(1).values


def _resample(curve: torch.Tensor, points: int) -> torch.Tensor:
    """(B, M) -> (B, points) by linear interpolation between equally spaced points (the official ``np.interp`` of
    ``linspace(0, 100, M)`` onto ``linspace(0, 100, points)``)."""
    m = curve.shape[1]
    position = torch.arange(points, dtype=torch.float64, device=curve.device) * (m - 1) / (points - 1)
    low = position.floor().long().clamp(max=m - 2)
    frac = position - low
    return curve[:, low] * (1 - frac) + curve[:, low + 1] * frac


def _cell_values(fit: torch.Tensor, order: torch.Tensor, areas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The official magnitudes: the i-th cell deleted (``order[:, i - 1]``) gets ``T_i / area + T_i (N - i) / N``,
    ``T_i = fit[i - 1] - fit[i]`` its drop on the fitted deletion curve.

    fit: (B, N + 1); order: (B, N) deletion order; areas: (N,) pixels per cell. Returns the (B, N) values and the
    (B, N) rank weights ``(N - i) / N``, both by cell id, float64.
    """
    cells = order.shape[1]
    drops = fit[:, :-1] - fit[:, 1:]
    weight = (cells - torch.arange(1, cells + 1, dtype=torch.float64, device=fit.device)) / cells
    values = drops / areas[order] + drops * weight
    by_cell = torch.empty_like(values).scatter_(1, order, values)
    return by_cell, torch.empty_like(values).scatter_(1, order, weight.expand_as(values))


def _mas_ranks(first: torch.Tensor, order: torch.Tensor, pixel_cell: torch.Tensor) -> torch.Tensor:
    """(B, H * W) pixel ranks for the MAS curves: descending ``|value|`` of the pixel's cell, equal values in the
    deletion order, and within a cell the later pixel first (the official ``np.flip(np.argsort(|map|))`` with a
    stable sort).

    Cells whose fitted drop is exactly zero tie; the official code never sees the tie, because cvxopt stops inside
    the feasible set and leaves them tiny drops that fall along the deletion order, which is the order kept here.
    first: (B, N) values by cell id; order: (B, N) deletion order; pixel_cell: (H * W,).
    """
    batch, cells = first.shape
    pixels = pixel_cell.shape[0]
    position = torch.empty_like(order).scatter_(1, order, torch.arange(cells, device=order.device).expand_as(order))
    cell_key = torch.stack([-first.abs(), position.double()], dim=2)  # sort keys, most significant first
    by_value = torch.argsort(cell_key[..., 1], dim=1, stable=True)
    by_value = by_value.gather(1, torch.argsort(cell_key[..., 0].gather(1, by_value), dim=1, stable=True))
    cell_rank = torch.empty_like(by_value).scatter_(
        1, by_value, torch.arange(cells, device=order.device).expand_as(order)
    )
    key = cell_rank.gather(1, pixel_cell.expand(batch, -1)) * pixels + (
        pixels - 1 - torch.arange(pixels, device=order.device)
    )
    return pixel_ranks(-key.double())


def _mas_objective(
    classifier: Classifier,
    images: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scores: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ranks: torch.Tensor,
    target: torch.Tensor,
    points: int,
    batch_size: int,
) -> torch.Tensor:
    """The curve MDA fits its final magnitudes to: ``1 - mean(insertion, 1 - deletion)`` of the first map's
    pixel-level MAS curves (official ``MASMetric``: ``H`` steps of ``W`` pixels, insertion from the blur, deletion
    to the mean colour, each normalised as :func:`_normalised`), resampled to ``points`` steps.

    images: (x, blurred, mean) (B, 3, H, W); scores: their (B,) target probabilities; ranks: (B, H * W) the first
    map's pixel ranks (:func:`_mas_ranks`). Returns (B, points) float64.
    """
    x, blurred, mean = images
    p_x, p_blur, p_ref = scores
    width = x.shape[-1]
    counts = [k * width for k in range(1, x.shape[-2])]  # the last step, the whole image, is x or the mean
    insertion = perturbation_curve(classifier, blurred, x, ranks, counts, target, batch_size)
    deletion = perturbation_curve(classifier, x, mean, ranks, counts, target, batch_size)
    insertion = torch.cat([p_blur[:, None], insertion, p_x[:, None]], dim=1)
    deletion = torch.cat([p_x[:, None], deletion, p_ref[:, None]], dim=1)
    insertion = _resample(_normalised(insertion, p_x, p_blur, falling=False), points)
    deletion = _resample(_normalised(deletion, p_x, p_ref, falling=True), points)
    return 1 - (insertion + (1 - deletion)) / 2


def _search_orders(
    classifier: Classifier,
    x: torch.Tensor,
    blurred: torch.Tensor,
    mean: torch.Tensor,
    scores: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ascending: torch.Tensor,
    pixel_cell: torch.Tensor,
    window: int,
    cutoff: float,
    target: torch.Tensor,
    batch_size: int,
) -> torch.Tensor:
    """Steps 1 and 2: the (B, N) worst insertion order into the mean colour, whose last cells are the insertion
    phase's most important ones (the most important at the very end). ascending: (B, N) cells by rising prior."""
    p_x, p_blur, _ = scores
    batch, cells = ascending.shape
    rows = torch.arange(batch, device=x.device)
    full = torch.full((batch,), cells, dtype=torch.long, device=x.device)
    taken = torch.zeros(batch, cells, dtype=torch.bool, device=x.device)
    top, found = _greedy_insertion(
        classifier, blurred, x, pixel_cell, ascending.flip(1), taken, full, window, target, batch_size,
        maximise=True, stop=(p_blur, p_x, cutoff),
    )  # fmt: skip
    # Only the cells up to the cutoff are kept; the search continues from the mean colour without them.
    taken = torch.zeros_like(taken)
    valid = top >= 0
    taken[rows[:, None].expand_as(top)[valid], top[valid]] = True
    rest, _ = _greedy_insertion(
        classifier, mean, x, pixel_cell, ascending, taken, cells - found, window, target, batch_size, maximise=False
    )
    worst = torch.full_like(ascending, -1)
    worst[:, : rest.shape[1]] = rest
    slots = (cells - 1 - torch.arange(top.shape[1], device=x.device)).expand_as(top)
    worst[rows[:, None].expand_as(top)[valid], slots[valid]] = top[valid]
    return worst


def _mda_maps(
    classifier: Classifier,
    x: torch.Tensor,
    target: torch.Tensor,
    prior_map: torch.Tensor,
    grid: tuple[int, int],
    window: int,
    options: dict[str, Any],
) -> torch.Tensor:
    """MDA maps (B, H, W) float32 of images x (B, 3, H, W) from a prior map (B, H, W) on a (gh, gw) cell grid."""
    batch, _, height, width = x.shape
    cells = grid[0] * grid[1]
    batch_size = options["batch_size"]
    pixel_cell = _cell_of_pixel(height, width, grid, x.device)
    areas = torch.bincount(pixel_cell, minlength=cells).double()
    prior = F.interpolate(prior_map[:, None].float(), size=grid, mode="bilinear", align_corners=False, antialias=True)
    ascending = torch.argsort(prior.abs().flatten(1), dim=1, stable=True)
    mean = classifier.norm_mean.to(x.dtype).expand_as(x)
    p_x = target_probability(batched_logits(classifier, x, batch_size), target)
    p_ref = target_probability(batched_logits(classifier, mean, batch_size), target)
    blurred, _, p_blur = _search_blur(classifier, x, target, batch_size)
    scores = (p_x, p_blur, p_ref)
    worst = _search_orders(
        classifier, x, blurred, mean, scores, ascending, pixel_cell, window, options["cutoff"], target, batch_size
    )
    # The worst insertion curve (k cells into the mean colour, k = 1 .. N) read backwards is the best deletion
    # curve: [p_x, p_x, c_{N-1}, ..., c_1], as the official code builds it (it never reaches the mean image itself).
    position = torch.empty_like(worst).scatter_(1, worst, torch.arange(cells, device=x.device).expand_as(worst))
    ranks = position.gather(1, pixel_cell.expand(batch, -1))
    inner = perturbation_curve(classifier, mean, x, ranks, list(range(1, cells)), target, batch_size)
    deletion = torch.cat([p_x[:, None], p_x[:, None], inner.flip(1)], dim=1)
    order = worst.flip(1)  # the best deletion order
    first, _ = _cell_values(convex_fit(_normalised(deletion, p_x, p_ref, falling=True)), order, areas)
    ranks = _mas_ranks(first, order, pixel_cell)
    objective = _mas_objective(classifier, (x, blurred, mean), scores, ranks, target, cells + 1, batch_size)
    sparse, weight = _cell_values(convex_fit(objective), order, areas)
    dense = torch.where(sparse >= options["kappa"], weight, sparse)
    top_dense = dense.amax(1, keepdim=True)
    dense = torch.where(top_dense != 0, dense / top_dense, torch.zeros_like(dense)) * sparse.amax(1, keepdim=True)
    gamma = options["gamma"]
    maps = ((1 - gamma) * sparse + gamma * dense).float().gather(1, pixel_cell.expand(batch, -1))
    maps = maps.view(batch, 1, height, width)
    if options["smooth"]:  # the official MDA() output: torchvision Resize to the grid and back (antialiased)
        maps = F.interpolate(maps, size=grid, mode="bilinear", align_corners=False, antialias=True)
        maps = F.interpolate(maps, size=(height, width), mode="bilinear", align_corners=False, antialias=True)
    return maps[:, 0]


def _check_classifier(classifier: nn.Module) -> Classifier:
    if not isinstance(classifier, Classifier):
        raise ValueError(
            f"MDA needs a Classifier (its substrates are the normalisation mean and a blur around it), got "
            f"{type(classifier).__name__}"
        )
    return classifier


class MDA(Explainer):
    """Metric-driven attribution (Walker et al., ICLR 2025), the official defaults (see the module docstring).

    Options (per call or at construction):
        grid: cells per side; None: the ViT's token grid (14 for /16, 7 for /32 models at 224 px), else 7.
        prior: the registered method whose map orders the search's candidates (the paper uses Bi-Attn, which is
            not in this project: see docs/deviations.md); default ``"integrated-gradients"``.
        cutoff: the insertion phase stops once the normalised probability reaches it (the paper's tau), (0, 1].
        kappa: the dense map's threshold on a cell's sparse value.
        gamma: the mix of the dense map, in [0, 1] (0 = the sparse map).
        smooth: resample the map to the grid and back bilinearly, as the official ``MDA()`` returns it.
        window: candidates per greedy step; None: ``min(2 floor(sqrt(N)), 28)``.
        batch_size: images per classifier call (changes nothing but memory and speed).
    """

    name = "mda"
    options: ClassVar[dict[str, Any]] = {
        "grid": None,
        "prior": "integrated-gradients",
        "cutoff": 0.9,
        "kappa": 0.005,
        "gamma": 0.0,
        "smooth": True,
        "window": None,
        "batch_size": 64,
    }
    option_types: ClassVar[dict[str, Any]] = {"grid": int | None, "window": int | None}

    def __init__(self, classifier: nn.Module, **options: Any) -> None:
        _check_classifier(classifier)
        self._priors: dict[str, Explainer] = {}
        super().__init__(classifier, **options)

    def _bind(self) -> None:
        self._priors = {}

    def _check_options(self, options: dict[str, Any]) -> None:
        for key, low in (("grid", 2), ("window", 1)):
            if options[key] is not None:
                options[key] = check_int_at_least(options[key], key, low)
        options["batch_size"] = check_int_at_least(options["batch_size"], "batch_size", 1)
        if not 0.0 < options["cutoff"] <= 1.0:
            raise ValueError(f"cutoff must be in (0, 1], got {options['cutoff']!r}")
        if not 0.0 <= options["gamma"] <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {options['gamma']!r}")
        if not math.isfinite(options["kappa"]):
            raise ValueError(f"kappa must be finite, got {options['kappa']!r}")
        prior = options["prior"]
        if prior is None:
            raise ValueError("prior must name a registered method, got None")
        options["prior"] = resolve_explainer(prior) if ":" not in prior else prior
        if options["prior"] == self.name:
            raise ValueError("MDA's prior cannot be MDA itself")
        # Built now, so a prior that does not apply to this model (legrad on a CNN) is refused with the options,
        # when the method is built, not at its first map.
        self.prior_explainer(options["prior"])

    def prior_explainer(self, name: str) -> Explainer:
        """The prior method ``name`` for this classifier, built once."""
        if name not in self._priors:
            self._priors[name] = get_explainer(name, self.classifier)
        return self._priors[name]

    def _needs_grad(self, options: Any) -> bool:
        prior = self.prior_explainer(options["prior"])
        return prior._needs_grad(prior.defaults)

    def _attribute(self, x: torch.Tensor, target: torch.Tensor, **options: Any) -> torch.Tensor:
        height, width = x.shape[-2:]
        model = getattr(self.classifier, "model", self.classifier)
        grid = default_grid(model, height, width) if options["grid"] is None else (options["grid"],) * 2
        if grid[0] > height or grid[1] > width:
            raise ValueError(f"grid {options['grid']} has more cells per side than the {height} x {width} image")
        cells = grid[0] * grid[1]
        window = search_window(cells) if options["window"] is None else min(options["window"], cells)
        prior_map = self.prior_explainer(options["prior"]).attribute(x, target)
        with torch.no_grad():
            return _mda_maps(_check_classifier(self.classifier), x, target, prior_map, grid, window, options)
