"""A trained AHA and its classifier as one serving artifact: ONNX (main) or an AOTInductor ``.pt2`` package.

The artifact maps images to the prediction and its map in one graph, so a runtime without Python or attr-engine
(onnxruntime, Triton, an AOTInductor loader) serves both:

- inputs ``images`` (B, 3, H, W) float32 in [0, 1] and ``target`` (B,) int64, the class to explain per image,
  ``-1`` for the predicted one;
- outputs ``logits`` (B, K) float32 and ``maps`` (B, H, W) float32, standardised per image as
  :meth:`~attr_engine.aha.model.AHA.attribute` returns them.

One graph per input size: the decoder's Python (levels ordered by size, the count of x2 upsampling steps) and the
ViTs' patch grids are resolved for that size when tracing; the batch stays dynamic. Nothing in the graph reads
values: the checks :meth:`~attr_engine.aha.model.AHA.attribute` makes (finite images, targets in range) are the
caller's: any negative target means the predicted class, and one >= K is an index error of the runtime.
Refinement (an optimiser per request) and other methods than AHA have no such graph and are refused.

The artifact carries its metadata: in ONNX ``metadata_props``, in a ``.pt2`` the AOTInductor package's metadata
(``torch._inductor.aoti_load_package(path).get_metadata()``); see :func:`export_metadata`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from attr_engine._optional import optional_import
from attr_engine.aha.config import AHAConfig
from attr_engine.aha.loss import standardise
from attr_engine.aha.network import Decoder, FeatureBackbone, with_prediction
from attr_engine.artifact import EXPORT_FORMAT, INPUT_NAMES, OUTPUT_NAMES
from attr_engine.atomic import atomic_write
from attr_engine.classifier import Classifier, classifier_fingerprint, eval_mode
from attr_engine.guards import check_export_side
from attr_engine.pixels import DataConfig

__all__ = [
    "EXPORT_FORMATS",
    "INPUT_NAMES",
    "OUTPUT_NAMES",
    "Exportable",
    "ServingModule",
    "check_exportable",
    "class_names",
    "export",
    "export_metadata",
    "strip_source_paths",
]

EXPORT_FORMATS: tuple[str, ...] = ("onnx", "pt2")
# Node metadata keys ending so hold a traceback of the tracing machine's source files.
_PATH_KEY_SUFFIX = "stack_trace"
_MISSING_ONNX = "exporting to ONNX needs onnx and onnxscript: pip install 'attr-engine[export]'"


class Exportable(Protocol):
    """What export reads of an explainer (:class:`attr_engine.aha.model.AHA` has all of it); a protocol so this
    module does not import the model module, which imports it."""

    classifier: Classifier
    config: AHAConfig
    img_size: int
    steps_trained: int
    decoder: Decoder
    backbone: FeatureBackbone
    defaults: dict[str, Any]


class ServingModule(nn.Module):
    """The traced graph: ``(images (B, 3, H, W) in [0, 1], target (B,) int64, -1 = predicted) -> (logits (B, K),
    maps (B, H, W))``, both float32.

    One backbone pass gives the logits and the decoder's levels where the backbone is the classifier's own network
    (:meth:`FeatureBackbone.forward_with_logits`); a separate backbone runs next to the classifier. No value is read
    on the way (no validation, no ``.tolist()``), which is what lets ``torch.export`` trace it with a dynamic batch.
    """

    def __init__(self, explainer: Exportable) -> None:
        super().__init__()
        self.backbone = explainer.backbone
        self.decoder = explainer.decoder
        self.classifier = explainer.classifier
        self.fused = explainer.backbone.model is explainer.classifier.model
        self.zscore = explainer.config.score_norm == "zscore"
        self.prediction = explainer.config.prediction_input

    def forward(self, images: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            feats, logits = self.backbone.forward_with_logits(images)
        else:
            feats = self.backbone(images)
            logits = self.classifier.forward_trusted(images)
        if self.prediction:
            feats = with_prediction(feats, logits)
        classes = torch.where(target < 0, logits.argmax(dim=1), target)
        maps = self.decoder(feats, images, classes).float()
        return logits.float(), standardise(maps, dim=(-2, -1)) if self.zscore else maps


def class_names(classifier: Classifier) -> list[str] | None:
    """The classifier's class names where its source knows them: a transformers config's ``id2label`` (unless it
    holds only the generic ``LABEL_i``), else None."""
    config = getattr(classifier.model, "config", None)
    labels = getattr(config, "id2label", None)
    if isinstance(labels, Mapping) and len(labels) == classifier.num_classes:
        names = [str(labels.get(i, labels.get(str(i), ""))) for i in range(classifier.num_classes)]
        if any(name != f"LABEL_{i}" for i, name in enumerate(names)):
            return names
    return None


def export_metadata(
    explainer: Exportable,
    img_size: int,
    names: Sequence[str] | None = None,
    preprocess: DataConfig | None = None,
) -> dict[str, str]:
    """The artifact's metadata, every value a string (ONNX ``metadata_props`` take only strings; lists and numbers
    are JSON): the format, attr-engine version, method, classifier fingerprint (as AHA checkpoints record it), input
    size, mean / std, number of classes, class names (where known), the crop that cuts an image to the input size
    (``preprocess``, a :meth:`DataConfig.to_dict` record; default: :func:`~attr_engine.imageops.data_config` of the
    classifier at ``img_size``), the explainer's settings and their digest (a hash of the resolved config and the
    decoder's weights), and the input / output contract."""
    from attr_engine import __version__
    from attr_engine.imageops import data_config

    clf = explainer.classifier
    settings = {"config": explainer.config.to_dict(), "steps_trained": explainer.steps_trained, "refine_steps": 0}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for name, value in explainer.decoder.state_dict().items():
        digest.update(name.encode())
        digest.update(value.detach().cpu().float().contiguous().numpy().tobytes())
    meta = {
        "format": EXPORT_FORMAT,
        "attr_engine_version": __version__,
        "method": "aha",
        "classifier_fingerprint": classifier_fingerprint(clf),
        "classifier_name": clf.model_name or type(clf.model).__name__,
        "input_size": json.dumps([3, img_size, img_size]),
        "mean": json.dumps(list(clf.mean)),
        "std": json.dumps(list(clf.std)),
        "num_classes": str(clf.num_classes),
        "preprocess": json.dumps((preprocess or data_config(clf, img_size=img_size)).to_dict()),
        "settings": json.dumps(settings, sort_keys=True),
        "settings_digest": digest.hexdigest()[:16],
        "inputs": "images: (B, 3, H, W) float32 in [0, 1]; target: (B,) int64, -1 = the predicted class",
        "outputs": "logits: (B, K) float32; maps: (B, H, W) float32, standardised per image",
    }
    names = list(names) if names is not None else class_names(clf)
    if names is not None:
        meta["class_names"] = json.dumps([str(n) for n in names])
    return meta


