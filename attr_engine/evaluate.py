"""Leaderboard: score attribution methods on the same images with the same metrics, the same randomness and the
same targets, and time them.

    board = evaluate(classifier, {"AHA": aha_explainer, "gradient": "gradient"}, (x, labels, masks))
    print(leaderboard_markdown(board)); write_leaderboard_csv(board, "board.csv")  # from attr_engine.report

Metrics (name: direction, what is computed with which settings):

| name | better | computation |
|---|---|---|
| deletion, insertion | lower, higher | AHA protocol: mean-colour reference, 21 fractions, predicted-class probability |
| pos, neg | lower, higher | positive / negative perturbation AUC, fractions 0 .. 0.9 |
| infidelity | lower | optimal-scaling infidelity (SP paper): H/4 and H/2 px patches, U(0, 1) baselines, 5 samples |
| infidelity_quantus | lower | Quantus 0.6.0 ``Infidelity`` defaults: 4 px patches, "black" baseline, 10 samples |
| max_sensitivity | lower | radius 0.02, 10 samples (the Semantic Pullback paper's settings) |
| random_logit | lower | Pearson correlation (as the Semantic Pullback paper reports), per-map max normalisation |
| random_logit_ssim | lower | Quantus' default SSIM of the flattened maps, per-map max normalisation |
| pointing_game, energy_pointing_game, mask_iou | higher | need object masks (mask_iou: IoU of the top-k% pixels) |

Infidelity patches of H/4 and H/2 are the SP paper's 56 and 112 px at 224 px; both infidelities compare logits.

Each method is scored the way its authors score it: pixel-ranking metrics (deletion, insertion, pos, neg, pointing
games) use the map its ``ranking_reduce`` declares (the Semantic Pullback: mean |value| over channels, see
:data:`~attr_engine.pullback.PULLBACK_RANKING_SOURCE`; every other method: its own map), and the infidelities
use the signed per-channel attribution of methods that declare ``infidelity_per_channel`` (gradient, gradient x
input, Integrated Gradients, the pullbacks, DeepLift, ``captum:...``), broadcasting the map otherwise. The
``ranked by`` column says which map was ranked. With ``extra_rankings=True``, methods that
declare some (the pullbacks: ``"input"``, i.e. ``sum_c pullback_c (x_c - mean colour_c)``, and the signed channel
mean) get extra rows with the deletion / insertion of those maps.

Every random metric draws from a generator seeded with ``seed`` for each method, so all methods see the same noise.
Metric settings can be overridden per metric: ``metrics={"infidelity": {"n_samples": 10}, "deletion": {}}``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from attr_engine.classifier import Classifier
from attr_engine.explainer import Explainer, FunctionExplainer, get_explainer, reduce_channels, resolve_baselines
from attr_engine.metrics import (
    deletion_insertion,
    energy_pointing_game,
    infidelity,
    max_sensitivity,
    perturbation_auc,
    pointing_game,
    random_logit,
    top_k_mask_iou,
)
from kernels.validate import check_int_at_least

__all__ = ["DEFAULT_METRICS", "METRICS", "Leaderboard", "MetricSpec", "evaluate"]


@dataclass
class _Context:
    """What a metric sees for one method: images, targets, the method's maps and the method itself."""

    classifier: Classifier
    x: torch.Tensor
    target: torch.Tensor
    maps: torch.Tensor
    masks: torch.Tensor | None
    explainer: Explainer
    seed: int
    batch_size: int
    channel_maps: torch.Tensor | None = None
    cache: dict[str, Any] = field(default_factory=dict)

    def generator(self) -> torch.Generator:
        return torch.Generator(device=self.x.device).manual_seed(self.seed)


@dataclass(frozen=True)
class MetricSpec:
    """A leaderboard metric: ``compute(context, **kwargs) -> (N,)`` per-image scores, and which way is better."""

    name: str
    direction: str
    compute: Callable[..., torch.Tensor]
    needs_masks: bool = False
    defaults: Mapping[str, Any] = field(default_factory=dict)


