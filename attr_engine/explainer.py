"""The one protocol every attribution method follows, and the registry of methods by name.

Every method - AHA, the Semantic Pullback, each baseline and any plugin - is an :class:`Explainer` called the way
Captum's methods are: ``explainer.attribute(inputs, target=None, baselines=None, **options) -> (B, H, W)``, with
``target`` and ``baselines`` also taken in Captum's IntegratedGradients order (:func:`captum_order`) and
``reduce=None`` giving Captum's input-shaped (B, C, H, W) result for the per-channel methods. The base
class does the work every method shares, once: it checks the images, merges and checks the options, resolves the
targets (:func:`~attr_engine.classifier.resolve_targets`, the one resolver of the package), puts the model in eval
mode, sets the grad mode and then calls the method's core, ``_attribute``.

The registry sits beside it: :func:`get_explainer` builds a method by name, :func:`list_explainers` lists the names
and :func:`register_explainer` adds one. The built-in methods register themselves when their package is imported
(``attr_engine.baselines``, ``attr_engine.aha``, ``attr_engine.pullback``); the registry imports those packages the
first time it is asked, so this module imports none of them and nothing imports in a circle. Third-party methods
come in through the entry-point group ``attr_engine.explainers`` (:data:`ENTRY_POINT_GROUP`), read lazily: an
entry point is loaded only when its name is asked for (or when a classifier filters the list).
"""

from __future__ import annotations

import collections.abc
import contextlib
import contextvars
import copy
import difflib
import importlib
import inspect
import math
import types
import typing
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any, ClassVar, Literal, overload

import torch
from torch import nn

from attr_engine.classifier import Classifier, check_device, eval_mode, input_dtype, resolve_targets
from attr_engine.guards import not_a_classifier_hint
from attr_engine.imageops import REFERENCES, resolve_reference
from attr_engine.pixels import NONFINITE_MAP  # an image's error when its map is not finite
from attr_engine_kernels.validate import check_tensor

__all__ = [
    "ENTRY_POINT_GROUP",
    "NONFINITE_MAP",
    "PERTURBATION_ALLOWANCE",
    "REDUCTIONS",
    "Explainer",
    "ExplainerSpec",
    "FunctionExplainer",
    "ImageRangeWarning",
    "UnknownExplainerError",
    "captum_order",
    "coerce_option",
    "explain_batch",
    "explain_batch_with_probability",
    "finite_maps",
    "get_explainer",
    "image_range_check",
    "list_explainers",
    "list_methods",
    "option_type",
    "reduce_channels",
    "register_explainer",
    "register_explainer_family",
    "resolve_baselines",
    "resolve_explainer",
    "resolve_targets",
]

# Channel reductions of a per-channel (B, C, H, W) attribution to one value per pixel (B, H, W).
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "max", "abs", "abs-sum", "norm", "input")
REDUCE_UNSET: Any = object()  # "no reduce argument given": the method's own display reduction


def reduce_channels(
    attr: torch.Tensor, reduce: str, x: torch.Tensor | None = None, reference: Any = None
) -> torch.Tensor:
    """One value per pixel from a per-channel attribution.

    Args:
        attr: (B, C, H, W) attribution.
        reduce: ``"mean"`` / ``"sum"`` over channels, ``"max"`` (max over channels), ``"abs"`` (mean of absolute
            values), ``"abs-sum"`` (sum of absolute values), ``"norm"`` (L2 norm over channels), or ``"input"``:
            ``sum_c attr_c * (x_c - reference_c)`` (a first-order estimate of what moving the pixel to the
            reference changes).
        x, reference: (B, C, H, W) images and a reference (tensor broadcastable to ``x`` or a number), for
            ``"input"`` only.

    Returns:
        (B, H, W) in ``attr``'s dtype.
    """
    if reduce == "mean":
        return attr.mean(dim=1)
    if reduce == "sum":
        return attr.sum(dim=1)
    if reduce == "max":
        return attr.amax(dim=1)
    if reduce == "abs":
        return attr.abs().mean(dim=1)
    if reduce == "abs-sum":
        return attr.abs().sum(dim=1)
    if reduce == "norm":
        return attr.norm(dim=1)
    if reduce == "input":
        if x is None or reference is None:
            raise ValueError("reduce='input' needs the images and a reference (baselines)")
        return (attr * (x.to(attr.dtype) - reference)).sum(dim=1)
    raise ValueError(f"reduce must be one of {REDUCTIONS} or None, got {reduce!r}")


def resolve_baselines(baselines: Any, x: torch.Tensor, classifier: nn.Module) -> torch.Tensor | float | None:
    """A reference for ``x`` (B, 3, H, W): None, a number, ``"black"`` (0), ``"mean"`` (the classifier's mean
    colour), ``"blur"`` (the strong blur AHA uses, kernel 37 / sigma 37 scaled from 224 px) or a tensor of shape
    (3, H, W), (1, 3, H, W) or (B, 3, H, W). Tensors come back on ``x``'s device and dtype, expanded to its shape.
    """
    if baselines is None:
        return None
    if isinstance(baselines, bool):
        raise ValueError("baselines must be a number, a name or a tensor, got a bool")
    if isinstance(baselines, int | float):
        value = float(baselines)
        if not math.isfinite(value):
            raise ValueError(f"baselines must be finite, got {value}")
        return value
    if isinstance(baselines, str) and baselines == "black":
        return 0.0  # a number broadcasts: no (B, C, H, W) zeros
    if isinstance(baselines, str) and baselines in REFERENCES:
        mean = getattr(classifier, "norm_mean", None)
        if baselines == "mean" and mean is None:
            raise ValueError("baselines='mean' needs a Classifier (it reads the normalisation mean)")
        return resolve_reference(baselines, x, mean, name="baselines").expand_as(x)
    if isinstance(baselines, torch.Tensor | str):  # the package's one reference resolver, and its errors
        return resolve_reference(baselines, x, None, name="baselines")
    raise ValueError(f"baselines must be a number, a name or a tensor, got {type(baselines).__name__}")


