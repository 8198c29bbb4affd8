"""Smaller or pre-optimised copies of an exported artifact, made without PyTorch: float16 weights, int8 weights in
the decoder, onnxruntime's graph optimisations saved into the file.

The copy keeps the contract :func:`attr_engine.artifact.read_artifact` checks: inputs ``images`` (B, 3, H, W)
float32 and ``target`` (B,) int64, outputs ``logits`` (B, K) float32 and ``maps`` (B, H, W) float32, and every
``metadata_props`` entry of the source, plus ``precision`` and ``graph_optimization`` saying what was done. The
converters are onnxruntime's own (``onnxruntime.transformers.float16``, ``onnxruntime.quantization``, a session's
``optimized_model_filepath``), so nothing here rewrites graphs by hand; only onnx, onnxruntime and the standard
library are imported, lazily, so a serving host without torch converts its files. benches/README.md has what each
option costs and how far its maps move.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attr_engine._optional import optional_import
from attr_engine.artifact import EXPORT_FORMAT
from attr_engine.atomic import atomic_path

__all__ = ["OPTIMIZATIONS", "PRECISIONS", "convert_artifact", "decoder_nodes"]

PRECISIONS: tuple[str, ...] = ("float32", "float16", "int8-decoder")
OPTIMIZATIONS: tuple[str, ...] = ("none", "basic", "extended", "all")
_LEVELS = {"basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}
# The module scopes torch.onnx's exporter records per node: "['', 'decoder', 'decoder.fuse.0', ...]".
_SCOPES_KEY = "pkg.torch.onnx.name_scopes"
_MISSING = "converting an artifact needs onnx and onnxruntime: pip install 'attr-engine[export]'"


def convert_artifact(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    precision: str | None = None,
    optimize: str = "none",
) -> Path:
    """Write a converted copy of the attr-engine ONNX artifact ``source`` to ``output`` (atomically: a temporary
    file in ``output``'s folder, renamed over it; ``output`` may be ``source``).

    Args:
        precision: ``"float32"``; ``"float16"``: every float weight and activation in float16 (onnxruntime's
            ``convert_float_to_float16`` with ``keep_io_types``, so the inputs and outputs stay float32; about half
            the bytes; onnxruntime's CPU provider computes the ops it has no float16 kernel for in float32);
            ``"int8-decoder"``: ``quantize_dynamic`` (int8 weights, activations quantised per call) of the
            decoder's nodes only, found by the module scopes torch.onnx records, so the classifier's logits, and
            with them every prediction, stay float32. ``None``: the source's own precision.
        optimize: ``"none"``, or onnxruntime's graph optimisation level (``"basic"``, ``"extended"``, ``"all"``)
            applied once and saved, so a server loads the optimised graph. ``"all"`` adds layouts for the CPU it
            ran on (onnxruntime's NCHWc): such a file is meant for CPUs of that kind; on a float16 file it also
            folds in the float32 copies of the weights the CPU provider computes with, undoing the smaller size.

    Raises:
        ValueError: one line naming ``source``: an unknown precision or level, no such file, not ONNX, no
            attr-engine export metadata, no decoder scopes for ``"int8-decoder"``, or a conversion that cannot be
            made soundly from this source (see :func:`_check_conversion`).
        ImportError: onnx or onnxruntime is not installed.
    """
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if optimize not in OPTIMIZATIONS:
        raise ValueError(f"optimize must be one of {', '.join(OPTIMIZATIONS)}, got {optimize!r}")
    proto = _load(source)
    meta = {entry.key: entry.value for entry in proto.metadata_props}
    before = meta.get("precision", "float32"), meta.get("graph_optimization", "none")
    after = _check_conversion(source, before, precision or before[0], optimize)
    target = Path(output)
    with atomic_path(target) as tmp:
        if after[0] != before[0]:
            proto = _to_precision(proto, after[0], tmp, source)
        if optimize != "none" and optimize != before[1]:
            proto = _optimized(proto, optimize, tmp)
        _set_metadata(proto, {**meta, "precision": after[0], "graph_optimization": after[1]})
        tmp.write_bytes(proto.SerializeToString())
    return target


def _load(source: str | os.PathLike[str]) -> Any:
    """The ONNX model at ``source`` (an ``onnx.ModelProto``), or a one-line ValueError if it is not an artifact
    of attr-engine's export."""
    onnx = optional_import("onnx", _MISSING)
    if not Path(source).is_file():
        raise ValueError(f"{source}: no such file")
    try:
        proto = onnx.load(str(source))
    except Exception as err:  # protobuf's DecodeError and onnx's own, all with a message
        raise ValueError(f"{source} is not an ONNX file ({' '.join(str(err).split())[:160]})") from None
    if {e.key: e.value for e in proto.metadata_props}.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{source} has no {EXPORT_FORMAT} metadata: convert a file attr-engine export wrote")
    return proto


def _check_conversion(
    source: str | os.PathLike[str], before: tuple[str, str], precision: str, optimize: str
) -> tuple[str, str]:
    """The ``(precision, graph_optimization)`` the copy will record, or a one-line ValueError where the conversion
    is unsound: reduced weights cannot be restored or reduced another way (float16 -> float32 or int8), and an
    optimised graph has lost the decoder's scopes and may hold one CPU's layouts, so it is converted no further
    (the same precision and level again is a copy)."""
    had_precision, had_level = before
    if had_level != "none" and (precision != had_precision or optimize not in ("none", had_level)):
        raise ValueError(
            f"{source} is already optimised ({had_level}); convert the unoptimised export to {precision} with "
            f"optimize {optimize}"
        )
    if had_precision != "float32" and precision != had_precision:
        raise ValueError(
            f"{source} holds {had_precision} weights, which cannot become {precision}: convert the float32 export"
        )
    return precision, had_level if optimize == "none" else optimize


def decoder_nodes(proto: Any) -> list[str]:
    """The names of the nodes torch.onnx traced inside the explainer's ``decoder`` module (their recorded module
    scopes start with it): everything between the backbone's levels and the map, the classifier excluded."""
    found = []
    for node in proto.graph.node:
        scopes = next((entry.value for entry in node.metadata_props if entry.key == _SCOPES_KEY), "")
        if scopes.startswith("['', 'decoder'"):
            found.append(node.name)
    return found


def _to_precision(proto: Any, precision: str, tmp: Path, source: str | os.PathLike[str]) -> Any:
    """``proto`` (float32) converted to ``precision`` (``"float16"`` or ``"int8-decoder"``); ``tmp`` is a scratch
    file quantize_dynamic writes to."""
    onnx = optional_import("onnx", _MISSING)
    if precision == "float16":
        float16 = optional_import("onnxruntime.transformers.float16", _MISSING)
        return float16.convert_float_to_float16(proto, keep_io_types=True)
    nodes = decoder_nodes(proto)
    if not nodes:
        raise ValueError(f"{source} records no decoder scopes to quantise: convert a file attr-engine export wrote")
    quantization = optional_import("onnxruntime.quantization", _MISSING)
    root = logging.getLogger()
    advice = _DropMessage("consider to run pre-processing")  # advice for calibrated (static) quantisation
    root.addFilter(advice)
    try:
        quantization.quantize_dynamic(proto, tmp, nodes_to_quantize=nodes, weight_type=quantization.QuantType.QInt8)
    finally:
        root.removeFilter(advice)
    return onnx.load(str(tmp))


class _DropMessage(logging.Filter):
    """A logging filter that drops the records whose message contains ``words``."""

    def __init__(self, words: str) -> None:
        super().__init__()
        self.words = words

    def filter(self, record: logging.LogRecord) -> bool:
        return self.words not in record.getMessage()


def _optimized(proto: Any, level: str, tmp: Path) -> Any:
    """``proto`` as onnxruntime's CPU provider rewrites it at graph optimisation ``level`` (written to ``tmp`` by
    the session, read back)."""
    onnx = optional_import("onnx", _MISSING)
    ort = optional_import("onnxruntime", _MISSING)
    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _LEVELS[level])
    options.optimized_model_filepath = str(tmp)
    options.log_severity_level = 3  # errors only: level all's warning about CPU-specific layouts is documented
    ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return onnx.load(str(tmp))


def _set_metadata(proto: Any, meta: Mapping[str, str]) -> None:
    """Replace ``proto``'s ``metadata_props`` with ``meta`` (every value a string, as ONNX takes them)."""
    del proto.metadata_props[:]
    for key, value in meta.items():
        proto.metadata_props.add(key=key, value=value)
