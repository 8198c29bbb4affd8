"""AHA (Amortized Hybrid Attribution): an explainer trained once per classifier by optimising soft deletion and
insertion AUC through a Gumbel-Sinkhorn soft ranking; then one forward pass per image."""

from attr_engine.aha.config import AHAConfig
from attr_engine.aha.loss import SoftAUC, soft_auc_loss
from attr_engine.aha.model import AHA

__all__ = ["AHA", "AHAConfig", "SoftAUC", "soft_auc_loss"]
