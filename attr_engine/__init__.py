"""attr-engine: pixel-level attribution for image classifiers (AHA and Semantic Pullback).

The public API:

- :class:`Classifier`, :func:`load_classifier`, :func:`train_classifier` - the frozen classifier adapter.
- :class:`AHA`, :class:`AHAConfig` - the amortized explainer.
- :class:`SemanticPullback`, :class:`PullbackConfig`, :func:`soft_adjoint` - soft-adjoint pullbacks on any model.
- :mod:`attr_engine.metrics` - deletion/insertion, localisation, infidelity, sensitivity and randomisation metrics.
- :func:`get_explainer` / :func:`list_explainers` - baselines and our methods behind one call shape.
- :func:`evaluate` - a leaderboard of methods x metrics.
- :mod:`attr_engine.data` - the embedded procedural dataset and an image-folder loader.
"""

__version__ = "0.1.0"

from attr_engine.aha import AHA, AHAConfig
from attr_engine.baselines import get_explainer, list_explainers
from attr_engine.classifier import Classifier, load_classifier
from attr_engine.evaluate import Leaderboard, evaluate
from attr_engine.metrics import DeletionInsertion, deletion_insertion, energy_pointing_game, pointing_game
from attr_engine.pullback import PullbackConfig, SemanticPullback, SoftAdjoint, default_alpha, soft_adjoint
from attr_engine.train import train_classifier

__all__ = [
    "AHA",
    "AHAConfig",
    "Classifier",
    "DeletionInsertion",
    "Leaderboard",
    "PullbackConfig",
    "SemanticPullback",
    "SoftAdjoint",
    "__version__",
    "default_alpha",
    "deletion_insertion",
    "energy_pointing_game",
    "evaluate",
    "get_explainer",
    "list_explainers",
    "load_classifier",
    "pointing_game",
    "soft_adjoint",
    "train_classifier",
]