def check_exportable(
    explainer: Exportable,
    format: str | None,
    path: str | os.PathLike[str],
    img_size: int | None = None,
    class_names: Sequence[str] | None = None,
    preprocess: DataConfig | None = None,
) -> tuple[str, int]:
    """The format and input side :func:`export` would use for these arguments, or a one-line ValueError saying why
    the explainer cannot be exported so (another method, refinement, a size the classifier does not take, class
    names of the wrong count, a crop to another size, an unknown format)."""
    fmt = format or ("pt2" if Path(path).suffix == ".pt2" else "onnx")
    size = getattr(explainer, "img_size", None) if img_size is None else img_size
    _refuse(explainer, fmt, size, class_names)
    if preprocess is not None and preprocess.input_size != (size, size):
        raise ValueError(f"preprocess crops {preprocess.input_size} images; the artifact takes {size} x {size}")
    return fmt, size  # type: ignore[return-value]  # _refuse checked it is an int


def _refuse(explainer: Exportable, fmt: str, img_size: Any, names: Sequence[str] | None) -> None:
    """Refuse in one line what has no exported graph (see the module docstring)."""
    if getattr(explainer, "name", None) != "aha" or not isinstance(getattr(explainer, "decoder", None), Decoder):
        raise ValueError(
            f"only AHA exports (one forward pass per map); {type(explainer).__name__} needs autograd or many "
            "passes per map, which no exported graph holds"
        )
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"format must be one of {EXPORT_FORMATS}, got {fmt!r}")
    if explainer.config.pullback_input:
        raise ValueError(
            "an AHA with pullback_input cannot be exported: its decoder takes the classifier's Soft Pullback, a "
            "gradient, which no exported graph holds; export one trained without it"
        )
    if explainer.defaults.get("refine_steps"):
        raise ValueError(
            "refine_steps > 0 cannot be exported: refinement runs an optimiser per request; export the one-pass "
            "explainer (refine_steps=0)"
        )
    check_export_side(img_size)
    expected = explainer.classifier.input_size
    if expected is not None and (expected[1], expected[2]) != (img_size, img_size) and _fixed_size(explainer):
        raise ValueError(
            f"the classifier takes {expected[1]} x {expected[2]} images (its patch grid is fixed), not {img_size}"
        )
    if names is not None and len(names) != explainer.classifier.num_classes:
        raise ValueError(f"class_names has {len(names)} names for {explainer.classifier.num_classes} classes")


