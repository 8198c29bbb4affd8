"""optional_import: the one place an optional dependency's absence becomes the message naming its extra."""

from __future__ import annotations

import sys

import pytest

from attr_engine._optional import optional_import


def test_a_missing_module_is_the_given_message_chained_to_the_import_error() -> None:
    with pytest.raises(ImportError, match=r"^needs nothere: pip install 'attr-engine\[x\]'$") as info:
        optional_import("attr_engine_not_a_module", "needs nothere: pip install 'attr-engine[x]'")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_submodules_are_imported_with_the_module(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "email.mime.text", raising=False)
    email = optional_import("email", "unused", "mime.text")
    assert email.__name__ == "email" and "email.mime.text" in sys.modules


def test_a_missing_submodule_is_the_message_too() -> None:
    with pytest.raises(ImportError, match="the extra"):
        optional_import("email", "the extra", "not_a_submodule")
