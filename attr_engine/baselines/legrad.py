"""LeGrad (Bousselham et al., ICCV 2025, arXiv 2404.03214) for timm ViTs; neither Captum nor pytorch-grad-cam has it.

For each block l from ``layer_index`` on, the score of the target class as if the network ended at block l,

    s^l = model.forward_head(model.norm(z^l))[target]      z^l: (B, N, D) the tokens block l puts out,

is differentiated w.r.t. that block's attention weights A^l (B, heads, N, N). The gradient is rectified, averaged
over the heads and over all N query rows (prefix tokens included), and its columns of the patch tokens (the model's
``num_prefix_tokens`` class / distillation / register tokens dropped) are block l's map on timm's patch grid
(``patch_embed.dynamic_feat_size`` for dynamic-size models, else ``grid_size``):

    E^l = mean_{h, i} relu(d s^l / d A^l_{h, i, prefix:}),   map = minmax(upsample(sum_l E^l)).

The maps of the blocks are summed, upsampled bilinearly to the image (``align_corners=False``) and min-max
normalised per image to [0, 1]. This is the official ``LeWrapper.compute_legrad_clip`` (legrad-torch 1.1), with
``layer_index=-2`` (the last two blocks) as its default; ``tests/test_legrad.py`` checks the maps against it on an
open_clip ViT ported to timm. The score s^l goes through the model's own norm, pooling and head, so s^L is the
classifier's logit (checked on every call); the official CLIP path mean-pools every layer's tokens instead
(docs/deviations.md lists this and the other differences).

The weights are read where every timm attention module applies ``attn_drop`` to the softmax, with the fused
(scaled-dot-product) kernel off for the call, by hooks that act only on this thread's calls
(:mod:`attr_engine.baselines._vit_attention`); both come off in ``finally``. The hook hands the block its weights
as a fresh leaf tensor: the same values, and the gradient of s^l w.r.t. that leaf is d s^l / d A^l, since s^l
depends on A^l only through what follows it; nothing before a block needs a graph.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from attr_engine.baselines._vit_attention import attention_modules, thread_hooks, unfused_attention
from attr_engine.baselines.cam import is_vit, token_grid
from attr_engine.explainer import Explainer

__all__ = ["LeGrad", "legrad_applies"]


def legrad_applies(model: nn.Module) -> bool:
    """Whether LeGrad fits ``model``: a timm ViT (:func:`~attr_engine.baselines.cam.is_vit`) whose ``norm`` and
    ``forward_head`` turn block tokens into logits and whose blocks have timm attention modules."""
    if not (is_vit(model) and callable(getattr(model, "forward_head", None))):
        return False
    if not isinstance(getattr(model, "norm", None), nn.Module):
        return False
    try:
        attention_modules(model)
    except ValueError:
        return False
    return True


class LeGrad(Explainer):
    """LeGrad maps (B, H, W) in [0, 1].

    Args:
        classifier: a :class:`~attr_engine.classifier.Classifier` around a timm ViT (ViT, DeiT, EVA, BEiT, ...:
            ``blocks[i].attn`` with ``attn_drop``, ``norm`` and ``forward_head``).
        layer_index: the first block whose map is summed (negative: counted from the end, as in the official
            ``LeWrapper(model, layer_index=-2)``); 0 sums every block, as in the paper's description.
    """

    name = "legrad"
    options: ClassVar[dict[str, Any]] = {"layer_index": -2}
    option_types: ClassVar[dict[str, Any]] = {"layer_index": int}  # an int default would also let None through

    def __init__(self, classifier: nn.Module, **options: Any) -> None:
        self._model, self._attns = self._parts(classifier)  # first: the base class checks layer_index against them
        super().__init__(classifier, **options)

    @staticmethod
    def _parts(classifier: nn.Module) -> tuple[Any, list[nn.Module]]:
        # Duck-typed timm ViT (blocks, norm, forward_head, num_prefix_tokens): attributes nn.Module does not declare.
        model: Any = getattr(classifier, "model", classifier)
        if not isinstance(model, nn.Module) or not legrad_applies(model):
            raise ValueError(
                "LeGrad needs a timm ViT (blocks of patch tokens with timm attention, norm and forward_head), got "
                f"{type(model).__name__}"
            )
        return model, attention_modules(model)

    def _bind(self) -> None:
        self._model, self._attns = self._parts(self.classifier)
        self._check_options(self.defaults)

    def _check_options(self, options: dict[str, Any]) -> None:
        depth = len(self._attns)
        index = options["layer_index"]
        if not -depth <= index < depth:
            raise ValueError(
                f"layer_index must be an integer in [{-depth}, {depth - 1}] for a model of {depth} blocks, got "
                f"{index!r}"
            )

    def _attribute(self, x: torch.Tensor, target: torch.Tensor, *, layer_index: int) -> torch.Tensor:
        """x: (B, 3, H, W) checked images; target: (B,) int64 classes -> (B, H, W) maps in [0, 1]."""
        start = layer_index % len(self._attns)
        tokens, weights, logits = self._capture(x, start)
        prefix = int(self._model.num_prefix_tokens)
        scores = [self._model.forward_head(self._model.norm(z)) for z in tokens]  # (B, K) per block
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
        blocks = list(self._model.blocks)[start:]
        attns = self._attns[start:]
        tokens: list[torch.Tensor] = []
        weights: list[torch.Tensor] = []

        def keep_weights(_module: nn.Module, _inputs: Any, out: torch.Tensor) -> torch.Tensor:
            leaf = out.detach().requires_grad_(True)
            weights.append(leaf)
            return leaf

        def keep_tokens(_module: nn.Module, _inputs: Any, out: Any) -> None:
            tokens.append(out)

        drops = [attn.get_submodule("attn_drop") for attn in attns]
        with unfused_attention(attns), thread_hooks(drops, keep_weights), thread_hooks(blocks, keep_tokens):
            logits = self.classifier(x)
        if len(weights) != len(attns) or len(tokens) != len(blocks):
            raise RuntimeError(
                f"LeGrad captured {len(weights)} attention maps and {len(tokens)} token sets from {len(blocks)} "
                "blocks: an attention module did not apply attn_drop once to its softmax weights"
            )
        for z, a in zip(tokens, weights, strict=True):
            if not isinstance(z, torch.Tensor) or z.ndim != 3 or a.ndim != 4 or a.shape[-1] != z.shape[1]:
                raise RuntimeError(
                    f"LeGrad expects block tokens (B, N, D) and attention weights (B, heads, N, N), got "
                    f"{tuple(getattr(z, 'shape', ()))} and {tuple(a.shape)}"
                )
        return tokens, weights, logits

    def _check_last_scores(self, scores: torch.Tensor, logits: torch.Tensor) -> None:
        """The last block's score must be the classifier's logit: else ``norm`` + ``forward_head`` are not how the
        model reads its tokens, and no block's score means what LeGrad needs."""
        scale = float(logits.detach().abs().amax()) if logits.numel() else 0.0
        if scores.shape != logits.shape or not torch.allclose(
            scores.detach().to(logits.dtype), logits.detach(), rtol=1e-3, atol=1e-3 * max(1.0, scale)
        ):
            raise ValueError(
                f"LeGrad scores each block's tokens with {type(self._model).__name__}.forward_head(norm(tokens)), "
                "but for the last block that does not give the classifier's logits: its forward does more than "
                "forward_head(norm(blocks(...)))"
            )

    def _normalised_map(self, relevance: torch.Tensor, size: torch.Size) -> torch.Tensor:
        """relevance: (B, P) summed over blocks, P patch tokens -> (B, H, W) upsampled, min-max per image."""
        grid = token_grid(self._model, int(size[0]), int(size[1]))
        if relevance.shape[1] != grid[0] * grid[1]:
            raise RuntimeError(f"{relevance.shape[1]} patch tokens do not fill the {grid[0]} x {grid[1]} grid")
        # Upsampling is linear, so summing on the grid and upsampling once equals the official per-block upsampling.
        maps = F.interpolate(relevance.reshape(-1, 1, *grid), size=tuple(size), mode="bilinear", align_corners=False)
        maps = maps[:, 0]
        low = maps.amin(dim=(1, 2), keepdim=True)
        span = maps.amax(dim=(1, 2), keepdim=True) - low
        # A constant map (every gradient rectified away) is 0, not the official 0 / 0 = NaN.
        return torch.where(span > 0, (maps - low) / span.clamp_min(torch.finfo(maps.dtype).tiny), 0.0)
