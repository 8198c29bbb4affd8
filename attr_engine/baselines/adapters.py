"""Adapters that let Quantus and Captum call any :class:`~attr_engine.baselines.Explainer`."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from attr_engine.baselines.base import Explainer

__all__ = ["CaptumAdapter", "quantus_explain_func"]


def _check_explainer(explainer: object) -> Explainer:
    if not isinstance(explainer, Explainer):
        raise ValueError(f"expected an attr_engine Explainer, got {type(explainer).__name__}")
    return explainer


def quantus_explain_func(explainer: Explainer) -> Any:
    """A Quantus ``explain_func``: ``f(model, inputs, targets, **kwargs) -> (B, 1, H, W)`` float32 numpy maps.

    Quantus passes its own (unwrapped) model; the explainer keeps explaining the classifier it is bound to, which
    must be the model handed to the Quantus metric. Extra keyword arguments from Quantus (``device``, ...) are
    ignored: the explainer runs on its classifier's device.

    Example:
        >>> metric(model=clf, x_batch=x, y_batch=y, a_batch=a, explain_func=quantus_explain_func(sal))  # doctest: +SKIP
    """
    explainer = _check_explainer(explainer)

    def explain_func(model: Any = None, inputs: Any = None, targets: Any = None, **_: Any) -> np.ndarray:
        x = torch.as_tensor(np.asarray(inputs), dtype=torch.float32, device=explainer.device)
        target = None if targets is None else torch.as_tensor(np.asarray(targets), device=explainer.device).long()
        return explainer.attribute(x, target).unsqueeze(1).cpu().numpy()

    return explain_func


class CaptumAdapter:
    """A Captum-style attribution object around an :class:`Explainer`.

    ``attribute(inputs, target=None)`` returns (B, 1, H, W) maps (broadcastable against the inputs, as Captum's
    metrics expect); given a one-tensor tuple - as Captum's ``sensitivity_max`` passes - it returns a one-tensor
    tuple. So ``captum.metrics.sensitivity_max(adapter.attribute, x, target=y)`` and
    ``captum.metrics.infidelity(adapter.forward_func, perturb, x, adapter.attribute(x, y), target=y)`` work.

    Attributes:
        forward_func: the explained classifier.
        multiplies_by_inputs: False: maps are local (infidelity perturbations should not be scaled by the input).
    """

    multiplies_by_inputs = False

    def __init__(self, explainer: Explainer) -> None:
        self.explainer = _check_explainer(explainer)
        self.forward_func = explainer.classifier

    def attribute(
        self, inputs: torch.Tensor | tuple[torch.Tensor, ...], target: Any = None, **kwargs: Any
    ) -> torch.Tensor | tuple[torch.Tensor]:
        if kwargs:
            raise ValueError(f"{self.explainer.name} takes no extra attribute arguments, got {sorted(kwargs)}")
        as_tuple = isinstance(inputs, tuple)
        if as_tuple:
            if len(inputs) != 1:
                raise ValueError(f"image explainers take one input tensor, got a tuple of {len(inputs)}")
            inputs = inputs[0]
        maps = self.explainer.attribute(inputs, target).unsqueeze(1)
        return (maps,) if as_tuple else maps

    def has_convergence_delta(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"CaptumAdapter({self.explainer!r})"
