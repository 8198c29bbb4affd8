"""Adapters that let Quantus and Captum call any :class:`~attr_engine.explainer.Explainer`.

- :func:`quantus_explain_func` gives Quantus' ``explain_func(model, inputs, targets, **kwargs) -> np.ndarray``; it
  explains with the *model Quantus passes in* (so MPRT's randomised copies change the maps) and honours
  ``explain_func_kwargs``.
- :class:`CaptumAdapter` gives input-shaped attributions, so ``captum.metrics.infidelity`` / ``sensitivity_max`` and
  ``captum.attr.visualization`` take them as they take Captum's own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from attr_engine.classifier import Classifier
from attr_engine.explainer import (
    PERTURBATION_ALLOWANCE,
    REDUCE_UNSET,
    Explainer,
    get_explainer,
    image_range_check,
    reduce_channels,
)

__all__ = ["CaptumAdapter", "as_classifier", "quantus_explain_func"]


def _check_explainer(explainer: object) -> Explainer:
    if not isinstance(explainer, Explainer):
        raise ValueError(f"expected an attr_engine Explainer, got {type(explainer).__name__}")
    return explainer


def as_classifier(model: nn.Module) -> Classifier:
    """``model`` if it is a :class:`Classifier`, else a Classifier that feeds it its inputs unchanged.

    A plain module (what Quantus holds when it was handed ``clf.model``) gets an identity normalisation: Quantus
    calls that module on its ``x_batch`` directly, so the explanation must see the same inputs. Note that a
    Classifier freezes the module in place (eval mode, no parameter gradients).
    """
    if isinstance(model, Classifier):
        return model
    if not isinstance(model, nn.Module):
        raise ValueError(f"Quantus passed a {type(model).__name__}; attr-engine explains torch modules")
    return Classifier(model, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))


def quantus_explain_func(method: Explainer | str, **options: Any) -> Any:
    """A Quantus ``explain_func``: ``f(model, inputs, targets, **kwargs) -> np.ndarray``.

    Each call explains with ``model``, the model Quantus passes (a :class:`~attr_engine.classifier.Classifier` with
    ``x_batch`` in [0, 1], or a plain module fed ``inputs`` unchanged): an :class:`Explainer` is rebound to it
    (:meth:`Explainer.rebind`), a registry name is built for it with ``options`` as constructor arguments. Keyword
    arguments (``options``, then Quantus' ``explain_func_kwargs``, which win) are the method's per-call options plus
    ``reduce`` (None: (B, C, H, W) per-channel attributions); Quantus' ``device`` is ignored. Quantus explains noisy
    copies of the images (MaxSensitivity's noise reaches 1.2), so the range check allows
    :data:`~attr_engine.explainer.PERTURBATION_ALLOWANCE` beyond [0, 1]: 0..255 and normalised images still warn.

    Returns:
        float32 numpy attributions, (B, 1, H, W) maps or (B, C, H, W) with ``reduce=None``.

    Example:
        >>> import quantus, torch
        >>> from attr_engine import Classifier, quantus_explain_func
        >>> from attr_engine import get_explainer
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3))
        >>> clf = Classifier(net, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), input_size=(3, 8, 8))
        >>> x = torch.rand(2, 3, 8, 8); y = clf(x).argmax(1)
        >>> f = quantus_explain_func(get_explainer("saliency", clf))
        >>> f(clf, x.numpy(), y.numpy()).shape
        (2, 1, 8, 8)
        >>> metric = quantus.MaxSensitivity(nr_samples=2, disable_warnings=True)
        >>> len(metric(model=clf, x_batch=x.numpy(), y_batch=y.numpy(), explain_func=f, device="cpu"))
        2
    """
    if isinstance(method, str):
        name = method
        explainer: Explainer | None = None
    else:
        explainer = _check_explainer(method)
        name = explainer.name
    defaults = {} if explainer is None else dict(options)

    def explain_func(model: Any = None, inputs: Any = None, targets: Any = None, **kwargs: Any) -> np.ndarray:
        kwargs.pop("device", None)  # Quantus adds it; the model's own device is the one that works
        if model is None:
            if explainer is None:
                raise ValueError(f"explain_func for {name!r} needs the model Quantus passes")
            model = explainer.classifier
        classifier = as_classifier(model)
        bound = explainer.rebind(classifier) if explainer is not None else get_explainer(name, classifier, **options)
        call = {**defaults, **kwargs}
        reduce = call.pop("reduce", REDUCE_UNSET)
        device = bound.device
        x = torch.as_tensor(np.asarray(inputs), dtype=torch.float32, device=device)
        target = None if targets is None else torch.as_tensor(np.asarray(targets), device=device).long()
        if target is not None and target.ndim == 0:
            target = target.expand(x.shape[0])
        if not (reduce is REDUCE_UNSET or bound.per_channel):
            raise ValueError(f"{bound.name} gives one value per pixel: it takes no reduce argument")
        with image_range_check(PERTURBATION_ALLOWANCE):
            maps = bound.attribute(x, target, reduce=reduce, keepdim=True, **call)
        return maps.cpu().numpy().astype(np.float32, copy=False)

    explain_func.__name__ = f"quantus_explain_func[{name}]"
    return explain_func


class CaptumAdapter:
    """A Captum attribution object around an :class:`Explainer`: input-shaped attributions.

    ``attribute(inputs, target=None, baselines=None, **options)`` returns (B, C, H, W) like the inputs: the method's
    per-channel attribution where it has one (Saliency, Integrated Gradients, the pullbacks, ``captum:...``),
    otherwise its (B, H, W) map repeated over the channels; ``reduce=`` at construction picks a reduction instead,
    repeated the same way. Given a one-tensor tuple - as ``captum.metrics.sensitivity_max`` passes - it returns a
    one-tensor tuple. ``return_convergence_delta`` is passed through for methods that have one.

    Attributes:
        forward_func: the explained classifier.
        multiplies_by_inputs: whether the attributions are global (IG, gradient x input, DeepLift): pass it to
            ``captum.metrics.infidelity_perturb_func_decorator`` as Captum's own methods do.

    Example:
        >>> import torch
        >>> from captum.metrics import infidelity, sensitivity_max
        >>> from attr_engine import Classifier
        >>> from attr_engine import CaptumAdapter, get_explainer
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3))
        >>> clf = Classifier(net, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), input_size=(3, 8, 8))
        >>> x = torch.rand(2, 3, 8, 8); y = clf(x).argmax(1)
        >>> ad = CaptumAdapter(get_explainer("saliency", clf))
        >>> ad.attribute(x, y).shape
        torch.Size([2, 3, 8, 8])
        >>> def perturb(inputs):
        ...     noise = 0.01 * torch.randn_like(inputs)
        ...     return noise, inputs - noise
        >>> infidelity(ad.forward_func, perturb, x, ad.attribute(x, y), target=y).shape
        torch.Size([2])
        >>> sensitivity_max(ad.attribute, x, target=y, n_perturb_samples=2).shape
        torch.Size([2])
        >>> from captum.attr import visualization
        >>> fig, ax = visualization.visualize_image_attr(
        ...     ad.attribute(x, y)[0].permute(1, 2, 0).numpy(), x[0].permute(1, 2, 0).numpy(), use_pyplot=False)
    """

    def __init__(self, explainer: Explainer, *, reduce: str | None = None) -> None:
        self.explainer = _check_explainer(explainer)
        self.forward_func = explainer.classifier
        self.reduce = reduce
        self.multiplies_by_inputs = bool(getattr(explainer, "multiplies_by_inputs", False))

    def attribute(
        self,
        inputs: torch.Tensor | tuple[torch.Tensor, ...],
        target: Any = None,
        baselines: Any = None,
        **options: Any,
    ) -> Any:
        as_tuple = isinstance(inputs, tuple)
        if isinstance(inputs, tuple):
            if len(inputs) != 1:
                raise ValueError(f"image explainers take one input tensor, got a tuple of {len(inputs)}")
            x = inputs[0]
        else:
            x = inputs
        if isinstance(baselines, tuple) and len(baselines) == 1:
            baselines = baselines[0]
        delta = bool(options.pop("return_convergence_delta", False))
        per_channel = self.explainer.per_channel
        out = self.explainer.attribute(
            x,
            target,
            baselines,
            reduce=None if per_channel else REDUCE_UNSET,
            return_convergence_delta=delta,
            **options,
        )
        attr, d = out if isinstance(out, tuple) else (out, None)  # a tuple exactly when delta was asked for
        if per_channel and self.reduce is not None:
            attr = reduce_channels(attr, self.reduce, x.to(attr.dtype), None)
        if attr.ndim == 3:
            attr = attr.unsqueeze(1).expand(-1, x.shape[1], -1, -1).contiguous()
        result = (attr,) if as_tuple else attr  # Captum's convention: the structure of the inputs
        return (result, d) if delta else result

    def has_convergence_delta(self) -> bool:
        return self.explainer.has_convergence_delta

    def __repr__(self) -> str:
        return f"CaptumAdapter({self.explainer!r})"
