"""Any Captum attribution class as an :class:`~attr_engine.baselines.Explainer`: ``captum:<ClassName>``.

``get_explainer("captum:DeepLift", clf)`` (and ``attr-engine explain --method captum:DeepLift``) builds
``captum.attr.DeepLift(clf)`` and calls its ``attribute`` with the options given, Captum's names unchanged: those of
the class's constructor (``multiply_by_inputs``, ``eps``, ...) go to the constructor, the rest to every
``attribute`` call (``n_samples``, ``sliding_window_shapes``, ``interpolate_mode``, ...), and a call may override
those. ``layer`` - for classes that take one - is a module or its name in the model (``"layer4"``,
``"stages.3"``); by default the last feature stage of a timm CNN.

Attributions to the input are per-channel (``reduce=None`` gives them; the default map is their channel sum, as the
attributions of additive methods add up). Layer attributions (``Layer*`` classes, e.g. ``LayerGradCam``) are summed
over the layer's channels and upsampled bilinearly to the input, as Grad-CAM is.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attr_engine.baselines._captum import import_captum
from attr_engine.baselines.cam import _last_cnn_stage, find_layer, layer_name
from attr_engine.explainer import Explainer, reduce_channels

__all__ = ["CaptumMethod", "captum_class"]

_REQUIRED: Any = inspect.Parameter.empty
# attribute() parameters the Explainer call shape supplies itself.
_SUPPLIED = {"self", "inputs", "target", "baselines", "return_convergence_delta", "additional_forward_args"}


def captum_class(name: str) -> type[Any]:
    """The Captum attribution class called ``name`` (case-insensitive), or a ValueError listing the known ones."""
    captum = import_captum()
    base = captum.Attribution
    classes = {
        n.lower(): getattr(captum, n)
        for n in dir(captum)
        if isinstance(getattr(captum, n), type) and issubclass(getattr(captum, n), base) and n[0] != "_"
    }
    # Abstract bases and wrappers of other attributions are not methods to run on a classifier.
    for skip in ("attribution", "gradientattribution", "perturbationattribution", "layerattribution"):
        classes.pop(skip, None)
    for skip in ("neuronattribution", "noisetunnel", "dataloaderattribution"):
        classes.pop(skip, None)
    cls = classes.get(name.strip().lower())
    if cls is None:
        known = ", ".join(sorted(c.__name__ for c in classes.values() if "LLM" not in c.__name__))
        raise ValueError(f"captum.attr has no attribution class {name!r} to run on an image classifier; known: {known}")
    return cls


class CaptumMethod(Explainer):
    """A Captum attribution class bound to the classifier.

    Args:
        classifier: the explained classifier (Captum's ``forward_func`` / ``model``).
        class_name: the ``captum.attr`` class, e.g. ``"DeepLift"``, ``"GuidedGradCam"``, ``"KernelShap"``.
        layer: for classes with a ``layer`` argument: a module or its name; None takes the last CNN stage.
        display_reduce: the channel reduction of the default map (``"sum"``; see :func:`reduce_channels`).
        ranking_reduce: the reduction pixel-ranking metrics use (None: the display map).
        baselines: default baselines (Captum's default: 0, i.e. black).
        options: Captum constructor and ``attribute`` arguments.
    """

    def __init__(
        self,
        classifier: nn.Module,
        class_name: str,
        *,
        layer: nn.Module | str | None = None,
        display_reduce: str = "sum",
        ranking_reduce: str | None = None,
        baselines: Any = None,
        **options: Any,
    ) -> None:
        cls = captum_class(class_name)
        self.captum_cls = cls
        self.name = f"captum:{cls.__name__}"
        init = inspect.signature(cls.__init__).parameters
        call = inspect.signature(cls.attribute).parameters
        init_names = [n for n in init if n != "self"]
        self._model_arg = init_names[0]
        self._uses_layer = "layer" in init
        self._init_kwargs = {k: options.pop(k) for k in list(options) if k in init and k not in ("self", "layer")}
        # Per instance here: the options are read from this Captum class's signature.
        self.options = {  # type: ignore[misc]
            n: p.default
            for n, p in call.items()
            if n not in _SUPPLIED and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        }
        self.takes_baselines = "baselines" in call
        self.default_baselines = "black"
        self.has_convergence_delta = "return_convergence_delta" in call
        layer_output = issubclass(cls, import_captum().LayerAttribution)
        self.per_channel = not layer_output
        self.infidelity_per_channel = self.per_channel
        self.display_reduce = display_reduce if not layer_output else None
        self.ranking_reduce = ranking_reduce
        if ranking_reduce is not None:
            self.ranking_source = f"declared for {self.name}"
        super().__init__(classifier, baselines=baselines, **options)
        self._layer_name: str | None = None
        if self._uses_layer:
            model = getattr(classifier, "model", classifier)
            module = find_layer(classifier, layer) if isinstance(layer, str) else layer or _last_cnn_stage(model)
            self._layer_name = layer_name(classifier, module)
        elif layer is not None:
            raise ValueError(f"{self.name} takes no layer")
        self._bind()

    def _check_options(self, options: dict[str, Any]) -> None:
        missing = [k for k, v in options.items() if v is _REQUIRED]
        if missing:
            raise ValueError(f"{self.name} needs the option(s) {', '.join(missing)} (Captum's required arguments)")

    def _bind(self) -> None:
        args: list[Any] = [self.classifier]
        if self._layer_name is not None:  # set exactly when the Captum class takes a layer
            args.append(find_layer(self.classifier, self._layer_name))
        self.method = self.captum_cls(*args, **self._init_kwargs)

    @property
    def multiplies_by_inputs(self) -> bool:
        return bool(getattr(self.method, "multiplies_by_inputs", False))

    def _attribute(self, x: torch.Tensor, target: torch.Tensor, **options: Any) -> Any:
        delta = options.get("return_convergence_delta", False)
        out = self.method.attribute(x.detach().requires_grad_(True), target=target, **options)
        attr, d = out if delta else (out, None)
        if isinstance(attr, tuple):
            (attr,) = attr
        if not self.per_channel:
            if attr.ndim != 4:
                raise RuntimeError(
                    f"{self.name} gave a layer attribution of shape {tuple(attr.shape)}, not (B, C, h, w)"
                )
            cam = reduce_channels(attr, "sum")[:, None].float()
            attr = F.interpolate(cam, size=x.shape[-2:], mode="bilinear", align_corners=False)[:, 0]
        attr = attr.detach()
        return (attr, d) if delta else attr
