"""Optional dependencies, imported on demand: the one place an extra's absence becomes a message naming it."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["optional_import"]


def optional_import(name: str, missing: str, *submodules: str) -> ModuleType:
    """Import and return module ``name`` (and its ``submodules``, which its users reach as attributes).

    Raises:
        ImportError: ``missing``, the message that says which extra installs it, chained to the original error.
    """
    try:
        module = importlib.import_module(name)
        for sub in submodules:
            importlib.import_module(f"{name}.{sub}")
    except ImportError as err:  # pragma: no cover - exercised only without the extra installed
        raise ImportError(missing) from err
    return module