def _deletion_insertion(ctx: _Context, key: str, **kwargs: Any) -> torch.Tensor:
    if "di" not in ctx.cache:
        kwargs.setdefault("batch_size", 256)
        ctx.cache["di"] = deletion_insertion(ctx.classifier, ctx.x, ctx.maps, ctx.target, protocol="aha", **kwargs)
    return getattr(ctx.cache["di"], key)


def _pos_neg(ctx: _Context, key: str, **kwargs: Any) -> torch.Tensor:
    if "pn" not in ctx.cache:
        ctx.cache["pn"] = perturbation_auc(ctx.classifier, ctx.x, ctx.maps, ctx.target, **kwargs)
    return getattr(ctx.cache["pn"], key)


def _infidelity(ctx: _Context, **kwargs: Any) -> torch.Tensor:
    side = min(ctx.x.shape[-2:])
    kwargs.setdefault("patch_sizes", (max(1, side // 4), max(1, side // 2)))
    # The signed per-channel attribution where the method declares one (as the SP paper scores its pullbacks).
    maps = ctx.channel_maps if ctx.channel_maps is not None else ctx.maps
    return infidelity(ctx.classifier, ctx.x, maps, ctx.target, generator=ctx.generator(), **kwargs)


def _max_sensitivity(ctx: _Context, **kwargs: Any) -> torch.Tensor:
    kwargs.setdefault("batch_size", ctx.batch_size)
    return max_sensitivity(ctx.explainer, ctx.x, ctx.target, maps=ctx.maps, generator=ctx.generator(), **kwargs)


def _random_logit(ctx: _Context, **kwargs: Any) -> torch.Tensor:
    kwargs.setdefault("batch_size", ctx.batch_size)
    return random_logit(ctx.explainer, ctx.x, ctx.target, maps=ctx.maps, generator=ctx.generator(), **kwargs)


def _localisation(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    def compute(ctx: _Context, **kwargs: Any) -> torch.Tensor:
        assert ctx.masks is not None  # evaluate() refuses a needs_masks metric without masks
        return fn(ctx.maps, ctx.masks, **kwargs).float()

    return compute


METRICS: dict[str, MetricSpec] = {
    spec.name: spec
    for spec in (
        MetricSpec("deletion", "lower", lambda ctx, **kw: _deletion_insertion(ctx, "deletion", **kw)),
        MetricSpec("insertion", "higher", lambda ctx, **kw: _deletion_insertion(ctx, "insertion", **kw)),
        MetricSpec("pos", "lower", lambda ctx, **kw: _pos_neg(ctx, "positive", **kw)),
        MetricSpec("neg", "higher", lambda ctx, **kw: _pos_neg(ctx, "negative", **kw)),
        MetricSpec(
            "infidelity",
            "lower",
            _infidelity,
            defaults={"scaling": "optimal", "baseline": "uniform", "uniform_range": (0.0, 1.0), "n_samples": 5},
        ),
        MetricSpec("infidelity_quantus", "lower", _infidelity, defaults={"patch_sizes": (4,), "n_samples": 10}),
        MetricSpec("max_sensitivity", "lower", _max_sensitivity, defaults={"radius": 0.02, "n_samples": 10}),
        MetricSpec("random_logit", "lower", _random_logit, defaults={"similarity": "pearson"}),
        MetricSpec("random_logit_ssim", "lower", _random_logit, defaults={"similarity": "ssim"}),
        MetricSpec("pointing_game", "higher", _localisation(pointing_game), needs_masks=True),
        MetricSpec("energy_pointing_game", "higher", _localisation(energy_pointing_game), needs_masks=True),
        MetricSpec("mask_iou", "higher", _localisation(top_k_mask_iou), needs_masks=True),
    )
}
DEFAULT_METRICS: tuple[str, ...] = (
    "deletion",
    "insertion",
    "infidelity",
    "max_sensitivity",
    "random_logit",
    "pointing_game",
)
TIME_COLUMN = "ms/image"
RANKED_BY_COLUMN = "ranked by"
# Metrics whose score depends only on the order of the pixels under the map (they use the ranking map).
RANKING_METRICS = frozenset(
    {"deletion", "insertion", "pos", "neg", "pointing_game", "energy_pointing_game", "mask_iou"}
)
_RANKING_NAMES: dict[str | None, str] = {
    None: "map",
    "mean": "signed mean",
    "sum": "signed sum",
    "max": "max",
    "abs": "mean abs",  # no "|": it would split a Markdown table cell
    "abs-sum": "sum abs",
    "input": "x·(x−r)",
}


@dataclass
class Leaderboard:
    """Result of :func:`evaluate`.

    Attributes:
        rows: one dict per method: ``{"method": name, <metric>: mean score, ..., "ms/image": time}``.
        metrics: metric columns in order.
        directions: ``"lower"`` / ``"higher"`` (is better) per metric column, and for ``"ms/image"``.
        scores: per method, per metric, the (N,) per-image scores (CPU).
        curves: per method, ``{"fractions", "deletion", "insertion"}`` mean deletion / insertion curves (CPU),
            when deletion or insertion was computed.
        images: (k, 3, H, W) the first images (CPU), and ``maps``: per method their (k, H, W) maps, for figures.
        title: a caption for reports.
        notes: lines under the table saying how each method was scored (reductions and their sources).
    """

    rows: list[dict[str, float | str]]
    metrics: list[str]
    directions: dict[str, str]
    scores: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    curves: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    images: torch.Tensor | None = None
    maps: dict[str, torch.Tensor] = field(default_factory=dict)
    title: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def columns(self) -> list[str]:
        """Table columns: method, the map pixel-ranking metrics ranked, metrics, time."""
        return ["method", RANKED_BY_COLUMN, *self.metrics, TIME_COLUMN]

    def column(self, metric: str) -> dict[str, float]:
        """``{method: mean score}`` for one column (rows without it - the extra ranking rows - left out)."""
        if metric not in self.columns[2:]:
            raise ValueError(f"unknown column {metric!r}; columns: {', '.join(self.columns[2:])}")
        return {str(r["method"]): float(r[metric]) for r in self.rows if metric in r}

    def best(self, metric: str) -> str:
        """The method with the best mean score on ``metric`` (NaNs never win)."""
        values = {m: v for m, v in self.column(metric).items() if v == v}
        if not values:
            raise ValueError(f"no method has a finite score on {metric!r}")
        pick = min if self.directions[metric] == "lower" else max
        return pick(values, key=values.__getitem__)


def _load_data(data: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(x, labels, masks) from tensors, a dataset with ``.tensors()``, or a map-style dataset of tuples."""
    if isinstance(data, torch.Tensor):
        parts: Sequence[Any] = (data,)
    elif isinstance(data, tuple | list):
        parts = data
    elif hasattr(data, "tensors"):
        parts = data.tensors()
    elif hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        items = [data[i] for i in range(len(data))]
        if not items:
            raise ValueError("data is empty")
        first = items[0] if isinstance(items[0], tuple | list) else (items[0],)
        parts = [torch.stack([torch.as_tensor(item[k]) for item in items]) for k in range(len(first))]
    else:
        raise ValueError(f"data must be (x[, labels[, masks]]) tensors or a dataset, got {type(data).__name__}")
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"data must hold images, optional labels and optional masks, got {len(parts)} parts")
    x = parts[0]
    if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.shape[1] != 3 or len(x) == 0:
        raise ValueError(f"images must be a non-empty (N, 3, H, W) tensor, got {getattr(x, 'shape', x)!r}")
    labels = torch.as_tensor(parts[1]).long().to(device) if len(parts) > 1 and parts[1] is not None else None
    masks = parts[2].bool().to(device) if len(parts) > 2 and parts[2] is not None else None
    return x.to(device), labels, masks


def _resolve_methods(classifier: Classifier, methods: Mapping[str, Any] | Sequence[Any]) -> dict[str, Explainer]:
    items = methods.items() if isinstance(methods, Mapping) else [(None, m) for m in methods]
    resolved: dict[str, Explainer] = {}
    for name, method in items:
        if isinstance(method, str):
            explainer = get_explainer(method, classifier)
        elif isinstance(method, Explainer):
            explainer = method
        elif callable(method):
            label = name or str(getattr(method, "__name__", "function"))
            explainer = FunctionExplainer(classifier, method, name=label)
        else:
            raise ValueError(f"a method must be a registry name, an Explainer or a callable, got {method!r}")
        if explainer.classifier is not classifier:
            raise ValueError(f"method {name or explainer.name!r} explains a different classifier")
        label = name or explainer.name
        if label in resolved:
            raise ValueError(f"two methods are named {label!r}; pass a mapping with distinct names")
        resolved[label] = explainer
    if not resolved:
        raise ValueError("methods is empty")
    return resolved


def _resolve_metrics(metrics: Sequence[str] | Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    items = metrics.items() if isinstance(metrics, Mapping) else [(m, {}) for m in metrics]
    resolved = {}
    for name, overrides in items:
        if name not in METRICS:
            raise ValueError(f"unknown metric {name!r}; known: {', '.join(METRICS)}")
        resolved[name] = {**METRICS[name].defaults, **dict(overrides or {})}
    if not resolved:
        raise ValueError("metrics is empty")
    return resolved


def _timed_maps(
    explainer: Explainer, x: torch.Tensor, target: torch.Tensor, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """Maps (N, H, W) for all images in batches, the per-channel attributions (N, C, H, W) of per-channel methods
    (else None), and the wall time per image in milliseconds (device work included; the display reduction too).

    One untimed call on one image first, so lazy imports, kernel selection and caches are not billed to a method.
    """
    maps, channels, seconds = [], [], 0.0
    # The reduction of per-channel methods whose display map is timed with them (None: the method gives maps).
    display = explainer.display_reduce if explainer.per_channel and explainer.display_reduce != "input" else None
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    explainer.attribute(x[:1], target[:1])
    for lo in range(0, len(x), batch_size):
        sync()
        start = time.perf_counter()
        chunk = x[lo : lo + batch_size]
        if display is not None:
            full = explainer.attribute(chunk, target[lo : lo + batch_size], reduce=None)
            out = reduce_channels(full, display)
            channels.append(full)
        else:
            out = explainer.attribute(chunk, target[lo : lo + batch_size])
        sync()
        seconds += time.perf_counter() - start
        maps.append(out)
    return torch.cat(maps), torch.cat(channels) if channels else None, 1e3 * seconds / len(x)


def evaluate(
    classifier: Classifier,
    methods: Mapping[str, Explainer | str | Callable[..., torch.Tensor]] | Sequence[Explainer | str],
    data: Any,
    metrics: Sequence[str] | Mapping[str, Mapping[str, Any]] = DEFAULT_METRICS,
    *,
    target: str = "pred",
    batch_size: int = 16,
    seed: int = 0,
    keep: int = 4,
    title: str = "",
    log: Callable[[str], None] | None = None,
    extra_rankings: bool = False,
) -> Leaderboard:
    """Score every method on every metric over the same images.

    Args:
        classifier: the frozen classifier; the images are moved to its device.
        methods: ``{display name: method}`` or a sequence of methods, each a registry name (see
            :func:`~attr_engine.explainer.list_explainers`), an :class:`~attr_engine.explainer.Explainer`, or a
            callable ``fn(x, target) -> maps`` (mapping form only, to name it).
        data: ``(x, labels, masks)`` / ``(x, labels)`` / ``x`` tensors, a dataset with ``.tensors()`` (e.g.
            :class:`~attr_engine.data.ShapesDataset`), or a map-style dataset of such tuples.
        metrics: metric names (see :data:`METRICS`) or ``{name: overrides of its settings}``.
        target: explain and score the ``"pred"`` icted class (the AHA protocol) or the ``"label"``.
        batch_size: images per explainer call (timing and the explainer-based metrics use it).
        seed: seeds every random metric, identically for every method.
        keep: how many images (and their maps) to keep for figures.
        title: caption stored on the result.
        log: called with a progress line per method.
        extra_rankings: add a row per extra reduction a method declares (the pullbacks: ``x·(x−r)`` and the signed
            mean) with its deletion / insertion, after the method's row.

    Returns:
        :class:`Leaderboard`.

    Raises:
        ValueError: unknown metric or method names, localisation metrics without masks, ``target="label"``
            without labels, bad data.
    """
    if not isinstance(classifier, Classifier):
        raise ValueError(f"classifier must be an attr_engine Classifier, got {type(classifier).__name__}")
    if target not in ("pred", "label"):
        raise ValueError(f"target must be 'pred' or 'label', got {target!r}")
    check_int_at_least(batch_size, "batch_size", 1)
    device = classifier.norm_mean.device
    x, labels, masks = _load_data(data, device)
    explainers = _resolve_methods(classifier, methods)
    settings = _resolve_metrics(metrics)
    if masks is None and any(METRICS[m].needs_masks for m in settings):
        raise ValueError("pointing-game metrics need object masks: pass data as (x, labels, masks)")
    if target == "label":
        if labels is None:
            raise ValueError("target='label' needs labels in data")
        targets = labels
    else:
        with torch.no_grad():
            targets = torch.cat([classifier(c).argmax(dim=1) for c in x.split(256)])

    rows: list[dict[str, float | str]] = []
    board = Leaderboard(rows=rows, metrics=list(settings), directions={}, title=title)
    board.directions = {name: METRICS[name].direction for name in settings} | {TIME_COLUMN: "lower"}
    board.images = x[:keep].cpu()
    for label, explainer in explainers.items():
        start = time.perf_counter()
        maps, channels, ms = _timed_maps(explainer, x, targets, batch_size)
        ranking, ranked_by = maps, None
        if channels is not None and explainer.ranking_reduce is not None:
            ranking, ranked_by = reduce_channels(channels, explainer.ranking_reduce), explainer.ranking_reduce
        per_channel = channels if getattr(explainer, "infidelity_per_channel", False) else None
        ctx = _Context(classifier, x, targets, maps, masks, explainer, seed, batch_size, channel_maps=per_channel)
        ranked = _Context(classifier, x, targets, ranking, masks, explainer, seed, batch_size, cache=ctx.cache)
        row: dict[str, float | str] = {"method": label, RANKED_BY_COLUMN: _RANKING_NAMES.get(ranked_by, str(ranked_by))}
        board.scores[label] = {}
        ctx.cache.clear()
        for name, kwargs in settings.items():
            use = ranked if name in RANKING_METRICS else ctx
            per_image = METRICS[name].compute(use, **kwargs).detach().float().cpu()
            board.scores[label][name] = per_image
            finite = per_image[torch.isfinite(per_image)]
            row[name] = float(finite.mean()) if len(finite) else float("nan")
        row[TIME_COLUMN] = ms
        rows.append(row)
        if "di" in ctx.cache:
            di = ctx.cache["di"]
            board.curves[label] = {
                "fractions": di.fractions.cpu(),
                "deletion": di.deletion_curve.mean(dim=0).cpu(),
                "insertion": di.insertion_curve.mean(dim=0).cpu(),
            }
        board.maps[label] = maps[:keep].cpu()
        if log is not None:
            scores = ", ".join(f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float))
            log(f"{label}: {scores} ({time.perf_counter() - start:.1f} s)")
        if ranked_by is not None:
            board.notes.append(
                f"{label}: pixel-ranking metrics rank {_RANKING_NAMES.get(ranked_by, ranked_by)} over channels "
                f"({explainer.ranking_source or 'declared by the method'})."
            )
        if per_channel is not None and any(m.startswith("infidelity") for m in settings):
            board.notes.append(f"{label}: infidelity scores the signed per-channel attribution.")
        # Other readings of the same attribution, for deletion / insertion only (no time: the maps are reused).
        extra = [m for m in ("deletion", "insertion") if m in settings]
        wanted = extra_rankings and channels is not None and extra
        for reduction in getattr(explainer, "extra_rankings", ()) if wanted else ():
            reference = resolve_baselines("mean", x, classifier) if reduction == "input" else None
            assert channels is not None  # wanted implies it
            alt = reduce_channels(channels, reduction, x, reference)
            alt_ctx = _Context(classifier, x, targets, alt, masks, explainer, seed, batch_size)
            name = _RANKING_NAMES.get(reduction, reduction)
            alt_row: dict[str, float | str] = {"method": f"{label} [{name}]", RANKED_BY_COLUMN: name}
            for metric in extra:
                per_image = METRICS[metric].compute(alt_ctx, **settings[metric]).detach().float().cpu()
                alt_row[metric] = float(per_image[torch.isfinite(per_image)].mean())
            rows.append(alt_row)
    return board
