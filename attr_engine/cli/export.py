"""``attr-engine export``: a trained AHA and its classifier as one serving artifact (ONNX or AOTInductor .pt2), and
an ONNX artifact converted to float16 or int8 decoder weights or pre-optimised (``--artifact``, without torch)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from attr_engine.artifact_precision import OPTIMIZATIONS, PRECISIONS, convert_artifact
from attr_engine.cli._common import (
    UsageError,
    add_classifier_args,
    add_device_arg,
    check_classifier_args,
    check_input_side,
    classifier_args,
    resolve_device,
    resolve_method,
    work_started,
)
from attr_engine.guards import check_aha_dir, check_crop_pct, check_export_side

# Flags of an export from --aha that a conversion of --artifact has no use for.
_EXPORT_ONLY = ("aha", "classifier", "model", "pretrained", "num_classes", "img_size", "class_names", "crop_pct")


def register(subparsers: Any) -> dict[str, argparse.ArgumentParser]:
    p = subparsers.add_parser(
        "export",
        help="write a trained AHA and its classifier as one ONNX (or AOTInductor .pt2) file that serves the "
        "prediction and its map",
        description="Export a trained AHA explainer and its classifier as one self-contained file: inputs images "
        "(B, 3, H, W) float32 in [0, 1] and target (B,) int64 (-1: the predicted class); outputs logits (B, K) and "
        "maps (B, H, W), standardised as explain writes them. One input size, any batch. Runs in onnxruntime "
        "without attr-engine or PyTorch. Only AHA without refinement exports: the other methods need autograd or "
        "many passes per map. With --artifact FILE instead of --aha, an exported ONNX file is converted "
        "(--precision, --optimize) without PyTorch.",
    )
    add_classifier_args(p)
    p.add_argument("--aha", metavar="DIR", help="trained AHA checkpoint directory (train-aha or demo output)")
    p.add_argument("--method", default="aha", help="the method to export: only aha has an exported form")
    p.add_argument("--refine-steps", type=int, default=0, help="must be 0: refinement cannot be exported")
    p.add_argument(
        "--output", "-o", required=True, metavar="FILE", help="the artifact to write (.onnx, or .pt2 for AOTInductor)"
    )
    p.add_argument(
        "--format", choices=("onnx", "pt2"), help="artifact format (default: from the suffix of --output; else onnx)"
    )
    p.add_argument("--img-size", type=int, help="square input side of the artifact (default: the explainer's)")
    p.add_argument(
        "--class-names",
        metavar="FILE",
        help="JSON list of class names to record in the metadata (default: a --classifier checkpoint's train.json "
        "classes, or a transformers model's labels, where known)",
    )
    p.add_argument(
        "--crop-pct",
        type=float,
        help="the centre crop recorded for a server to cut images with, as explain takes it (default: timm's for "
        "--model, 1.0 for a --classifier checkpoint)",
    )
    add_device_arg(p)
    convert = p.add_argument_group("precision and graph optimisation (ONNX)")
    convert.add_argument(
        "--artifact",
        metavar="FILE",
        help="an ONNX file attr-engine export wrote, converted to --output by --precision / --optimize instead of "
        "exporting (no classifier, explainer or PyTorch needed)",
    )
    convert.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="float16: every weight in float16 (about half the bytes; inputs and outputs stay float32); "
        "int8-decoder: the decoder's weights in int8 (dynamic quantisation; the classifier stays float32, so "
        "predictions do not change) (default: float32, or --artifact's own)",
    )
    convert.add_argument(
        "--optimize",
        choices=OPTIMIZATIONS,
        default="none",
        help="onnxruntime's graph optimisation level, applied once and saved in the file (all: with layouts for "
        "this kind of CPU) (default: none)",
    )
    p.set_defaults(run=run_export)
    return {"export": p}


def _check_args(args: argparse.Namespace) -> None:
    """Refusals that need no model: refinement, no explainer, an impossible size, paths of the wrong kind (one line
    each, exit 2), before torch is imported; then another method than aha (its name resolved by the registry). With
    ``--artifact``, only the conversion's own flags count."""
    if args.artifact is not None:
        _check_conversion_args(args)
        return
    if args.refine_steps != 0:
        raise UsageError("--refine-steps must be 0: refinement runs an optimiser per request, which no graph holds")
    if args.aha is None:
        raise UsageError("export needs a trained explainer: pass --aha DIR (train-aha or demo output)")
    if args.img_size is not None:
        check_export_side(args.img_size, flag="--img-size")
    if args.crop_pct is not None:
        check_crop_pct(args.crop_pct, "--crop-pct")
    if Path(args.output).is_dir():
        raise UsageError(f"--output {args.output} is a directory; name the file to write")
    if args.class_names is not None and Path(args.class_names).is_dir():
        raise UsageError(f"--class-names {args.class_names} is a directory; pass the JSON file of class names")
    check_aha_dir(args.aha, cli=True)
    check_classifier_args(args)
    method = resolve_method(args.method)
    if method != "aha":
        raise UsageError(
            f"{method} cannot be exported: only aha has a one-pass graph (the others need autograd or many passes)"
        )


