"""The model adapter every attribution method talks to: [0, 1] RGB in, logits out, weights frozen.

Attribution methods perturb, blend and differentiate *images*, so the classifier boundary is fixed at RGB in
[0, 1]; the model's own normalisation lives inside :class:`Classifier` as buffers. The wrapped model is frozen
(eval mode, no parameter gradients): gradients still flow to the input, which is what attribution needs, and
BatchNorm/dropout never change behaviour between the forward passes an explanation compares.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import os
import re
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import timm
import torch
from torch import nn

from attr_engine.checkpoint import check_state_shapes, load_safetensors, save_safetensors
from attr_engine.guards import (
    CLASSIFIER_FILE,
    CLASSIFIER_FORMAT,
    MAX_IMG_SIZE,
    check_checkpoint_file,
    check_model_name_path,
    checkpoint_given_as_name,
    not_a_classifier_hint,
)
from attr_engine.model_sources import (
    as_hf_adapter,
    build_torchvision,
    check_torchvision_name,
    hub_reachable_or_offline,
    is_hf_classifier,
    is_torchvision_vit,
    load_hf,
    split_source,
)
from attr_engine_kernels.validate import check_int_at_least, check_tensor

__all__ = [
    "CPU_PIXELS_PER_CALL",
    "MAX_FILE_IMG_SIZE",
    "Classifier",
    "accepts_img_size",
    "check_against_weights",
    "check_device",
    "check_model_name",
    "checkpoint_class_names",
    "checkpoint_model_name",
    "classifier_fingerprint",
    "eval_mode",
    "file_int",
    "images_per_call",
    "input_dtype",
    "is_external_name",
    "load_classifier",
    "load_error",
    "model_device",
    "resolve_targets",
    "save_classifier",
]

# Marks a safetensors file written by save_classifier; its metadata can rebuild the architecture.
_CHECKPOINT_FORMAT = CLASSIFIER_FORMAT
# Model kwargs a checkpoint may not set: timm reads files, caches or the network through these (checkpoint_path is
# even unpickled with torch.load), and pretrained_cfg(_overlay) may name a file. Only the caller may pass them.
# Matched on the name's last segment for paths (drop_path_rate is an ordinary architecture argument).
# torchvision's ``weights`` would download them.
_UNSAFE_KWARG = re.compile(
    r"(^|_)(path|file|dir|url|hub|weights)s?$|pretrained|checkpoint|cfg|cache|download", re.IGNORECASE
)


# The largest input side a file may set (guards.MAX_IMG_SIZE, which bounds --img-size too).
MAX_FILE_IMG_SIZE = MAX_IMG_SIZE


def file_int(value: Any, name: str, source: object, *, high: int | None = None) -> int:
    """An integer a file sets (JSON / safetensors metadata), in ``[1, high]``: a ValueError naming the file if not."""
    try:
        number = int(value) if isinstance(value, str) else value
    except ValueError:
        number = None
    if not isinstance(number, int) or isinstance(number, bool) or number < 1 or (high is not None and number > high):
        bound = f" <= {high}" if high is not None else ""
        raise ValueError(f"{source}: corrupt metadata: {name} must be an integer >= 1{bound}, got {value!r}")
    return number


def check_against_weights(
    name: str, create_kwargs: dict[str, Any], state: dict[str, torch.Tensor], source: object
) -> None:
    """Refuse a checkpoint whose sizes (``num_classes``, ``img_size``, model kwargs) do not fit its own weights,
    before the model is allocated.

    The model is built on the meta device (shapes only, no memory), so a file claiming ten million classes or a
    100000 px ViT is refused here instead of exhausting memory in the real build. Models that cannot be built on
    the meta device skip this check; the real build's strict state-dict load still catches any mismatch.
    """
    kind, ident = split_source(name)
    try:
        with torch.device("meta"):
            if kind == "torchvision":
                kwargs = dict(create_kwargs)
                probe = build_torchvision(
                    ident, num_classes=kwargs.pop("num_classes", None), img_size=kwargs.pop("img_size", None), **kwargs
                )
            else:
                probe = timm.create_model(name, pretrained=False, **create_kwargs)
    except Exception:  # any failure of the shape-only build: the real build reports it in its own words
        return
    check_state_shapes(probe, state, source, f"{name} with {create_kwargs}")


def _plain_json(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, list) and all(_plain_json(v) for v in value)


def _checkpoint_kwargs(raw: str, source: object) -> dict[str, Any]:
    """Model kwargs stored in a checkpoint: a JSON object of plain values whose keys open nothing else."""
    try:
        kwargs = json.loads(raw)
    except ValueError as err:
        raise ValueError(f"{source}: corrupt classifier metadata: model_kwargs is not JSON ({err})") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"{source}: model_kwargs must be a JSON object, got {type(kwargs).__name__}")
    for key, value in kwargs.items():
        if _UNSAFE_KWARG.search(key):
            raise ValueError(
                f"{source}: refusing model kwarg {key!r} from a checkpoint (it could make the loader open other files "
                "or the network); pass it to load_classifier yourself if you mean it"
            )
        if not _plain_json(value):
            raise ValueError(f"{source}: model kwarg {key!r} must be a plain JSON value or list, got {value!r}")
    return kwargs


def _as_triple(values: Sequence[float] | torch.Tensor, name: str) -> tuple[float, float, float]:
    try:
        triple = tuple(float(v) for v in (values.tolist() if isinstance(values, torch.Tensor) else values))
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be three numbers (one per RGB channel), got {values!r}") from None
    if len(triple) != 3:
        raise ValueError(f"{name} must have 3 entries (one per RGB channel), got {len(triple)}")
    if not all(abs(v) < float("inf") for v in triple):
        raise ValueError(f"{name} must be finite, got {triple}")
    return triple


def _model_input_size(model: nn.Module) -> tuple[int, int, int] | None:
    """Best-known (C, H, W) the model expects: a fixed patch-embed grid (timm), a torchvision ViT's ``image_size`` or
    a transformers config's beat the pretrained config."""
    img_size = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if img_size is None and is_torchvision_vit(model):
        img_size = getattr(model, "image_size", None)
    if img_size is None and is_hf_classifier(model):
        img_size = getattr(model.config, "image_size", None)
    if img_size is not None:
        h, w = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        return (3, int(h), int(w))
    cfg = getattr(model, "pretrained_cfg", None) or {}
    size = cfg.get("input_size")
    if size is not None and len(size) == 3:
        return tuple(int(s) for s in size)  # type: ignore[return-value]
    return None