def _fixed_size(explainer: Exportable) -> bool:
    """Whether the backbone's input size is fixed (a ViT's patch grid and position embeddings)."""
    model = explainer.classifier.model
    patch_embed = getattr(model, "patch_embed", None)
    if patch_embed is not None and not getattr(patch_embed, "dynamic_img_size", False):
        return getattr(patch_embed, "img_size", None) is not None
    return hasattr(model, "image_size") or hasattr(getattr(model, "config", None), "image_size")


def export(
    explainer: Exportable,
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    img_size: int | None = None,
    class_names: Sequence[str] | None = None,
    preprocess: DataConfig | None = None,
) -> Path:
    """Write ``explainer`` and its classifier as a serving artifact at ``path`` (atomically) and return the path.

    Args:
        explainer: a trained :class:`~attr_engine.aha.model.AHA` with ``refine_steps`` 0.
        path: the file to write; ``format`` None takes it from the suffix (``.pt2``: AOTInductor, else ONNX).
        format: ``"onnx"`` (torch.export, then ``torch.onnx.export(dynamo=True)``) or ``"pt2"`` (AOTInductor, a
            C++ compile of the graph for this machine's CPU, or its GPU when the classifier is on one).
        img_size: the square input side the graph takes (default: the explainer's ``img_size``).
        class_names: one name per class for the metadata (default: the classifier's own, where known).
        preprocess: the crop that cuts an image to the input size, recorded for a server to apply (default:
            :func:`~attr_engine.imageops.data_config` of the classifier at ``img_size``; a ``train-classifier``
            checkpoint is explained with ``crop_pct=1.0``, which ``attr-engine export`` records).

    Raises:
        ValueError: what cannot be exported (another method, refinement, a size the classifier does not take).
        ImportError: ONNX without the ``export`` extra installed.
    """
    target = Path(path)
    fmt, size = check_exportable(explainer, format, target, img_size, class_names, preprocess)
    if fmt == "onnx":
        optional_import("onnx", _MISSING_ONNX)
        optional_import("onnxscript", _MISSING_ONNX)
    meta = export_metadata(explainer, size, class_names, preprocess)
    module = ServingModule(explainer)
    device = explainer.classifier.norm_mean.device
    # Batch 2 when tracing: a batch of 1 would let the tracer specialise every size-1 broadcast to the batch. Drawn
    # from a generator of its own, so exporting leaves the caller's random state alone.
    images = torch.rand(2, 3, size, size, generator=torch.Generator().manual_seed(0)).to(device)
    example = (images, torch.full((2,), -1, dtype=torch.long, device=device))
    batch = torch.export.Dim("batch", min=1, max=4096)
    dynamic = {"images": {0: batch}, "target": {0: batch}}
    # Traced in eval mode (batch-norm statistics, no dropout); every module's own mode comes back afterwards.
    with eval_mode(module), torch.no_grad():
        program = torch.export.export(module, example, dynamic_shapes=dynamic, strict=False)
    if fmt == "onnx":
        _write_onnx(program, target, meta)
    else:
        _write_pt2(program, target, meta)
    return target


def _write_onnx(program: torch.export.ExportedProgram, target: Path, meta: Mapping[str, str]) -> None:
    onnx = optional_import("onnx", _MISSING_ONNX)
    onnx_program = torch.onnx.export(
        program, input_names=list(INPUT_NAMES), output_names=list(OUTPUT_NAMES), dynamo=True, verbose=False
    )
    assert onnx_program is not None  # no file given: the program is returned
    proto = onnx_program.model_proto
    strip_source_paths(proto.graph)
    for key, value in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.checker.check_model(proto)
    # One file, weights inside: the artifact must be self-contained (the default would write them beside it).
    with atomic_write(target) as f:
        f.write(proto.SerializeToString())


def strip_source_paths(graph: Any) -> None:
    """Drop the node metadata that names files (``pkg.torch.onnx.stack_trace``: the tracing machine's paths to
    attr-engine's and torch's sources) from an ONNX ``graph`` and the subgraphs its nodes hold, so the artifact
    carries no path of the machine that exported it. The module scopes (``pkg.torch.onnx.name_scopes``,
    ``namespace``) stay: they name modules, not files, and mark the decoder's nodes for
    :func:`attr_engine.artifact_precision.convert_artifact`."""
    for node in graph.node:
        kept = [entry for entry in node.metadata_props if not entry.key.endswith(_PATH_KEY_SUFFIX)]
        del node.metadata_props[:]
        node.metadata_props.extend(kept)
        for attribute in node.attribute:
            for subgraph in (*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs):
                strip_source_paths(subgraph)


def _write_pt2(program: torch.export.ExportedProgram, target: Path, meta: Mapping[str, str]) -> None:
    from torch._inductor import aoti_compile_and_package

    with atomic_write(target) as f:
        # AOTInductor writes the package into any writable, seekable file: the temporary one atomic_write renames.
        aoti_compile_and_package(program, package_path=f, inductor_configs={"aot_inductor.metadata": dict(meta)})
