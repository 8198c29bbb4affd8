"""Captum, imported on demand: it is an evaluation extra, not a core dependency."""

from __future__ import annotations

from typing import Any

__all__ = ["import_captum"]


def import_captum() -> Any:
    """``captum.attr``, or a clear error: Captum is an evaluation extra, not a core dependency."""
    try:
        import captum.attr
    except ImportError as err:  # pragma: no cover - exercised only without the extra installed
        raise ImportError(
            "this baseline runs through Captum, which is not installed; pip install 'attr-engine[eval]'"
        ) from err
    return captum.attr
