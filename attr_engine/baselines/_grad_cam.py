"""pytorch-grad-cam (PyPI ``grad-cam``), imported on demand: it is the ``cam`` extra, not a core dependency."""

from __future__ import annotations

from typing import Any

__all__ = ["import_grad_cam"]


def import_grad_cam() -> Any:
    """The ``pytorch_grad_cam`` package, or a clear error naming the extra that installs it."""
    try:
        import pytorch_grad_cam
        import pytorch_grad_cam.base_cam
        import pytorch_grad_cam.utils.model_targets
    except ImportError as err:  # pragma: no cover - exercised only without the extra installed
        raise ImportError(
            "the gradcam:<Class> methods run through pytorch-grad-cam, which is not installed; "
            "pip install 'attr-engine[cam]' (or pip install grad-cam)"
        ) from err
    return pytorch_grad_cam
