"""Captum, imported on demand: it is an evaluation extra, not a core dependency."""

from __future__ import annotations

from typing import Any

from attr_engine._optional import optional_import

__all__ = ["import_captum"]


def import_captum() -> Any:
    """``captum.attr``, or a clear error: Captum is an evaluation extra, not a core dependency."""
    return optional_import(
        "captum.attr", "this baseline runs through Captum, which is not installed; pip install 'attr-engine[eval]'"
    )
