"""Any Captum attribution class as an :class:`~attr_engine.baselines.Explainer`: ``captum:<ClassName>``.

``get_explainer("captum:DeepLift", clf)`` (and ``attr-engine explain --method captum:DeepLift``) builds
``captum.attr.DeepLift(clf)`` and calls its ``attribute`` with the options given, Captum's names unchanged: those of
the class's constructor (``multiply_by_inputs``, ``eps``, ...) go to the constructor, the rest to every
``attribute`` call (``n_samples``, ``sliding_window_shapes``, ``interpolate_mode``, ...), and a call may override
those. ``layer`` - for classes that take one - is a module or its name in the model (``"layer4"``,
``"stages.3"``); by default the last feature stage of a timm or torchvision CNN
(:func:`~attr_engine.baselines.cam.cnn_stage`).

Option values take the types of Captum's signature (a list where it wants a tuple - YAML and JSON have no tuples -
an int where it wants a float; a string for a bool is refused), and when the method is built they also go through
Captum's own argument checks, on a probe that stops before the model would run: ``n_steps=-3`` or a window larger
than the image is one ValueError naming the option then, not an AssertionError from inside Captum mid-run.

Attributions to the input are per-channel (``reduce=None`` gives them; the default map is their channel sum, as the
attributions of additive methods add up). Layer attributions (``Layer*`` classes, e.g. ``LayerGradCam``) are summed
over the layer's channels and upsampled bilinearly to the input, as Grad-CAM is.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attr_engine.baselines._captum import import_captum
from attr_engine.baselines.cam import cnn_stage, find_layer, layer_name
from attr_engine.explainer import Explainer, coerce_option, option_type, reduce_channels, resolve_baselines

__all__ = ["CaptumMethod", "captum_class"]

_REQUIRED: Any = inspect.Parameter.empty
# attribute() parameters the Explainer call shape supplies itself.
_SUPPLIED = {"self", "inputs", "target", "baselines", "return_convergence_delta", "additional_forward_args"}
# The words of Captum's DeepLift error for a module called more than once in the forward pass.
_REUSED_MODULE = "does not contain some of the input/output attributes"
# What Captum raises on arguments it does not accept (its checks are mostly asserts) before it runs the model.
_ARGUMENT_ERRORS = (AssertionError, TypeError, ValueError, IndexError, RuntimeError)


def _annotations(fn: Callable[..., Any]) -> dict[str, Any]:
    """The parameter annotations of ``fn``, resolved where they can be (Captum annotates with ``typing``)."""
    try:
        return typing.get_type_hints(fn)
    except Exception:  # a forward reference that does not resolve: the raw annotations (strings are unchecked)
        return {n: p.annotation for n, p in inspect.signature(fn).parameters.items()}


class _ProbeReached(BaseException):
    """Raised by :class:`_ProbeModel` when Captum first runs the model: its argument checks are behind it.

    A BaseException, so no ``except Exception`` on Captum's side can mistake it for a failure of its own.
    """


class _ProbeModel(nn.Module):
    """The classifier (as a child, so layers and hooks are found where they are) under a forward that stops."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _ProbeReached


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
        init_types = _annotations(cls.__init__)
        self._init_kwargs = {
            k: coerce_option(self.name, k, options.pop(k), init_types.get(k, option_type(init[k].default)))
            for k in list(options)
            if k in init and k not in ("self", "layer")
        }
        # Per instance here: the options and their types are read from this Captum class's signature.
        self.options = {  # type: ignore[misc]
            n: p.default
            for n, p in call.items()
            if n not in _SUPPLIED and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        }
        call_types = _annotations(cls.attribute)
        self.option_types = {n: call_types[n] for n in self.options if n in call_types}  # type: ignore[misc]
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
            module = find_layer(classifier, layer) if isinstance(layer, str) else layer or cnn_stage(model)
            self._layer_name = layer_name(classifier, module)
        elif layer is not None:
            raise ValueError(f"{self.name} takes no layer")
        self._bind()
        self._probe(options)

    def _captum_instance(self, model: nn.Module) -> Any:
        args: list[Any] = [model]
        if self._layer_name is not None:  # set exactly when the Captum class takes a layer
            args.append(find_layer(self.classifier, self._layer_name))
        return self.captum_cls(*args, **self._init_kwargs)

    def _probe_error(self, options: dict[str, Any]) -> BaseException | None:
        """What Captum raises for one image of the classifier's input size with these options before it would run
        the model (None: it got as far as the model), on a copy bound to a model that stops at its first call."""
        size: tuple[int, ...] = tuple(getattr(self.classifier, "input_size", None) or ())  # _probe checked it
        x = torch.zeros(1, *size, device=self.device)
        kwargs = {k: v for k, v in options.items() if k != "show_progress"}
        if self.takes_baselines:
            given = self.baselines if self.baselines is not None else self.default_baselines
            kwargs["baselines"] = resolve_baselines(given, x, self.classifier)
        target = torch.zeros(1, dtype=torch.long, device=x.device)
        try:
            with torch.enable_grad():
                method = self._captum_instance(_ProbeModel(self.classifier))
                method.attribute(x.requires_grad_(True), target=target, **kwargs)
        except _ProbeReached:
            return None
        except Exception as err:
            # Reached the model after all when a clean-up of Captum's (LRP's) failed on the way out; any other
            # error than an argument check's is not the probe's to judge (the real call reports it).
            reached = err.__context__ is not None and isinstance(err.__context__, _ProbeReached)
            return err if isinstance(err, _ARGUMENT_ERRORS) and not reached else None
        return None

    def _probe(self, given: dict[str, Any]) -> None:
        """Check the options against Captum's own argument checks now, when the method is built, instead of in the
        middle of a run (the CLI then reports a bad ``--option`` in one line before any work starts).

        Captum validates its arguments (asserts, mostly) before it first runs the model, so the probe costs no
        model evaluation. The options are blamed only where Captum accepts the same call with its own defaults in
        their place (or where they hold its required arguments): a class that fails for another reason (DeepLiftShap
        without a baseline distribution) is left to fail, as before, when it is called.
        """
        if not given or getattr(self.classifier, "input_size", None) is None:
            return  # Captum's defaults need no probe; without an input size a window cannot be checked
        err = self._probe_error(self.defaults)
        if err is None:
            return
        has_required = any(v is _REQUIRED for v in self.options.values())
        if not has_required and self._probe_error(dict(self.options)) is not None:
            return  # Captum's own defaults fail the same probe: not the options' fault
        raise ValueError(self._rejected({k: self.defaults[k] for k in given if k in self.defaults}, err)) from err

    def _rejected(self, options: dict[str, Any], err: BaseException) -> str:
        """One line: the method, the options it was given (Captum does not say which one it refuses) and why."""
        message = " ".join(str(err).split()) or type(err).__name__
        if not options:
            return f"{self.name}: {message}"
        return f"{self.name} rejects {', '.join(f'{k}={v!r}' for k, v in options.items())}: {message}"

    def _check_options(self, options: dict[str, Any]) -> None:
        missing = [k for k, v in options.items() if v is _REQUIRED]
        if missing:
            raise ValueError(f"{self.name} needs the option(s) {', '.join(missing)} (Captum's required arguments)")

    def _bind(self) -> None:
        self.method = self._captum_instance(self.classifier)

    @property
    def multiplies_by_inputs(self) -> bool:
        return bool(getattr(self.method, "multiplies_by_inputs", False))

    def _attribute(self, x: torch.Tensor, target: torch.Tensor, **options: Any) -> Any:
        delta = options.get("return_convergence_delta", False)
        try:
            out = self.method.attribute(x.detach().requires_grad_(True), target=target, **options)
        except (AssertionError, TypeError) as err:
            # Captum's argument checks are asserts: one line naming the options, not a traceback from its insides.
            given = {k: v for k, v in options.items() if k in self.options and v is not self.options[k]}
            raise ValueError(self._rejected(given, err)) from err
        except RuntimeError as err:
            if _REUSED_MODULE not in str(err):
                raise
            # DeepLift's rules hook each nonlinearity once per forward pass: a module called twice (torchvision's
            # ResNet blocks call one ReLU module twice) has no single input to compare with its reference.
            raise ValueError(
                f"{self.name} cannot explain {type(getattr(self.classifier, 'model', self.classifier)).__name__}: a "
                "nonlinearity module is used more than once in its forward pass (torchvision's ResNet blocks reuse "
                "their ReLU), and Captum's DeepLift rules need one module per use"
            ) from err
        attr, d = out if delta else (out, None)
        if isinstance(attr, tuple):
            (attr,) = attr
        if not self.per_channel:
            if attr.ndim != 4:
                # The layer the user chose (option layer=...) is not a spatial one: theirs to change.
                raise ValueError(
                    f"{self.name} gave a layer attribution of shape {tuple(attr.shape)}, not (B, C, h, w): choose a "
                    "convolutional layer or stage with the option layer=NAME"
                )
            cam = reduce_channels(attr, "sum")[:, None].float()
            attr = F.interpolate(cam, size=x.shape[-2:], mode="bilinear", align_corners=False)[:, 0]
        attr = attr.detach()
        return (attr, d) if delta else attr