# ---------------------------------------------------------------------------------------------------------------
# Option types: values from a command line or a config file (YAML scalars and lists) made into what a method takes
# ---------------------------------------------------------------------------------------------------------------

_UNCHECKED: Any = object()  # "no type known": the value goes to the method's own checks unchanged


def option_type(default: Any) -> Any:
    """The type an option with this default takes, for :func:`coerce_option`.

    A bool default takes exactly a bool (``"maybe"`` or ``1`` for a switch is a mistake, not ``True``); an int,
    float, str or tuple default takes that type or None (None is how many options say "choose for me", and the
    method's own check refuses it where it means nothing). A None default (or any other) carries no type.
    """
    if isinstance(default, bool):
        return bool
    for kind in (int, float, str, tuple):
        if isinstance(default, kind):
            return kind | None
    return _UNCHECKED


def _describe(spec: Any) -> str:
    """``spec`` in words for an error message ("true or false", "an integer", "a list of integers or null")."""
    if spec is type(None) or spec is None:
        return "null"
    if spec is bool:
        return "true or false"
    words = {int: "an integer", float: "a number", str: "a string", tuple: "a list", list: "a list", dict: "a mapping"}
    if spec in words:
        return words[spec]
    origin = typing.get_origin(spec)
    if origin is typing.Union or origin is types.UnionType:
        parts = [_describe(arg) for arg in typing.get_args(spec) if arg is not type(None)]
        none = type(None) in typing.get_args(spec)
        return " or ".join(dict.fromkeys([*parts, *(["null"] if none else [])]))
    if origin in (tuple, list):
        args = typing.get_args(spec)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_plural(args[0])}"
        return f"a list of {len(args)} {_plural(args[0])}" if len(set(args)) == 1 else "a list"
    if origin in (dict, collections.abc.Mapping):
        return "a mapping"
    if origin is collections.abc.Callable or spec is collections.abc.Callable:
        return "a function"
    return f"a {getattr(spec, '__name__', str(spec))}"


def _plural(spec: Any) -> str:
    """The items of a list of ``spec`` in words ("integers", "lists")."""
    words = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}
    if spec in words:
        return words[spec]
    origin = typing.get_origin(spec)
    if origin is typing.Union or origin is types.UnionType:
        return " or ".join(dict.fromkeys(_plural(arg) for arg in typing.get_args(spec)))
    if spec in (tuple, list) or origin in (tuple, list):
        return "lists"
    return "values"


def _convert(value: Any, spec: Any) -> tuple[bool, Any]:
    """``(True, value as spec)`` if ``value`` fits ``spec`` (a type or a typing annotation), else ``(False, value)``.

    Lists become tuples where a tuple is expected (YAML and JSON have no tuples), ints become floats where a float
    is; bools never pass for numbers. Annotations this does not understand (type variables, forward references,
    protocols) accept everything: the method's own checks then decide.
    """
    if spec is _UNCHECKED or spec is Any or spec is inspect.Parameter.empty or isinstance(spec, str | typing.TypeVar):
        return True, value
    if spec is None or spec is type(None):
        return value is None, value
    if spec is bool:
        return isinstance(value, bool), value
    if spec is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if spec is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if spec is str:
        return isinstance(value, str), value
    origin = typing.get_origin(spec)
    if origin is typing.Union or origin is types.UnionType:
        fits = [_convert(value, arg) for arg in typing.get_args(spec)]
        # A member the value fits unchanged wins (Union[int, float] keeps 3 an int), else the first that converts.
        for ok, converted in fits:
            if ok and type(converted) is type(value):
                return True, converted
        return next(((True, c) for ok, c in fits if ok), (False, value))
    if spec in (tuple, list) or origin in (tuple, list):
        if not isinstance(value, list | tuple):
            return False, value
        args = typing.get_args(spec)
        if len(args) == 2 and args[1] is Ellipsis:
            args = (args[0],) * len(value)
        elif not args:
            args = (_UNCHECKED,) * len(value)
        elif len(args) != len(value):
            return False, value
        items = [_convert(v, a) for v, a in zip(value, args, strict=True)]
        if not all(ok for ok, _ in items):
            return False, value
        kind = origin or spec
        return True, kind(c for _, c in items)
    if spec is dict or origin in (dict, collections.abc.Mapping):
        return isinstance(value, Mapping), value
    if origin is collections.abc.Callable or spec is collections.abc.Callable:
        return callable(value), value
    if isinstance(spec, type) and not getattr(spec, "_is_protocol", False):
        return isinstance(value, spec), value
    return True, value


