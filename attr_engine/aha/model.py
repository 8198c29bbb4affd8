"""AHA: the amortized explainer (train once per classifier, then one forward pass per image)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from attr_engine.aha.config import AHAConfig
from attr_engine.aha.loss import soft_auc_loss, standardise, target_probabilities
from attr_engine.aha.network import FeatureBackbone, PerImageTail, build_backbone, build_decoder, with_prediction
from attr_engine.aha.persistence import WEIGHTS_FILE, load_checkpoint, save_explainer
from attr_engine.aha.trainer import fit as train_decoder
from attr_engine.classifier import Classifier, check_device, eval_mode, resolve_targets
from attr_engine.explainer import Explainer, register_explainer
from attr_engine.guards import check_count, not_a_classifier_hint
from attr_engine.imageops import gaussian_blur, reference_image
from attr_engine.pullback import SemanticPullback
from attr_engine_kernels.region import blur_kernel_size
from attr_engine_kernels.validate import check_int, check_int_at_least, check_positive, check_tensor

if TYPE_CHECKING:
    from attr_engine.pixels import DataConfig

__all__ = ["AHA"]


class AHA(nn.Module, Explainer):
    """Amortized Hybrid Attribution: a decoder trained to minimise soft deletion and maximise soft insertion AUC.

    Args:
        classifier: the frozen classifier to explain (images in [0, 1]).
        config: :class:`AHAConfig`; ``None`` uses the defaults.
        img_size: training/inference resolution used to size the config's scale-dependent defaults; ``None`` takes
            the classifier's ``input_size`` (224 if unknown).
        backbone: a built :class:`~attr_engine.aha.network.FeatureBackbone` to use instead of building the one
            ``config`` names (:meth:`load` passes the separate backbone it restored from the checkpoint).

    An :class:`~attr_engine.explainer.Explainer`: ``attribute(inputs, target=None, **options) -> (B, H, W)``
    float32 maps, standardised per image (mean 0, std 1; see :func:`standardise_maps`) when the decoder was trained
    on z-scored scores (``config.score_norm``, the default), as the raw network output otherwise. Options:

    - ``refine_steps``: test-time refinement steps T (default 0: one forward pass). With T > 0 each image's own copy
      of the decoder's last layers takes T steps on that image's soft objective (:meth:`_refine`): a refined map does
      not depend on the other images of its batch.
    - ``seed`` (alias ``generator``): an int or a ``torch.Generator`` seeding the refinement's grid draws (None:
      ``config.seed``), so refined maps are reproducible.

    Calling the module itself, ``aha(x, target)``, runs the raw network (:meth:`forward`) without any checks.

    Example:
        >>> aha = AHA(classifier)  # doctest: +SKIP
        >>> aha.fit(train_set, epochs=1, batch_size=32)  # doctest: +SKIP
        >>> maps = aha.attribute(images)  # (B, H, W)  # doctest: +SKIP
        >>> refined = aha.attribute(images, refine_steps=3, seed=0)  # doctest: +SKIP
    """

    classifier: Classifier  # AHA scores masks with it (norm_mean, fingerprint): only a Classifier will do
    name = "aha"
    needs_grad = False  # only refinement does (see _needs_grad)
    options: ClassVar[Mapping[str, Any]] = {"refine_steps": 0, "seed": None}
    option_aliases: ClassVar[Mapping[str, str]] = {"generator": "seed"}

    def __init__(
        self,
        classifier: Classifier,
        config: AHAConfig | None = None,
        *,
        img_size: int | None = None,
        backbone: FeatureBackbone | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(classifier, Classifier):
            raise ValueError(
                f"classifier must be an attr_engine.Classifier, got {type(classifier).__name__}"
                f"{not_a_classifier_hint(classifier)}"
            )
        if classifier.num_classes < 2:
            raise ValueError("AHA needs a classifier with at least two classes")
        self.classifier = classifier
        size = img_size or (classifier.input_size[1] if classifier.input_size is not None else 224)
        self.img_size = int(size)
        self.config = (config or AHAConfig()).resolved(self.img_size)
        self.backbone: FeatureBackbone = backbone or build_backbone(
            classifier, self.config.backbone, self.config.layers, self.config.backbone_pretrained
        )
        channels = self.backbone.channels((self.img_size, self.img_size))
        self.feature_channels = channels
        # Seeded initialisation: the same config gives the same untrained decoder (and so the same training run).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.config.seed)
            self.decoder = build_decoder(self.config, channels, classifier, classifier.norm_mean)
        self.decoder.to(classifier.norm_mean.device)
        self.steps_trained = 0
        Explainer.__init__(self, classifier)

    @property
    def device(self) -> torch.device:
        return self.classifier.norm_mean.device

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Raw maps. x: (B, 3, H, W) in [0, 1], any floating dtype; target: (B,) classes -> (B, H, W) float32."""
        # The backbone casts to its own dtype; the decoder is float32 whatever the classifier's dtype.
        x = x.float()
        return self.decoder(self.features(x), x, target, self.pullback_input(x, target))

    @torch.no_grad()
    def features(self, x: torch.Tensor, logits: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The decoder's inputs from the backbone for x (B, 3, H, W) in [0, 1]: its levels (B, C_l, h_l, w_l), and
        where ``config.prediction_input`` is on the classifier's predicted distribution (B, K) after them
        (:func:`~attr_engine.aha.network.with_prediction`) from ``logits`` (B, K) if the caller has them, else from
        the same backbone pass when it is the classifier's own network, else from one classifier pass."""
        if not self.config.prediction_input:
            return self.backbone(x)
        if logits is not None:
            return with_prediction(self.backbone(x), logits)
        if self.backbone.model is self.classifier.model:
            return with_prediction(*self.backbone.forward_with_logits(x))
        return with_prediction(self.backbone(x), self.classifier.forward_trusted(x))

    def pullback_input(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
        """The decoder's per-pixel inputs beside the image where ``config.pullback_input`` is on, else None.

        x: (B, 3, H, W) float32 in [0, 1]; target: (B,) classes -> (B, 2, H, W), no gradient. ``v`` (B, 3, H, W) is
        the target logit's pullback (:class:`~attr_engine.pullback.SemanticPullback` with
        ``method=config.pullback_method``): the Soft Pullback (one forward and backward of the classifier with
        softened gates) or Pullback Ascent's ``x_K - x_0`` (K such steps). The channels are
        ``sum_c v_c (x_c - r_c)``, r the mean colour (the first-order change of the logit when the pixel is set
        to the reference, what the ``x·(x−r)`` rankings rank by), and ``sum_c |v_c|``, each divided by its root
        mean square over the image so that their scale is the same for every classifier. Why: the decoder sees
        the classifier only through the backbone's features, at the backbone's resolution; this hands it the
        classifier's own pixel-level sensitivity for the class it explains (the one-pass maps fall short of the
        per-image optimum on photographs).
        """
        if not self.config.pullback_input:
            return None
        # attribute runs the classifier in eval mode and hands back a tensor without gradient.
        pullback = SemanticPullback(self.classifier, method=self.config.pullback_method)
        v = pullback.attribute(x, target, reduce=None).float()
        mean = self.classifier.norm_mean.float().view(1, -1, 1, 1)
        channels = torch.stack(((v * (x - mean)).sum(dim=1), v.abs().sum(dim=1)), dim=1)
        rms = channels.square().mean(dim=(2, 3), keepdim=True).add(1e-24).sqrt()
        return (channels / rms).detach()

    # ------------------------------------------------------------------------------------------------------------
    # Inference
    # ------------------------------------------------------------------------------------------------------------

    def _check_options(self, options: dict[str, Any]) -> None:
        check_count(options["refine_steps"], "refine_steps")
        seed = options["seed"]
        # Any int torch accepts as a seed (negative ones too), or a generator: no count validator fits.
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int | torch.Generator)):
            raise ValueError(f"seed must be an int or a torch.Generator, got {seed!r}")

    def _needs_grad(self, options: Mapping[str, Any]) -> bool:
        # Refinement trains a copy of the decoder and the pullback input is a gradient; otherwise one forward pass
        # needs no autograd (and runs in inference mode).
        return options["refine_steps"] > 0 or self.config.pullback_input

    def _cast_inputs(self, x: torch.Tensor) -> torch.Tensor:
        # AHA's decoder works in float32: images of any floating dtype are cast once here (the classifier and the
        # backbone cast to their own dtype in turn).
        return x.float()

    def _attribute(
        self, x: torch.Tensor, target: torch.Tensor, *, refine_steps: int, seed: torch.Generator | int | None
    ) -> torch.Tensor:
        """(B, H, W) float32 maps for checked images x: (B, 3, H, W) and resolved targets: (B,).

        With ``refine_steps`` T > 0 the maps come from :meth:`_refine`; either way they are standardised per image
        when ``config.score_norm`` is "zscore".
        """
        if refine_steps:
            # A copy made outside inference mode: an inference tensor (made under inference_mode) cannot be saved
            # for the refinement's backward.
            maps = self._refine(x.clone(), target, refine_steps, seed)
        else:
            with torch.no_grad():
                maps = self(x, target).float()
        return standardise_maps(maps) if self.config.score_norm == "zscore" else maps

    def predict_and_explain(
        self, x: torch.Tensor, target: int | Sequence[int] | torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The classifier's logits and the maps of ``target`` from one pass of the backbone.

        ``attribute(x)`` with ``target=None`` runs the classifier once for the prediction and the backbone again for
        the decoder's levels; here one pass gives both (:meth:`FeatureBackbone.forward_with_logits`) when the
        backbone is the classifier's own network (``config.backbone`` None) and its adapter can (timm models with
        ``forward_head``, torchvision and transformers classifiers). Otherwise (a separate backbone, a model
        without ``forward_head``) the classifier runs once more for the logits, as ``attribute`` does.

        Args:
            x: (B, 3, H, W) images in [0, 1] on the classifier's device, checked as :meth:`attribute` checks them.
            target: as for :meth:`attribute`; ``None`` explains each image's predicted class (argmax of the
                returned logits).

        Returns:
            ``(logits, maps)``: (B, K) logits in the classifier's dtype, and (B, H, W) float32 maps equal bit for
            bit to ``attribute(x, target=<the class explained>)`` with this explainer's options (refinement
            included: ``refine_steps`` > 0 refines as :meth:`attribute` does, on the same levels).

        Raises:
            ValueError: bad images or target (the same checks and messages as :meth:`attribute`).
            RuntimeError: refinement asked inside ``torch.inference_mode()``.
        """
        opts = self.defaults
        if self._needs_grad(opts) and torch.is_inference_mode_enabled():
            what = "refine_steps > 0" if opts["refine_steps"] else "the pullback input"
            raise RuntimeError(f"aha with {what} needs autograd and cannot run inside torch.inference_mode()")
        check_device(x, self.classifier)
        check_tensor(x, "x", ndim=4, finite=True)
        if x.shape[1] != 3:
            raise ValueError(f"x must be (B, 3, H, W) RGB images, got shape {tuple(x.shape)}")
        x = self._cast_inputs(x)
        if x.shape[0] == 0:  # an empty batch (the tail of a filtered loader): empty results, the target still checked
            resolve_targets(self.classifier, x, target, logits=torch.zeros(0, self.classifier.num_classes))
            return torch.zeros(0, self.classifier.num_classes, device=x.device), x.new_zeros(0, *x.shape[2:])
        with eval_mode(self.classifier), torch.no_grad():
            if self.backbone.model is self.classifier.model:
                feats, logits = self.backbone.forward_with_logits(x)
            else:
                feats, logits = self.backbone(x), self.classifier(x)
            classes = resolve_targets(self.classifier, x, target, logits=logits)
            if self.config.prediction_input:
                feats = with_prediction(feats, logits)
            if not opts["refine_steps"]:
                maps = self.decoder(feats, x, classes, self.pullback_input(x, classes)).float()
        if opts["refine_steps"]:
            with eval_mode(self.classifier):
                maps = self._refine(x.clone(), classes, opts["refine_steps"], opts["seed"], feats)
        maps = standardise_maps(maps) if self.config.score_norm == "zscore" else maps
        return logits.detach(), maps.detach()

    def _shallow_copy(self, classifier: Classifier) -> AHA:
        """This explainer's trained decoder (shared, not copied) and options over ``classifier``: its backbone (when
        AHA uses the classifier's own) and that classifier as the scorer, so a model with randomised layers changes
        the maps. A separately configured backbone (``config.backbone``) is kept, since it is not part of the
        classifier."""
        new = AHA.__new__(AHA)
        nn.Module.__init__(new)
        new.classifier = classifier
        new.img_size = self.img_size
        new.config = self.config
        if self.config.backbone is None and classifier is not self.classifier:
            new.backbone = build_backbone(classifier, None, self.config.layers, False)
        else:
            new.backbone = self.backbone
        new.feature_channels = self.feature_channels
        new.decoder = self.decoder
        new.steps_trained = self.steps_trained
        new.baselines = None
        new.defaults = dict(self.defaults)
        return new

    def rebind(self, classifier: nn.Module) -> AHA:
        """The trained decoder of this explainer over another classifier (see :meth:`_shallow_copy`); ``self`` for
        the same classifier."""
        if classifier is self.classifier:
            return self
        if not isinstance(classifier, Classifier):
            raise ValueError(f"AHA explains an attr_engine Classifier, got {type(classifier).__name__}")
        return self._shallow_copy(classifier)

    def with_options(self, **options: Any) -> AHA:
        """This explainer (the decoder shared) with these options as the defaults of every call."""
        new = self._shallow_copy(self.classifier)
        new.defaults = self._merge_options(self.defaults, options)
        return new

    def _refine(
        self,
        x: torch.Tensor,
        target: torch.Tensor,
        steps: int,
        generator: torch.Generator | int | None,
        feats: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Refine each image's map on that image's soft objective for ``steps`` Adam steps; return (B, H, W) maps.

        ``config.refine_mode`` says what takes the steps. ``"map"``: the map itself, H x W free values per image
        started from the standardised one-pass map, at rate ``config.refine_map_lr`` (in standard deviations of
        that map): a short run of :meth:`optimise_maps`. ``"decoder"``: per-image copies of the decoder's last
        ``config.refine_depth`` layers (:class:`PerImageTail`) at rate ``config.refine_lr``, which keeps the map in
        the family the decoder draws but moves it less per step. Either way the loss is the sum of the per-image
        objectives and Adam is elementwise, so a refined map does not depend on its batch mates, and the grids and
        offsets of the steps come from ``generator`` alone, the same for every image. Everything before the steps
        runs once without autograd; a step costs ``2 x (config.refine_fractions - 2)`` classifier passes with
        backward per image (the curves' ends do not depend on the map). The masks are smoothed as in training
        (``config.mask_sigma``), and the grids are clipped to the short side of ``x``. ``feats``: the decoder's
        inputs for ``x`` (:meth:`features`) if the caller has them (:meth:`predict_and_explain`), else computed here.
        """
        cfg = self.config
        gen = _as_generator(generator if generator is not None else cfg.seed)
        fractions = torch.linspace(0, 1, cfg.refine_fractions, device=x.device)
        # The grid may not exceed the short side of these images (attr_engine_kernels.region_pool): resolved clips
        # the range.
        grid_range = cfg.resolved((x.shape[-2], x.shape[-1])).refine_grid_range
        assert grid_range is not None  # resolved fills it in
        with torch.no_grad():
            inputs = self.features(x) if feats is None else feats
            extra = self.pullback_input(x, target)
            reference, ends = self._objective_ends(x, target)
        # What takes the steps (params) and how the maps follow from it (maps_of); the descent is the same.
        maps_of: Callable[[], torch.Tensor]
        params: list[torch.Tensor]
        if cfg.refine_mode == "map":
            with torch.no_grad():
                start = standardise_maps(self.decoder(inputs, x, target, extra).float())
            if not cfg.refine_smooth:
                free = nn.Parameter(start)
                maps_of = lambda: free
            else:
                # The map moves by a blur of its free values: a step's per-cell blocks arrive smoothed.
                free = nn.Parameter(torch.zeros_like(start))
                sigma = cfg.refine_smooth * min(x.shape[-2:]) / grid_range[1]
                size = blur_kernel_size(sigma)
                maps_of = lambda: start + gaussian_blur(free[:, None], size, sigma)[:, 0]
            params, lr = [free], cfg.refine_map_lr
        else:
            with torch.no_grad():
                hidden = self.decoder.hidden(inputs, x, target, cfg.refine_depth, extra)
            tail = PerImageTail(self.decoder, x.shape[0], cfg.refine_depth)
            maps_of = lambda: self.decoder.with_terms(tail(hidden), x, extra)
            params, lr = list(tail.parameters()), cfg.refine_lr
        maps = self._descend(x, target, params, maps_of, steps=steps, lr=lr, fractions=fractions,
                             grid_range=grid_range, generator=gen, reference=reference, ends=ends)  # fmt: skip
        return maps[steps]

    def _objective_ends(
        self, x: torch.Tensor, target: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The mean-colour reference (B, 3, H, W) of the objective and its curves' ends: the target's probability
        on x (all kept) and on the reference (all removed), each (B,), which no map changes."""
        reference = reference_image(x, "mean", self.classifier.norm_mean)
        ends = target_probabilities(self.classifier, torch.stack((x, reference), dim=1), target, amp=self.config.amp)
        return reference, (ends[:, 0], ends[:, 1])

    def _descend(
        self,
        x: torch.Tensor,
        target: torch.Tensor,
        params: list[torch.Tensor],
        maps_of: Callable[[], torch.Tensor],
        *,
        steps: int,
        lr: float,
        fractions: torch.Tensor,
        grid_range: tuple[int, int],
        generator: torch.Generator,
        reference: torch.Tensor,
        ends: tuple[torch.Tensor, torch.Tensor],
        record: Sequence[int] = (),
    ) -> dict[int, torch.Tensor]:
        """Adam on ``params`` against the sum of the per-image soft objectives of ``maps_of()`` (B, H, W).

        The one loop of refinement and of :meth:`optimise_maps`: each step draws a grid from ``grid_range`` and
        (with ``config.random_offset``) a sub-cell offset from ``generator``, and scores the maps as training does
        at its final temperature without Gumbel noise. Returns ``{step: (B, H, W) float32 maps}`` for every step in
        ``record`` and for ``steps``.
        """
        cfg = self.config.resolved((x.shape[-2], x.shape[-1]))
        optimizer = torch.optim.Adam(params, lr=lr)
        out: dict[int, torch.Tensor] = {}
        with torch.enable_grad():
            for step in range(steps + 1):
                if step in record or step == steps:
                    out[step] = maps_of().detach().float().clone()
                if step == steps:
                    break
                grid = int(torch.randint(grid_range[0], grid_range[1] + 1, (1,), generator=generator))
                offset = tuple(torch.rand(2, generator=generator).tolist()) if cfg.random_offset else (0.0, 0.0)
                result = soft_auc_loss(
                    self.classifier, x, maps_of(), target, reference, grid=grid, fractions=fractions,
                    tau=cfg.tau_end, offset=offset, noise=0.0, endpoints=ends, **cfg.loss_kwargs(),
                )  # fmt: skip
                optimizer.zero_grad(set_to_none=True)
                # The batch mean times B is the sum of the per-image objectives (the peak term is a mean over
                # pixels of the batch too): each image's parameters get its own gradient, not scaled by 1 / B.
                (result.loss * x.shape[0]).backward()
                optimizer.step()
        return out

    def optimise_maps(
        self,
        x: torch.Tensor,
        target: torch.Tensor | None = None,
        *,
        steps: int,
        record: Sequence[int] = (),
        lr: float = 0.05,
        seed: int | None = None,
    ) -> dict[int, torch.Tensor]:
        """The per-image optimum of AHA's training objective: free maps, initialised from the one-pass maps.

        Each image's map (H x W free values, not decoder weights) starts from the explainer's standardised T=0 map
        and takes ``steps`` Adam steps (rate ``lr``) on that image's soft objective as training scores it: grids
        drawn from ``config.grid_range`` with the training's sub-cell offsets, ``config.n_fractions`` fractions,
        the final temperature ``tau_end`` without Gumbel noise, the mask smoothing and peak penalty of training,
        and the mean-colour reference the metrics use. The loss is the sum of the per-image objectives, so a map
        does not depend on its batch mates. No cost limit: this measures what the objective itself would give each
        image (its gap to the one-pass map is the amortization gap); refinement with ``refine_mode="map"`` is a
        short run of the same descent. A step costs ``2 x (n_fractions - 2)`` classifier passes with backward per
        image.

        Args:
            x: (B, 3, H, W) images in [0, 1]; target: (B,) classes (``None``: the predicted ones).
            steps: Adam steps (>= 0); record: step counts (each in [0, steps]) whose maps are returned too.
            lr: Adam step size, in standard deviations of the initial map; seed: the grid draws (None:
                ``config.seed``).

        Returns:
            ``{step: (B, H, W) float32 maps}`` for every step in ``record`` and for ``steps``.
        """
        check_int_at_least(steps, "steps", 0)
        wanted = sorted({*(check_int(s, "record") for s in record), steps})
        if wanted[0] < 0 or wanted[-1] > steps:
            raise ValueError(f"record must hold step counts in [0, {steps}], got {list(record)!r}")
        check_positive(lr, "lr")
        if x.ndim != 4 or x.shape[1] != 3 or not x.is_floating_point():
            raise ValueError(f"x must be float images (B, 3, H, W), got {tuple(x.shape)} {x.dtype}")
        cfg = self.config.resolved((x.shape[-2], x.shape[-1]))
        assert cfg.grid_range is not None  # resolved fills it in
        x = x.float().to(self.device)
        with torch.no_grad():
            if target is None:
                target = self.classifier(x).argmax(dim=1)
            target = target.to(self.device)
            free = nn.Parameter(standardise_maps(self(x, target).float()))
            reference, ends = self._objective_ends(x, target)
        fractions = torch.linspace(0, 1, cfg.n_fractions, device=x.device)
        return self._descend(x, target, [free], lambda: free, steps=steps, lr=lr, fractions=fractions,
                             grid_range=cfg.grid_range, generator=_as_generator(cfg.seed if seed is None else seed),
                             reference=reference, ends=ends, record=wanted)  # fmt: skip

    # ------------------------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------------------------

    # Training: trainer.fit itself, so its options are declared once (a bound call passes this AHA as ``aha``).
    fit = train_decoder

    # ------------------------------------------------------------------------------------------------------------
    # Persistence
    # ------------------------------------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the trained decoder to directory ``path``: ``explainer.safetensors`` + ``config.json``.

        The classifier's own backbone is not saved (it comes from the classifier when loading); a separate backbone
        (``config.backbone``) is saved with the decoder, so loading never downloads or opens anything else. Each
        file is written atomically, the weights first, so a crash never leaves a config pointing at missing weights
        (:func:`~attr_engine.aha.persistence.save_explainer`).
        """
        return save_explainer(self, path)

    def export(
        self,
        path: str | os.PathLike[str],
        *,
        format: str | None = None,
        img_size: int | None = None,
        class_names: Sequence[str] | None = None,
        preprocess: DataConfig | None = None,
    ) -> Path:
        """Write this explainer and its classifier as one serving artifact at ``path`` (atomically).

        ONNX (main format: ``torch.export``, then ``torch.onnx.export(dynamo=True)``; the ``export`` extra) or an
        AOTInductor ``.pt2`` package (``format="pt2"`` or a ``.pt2`` suffix): inputs ``images`` (B, 3, H, W) float32
        in [0, 1] and ``target`` (B,) int64 (-1: the predicted class), outputs ``logits`` (B, K) and ``maps``
        (B, H, W), the maps of :meth:`attribute`; one input size, any batch; metadata inside (classifier
        fingerprint, input size, mean / std, crop, class names where known, settings digest, attr-engine version). See
        :mod:`attr_engine.aha.export`.

        Args:
            img_size: the square side the artifact takes (default :attr:`img_size`).
            class_names: one name per class for the metadata (default: the classifier's, where it knows them).
            preprocess: the crop a server applies to cut an image to the input size, recorded in the metadata
                (default: :func:`~attr_engine.imageops.data_config` of the classifier at ``img_size``).

        Raises:
            ValueError: refinement (``refine_steps`` > 0: an optimiser per request has no graph), or a size the
                classifier does not take, named in one line.
            ImportError: ONNX without onnx / onnxscript installed.
        """
        from attr_engine.aha.export import export

        return export(self, path, format=format, img_size=img_size, class_names=class_names, preprocess=preprocess)

    @classmethod
    def load(cls, path: str | os.PathLike[str], classifier: Classifier, *, trust_backbone: bool = False) -> AHA:
        """Rebuild an explainer saved by :meth:`save` (or a training output directory) for ``classifier``.

        A training directory loads the checkpoint its ``config.json`` points at (see
        :func:`~attr_engine.aha.persistence.checkpoint_dir`). A checkpoint is data: it is rebuilt from its own
        files and ``classifier`` alone. A separate backbone must be a timm registry name whose weights the
        checkpoint holds; every size the files set is checked against the stored weights before anything is
        allocated (:func:`~attr_engine.aha.persistence.load_checkpoint`).

        Args:
            trust_backbone: also accept a separate backbone the checkpoint does not hold the weights of (written
                before backbones were saved), built as its config says: a hub or local-dir name, or timm's
                pretrained weights (a download). Only for checkpoints whose origin you trust.

        Raises:
            FileNotFoundError: the directory or one of its files is missing.
            ValueError: the files are corrupt (non-finite weights, sizes the weights do not confirm), of another
                format, inconsistent with each other, made for a different classifier, or name a backbone the
                loader would have to fetch from elsewhere.
        """
        if isinstance(path, nn.Module):
            raise ValueError(
                f"AHA.load(path, classifier) takes the checkpoint directory first, got a {type(path).__name__} "
                "(are the arguments swapped?)"
            )
        if not isinstance(classifier, Classifier):
            raise ValueError(
                f"classifier must be an attr_engine.Classifier, got {type(classifier).__name__}"
                f"{not_a_classifier_hint(classifier)}"
            )
        ckpt = load_checkpoint(path, classifier, trust_backbone=trust_backbone)
        config = ckpt.config
        backbone = None
        if config.backbone is not None and ckpt.backbone_state:
            backbone = build_backbone(classifier, config.backbone, config.layers, state=ckpt.backbone_state)
        try:
            aha = cls(classifier, config, img_size=ckpt.img_size, backbone=backbone)
        except (AssertionError, IndexError) as err:
            # timm asserts tapped block indices in range: a crafted config's layers, named as such.
            raise ValueError(
                f"{ckpt.src}: the backbone cannot tap the checkpoint's layers {config.layers}: {err}"
            ) from None
        try:
            aha.decoder.load_state_dict(ckpt.decoder_state, strict=True)
        except RuntimeError as err:
            raise ValueError(f"{ckpt.src / WEIGHTS_FILE} does not match the explainer architecture: {err}") from err
        aha.steps_trained = int(ckpt.meta.get("steps_trained", 0))
        return aha


def standardise_maps(maps: torch.Tensor) -> torch.Tensor:
    """Each map (B, H, W) shifted and scaled to mean 0 and standard deviation 1 over its pixels.

    A decoder trained on z-scored region scores learns only an order: its maps' offset and scale are whatever
    training left, so "positive" means nothing. Standardised, a positive pixel is one ranked above the image's
    mean, which is what metrics of positive mass (energy pointing game) and signed colour maps read. The ranking,
    and with it deletion and insertion, is unchanged.
    """
    return standardise(maps, dim=(-2, -1))


def _as_generator(generator: torch.Generator | int) -> torch.Generator:
    if isinstance(generator, torch.Generator):
        return generator
    return torch.Generator().manual_seed(int(generator))


def _registered(classifier: nn.Module, *, aha: AHA | str | os.PathLike[str] | None = None, **options: Any) -> AHA:
    """The registry's ``"aha"``: a trained ``aha`` (for ``classifier``, or the checkpoint directory to load it from)
    with these options as its defaults.

    The seed of refinement defaults to 0 here (not ``config.seed``): what ``get_explainer("aha", ...)`` and the
    CLI have always used, so their refined maps stay the same.
    """
    if isinstance(aha, (str, os.PathLike)):
        if not isinstance(classifier, Classifier):
            raise ValueError(
                f"an AHA checkpoint loads for a Classifier, got {type(classifier).__name__}"
                f"{not_a_classifier_hint(classifier)}"
            )
        aha = AHA.load(aha, classifier)  # its errors name the path and what to pass instead
    if not isinstance(aha, AHA):
        raise ValueError(f"the 'aha' explainer needs a trained AHA passed as aha=..., got {type(aha).__name__}")
    if aha.classifier is not classifier:
        raise ValueError("aha was built for a different classifier than the one given")
    options.setdefault("seed", 0)
    return aha.with_options(**options)


register_explainer("aha", _registered, description="trained AHA explainer (aha=..., refine_steps=T)")
