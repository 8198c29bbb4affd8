"""LeGrad (Bousselham et al., ICCV 2025, arXiv 2404.03214) for ViTs (timm, torchvision, transformers); neither Captum
nor pytorch-grad-cam has it.

For each block l from ``layer_index`` on, the score of the target class as if the network ended at block l,

    s^l = head(z^l)[target]      z^l: (B, N, D) the tokens block l puts out,

where ``head`` is the model's own final norm, pooling and classifier (timm ``forward_head(norm(z))``, torchvision
``heads(encoder.ln(z)[:, 0])``, transformers ``classifier(layernorm(z)[:, 0])``;
:func:`~attr_engine.baselines._vit.vit_layout`),

is differentiated w.r.t. that block's attention weights A^l (B, heads, N, N). The gradient is rectified, averaged
over the heads and over all N query rows (prefix tokens included), and its columns of the patch tokens (the
class / distillation / register tokens dropped) are block l's map on the patch grid:

    E^l = mean_{h, i} relu(d s^l / d A^l_{h, i, prefix:}),   map = minmax(upsample(sum_l E^l)).

The maps of the blocks are summed, upsampled bilinearly to the image (``align_corners=False``) and min-max
normalised per image to [0, 1]. This is the official ``LeWrapper.compute_legrad_clip`` (legrad-torch 1.1), with
``layer_index=-2`` (the last two blocks) as its default; ``tests/test_legrad.py`` checks the maps against it on an
open_clip ViT ported to timm. The score s^l goes through the model's own norm, pooling and head, so s^L is the
classifier's logit (checked on every call); the official CLIP path mean-pools every layer's tokens instead
(docs/deviations.md lists this and the other differences).

Hooks read the weights for this thread's calls only
(:func:`~attr_engine.baselines._vit_attention.captured_attention`; timm through ``attn_drop`` with the fused kernel
off, torchvision and transformers by recomputing the module's output from its weights) and come off in ``finally``.
Each block gets its weights as a fresh leaf, whose gradient is d s^l / d A^l. ``tests/test_legrad.py`` checks the
torchvision and transformers paths against the timm one on a timm ViT given the same weights.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from attr_engine.baselines._vit import ViTLayout, vit_layout
from attr_engine.baselines._vit_attention import captured_attention, thread_hooks
from attr_engine.explainer import Explainer

__all__ = ["LeGrad", "legrad_applies"]


def legrad_applies(model: nn.Module) -> bool:
    """Whether LeGrad fits ``model``: a timm, torchvision or transformers ViT whose blocks' attention weights can be
    read and whose final norm and head turn block tokens into logits
    (:func:`~attr_engine.baselines._vit.vit_layout`)."""
    layout = vit_layout(model)
    return layout is not None and layout.attentions is not None


class LeGrad(Explainer):
    """LeGrad maps (B, H, W) in [0, 1].

    Args:
        classifier: a :class:`~attr_engine.classifier.Classifier` around a timm ViT (ViT, DeiT, EVA, BEiT, ...:
            ``blocks[i].attn`` with ``attn_drop``, ``norm`` and ``forward_head``), a torchvision
            ``VisionTransformer`` or a transformers ViT / DeiT in :class:`~attr_engine.model_sources.HFImageClassifier`.
        layer_index: the first block whose map is summed (negative: counted from the end, as in the official
            ``LeWrapper(model, layer_index=-2)``); 0 sums every block, as in the paper's description.
    """

    name = "legrad"
    options: ClassVar[dict[str, Any]] = {"layer_index": -2}
    option_types: ClassVar[dict[str, Any]] = {"layer_index": int}  # an int default would also let None through

    def __init__(self, classifier: nn.Module, **options: Any) -> None:
        self._layout = self._read(classifier)  # first: the base class checks layer_index against its blocks
        super().__init__(classifier, **options)

    @staticmethod
    def _read(classifier: nn.Module) -> ViTLayout:
        model = getattr(classifier, "model", classifier)
        layout = vit_layout(model) if isinstance(model, nn.Module) else None
        if layout is None or layout.attentions is None:
            raise ValueError(
                "LeGrad needs a ViT (timm, torchvision or transformers: blocks of patch tokens with readable "
                f"attention, a final norm and head), got {type(model).__name__}"
            )
        return layout

    def _bind(self) -> None:
        self._layout = self._read(self.classifier)
        self._check_options(self.defaults)

    def _check_options(self, options: dict[str, Any]) -> None:
        depth = len(self._layout.blocks)
        index = options["layer_index"]
        if not -depth <= index < depth:
            raise ValueError(
                f"layer_index must be an integer in [{-depth}, {depth - 1}] for a model of {depth} blocks, got "
                f"{index!r}"
            )

    def _attribute(self, x: torch.Tensor, target: torch.Tensor, *, layer_index: int) -> torch.Tensor:
        """x: (B, 3, H, W) checked images; target: (B,) int64 classes -> (B, H, W) maps in [0, 1]."""
        start = layer_index % len(self._layout.blocks)
        tokens, weights, logits = self._capture(x, start)
        prefix = self._layout.prefix
        scores = [self._layout.head(z) for z in tokens]  # (B, K) per block
        self._check_last_scores(scores[-1], logits)  # before any backward: a model LeGrad cannot read costs nothing
        total: torch.Tensor | None = None
        for i, (block_scores, a) in enumerate(zip(scores, weights, strict=True)):
            score = block_scores.gather(1, target[:, None]).sum()  # images are independent: one backward for all
            # The blocks' graphs overlap (block l's holds blocks start..l): keep it until the last backward.
            (grad,) = torch.autograd.grad(score, a, retain_graph=i < len(scores) - 1, allow_unused=True)
            if grad is None:  # the score does not depend on this block's attention at all
                grad = torch.zeros_like(a)
            # Rectify, then average over heads (dim 1) and query rows (dim 2), as the official code does.
            grad = grad.to(torch.promote_types(grad.dtype, torch.float32))
            relevance = grad.clamp(min=0).mean(dim=1).mean(dim=1)[:, prefix:]
            total = relevance if total is None else total + relevance
        if total is None:
            raise RuntimeError("LeGrad captured no blocks")
        return self._normalised_map(total, x.shape[-2:])

    def _capture(self, x: torch.Tensor, start: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """One forward pass: the tokens (B, N, D) and attention-weight leaves (B, heads, N, N) of blocks ``start``
        on, and the logits (B, K)."""
        blocks = self._layout.blocks[start:]
        attns = (self._layout.attentions or [])[start:]
        tokens: list[torch.Tensor] = []

        def keep_tokens(_module: nn.Module, _inputs: Any, out: Any) -> None:
            tokens.append(out)

        kind = self._layout.attention_kind
        with captured_attention(kind, attns) as weights, thread_hooks(blocks, keep_tokens):
            logits = self.classifier(x)
        if len(weights) != len(attns) or len(tokens) != len(blocks):
            raise RuntimeError(
                f"LeGrad captured {len(weights)} attention maps and {len(tokens)} token sets from {len(blocks)} "
                "blocks: an attention module did not compute its softmax weights once"
            )
        for z, a in zip(tokens, weights, strict=True):
            if not isinstance(z, torch.Tensor) or z.ndim != 3 or a.ndim != 4 or a.shape[-1] != z.shape[1]:
                raise RuntimeError(
                    f"LeGrad expects block tokens (B, N, D) and attention weights (B, heads, N, N), got "
                    f"{tuple(getattr(z, 'shape', ()))} and {tuple(a.shape)}"
                )
        return tokens, weights, logits

    def _check_last_scores(self, scores: torch.Tensor, logits: torch.Tensor) -> None:
        """The last block's score must be the classifier's logit: else the final norm and head are not how the
        model reads its tokens, and no block's score means what LeGrad needs."""
        scale = float(logits.detach().abs().amax()) if logits.numel() else 0.0
        if scores.shape != logits.shape or not torch.allclose(
            scores.detach().to(logits.dtype), logits.detach(), rtol=1e-3, atol=1e-3 * max(1.0, scale)
        ):
            raise ValueError(
                f"LeGrad scores each block's tokens with the final norm and head of {self._model_name}, but for the "
                "last block that does not give the classifier's logits: its forward does more than "
                "head(norm(blocks(...)))"
            )

    @property
    def _model_name(self) -> str:
        return type(getattr(self.classifier, "model", self.classifier)).__name__

    def _normalised_map(self, relevance: torch.Tensor, size: torch.Size) -> torch.Tensor:
        """relevance: (B, P) summed over blocks, P patch tokens -> (B, H, W) upsampled, min-max per image."""
        grid = self._layout.grid(int(size[0]), int(size[1]))
        if relevance.shape[1] != grid[0] * grid[1]:
            raise RuntimeError(f"{relevance.shape[1]} patch tokens do not fill the {grid[0]} x {grid[1]} grid")
        # Upsampling is linear, so summing on the grid and upsampling once equals the official per-block upsampling.
        maps = F.interpolate(relevance.reshape(-1, 1, *grid), size=tuple(size), mode="bilinear", align_corners=False)
        maps = maps[:, 0]
        low = maps.amin(dim=(1, 2), keepdim=True)
        span = maps.amax(dim=(1, 2), keepdim=True) - low
        # A constant map (every gradient rectified away) is 0, not the official 0 / 0 = NaN.
        return torch.where(span > 0, (maps - low) / span.clamp_min(torch.finfo(maps.dtype).tiny), 0.0)