def coerce_option(owner: str, key: str, value: Any, spec: Any) -> Any:
    """``value`` as the option ``key`` of ``owner`` takes it (see :func:`option_type` and the annotations of
    Captum's signatures), or a ValueError naming the option: a wrong type fails here, in one line, instead of as a
    traceback deep inside the method (or, worse, being taken as true)."""
    ok, converted = _convert(value, spec)
    if not ok:
        raise ValueError(f"{owner} option {key!r} must be {_describe(spec)}, got {value!r}")
    return converted


class ImageRangeWarning(UserWarning):
    """Float images with values above 1: explainers take images in [0, 1], not 0..255 pixel values."""


def _only_a_reference(value: Any) -> bool:
    """Whether ``value`` can only be a baseline, never a target: a floating tensor, a float or a reference name
    (targets are integer class indices; :func:`~attr_engine.classifier.resolve_targets` refuses anything else)."""
    if isinstance(value, torch.Tensor):
        return value.is_floating_point()
    return isinstance(value, float | str)


def captum_order(
    name: str, target: Any, baselines: Any, takes_baselines: bool = True
) -> tuple[int | Sequence[int] | torch.Tensor | None, Any]:
    """``(target, baselines)`` from the two arguments after the images, in either order.

    attr-engine's order is ``attribute(inputs, target, baselines)`` (Captum's for Saliency, InputXGradient, Grad-CAM:
    ``(inputs, target)``); Captum's IntegratedGradients, DeepLift, DeepLiftShap, FeatureAblation, ShapleyValueSampling,
    Lime and KernelShap take ``attribute(inputs, baselines, target)``. A target is always integer class indices and
    a baseline never is, so the two orders are told apart by value: a floating tensor, a float or a reference name
    in the target's place is the baseline, and the argument after it the target. Two integers stay in attr-engine's
    order, and an integer baseline outside the images' [0, 1] range is refused as the likely class index of a
    Captum-order call (``attribute(x, 0, 3)``: write ``0.0`` or ``target=3``). A method that takes no baseline
    (``takes_baselines=False``) gets its arguments as given: Captum's classes without one take ``(inputs, target)``.
    """
    if not takes_baselines:
        return target, baselines
    if _only_a_reference(target):
        if baselines is not None and _only_a_reference(baselines):
            raise ValueError(
                f"{name}: target must hold integer class indices, got a {_kind(target)} and then a "
                f"{_kind(baselines)}; the order is attribute(inputs, target, baselines) or Captum's "
                "attribute(inputs, baselines, target)"
            )
        return baselines, target
    if isinstance(baselines, int) and not isinstance(baselines, bool) and not 0 <= baselines <= 1:
        raise ValueError(
            f"{name}: baselines={baselines} is an integer outside the images' [0, 1] range: in Captum's order "
            "attribute(inputs, baselines, target) write the baseline as a float (0.0) or pass target= by keyword; "
            "attr-engine's order is attribute(inputs, target, baselines)"
        )
    return target, baselines


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


# Above this, a float image is not a [0, 1] image: a noise perturbation of one (max-sensitivity adds at most its
# radius, 0.02) or the ringing of a bicubic resize overshoots 1 by far less; 0..255 pixels or normalised images
# (max about 2.6) do not.
RANGE_WARNING_ABOVE = 1.1
_range_warned = False  # warned once per process: a run over a folder of such images says it once, not per batch
# How far images may leave [0, 1] without a warning beyond RANGE_WARNING_ABOVE's margin: 0 for a caller's images;
# more while explaining noisy copies of them (Quantus' perturbations), which also warn below zero then.
_range_allowance: contextvars.ContextVar[float] = contextvars.ContextVar("attr_engine_range_allowance", default=0.0)

# Quantus' perturbations of [0, 1] images: MaxSensitivity's and AvgSensitivity's uniform noise of radius 0.2 and
# LocalLipschitzEstimate's Gaussian of std 0.1 (about 0.5 at the extreme of a 224 px image) stay well inside this;
# 0..255 pixels do not, nor normalised images (about -2.1 to 2.6 for ImageNet statistics) with their darkest or
# brightest pixels.
PERTURBATION_ALLOWANCE = 1.0


@contextlib.contextmanager
def image_range_check(allowance: float) -> Iterator[None]:
    """Widen the :class:`ImageRangeWarning` check by ``allowance`` for the explainer calls inside the block (this
    thread or task only): images then warn above ``1.1 + allowance`` or below ``-0.1 - allowance``.
    :func:`~attr_engine.adapters.quantus_explain_func` explains Quantus' noisy copies of the caller's images with
    :data:`PERTURBATION_ALLOWANCE`."""
    if not allowance >= 0:
        raise ValueError(f"allowance must be >= 0, got {allowance}")
    token = _range_allowance.set(float(allowance))
    try:
        yield
    finally:
        _range_allowance.reset(token)


