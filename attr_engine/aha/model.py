"""AHA: the amortized explainer (train once per classifier, then one forward pass per image)."""

from __future__ import annotations

import copy
import hashlib
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from attr_engine.aha.config import AHAConfig
from attr_engine.aha.explainer import Decoder, FeatureBackbone, build_backbone
from attr_engine.aha.loss import soft_auc_loss
from attr_engine.checkpoint import load_json, load_safetensors, save_json, save_safetensors
from attr_engine.classifier import Classifier, check_device, resolve_targets
from attr_engine.imageops import reference_image
from kernels._validate import check_tensor

_FORMAT = "attr_engine.aha/1"
WEIGHTS_FILE = "explainer.safetensors"
CONFIG_FILE = "config.json"
# Training checkpoints: OUT/checkpoints/step-<8 digits>/ each hold a whole checkpoint; OUT/config.json points at one.
CHECKPOINTS_DIR = "checkpoints"
POINTER_KEY = "checkpoint"
_STEP_DIR = re.compile(r"step-(\d{8,})")


def step_dirs(path: str | os.PathLike[str]) -> list[Path]:
    """Training checkpoint directories ``path/checkpoints/step-N`` that hold weights and a config, newest first.

    A step directory is written under a temporary name and renamed into place whole, so one that exists is complete
    unless its files were damaged afterwards (callers that load it still check).
    """
    root = Path(path) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        match = _STEP_DIR.fullmatch(d.name)
        if match and d.is_dir() and (d / WEIGHTS_FILE).is_file() and (d / CONFIG_FILE).is_file():
            found.append((int(match.group(1)), d))
    return [d for _, d in sorted(found, reverse=True)]


def checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    """The directory whose weights :meth:`AHA.load` reads for ``path``.

    ``path`` is either what :meth:`AHA.save` wrote (weights and config side by side) or a training output directory,
    whose ``config.json`` names the current step directory (the pointer, switched last). A pointer to a missing or
    incomplete step directory falls back to the newest complete one.

    Raises:
        FileNotFoundError: ``path`` holds no checkpoint.
        ValueError: the pointer is not a step directory under ``path/checkpoints`` (a checkpoint may only point
            inside itself).
    """
    src = Path(path)
    if not src.is_dir():
        raise FileNotFoundError(f"AHA checkpoint directory not found: {src}")
    top = src / CONFIG_FILE
    pointer = None
    if top.is_file():
        meta = load_json(top)
        pointer = meta.get(POINTER_KEY) if isinstance(meta, dict) else None
        if pointer is None and (src / WEIGHTS_FILE).is_file():
            return src
    if pointer is not None:
        parts = Path(pointer).parts if isinstance(pointer, str) else ()
        if len(parts) != 2 or parts[0] != CHECKPOINTS_DIR or not _STEP_DIR.fullmatch(parts[1]):
            raise ValueError(f"{top}: {POINTER_KEY!r} must name a {CHECKPOINTS_DIR}/step-N directory, got {pointer!r}")
        target = src / pointer
        if (target / WEIGHTS_FILE).is_file() and (target / CONFIG_FILE).is_file():
            return target
    newest = step_dirs(src)
    if newest:
        return newest[0]
    raise FileNotFoundError(f"no AHA checkpoint in {src} (no {CONFIG_FILE} with {WEIGHTS_FILE}, no {CHECKPOINTS_DIR}/)")


