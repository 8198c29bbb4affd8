"""Where a plain ViT keeps what the token methods read, for the three families attr-engine runs: timm, torchvision
and transformers. Grad-CAM (the project's and pytorch-grad-cam's), LeGrad and their reshape of tokens onto the patch
grid all read one :class:`ViTLayout` instead of each knowing the three layouts.

| | timm ``VisionTransformer`` & co. | torchvision ``VisionTransformer`` | transformers ``ViTForImageClassification`` |
|---|---|---|---|
| blocks | ``blocks`` | ``encoder.layers`` | ``vit.layers`` (``hf.base_model.layers``) |
| prefix tokens | ``num_prefix_tokens`` | 1 (class token) | class (+ distillation, register) tokens |
| patch grid | ``patch_embed`` (dynamic size too) | ``(H, W) // patch_size`` | ``(H, W) // config.patch_size`` |
| CAM layer | ``blocks[-1].norm1`` | ``encoder.layers[-1].ln_1`` | ``vit.layers[-1].layernorm_before`` |
| logits of tokens z | ``forward_head(norm(z))`` | ``heads(encoder.ln(z)[:, 0])`` | ``classifier(layernorm(z)[:, 0])`` |
| attention | timm ``Attention`` (``attn_drop``) | ``nn.MultiheadAttention`` | ``ViTAttention`` (q/k/v/o projections) |

The CAM layer is the one pytorch-grad-cam's documentation uses for ViTs (the last block's first LayerNorm). The
logits of a block's tokens are what the model's own final norm, pooling and head make of them, so for the last block
they are the classifier's logits (LeGrad checks this on every call).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attr_engine.baselines._vit_attention import attention_modules
from attr_engine.model_sources import is_hf_classifier, is_torchvision_vit

__all__ = ["ViTLayout", "vit_layout"]


@dataclass(frozen=True)
class ViTLayout:
    """A ViT's parts as the token methods read them.

    Attributes:
        family: ``"timm"``, ``"torchvision"`` or ``"transformers"``.
        blocks: the transformer blocks, each (B, N, D) tokens -> (B, N, D).
        prefix: tokens before the patch tokens (class, distillation, register).
        cam_layer: the last block's first LayerNorm (pytorch-grad-cam's ViT layer).
        attentions: each block's attention module, of the kind ``attention_kind`` names (``"timm"``, ``"mha"``:
            ``nn.MultiheadAttention``, ``"transformers"``: q/k/v/o projections), or None where it is none of these.
        head: (B, N, D) tokens of a block -> (B, K) logits, through the model's final norm, pooling and head.
        grid: (height, width) of the images -> (rows, cols) of the patch grid.
    """

    family: str
    blocks: list[nn.Module]
    prefix: int
    cam_layer: nn.Module
    attentions: list[nn.Module] | None
    attention_kind: str
    head: Callable[[torch.Tensor], torch.Tensor]
    grid: Callable[[int, int], tuple[int, int]]

    def reshape(self, height: int, width: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """pytorch-grad-cam's ``reshape_transform`` for ``height`` x ``width`` images: (B, P + h * w, D) tokens ->
        (B, D, h, w), the P prefix tokens dropped; (B, C, h, w) tensors pass unchanged."""
        prefix = self.prefix
        rows, cols = self.grid(height, width)

        def reshape(tokens: torch.Tensor) -> torch.Tensor:
            if tokens.ndim != 3:
                return tokens
            batch, count, dim = tokens.shape
            if count != prefix + rows * cols:
                raise RuntimeError(f"{count} tokens are not {prefix} prefix tokens and a {rows} x {cols} patch grid")
            return tokens[:, prefix:].reshape(batch, rows, cols, dim).permute(0, 3, 1, 2)

        return reshape


def is_vit(model: nn.Module) -> bool:
    """Whether ``model`` is a timm ViT-style model: a sequence of blocks over patch tokens from ``patch_embed``."""
    return (
        isinstance(getattr(model, "blocks", None), nn.Sequential | nn.ModuleList)
        and hasattr(model, "patch_embed")
        and hasattr(model, "num_prefix_tokens")
    )


def token_grid(model: nn.Module, height: int, width: int) -> tuple[int, int]:
    """The (rows, cols) patch grid of a timm ViT for an input of ``height`` x ``width``."""
    embed: Any = model.patch_embed  # timm's PatchEmbed (grid_size, dynamic_feat_size): not declared on nn.Module
    if getattr(model, "dynamic_img_size", False) and hasattr(embed, "dynamic_feat_size"):
        rows, cols = embed.dynamic_feat_size((height, width))
    else:
        rows, cols = embed.grid_size
    return int(rows), int(cols)


def _patch_grid(patch: int) -> Callable[[int, int], tuple[int, int]]:
    """A stride-``patch`` patch embedding's grid: the patches that fit (torchvision's and transformers' conv)."""
    return lambda height, width: (int(height) // patch, int(width) // patch)


def _timm(model: Any) -> ViTLayout | None:
    if not is_vit(model) or len(model.blocks) == 0 or not hasattr(model.blocks[-1], "norm1"):
        return None
    try:
        attns: list[nn.Module] | None = attention_modules(model)
    except ValueError:
        attns = None
    forward_head, norm = getattr(model, "forward_head", None), getattr(model, "norm", None)
    if not callable(forward_head) or not isinstance(norm, nn.Module):
        attns = None  # no head to score a block's tokens with: nothing LeGrad can read
    return ViTLayout(
        family="timm",
        blocks=list(model.blocks),
        prefix=int(model.num_prefix_tokens),
        cam_layer=model.blocks[-1].norm1,
        attentions=attns,
        attention_kind="timm",
        head=lambda z: model.forward_head(model.norm(z)),
        grid=lambda height, width: token_grid(model, height, width),
    )


def _torchvision(model: Any) -> ViTLayout | None:
    if not is_torchvision_vit(model):
        return None
    blocks = list(model.encoder.layers)
    attns: list[Any] = [getattr(b, "self_attention", None) for b in blocks]
    return ViTLayout(
        family="torchvision",
        blocks=blocks,
        prefix=1,
        cam_layer=blocks[-1].ln_1,
        attentions=attns if all(isinstance(a, nn.MultiheadAttention) for a in attns) else None,
        attention_kind="mha",
        head=lambda z: model.heads(model.encoder.ln(z)[:, 0]),
        grid=_patch_grid(int(model.patch_size)),
    )


def _transformers(adapter: Any) -> ViTLayout | None:
    """A transformers ViT-style classifier (ViT, DeiT, ...: ``layers`` of ``layernorm_before`` / ``attention``
    blocks, a ``layernorm`` and a ``classifier`` on the class token) inside :class:`HFImageClassifier`."""
    if not is_hf_classifier(adapter):
        return None
    hf = adapter.hf
    base: Any = getattr(hf, "base_model", None)  # transformers' modules: attributes nn.Module does not declare
    layers: Any = getattr(base, "layers", None)  # nn.ModuleList of ViTLayer (checked below)
    embeddings = getattr(base, "embeddings", None)
    patch = getattr(hf.config, "patch_size", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0 or not isinstance(patch, int):
        return None
    if not all(hasattr(b, "layernorm_before") and hasattr(b, "attention") for b in layers):
        return None
    prefix = sum(
        int(t.shape[1])
        for t in (getattr(embeddings, n, None) for n in ("cls_token", "distillation_token", "register_tokens"))
        if isinstance(t, torch.Tensor)
    )
    attns: list[Any] = [b.attention for b in layers]
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
    readable = all(all(hasattr(a, p) for p in projections) for a in attns)
    # A head on the class token after a final LayerNorm (ViT, DeiT): else no block's tokens can be scored.
    scorable = isinstance(getattr(hf, "classifier", None), nn.Module) and isinstance(
        getattr(base, "layernorm", None), nn.Module
    )
    head: Callable[[torch.Tensor], torch.Tensor] = lambda z: hf.classifier(base.layernorm(z)[:, 0])
    last: Any = layers[-1]
    return ViTLayout(
        family="transformers",
        blocks=list(layers),
        prefix=prefix,
        cam_layer=last.layernorm_before,
        attentions=attns if readable and scorable else None,
        attention_kind="transformers",
        head=head,
        grid=_patch_grid(patch),
    )


def vit_layout(model: nn.Module) -> ViTLayout | None:
    """The :class:`ViTLayout` of a timm, torchvision or transformers ViT (``Classifier.model``), else None."""
    for read in (_timm, _torchvision, _transformers):
        layout = read(model)
        if layout is not None:
            return layout
    return None