def _check_values(x: torch.Tensor) -> None:
    """Refuse NaN / inf in the images and, the first time in a process, warn when their maximum says they are not
    in [0, 1]: a [0, 255] image is not an error to the classifier (it normalises whatever it gets), so without a
    word the maps would explain a saturated image. One transfer to the host for all of it. Inside
    :func:`image_range_check` the bounds widen and the minimum is checked too (a noisy copy is not exact)."""
    global _range_warned
    if x.numel() == 0:
        return
    allowance = _range_allowance.get()
    if _range_warned:
        finite, peak, low = bool(torch.isfinite(x).all()), 0.0, 0.0
    else:
        probe = x.detach()
        stats = torch.stack([torch.isfinite(probe).all().float(), probe.amax().float(), probe.amin().float()])
        finite, peak, low = bool(stats[0]), *(float(v) for v in stats[1:].tolist())
    if not finite:
        raise ValueError("x contains NaN or infinite values")
    below = allowance > 0 and low < 1 - RANGE_WARNING_ABOVE - allowance
    if peak > RANGE_WARNING_ABOVE + allowance or below:
        _range_warned = True
        reach = f"go down to {low:g}" if below else f"reach {peak:g}"
        warnings.warn(
            f"the images {reach}, but explainers take float images in [0, 1] (divide 0..255 pixels by 255; "
            "do not normalise them, the classifier does): their maps explain saturated images",
            ImageRangeWarning,
            stacklevel=3,
        )