def input_dtype(model: nn.Module) -> torch.dtype | None:
    """The floating dtype ``model`` computes in (its first floating parameter, else buffer), or None if it has none.

    Attribution methods cast images to it at their boundary, so fp16 / bf16 / float64 images work with a float32
    model (and the reverse) instead of failing deep inside with torch's dtype mismatch.
    """
    for tensors in (model.parameters(), model.buffers()):
        for t in tensors:
            if t.is_floating_point():
                return t.dtype
    return None


# The most pixels one differentiated classifier call takes on a CPU: 16 images of 224 x 224. Its activations (and
# those kept for the backward) grow with the pixels of the call, and the methods that batch many variants of an
# image (Integrated Gradients' path points, AHA's blends) would otherwise hold gigabytes at 224 px
# (benches/README.md, "Memory on a CPU").
CPU_PIXELS_PER_CALL = 16 * 224 * 224


def images_per_call(height: int, width: int, device: torch.device | str) -> int | None:
    """How many (3, ``height``, ``width``) images one differentiated classifier call should take on ``device``.

    On a CPU, as many as fit in :data:`CPU_PIXELS_PER_CALL` pixels (at least one), so host memory stays bounded
    whatever the image size; None (no limit) on accelerators, whose callers keep their own batching.
    """
    if torch.device(device).type != "cpu":
        return None
    return max(1, CPU_PIXELS_PER_CALL // max(1, int(height) * int(width)))


def model_device(model: nn.Module) -> torch.device | None:
    """The device of ``model``'s first parameter (else buffer), or None for a model without tensors."""
    for tensors in (model.parameters(), model.buffers()):
        for t in tensors:
            return t.device
    return None


def check_device(x: torch.Tensor, model: nn.Module, name: str = "x") -> None:
    """Raise a ValueError naming both devices unless ``x`` holds data on ``model``'s device.

    Checked before anything reads values (a finiteness check on a meta tensor would otherwise fail in ``.item()``,
    and a device mismatch deep inside the first layer).
    """
    if not isinstance(x, torch.Tensor):
        return  # the type is reported by the tensor checks that follow
    device = model_device(model)
    if x.device.type == "meta":
        where = f"; move it to the classifier's device ({device})" if device is not None else ""
        raise ValueError(f"{name} is on the meta device, which holds no values to explain{where}")
    if device is not None and device.type == "meta":
        raise ValueError(f"the classifier is on the meta device (no weights loaded) but {name} is on {x.device}")
    if device is not None and device != x.device:
        raise ValueError(
            f"{name} is on {x.device} but the classifier is on {device}; move one of them, e.g. x.to({str(device)!r})"
        )


class Classifier(nn.Module):
    """A frozen image classifier taking RGB images in [0, 1].

    ``forward(x)`` computes ``model((x - mean) / std)``.

    Args:
        model: any classifier mapping normalised ``(B, 3, H, W)`` images to ``(B, K)`` logits. It is frozen *in
            place* (``requires_grad_(False)``, eval mode). A transformers ``*ForImageClassification`` model is
            wrapped in :class:`~attr_engine.model_sources.HFImageClassifier` first (``.model`` is the wrapper).
        mean, std: per-channel normalisation. ``None`` takes them from ``model.pretrained_cfg`` (timm models);
            for other models they must be given (pass ``(0, 0, 0)`` / ``(1, 1, 1)`` for models trained on raw
            [0, 1] pixels).
        input_size: ``(C, H, W)`` the model was built for; ``None`` infers it from a fixed patch embedding or the
            timm pretrained config, and stays ``None`` if neither exists.
        num_classes: number of logits; ``None`` reads ``model.num_classes`` or, failing that, runs one probe
            forward pass on first access.
        validate_inputs: check every input (rank, channels, dtype, finiteness). The finiteness check forces a
            host-device sync, so hot loops on GPU may turn it off.

    Frozen means frozen: ``.train(True)`` is accepted (so a parent module's ``.train()`` works) but leaves the
    wrapped model in eval mode and ``self.training`` False. Code that really wants to fine-tune calls
    ``classifier.model.train()`` and re-enables gradients itself, then ``classifier.freeze()``
    (``train_classifier`` does exactly this).

    Input values outside [0, 1] are not rejected: perturbation baselines (noise, blur) legitimately overshoot.

    Example:
        >>> clf = load_classifier("resnet18", num_classes=10)  # doctest: +SKIP
        >>> logits = clf(torch.rand(2, 3, 224, 224))  # (2, 10)  # doctest: +SKIP
    """

    # Registered as buffers in __init__ (nn.Module.__getattr__ returns them); declared so they type as tensors.
    norm_mean: torch.Tensor  # (1, 3, 1, 1)
    norm_std: torch.Tensor  # (1, 3, 1, 1)

    def __init__(
        self,
        model: nn.Module,
        mean: Sequence[float] | torch.Tensor | None = None,
        std: Sequence[float] | torch.Tensor | None = None,
        *,
        input_size: Sequence[int] | None = None,
        num_classes: int | None = None,
        validate_inputs: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"model must be a torch.nn.Module, got {type(model).__name__}{not_a_classifier_hint(model)}"
            )
        model = as_hf_adapter(model)  # a raw transformers image classifier: pixel_values in, an output object out
        cfg = getattr(model, "pretrained_cfg", None) or {}
        if mean is None:
            mean = cfg.get("mean")
        if std is None:
            std = cfg.get("std")
        if mean is None or std is None:
            raise ValueError(
                f"{type(model).__name__} has no pretrained_cfg to read mean/std from; pass mean= and std= "
                "(e.g. the ImageNet values, or (0, 0, 0) and (1, 1, 1) for a model trained on raw [0, 1] pixels)"
            )
        mean_t, std_t = _as_triple(mean, "mean"), _as_triple(std, "std")
        if not all(s > 0 for s in std_t):
            raise ValueError(f"std must be positive, got {std_t}")
        if input_size is not None:
            input_size = tuple(int(s) for s in input_size)
            if len(input_size) != 3 or input_size[0] != 3 or min(input_size) < 1:
                raise ValueError(f"input_size must be (3, H, W) with positive H and W, got {input_size}")
        else:
            input_size = _model_input_size(model)
        if num_classes is None:
            attr = getattr(model, "num_classes", None)
            num_classes = attr if isinstance(attr, int) and attr > 0 else None
        else:
            check_int_at_least(num_classes, "num_classes", 1)

        self._model = model
        self._input_size: tuple[int, int, int] | None = input_size
        self._num_classes: int | None = num_classes
        self.validate_inputs = validate_inputs
        # Set by load_classifier / train_classifier so save_classifier can record how to rebuild the model.
        self.model_name: str | None = None
        self.model_kwargs: dict[str, Any] = {}
        param = next(model.parameters(), None)
        device = param.device if param is not None else None
        # (1, 3, 1, 1) so they broadcast over (B, 3, H, W); saved with the state dict so a checkpoint is complete.
        self.register_buffer("norm_mean", torch.tensor(mean_t, device=device).view(1, 3, 1, 1))
        self.register_buffer("norm_std", torch.tensor(std_t, device=device).view(1, 3, 1, 1))
        self.freeze()

    @property
    def model(self) -> nn.Module:
        """The wrapped (frozen) model, which expects normalised input."""
        return self._model

    @property
    def mean(self) -> tuple[float, float, float]:
        """Per-channel normalisation mean."""
        return tuple(self.norm_mean.flatten().tolist())

    @property
    def std(self) -> tuple[float, float, float]:
        """Per-channel normalisation standard deviation."""
        return tuple(self.norm_std.flatten().tolist())

    @property
    def input_size(self) -> tuple[int, int, int] | None:
        """``(3, H, W)`` the model was built or trained for, or ``None`` if unknown."""
        return self._input_size

    @property
    def num_classes(self) -> int:
        """Number of logits K."""
        if self._num_classes is None:
            _, h, w = self._input_size or (3, 224, 224)
            probe = torch.zeros(1, 3, h, w, device=self.norm_mean.device, dtype=self.norm_mean.dtype)
            with torch.no_grad():
                self._num_classes = int(self.forward(probe).shape[-1])
        return self._num_classes

    def freeze(self) -> Classifier:
        """Put the wrapped model in eval mode and turn off its parameter gradients; returns ``self``."""
        self._model.requires_grad_(False)
        self._model.eval()
        self.training = False
        return self

    def train(self, mode: bool = True) -> Classifier:
        """Keep eval mode whatever ``mode`` says (see the class docstring)."""
        return self.freeze()

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``x: (B, 3, H, W)`` in [0, 1] -> the model's normalised input, same shape and dtype."""
        return (x - self.norm_mean.to(x.dtype)) / self.norm_std.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: (B, 3, H, W)`` RGB in [0, 1], any floating dtype (cast to the model's) -> logits ``(B, K)``.

        Raises:
            ValueError: if ``x`` is not a finite floating-point ``(B, 3, H, W)`` tensor (when ``validate_inputs``).
        """
        return self._logits(x, finite=True)

    def forward_trusted(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` without the check that reads ``x`` (finiteness): for engine loops (training steps,
        metric chunks) whose images were validated once at their entry point. On a GPU that check is a host-device
        synchronisation per call; shapes, channels and devices are still checked. ``x: (B, 3, H, W)`` -> ``(B, K)``.
        """
        return self._logits(x, finite=False)

    def _logits(self, x: torch.Tensor, *, finite: bool) -> torch.Tensor:
        if self.validate_inputs:
            check_device(x, self)
            check_tensor(x, "x", ndim=4, finite=finite)
            if x.shape[1] != 3:
                raise ValueError(f"x must be RGB images (B, 3, H, W), got {x.shape[1]} channels: {tuple(x.shape)}")
            _check_patch_grid(self._model, x)
        dtype = input_dtype(self._model)
        if dtype is not None and x.dtype != dtype:
            x = x.to(dtype)  # differentiable: the input gradient comes back in the caller's dtype
        logits = self._model(self.normalize(x))
        if logits.ndim != 2:
            raise ValueError(f"the wrapped model must return (B, K) logits, got shape {tuple(logits.shape)}")
        return logits

    def extra_repr(self) -> str:
        return f"mean={self.mean}, std={self.std}, input_size={self._input_size}"


def _check_patch_grid(model: nn.Module, x: torch.Tensor) -> None:
    """A ValueError naming the size a timm ViT takes, where its patch embedding would assert on ``x`` (B, 3, H, W):
    a model built for a fixed size (``strict_img_size``) takes that size only, others a multiple of the patch."""
    embed = getattr(model, "patch_embed", None)
    size, patch = getattr(embed, "img_size", None), getattr(embed, "patch_size", None)
    if size is None or patch is None:
        return  # no timm patch embedding, or a dynamic one
    got = tuple(x.shape[-2:])
    if getattr(embed, "strict_img_size", False) and got != tuple(size):
        raise ValueError(
            f"x is {got[0]} x {got[1]} but this ViT takes {size[0]} x {size[1]} images (its patch grid is fixed); "
            f"resize the images, or build the model with img_size={got[0]}"
        )
    if not getattr(embed, "dynamic_img_pad", True) and (got[0] % patch[0] or got[1] % patch[1]):
        raise ValueError(
            f"x is {got[0]} x {got[1]}: this ViT takes sides that are multiples of its {patch[0]} px patches"
        )


def _unknown_model_error(name: str) -> ValueError:
    names = timm.list_models()
    # Pattern matches catch families ("vit_tiny" -> every vit_tiny_*); difflib catches typos ("resnt18").
    fragments = [f for f in name.lower().replace("-", "_").split("_") if len(f) >= 3][:2]
    pattern_hits = timm.list_models(f"*{'*'.join(fragments)}*") if fragments else []
    close = difflib.get_close_matches(name, names, n=8, cutoff=0.6)
    suggestions = list(dict.fromkeys([*close, *pattern_hits]))[:12]
    hint = f" Close matches: {', '.join(suggestions)}." if suggestions else ""
    return ValueError(f"unknown timm model {name!r}.{hint} See timm.list_models() for all names.")


def is_external_name(name: str) -> bool:
    """Whether ``name`` points outside a model registry: a hub or local-dir name (timm's ``hf-hub:`` /
    ``local-dir:``, every transformers ``hf:`` name), or a source nobody knows (``"https://..."``). Such a name read
    from a file must not be built without the caller's confirmation. ``torchvision:<builder>`` names of torchvision's
    registry are not external (built without weights, they open nothing)."""
    try:
        source, ident = split_source(name)
    except ValueError:
        return True
    if source == "hf":
        return True
    if source == "torchvision":
        try:
            check_torchvision_name(ident)
        except ValueError:
            return True
        return False
    try:
        return timm.models.parse_model_name(name)[0] is not None
    except ValueError:  # an unknown source prefix
        return True


def check_model_name(name: str) -> bool:
    """Raise ValueError (with close matches) unless ``name`` is a timm or torchvision model; True for hub /
    local-dir names.

    ``"hf-hub:org/repo"`` and ``"local-dir:/path"`` names are resolved by timm itself, not from its registry, and
    ``"hf:org/repo"`` (transformers) by transformers, so they pass here and are only checked when the model is built.
    ``"torchvision:<builder>"`` must be one of torchvision's classification models.
    """
    if not isinstance(name, str):
        raise ValueError(f"name must be a timm model name (str), got {type(name).__name__}")
    source, ident = split_source(name)
    if source == "torchvision":
        check_torchvision_name(ident)
        return False
    if source == "hf":
        return True
    external = timm.models.parse_model_name(name)[0] is not None
    if not external and not timm.is_model(name):
        raise _unknown_model_error(name)
    return external


def accepts_img_size(name: str) -> bool:
    """Whether timm's model ``name`` takes an ``img_size`` argument (its architecture depends on the input size)."""
    # timm marks models whose architecture is tied to the input size (ViT, Swin, ...) with fixed_input_size; those
    # take an img_size kwarg, while CNNs reject it (TypeError) and run at any size anyway.
    cfg = timm.models.get_pretrained_cfg(name)
    return bool(cfg is not None and getattr(cfg, "fixed_input_size", False))


def load_classifier(
    name: str | None = None,
    *,
    pretrained: bool = False,
    num_classes: int | None = None,
    img_size: int | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    seed: int | None = None,
    **model_kwargs: Any,
) -> Classifier:
    """Build a timm, torchvision or Hugging Face model by name and wrap it in a frozen :class:`Classifier`.

    Args:
        name: the architecture: a timm name (``timm.list_models()``, optionally with a pretrained tag such as
            ``"resnet50.a1_in1k"``), timm's ``"hf-hub:org/repo"`` / ``"local-dir:path"``, ``"torchvision:<builder>"``
            or ``"hf:<repo id or directory>"`` (transformers, the ``hf`` extra; see :mod:`attr_engine.model_sources`).
            ``None`` reads it from ``checkpoint`` (a name outside a registry, :func:`is_external_name`, must then be
            passed). A checkpoint file given here (a name ending in ``.safetensors`` or ``.pt``, or an existing file
            named with its directory) loads as ``checkpoint=`` with ``name=None``: a :func:`save_classifier` file
            records its architecture, size, kwargs and normalisation, so the file alone rebuilds the model, and no
            registry name is such a path. One that records no architecture, or a directory, is refused in one line.
        pretrained: download the source's pretrained weights (needs network access on first use): timm's,
            torchvision's ``weights="DEFAULT"``, or transformers' ``from_pretrained`` (safetensors only).
        num_classes: number of logits; ``None`` keeps the model default (1000 for ImageNet models), or the value
            stored in ``checkpoint`` if it was written by :func:`save_classifier`.
        img_size: square input size. Passed to models with a size-dependent architecture (ViT-family: patch grid
            and position embeddings); for other models (CNNs) it is only recorded as ``input_size``.
        checkpoint: a safetensors file with the model's state dict (or a whole Classifier's, normalisation
            buffers included), loaded strictly. Files written by :func:`save_classifier` also carry
            ``num_classes``, ``img_size``, model kwargs and mean/std, used wherever the caller leaves them unset.
            Not for ``hf:`` models, whose weights are a ``save_pretrained`` directory named as ``"hf:DIR"``.
        seed: seeds the build (torch's global generator is left as it was), so random weights are the same in
            every process that builds them; ``None``: the global generator as it is.
        **model_kwargs: forwarded to ``timm.create_model``, torchvision's builder or transformers' loader.

    Raises:
        ValueError: an unknown name (with close matches), a path where a name goes, a checkpoint that is corrupt or
            does not match the architecture (naming the file), a build or download that fails (one line).
        FileNotFoundError: the checkpoint is missing. ImportError: an ``hf:`` name without transformers.
    """
    name, checkpoint = _name_and_checkpoint(name, checkpoint)
    if name is None:
        if checkpoint is None:
            raise ValueError("no classifier: pass a model name or checkpoint=PATH")
        name = checkpoint_model_name(checkpoint)
    if pretrained and checkpoint is None:
        hub_reachable_or_offline()
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        try:
            return _load_named(
                name, pretrained=pretrained, num_classes=num_classes, img_size=img_size, checkpoint=checkpoint,
                **model_kwargs,
            )  # fmt: skip
        except (RuntimeError, OSError) as err:
            raise load_error(name, pretrained, err) from None


def _name_and_checkpoint(
    name: Any, checkpoint: str | os.PathLike[str] | None
) -> tuple[str | None, str | os.PathLike[str] | None]:
    """:func:`load_classifier`'s ``name`` and ``checkpoint`` once a path given as the name is read as the
    checkpoint; a model object, a directory or a misplaced file refused in one line (:mod:`attr_engine.guards`)."""
    if isinstance(name, nn.Module):
        raise ValueError(
            f"load_classifier builds a model from its name, and this is a {type(name).__name__} already: use a "
            "Classifier as it is, and wrap any other torch module with Classifier(model, mean, std)"
        )
    if name is not None and checkpoint_given_as_name(name):
        if checkpoint is not None:
            raise ValueError(
                f"{name} is a checkpoint file given as the model name, beside checkpoint={checkpoint}: pass one file, "
                "as checkpoint=PATH (with the model name if the file does not record it)"
            )
        name, checkpoint = None, name
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if isinstance(name, str):
        check_model_name_path(name)
    # A transformers model never loads from checkpoint=: _load_named says so, whether or not the file exists.
    hf = isinstance(name, str) and split_source(name)[0] == "hf"
    if checkpoint is not None and not hf:
        check_checkpoint_file(checkpoint)
    return name, checkpoint


def checkpoint_model_name(checkpoint: str | os.PathLike[str]) -> str:
    """The architecture a classifier checkpoint records (``save_classifier``'s ``model_name``).

    A name read from a file must be in a registry (timm's, torchvision's): a file may not send the loader to the hub
    or to another directory on its own; the caller confirms such a name by passing it.

    Raises:
        FileNotFoundError: no such file. ValueError: not a safetensors file, no recorded name, an external name.
    """
    from safetensors import SafetensorError, safe_open

    path = check_checkpoint_file(checkpoint)
    try:
        with safe_open(str(path), framework="pt") as f:
            saved = (f.metadata() or {}).get("model_name")
    except (SafetensorError, OSError, RuntimeError) as err:
        raise ValueError(f"{path} is not a valid classifier checkpoint (safetensors): {err}") from None
    if saved is None:
        raise ValueError(
            f"{path} does not record its architecture: pass the model name with it, load_classifier(NAME, "
            "checkpoint=PATH) (on the command line, --model NAME with --classifier)"
        )
    if is_external_name(saved):
        raise ValueError(
            f"{path} names the model {saved!r}, which is not in timm's registry; pass --model to confirm it "
            "(in Python, load_classifier(NAME, checkpoint=PATH))"
        )
    return saved


def load_error(name: str, pretrained: bool, err: BaseException) -> Exception:
    """What a failed build of the model ``name`` means to a user, as one line.

    Pretrained downloads fail as RuntimeError / OSError (no network, no such tag on the hub); the hub's offline
    miss is a FileNotFoundError too.
    """
    if pretrained and os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        return ValueError(
            f"cannot load {name!r} with --pretrained: the Hugging Face hub is unreachable (offline) and its weights "
            "are not in the local cache"
        )
    if isinstance(err, FileNotFoundError):  # the hub's offline miss does not name the model: say which
        text = " ".join(str(err).split())
        return FileNotFoundError(text if name in text else f"cannot load {name!r}: {text}")
    return ValueError(f"cannot load {name!r}: {' '.join(str(err).split())[:300]}")


def checkpoint_class_names(checkpoint: str | os.PathLike[str], classifier: Classifier) -> dict[int, str]:
    """``{class id: name}`` from the ``train.json`` that ``train-classifier`` writes beside ``checkpoint``, used
    only when it names this classifier's model and as many classes as it has; ``{}`` otherwise (no record, an
    unreadable one, or one for another model)."""
    try:
        record = json.loads((Path(checkpoint).parent / "train.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    classes = record.get("classes") if isinstance(record, dict) else None
    if (
        isinstance(classes, list)
        and len(classes) == classifier.num_classes
        and all(isinstance(c, str) for c in classes)
        and record.get("model") == getattr(classifier, "model_name", None)
    ):
        return dict(enumerate(classes))
    return {}


def classifier_fingerprint(classifier: Classifier) -> str:
    """A short hash of the classifier's architecture and weights: what an AHA checkpoint and an ``explain`` output
    record of the classifier they were made for.

    Parameter names, shapes and per-tensor float64 sums (rounded, so the same weights on another device or after a
    save/load round trip give the same hash) identify a model without hashing every byte.
    """
    digest = hashlib.sha256()
    for name, value in classifier.model.state_dict().items():
        digest.update(name.encode())
        digest.update(str(tuple(value.shape)).encode())
        if value.is_floating_point() and value.numel():
            v = value.detach().double()
            digest.update(f"{v.sum().item():.6e}/{v.abs().sum().item():.6e}".encode())
    return digest.hexdigest()[:16]


def _load_named(
    name: str,
    *,
    pretrained: bool = False,
    num_classes: int | None = None,
    img_size: int | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    **model_kwargs: Any,
) -> Classifier:
    """:func:`load_classifier` once the model's name is known."""
    external = check_model_name(name)
    source = split_source(name)[0]
    if pretrained and checkpoint is not None:
        raise ValueError("pass pretrained=True or checkpoint=..., not both (the checkpoint would overwrite it)")
    if img_size is not None:
        check_int_at_least(img_size, "img_size", 1)
    if source == "hf":
        if checkpoint is not None:
            raise ValueError(
                f"{name}: a transformers model loads its weights from a save_pretrained directory (name it as "
                "'hf:DIR'), not from checkpoint="
            )
        ident = split_source(name)[1]
        adapter = load_hf(ident, pretrained=pretrained, num_classes=num_classes, img_size=img_size, **model_kwargs)
        return _wrap(adapter, name, model_kwargs, img_size)

    state: dict[str, torch.Tensor] | None = None
    mean = std = None
    if checkpoint is not None:
        state, mean, std, num_classes, img_size, model_kwargs = _read_checkpoint(
            checkpoint, name, num_classes, img_size, model_kwargs
        )
    create_kwargs = dict(model_kwargs)
    if num_classes is not None:
        create_kwargs["num_classes"] = num_classes
    if img_size is not None and (external or source == "torchvision" or accepts_img_size(name)):
        create_kwargs["img_size"] = img_size
    if state is not None and not external:
        check_against_weights(name, create_kwargs, state, checkpoint)
    model = _build(name, pretrained, create_kwargs, external, f"{checkpoint}: " if checkpoint is not None else "")
    if state is not None:
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise ValueError(f"{checkpoint} does not match {name} with {create_kwargs}: {err}") from err
    return _wrap(model, name, model_kwargs, img_size, mean, std)


def _wrap(
    model: nn.Module,
    name: str,
    model_kwargs: dict[str, Any],
    img_size: int | None,
    mean: Any = None,
    std: Any = None,
) -> Classifier:
    """``model`` in a :class:`Classifier` with the normalisation its ``pretrained_cfg`` gives (unless a checkpoint
    gave its own), recording the name and kwargs :func:`save_classifier` stores."""
    cfg = timm.data.resolve_model_data_config(model)
    input_size = (3, img_size, img_size) if img_size is not None else _model_input_size(model)
    clf = Classifier(
        model,
        mean if mean is not None else cfg["mean"],
        std if std is not None else cfg["std"],
        input_size=input_size,
    )
    clf.model_name = name
    clf.model_kwargs = dict(model_kwargs)
    return clf


def _build(name: str, pretrained: bool, create_kwargs: dict[str, Any], external: bool, source: str) -> nn.Module:
    """The timm or torchvision model ``name`` built with ``create_kwargs`` (``source`` prefixes the errors)."""
    kind, ident = split_source(name)
    if kind == "torchvision":
        kwargs = dict(create_kwargs)
        try:
            return build_torchvision(
                ident, pretrained=pretrained, num_classes=kwargs.pop("num_classes", None),
                img_size=kwargs.pop("img_size", None), **kwargs,
            )  # fmt: skip
        except ValueError as err:
            raise ValueError(f"{source}{err}") from err
    try:
        try:
            return timm.create_model(name, pretrained=pretrained, **create_kwargs)
        except TypeError as err:
            # An external model's architecture is only known once its config is fetched: a CNN rejects img_size.
            if not (external and "img_size" in create_kwargs and "img_size" in str(err)):
                raise
            del create_kwargs["img_size"]
            return timm.create_model(name, pretrained=pretrained, **create_kwargs)
    except (TypeError, AssertionError, KeyError) as err:
        # Unknown or inconsistent architecture arguments (e.g. a checkpoint's kwargs for another model): one line.
        raise ValueError(f"{source}cannot build {name} with {create_kwargs}: {err}") from err


def _read_checkpoint(
    checkpoint: str | os.PathLike[str],
    name: str,
    num_classes: int | None,
    img_size: int | None,
    model_kwargs: dict[str, Any],
) -> tuple[dict[str, torch.Tensor], Any, Any, int | None, int | None, dict[str, Any]]:
    """A classifier checkpoint's weights, mean, std, and the num_classes / img_size / model kwargs it sets where the
    caller left them unset (all checked: see :func:`load_classifier`)."""
    mean = std = None
    state, meta = load_safetensors(checkpoint, finite=True)
    if meta.get("format") == _CHECKPOINT_FORMAT:
        saved_name = meta.get("model_name")
        arch = timm.models.split_model_name_tag  # "resnet50.a1_in1k" and "resnet50" share weights' shapes
        if saved_name and arch(saved_name)[0] != arch(name)[0]:
            raise ValueError(f"{checkpoint} was saved for model {saved_name!r}, not {name!r}")
        saved_kwargs = _checkpoint_kwargs(meta.get("model_kwargs", "{}"), checkpoint)
        try:
            mean, std = json.loads(meta["mean"]), json.loads(meta["std"])
            if num_classes is None:
                # Confirmed against the weights below, before anything of that size is allocated.
                num_classes = file_int(meta["num_classes"], "num_classes", checkpoint)
            if img_size is None and meta.get("img_size"):
                img_size = file_int(meta["img_size"], "img_size", checkpoint, high=MAX_FILE_IMG_SIZE)
        except (KeyError, ValueError) as err:
            text = str(err) if str(checkpoint) in str(err) else f"{checkpoint}: corrupt classifier metadata: {err}"
            raise ValueError(text) from err
        model_kwargs = {**saved_kwargs, **model_kwargs}
    # A Classifier's own state dict nests the model under "_model." next to the normalisation buffers.
    if any(k.startswith("_model.") for k in state):
        if mean is None and "norm_mean" in state and "norm_std" in state:
            mean, std = state["norm_mean"].flatten().tolist(), state["norm_std"].flatten().tolist()
        state = {k.removeprefix("_model."): v for k, v in state.items() if k.startswith("_model.")}
    return state, mean, std, num_classes, img_size, model_kwargs


def save_classifier(
    classifier: Classifier,
    path: str | os.PathLike[str],
    *,
    model_name: str | None = None,
    model_kwargs: dict[str, Any] | None = None,
) -> None:
    """Write the wrapped model's weights plus what :func:`load_classifier` needs to rebuild it (safetensors).

    ``model_name`` / ``model_kwargs`` default to those recorded by :func:`load_classifier` (or
    ``train_classifier``); kwargs must be JSON-serialisable.
    """
    if not isinstance(classifier, Classifier):
        raise ValueError(
            f"classifier must be a Classifier, got {type(classifier).__name__}{not_a_classifier_hint(classifier)}"
        )
    if Path(path).is_dir():
        raise ValueError(f"{path} is a directory: name the checkpoint file, e.g. {Path(path) / CLASSIFIER_FILE}")
    name = model_name or classifier.model_name
    if name and split_source(name)[0] == "hf":
        raise ValueError(
            f"{name} is a transformers model: save it with classifier.model.hf.save_pretrained(DIR) (safetensors) "
            "and its image processor, and load it with load_classifier('hf:DIR')"
        )
    kwargs = model_kwargs if model_kwargs is not None else classifier.model_kwargs
    try:
        kwargs_json = json.dumps(kwargs)
    except TypeError as err:
        raise ValueError(f"model_kwargs must be JSON-serialisable to be stored in {path}: {err}") from err
    meta = {
        "format": _CHECKPOINT_FORMAT,
        "num_classes": str(classifier.num_classes),
        "mean": json.dumps(classifier.mean),
        "std": json.dumps(classifier.std),
        "model_kwargs": kwargs_json,
    }
    if name:
        meta["model_name"] = name
    if classifier.input_size is not None and classifier.input_size[1] == classifier.input_size[2]:
        meta["img_size"] = str(classifier.input_size[1])
    save_safetensors(classifier.model.state_dict(), path, meta)


def resolve_targets(
    classifier: nn.Module | None,
    x: torch.Tensor,
    target: int | Sequence[int] | torch.Tensor | None,
    *,
    logits: torch.Tensor | None = None,
    check_range: bool = True,
) -> torch.Tensor:
    """The classes to explain or score: (B,) int64 on ``x``'s device. The one target resolver of the package: every
    method (through :class:`~attr_engine.explainer.Explainer`) and every metric resolves targets here, so all of
    them accept the same targets and refuse bad ones with the same errors.

    Args:
        classifier: the model; ``None`` is allowed when ``logits`` are given or ``target`` is not None.
        x: (B, ...) the images (only their batch size and device are read unless the prediction is needed).
        target: ``None`` takes the predicted class; an int applies to every image; else a sequence or (B,) integer
            tensor, one class per image.
        logits: (B, K) logits of ``x`` if the caller computed them anyway: ``None`` then takes their argmax (no
            second classifier pass) and K bounds the classes.
        check_range: check the classes against ``[0, K)``, K from ``logits`` or ``classifier.num_classes`` (only
            ``>= 0`` when neither is known). False leaves the range to the caller (e.g. checked against logits it
            computes anyway).

    Raises:
        ValueError: booleans, floats, a wrong length, a class outside ``[0, K)``, or ``target=None`` with neither
            a classifier nor logits.
    """
    batch = x.shape[0]
    if target is None:
        if logits is not None:
            return logits.argmax(dim=1).to(x.device)
        if classifier is None:
            raise ValueError("target=None takes the predicted class, which needs a classifier; pass target explicitly")
        with torch.no_grad():
            return classifier(x).argmax(dim=1)
    if isinstance(target, bool) or (isinstance(target, torch.Tensor) and target.dtype == torch.bool):
        raise ValueError("target must be integer class indices, got booleans")
    try:
        t = torch.as_tensor(target, device=x.device)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"target must be an int, ints or an integer tensor, got {target!r}") from None
    if t.is_floating_point() or t.is_complex():
        raise ValueError(f"target must hold integer class indices, got dtype {t.dtype}")
    # The classes as given, before one int is spread over the batch: an empty batch would leave nothing to check.
    given = t
    if t.ndim == 0:
        t = t.expand(batch)
    if tuple(t.shape) != (batch,):
        raise ValueError(f"target must be an int or have one entry per image ({batch}), got shape {tuple(t.shape)}")
    if not check_range:
        return t.long()
    if logits is not None:
        upper: int | None = logits.shape[-1]
    else:
        num_classes = getattr(classifier, "num_classes", None)
        upper = num_classes if isinstance(num_classes, int) else None
    if bool((given < 0).any()) or (upper is not None and bool((given >= upper).any())):
        shown = t.tolist() if t.numel() else given.tolist()
        raise ValueError(f"target classes must lie in [0, {upper if upper is not None else 'K'}), got {shown}")
    return t.long()


# id(model) -> [open eval_mode blocks, the model, its modules' own training flags]: shared by every thread, so one
# thread's exit never puts a model back in training mode while another thread is still explaining with it.
_EVAL_USERS: dict[int, list[Any]] = {}
_EVAL_LOCK = threading.Lock()


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Run a block with every submodule of ``model`` in eval mode, then give each its own training flag back.

    Attribution must not change the model it explains: in training mode BatchNorm would update its running
    statistics and dropout would randomise every pass. Flags are set directly (not through ``.train()``, which
    subclasses may override), so the model's state dict and modes after the block are exactly those before it.
    Nested and concurrent blocks on one model are counted: the flags come back when the last one ends.
    """
    key = id(model)
    with _EVAL_LOCK:
        entry = _EVAL_USERS.get(key)
        if entry is None:
            flags = [(m, m.training) for m in model.modules()]
            entry = _EVAL_USERS[key] = [0, model, flags]
            for m, _ in flags:
                m.training = False
        entry[0] += 1
    try:
        yield model
    finally:
        with _EVAL_LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                del _EVAL_USERS[key]
                for m, flag in entry[2]:
                    m.training = flag
