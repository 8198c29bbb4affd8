"""attr-engine: pixel-level attribution for image classifiers (AHA and Semantic Pullback)."""

__version__ = "0.1.0"

__all__ = ["__version__"]
