"""The AHA network: a frozen timm feature backbone and a trained class-conditioned decoder.

The decoder follows the DPT idea at a size that trains on a CPU: every tapped backbone level is projected, joined
with a learned embedding of the class to explain, and fused coarse-to-fine; the fused features are then upsampled in
x2 steps to the input resolution, where a shallow convolutional encoding of the image itself supplies pixel-level
detail, so maps on ViTs are dense instead of patch-sized blocks. Only the decoder is trained; a checkpoint stores it
and, when the backbone is a separate model, that backbone's weights too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from attr_engine.classifier import Classifier, load_classifier


class FeatureBackbone(nn.Module):
    """Frozen multi-level features through timm's ``forward_intermediates`` API (ViTs, ConvNeXts, ResNets, ...).

    Prefix tokens (class, distillation, registers) are removed and tokens reshaped to their grid by timm itself,
    so nothing here assumes a patch size, a grid or one class token.

    Args:
        model: a timm model exposing ``forward_intermediates``.
        mean, std: the normalisation this backbone expects, applied to [0, 1] images.
        layers: block/stage indices to tap; ``None`` picks four evenly spaced blocks of a transformer, or every stage
            of a CNN.
    """

    # Buffers registered in __init__; declared so they type as tensors, not nn.Module.__getattr__'s union.
    mean: torch.Tensor  # (1, 3, 1, 1)
    std: torch.Tensor  # (1, 3, 1, 1)

    def __init__(
        self,
        model: nn.Module,
        mean: torch.Tensor,
        std: torch.Tensor,
        layers: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        if not hasattr(model, "forward_intermediates"):
            raise ValueError(
                f"{type(model).__name__} has no forward_intermediates (timm's intermediate-layer API); "
                "name a timm backbone in AHAConfig.backbone"
            )
        self.model = model.eval().requires_grad_(False)
        self.register_buffer("mean", mean.detach().reshape(1, 3, 1, 1).clone(), persistent=False)
        self.register_buffer("std", std.detach().reshape(1, 3, 1, 1).clone(), persistent=False)
        self.indices = list(layers) if layers is not None else _default_layers(model)

    def train(self, mode: bool = True) -> FeatureBackbone:
        # Frozen: batch-norm statistics and dropout never switch to training behaviour.
        super().train(False)
        return self

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x: (B, 3, H, W) in [0, 1] -> list of (B, C_l, h_l, w_l) feature maps."""
        dtype = self.mean.dtype
        param = next(self.model.parameters(), None)
        if param is not None and param.is_floating_point():
            dtype = param.dtype  # images of any dtype run in the backbone's own
        z = (x.to(dtype) - self.mean.to(dtype)) / self.std.to(dtype)
        # timm's method, checked for in __init__; nn.Module declares no such attribute.
        feats = self.model.forward_intermediates(z, indices=self.indices, intermediates_only=True)  # type: ignore[operator]
        return [f.float() for f in feats]

    def channels(self, img_size: tuple[int, int]) -> list[int]:
        """Channels of each tapped level, found with one probe pass at ``img_size``."""
        param = next(self.model.parameters())
        probe = torch.zeros(1, 3, *img_size, device=param.device, dtype=param.dtype)
        return [f.shape[1] for f in self(probe)]


def _default_layers(model: nn.Module) -> list[int]:
    blocks = getattr(model, "blocks", None)
    stages = getattr(model, "stages", None)
    if isinstance(blocks, nn.Sequential | nn.ModuleList) and len(blocks) >= 4 and stages is None:
        depth = len(blocks)
        # DPT-style taps: the ends of the four quarters of the network.
        return sorted({max(0, round(depth * q / 4) - 1) for q in (1, 2, 3, 4)})
    info = getattr(model, "feature_info", None)
    if info is not None:
        return list(range(len(info)))
    raise ValueError(f"cannot pick default layers for {type(model).__name__}; set AHAConfig.layers")


def build_backbone(
    classifier: Classifier,
    name: str | None,
    layers: tuple[int, ...] | None,
    pretrained: bool = False,
    state: Mapping[str, torch.Tensor] | None = None,
) -> FeatureBackbone:
    """The classifier's own backbone (``name=None``) or a separately built timm model, frozen, with its own mean/std.

    ``state``: the separate model's weights (as a checkpoint stores them); it is then built without ``pretrained``
    and loaded strictly, so a saved explainer is rebuilt from its own files, with no download.
    """
    if name is None:
        return FeatureBackbone(classifier.model, classifier.norm_mean, classifier.norm_std, layers)
    img_size = classifier.input_size[1] if classifier.input_size is not None else None
    other = load_classifier(name, pretrained=pretrained and state is None, img_size=img_size)
    if state is not None:
        try:
            other.model.load_state_dict(dict(state), strict=True)
        except RuntimeError as err:
            raise ValueError(f"the stored weights of backbone {name!r} do not match it: {err}") from None
    return FeatureBackbone(other.model, other.norm_mean, other.norm_std, layers).to(classifier.norm_mean.device)