def _check_conversion_args(args: argparse.Namespace) -> None:
    """``--artifact``: no flag of an export from ``--aha``, an ONNX output that is a file name."""
    given = [f"--{name.replace('_', '-')}" for name in _EXPORT_ONLY if getattr(args, name) not in (None, False)]
    if given:
        raise UsageError(
            f"--artifact converts an exported file: it takes no {', '.join(given)} (a flag of an export from --aha)"
        )
    if args.format == "pt2" or Path(args.output).suffix == ".pt2":
        raise UsageError("--artifact converts ONNX files: --output must be an .onnx file, not a .pt2 package")
    if Path(args.output).is_dir():
        raise UsageError(f"--output {args.output} is a directory; name the file to write")


def _convert(source: str, output: str, precision: str | None, optimize: str) -> Path:
    """``source`` converted to ``output`` by :func:`~attr_engine.artifact_precision.convert_artifact` (which
    imports onnx and onnxruntime when it runs, never torch); its refusals as one-line usage errors."""
    try:
        return convert_artifact(source, output, precision=precision, optimize=optimize)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _class_names(path: str | None) -> list[str] | None:
    if path is None:
        return None
    try:
        names = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise UsageError(f"--class-names {path}: {err}") from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise UsageError(f"--class-names {path} must hold a JSON list of strings")
    return names


def run_export(args: argparse.Namespace) -> int:
    _check_args(args)
    if args.artifact is not None:
        # No work_started(): the conversion writes its one file atomically, so a refusal leaves nothing behind.
        path = _convert(args.artifact, args.output, args.precision, args.optimize)
        print(f"wrote {path} ({args.precision or 'precision of the source'}, graph optimisation {args.optimize})")
        return 0
    device = resolve_device(args.device)
    from attr_engine.classifier import load_classifier
    from attr_engine.explainer import get_explainer

    classifier = load_classifier(**classifier_args(args, img_size=args.img_size)).to(device)
    check_input_side(classifier, args.img_size or (classifier.input_size[1] if classifier.input_size else 224))
    from attr_engine.aha import AHA

    explainer = get_explainer("aha", classifier, aha=args.aha)
    assert isinstance(explainer, AHA)  # the registry's "aha" is AHA
    names = _class_names(args.class_names)
    if names is None and args.classifier is not None:
        from attr_engine.classifier import checkpoint_class_names

        names = list(checkpoint_class_names(args.classifier, classifier).values()) or None
    try:
        from attr_engine.aha.export import check_exportable
        from attr_engine.imageops import data_config

        fmt, size = check_exportable(explainer, args.format, args.output, args.img_size, names)
        converted = args.precision not in (None, "float32") or args.optimize != "none"
        if converted and fmt != "onnx":
            raise ValueError("--precision and --optimize convert ONNX artifacts; a .pt2 package has neither")
        # The crop explain and serve use for these flags, recorded so a server of the file cuts images alike.
        crop_pct = args.crop_pct if args.crop_pct is not None else (1.0 if args.classifier else None)
        config = data_config(classifier, img_size=size, crop_pct=crop_pct)
    except ValueError as err:
        raise UsageError(str(err)) from None
    work_started()
    path = explainer.export(
        args.output, format=args.format, img_size=args.img_size, class_names=names, preprocess=config
    )
    if not converted:
        print(f"wrote {path}")
        return 0
    _convert(str(path), str(path), args.precision, args.optimize)
    print(f"wrote {path} ({args.precision or 'float32'}, graph optimisation {args.optimize})")
    return 0
