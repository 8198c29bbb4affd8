"""What a method's options ask of the machine per image, known before it runs: classifier passes and batch size.

A sampling or path method's cost grows with one option (Integrated Gradients' ``n_steps``, SmoothGrad's and
Captum's ``n_samples``, RISE's ``n_masks``, occlusion's windows, MDA's grid) and its memory with another (the
images handed to the classifier in one call: ``internal_batch_size``, ``batch_size``, ...). A value a few orders of
magnitude too large runs for hours or asks for petabytes before failing; :func:`method_cost` lets a caller refuse it
first (``attr-engine explain --max-cost``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["COUNT_OPTIONS", "MethodCost", "method_cost"]

# Options whose value is a number of classifier passes per image (Captum's names and this package's).
COUNT_OPTIONS = ("n_steps", "n_samples", "nt_samples", "n_masks", "num_samples", "n_perturb_samples")
# Options whose value is a number of images handed to the classifier in one call.
BATCH_OPTIONS = ("internal_batch_size", "batch_size", "nt_samples_batch_size", "perturbations_per_eval")


@dataclass(frozen=True)
class MethodCost:
    """The cost of one image.

    Attributes:
        passes: classifier passes (a forward, or a forward and a backward) per image, estimated from the options.
        passes_from: the option (``name=value``) the passes follow, or ``""`` for a method of fixed cost.
        batch: images per classifier call (0: one call per batch of inputs, the method's fixed working set).
        batch_from: the option (``name=value``) the batch follows, or ``""``.
    """

    passes: int
    passes_from: str = ""
    batch: int = 0
    batch_from: str = ""


def _options(explainer: Any) -> dict[str, Any]:
    """The explainer's merged options, and for methods that keep them as attributes (RISE) those too."""
    options = dict(getattr(explainer, "defaults", {}) or {})
    for key in (*COUNT_OPTIONS, *BATCH_OPTIONS):
        value = getattr(explainer, key, None)
        if key not in options and isinstance(value, int) and not isinstance(value, bool):
            options[key] = value
    return options


def _largest(options: dict[str, Any], keys: tuple[str, ...]) -> tuple[int, str]:
    found = [(int(v), f"{k}={v}") for k, v in options.items() if k in keys and isinstance(v, int | float) and v > 0]
    return max(found) if found else (0, "")


def _windows(window: Any, stride: Any, height: int, width: int) -> int:
    """Positions of a (C, h, w) window sliding over (height, width) with a (C, sh, sw) stride (or one side)."""
    wh, ww = (window[-2], window[-1]) if isinstance(window, tuple | list) else (window, window)
    sh, sw = (stride[-2], stride[-1]) if isinstance(stride, tuple | list) else (stride, stride)
    rows = max(0, (height - int(wh)) // max(1, int(sh))) + 1
    cols = max(0, (width - int(ww)) // max(1, int(sw))) + 1
    return rows * cols


def _mda_passes(explainer: Any, options: dict[str, Any], height: int, width: int) -> tuple[int, str]:
    """About two greedy searches (deletion, insertion) of ``window`` candidates per cell, plus the prior's map."""
    from attr_engine.baselines.mda import default_grid, search_window

    model = getattr(explainer.classifier, "model", explainer.classifier)
    grid = options.get("grid")
    rows, cols = default_grid(model, height, width) if grid is None else (grid, grid)
    cells = rows * cols
    window = min(options.get("window") or search_window(cells), cells)
    prior = method_cost(explainer.prior_explainer(options["prior"]), height, width).passes
    return 2 * cells * window + prior, f"grid={rows}"


def method_cost(explainer: Any, height: int, width: int) -> MethodCost:
    """Classifier passes per image and images per call of ``explainer`` on (height, width) images.

    The estimate follows the options that set the cost (:data:`COUNT_OPTIONS`; occlusion's windows; MDA's grid);
    a method without such options counts one pass.
    """
    options = _options(explainer)
    passes, passes_from = _largest(options, COUNT_OPTIONS)
    batch, batch_from = _largest(options, BATCH_OPTIONS)
    name = getattr(explainer, "name", "")
    if name == "occlusion":  # this package's defaults: a window of 1/8 of the side, half a window's stride
        side = max(2, height // 8)
        window = options.get("sliding_window_shapes") or (3, side, side)
        stride = options.get("strides") or (3, max(1, window[1] // 2), max(1, window[2] // 2))
        passes, passes_from = _windows(window, stride, height, width), "sliding_window_shapes, strides"
    elif name == "captum:Occlusion" and isinstance(options.get("sliding_window_shapes"), tuple | list | int):
        stride = options.get("strides") or 1  # Captum's default stride
        passes = _windows(options["sliding_window_shapes"], stride, height, width)
        passes_from = "sliding_window_shapes, strides"
    elif name == "mda":
        passes, passes_from = _mda_passes(explainer, options, height, width)
    return MethodCost(max(passes, 1), passes_from, batch, batch_from)
