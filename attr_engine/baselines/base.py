"""The call shape every attribution method shares, Captum's: ``explainer.attribute(inputs, target=None,
baselines=None, **options) -> (B, H, W)``."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from attr_engine.classifier import Classifier, check_device, eval_mode, input_dtype, resolve_targets
from attr_engine.imageops import REFERENCES, reference_image, scaled_blur
from kernels._validate import check_tensor

__all__ = [
    "REDUCTIONS",
    "Explainer",
    "FunctionExplainer",
    "import_captum",
    "reduce_channels",
    "resolve_baselines",
    "resolve_targets",
]


def import_captum() -> Any:
    """``captum.attr``, or a clear error: Captum is an evaluation extra, not a core dependency."""
    try:
        import captum.attr
    except ImportError as err:  # pragma: no cover - exercised only without the extra installed
        raise ImportError(
            "this baseline runs through Captum, which is not installed; pip install 'attr-engine[eval]'"
        ) from err
    return captum.attr


# Channel reductions of a per-channel (B, C, H, W) attribution to one value per pixel (B, H, W).
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "max", "abs", "abs-sum", "input")
_KEEP: Any = object()  # "no reduce argument given": the method's own display reduction


def reduce_channels(
    attr: torch.Tensor, reduce: str, x: torch.Tensor | None = None, reference: Any = None
) -> torch.Tensor:
    """One value per pixel from a per-channel attribution.

    Args:
        attr: (B, C, H, W) attribution.
        reduce: ``"mean"`` / ``"sum"`` over channels, ``"max"`` (max over channels), ``"abs"`` (mean of absolute
            values), ``"abs-sum"`` (sum of absolute values), or ``"input"``: ``sum_c attr_c * (x_c - reference_c)``
            (a first-order estimate of what moving the pixel to the reference changes).
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
    if isinstance(baselines, torch.Tensor):
        ref = baselines.unsqueeze(0) if baselines.ndim == 3 else baselines
        if ref.ndim != 4 or ref.shape[1:] != x.shape[1:] or ref.shape[0] not in (1, x.shape[0]):
            # The shape only: a tensor's values are no use in an error message.
            raise ValueError(
                f"a baselines tensor must be (3, H, W), (1, 3, H, W) or (B, 3, H, W) for inputs {tuple(x.shape)}, "
                f"got shape {tuple(baselines.shape)}"
            )
        check_tensor(ref, "baselines", finite=True)
        return ref.to(device=x.device, dtype=x.dtype).expand_as(x)
    if isinstance(baselines, str):
        if baselines not in REFERENCES:
            raise ValueError(
                f"baselines must be one of {', '.join(REFERENCES)}, a number or a tensor, got {baselines!r}"
            )
        if baselines == "black":
            return 0.0
        mean = getattr(classifier, "norm_mean", None)
        if baselines == "mean" and mean is None:
            raise ValueError("baselines='mean' needs a Classifier (it reads the normalisation mean)")
        kernel, sigma = scaled_blur(min(x.shape[-2:]))
        return reference_image(x, baselines, mean, blur_kernel=kernel, blur_sigma=sigma).to(x.dtype).expand_as(x)
    raise ValueError(f"baselines must be a number, a name or a tensor, got {type(baselines).__name__}")


