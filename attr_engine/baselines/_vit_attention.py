"""Reading the attention weights of a timm ViT's blocks, safely across threads.

timm's attention modules (``Attention``, ``EvaAttention``, DeiT's and BEiT's) compute the softmax weights in the
open only with ``fused_attn`` False; with it True they call ``F.scaled_dot_product_attention`` and the weights
never exist. Every one of them applies ``attn_drop`` to the softmax before ``@ v``, so a forward hook there sees
(and may replace) the weights (B, heads, N, N).

- :func:`unfused_attention` switches ``fused_attn`` off while at least one caller, in any thread, needs the
  weights: a per-module count under a lock, so two overlapping calls on one model cannot restore the flag while
  the other still runs (a plain save-and-restore would leave it False for good, or switch the fused path back on
  under the other call), and the last one out restores what the module had. Another thread running the same model
  meanwhile takes the explicit softmax path: the same values up to rounding.
- :func:`thread_hooks` registers forward hooks that act only on the calls of the thread that registered them, so a
  thread running the same model meanwhile neither feeds them nor has its outputs replaced. Both come off in
  ``finally``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

__all__ = ["attention_modules", "thread_hooks", "unfused_attention"]


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Each block's attention module (``model.blocks[i].attn``) of a timm ViT.

    Raises:
        ValueError: a block without an ``.attn`` module that applies an ``attn_drop`` layer (timm's attention).
    """
    blocks: Any = getattr(model, "blocks", ())
    attns: list[nn.Module] = []
    for i, block in enumerate(blocks):
        attn = getattr(block, "attn", None)
        if not isinstance(attn, nn.Module) or not isinstance(getattr(attn, "attn_drop", None), nn.Module):
            raise ValueError(
                f"block {i} of {type(model).__name__} needs an .attn module with an attn_drop layer (timm's "
                f"attention), got {type(attn).__name__}"
            )
        attns.append(attn)
    if not attns:
        raise ValueError(f"{type(model).__name__} has no blocks")
    return attns


# id(module) -> [module, its own fused_attn, number of callers inside]. The entry holds the module, so its id
# cannot be reused while the entry exists.
_UNFUSED: dict[int, list[Any]] = {}
_LOCK = threading.Lock()


def _unfuse(attn: Any) -> None:  # timm's attention: fused_attn is not declared on nn.Module
    with _LOCK:
        entry = _UNFUSED.get(id(attn))
        if entry is None:
            entry = _UNFUSED[id(attn)] = [attn, attn.fused_attn, 0]
            attn.fused_attn = False
        entry[2] += 1


def _refuse(attn: Any) -> None:
    with _LOCK:
        entry = _UNFUSED[id(attn)]
        entry[2] -= 1
        if entry[2] == 0:
            del _UNFUSED[id(attn)]
            attn.fused_attn = entry[1]


@contextmanager
def unfused_attention(attns: Sequence[nn.Module]) -> Iterator[None]:
    """``fused_attn = False`` on each of ``attns`` that has the flag, for the duration; the last caller restores it."""
    taken: list[nn.Module] = []
    try:
        for attn in attns:
            if hasattr(attn, "fused_attn") and attn not in taken:
                _unfuse(attn)
                taken.append(attn)
        yield
    finally:
        while taken:
            _refuse(taken.pop())


@contextmanager
def thread_hooks(modules: Sequence[nn.Module], hook: Callable[[nn.Module, Any, Any], Any]) -> Iterator[None]:
    """``hook(module, inputs, output)`` as a forward hook on each of ``modules``, for calls from this thread only.

    What the hook returns replaces the module's output (None keeps it), as for any forward hook.
    """
    owner = threading.get_ident()

    def filtered(module: nn.Module, inputs: Any, output: Any) -> Any:
        return hook(module, inputs, output) if threading.get_ident() == owner else None

    handles = []
    try:
        for module in modules:
            handles.append(module.register_forward_hook(filtered))
        yield
    finally:
        for handle in handles:
            handle.remove()
