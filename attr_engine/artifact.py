"""The exported artifact's contract, read without PyTorch: the names :mod:`attr_engine.aha.export` writes, and an
ONNX file checked and described for a server that runs it in onnxruntime (:func:`read_artifact`).

The writer (``attr-engine export``) and the reader (``attr-engine serve --artifact``) share these names, so a file
one writes is a file the other takes. Only onnxruntime, onnx (to cut the classifier's subgraph out of a file), numpy
and the standard library are imported here, lazily.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attr_engine.pixels import DataConfig

__all__ = ["EXPORT_FORMAT", "INPUT_NAMES", "OUTPUT_NAMES", "OnnxArtifact", "read_artifact"]

# The metadata's "format": what marks a file as attr-engine's export, and its version.
EXPORT_FORMAT = "attr_engine.export/1"
INPUT_NAMES: tuple[str, ...] = ("images", "target")
OUTPUT_NAMES: tuple[str, ...] = ("logits", "maps")
FRAMES = ("image", "model")
# The crop of a file written before export recorded one: the whole shorter side (train-classifier's own crop).
OLD_FILE_CROP_PCT = 1.0


@dataclass(frozen=True)
class OnnxArtifact:
    """An exported AHA file (``attr-engine export``) as a server runs it: the file and what its metadata says.

    Attributes:
        path: the ``.onnx`` file: inputs ``images`` (B, 3, H, W) float32 in [0, 1] and ``target`` (B,) int64
            (-1: the predicted class); outputs ``logits`` (B, K) and ``maps`` (B, H, W).
        num_classes: K.
        preprocess: how an image is cut to the file's ``(H, W)``: the metadata's record (export writes the crop
            ``explain`` uses), else the input size with ``crop_pct`` :data:`OLD_FILE_CROP_PCT`, bicubic, centre
            crop; a ``crop_pct`` given to :func:`read_artifact` replaces either's.
        names: one name per class from the metadata's ``class_names``, else empty.
        frame: ``"image"`` (maps in the image's frame, NaN where the crop cut) or ``"model"`` (the input size).
        method: the method the metadata names (``"aha"``).
    """

    path: str
    num_classes: int
    preprocess: DataConfig
    names: tuple[str, ...] = ()
    frame: str = "image"
    method: str = "aha"

    def session(self, threads: int = 1, gpu: bool = False) -> Any:
        """An onnxruntime ``InferenceSession`` of the file with ``threads`` intra-op threads, on onnxruntime's CUDA
        provider first with ``gpu`` (where the installed onnxruntime has it), else the CPU's."""
        return _session(self.path, threads, gpu)

    def logits_session(self, threads: int = 1, gpu: bool = False) -> Any:
        """A session of the file's classifier alone: input ``images``, output ``logits`` (B, K), the file's own
        subgraph from one to the other (``onnx.utils.Extractor``, in memory), or None where the logits need more
        than the images (a file export did not write).

        onnxruntime runs every node of a graph whatever outputs a call asks for, so the full :meth:`session`
        prices a prediction at the prediction and its map; this one at the classifier's cost (measured in
        benches/README.md "HTTP serving"). It holds a second copy of the classifier's weights.
        """
        import onnx

        try:
            graph = onnx.utils.Extractor(onnx.load(self.path)).extract_model(["images"], ["logits"])
            onnx.checker.check_model(graph)
        except Exception:  # onnx's own types (ValidationError, KeyError ...): the logits need "target" too
            return None
        return _session(graph.SerializeToString(), threads, gpu)


def _session(model: str | bytes, threads: int, gpu: bool) -> Any:
    """An onnxruntime session of ``model`` (a path or a serialised graph): ``threads`` intra-op threads, one
    inter-op, onnxruntime's CUDA provider first with ``gpu`` where the installed onnxruntime has it."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    providers = ["CPUExecutionProvider"]
    if gpu and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    return ort.InferenceSession(model, options, providers=providers)


def read_artifact(path: str | os.PathLike[str], *, crop_pct: float | None = None, frame: str = "image") -> OnnxArtifact:
    """The ONNX file at ``path`` loaded once in onnxruntime and described from its metadata.

    Args:
        path: a file ``attr-engine export`` (or ``AHA.export``) wrote.
        crop_pct: replaces the recorded crop (or the default of a file without a record).
        frame: ``"image"`` or ``"model"``, see :class:`OnnxArtifact`.

    Raises:
        ValueError: one line naming ``path``: no such file, not an ONNX file onnxruntime loads, no
            ``attr_engine.export`` metadata, inputs or outputs other than export's, damaged metadata, or a
            ``crop_pct`` out of (0, 1].
    """
    if frame not in FRAMES:
        raise ValueError(f"frame must be one of {', '.join(FRAMES)}, got {frame!r}")
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        session = OnnxArtifact(str(file), 1, DataConfig((1, 1))).session()
    except Exception as err:  # onnxruntime's own types (InvalidProtobuf, Fail, ...), all with a message
        reason = " ".join(str(err).split())[:160]
        raise ValueError(f"{path} is not an ONNX file onnxruntime can load ({reason})") from None
    meta = session.get_modelmeta().custom_metadata_map
    if meta.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{path} has no {EXPORT_FORMAT} metadata: write the file with attr-engine export")
    inputs = tuple(i.name for i in session.get_inputs())
    outputs = tuple(o.name for o in session.get_outputs())
    if inputs != INPUT_NAMES or outputs != OUTPUT_NAMES:
        raise ValueError(
            f"{path} takes {', '.join(inputs)} and gives {', '.join(outputs)}; an attr-engine export takes "
            f"{', '.join(INPUT_NAMES)} and gives {', '.join(OUTPUT_NAMES)}"
        )
    try:
        artifact = _described(str(file), meta, frame)
        if crop_pct is not None:
            artifact = dataclasses.replace(
                artifact, preprocess=dataclasses.replace(artifact.preprocess, crop_pct=float(crop_pct))
            )
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"{path}: {' '.join(str(err).split())}") from None
    return artifact


def _described(path: str, meta: Mapping[str, str], frame: str) -> OnnxArtifact:
    """The artifact the metadata ``meta`` describes; ValueError / TypeError / KeyError for a damaged record."""
    num_classes = int(meta["num_classes"])
    channels, height, width = json.loads(meta["input_size"])
    if num_classes < 1 or channels != 3 or min(height, width) < 1:
        raise ValueError(f"the metadata's num_classes {num_classes} or input_size {meta['input_size']} is damaged")
    names: tuple[str, ...] = ()
    if "class_names" in meta:
        listed = json.loads(meta["class_names"])
        if not isinstance(listed, list) or len(listed) != num_classes:
            raise ValueError(f"the metadata's class_names are not {num_classes} names")
        names = tuple(str(name) for name in listed)
    if "preprocess" in meta:
        preprocess = DataConfig.from_dict(json.loads(meta["preprocess"]))
        if preprocess.input_size != (height, width):
            raise ValueError(f"the recorded preprocess crops {preprocess.input_size}, the file takes {(height, width)}")
    else:
        preprocess = DataConfig((height, width), OLD_FILE_CROP_PCT)
    return OnnxArtifact(path, num_classes, preprocess, names, frame, meta.get("method", "aha"))
