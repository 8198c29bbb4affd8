"""Reading the attention weights of a ViT's blocks (timm, torchvision, transformers), safely across threads.

timm's attention modules (``Attention``, ``EvaAttention``, DeiT's and BEiT's) compute the softmax weights in the
open only with ``fused_attn`` False; with it True they call ``F.scaled_dot_product_attention`` and the weights
never exist. Every one of them applies ``attn_drop`` to the softmax before ``@ v``, so a forward hook there sees
(and may replace) the weights (B, heads, N, N).

- :func:`unfused_attention` switches ``fused_attn`` off while at least one caller, in any thread, needs the
  weights: a per-module count under a lock, so two overlapping calls on one model cannot restore the flag while
  the other still runs (a plain save-and-restore would leave it False for good, or switch the fused path back on
  under the other call), and the last one out restores what the module had. Another thread running the same model
  meanwhile takes the explicit softmax path: the same values up to rounding.
- :func:`captured_attention` hands each block its softmax weights as a fresh leaf tensor and collects the leaves:
  on timm's modules at ``attn_drop`` (above); torchvision's ``nn.MultiheadAttention`` and transformers'
  ``ViTAttention`` never expose their weights to a hook (fused or scaled-dot-product kernels), so their forward
  hook recomputes the module's output from its inputs, its own projections and the leaf - the attention formula
  those modules compute, written out because no library returns weights the output is then computed from.
- :func:`thread_hooks` registers forward hooks that act only on the calls of the thread that registered them, so a
  thread running the same model meanwhile neither feeds them nor has its outputs replaced. Both come off in
  ``finally``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["attention_modules", "captured_attention", "thread_hooks", "unfused_attention"]


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


@contextmanager
def captured_attention(kind: str, attns: Sequence[nn.Module]) -> Iterator[list[torch.Tensor]]:
    """The softmax weights (B, heads, N, N) of ``attns`` in this thread's forward passes, as leaves that require
    grad, in call order; each module's output is computed from its leaf, so the gradient of anything downstream
    w.r.t. a leaf is the gradient w.r.t. that block's attention weights.

    Args:
        kind: ``"timm"`` (timm attention with ``attn_drop``), ``"mha"`` (``nn.MultiheadAttention`` called as
            ``(x, x, x)``, as torchvision's encoder does) or ``"transformers"`` (``ViTAttention``: ``q_proj`` ...
            ``o_proj``, ``head_dim``, ``scaling``).
    """
    weights: list[torch.Tensor] = []

    def keep(weight: torch.Tensor) -> torch.Tensor:
        leaf = weight.detach().requires_grad_(True)
        weights.append(leaf)
        return leaf

    if kind == "timm":
        drops = [attn.get_submodule("attn_drop") for attn in attns]
        with unfused_attention(attns), thread_hooks(drops, lambda _m, _i, out: keep(out)):
            yield weights
    elif kind == "mha":
        with thread_hooks(attns, lambda module, inputs, _out: _mha_output(module, inputs, keep)):
            yield weights
    elif kind == "transformers":
        with thread_hooks(attns, lambda module, inputs, _out: _transformers_output(module, inputs, keep)):
            yield weights
    else:
        raise ValueError(f"unknown attention kind {kind!r}")


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, N, D) -> (B, heads, N, D / heads)."""
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


def _mha_output(module: Any, inputs: Any, keep: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, None]:
    """``nn.MultiheadAttention(x, x, x)``'s output recomputed with its weights from ``keep`` (no masks, no bias_k)."""
    if len(inputs) != 3 or module.bias_k is not None or module.add_zero_attn or not module._qkv_same_embed_dim:
        raise ValueError("attention weights are read from nn.MultiheadAttention(x, x, x) without masks or bias_k only")
    query, key, value = (t if module.batch_first else t.transpose(0, 1) for t in inputs)
    w_q, w_k, w_v = module.in_proj_weight.chunk(3)
    b_q, b_k, b_v = module.in_proj_bias.chunk(3) if module.in_proj_bias is not None else (None, None, None)
    heads = int(module.num_heads)
    q = _heads(torch.nn.functional.linear(query, w_q, b_q), heads)
    k = _heads(torch.nn.functional.linear(key, w_k, b_k), heads)
    v = _heads(torch.nn.functional.linear(value, w_v, b_v), heads)
    leaf = keep(torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1))
    out = module.out_proj((leaf @ v).transpose(1, 2).flatten(2))
    return (out if module.batch_first else out.transpose(0, 1)), None


def _transformers_output(
    module: Any, inputs: Any, keep: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers ``ViTAttention(hidden_states, attention_mask)``'s output recomputed as its eager path does,
    with the weights from ``keep``."""
    hidden, mask = inputs[0], inputs[1] if len(inputs) > 1 else None
    shape = (*hidden.shape[:-1], -1, module.head_dim)
    q, k, v = (proj(hidden).view(shape).transpose(1, 2) for proj in (module.q_proj, module.k_proj, module.v_proj))
    scores = (q @ k.transpose(2, 3)) * module.scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    leaf = keep(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype))
    out = module.o_proj((leaf @ v).transpose(1, 2).reshape(*hidden.shape[:-1], -1).contiguous())
    return out, leaf
