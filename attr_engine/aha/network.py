"""The AHA network: a frozen feature backbone (timm, torchvision or transformers) and a trained class-conditioned
decoder.

The decoder follows the DPT idea at a size that trains on a CPU: every tapped backbone level is projected, joined
with a learned embedding of the class to explain, and fused coarse-to-fine; the fused features are then upsampled in
x2 steps to the input resolution, where a shallow convolutional encoding of the image itself supplies pixel-level
detail, so maps on ViTs are dense instead of patch-sized blocks. Only the decoder is trained; a checkpoint stores it
and, when the backbone is a separate model, that backbone's weights too.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attr_engine.aha.config import DECODER_PADDINGS, DECODER_STRIDES, DECODER_UPSAMPLES, DECODERS, AHAConfig
from attr_engine.aha.loss import standardise
from attr_engine.classifier import Classifier, load_classifier
from attr_engine.model_sources import is_hf_classifier, is_torchvision_vit

# The channels the pullback input adds to the image the decoder's stem encodes (AHAConfig.pullback_input).
PULLBACK_CHANNELS = 2

# The floor added to a pixel's colour distance from the reference before its log (Decoder's reference-distance
# term): about 5/255 per channel, so a pixel of exactly the reference colour gets a finite, lowest value.
DISTANCE_EPS = 0.02

# The guided upsampling's starting scales (GuidedUpsample): exp(-2 d^2) for a distance of d cells, and
# exp(-12.5 c^2) for a squared colour difference c^2 (summed over RGB in [0, 1]: sigma 0.2), both learned from there.
GUIDED_SPATIAL_SCALE = 2.0
GUIDED_COLOUR_SCALE = 12.5
# The bytes one slice of the guided upsampling's (b, 9, H, W) float32 logits may take: a batch is upsampled a few
# images at a time (2 at 224 px, 28 at 64 px), so the temporaries stay in the cache; one (32, 9, 224, 224) tensor is
# 58 MB. Chosen from a sweep of 1-64 MiB at 1 and 2 threads (benches/README.md, "The guided upsampler alone").
GUIDED_SLICE_BYTES = 4 * 2**20

# GuidedUpsample's 3 x 3 neighbouring cells, row-major, as offsets into maps padded by one cell.
_WINDOWS = tuple((i, j) for i in range(3) for j in range(3))


class FeatureBackbone(nn.Module):
    """Frozen multi-level features of a timm, torchvision or Hugging Face classifier, as (B, C, h, w) maps.

    Where the levels come from:

    - timm: ``forward_intermediates`` (ViTs, ConvNeXts, ResNets, ...). Prefix tokens are removed and tokens
      reshaped to their grid by timm itself, so nothing here assumes a patch size, a grid or one class token.
    - torchvision: the outputs of the model's own stages (ResNet ``layer1``-``layer4``; the layers of ``features``
      for VGG, ConvNeXt, EfficientNet, MobileNet, DenseNet; the encoder layers of a VisionTransformer), read by
      forward hooks that exist only during one call (removed in ``finally``) and record only the calling thread's
      pass. Not ``torchvision.models.feature_extraction``: its FX trace fails on VisionTransformer's input-size
      assert (torch 2.14 / torchvision 0.29) and costs seconds per build.
    - transformers (:class:`~attr_engine.model_sources.HFImageClassifier`): the model's ``hidden_states`` after its
      embeddings, one per layer or stage.

    Token levels (B, N, D) of the torchvision and transformers ViTs lose their prefix tokens (``N - h * w``, the
    grid from the patch size) and are laid out on the patch grid.

    Args:
        model: the classifier's network (``Classifier.model``).
        mean, std: the normalisation this backbone expects, applied to [0, 1] images.
        layers: indices of the levels to tap; ``None`` picks four evenly spaced blocks of a transformer, or every
            stage of a CNN (for a torchvision ``features`` list: the last layer at each resolution).
        img_size: the side of the probe pass that finds a ``features`` list's stages (default 224).
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
        img_size: int | None = None,
    ) -> None:
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.register_buffer("mean", mean.detach().reshape(1, 3, 1, 1).clone(), persistent=False)
        self.register_buffer("std", std.detach().reshape(1, 3, 1, 1).clone(), persistent=False)
        self.source = _feature_source(model)
        self._nodes = _torchvision_nodes(model) if self.source == "torchvision" else []  # candidate levels
        if layers is not None:
            self.indices = list(layers)
        elif self.source == "timm":
            self.indices = _default_layers(model)
        else:
            self.indices = self._default_levels(img_size or 224)
        count = len(self._nodes)
        if self.source == "torchvision" and (not self.indices or any(not -count <= i < count for i in self.indices)):
            raise ValueError(f"layers {self.indices} are not levels of {type(model).__name__} (it has {count})")

    def train(self, mode: bool = True) -> FeatureBackbone:
        # Frozen: batch-norm statistics and dropout never switch to training behaviour.
        super().train(False)
        return self

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.mean.dtype
        param = next(self.model.parameters(), None)
        if param is not None and param.is_floating_point():
            dtype = param.dtype  # images of any dtype run in the backbone's own
        return (x.to(dtype) - self.mean.to(dtype)) / self.std.to(dtype)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x: (B, 3, H, W) in [0, 1] -> list of (B, C_l, h_l, w_l) feature maps."""
        z = self._normalise(x)
        if self.source == "timm":
            # timm's method; nn.Module declares no such attribute.
            feats = self.model.forward_intermediates(z, indices=self.indices, intermediates_only=True)  # type: ignore[operator]
        else:
            feats = [_as_map(f, self.model, x.shape[-2:]) for f in self._levels(z, self.indices)]
        return [f.float() for f in feats]

    @property
    def fuses_logits(self) -> bool:
        """Whether :meth:`forward_with_logits` takes the logits from the same pass as the levels: a timm model
        with ``forward_head``, any torchvision or transformers classifier; else it runs the model a second time."""
        return self.source != "timm" or callable(getattr(self.model, "forward_head", None))

    @torch.no_grad()
    def forward_with_logits(self, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """x: (B, 3, H, W) in [0, 1] -> (the levels :meth:`forward` gives, bit for bit; (B, K) logits).

        One pass of the model gives both where :attr:`fuses_logits` says so: timm's ``forward_intermediates`` with
        the final features, then ``forward_head``; torchvision's own forward (whose stages the hooks read); the
        transformers model's output with ``hidden_states``. This is the classifier's own network, so the logits are
        its prediction (only when the backbone *is* the classifier's network: the caller checks that).
        """
        z = self._normalise(x)
        if not self.fuses_logits:
            return self(x), self.model(z)
        if self.source == "timm":
            final, feats = self.model.forward_intermediates(z, indices=self.indices, intermediates_only=False)  # type: ignore[operator]
            logits = self.model.forward_head(final)  # type: ignore[operator]
        else:
            levels, logits = self._levels_and_logits(z, self.indices)
            feats = [_as_map(f, self.model, x.shape[-2:]) for f in levels]
        return [f.float() for f in feats], logits

    def _levels(self, z: torch.Tensor, indices: list[int]) -> list[torch.Tensor]:
        """The raw levels ``indices`` of a torchvision or transformers model for normalised ``z``."""
        return self._levels_and_logits(z, indices)[0]

    def _levels_and_logits(self, z: torch.Tensor, indices: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The raw levels ``indices`` of a torchvision or transformers model and its (B, K) logits, one pass."""
        if self.source == "torchvision":
            return _torchvision_levels(self.model, [self._nodes[i] for i in indices], z)
        logits, states = self.model.logits_and_hidden_states(z)  # type: ignore[operator]  # HFImageClassifier's
        states = states[1:]
        if any(not -len(states) <= i < len(states) for i in indices):
            raise ValueError(f"layers {indices} are not levels of {type(self.model).__name__} (it has {len(states)})")
        return [states[i] for i in indices], logits

    def _default_levels(self, side: int) -> list[int]:
        """Every stage of a CNN, four evenly spaced blocks of a transformer (torchvision / transformers)."""
        param = next(self.model.parameters())
        probe = torch.zeros(1, 3, side, side, device=param.device, dtype=param.dtype)
        with torch.no_grad():
            if self.source == "torchvision":
                levels = _torchvision_levels(self.model, self._nodes, probe)[0]
            else:
                levels = list(self.model.hidden_states(probe)[1:])  # type: ignore[operator]
        if levels and all(f.ndim == 3 for f in levels):
            return _quarters(len(levels))
        if self.source == "hf" or any(not n.startswith("features.") for n in self._nodes):
            return list(range(len(levels)))
        # A features list: the last layer at each resolution (the end of each stage).
        sizes = [tuple(f.shape[-2:]) for f in levels]
        return [i for i in range(len(sizes)) if i + 1 == len(sizes) or sizes[i + 1] != sizes[i]]

    def channels(self, img_size: tuple[int, int]) -> list[int]:
        """Channels of each tapped level, found with one probe pass at ``img_size``."""
        param = next(self.model.parameters())
        probe = torch.zeros(1, 3, *img_size, device=param.device, dtype=param.dtype)
        return [f.shape[1] for f in self(probe)]


def _feature_source(model: nn.Module) -> str:
    if hasattr(model, "forward_intermediates"):
        return "timm"
    if is_hf_classifier(model):
        return "hf"
    if type(model).__module__.startswith("torchvision."):
        return "torchvision"
    raise ValueError(
        f"{type(model).__name__} is neither a timm model (forward_intermediates), a torchvision classifier nor a "
        "transformers one; name a timm backbone in AHAConfig.backbone"
    )


def _torchvision_nodes(model: nn.Module) -> list[str]:
    """The candidate levels of a torchvision classifier, as module names create_feature_extractor returns."""
    if is_torchvision_vit(model):
        layers: Any = model.encoder.layers  # type: ignore[union-attr]  # is_torchvision_vit checked it
        return [f"encoder.layers.{name}" for name, _ in layers.named_children()]
    if all(isinstance(getattr(model, f"layer{i}", None), nn.Module) for i in range(1, 5)):
        return [f"layer{i}" for i in range(1, 5)]  # ResNet, ResNeXt, Wide ResNet
    features = getattr(model, "features", None)
    if isinstance(features, nn.Sequential) and len(features) > 0:
        return [f"features.{i}" for i in range(len(features))]
    raise ValueError(f"cannot find the feature stages of torchvision's {type(model).__name__}; set AHAConfig.backbone")


def _stage_outputs(model: nn.Module, names: list[str], z: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The first output of each module ``names`` in one pass of ``model`` on ``z``, by hooks of this call only, and
    the model's own output (its logits) of that pass."""
    owner = threading.get_ident()
    captured: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Any:
        def record(_module: nn.Module, _inputs: Any, output: Any) -> None:
            # Another thread running the same model meanwhile fires this hook too: only this call's pass counts.
            if threading.get_ident() == owner and name not in captured:
                captured[name] = output[0] if isinstance(output, tuple) else output

        return record

    handles = []
    try:
        for name in dict.fromkeys(names):
            handles.append(model.get_submodule(name).register_forward_hook(hook(name)))
        logits = model(z)
    finally:
        for handle in handles:
            handle.remove()
    missing = [n for n in names if n not in captured]
    if missing:
        raise RuntimeError(f"{type(model).__name__}: the levels {missing} did not run in the forward pass")
    return [captured[n] for n in names], logits


def _channels_last(model: nn.Module) -> bool:
    """Whether ``model`` is a torchvision Swin Transformer, whose ``features`` stages put out (B, h, w, C): it
    permutes to channels-first only after its last stage."""
    cls = type(model)
    return cls.__name__ == "SwinTransformer" and cls.__module__.startswith("torchvision.")


def _torchvision_levels(model: nn.Module, names: list[str], z: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The outputs of the stages ``names`` of a torchvision classifier for ``z``, 4-D ones as (B, C, h, w), and the
    model's logits of the same pass."""
    levels, logits = _stage_outputs(model, names, z)
    if _channels_last(model):
        levels = [f.permute(0, 3, 1, 2) if f.ndim == 4 else f for f in levels]
    return levels, logits


def _as_map(level: torch.Tensor, model: nn.Module, size: Sequence[int]) -> torch.Tensor:
    """A (B, C, h, w) level as it is; (B, N, D) tokens without their prefix tokens on the patch grid."""
    if level.ndim == 4:
        return level
    if level.ndim != 3:
        raise ValueError(f"a backbone level of shape {tuple(level.shape)} is neither (B, C, h, w) nor (B, N, D)")
    patch: Any = getattr(model, "patch_size", None) or getattr(getattr(model, "config", None), "patch_size", None)
    ph, pw = (patch, patch) if isinstance(patch, int) else tuple(patch or (0, 0))
    if not ph or not pw:
        raise ValueError(f"{type(model).__name__} gives token levels but no patch_size to lay them on a grid")
    rows, cols = int(size[0]) // ph, int(size[1]) // pw
    prefix = level.shape[1] - rows * cols
    if prefix < 0:
        raise ValueError(f"{level.shape[1]} tokens do not fill the {rows} x {cols} patch grid")
    return level[:, prefix:].transpose(1, 2).reshape(level.shape[0], level.shape[2], rows, cols)


def _quarters(depth: int) -> list[int]:
    # DPT-style taps: the ends of the four quarters of the network.
    return sorted({max(0, round(depth * q / 4) - 1) for q in (1, 2, 3, 4)})


def _default_layers(model: nn.Module) -> list[int]:
    blocks = getattr(model, "blocks", None)
    stages = getattr(model, "stages", None)
    if isinstance(blocks, nn.Sequential | nn.ModuleList) and len(blocks) >= 4 and stages is None:
        return _quarters(len(blocks))
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
    """The classifier's own backbone (``name=None``: its timm, torchvision or transformers network) or a separately
    built model (any name :func:`~attr_engine.classifier.load_classifier` takes), frozen, with its own mean/std.

    ``state``: the separate model's weights (as a checkpoint stores them); it is then built without ``pretrained``
    and loaded strictly, so a saved explainer is rebuilt from its own files, with no download.
    """
    img_size = classifier.input_size[1] if classifier.input_size is not None else None
    if name is None:
        return FeatureBackbone(classifier.model, classifier.norm_mean, classifier.norm_std, layers, img_size)
    other = load_classifier(name, pretrained=pretrained and state is None, img_size=img_size)
    if state is not None:
        try:
            other.model.load_state_dict(dict(state), strict=True)
        except RuntimeError as err:
            raise ValueError(f"the stored weights of backbone {name!r} do not match it: {err}") from None
    backbone = FeatureBackbone(other.model, other.norm_mean, other.norm_std, layers, img_size)
    return backbone.to(classifier.norm_mean.device)


class _ConvUnit(nn.Module):
    """Residual 3x3 conv unit (pre-activation) used to refine fused features."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(dim, dim, 3, padding=1)
        self.conv2 = nn.Conv2d(dim, dim, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.gelu(self.conv1(F.gelu(x))))


def _separable(dim: int) -> nn.Sequential:
    """Depthwise 3x3 then pointwise 1x1 convolution: ``dim * (9 + dim)`` multiply-adds per pixel instead of a full
    3x3's ``9 * dim^2`` (8x fewer at 32 channels)."""
    return nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1, groups=dim), nn.Conv2d(dim, dim, 1))


class GuidedUpsample(nn.Module):
    """Joint bilateral upsampling of a map by ``stride``, guided by the image (FeatUp's JBU idea, parameter-light).

    Each output pixel is a weighted mean of the 3 x 3 low-resolution scores around its cell; the weights are a
    softmax over those nine of ``-a * d^2 - b * c^2``, with ``d`` the distance (in cells) from the pixel to each
    cell's centre and ``c^2`` the squared RGB difference between the pixel and the cell's mean colour; ``a`` and
    ``b`` are learned (log-parametrised, starting at :data:`GUIDED_SPATIAL_SCALE` and :data:`GUIDED_COLOUR_SCALE`).
    A pixel on an object's edge thus takes the scores of the cells of its own colour, so a map decoded at 1/4 or
    1/8 of the input side keeps the boundaries a bilinear resize would blur across. Cost per pixel: about 9 x 10
    operations, against tens of thousands of multiply-adds per pixel for a convolution stage at full resolution.
    The pixel's own squared norm is left out of the logits (it is the same for its nine cells and cancels in the
    softmax), and the dot product with each cell's colour is summed one channel at a time, so no
    (B, 3, 9, s^2, h, w) tensor is formed.
    """

    spatial: torch.Tensor  # (9, s * s, 1, 1) squared distances from each sub-pixel to each neighbouring cell

    def __init__(self, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.spatial_log = nn.Parameter(torch.tensor(math.log(GUIDED_SPATIAL_SCALE)))
        self.colour_log = nn.Parameter(torch.tensor(math.log(GUIDED_COLOUR_SCALE)))
        offset = (torch.arange(stride, dtype=torch.float32) + 0.5) / stride - 0.5  # sub-pixel centre in its cell
        shifts = torch.tensor([-1.0, 0.0, 1.0])
        dy = (shifts[:, None, None, None] - offset[None, None, :, None]) ** 2  # (3, 1, s, 1)
        dx = (shifts[None, :, None, None] - offset[None, None, None, :]) ** 2  # (1, 3, 1, s)
        self.register_buffer("spatial", (dy + dx).reshape(9, stride * stride, 1, 1), persistent=False)

    def forward(self, maps: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """maps (B, h, w); x (B, 3, h * stride, w * stride) the guide image -> (B, h * stride, w * stride).

        In eager mode a batch is upsampled in slices of :data:`GUIDED_SLICE_BYTES` worth of logits (each image's
        result is the same as alone) by :meth:`all_cells`. A graph being traced, exported or compiled (ONNX, the
        AOTInductor package, ``torch.compile``) gets :meth:`cell_by_cell`, the same map over the whole batch (its
        batch dimension stays symbolic): in onnxruntime the nine-way softmax of :meth:`all_cells` is the slower
        form, in eager PyTorch the faster one (benches/README.md "The guided upsampler alone"; the compiled forms
        are not timed).
        """
        if _tracing():
            return self.cell_by_cell(maps, x)
        per_slice = max(1, GUIDED_SLICE_BYTES // (9 * x.shape[-2] * x.shape[-1] * 4))
        if len(maps) <= per_slice:
            return self.all_cells(maps, x)
        return torch.cat([self.all_cells(m, g) for m, g in zip(maps.split(per_slice), x.split(per_slice), strict=True)])

    def _neighbourhood(self, maps: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """maps (B, h, w), x (B, 3, H, W) -> each output pixel's colour as (B, 3, s^2, h, w) (sub-pixel ``k`` of cell
        ``(cy, cx)`` at ``[:, :, k, cy, cx]``), the maps and the cells' mean colours padded by one cell: (B, 1, h + 2,
        w + 2) and (B, 3, h + 2, w + 2), so the neighbour ``(i, j)`` of every cell is the slice ``[..., i : i + h,
        j : j + w]`` (edge cells repeat)."""
        s = self.stride
        bsz, height, width = maps.shape
        x = x.float()
        pixels = F.pixel_unshuffle(x, s).reshape(bsz, 3, s * s, height, width)
        padded_maps = F.pad(maps.float()[:, None], (1, 1, 1, 1), mode="replicate")
        padded_cells = F.pad(F.avg_pool2d(x, s), (1, 1, 1, 1), mode="replicate")
        return pixels, padded_maps, padded_cells

    def all_cells(self, maps: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The map, maps (B, h, w) -> (B, h * stride, w * stride), from the logits of the nine cells at once: one
        (B, 9, s^2, h, w) tensor and one softmax over its second dimension."""
        s = self.stride
        height, width = maps.shape[-2:]
        pixels, padded_maps, padded_cells = self._neighbourhood(maps, x)
        near_maps = torch.stack([padded_maps[:, 0, i : i + height, j : j + width] for i, j in _WINDOWS], 1)
        near_cells = torch.stack([padded_cells[:, :, i : i + height, j : j + width] for i, j in _WINDOWS], 2)
        # -b |p - c|^2 = -b |p|^2 + 2b p.c - b |c|^2, and -b |p|^2 is the same for a pixel's nine cells, so it
        # cancels in the softmax: the logits are 2b p.c - b |c|^2 - a d^2, (B, 9, s^2, h, w), the dot product
        # summed channel by channel (a batched matmul of 3-long vectors per position is 5x slower on the CPU)
        colour_scale = self.colour_log.exp()
        scaled_cells = (2 * colour_scale) * near_cells  # (B, 3, 9, h, w)
        logits = pixels[:, :1] * scaled_cells[:, 0, :, None]
        for c in (1, 2):
            logits = logits + pixels[:, c : c + 1] * scaled_cells[:, c, :, None]
        cell_terms = -colour_scale * near_cells.square().sum(1)  # (B, 9, h, w)
        logits = logits + (cell_terms[:, :, None] - self.spatial_log.exp() * self.spatial)
        out = (logits.softmax(1) * near_maps[:, :, None]).sum(1)  # (B, s^2, h, w)
        return F.pixel_shuffle(out, s)[:, 0]

    def cell_by_cell(self, maps: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """:meth:`all_cells`'s map as a two-pass softmax over the nine cells, one cell at a time: a first pass takes
        the largest logit of each (B, s^2, h, w) position, a second sums ``exp(logit - largest)`` and its product
        with the cell's score. Each cell's logit is computed in both passes, so in inference no logit tensor is
        larger than (B, s^2, h, w), 9x smaller than :meth:`all_cells`' (B, 9, s^2, h, w). The shift is detached:
        it does not change the softmax, so its gradient is zero and need not be traced."""
        height, width = maps.shape[-2:]
        pixels, padded_maps, padded_cells = self._neighbourhood(maps, x)
        colour_scale = self.colour_log.exp()
        spatial = self.spatial_log.exp() * self.spatial  # (9, s^2, 1, 1)

        def logit(k: int) -> torch.Tensor:  # (B, s^2, h, w): 2b p.c - b |c|^2 - a d^2 for neighbour k
            i, j = _WINDOWS[k]
            cell = padded_cells[:, :, i : i + height, j : j + width]  # (B, 3, h, w)
            scaled = (2 * colour_scale) * cell
            dot = pixels[:, 0] * scaled[:, 0:1] + pixels[:, 1] * scaled[:, 1:2] + pixels[:, 2] * scaled[:, 2:3]
            return dot + (-colour_scale * cell.square().sum(1, keepdim=True) - spatial[k])

        largest = logit(0)
        for k in range(1, 9):
            largest = torch.maximum(largest, logit(k))
        largest = largest.detach()
        total = weighted = torch.zeros_like(largest)
        for k, (i, j) in enumerate(_WINDOWS):
            weights = (logit(k) - largest).exp()
            total = total + weights
            weighted = weighted + weights * padded_maps[:, :, i : i + height, j : j + width]
        return F.pixel_shuffle(weighted / total, self.stride)[:, 0]


def _tracing() -> bool:
    """Whether a graph is being captured (torch.export / torch.compile / the ONNX exporters / TorchScript tracing)."""
    return (
        torch.compiler.is_compiling()
        or torch.compiler.is_exporting()
        or torch.onnx.is_in_onnx_export()
        or torch.jit.is_tracing()
    )


class Decoder(nn.Module):
    """Class-conditioned decoder: backbone levels + class id + image -> one-channel map at input resolution.

    With ``stride`` > 1 the convolutions run at 1/``stride`` of the input side: the image stem reads each
    ``stride x stride`` pixel block as ``3 * stride^2`` channels (a pixel unshuffle, so no pixel is dropped), the
    fused features are upsampled only that far, the head and the output projection run there, and
    :meth:`with_terms` brings the map to the input resolution (``upsample``). The x2 steps and head at full
    resolution are most of the full decoder's cost at 224 px; at a stride of 4 they shrink 16x.

    Args:
        feature_channels: channels of each backbone level (any order of resolutions).
        num_classes: classes the embedding covers.
        dim: fused width; class_dim: class-embedding size.
        image_dim: width of the full-resolution image encoding and of the head (``None``: ``max(8, dim // 2)``).
        kind: ``"full"`` (every x2 upsampling step a 3x3 convolution at ``dim`` channels, full 3x3 convolutions in
            the image encoding and the head) or ``"light"``: the fused features are projected to ``image_dim``
            before upsampling, and the upsampling steps, the image encoding and the head are depthwise-separable
            or pointwise, except the stem's first convolution (3 channels in) and the head's last 3x3 (the layer
            refinement adapts). Per input pixel that is about ``13 * image_dim^2 + 50 * image_dim`` multiply-adds
            (~15 k at 32 channels, against ~84 k for "full" at dim 64): the cost follows the image encoding's
            width, not the fused one.
        reference: the reference colour (3,) in [0, 1] of a reference-distance term (``AHAConfig.
            reference_distance``): the map gains ``w * log(||x - r|| + DISTANCE_EPS)`` per pixel, with ``w`` a
            learned scalar starting at 0 (the untrained map is unchanged). It orders the pixels inside a cell,
            which the region-pooled objective never ranks: a pixel of the reference colour changes nothing when
            deleted or inserted, so a positive ``w`` moves it last (what the ``x·(x−r)`` rankings do). ``None``: no
            term. The colour is not stored in the weights (the classifier's mean gives it back on load).
        extra_channels: channels the image stem takes besides the image's RGB (``PULLBACK_CHANNELS`` with
            ``AHAConfig.pullback_input``, passed as ``extra`` to :meth:`forward`); 0: the image alone.
        stride: the decoder's resolution as a divisor of the input side (``AHAConfig.decoder_stride``), one of
            ``DECODER_STRIDES``; an input side that is not a multiple is padded (edge pixels repeated) and the map
            cropped back.
        upsample: ``"guided"`` (:class:`GuidedUpsample`) or ``"bilinear"`` (``AHAConfig.decoder_upsample``);
            unused at stride 1.
        pullback_skip: the map also gains ``s * extra[:, 0]`` (``AHAConfig.pullback_skip``), the pullback's
            ``v·(x − r)`` channel, with ``s`` a learned scalar starting at 1: the untrained map already ranks the
            pixels much as the pullback's ``x·(x−r)`` ranking does, and training learns the correction. Needs
            ``extra_channels``.
        head_weight: the classifier head's weights (K, C) for ``AHAConfig.head_input``: the deepest level of C
            channels (:func:`head_level`) gains the standardised score ``W_t · f`` of the target class t at each
            position, one channel before its projection; ``None``: no such channel. A buffer, not a weight: it is the
            classifier's, read again when the explainer is built, never trained or stored.
        padding: how every 3x3 convolution pads the frame (``AHAConfig.decoder_padding``): ``"zeros"`` or
            ``"replicate"``. Zero padding shows each convolution a dark border that no image has, which trained
            weights can turn into extra (or missing) weight on the frame's outer pixels; replicate padding extends
            the edge pixels instead. Only the padding changes: the weights and their shapes are the same.
        prediction_input: ``feats`` ends with the classifier's predicted distribution (B, K), the softmax of its
            logits (:func:`with_prediction`), which a learned (class_dim, K) matrix adds to the class embedding:
            the decoder knows how sure the classifier is and what else it sees, not only the class it explains.
            The matrix starts at zero (the untrained map is unchanged).
    """

    reference: torch.Tensor  # (1, 3, 1, 1), a buffer where the reference-distance term is on
    head_weight: torch.Tensor  # (K, C), a buffer where the head score is on

    def __init__(
        self,
        feature_channels: list[int],
        num_classes: int,
        dim: int = 64,
        class_dim: int = 32,
        image_dim: int | None = None,
        kind: str = "full",
        reference: torch.Tensor | None = None,
        padding: str = "zeros",
        extra_channels: int = 0,
        pullback_skip: bool = False,
        stride: int = 1,
        upsample: str = "guided",
        head_weight: torch.Tensor | None = None,
        prediction_input: bool = False,
    ) -> None:
        super().__init__()
        if stride not in DECODER_STRIDES:
            raise ValueError(f"decoder stride must be one of {DECODER_STRIDES}, got {stride!r}")
        if upsample not in DECODER_UPSAMPLES:
            raise ValueError(f"decoder upsample must be one of {DECODER_UPSAMPLES}, got {upsample!r}")
        if pullback_skip and not extra_channels:
            raise ValueError("the pullback skip adds the pullback input's first channel: extra_channels must be > 0")
        if kind not in DECODERS:
            raise ValueError(f"decoder kind must be one of {DECODERS}, got {kind!r}")
        if padding not in DECODER_PADDINGS:
            raise ValueError(f"decoder padding must be one of {DECODER_PADDINGS}, got {padding!r}")
        self.kind = kind
        self.class_embed = nn.Embedding(num_classes, class_dim)
        nn.init.normal_(self.class_embed.weight, std=1.0)
        self.head_level: int | None = None
        if head_weight is not None:
            if head_weight.shape[0] != num_classes:
                raise ValueError(f"head_weight must have {num_classes} rows, got {tuple(head_weight.shape)}")
            self.head_level = head_level(feature_channels, head_weight)
            self.register_buffer("head_weight", head_weight.detach().float().clone(), persistent=False)
        extra_in = [int(i == self.head_level) for i in range(len(feature_channels))]
        self.project = nn.ModuleList(
            nn.Conv2d(c + class_dim + e, dim, 1) for c, e in zip(feature_channels, extra_in, strict=True)
        )
        self.fuse = nn.ModuleList(_ConvUnit(dim) for _ in feature_channels)
        half = max(8, dim // 2) if image_dim is None else image_dim
        self.extra_channels = extra_channels
        self.stride = stride
        stem_in = (3 + extra_channels) * stride * stride
        if kind == "full":
            self.up = nn.Sequential(nn.Conv2d(dim, dim, 3, padding=1), nn.GELU())
            self.image_stem = nn.Sequential(
                nn.Conv2d(stem_in, half, 3, padding=1), nn.GELU(), nn.Conv2d(half, half, 3, padding=1), nn.GELU()
            )
            self.head = nn.Sequential(
                nn.Conv2d(dim + half, half, 3, padding=1), nn.GELU(), nn.Conv2d(half, half, 3, padding=1), nn.GELU()
            )
        else:
            self.reduce = nn.Conv2d(dim, half, 1)
            self.up = nn.Sequential(*_separable(half), nn.GELU())
            self.image_stem = nn.Sequential(
                nn.Conv2d(stem_in, half, 3, padding=1), nn.GELU(), *_separable(half), nn.GELU()
            )
            # The last convolution stays a full 3x3: it is what refinement adapts per image (PerImageTail), and a
            # pointwise one there did not lower the soft objective in six steps where the 3x3 does (tested).
            self.head = nn.Sequential(
                nn.Conv2d(2 * half, half, 1), nn.GELU(), nn.Conv2d(half, half, 3, padding=1), nn.GELU()
            )
        # No bias: rankings ignore a constant offset, so its gradient is pure rounding noise that Adam would
        # amplify into a random walk.
        self.out = nn.Conv2d(half, 1, 1, bias=False)
        for module in self.modules():
            if isinstance(module, nn.Conv2d) and module.padding != (0, 0):
                module.padding_mode = padding  # type: ignore[assignment]  # one of DECODER_PADDINGS, checked above
        # Created after every other weight: the seeded initialisation of the rest is the same with or without it.
        self.distance_weight: nn.Parameter | None = None
        if reference is not None:
            self.distance_weight = nn.Parameter(torch.zeros(()))
            self.register_buffer("reference", reference.detach().float().reshape(1, 3, 1, 1).clone(), persistent=False)
        self.skip_weight: nn.Parameter | None = nn.Parameter(torch.ones(())) if pullback_skip else None
        self.upsample = GuidedUpsample(stride) if stride > 1 and upsample == "guided" else None
        self.prediction_weight: nn.Parameter | None = None
        if prediction_input:  # zeros, no random draw: the other weights' seeded initialisation is unchanged
            self.prediction_weight = nn.Parameter(torch.zeros(class_dim, num_classes))
        # channels_last convolution weights (and activations, see trunk): oneDNN's direct kernels skip the reorders
        # it otherwise does around every convolution; 1.3-1.4x faster decoder on the CPU (bench_floor, 32 and
        # 64 px). Same values up to rounding; a checkpoint stores the weights contiguous either way.
        self.to(memory_format=torch.channels_last)

    def forward(
        self, feats: list[torch.Tensor], x: torch.Tensor, target: torch.Tensor, extra: torch.Tensor | None = None
    ) -> torch.Tensor:
        """feats: levels (B, C_l, h_l, w_l), then the predicted distribution (B, K) where ``prediction_input``
        (:func:`with_prediction`); x: (B, 3, H, W) in [0, 1]; target: (B,) class ids; extra: (B, ``extra_channels``,
        H, W) per-pixel inputs beside the image (None where there are none) -> (B, H, W)."""
        return self.with_terms(self.out(self.head(self.trunk(feats, x, target, extra)))[:, 0], x, extra)

    def with_terms(self, maps: torch.Tensor, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """The output projection's maps (B, h, w) at the decoder's resolution, brought to the input's (B, H, W) (at
        ``stride`` > 1) plus the terms that skip the convolutions: the reference-distance term of x (B, 3, H, W)
        (see ``reference``) and the pullback skip of extra (B, ``extra_channels``, H, W) (see ``pullback_skip``);
        unchanged without them. The decoder's last layers end here, so refinement of a :class:`PerImageTail` adds
        them too."""
        if self.stride > 1:
            maps = self._to_input_size(maps, x)
        if self.distance_weight is not None:
            distance = torch.linalg.vector_norm(x.float() - self.reference, dim=1)
            maps = maps + self.distance_weight * torch.log(distance + DISTANCE_EPS)
        if self.skip_weight is not None:
            if extra is None:
                raise ValueError("the decoder's pullback skip needs the pullback input (extra), got None")
            maps = maps + self.skip_weight * extra[:, 0].to(maps.dtype)
        return maps

    def _to_input_size(self, maps: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """maps (B, h, w) with h = ceil(H / stride) -> (B, H, W), guided by x (B, 3, H, W) or bilinear."""
        height, width = x.shape[-2:]
        if self.upsample is None:
            size = (maps.shape[-2] * self.stride, maps.shape[-1] * self.stride)
            full = F.interpolate(maps[:, None], size=size, mode="bilinear", align_corners=False)[:, 0]
        else:
            full = self.upsample(maps, self._pad_to_stride(x))
        return full[:, :height, :width]

    def _pad_to_stride(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, C, H, W) padded on the bottom and right (edge pixels repeated) to multiples of ``stride``."""
        height, width = x.shape[-2:]
        bottom, right = -height % self.stride, -width % self.stride
        return F.pad(x, (0, right, 0, bottom), mode="replicate") if bottom or right else x

    def hidden(
        self,
        feats: list[torch.Tensor],
        x: torch.Tensor,
        target: torch.Tensor,
        depth: int,
        extra: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The activations (B, C, H, W) that enter the decoder's last ``depth`` layers (1: the output projection;
        2: also the head's last convolution, :attr:`tail_conv`), as :class:`PerImageTail` takes them; the inputs
        are :meth:`forward`'s."""
        if depth not in (1, 2):
            raise ValueError(f"depth must be 1 or 2, got {depth!r}")
        z = self.trunk(feats, x, target, extra)
        return self.head(z) if depth == 1 else self.head[:-2](z)

    @property
    def tail_conv(self) -> nn.Conv2d:
        """The head's last convolution (3x3), refined per image at depth 2."""
        conv = self.head[-2]
        assert isinstance(conv, nn.Conv2d)
        return conv

    def trunk(
        self, feats: list[torch.Tensor], x: torch.Tensor, target: torch.Tensor, extra: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Fused features at the decoder's resolution joined with the image stem: (B, dim + image_dim, h, w)
        ("full") or (B, 2 * image_dim, h, w) ("light"), h = ceil(H / stride) (H at stride 1); the inputs are
        :meth:`forward`'s."""
        got = 0 if extra is None else extra.shape[1]
        if got != self.extra_channels:
            raise ValueError(f"the decoder's stem takes {self.extra_channels} channels beside the image, got {got}")
        if extra is not None:
            x = torch.cat((x, extra.to(x.dtype)), dim=1)
        if self.stride > 1:  # each stride x stride block of pixels becomes channels of one position
            x = F.pixel_unshuffle(self._pad_to_stride(x), self.stride)
        emb = self.class_embed(target)
        if self.prediction_weight is not None:
            feats, probs = feats[:-1], feats[-1]
            classes = self.prediction_weight.shape[1]
            # The batch is compared only outside a trace, where it stays symbolic.
            if probs.ndim != 2 or probs.shape[1] != classes or (not _tracing() and len(probs) != len(target)):
                raise ValueError(
                    f"the decoder's last input must be the predicted distribution ({len(target)}, {classes}) "
                    f"(with_prediction), got {tuple(probs.shape)}"
                )
            emb = emb + probs.to(emb.dtype) @ self.prediction_weight.T
        elif feats and feats[-1].ndim == 2:
            raise ValueError("the decoder was built without prediction_input: pass the backbone's levels alone")
        if self.head_level is not None:
            feats = self._with_head_score(feats, target)
        emb = emb[:, :, None, None]
        cl = torch.channels_last
        height, width = x.shape[-2:]
        if self.stride > 1:  # a level finer than the decoder's resolution is averaged down to it
            feats = [_at_most(f, height, width) for f in feats]
        feats = [f.contiguous(memory_format=cl) if f.ndim == 4 else f for f in feats]
        x = x.contiguous(memory_format=cl)
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
        if self.kind == "light":
            fused = self.reduce(fused)  # upsample at the image encoding's width, not the fused one
        # x2 steps (shared weights) up to the decoder's resolution, then an exact resize for odd sizes. The conv runs at
        # least once so every parameter takes part in every step (DistributedDataParallel requires it).
        steps = max(0, math.ceil(math.log2(max(height / fused.shape[-2], width / fused.shape[-1]))))
        if steps == 0:
            fused = self.up(fused)
        for _ in range(steps):
            fused = self.up(F.interpolate(fused, scale_factor=2.0, mode="bilinear", align_corners=False))
        if fused.shape[-2:] != (height, width):  # an identity resize would still cost a pass over the map
            fused = F.interpolate(fused, size=(height, width), mode="bilinear", align_corners=False)
        return torch.cat((fused, self.image_stem(x)), dim=1)

    def _with_head_score(self, feats: list[torch.Tensor], target: torch.Tensor) -> list[torch.Tensor]:
        """feats with level ``head_level`` (B, C, h, w) joined by the head's score of ``target`` (B,) at each
        position, ``W_t · f(x, y)``, standardised per image (zero mean, unit root mean square): (B, C + 1, h, w)."""
        assert self.head_level is not None
        level = feats[self.head_level]
        score = torch.einsum("bchw,bc->bhw", level.float(), self.head_weight[target])[:, None]
        score = standardise(score, dim=(2, 3))  # a constant score (one position) is zeros
        joined = list(feats)
        joined[self.head_level] = torch.cat((level, score.to(level.dtype)), dim=1)
        return joined


def _at_most(level: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """level (B, C, h, w) averaged down to at most (height, width) per side; unchanged where it is not finer."""
    size = (min(level.shape[-2], height), min(level.shape[-1], width))
    if tuple(level.shape[-2:]) == size:
        return level
    if level.shape[-2] % size[0] == 0 and level.shape[-1] % size[1] == 0:  # the common case, 2-3x faster
        return F.avg_pool2d(level, (level.shape[-2] // size[0], level.shape[-1] // size[1]))
    return F.adaptive_avg_pool2d(level, size)


def classifier_head_weight(model: nn.Module, num_classes: int) -> torch.Tensor:
    """The weights (K, C) of ``model``'s classification head: its last ``nn.Linear`` with ``num_classes`` outputs
    (timm's ``head`` / ``fc``, torchvision's ``fc`` / ``heads.head`` / ``classifier[-1]``, a transformers model's
    ``classifier``), for ``AHAConfig.head_input``. A head of another kind is refused by name."""
    heads = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == num_classes]
    if not heads:
        raise ValueError(
            f"head_input needs a classification head that is an nn.Linear with {num_classes} outputs; "
            f"{type(model).__name__} has none"
        )
    return heads[-1].weight.detach()


def head_level(feature_channels: list[int], head_weight: torch.Tensor) -> int:
    """The deepest level (the last in tap order) whose width is the head's input, ``head_weight.shape[1]``."""
    width = head_weight.shape[1]
    for i in reversed(range(len(feature_channels))):
        if feature_channels[i] == width:
            return i
    raise ValueError(
        f"head_input: no tapped level has the {width} channels the classifier's head takes "
        f"(the levels have {feature_channels}); tap its last stage or block (layers=...)"
    )


def with_prediction(feats: list[torch.Tensor], logits: torch.Tensor) -> list[torch.Tensor]:
    """The decoder's inputs for ``AHAConfig.prediction_input``: the levels ``feats`` followed by the classifier's
    predicted distribution, the softmax of ``logits`` (B, K), in float32 (bounded whatever the logits' scale)."""
    return [*feats, torch.softmax(logits.float(), dim=1)]


def build_decoder(
    config: AHAConfig, feature_channels: list[int], classifier: Classifier, reference: torch.Tensor
) -> Decoder:
    """The :class:`Decoder` ``config`` describes over levels of ``feature_channels`` for ``classifier``'s classes:
    its widths, kind, padding, the reference-distance term (colour ``reference`` (3,), used only where
    ``config.reference_distance`` is on), the pullback input's stem channels and skip, the stride and upsampling,
    the head score (the classifier's head weights, :func:`classifier_head_weight`, where ``config.head_input``
    is on) and the predicted distribution's matrix (``config.prediction_input``). One place maps a config to a
    decoder, for the explainer and for the checkpoint check that builds it on the meta device."""
    return Decoder(
        feature_channels,
        classifier.num_classes,
        config.decoder_dim,
        config.class_dim,
        config.image_dim,
        config.decoder,
        reference if config.reference_distance else None,
        config.decoder_padding,
        PULLBACK_CHANNELS if config.pullback_input else 0,
        config.pullback_skip,
        config.decoder_stride,
        config.decoder_upsample,
        classifier_head_weight(classifier.model, classifier.num_classes) if config.head_input else None,
        config.prediction_input,
    )


class PerImageTail(nn.Module):
    """Per-image copies of a decoder's last ``depth`` layers, for test-time refinement.

    Image i's map is computed from its own copy only (a grouped convolution with one group per image, then a
    per-image output projection), so a gradient step on the summed objective moves each copy by its own image's
    gradient alone and a refined map never depends on the rest of its batch. Fine-tuning one shared decoder on the
    batch, as before, mixed every image's gradient into every map.

    Args:
        decoder: the trained decoder whose layers are copied (not modified).
        batch: number of images B.
        depth: 1 refines the output projection (``image_dim`` weights per image); 2 also the head's last
            convolution (:attr:`Decoder.tail_conv`).
    """

    def __init__(self, decoder: Decoder, batch: int, depth: int) -> None:
        super().__init__()
        if depth not in (1, 2):
            raise ValueError(f"depth must be 1 or 2, got {depth!r}")
        self.depth = depth
        out = decoder.out.weight.detach()[0, :, 0, 0]  # (C,)
        self.out = nn.Parameter(out.expand(batch, -1).clone())  # (B, C)
        if depth == 2:
            conv = decoder.tail_conv
            bias = conv.bias
            assert bias is not None  # every head convolution has one
            self.padding = conv.kernel_size[0] // 2
            self.padding_mode = conv.padding_mode  # "zeros" or "replicate", as the decoder pads
            self.weight = nn.Parameter(conv.weight.detach().repeat(batch, 1, 1, 1))  # (B * C, C, k, k)
            self.bias = nn.Parameter(bias.detach().repeat(batch))  # (B * C,)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (B, C, H, W) from :meth:`Decoder.hidden` at the same depth -> maps (B, H, W)."""
        if self.depth == 2:
            bsz, ch, height, width = hidden.shape
            flat = hidden.reshape(1, bsz * ch, height, width)
            padding = self.padding
            if self.padding_mode != "zeros":
                flat, padding = F.pad(flat, (padding,) * 4, mode=self.padding_mode), 0
            hidden = F.gelu(F.conv2d(flat, self.weight, self.bias, padding=padding, groups=bsz)).view_as(hidden)
        return torch.einsum("bchw,bc->bhw", hidden, self.out)