class Explainer:
    """Base class: an attribution method bound to one classifier, called the way Captum's methods are.

    ``attribute(inputs, target=None, baselines=None, **options)``; options given at construction are the defaults of
    every call and a call may override them. Subclasses implement ``_attribute(x, target, baselines=..., **options)``
    for checked images and resolved targets, returning (B, C, H, W) per-channel attributions (``per_channel``
    methods; the base class reduces them) or (B, H, W) maps; the base class checks inputs, options and outputs so
    every method fails the same way on bad input.

    Class attributes a method declares:
        name: registry name of the method.
        needs_grad: run ``_attribute`` with autograd enabled even inside ``torch.no_grad()`` (a method whose need
            depends on its options overrides :meth:`_needs_grad` instead).
        options: per-call options and their defaults (Captum's names for the Captum-backed methods). A value given
            for an option is coerced to its default's type (:func:`option_type`, :func:`coerce_option`) or refused.
        option_types: the type an option takes where its default does not say (a None default) or says too little
            (an annotation such as ``tuple[int, ...]``); by default read from ``options``.
        option_aliases: other names accepted for options (``{alias: name}``).
        per_channel: ``_attribute`` returns (B, C, H, W); ``reduce=None`` hands it out unreduced.
        display_reduce: the channel reduction of the default map (how the method's authors display it).
        ranking_reduce: the reduction its authors' evaluation ranks pixels by (None: the display map), with
            ``ranking_source`` saying where that comes from; the leaderboard scores pixel-ranking metrics with it.
        takes_baselines, default_baselines: whether ``baselines`` is used, and its default.
        has_convergence_delta: ``return_convergence_delta=True`` is supported (Captum's meaning).
        infidelity_per_channel: infidelity scores the signed (B, C, H, W) attribution, not the map.
        extra_rankings: other reductions whose deletion / insertion the leaderboard reports beside the map's.
        channels: the number of image channels accepted (None: any).
        output_dtype: the dtype of the result (None: the dtype of the caller's images).
        checks_target_range: the base class checks the target classes against ``classifier.num_classes``; a method
            that checks them against the logits it computes anyway sets False (one host-device sync saved).

    Attributes:
        classifier: the explained classifier (metrics read ``.classifier`` to resolve targets).
        defaults: the options every call starts from.
        baselines: the default ``baselines`` of every call (None: ``default_baselines``).
    """

    name = "explainer"
    needs_grad = True
    options: ClassVar[Mapping[str, Any]] = {}
    option_aliases: ClassVar[Mapping[str, str]] = {}
    option_types: ClassVar[Mapping[str, Any]] = {}
    per_channel = False
    display_reduce: str | None = None
    ranking_reduce: str | None = None
    ranking_source = ""
    takes_baselines = False
    default_baselines: Any = None
    has_convergence_delta = False
    infidelity_per_channel = False
    extra_rankings: tuple[str, ...] = ()
    channels: int | None = 3
    output_dtype: torch.dtype | None = torch.float32
    checks_target_range = True

    def __init__(self, classifier: nn.Module, *, baselines: Any = None, **options: Any) -> None:
        if not isinstance(classifier, nn.Module):
            raise ValueError(
                f"classifier must be a torch.nn.Module (a Classifier), got {type(classifier).__name__}"
                f"{not_a_classifier_hint(classifier)}"
            )
        self.classifier = classifier
        if baselines is not None:
            if not self.takes_baselines:
                raise ValueError(f"{self.name} takes no baselines")
            if not isinstance(baselines, torch.Tensor):
                resolve_baselines(baselines, torch.zeros(1, 3, 1, 1), classifier)  # a bad name fails here
        self.baselines = baselines
        self.defaults: dict[str, Any] = self._merge_options(dict(self.options), options)

    def _merge_options(self, base: dict[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
        merged = dict(base)
        for key, value in given.items():
            key = self.option_aliases.get(key, key)
            if key not in self.options:
                known = ", ".join(sorted(self.options)) or "none"
                raise ValueError(f"{self.name} has no option {key!r}; its options: {known}")
            spec = self.option_types.get(key, _UNCHECKED)
            if spec is _UNCHECKED:
                spec = option_type(self.options[key])
            merged[key] = coerce_option(self.name, key, value, spec)
        self._check_options(merged)
        return merged

    def _check_options(self, options: dict[str, Any]) -> None:
        """Validate (and normalise in place) a full set of options; raise ValueError on a bad one."""

    def _needs_grad(self, options: Mapping[str, Any]) -> bool:
        """Whether a call with these (merged) options needs autograd; by default the class's ``needs_grad``."""
        return self.needs_grad

    def _cast_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The checked images as ``_attribute`` receives them: by default in the classifier's dtype, so fp16 / bf16
        / float64 images work with a model of another dtype instead of failing deep inside."""
        dtype = input_dtype(self.classifier)
        return x.to(dtype) if dtype is not None and x.dtype != dtype else x

    def _bind(self) -> None:
        """Set up what depends on ``self.classifier`` (layers, hooks, wrapped explainers); called by :meth:`rebind`."""

    def rebind(self, classifier: nn.Module) -> Explainer:
        """This method, with its options, explaining another classifier (e.g. a copy with randomised layers).

        Returns ``self`` for the same classifier, else a shallow copy whose model-dependent state is rebuilt.
        """
        if classifier is self.classifier:
            return self
        if not isinstance(classifier, nn.Module):
            raise ValueError(
                f"classifier must be a torch.nn.Module, got {type(classifier).__name__}"
                f"{not_a_classifier_hint(classifier)}"
            )
        new = copy.copy(self)
        new.classifier = classifier
        new.defaults = dict(self.defaults)
        new._bind()
        return new

    def with_options(self, **options: Any) -> Explainer:
        """A shallow copy of this method whose defaults are these options over the current ones (``self`` itself
        is left alone; model state such as a trained decoder is shared, not copied)."""
        new = copy.copy(self)
        new.defaults = self._merge_options(self.defaults, options)
        return new

    @property
    def device(self) -> torch.device:
        if isinstance(self.classifier, Classifier):
            return self.classifier.norm_mean.device
        param = next(self.classifier.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    # The return type follows return_convergence_delta: maps alone, or (maps, delta).
    @overload
    def attribute(
        self,
        inputs: torch.Tensor,
        target: int | Sequence[int] | torch.Tensor | float | str | None = ...,
        baselines: Any = ...,
        *,
        reduce: str | None = ...,
        keepdim: bool = ...,
        return_convergence_delta: Literal[False] = ...,
        **options: Any,
    ) -> torch.Tensor: ...
    @overload
    def attribute(
        self,
        inputs: torch.Tensor,
        target: int | Sequence[int] | torch.Tensor | float | str | None = ...,
        baselines: Any = ...,
        *,
        reduce: str | None = ...,
        keepdim: bool = ...,
        return_convergence_delta: Literal[True],
        **options: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    @overload
    def attribute(
        self,
        inputs: torch.Tensor,
        target: int | Sequence[int] | torch.Tensor | float | str | None = ...,
        baselines: Any = ...,
        *,
        reduce: str | None = ...,
        keepdim: bool = ...,
        return_convergence_delta: bool,
        **options: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...
    def attribute(
        self,
        inputs: torch.Tensor,
        target: int | Sequence[int] | torch.Tensor | float | str | None = None,
        baselines: Any = None,
        *,
        reduce: str | None = REDUCE_UNSET,
        keepdim: bool = False,
        return_convergence_delta: bool = False,
        **options: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attribution maps: (B, H, W) by default, or Captum's input-shaped (B, C, H, W) with ``reduce=None``.

        Methods that take a baseline take ``target`` and ``baselines`` in either order: ``attribute(x, target,
        baselines)`` or Captum's ``attribute(x, baselines, target)`` of IntegratedGradients, DeepLift and the
        ablation methods (see :func:`captum_order`: a target is integer classes, a baseline never is).

        Args:
            inputs: (B, 3, H, W) images in [0, 1] on the classifier's device, any floating dtype; values above
                1.1 (0..255 pixels, normalised images) give one :class:`ImageRangeWarning` per process.
            target: class per image (int, sequence or (B,) tensor); ``None`` explains the predicted class
                (:func:`~attr_engine.classifier.resolve_targets`: a bool, wrong length or class is a ValueError).
            baselines: the reference of methods that use one (Integrated Gradients, occlusion, DeepLift, ...,
                and ``reduce="input"``): a number, ``"black"``, ``"mean"``, ``"blur"`` or a tensor (3, H, W),
                (1, 3, H, W) or (B, 3, H, W). None: the construction-time value, else the method's default.
            reduce: for per-channel methods, how channels become one value per pixel (see :func:`reduce_channels`);
                None returns the (B, C, H, W) attribution Captum's class returns. Default: the method's
                ``display_reduce`` (sum, mean or max-abs over channels, per method).
            keepdim: return (B, 1, H, W) instead of (B, H, W).
            return_convergence_delta: also return Captum's (B,) convergence delta (methods that have one).
            options: per-call overrides of the method's options (see ``options``).

        Returns:
            (B, H, W) maps (higher = more important for the target), detached, float32 (or the images' dtype
            where ``output_dtype`` is None), or (B, 1, H, W) with ``keepdim``, or (B, C, H, W) with
            ``reduce=None``; (0, ...) for an empty batch. With ``return_convergence_delta``, a pair
            (maps, (B,) delta).

        Raises:
            RuntimeError: a method that needs autograd called inside ``torch.inference_mode()``.
            ValueError: bad images, target, baselines, reduction or options.
        """
        x = inputs
        # Captum's classes that take a baseline take it first; those that take none take (inputs, target).
        target, baselines = captum_order(self.name, target, baselines, self.takes_baselines or reduce == "input")
        opts = self._merge_options(self.defaults, options) if options else self.defaults
        needs_grad = self._needs_grad(opts)
        if torch.is_inference_mode_enabled() and needs_grad:
            raise RuntimeError(
                f"{self.name} needs autograd and cannot run inside torch.inference_mode(); call it outside "
                "(torch.no_grad() is fine)"
            )
        check_device(x, self.classifier)
        check_tensor(x, "x", ndim=4)
        _check_values(x)
        if self.channels is not None and x.shape[1] != self.channels:
            raise ValueError(f"x must be (B, {self.channels}, H, W) RGB images, got shape {tuple(x.shape)}")
        if reduce is REDUCE_UNSET:
            reduce = self.display_reduce
        elif not self.per_channel:
            raise ValueError(f"{self.name} gives one value per pixel: it takes no reduce argument")
        elif reduce is not None and reduce not in REDUCTIONS:
            raise ValueError(f"reduce must be one of {REDUCTIONS} or None, got {reduce!r}")
        if return_convergence_delta and not self.has_convergence_delta:
            raise ValueError(f"{self.name} has no convergence delta")
        if baselines is not None and not (self.takes_baselines or reduce == "input"):
            raise ValueError(f"{self.name} takes no baselines")
        out_dtype = self.output_dtype or x.dtype
        check_range = self.checks_target_range
        if x.shape[0] == 0:  # an empty batch (the tail of a filtered loader): an empty result, the target still checked
            if target is not None:
                # Against the classifier's classes even for methods that check against their logits: there are
                # none, so one probe image of this size gives K (classifier.num_classes may probe another size).
                probe = self._cast_inputs(torch.zeros(1, *x.shape[1:], dtype=x.dtype, device=x.device))
                with torch.no_grad(), eval_mode(self.classifier):
                    classes = self.classifier(probe).shape[-1]
                resolve_targets(self.classifier, x, target, logits=torch.zeros(0, classes, device=x.device))
            shape = (0, *x.shape[1:]) if reduce is None and self.per_channel else (0, *x.shape[2:])
            empty = torch.zeros(shape, dtype=out_dtype, device=x.device)
            empty = empty.unsqueeze(1) if keepdim and empty.ndim == 3 else empty
            return (empty, torch.zeros(0, device=x.device)) if return_convergence_delta else empty
        x = self._cast_inputs(x)
        given = baselines if baselines is not None else self.baselines
        if given is None and (self.takes_baselines or reduce == "input"):
            given = self.default_baselines if self.default_baselines is not None else "mean"
        ref = resolve_baselines(given, x, self.classifier)
        kwargs: dict[str, Any] = dict(opts)
        if self.takes_baselines:
            kwargs["baselines"] = ref
        if return_convergence_delta:
            kwargs["return_convergence_delta"] = True
        # Eval mode for the call: a raw model in training mode would update BatchNorm statistics and run dropout.
        with eval_mode(self.classifier):
            target = resolve_targets(self.classifier, x, target, check_range=check_range)
            with torch.set_grad_enabled(needs_grad or torch.is_grad_enabled()):
                out = self._attribute(x, target, **kwargs)
        delta = None
        if return_convergence_delta:
            out, delta = out
        if self.per_channel:
            if out.shape != x.shape:
                raise RuntimeError(f"{self.name} produced attributions {tuple(out.shape)} for images {tuple(x.shape)}")
            if reduce is not None:
                out = reduce_channels(out, reduce, x, ref)
        if out.ndim == 3 and out.shape != (x.shape[0], *x.shape[2:]):
            raise RuntimeError(f"{self.name} produced maps of shape {tuple(out.shape)} for images {tuple(x.shape)}")
        if keepdim and out.ndim == 3:
            out = out.unsqueeze(1)
        out = out.detach().to(out_dtype)
        return (out, delta.detach().float()) if delta is not None else out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.attribute(*args, **kwargs)

    # Each method declares the keyword options it takes (the base class passes exactly its merged ``options``);
    # ``*args: Any, **options: Any`` is the signature a type checker accepts every such override of.
    def _attribute(self, x: torch.Tensor, target: torch.Tensor, *args: Any, **options: Any) -> Any:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class FunctionExplainer(Explainer):
    """Any ``fn(x, target) -> (B, H, W)`` (or ``(B, C, H, W)``, averaged over channels) as an :class:`Explainer`."""

    def __init__(
        self, classifier: nn.Module, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], name: str = "function"
    ) -> None:
        super().__init__(classifier)
        if not callable(fn):
            raise ValueError(f"fn must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = name

    def _attribute(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        maps = self.fn(x, target)
        if not isinstance(maps, torch.Tensor):
            raise RuntimeError(f"{self.name} must return a tensor, got {type(maps).__name__}")
        return maps.mean(dim=1) if maps.ndim == 4 else maps


# ---------------------------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------------------------

ENTRY_POINT_GROUP = "attr_engine.explainers"
# Packages whose import registers the built-in methods; imported on the registry's first use (see the module doc).
_BUILTIN_PACKAGES = ("attr_engine.baselines", "attr_engine.aha", "attr_engine.pullback")


@dataclass(frozen=True)
class ExplainerSpec:
    """A registry entry: ``factory(classifier, **kwargs) -> Explainer``; ``applies(model)`` says which models fit."""

    name: str
    factory: Callable[..., Explainer]
    description: str
    applies: Callable[[nn.Module], bool] = lambda model: True


_REGISTRY: dict[str, ExplainerSpec] = {}
# ``prefix:rest`` names (``captum:DeepLift``): prefix -> factory(classifier, rest, **kwargs).
_FAMILIES: dict[str, Callable[..., Explainer]] = {}
_ALIASES = {
    "grad": "gradient",
    "gxi": "gradient-x-input",
    "input-x-gradient": "gradient-x-input",
    "ig": "integrated-gradients",
    "gradcam": "grad-cam",
    "rollout": "attention-rollout",
    "sfp": "pullback-soft",
    "pa": "pullback-ascent",
    "pullback": "pullback-ascent",  # the command line's default method
}
_builtins_loaded = False
_plugins: dict[str, metadata.EntryPoint] | None = None  # canonical name -> entry point not yet loaded


def explain_batch(
    classifier: nn.Module, explainer: Explainer, x: torch.Tensor, target: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Maps of one batch for the classes asked for, or the predicted ones.

    Args:
        classifier: the explained classifier (predicts the classes when ``target`` is None).
        explainer: the method.
        x: (B, 3, H, W) images on the classifier's device.
        target: (B,) classes, or None.

    Returns:
        (B, H, W) float32 maps on the CPU, and the (B,) classes explained, on ``x``'s device.
    """
    with torch.no_grad():
        target = classifier(x).argmax(1) if target is None else target.to(x.device)
    return explainer.attribute(x, target).float().cpu(), target


def explain_batch_with_probability(
    classifier: nn.Module, explainer: Explainer, x: torch.Tensor, target: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`explain_batch`, plus the classifier's softmax probability of each explained class.

    One forward pass gives both the predicted classes (argmax of the logits, exactly as :func:`explain_batch`
    picks them) and the probabilities, so captions cost nothing when the target is predicted and one no-grad
    forward pass when it is given.

    Returns:
        (B, H, W) float32 maps on the CPU, the (B,) classes explained on ``x``'s device, and their (B,) float32
        probabilities on the CPU.
    """
    with torch.no_grad():
        logits = classifier(x)
        # Given classes are checked against the logits before they index them (gather would fail on its own terms,
        # on CUDA with a device-side assert).
        target = logits.argmax(1) if target is None else resolve_targets(classifier, x, target, logits=logits)
        probability = logits.float().softmax(1).gather(1, target[:, None])[:, 0].cpu()
    return explainer.attribute(x, target).float().cpu(), target, probability


def finite_maps(maps: torch.Tensor) -> list[bool]:
    """Per map of ``maps`` (B, H, W), whether every value is finite (in the classifier's frame, before any NaN
    border is added for the image's frame)."""
    return torch.isfinite(maps).flatten(1).all(1).tolist() if maps.numel() else [True] * len(maps)


def _canonical(name: str) -> str:
    if not isinstance(name, str):
        swapped = " (get_explainer(name, classifier): arguments swapped?)" if isinstance(name, nn.Module) else ""
        raise ValueError(f"explainer name must be a string, got {type(name).__name__}{swapped}")
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    return _ALIASES.get(key, key)


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True  # first: the packages call register_explainer while they are imported
    for package in _BUILTIN_PACKAGES:
        importlib.import_module(package)


def _plugin_entry_points() -> dict[str, metadata.EntryPoint]:
    """The entry points of :data:`ENTRY_POINT_GROUP` not loaded yet, by canonical name (read once)."""
    global _plugins
    if _plugins is None:
        found: dict[str, metadata.EntryPoint] = {}
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            key = _canonical(ep.name)
            if key not in _REGISTRY:  # a built-in name is not shadowed by a plugin
                found.setdefault(key, ep)
        _plugins = found
    return _plugins


def _load_plugin(key: str) -> ExplainerSpec | None:
    """Load the plugin entry point named ``key`` (if any) and register what it names.

    The entry point names either a factory (an :class:`Explainer` subclass or any ``f(classifier, **kwargs)``),
    registered under the entry point's name, or a module that registers its methods itself when imported.
    """
    ep = _plugin_entry_points().pop(key, None)
    if ep is None:
        return None
    try:
        loaded = ep.load()
    except Exception as err:  # a broken plugin must name itself, not fail later as an unknown method
        raise ImportError(f"the explainer plugin {ep.name!r} ({ep.value}) failed to load: {err}") from err
    if key not in _REGISTRY:
        if not callable(loaded):
            raise ValueError(
                f"the explainer plugin {ep.name!r} ({ep.value}) names a {type(loaded).__name__}, not a factory "
                "(an Explainer subclass or a function of (classifier, **options))"
            )
        doc = (getattr(loaded, "__doc__", None) or "").strip().splitlines()
        applies = getattr(loaded, "applies", None)
        register_explainer(
            key,
            loaded,
            description=doc[0] if doc else f"plugin {ep.value}",
            applies=applies if callable(applies) else None,
        )
    return _REGISTRY[key]


def register_explainer(
    name: str,
    factory: Callable[..., Explainer],
    *,
    description: str = "",
    applies: Callable[[nn.Module], bool] | None = None,
) -> None:
    """Add a method to the registry, so :func:`get_explainer`, ``attr-engine explain --method NAME`` and
    ``attr-engine evaluate --methods NAME`` find it (names are case-insensitive; ``_`` and ``-`` are the same).

    Args:
        name: the method's name.
        factory: ``factory(classifier, **kwargs) -> Explainer``, e.g. an :class:`Explainer` subclass.
        description: one line for listings and errors.
        applies: ``applies(model) -> bool`` for the models the method fits (default: every model).

    Raises:
        ValueError: the name is taken, or ``factory`` is not callable.
    """
    key = _canonical(name)
    if not callable(factory):
        raise ValueError(f"the factory of explainer {key!r} must be callable, got {type(factory).__name__}")
    if key in _REGISTRY:
        raise ValueError(f"an explainer named {key!r} is already registered")
    _REGISTRY[key] = ExplainerSpec(key, factory, description, applies or (lambda model: True))


def register_explainer_family(prefix: str, factory: Callable[..., Explainer]) -> None:
    """Register names of the form ``prefix:rest`` (``captum:DeepLift``): ``factory(classifier, rest, **kwargs)``."""
    key = prefix.strip().lower()
    if not key or ":" in key:
        raise ValueError(f"a family prefix must be a non-empty name without ':', got {prefix!r}")
    if key in _FAMILIES:
        raise ValueError(f"an explainer family {key!r} is already registered")
    _FAMILIES[key] = factory


def list_explainers(classifier: nn.Module | None = None) -> list[str]:
    """Registered method names (plugins included), sorted; with ``classifier``, only those that apply to its model.

    Filtering by a classifier loads the plugins (a plugin that fails to load is skipped with a warning).
    """
    _load_builtins()
    if classifier is None:
        return sorted({*_REGISTRY, *_plugin_entry_points()})
    for key in list(_plugin_entry_points()):
        try:
            _load_plugin(key)
        except (ImportError, ValueError) as err:
            warnings.warn(str(err), stacklevel=2)
    model = getattr(classifier, "model", classifier)
    return sorted(name for name, spec in _REGISTRY.items() if spec.applies(model))


class UnknownExplainerError(ValueError):
    """No registered method, alias, family or plugin has this name; ``close`` holds the nearest known names."""

    def __init__(self, name: str, close: Sequence[str] = ()) -> None:
        self.name, self.close = name, list(close)
        hint = f" (did you mean {', '.join(self.close)}?)" if self.close else ""
        super().__init__(f"unknown explainer {name!r}{hint}; known: {', '.join(list_explainers())}")


def resolve_explainer(name: str) -> str:
    """The canonical registry name of ``name``: the one every caller records and compares.

    Case, ``_`` / ``-`` and spaces do not matter and aliases resolve (``"AHA"`` -> ``"aha"``, ``"pullback"`` /
    ``"PA"`` -> ``"pullback-ascent"``); a family name keeps its member as written (``"Captum:DeepLift"`` ->
    ``"captum:DeepLift"``: class names are case-sensitive).

    Raises:
        UnknownExplainerError: nothing is registered under that name (with close matches).
    """
    _load_builtins()
    if isinstance(name, str) and ":" in name:
        prefix, _, rest = name.strip().partition(":")
        key = prefix.strip().lower()
        if key in _FAMILIES:
            return f"{key}:{rest.strip()}"
    key = _canonical(name)
    if key in _REGISTRY or key in _plugin_entry_points():
        return key
    raise UnknownExplainerError(name, difflib.get_close_matches(key, list_explainers(), n=3))


def list_methods() -> list[tuple[str, str, list[str]]]:
    """``(name, description, aliases)`` of every registered method, plug-ins included (loaded, so their
    descriptions are known; one that fails to load is listed with its error), then one row per name family
    (``captum:<Class>``), sorted by name."""
    _load_builtins()
    rows = []
    for key in sorted({*_REGISTRY, *_plugin_entry_points()}):
        try:
            spec = _REGISTRY.get(key) or _load_plugin(key)
            description = spec.description if spec is not None else ""
        except (ImportError, ValueError) as err:
            description = f"(cannot be loaded: {err})"
        rows.append((key, description, sorted(alias for alias, target in _ALIASES.items() if target == key)))
    for prefix, factory in sorted(_FAMILIES.items()):
        doc = (getattr(factory, "__doc__", None) or "").strip().splitlines()
        rows.append((f"{prefix}:<Class>", doc[0] if doc else f"the {prefix} family", []))
    return rows


def get_explainer(name: str, classifier: nn.Module, **kwargs: Any) -> Explainer:
    """Build the explainer ``name`` for ``classifier``; ``kwargs`` go to its constructor.

    Raises:
        ValueError: an unknown name (listing the known ones), a method that does not apply to this model, or bad
            constructor arguments (e.g. ``"aha"`` without ``aha=``).
        ImportError: the plugin of that name failed to load.
    """
    _load_builtins()
    if isinstance(name, str) and ":" in name:
        prefix, _, rest = name.strip().partition(":")
        family = _FAMILIES.get(prefix.strip().lower())
        if family is not None:
            return family(classifier, rest, **kwargs)
    key = resolve_explainer(name)
    spec = _REGISTRY.get(key) or _load_plugin(key)
    if spec is None:  # a plugin that registered something else under its name
        raise UnknownExplainerError(name)
    model = getattr(classifier, "model", classifier)
    if not spec.applies(model):
        raise ValueError(f"explainer {key!r} does not apply to {type(model).__name__} ({spec.description})")
    return spec.factory(classifier, **kwargs)