def classifier_fingerprint(classifier: Classifier) -> str:
    """A short hash of the classifier's architecture and weights: a checkpoint records the one it was trained for.

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


class AHA(nn.Module):
    """Amortized Hybrid Attribution: a decoder trained to minimise soft deletion and maximise soft insertion AUC.

    Args:
        classifier: the frozen classifier to explain (images in [0, 1]).
        config: :class:`AHAConfig`; ``None`` uses the defaults.
        img_size: training/inference resolution used to size the config's scale-dependent defaults; ``None`` takes
            the classifier's ``input_size`` (224 if unknown).

    Example:
        >>> aha = AHA(classifier)  # doctest: +SKIP
        >>> aha.fit(train_set, epochs=1, batch_size=32)  # doctest: +SKIP
        >>> maps = aha.attribute(images)  # (B, H, W)  # doctest: +SKIP
    """

    def __init__(self, classifier: Classifier, config: AHAConfig | None = None, *, img_size: int | None = None) -> None:
        super().__init__()
        if not isinstance(classifier, Classifier):
            raise ValueError(f"classifier must be an attr_engine.Classifier, got {type(classifier).__name__}")
        if classifier.num_classes < 2:
            raise ValueError("AHA needs a classifier with at least two classes")
        self.classifier = classifier
        size = img_size or (classifier.input_size[1] if classifier.input_size is not None else 224)
        self.img_size = int(size)
        self.config = (config or AHAConfig()).resolved(self.img_size)
        self.backbone: FeatureBackbone = build_backbone(
            classifier, self.config.backbone, self.config.layers, self.config.backbone_pretrained
        )
        channels = self.backbone.channels((self.img_size, self.img_size))
        self.feature_channels = channels
        # Seeded initialisation: the same config gives the same untrained decoder (and so the same training run).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.config.seed)
            self.decoder = Decoder(channels, classifier.num_classes, self.config.decoder_dim, self.config.class_dim)
        self.decoder.to(classifier.norm_mean.device)
        self.steps_trained = 0

    @property
    def device(self) -> torch.device:
        return self.classifier.norm_mean.device

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Raw maps. x: (B, 3, H, W) in [0, 1], any floating dtype; target: (B,) classes -> (B, H, W) float32."""
        # The backbone casts to its own dtype; the decoder is float32 whatever the classifier's dtype.
        return self.decoder(self.backbone(x), x.float(), target)

    # ------------------------------------------------------------------------------------------------------------
    # Inference
    # ------------------------------------------------------------------------------------------------------------

    def attribute(
        self,
        x: torch.Tensor,
        target: int | Sequence[int] | torch.Tensor | None = None,
        refine_steps: int = 0,
        *,
        generator: torch.Generator | int | None = None,
    ) -> torch.Tensor:
        """Attribution maps for a batch: one forward pass, plus optional test-time refinement.

        Args:
            x: (B, 3, H, W) images in [0, 1].
            target: class to explain: an int (every image), a sequence or ``(B,)`` integer tensor, or ``None`` for the
                predicted class; resolved as every method does (:func:`~attr_engine.classifier.resolve_targets`):
                booleans, floats, a wrong length or a class out of range are a ValueError.
            refine_steps: T test-time refinement steps: a copy of the decoder takes T Adam steps (``config.refine_lr``)
                on this batch's soft deletion/insertion objective, each at a grid size and offset drawn from the
                training range; costs T soft-AUC evaluations (2 x n_fractions classifier passes per image each).
            generator: seeds the refinement's grid draws (reproducible refinement).

        Returns:
            (B, H, W) float32 maps; higher = more important for ``target``. Refinement works inside
            ``torch.no_grad()`` (it enables gradients itself).

        Raises:
            RuntimeError: refinement inside ``torch.inference_mode()``, where no gradient can be computed.
            ValueError: bad ``x``, ``target`` or ``refine_steps``.
        """
        check_device(x, self.classifier)
        check_tensor(x, "x", ndim=4, finite=True)
        if x.shape[1] != 3:
            raise ValueError(f"x must be (B, 3, H, W), got shape {tuple(x.shape)}")
        if isinstance(refine_steps, bool) or not isinstance(refine_steps, int) or refine_steps < 0:
            raise ValueError(f"refine_steps must be an int >= 0, got {refine_steps!r}")
        if refine_steps and torch.is_inference_mode_enabled():
            raise RuntimeError(
                "AHA refinement (refine_steps > 0) trains a copy of the decoder, which needs autograd: it cannot run "
                "inside torch.inference_mode(); call it outside (torch.no_grad() is fine) or use refine_steps=0"
            )
        # AHA's decoder works in float32: images of any floating dtype are cast once here (the classifier and the
        # backbone cast to their own dtype in turn).
        x = x.float()
        if x.shape[0] == 0:  # an empty batch: an empty result (the target still checked), no refinement to run
            if target is not None:
                resolve_targets(self.classifier, x, target)
            return x.new_zeros(0, *x.shape[2:])
        target = resolve_targets(self.classifier, x, target)
        if refine_steps:
            # A copy made outside inference mode: an inference tensor (made under inference_mode) cannot be saved
            # for the refinement's backward.
            return self._refine(x.clone(), target, refine_steps, generator)
        with torch.no_grad():
            return self(x, target).float()

    def _refine(
        self,
        x: torch.Tensor,
        target: torch.Tensor,
        steps: int,
        generator: torch.Generator | int | None,
    ) -> torch.Tensor:
        """Fine-tune a copy of the decoder on this batch's soft objective for ``steps`` Adam steps; return its maps.

        Refining the decoder rather than the map keeps the maps in the family the decoder draws (smooth, image
        aligned); gradient steps on the map itself arrive through region pooling as per-cell blocks. Measured on the
        embedded data (small ResNet, 48 held-out images, T=3): decoder refinement lowered hard deletion AUC from 0.269
        to 0.246 and raised insertion from 0.830 to 0.839 with the pointing game intact, while map-space steps
        moved deletion by under 0.004 and cost pointing-game hits.
        """
        cfg = self.config
        gen = _as_generator(generator if generator is not None else cfg.seed)
        reference = reference_image(x, "mean", self.classifier.norm_mean)
        fractions = torch.linspace(0, 1, cfg.n_fractions, device=x.device)
        lo, hi = cfg.grid_range  # type: ignore[misc]
        decoder = copy.deepcopy(self.decoder).train()
        optimizer = torch.optim.Adam(decoder.parameters(), lr=cfg.refine_lr)
        with torch.enable_grad():
            feats = self.backbone(x)
            for _ in range(steps):
                grid = int(torch.randint(lo, hi + 1, (1,), generator=gen))
                offset = tuple(torch.rand(2, generator=gen).tolist()) if cfg.random_offset else (0.0, 0.0)
                result = soft_auc_loss(
                    self.classifier, x, decoder(feats, x, target), target, reference, grid=grid,
                    fractions=fractions, tau=cfg.tau_end, n_iters=cfg.n_iters, offset=offset, noise=0.0,
                    peak_weight=cfg.peak_weight, peak_kernel=cfg.peak_kernel or 3, amp=cfg.amp,
                )  # fmt: skip
                optimizer.zero_grad(set_to_none=True)
                result.loss.backward()
                optimizer.step()
        with torch.no_grad():
            return decoder.eval()(feats, x, target).float()

    # ------------------------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------------------------

    def fit(
        self,
        data: Dataset | DataLoader,
        *,
        epochs: int = 1,
        batch_size: int = 32,
        max_steps: int | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        resume: str | os.PathLike[str] | None = None,
        num_workers: int = 0,
        progress: bool = True,
    ) -> dict[str, list[float]]:
        """Train the decoder on ``data`` (see :func:`attr_engine.aha.trainer.fit` for every detail).

        Returns:
            History with per-step ``loss``, ``deletion``, ``insertion``, ``tau`` and ``lr``.
        """
        from attr_engine.aha.trainer import fit

        return fit(
            self, data, epochs=epochs, batch_size=batch_size, max_steps=max_steps, checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every, resume=resume, num_workers=num_workers, progress=progress,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------------------------------
    # Persistence
    # ------------------------------------------------------------------------------------------------------------

    def _metadata(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "classifier": classifier_fingerprint(self.classifier),
            "num_classes": self.classifier.num_classes,
            "img_size": self.img_size,
            "feature_channels": self.feature_channels,
            "steps_trained": self.steps_trained,
            "config": self.config.to_dict(),
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the trained decoder to directory ``path``: ``explainer.safetensors`` + ``config.json``.

        Only the decoder is saved; the frozen backbone comes from the classifier (or timm) when loading. Each file is
        written atomically, the weights first, so a crash never leaves a config pointing at missing weights.
        """
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        meta = self._metadata()
        save_safetensors(
            self.decoder.state_dict(),
            out / WEIGHTS_FILE,
            {"format": _FORMAT, "classifier": meta["classifier"], "steps_trained": str(self.steps_trained)},
        )
        save_json(meta, out / CONFIG_FILE)
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str], classifier: Classifier) -> AHA:
        """Rebuild an explainer saved by :meth:`save` (or a training output directory) for ``classifier``.

        A training directory loads the checkpoint its ``config.json`` points at (see :func:`checkpoint_dir`).

        Raises:
            FileNotFoundError: the directory or one of its files is missing.
            ValueError: the files are corrupt, of another format, inconsistent with each other, or were made for
                a different classifier.
        """
        src = checkpoint_dir(path)
        meta = load_json(src / CONFIG_FILE)
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
            raise ValueError(f"{src / CONFIG_FILE} is not an AHA checkpoint config (format {_FORMAT})")
        state, weights_meta = load_safetensors(src / WEIGHTS_FILE, device=classifier.norm_mean.device)
        steps = str(meta.get("steps_trained", 0))
        same_step = weights_meta.get("steps_trained", steps) == steps
        if weights_meta.get("classifier") != meta.get("classifier") or not same_step:
            raise ValueError(f"{src}: weights and config belong to different checkpoints (torn write?)")
        expected = classifier_fingerprint(classifier)
        if meta["classifier"] != expected:
            raise ValueError(
                f"{src} was trained for another classifier (fingerprint {meta['classifier']}, this one is {expected})"
            )
        try:
            config = AHAConfig.from_dict(_tuples(meta["config"]))
            aha = cls(classifier, config, img_size=int(meta["img_size"]))
        except (KeyError, TypeError) as err:
            raise ValueError(f"{src / CONFIG_FILE}: corrupt AHA config: {err}") from err
        try:
            aha.decoder.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise ValueError(f"{src / WEIGHTS_FILE} does not match the explainer architecture: {err}") from err
        aha.steps_trained = int(meta.get("steps_trained", 0))
        return aha


def _tuples(config: dict[str, Any]) -> dict[str, Any]:
    """JSON turns tuples into lists; the config's tuple fields are restored so equality and hashing behave."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}


def _as_generator(generator: torch.Generator | int) -> torch.Generator:
    if isinstance(generator, torch.Generator):
        return generator
    return torch.Generator().manual_seed(int(generator))


__all__ = ["AHA", "checkpoint_dir", "classifier_fingerprint", "step_dirs"]
