"""pytorch-grad-cam (PyPI ``grad-cam``), imported on demand: it is the ``cam`` extra, not a core dependency."""

from __future__ import annotations

from typing import Any

from attr_engine._optional import optional_import

__all__ = ["import_grad_cam"]


def import_grad_cam() -> Any:
    """The ``pytorch_grad_cam`` package, or a clear error naming the extra that installs it."""
    return optional_import(
        "pytorch_grad_cam",
        "the gradcam:<Class> methods run through pytorch-grad-cam, which is not installed; "
        "pip install 'attr-engine[cam]' (or pip install grad-cam)",
        "base_cam",
        "utils.model_targets",
    )
