"""AHAConfig: every knob of the AHA explainer and its training, validated in one place and frozen (derive a changed
config with ``dataclasses.replace``, which validates again)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from attr_engine.guards import check_count
from attr_engine.imageops import REFERENCES
from attr_engine.pullback import PULLBACK_METHODS
from attr_engine_kernels.validate import check_bool, check_int, check_int_at_least, check_non_negative, check_positive

# The decoder designs (attr_engine.aha.network.Decoder's ``kind``) and how its convolutions pad the frame.
DECODERS = ("full", "light")
DECODER_PADDINGS = ("zeros", "replicate")
# The decoder's output resolution, as the input side over the output side (AHAConfig.decoder_stride), and how a
# lower-resolution output is brought to the input's (AHAConfig.decoder_upsample).
DECODER_STRIDES = (1, 2, 4, 8)
DECODER_UPSAMPLES = ("guided", "bilinear")

FRACTION_SAMPLING = ("linspace", "random")
TARGET_MODES = ("pred+label", "pred")
SCORE_NORMS = ("raw", "zscore")
# How a training step draws the reference of each curve (see AHAConfig.reference_draw).
REFERENCE_DRAWS = ("step", "image", "signal")
# What test-time refinement steps (AHA._refine): the map itself, or per-image copies of the decoder's last layers.
REFINE_MODES = ("map", "decoder")
# How the teacher is taught (AHAConfig.teacher_loss; attr_engine.aha.teacher.teacher_loss).
TEACHER_LOSSES = ("ranking", "pixel")

# The official grid range at 224 px is 7..28 cells; the rule below reproduces it there and keeps cells of at least
# MIN_CELL_PX pixels and at least MIN_GRID cells per side (where the image allows) at every other size.
MAX_GRID = 28
MIN_GRID = 4
MIN_CELL_PX = 2


def grid_rule(height: int, width: int | None = None) -> tuple[int, int]:
    """Default inclusive (min, max) grid range for an image of ``height`` x ``width`` (``width`` None: square).

    ``g_max = min(28, side // 2)`` and ``g_min = max(4, g_max // 4)`` (both clipped to ``[1, g_max]``), with
    ``side = min(H, W)``: the region grid is g x g over the whole image (``attr_engine_kernels.region_pool`` needs
    ``g <= min(H, W)``), so the short side bounds it. This gives 7..28 at 224 px (the official range), 7..28 at
    64 px (cells of 2.3..9 px), 4..16 at 32 px and 4..8 at 16 px. The range of the earlier rule, ``(side / 32,
    side / 8)``, scaled the official cell sizes instead: 1..4 cells at 32 px, where a 1 x 1 grid ranks nothing.
    """
    check_int_at_least(height, "height", 1)
    side = height if width is None else min(height, check_int_at_least(width, "width", 1))
    g_max = max(1, min(MAX_GRID, side // MIN_CELL_PX))
    g_min = min(g_max, max(MIN_GRID, g_max // 4))
    return g_min, g_max


# The config's on/off fields, checked to be bools.
_FLAGS = (
    "backbone_pretrained",
    "random_offset",
    "amp",
    "reference_distance",
    "pullback_input",
    "pullback_skip",
    "head_input",
    "prediction_input",
)


@dataclass(frozen=True)
class AHAConfig:
    """Configuration of an AHA explainer (architecture, soft-AUC loss, optimiser, test-time refinement).

    Frozen and validated in ``__post_init__``. Resolution-dependent sizes default to ``None`` and are derived from
    the image's short side by :meth:`resolved`. Origin of each default in brackets: official (AHA code / paper),
    scaled (official 224 px value scaled with the side), measured (a bench in benches/README.md), project (a choice
    of this project). The notes and measurements behind each field are in docs/aha_config.md.

    Attributes:
        backbone: timm model name tapped instead of the classifier's own backbone; None = the classifier's. [project]
        backbone_pretrained: load ``backbone``'s pretrained weights. [project]
        layers: backbone block/stage indices to tap; None = 4 evenly spaced blocks (ViT), every stage (CNN). [official]
        decoder_dim: channels of the fused decoder (64). [project]
        class_dim: size of the class embedding joined to every feature position (32). [project]
        image_dim: channels of the full-resolution image encoding; None = max(8, decoder_dim // 2). [project]
        decoder: "full" (3x3 convolutions) or "light" (depthwise-separable stages at high resolution). [project]
        decoder_padding: how the decoder's 3x3 convolutions pad the frame: "zeros" or "replicate" (the edge
            pixels repeated, so the frame's outer rows see no artificial dark border) ("zeros"). [measured]
        decoder_stride: the decoder runs at 1/``decoder_stride`` of the input side (1, 2, 4 or 8): its image stem
            reads the image's ``stride x stride`` pixel blocks as channels, its upsampling and head stop there, and
            the map is brought to the input resolution by ``decoder_upsample``; the decoder's cost then follows
            the backbone's grid, not the image's pixels (1: the full-resolution decoder). [project]
        decoder_upsample: how a ``decoder_stride`` > 1 map reaches the input resolution: "guided" (each pixel a
            softmax-weighted mean of the 3 x 3 nearest low-resolution scores, weighted by distance and by how close
            the pixel's colour is to each cell's mean colour, with a learned colour scale: a joint bilateral
            upsampling that keeps object boundaries) or "bilinear" ("guided"). [project]
        reference_distance: add a learned multiple of log(|x - r|) to the map, r the mean colour, to order the
            pixels inside a cell (False). [measured]
        pullback_input: the decoder also sees the classifier's pullback for the target class, as two channels
            (its product with x - r and its magnitude); more forward and backward passes of the classifier per
            map, and such an explainer cannot be exported (False). [measured]
        pullback_method: which pullback ``pullback_input`` feeds: "soft" (Soft Pullback, one forward and
            backward) or "ascent" (Pullback Ascent's ``x_K - x_0``, K = 5 of them) ("soft"). [measured]
        pullback_skip: the map also adds a learned multiple (starting at 1) of the pullback input's ``v·(x − r)``
            channel, so that training starts from the pullback's ranking; needs ``pullback_input`` (False).
            [measured]
        head_input: the deepest tap whose width is the classifier head's input also gets the head's score of the
            target class at each of its positions (``W_t · f(x, y)``: the class activation map of a pooled linear
            head), one channel standardised per image; no backward pass, exported; needs the classifier's own
            backbone (False). [measured]
        prediction_input: the classifier's predicted distribution (the softmax of its logits, from the pass that
            gives the decoder's levels) also conditions the decoder, through a learned matrix onto the class
            embedding; no backward pass, exported (False). [measured]
        grid_range: inclusive (min, max) grid per step; None = :func:`grid_rule` of the short side. [official/measured]
        random_offset: shift the grid's cell boundaries by a random sub-cell offset each step (True). [project]
        tau_start: Sinkhorn temperature at the first step (1.0), annealed linearly to ``tau_end``. [official]
        tau_end: Sinkhorn temperature at the last step (0.3). [official]
        n_iters: Sinkhorn iterations (30). [official]
        noise: Gumbel noise scale of the sorter (1.0). [official]
        n_fractions: perturbation fractions S per curve (16). [official]
        fraction_sampling: "linspace" (fixed, with endpoints) or "random" (sorted uniform plus endpoints). [official]
        references: reference images drawn from each step ("black", "mean", "blur"). [official]
        reference_draw: how ``references`` are drawn: "step" (one for the whole step), "image" (one per image) or
            "signal" (the step's, except for a curve it leaves flat: one that moves that curve's target
            probability, and flat curves left out of the loss's mean) ("step"). [official]
        peak_weight: weight of the peak penalty mean(relu(A - avgpool(A))^2) (0.0025). [official]
        peak_kernel: peak-penalty window in px; None = 15 px at 224 px, odd, >= 3. [scaled]
        mask_sigma: Gaussian blur (px) of the upsampled masks before blending; None = 1.0 at 224 px, 0 = off. [scaled]
        score_norm: what enters the sorter: "zscore" (per-image standardised) or "raw" (as pooled). [measured]
        anchor_span: span of the rank anchors the z-scores are matched against (4.0). [project]
        targets: "pred+label" (the prediction and the label or runner-up) or "pred". [project]
        teacher_weight: weight of the teacher's loss (``teacher_loss``) on the predicted class's maps against
            each training image's per-image optimum, beside the soft-AUC loss; 0 = no teacher, and ``fit`` then
            takes none (0.0). [project]
        teacher_loss: what the teacher's loss compares (:func:`attr_engine.aha.teacher.teacher_loss`): "ranking"
            (the ranking of the step's region scores, ListNet's top-one KL divergence) or "pixel" (the z-scored
            maps pixel by pixel, mean squared difference: it also sees a change within a region) ("ranking").
            [project]
        lr: AdamW learning rate (3e-4). [official]
        weight_decay: AdamW weight decay (1e-3). [official]
        warmup: fraction of the steps spent in linear warm-up before cosine decay (0.06). [official]
        grad_clip: gradient-norm clip (1.0). [official]
        seed: seed of the training run (42). [official]
        amp: bf16 autocast of the classifier on CUDA (True). [official]
        refine_mode: what refinement steps: "map" (each image's map, free values) or "decoder" (per-image copies of
            the decoder's last layers) ("map"). [measured]
        refine_map_lr: Adam step size of "map" refinement, in standard deviations of the map (0.1). [measured]
        refine_smooth: "map" refinement moves the map by a Gaussian blur of its free values, sigma this fraction of
            the finest refinement cell's side (0 = off, 0.0). [measured]
        refine_lr: Adam step size of "decoder" refinement (1e-3). [measured]
        refine_depth: decoder layers "decoder" refinement copies per image, 2 or 1 (2). [measured]
        refine_fractions: fractions per refinement curve (6). [measured]
        refine_grid_range: grids of refinement steps; None = the lower half of ``grid_range``. [measured]
        val_every: optimiser steps between two validation scores (50). [project]
        patience: validation scores without improvement before training stops (5). [project]
        min_delta: gain of the validation composite that counts as an improvement (1e-3). [project]
        val_fractions: fraction intervals of each validation curve (8). [project]
    """

    backbone: str | None = None
    backbone_pretrained: bool = False
    layers: tuple[int, ...] | None = None
    decoder_dim: int = 64
    class_dim: int = 32
    image_dim: int | None = None
    decoder: str = "full"
    decoder_padding: str = "zeros"
    decoder_stride: int = 1
    decoder_upsample: str = "guided"
    reference_distance: bool = False
    pullback_input: bool = False
    pullback_method: str = "soft"
    pullback_skip: bool = False
    head_input: bool = False
    prediction_input: bool = False

    grid_range: tuple[int, int] | None = None
    random_offset: bool = True
    tau_start: float = 1.0
    tau_end: float = 0.3
    n_iters: int = 30
    noise: float = 1.0
    n_fractions: int = 16
    fraction_sampling: str = "linspace"
    references: tuple[str, ...] = REFERENCES
    reference_draw: str = "step"
    peak_weight: float = 0.0025
    peak_kernel: int | None = None
    mask_sigma: float | None = None
    score_norm: str = "zscore"
    anchor_span: float = 4.0
    targets: str = "pred+label"
    teacher_weight: float = 0.0
    teacher_loss: str = "ranking"

    lr: float = 3e-4
    weight_decay: float = 1e-3
    warmup: float = 0.06
    grad_clip: float = 1.0
    seed: int = 42
    amp: bool = True

    refine_mode: str = "map"
    refine_map_lr: float = 0.1
    refine_smooth: float = 0.0
    refine_lr: float = 1e-3
    refine_depth: int = 2
    refine_fractions: int = 6
    refine_grid_range: tuple[int, int] | None = None

    val_every: int = 50
    patience: int = 5
    min_delta: float = 1e-3
    val_fractions: int = 8

    def __post_init__(self) -> None:
        # Frozen: normalised values (lists from JSON -> tuples, ints -> floats) are written with object.__setattr__.
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if self.backbone is not None and (not isinstance(self.backbone, str) or not self.backbone):
            raise ValueError(f"backbone must be None or a timm model name, got {self.backbone!r}")
        for name in _FLAGS:
            check_bool(getattr(self, name), name)
        if self.layers is not None:
            put("layers", _int_tuple(self.layers, "layers"))
        check_int_at_least(self.decoder_dim, "decoder_dim", 1)
        check_int_at_least(self.class_dim, "class_dim", 1)
        if self.image_dim is not None:
            check_int_at_least(self.image_dim, "image_dim", 1)
        if self.decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {DECODERS}, got {self.decoder!r}")
        if self.decoder_padding not in DECODER_PADDINGS:
            raise ValueError(f"decoder_padding must be one of {DECODER_PADDINGS}, got {self.decoder_padding!r}")
        if check_int(self.decoder_stride, "decoder_stride") not in DECODER_STRIDES:
            raise ValueError(f"decoder_stride must be one of {DECODER_STRIDES}, got {self.decoder_stride!r}")
        if self.decoder_upsample not in DECODER_UPSAMPLES:
            raise ValueError(f"decoder_upsample must be one of {DECODER_UPSAMPLES}, got {self.decoder_upsample!r}")
        if self.pullback_method not in PULLBACK_METHODS:
            raise ValueError(f"pullback_method must be one of {PULLBACK_METHODS}, got {self.pullback_method!r}")
        if self.pullback_skip and not self.pullback_input:
            raise ValueError("pullback_skip adds the pullback input's channel to the map: set pullback_input=True")
        if self.head_input and self.backbone is not None:
            raise ValueError("head_input scores the classifier's own features with its head: leave backbone None")
        check_int_at_least(self.n_iters, "n_iters", 1)
        check_count(self.n_fractions, "n_fractions")  # a curve needs two points
        check_int_at_least(self.refine_fractions, "refine_fractions", 2)
        check_count(self.val_every, "val_every")
        check_count(self.patience, "patience")
        # One interval has only the two ends, which do not depend on the map: the score could never change.
        check_int_at_least(self.val_fractions, "val_fractions", 2)
        put("min_delta", check_non_negative(self.min_delta, "min_delta"))
        put("refine_smooth", check_non_negative(self.refine_smooth, "refine_smooth"))
        if check_int(self.refine_depth, "refine_depth") not in (1, 2):
            raise ValueError(f"refine_depth must be 1 or 2 (decoder layers refined per image), got {self.refine_depth}")
        for name in ("grid_range", "refine_grid_range"):
            value = getattr(self, name)
            if value is not None:
                pair = _int_tuple(value, name)
                if len(pair) != 2 or not 1 <= pair[0] <= pair[1]:
                    raise ValueError(f"{name} must be (min, max) with 1 <= min <= max, got {value!r}")
                put(name, pair)
        if self.teacher_loss not in TEACHER_LOSSES:
            raise ValueError(f"teacher_loss must be one of {TEACHER_LOSSES}, got {self.teacher_loss!r}")
        if self.refine_mode not in REFINE_MODES:
            raise ValueError(f"refine_mode must be one of {REFINE_MODES}, got {self.refine_mode!r}")
        for name in ("tau_start", "tau_end", "lr", "refine_lr", "refine_map_lr"):
            put(name, check_positive(getattr(self, name), name))
        for name in ("noise", "peak_weight", "weight_decay", "grad_clip", "teacher_weight"):
            put(name, check_non_negative(getattr(self, name), name))
        put("warmup", check_non_negative(self.warmup, "warmup"))
        if not self.warmup < 1:
            raise ValueError(f"warmup is a fraction of the steps in [0, 1), got {self.warmup!r}")
        check_int(self.seed, "seed")
        if self.fraction_sampling not in FRACTION_SAMPLING:
            raise ValueError(f"fraction_sampling must be one of {FRACTION_SAMPLING}, got {self.fraction_sampling!r}")
        if isinstance(self.references, str):  # tuple("mean") would be ("m", "e", "a", "n")
            raise ValueError(f"references must be a sequence of names from {REFERENCES}, got {self.references!r}")
        put("references", tuple(self.references))
        if not self.references or any(r not in REFERENCES for r in self.references):
            raise ValueError(f"references must be a non-empty subset of {REFERENCES}, got {self.references!r}")
        if self.reference_draw not in REFERENCE_DRAWS:
            raise ValueError(f"reference_draw must be one of {REFERENCE_DRAWS}, got {self.reference_draw!r}")
        if self.score_norm not in SCORE_NORMS:
            raise ValueError(f"score_norm must be one of {SCORE_NORMS}, got {self.score_norm!r}")
        put("anchor_span", check_positive(self.anchor_span, "anchor_span"))
        if self.targets not in TARGET_MODES:
            raise ValueError(f"targets must be one of {TARGET_MODES}, got {self.targets!r}")
        if self.peak_kernel is not None and check_int_at_least(self.peak_kernel, "peak_kernel", 1) % 2 == 0:
            raise ValueError(f"peak_kernel must be a positive odd int, got {self.peak_kernel!r}")
        if self.mask_sigma is not None:
            put("mask_sigma", check_non_negative(self.mask_sigma, "mask_sigma"))

    def resolved(self, img_size: int | tuple[int, int]) -> AHAConfig:
        """A copy with the size-dependent defaults filled in for images of side ``img_size`` (or ``(H, W)``).

        The one place a grid range meets an image size: the grid range follows :func:`grid_rule` on the short side,
        and an explicit range (the training one and the refinement one) is clipped to it, since a grid may not
        exceed ``min(H, W)`` (``attr_engine_kernels.region_pool``). The peak window and the mask blur scale with the
        short side too. On a resolved config only the clipping is left to do, so training and refinement call it
        again with the shape of the images they are given, which may be smaller than the explainer's ``img_size``.
        """
        height, width = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        side = min(check_int_at_least(height, "img_size", 1), check_int_at_least(width, "img_size", 1))
        grid_range = self.grid_range or grid_rule(height, width)
        grid_range = (min(grid_range[0], side), min(grid_range[1], side))
        # Refinement: the lower half of the training range (see the class docstring, "Test-time refinement").
        refine = self.refine_grid_range or (grid_range[0], max(grid_range[0], grid_range[1] // 2))
        refine = (min(refine[0], side), min(refine[1], side))
        peak_kernel = self.peak_kernel or max(3, round(15 * side / 224) | 1)
        mask_sigma = 1.0 * side / 224 if self.mask_sigma is None else self.mask_sigma
        return dataclasses.replace(
            self, grid_range=grid_range, refine_grid_range=refine, peak_kernel=peak_kernel, mask_sigma=mask_sigma
        )

    def loss_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`~attr_engine.aha.loss.soft_auc_loss` this config sets, the same for a
        training step and a refinement step: ``n_iters``, ``peak_weight``, ``peak_kernel``, ``mask_sigma``,
        ``score_norm``, ``anchor_span`` and ``amp``.

        What differs between the two is passed beside them: the grid, offset and fractions drawn for the step, the
        temperature (annealed in training, ``tau_end`` in refinement), the Gumbel noise (off in refinement) and the
        curves' fixed ends (refinement). An unresolved config gives the loss's own fallbacks (a 3 px peak window,
        no mask smoothing); :meth:`resolved` fills both in.
        """
        return {
            "n_iters": self.n_iters,
            "peak_weight": self.peak_weight,
            "peak_kernel": self.peak_kernel or 3,
            "mask_sigma": self.mask_sigma or 0.0,
            "score_norm": self.score_norm,
            "anchor_span": self.anchor_span,
            "amp": self.amp,
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (tuples become lists)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AHAConfig:
        """Inverse of :meth:`to_dict`, for what JSON or YAML gives back (a checkpoint's ``config.json``, the CLI's
        config file and ``--aha-option``): lists become tuples here, and nowhere else, so a config read back equals
        and hashes like the one written. Unknown keys are an error so a typo never passes silently."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown AHAConfig fields: {', '.join(unknown)}")
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**fields)


def _int_tuple(values: Any, name: str) -> tuple[int, ...]:
    """A sequence of integers as a tuple (JSON gives lists), each checked."""
    if isinstance(values, str) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name} must be a sequence of integers, got {values!r}")
    return tuple(check_int(v, name) for v in values)
