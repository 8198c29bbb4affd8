"""Evaluation metrics for attribution maps: perturbation curves (deletion / insertion) and localisation against
object masks (pointing game, energy pointing game). Input checks shared by all metrics live in ``_checks``."""

from attr_engine.metrics.localisation import energy_pointing_game, pointing_game
from attr_engine.metrics.perturbation import (
    PROTOCOLS,
    DeletionInsertion,
    deletion_insertion,
    perturbation_counts,
    pixel_ranks,
)

__all__ = [
    "PROTOCOLS",
    "DeletionInsertion",
    "deletion_insertion",
    "energy_pointing_game",
    "perturbation_counts",
    "pixel_ranks",
    "pointing_game",
]
