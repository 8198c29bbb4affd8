"""Leaderboard: score attribution methods on the same images with the same metrics, the same randomness and the
same targets, and time them.

    board = evaluate(classifier, {"AHA": aha_explainer, "gradient": "gradient"}, (x, labels, masks))
    print(board.to_markdown()); board.to_csv("board.csv")  # figures: attr_engine.report.write_report(board, dir)

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

Each method is scored the way its authors score it: pixel-ranking metrics (deletion, insertion, pos, neg, pointing
games) use the map its ``ranking_reduce`` declares (the Semantic Pullback: mean |value| over channels, see
:data:`~attr_engine.pullback.PULLBACK_RANKING_SOURCE`; every other method: its own map), and the infidelities
use the signed per-channel attribution of methods that declare ``infidelity_per_channel`` (gradient, gradient x
input, Integrated Gradients, the pullbacks, DeepLift, ``captum:...``), broadcasting the map otherwise. The
``ranked by`` column says which map was ranked; ``extra_rankings=True`` adds rows for the extra rankings methods
declare (the pullbacks: ``"input"``, ``sum_c pullback_c (x_c - mean colour_c)``, and the signed channel mean).

Every random metric draws from a generator seeded with ``seed`` for each method, so all methods see the same noise.
Metric settings can be overridden per metric: ``metrics={"infidelity": {"n_samples": 10}, "deletion": {}}``.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attr_engine.atomic import atomic_write
from attr_engine.classifier import Classifier
from attr_engine.explainer import Explainer, FunctionExplainer, get_explainer, reduce_channels, resolve_baselines
from attr_engine.guards import not_a_classifier_hint
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
from attr_engine.tables import csv_text, markdown_table
from attr_engine_kernels.validate import check_int_at_least

__all__ = ["DEFAULT_METRICS", "METRICS", "ChanceLevelWarning", "Leaderboard", "MetricSpec", "chance_level", "evaluate"]


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
    # Classifier passes per image, estimated from (height, width, the method's passes per map, settings): the
    # cost warning of evaluate(). None: a few passes, never slow.
    passes: Callable[..., int] | None = None


def _infidelity_passes(height: int, width: int, method_passes: int, **kwargs: Any) -> int:
    """One pass per patch (the replacements are cumulative) per patch size, per sample of a random baseline."""
    side = min(height, width)
    sizes = kwargs.get("patch_sizes") or (max(1, side // 4), max(1, side // 2))
    patches = sum(math.ceil(height / p) * math.ceil(width / p) for p in sizes)
    return patches * (int(kwargs.get("n_samples", 10)) if kwargs.get("baseline", "black") == "uniform" else 1)


def _explainer_passes(height: int, width: int, method_passes: int, **kwargs: Any) -> int:
    """A map of the method per noisy sample (max-sensitivity) or per other class (random logit)."""
    return method_passes * int(kwargs.get("n_samples", 1))


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
            passes=_infidelity_passes,
        ),
        MetricSpec(
            "infidelity_quantus",
            "lower",
            _infidelity,
            defaults={"patch_sizes": (4,), "n_samples": 10},
            passes=_infidelity_passes,
        ),
        MetricSpec(
            "max_sensitivity",
            "lower",
            _max_sensitivity,
            defaults={"radius": 0.02, "n_samples": 10},
            passes=_explainer_passes,
        ),
        MetricSpec(
            "random_logit", "lower", _random_logit, defaults={"similarity": "pearson"}, passes=_explainer_passes
        ),
        MetricSpec(
            "random_logit_ssim", "lower", _random_logit, defaults={"similarity": "ssim"}, passes=_explainer_passes
        ),
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
# A metric that makes more classifier passes than this for one method over all the images is announced before it
# runs (evaluate()'s cost warning): on a CPU at 224 px that is minutes.
SLOW_METRIC_PASSES = 5_000
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

# The same reductions in words, for the notes under a table.
_RANKING_WORDS: dict[str | None, str] = {
    "mean": "the mean of its colour channels",
    "sum": "the sum of its colour channels",
    "max": "the largest of its colour channels",
    "abs": "the mean absolute value of its colour channels",
    "abs-sum": "the summed absolute value of its colour channels",
    "norm": "the length of its colour-channel vector",
    "input": "its colour channels times the image's distance from the mean colour",
}


class ChanceLevelWarning(UserWarning):
    """The classifier's accuracy on labelled images, or its confidence, is at chance: maps of such a classifier
    explain an untrained or mismatched model, and a leaderboard over them ranks noise."""


def chance_level(logits: torch.Tensor, labels: torch.Tensor | None = None) -> str | None:
    """A sentence saying the classifier is at chance on these images, or None when it is not.

    With labels: the accuracy lies within two binomial standard errors of chance, ``1/K + 2 sqrt(p (1 - p) / N)``
    with ``p = 1/K`` (so a handful of images never passes for chance by luck, and 60 % on 5 classes never warns).
    Without: the mean top-1 probability is under ``1.5 / K``, predictions close to uniform (an untrained head).

    Args:
        logits: (N, K) the classifier's logits on the images.
        labels: (N,) their classes, or None; entries below 0 (unlabelled) are left out.
    """
    n, k = logits.shape
    if n == 0 or k < 2:
        return None
    chance = 1.0 / k
    if labels is not None and bool((labels >= 0).any()):
        known = labels >= 0
        count = int(known.sum())
        accuracy = float((logits.argmax(dim=1)[known] == labels[known]).float().mean())
        if accuracy <= chance + 2 * (chance * (1 - chance) / count) ** 0.5:
            return (
                f"the classifier's accuracy on these {count} labelled images is {accuracy:.1%}, chance is {chance:.1%}"
                f" ({k} classes): its maps explain an untrained or mismatched model"
            )
        return None
    confidence = float(logits.float().softmax(dim=1).amax(dim=1).mean())
    if confidence < 1.5 * chance:
        return (
            f"the classifier's mean confidence on these {n} images is {confidence:.1%}, chance is {chance:.1%} "
            f"({k} classes): its maps explain an untrained or mismatched model"
        )
    return None


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

    def to_markdown(self, digits: int = 3) -> str:
        """The table in Markdown (best value of each column in bold, directions in the header), the title above
        and the notes below."""
        table = markdown_table(self.rows, self.columns, directions=self.directions, digits=digits, title=self.title)
        return table + "".join(f"\n{note}\n" for note in self.notes)

    def to_csv(self, path: str | os.PathLike[str] | None = None) -> str:
        """The rows as CSV text (a header, then one line per row, floats at full precision); written atomically to
        ``path`` (parents created) when one is given."""
        text = csv_text(self.rows, self.columns)
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

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


def _without_mask_metrics(settings: dict[str, dict[str, Any]], has_masks: bool, *, default: bool) -> dict[str, Any]:
    """``settings`` without the metrics that need object masks when the data has none: dropped with one warning
    from the default set (as ``attr-engine evaluate`` drops them on an image folder), refused when asked for."""
    needing = [m for m in settings if METRICS[m].needs_masks]
    if has_masks or not needing:
        return settings
    if not default:
        raise ValueError(f"{', '.join(needing)} need object masks: pass data as (x, labels, masks)")
    warnings.warn(
        f"the data has no object masks: {', '.join(needing)} left out of the default metrics",
        UserWarning,
        stacklevel=3,
    )
    kept = {m: v for m, v in settings.items() if m not in needing}
    if not kept:
        raise ValueError("every metric needs object masks, and the data has none")
    return kept


def warn_slow_metrics(
    explainers: Mapping[str, Explainer],
    settings: Mapping[str, Mapping[str, Any]],
    size: tuple[int, int],
    images: int,
) -> None:
    """One warning per (method, metric) whose classifier passes over ``images`` images of ``size`` (H, W) exceed
    :data:`SLOW_METRIC_PASSES`, naming the estimate and the settings that set it, before any of them runs."""
    from attr_engine.baselines.cost import method_cost

    for name, kwargs in settings.items():
        estimate = METRICS[name].passes
        if estimate is None:
            continue
        for label, explainer in explainers.items():
            per_image = estimate(*size, method_cost(explainer, *size).passes, **kwargs)
            if per_image * images > SLOW_METRIC_PASSES:
                warnings.warn(
                    f"{name} on {label}: about {per_image:,} classifier passes per image, {per_image * images:,} for "
                    f"{images} image(s) at {size[0]} x {size[1]} px; this may take long (fewer images, a smaller "
                    f"--img-size or a lighter metric are faster)",
                    stacklevel=3,
                )


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


def _check_classifier(classifier: Any) -> None:
    """A loaded :class:`Classifier`, or a one-line error that names what to call first (a name or a path given)."""
    if not isinstance(classifier, Classifier):
        raise ValueError(
            f"classifier must be an attr_engine Classifier, got {type(classifier).__name__}"
            f"{not_a_classifier_hint(classifier)}"
        )


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
    step: Callable[[str], None] | None = None,
) -> Leaderboard:
    """Score every method on every metric over the same images.

    Args:
        classifier: the frozen classifier; the images are moved to its device.
        methods: ``{display name: method}`` or a sequence of methods, each a registry name (see
            :func:`~attr_engine.explainer.list_explainers`), an :class:`~attr_engine.explainer.Explainer`, or a
            callable ``fn(x, target) -> maps`` (mapping form only, to name it).
        data: ``(x, labels, masks)`` / ``(x, labels)`` / ``x`` tensors, a dataset with ``.tensors()`` (e.g.
            :class:`~attr_engine.data.ShapesDataset`), or a map-style dataset of such tuples.
        metrics: metric names (see :data:`METRICS`) or ``{name: overrides of its settings}``. The default,
            :data:`DEFAULT_METRICS`, leaves the pointing game out (one warning) when the data has no masks.
        target: explain and score the ``"pred"`` icted class (the AHA protocol) or the ``"label"``.
        batch_size: images per explainer call (timing and the explainer-based metrics use it).
        seed: seeds every random metric, identically for every method.
        keep: how many images (and their maps) to keep for figures.
        title: caption stored on the result.
        log: called with a progress line per method.
        step: called with ``"method: maps"`` / ``"method: metric"`` before each step (a progress bar's ticks: there
            are ``len(methods) * (1 + len(metrics))``).
        extra_rankings: add a row per extra reduction a method declares (the pullbacks: ``x·(x−r)`` and the signed
            mean) with its deletion / insertion, after the method's row.

    Returns:
        :class:`Leaderboard`.

    Raises:
        ValueError: unknown metric or method names, localisation metrics asked for without masks, ``target="label"``
            without labels, bad data.
    """
    _check_classifier(classifier)
    if target not in ("pred", "label"):
        raise ValueError(f"target must be 'pred' or 'label', got {target!r}")
    check_int_at_least(batch_size, "batch_size", 1)
    device = classifier.norm_mean.device
    x, labels, masks = _load_data(data, device)
    explainers = _resolve_methods(classifier, methods)
    settings = _resolve_metrics(metrics)
    settings = _without_mask_metrics(settings, masks is not None, default=metrics is DEFAULT_METRICS)
    if target == "label" and labels is None:
        raise ValueError("target='label' needs labels in data")
    with torch.no_grad():
        logits = torch.cat([classifier(c) for c in x.split(256)])
    targets = labels if target == "label" and labels is not None else logits.argmax(dim=1)
    at_chance = chance_level(logits, labels)
    if at_chance is not None:
        warnings.warn(at_chance, ChanceLevelWarning, stacklevel=2)
    warn_slow_metrics(explainers, settings, (x.shape[-2], x.shape[-1]), len(x))
    tick = step or (lambda name: None)
    rows: list[dict[str, float | str]] = []
    board = Leaderboard(rows=rows, metrics=list(settings), directions={}, title=title)
    board.directions = {name: METRICS[name].direction for name in settings} | {TIME_COLUMN: "lower"}
    board.images = x[:keep].cpu()
    board.notes += [at_chance[0].upper() + at_chance[1:] + "."] if at_chance is not None else []
    for label, explainer in explainers.items():
        start = time.perf_counter()
        tick(f"{label}: maps")
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
            tick(f"{label}: {name}")
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
                f"{label}: deletion, insertion and the pointing games rank the pixels by "
                f"{_RANKING_WORDS.get(ranked_by, ranked_by)} (the ranking it is scored by), not by the map shown."
            )
        if per_channel is not None and any(m.startswith("infidelity") for m in settings):
            board.notes.append(f"{label}: infidelity uses the signed attribution of each colour channel, not the map.")
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
