"""Evaluation metrics for attribution maps, batched on the inputs' device.

- Perturbation curves: deletion / insertion (``perturbation``), positive / negative perturbation AUC and infidelity
  (``faithfulness``).
- Robustness: max-sensitivity (``robustness``); randomisation: random logit (``randomisation``).
- Localisation against object masks: pointing game, energy pointing game, top-k% mask IoU (``localisation``).

Input checks shared by all metrics live in ``_checks`` (pixel maps) and ``_maps`` (Quantus-style maps with channels);
the one perturbation-curve loop behind deletion / insertion, Pos / Neg and infidelity lives in
:mod:`attr_engine.metrics.curves` (public: MDA uses it too).
"""

from attr_engine.metrics.faithfulness import (
    INFIDELITY_BASELINES,
    POS_NEG_FRACTIONS,
    PerturbationAUC,
    infidelity,
    infidelity_from_perturbations,
    patch_grid,
    perturbation_auc,
)
from attr_engine.metrics.localisation import energy_pointing_game, pointing_game, top_k_mask_iou
from attr_engine.metrics.perturbation import (
    PROTOCOLS,
    DeletionInsertion,
    deletion_insertion,
    perturbation_counts,
    pixel_ranks,
)
from attr_engine.metrics.randomisation import (
    SIMILARITIES,
    pearson_similarity,
    random_logit,
    random_other_class,
    ssim_similarity,
)
from attr_engine.metrics.robustness import max_sensitivity

__all__ = [
    "INFIDELITY_BASELINES",
    "POS_NEG_FRACTIONS",
    "PROTOCOLS",
    "SIMILARITIES",
    "DeletionInsertion",
    "PerturbationAUC",
    "deletion_insertion",
    "energy_pointing_game",
    "infidelity",
    "infidelity_from_perturbations",
    "max_sensitivity",
    "patch_grid",
    "pearson_similarity",
    "perturbation_auc",
    "perturbation_counts",
    "pixel_ranks",
    "pointing_game",
    "random_logit",
    "random_other_class",
    "ssim_similarity",
    "top_k_mask_iou",
]
