"""Options declared once: the method and the function that share a set of options share one signature."""

import inspect

import torch
from torch import nn

from attr_engine.aha import trainer
from attr_engine.aha.model import AHA
from attr_engine.pullback.soft_adjoint import SoftAdjoint, soft_adjoint


def _params(fn: object, drop_first: bool) -> list[inspect.Parameter]:
    params = list(inspect.signature(fn).parameters.values())  # type: ignore[arg-type]
    return params[1:] if drop_first else params


def test_aha_fit_takes_trainer_fit_options() -> None:
    """AHA.fit(data, ...) has trainer.fit(aha, data, ...)'s parameters after ``aha``: names, kinds, defaults, types."""
    assert _params(AHA.fit, drop_first=True) == _params(trainer.fit, drop_first=True)
    assert "val" in inspect.signature(AHA.fit).parameters  # the last option, so the comparison saw them all
    assert AHA.fit.__doc__ == trainer.fit.__doc__


def test_soft_adjoint_takes_soft_adjoint_class_options() -> None:
    assert _params(soft_adjoint, drop_first=False) == _params(SoftAdjoint, drop_first=False)
    assert [p.name for p in _params(soft_adjoint, drop_first=False)][:2] == ["model", "relu_tau"]
    assert soft_adjoint.__name__ == "soft_adjoint" and soft_adjoint.__doc__ == SoftAdjoint.__doc__
    ctx = soft_adjoint(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), relu_tau=0.25)
    assert isinstance(ctx, SoftAdjoint) and ctx.relu_tau == 0.25
    with ctx:
        assert ctx.softened == [("1", "relu")]
    assert torch.is_grad_enabled()
