"""Attention rollout (Abnar & Zuidema, ACL 2020) for timm ViTs; Captum has no attention methods.

Each block's attention weights (B, heads, N, N) are fused over heads (mean by default), mixed with the identity
for the residual path, ``0.5 * A + 0.5 * I``, re-normalised per row and multiplied through the blocks,
``R = A_L ... A_1``. The map is the class token's row over the patch tokens (with no prefix token, the mean row),
laid out on timm's patch grid and upsampled bilinearly. It is class-agnostic: ``target`` does not change it.

The weights are read where every timm attention module applies ``attn_drop`` to the softmax, with the fused
(scaled-dot-product) kernel switched off for the call, by hooks that act only on this thread's calls
(:mod:`attr_engine.baselines._vit_attention`, shared with LeGrad); both are undone afterwards, also when calls
overlap in several threads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attr_engine.baselines._vit_attention import attention_modules, thread_hooks, unfused_attention
from attr_engine.baselines.cam import is_vit, token_grid
from attr_engine.explainer import Explainer

__all__ = ["AttentionRollout"]

_FUSIONS = ("mean", "max", "min")


class AttentionRollout(Explainer):
    """Attention rollout maps (B, H, W).

    Args:
        classifier: a :class:`~attr_engine.classifier.Classifier` around a timm ViT.
        head_fusion: ``"mean"``, ``"max"`` or ``"min"`` over heads.
    """

    name = "attention-rollout"
    needs_grad = False

    def __init__(self, classifier: nn.Module, *, head_fusion: str = "mean") -> None:
        super().__init__(classifier)
        # Duck-typed timm ViT (blocks, .attn, num_prefix_tokens): attributes nn.Module does not declare.
        model: Any = getattr(classifier, "model", classifier)
        if not is_vit(model):
            raise ValueError(f"attention rollout needs a timm ViT (blocks of patch tokens), got {type(model).__name__}")
        attns = attention_modules(model)  # a block without timm attention is one ValueError naming it
        if head_fusion not in _FUSIONS:
            raise ValueError(f"head_fusion must be one of {_FUSIONS}, got {head_fusion!r}")
        self.head_fusion = head_fusion
        self._model: Any = model
        self._attns = attns

    def _bind(self) -> None:
        self._model = getattr(self.classifier, "model", self.classifier)
        self._attns = attention_modules(self._model)

    def _attribute(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        weights: list[torch.Tensor] = []
        drops = [attn.get_submodule("attn_drop") for attn in self._attns]
        with unfused_attention(self._attns), thread_hooks(drops, lambda _m, _i, out: weights.append(out)):
            with torch.no_grad():
                self.classifier(x)
        if len(weights) != len(self._attns):
            raise RuntimeError(f"captured {len(weights)} attention maps from {len(self._attns)} blocks")
        rollout = None
        for a in weights:
            a = a.float()
            a = a.mean(dim=1) if self.head_fusion == "mean" else getattr(a, f"a{self.head_fusion}")(dim=1)
            eye = torch.eye(a.shape[-1], device=a.device, dtype=a.dtype)
            a = 0.5 * a + 0.5 * eye
            a = a / a.sum(dim=-1, keepdim=True)
            rollout = a if rollout is None else a @ rollout
        if rollout is None:  # a model without blocks: nothing to roll out
            raise RuntimeError("captured no attention maps")
        prefix = int(self._model.num_prefix_tokens)
        rows = rollout[:, 0] if prefix > 0 else rollout.mean(dim=1)
        patch = rows[:, prefix:]
        grid = token_grid(self._model, *x.shape[-2:])
        if patch.shape[1] != grid[0] * grid[1]:
            raise RuntimeError(f"{patch.shape[1]} patch tokens do not fill the {grid[0]} x {grid[1]} grid")
        cam = patch.reshape(-1, 1, *grid)
        return F.interpolate(cam, size=x.shape[-2:], mode="bilinear", align_corners=False).squeeze(1)
