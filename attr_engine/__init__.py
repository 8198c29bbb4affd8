"""attr-engine: pixel-level attribution for image classifiers (AHA and Semantic Pullback)."""

__version__ = "0.1.0"

from attr_engine.classifier import Classifier, load_classifier
from attr_engine.train import train_classifier

__all__ = ["Classifier", "__version__", "load_classifier", "train_classifier"]