class Explainer:
    """Base class: an attribution method bound to one classifier, called the way Captum's methods are.

    ``attribute(inputs, target=None, baselines=None, **options)``; options given at construction are the defaults of
    every call and a call may override them. Subclasses implement ``_attribute(x, target, baselines=..., **options)``
    for checked images and resolved targets, returning (B, C, H, W) per-channel attributions (``per_channel``
    methods; the base class reduces them) or (B, H, W) maps; the base class checks inputs, options and outputs so
    every method fails the same way on bad input.

    Class attributes a method declares:
        name: registry name of the method.
        needs_grad: run ``_attribute`` with autograd enabled even inside ``torch.no_grad()``.
        options: per-call options and their defaults (Captum's names for the Captum-backed methods).
        option_aliases: older names accepted for options (``{old: new}``).
        per_channel: ``_attribute`` returns (B, C, H, W); ``reduce=None`` hands it out unreduced.
        display_reduce: the channel reduction of the default map (how the method's authors display it).
        ranking_reduce: the reduction its authors' evaluation ranks pixels by (None: the display map), with
            ``ranking_source`` saying where that comes from; the leaderboard scores pixel-ranking metrics with it.
        takes_baselines, default_baselines: whether ``baselines`` is used, and its default.
        has_convergence_delta: ``return_convergence_delta=True`` is supported (Captum's meaning).
        infidelity_per_channel: infidelity scores the signed (B, C, H, W) attribution, not the map.
        extra_rankings: other reductions whose deletion / insertion the leaderboard reports beside the map's.

    Attributes:
        classifier: the explained classifier (metrics read ``.classifier`` to resolve targets).
        defaults: the options every call starts from.
        baselines: the default ``baselines`` of every call (None: ``default_baselines``).
    """

    name = "explainer"
    needs_grad = True
    options: ClassVar[Mapping[str, Any]] = {}
    option_aliases: ClassVar[Mapping[str, str]] = {}
    per_channel = False
    display_reduce: str | None = None
    ranking_reduce: str | None = None
    ranking_source = ""
    takes_baselines = False
    default_baselines: Any = None
    has_convergence_delta = False
    infidelity_per_channel = False
    extra_rankings: tuple[str, ...] = ()

    def __init__(self, classifier: nn.Module, *, baselines: Any = None, **options: Any) -> None:
        if not isinstance(classifier, nn.Module):
            raise ValueError(f"classifier must be a torch.nn.Module (a Classifier), got {type(classifier).__name__}")
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
            merged[key] = value
        self._check_options(merged)
        return merged

    def _check_options(self, options: dict[str, Any]) -> None:
        """Validate (and normalise in place) a full set of options; raise ValueError on a bad one."""

    def _bind(self) -> None:
        """Set up what depends on ``self.classifier`` (layers, hooks, wrapped explainers); called by :meth:`rebind`."""

    def rebind(self, classifier: nn.Module) -> Explainer:
        """This method, with its options, explaining another classifier (e.g. a copy with randomised layers).

        Returns ``self`` for the same classifier, else a shallow copy whose model-dependent state is rebuilt.
        """
        if classifier is self.classifier:
            return self
        if not isinstance(classifier, nn.Module):
            raise ValueError(f"classifier must be a torch.nn.Module, got {type(classifier).__name__}")
        new = copy.copy(self)
        new.classifier = classifier
        new.defaults = dict(self.defaults)
        new._bind()
        return new

    @property
    def device(self) -> torch.device:
        if isinstance(self.classifier, Classifier):
            return self.classifier.norm_mean.device
        param = next(self.classifier.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def attribute(
        self,
        inputs: torch.Tensor,
        target: int | Sequence[int] | torch.Tensor | None = None,
        baselines: Any = None,
        *,
        reduce: str | None = _KEEP,
        keepdim: bool = False,
        return_convergence_delta: bool = False,
        **options: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attribution maps.

        Args:
            inputs: (B, 3, H, W) images in [0, 1], on the classifier's device, any floating dtype (cast to the
                classifier's).
            target: class per image (int, sequence or (B,) tensor); ``None`` explains the predicted class.
            baselines: the reference of methods that use one (Integrated Gradients, occlusion, DeepLift, ...,
                and ``reduce="input"``): a number, ``"black"``, ``"mean"``, ``"blur"`` or a tensor (3, H, W),
                (1, 3, H, W) or (B, 3, H, W). None: the construction-time value, else the method's default.
            reduce: for per-channel methods, how channels become one value per pixel (see :func:`reduce_channels`);
                None returns the (B, C, H, W) attribution. Default: the method's ``display_reduce``.
            keepdim: return (B, 1, H, W) instead of (B, H, W).
            return_convergence_delta: also return Captum's (B,) convergence delta (methods that have one).
            options: per-call overrides of the method's options (see ``options``).

        Returns:
            (B, H, W) float32 maps (higher = more important for the target), detached, or (B, 1, H, W) with
            ``keepdim``, or (B, C, H, W) with ``reduce=None``; (0, ...) for an empty batch. With
            ``return_convergence_delta``, a pair (maps, (B,) delta).
        """
        x = inputs
        if torch.is_inference_mode_enabled() and self.needs_grad:
            raise RuntimeError(f"{self.name} needs autograd and cannot run inside torch.inference_mode()")
        check_device(x, self.classifier)
        check_tensor(x, "x", ndim=4, finite=True)
        if x.shape[1] != 3:
            raise ValueError(f"x must be an RGB batch (B, 3, H, W), got shape {tuple(x.shape)}")
        if reduce is _KEEP:
            reduce = self.display_reduce
        elif not self.per_channel:
            raise ValueError(f"{self.name} gives one value per pixel: it takes no reduce argument")
        elif reduce is not None and reduce not in REDUCTIONS:
            raise ValueError(f"reduce must be one of {REDUCTIONS} or None, got {reduce!r}")
        if return_convergence_delta and not self.has_convergence_delta:
            raise ValueError(f"{self.name} has no convergence delta")
        if baselines is not None and not (self.takes_baselines or reduce == "input"):
            raise ValueError(f"{self.name} takes no baselines")
        opts = self._merge_options(self.defaults, options) if options else self.defaults
        if x.shape[0] == 0:  # an empty batch (the tail of a filtered loader): an empty result, the target still checked
            if target is not None:
                resolve_targets(self.classifier, x, target)
            shape = (0, *x.shape[1:]) if reduce is None and self.per_channel else (0, *x.shape[2:])
            empty = torch.zeros(shape, dtype=torch.float32, device=x.device)
            empty = empty.unsqueeze(1) if keepdim and empty.ndim == 3 else empty
            return (empty, torch.zeros(0, device=x.device)) if return_convergence_delta else empty
        dtype = input_dtype(self.classifier)
        if dtype is not None and x.dtype != dtype:
            x = x.to(dtype)  # fp16 / bf16 / float64 images and a model of another dtype: cast at the boundary
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
            target = resolve_targets(self.classifier, x, target)
            with torch.set_grad_enabled(self.needs_grad or torch.is_grad_enabled()):
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
        out = out.detach().float()
        return (out, delta.detach().float()) if delta is not None else out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.attribute(*args, **kwargs)

    def _attribute(self, x: torch.Tensor, target: torch.Tensor, **options: Any) -> Any:
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