class _ConvUnit(nn.Module):
    """Residual 3x3 conv unit (pre-activation) used to refine fused features."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(dim, dim, 3, padding=1)
        self.conv2 = nn.Conv2d(dim, dim, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.gelu(self.conv1(F.gelu(x))))


class Decoder(nn.Module):
    """Class-conditioned decoder: backbone levels + class id + image -> one-channel map at input resolution.

    Args:
        feature_channels: channels of each backbone level (any order of resolutions).
        num_classes: classes the embedding covers.
        dim: fused width; class_dim: class-embedding size.
    """

    def __init__(self, feature_channels: list[int], num_classes: int, dim: int = 64, class_dim: int = 32) -> None:
        super().__init__()
        self.class_embed = nn.Embedding(num_classes, class_dim)
        nn.init.normal_(self.class_embed.weight, std=1.0)
        self.project = nn.ModuleList(nn.Conv2d(c + class_dim, dim, 1) for c in feature_channels)
        self.fuse = nn.ModuleList(_ConvUnit(dim) for _ in feature_channels)
        self.up = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1), nn.GELU())
        half = max(8, dim // 2)
        self.image_stem = nn.Sequential(
            nn.Conv2d(3, half, 3, padding=1), nn.GELU(), nn.Conv2d(half, half, 3, padding=1), nn.GELU()
        )
        self.head = nn.Sequential(
            nn.Conv2d(dim + half, half, 3, padding=1), nn.GELU(), nn.Conv2d(half, half, 3, padding=1), nn.GELU()
        )
        # No bias: rankings ignore a constant offset, so its gradient is pure rounding noise that Adam would
        # amplify into a random walk.
        self.out = nn.Conv2d(half, 1, 1, bias=False)

    def forward(self, feats: list[torch.Tensor], x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """feats: levels (B, C_l, h_l, w_l); x: (B, 3, H, W) in [0, 1]; target: (B,) class ids -> (B, H, W)."""
        return self.out(self.head(self.trunk(feats, x, target)))[:, 0]

    def hidden(self, feats: list[torch.Tensor], x: torch.Tensor, target: torch.Tensor, depth: int) -> torch.Tensor:
        """The activations (B, C, H, W) that enter the decoder's last ``depth`` layers (1: the output projection;
        2: also the head's last 3x3 convolution), as :class:`PerImageTail` takes them."""
        if depth not in (1, 2):
            raise ValueError(f"depth must be 1 or 2, got {depth!r}")
        z = self.trunk(feats, x, target)
        return self.head(z) if depth == 1 else self.head[1](self.head[0](z))

    def trunk(self, feats: list[torch.Tensor], x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Fused features at input resolution joined with the image stem: (B, dim + dim // 2, H, W)."""
        emb = self.class_embed(target)[:, :, None, None]
        # Coarse to fine: each level adds the upsampled sum of the coarser ones (stable order for equal sizes).
        order = sorted(range(len(feats)), key=lambda i: (feats[i].shape[-2] * feats[i].shape[-1], -i))
        fused = None
        for i in order:
            f = feats[i]
            z = self.project[i](torch.cat((f, emb.expand(-1, -1, *f.shape[-2:])), dim=1))
            if fused is not None:
                z = z + F.interpolate(fused, size=z.shape[-2:], mode="bilinear", align_corners=False)
            fused = self.fuse[i](z)
        assert fused is not None
        height, width = x.shape[-2:]
        # x2 steps (shared weights) up to the input resolution, then an exact resize for odd sizes. The conv runs at
        # least once so every parameter takes part in every step (DistributedDataParallel requires it).
        steps = max(0, math.ceil(math.log2(max(height / fused.shape[-2], width / fused.shape[-1]))))
        if steps == 0:
            fused = self.up(fused)
        for _ in range(steps):
            fused = self.up(F.interpolate(fused, scale_factor=2.0, mode="bilinear", align_corners=False))
        fused = F.interpolate(fused, size=(height, width), mode="bilinear", align_corners=False)
        return torch.cat((fused, self.image_stem(x)), dim=1)


class PerImageTail(nn.Module):
    """Per-image copies of a decoder's last ``depth`` layers, for test-time refinement.

    Image i's map is computed from its own copy only (a grouped convolution with one group per image, then a
    per-image output projection), so a gradient step on the summed objective moves each copy by its own image's
    gradient alone and a refined map never depends on the rest of its batch. Fine-tuning one shared decoder on the
    batch, as before, mixed every image's gradient into every map.

    Args:
        decoder: the trained decoder whose layers are copied (not modified).
        batch: number of images B.
        depth: 1 refines the output projection (``half`` weights per image); 2 also the head's last 3x3 conv.
    """

    def __init__(self, decoder: Decoder, batch: int, depth: int) -> None:
        super().__init__()
        if depth not in (1, 2):
            raise ValueError(f"depth must be 1 or 2, got {depth!r}")
        self.depth = depth
        out = decoder.out.weight.detach()[0, :, 0, 0]  # (C,)
        self.out = nn.Parameter(out.expand(batch, -1).clone())  # (B, C)
        if depth == 2:
            conv = decoder.head[2]
            assert isinstance(conv, nn.Conv2d) and conv.bias is not None
            self.weight = nn.Parameter(conv.weight.detach().repeat(batch, 1, 1, 1))  # (B * C, C, 3, 3)
            self.bias = nn.Parameter(conv.bias.detach().repeat(batch))  # (B * C,)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (B, C, H, W) from :meth:`Decoder.hidden` at the same depth -> maps (B, H, W)."""
        if self.depth == 2:
            bsz, ch, height, width = hidden.shape
            flat = hidden.reshape(1, bsz * ch, height, width)
            hidden = F.gelu(F.conv2d(flat, self.weight, self.bias, padding=1, groups=bsz)).view_as(hidden)
        return torch.einsum("bchw,bc->bhw", hidden, self.out)
