"""AHA (Amortized Hybrid Attribution): an explainer trained once per classifier by optimising soft deletion and
insertion AUC through a Gumbel-Sinkhorn soft ranking; then one forward pass per image.

Modules: ``config`` (AHAConfig), ``network`` (backbone + class-conditioned decoder), ``loss`` (soft AUC),
``trainer`` (the training loop), ``persistence`` (checkpoint files), ``model`` (:class:`AHA`, the Explainer;
importing it registers ``"aha"`` with :func:`attr_engine.get_explainer`).
"""

from attr_engine.aha.config import AHAConfig
from attr_engine.aha.loss import SoftAUC, soft_auc_loss
from attr_engine.aha.model import AHA

__all__ = ["AHA", "AHAConfig", "SoftAUC", "soft_auc_loss"]
