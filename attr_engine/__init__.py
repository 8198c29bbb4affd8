"""attr-engine: pixel-level attribution for image classifiers (AHA and Semantic Pullback).

The public API:

- :class:`Classifier`, :func:`load_classifier`, :func:`train_classifier` - the frozen classifier adapter.
- :class:`AHA`, :class:`AHAConfig` - the amortized explainer.
- :class:`SemanticPullback`, :class:`PullbackConfig`, :func:`soft_adjoint` - soft-adjoint pullbacks on any model.
- :mod:`attr_engine.metrics` - deletion/insertion, localisation, infidelity, sensitivity and randomisation metrics.
- :class:`Explainer`, :func:`get_explainer` / :func:`list_explainers` / :func:`register_explainer` - every method
  (AHA, the pullbacks, the baselines, plugins) behind one protocol with Captum's call shape;
  :func:`quantus_explain_func` / :class:`CaptumAdapter` - any of them as a Quantus ``explain_func`` or a Captum
  attribution object.
- :func:`evaluate` - a leaderboard of methods x metrics.
- :mod:`attr_engine.data` - the embedded procedural dataset and an image-folder loader.
- :func:`preprocess`, :func:`to_image_frame`, :func:`data_config` - the classifier's own resize and crop, and maps
  drawn back on the original image (the cropped-away border NaN).

The names are imported on first use (PEP 562), so ``import attr_engine`` - and ``attr-engine --help`` - costs
nothing until torch is actually needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "AHA": "attr_engine.aha",
    "AHAConfig": "attr_engine.aha",
    "Explainer": "attr_engine.explainer",
    "get_explainer": "attr_engine.explainer",
    "list_explainers": "attr_engine.explainer",
    "register_explainer": "attr_engine.explainer",
    "CaptumAdapter": "attr_engine.adapters",
    "quantus_explain_func": "attr_engine.adapters",
    "Classifier": "attr_engine.classifier",
    "load_classifier": "attr_engine.classifier",
    "Leaderboard": "attr_engine.evaluate",
    "evaluate": "attr_engine.evaluate",
    "DeletionInsertion": "attr_engine.metrics",
    "deletion_insertion": "attr_engine.metrics",
    "energy_pointing_game": "attr_engine.metrics",
    "pointing_game": "attr_engine.metrics",
    "PullbackConfig": "attr_engine.pullback",
    "SemanticPullback": "attr_engine.pullback",
    "SoftAdjoint": "attr_engine.pullback",
    "default_alpha": "attr_engine.pullback",
    "soft_adjoint": "attr_engine.pullback",
    "train_classifier": "attr_engine.classifier_training",
    "DataConfig": "attr_engine.imageops",
    "data_config": "attr_engine.imageops",
    "preprocess": "attr_engine.imageops",
    "to_image_frame": "attr_engine.imageops",
}

# A literal list, so linters and type checkers see the names the TYPE_CHECKING block imports.
__all__ = [
    "AHA",
    "AHAConfig",
    "CaptumAdapter",
    "Classifier",
    "DataConfig",
    "DeletionInsertion",
    "Explainer",
    "Leaderboard",
    "PullbackConfig",
    "SemanticPullback",
    "SoftAdjoint",
    "__version__",
    "data_config",
    "default_alpha",
    "deletion_insertion",
    "energy_pointing_game",
    "evaluate",
    "get_explainer",
    "list_explainers",
    "load_classifier",
    "pointing_game",
    "preprocess",
    "quantus_explain_func",
    "register_explainer",
    "soft_adjoint",
    "to_image_frame",
    "train_classifier",
]

if TYPE_CHECKING:
    from attr_engine.adapters import CaptumAdapter, quantus_explain_func
    from attr_engine.aha import AHA, AHAConfig
    from attr_engine.classifier import Classifier, load_classifier
    from attr_engine.classifier_training import train_classifier
    from attr_engine.evaluate import Leaderboard, evaluate
    from attr_engine.explainer import Explainer, get_explainer, list_explainers, register_explainer
    from attr_engine.imageops import DataConfig, data_config, preprocess, to_image_frame
    from attr_engine.metrics import DeletionInsertion, deletion_insertion, energy_pointing_game, pointing_game
    from attr_engine.pullback import PullbackConfig, SemanticPullback, SoftAdjoint, default_alpha, soft_adjoint


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        # `import attr_engine; attr_engine.metrics.pointing_game(...)` worked when everything was imported eagerly.
        try:
            return importlib.import_module(f"attr_engine.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"attr_engine.{name}":
                raise
            raise AttributeError(f"module 'attr_engine' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
