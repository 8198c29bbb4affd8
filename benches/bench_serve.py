"""Serving cost (issues #30, #41): the prediction alone against the prediction and its AHA map, eager and exported,
side by side in one process, for the full-resolution decoder and the decoder at a stride.

    nice -n 10 python -u -m benches.bench_serve --no-pt2                          # everything below (long)
    nice -n 10 python -u -m benches.bench_serve --models resnet50,convnext_tiny,vit_small_patch16_224 --sizes 224 \
        --strides 1,4,8 --no-pt2
    nice -n 10 python -u -m benches.bench_serve --models resnet18 --sizes 224 --batches 1 --threads 1 --decoder light
    nice -n 10 python -u -m benches.bench_serve --models resnet18 --sizes 64 --batches 1 --repeats 1 --no-pt2  # smoke

Models (untrained, 10 classes, built at each size): timm ``resnet18``, ``resnet50``, ``convnext_tiny`` and
``vit_small_patch16_224`` (the models production serves; untrained weights cost what trained ones do), and the
leaderboard's small ViT (``vit``: ``small_model_config("vit")``, 4 blocks, width 96, an 8 x 8 patch grid at every
size). The explainer is an untrained AHA with the default config, ``--decoder`` and each of ``--strides``
(``AHAConfig.decoder_stride``; 1 is the full-resolution decoder). For each thread count (torch and onnxruntime
both set to it) and batch, the minimum over ``--repeats`` calls after one warm-up, in ms per image:

- ``classifier``: ``classifier(x)`` under ``torch.inference_mode`` (eager), and the classifier alone exported to ONNX
  in onnxruntime (``classifier ort``); measured once per model, size, threads and batch, shared by the strides;
- ``attribute``: ``aha.attribute(x)``, which runs the classifier for the prediction, then the backbone again;
- ``fused``: ``aha.predict_and_explain(x)``, logits and levels from one backbone pass;
- ``onnx``: the artifact of ``aha.export`` in onnxruntime (CPU provider), target -1;
- ``pt2``: the AOTInductor package of ``aha.export`` (``--no-pt2`` skips its compile, minutes per model and size).

Ratios from the same run: ``fused / classifier`` and ``onnx / classifier ort`` (the map's price in multiples of the
prediction, eager and exported; issue #41's target <= 1.25 on resnet50, convnext_tiny and vit_small and <= 1.5 on
resnet18 at 224 px, 1 thread), the decoder's share of ``fused`` (``(fused - classifier) / fused``), and ``|maps|``
the largest difference between the ONNX artifact's maps and eager's (<= 1e-4).

``--flops`` prints the work instead, per image at batch 1 (a count, the same under any load): GFLOPs of the
classifier and of ``predict_and_explain`` as ``torch.utils.flop_counter`` counts them (matrix products,
convolutions, attention; elementwise operations such as the guided upsampler's, about 90 a pixel, are not counted).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from attr_engine.aha import AHA, AHAConfig
from attr_engine.classifier import Classifier
from benches.bench_floor import best_ms, build

MODELS = ("resnet18", "resnet50", "convnext_tiny", "vit_small_patch16_224", "vit")
COLUMNS = ("classifier", "classifier ort", "attribute", "fused", "onnx", "pt2")


class _Logits(nn.Module):
    """The classifier alone as a graph: [0, 1] images -> logits (normalisation inside, no input checks)."""

    def __init__(self, classifier: Classifier) -> None:
        super().__init__()
        self.classifier = classifier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier.model(self.classifier.normalize(x))


def export_classifier(classifier: Classifier, size: int, path: Path) -> Path:
    batch = torch.export.Dim("batch", min=1, max=4096)
    example = (torch.rand(2, 3, size, size),)
    program = torch.onnx.export(
        _Logits(classifier).eval(), example, dynamo=True, dynamic_shapes={"x": {0: batch}}, verbose=False
    )
    assert program is not None
    program.save(str(path), external_data=False)
    return path


def session(path: Path, threads: int):  # -> onnxruntime.InferenceSession
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def export_explainer(aha: AHA, root: Path, pt2: bool) -> dict[str, Path]:
    """The exported files of one explainer, with their export times printed."""
    paths: dict[str, Path] = {}
    start = time.perf_counter()
    paths["onnx"] = aha.export(root / "aha.onnx")
    print(f"  exported AHA (stride {aha.config.decoder_stride}) to ONNX in {time.perf_counter() - start:.0f} s",
          flush=True)  # fmt: skip
    if pt2:
        start = time.perf_counter()
        paths["pt2"] = aha.export(root / "aha.pt2")
        print(f"  compiled the .pt2 in {time.perf_counter() - start:.0f} s", flush=True)
    return paths


def measure_classifier(classifier: Classifier, path: Path, x: torch.Tensor, threads: int, repeats: int) -> dict:
    """ms per image of the classifier alone, eager and in onnxruntime."""
    torch.set_num_threads(threads)
    with torch.inference_mode():
        eager = best_ms(lambda: classifier(x), len(x), repeats)
    clf_session = session(path, threads)
    return {
        "classifier": eager,
        "classifier ort": best_ms(lambda: clf_session.run(None, {"x": x.numpy()}), len(x), repeats),
    }


def measure(aha: AHA, paths: dict[str, Path], x: torch.Tensor, threads: int, repeats: int) -> dict[str, float]:
    """ms per image of the explainer's columns (the ones with an artifact) and the ONNX maps' largest difference."""
    torch.set_num_threads(threads)
    batch = len(x)
    feed = {"images": x.numpy(), "target": np.full(batch, -1, np.int64)}
    row: dict[str, float] = {}
    row["attribute"] = best_ms(lambda: aha.attribute(x), batch, repeats)
    row["fused"] = best_ms(lambda: aha.predict_and_explain(x), batch, repeats)
    aha_session = session(paths["onnx"], threads)
    row["onnx"] = best_ms(lambda: aha_session.run(None, feed), batch, repeats)
    maps = aha_session.run(["maps"], feed)[0]
    row["|maps|"] = float(np.abs(maps - aha.predict_and_explain(x)[1].numpy()).max())
    if "pt2" in paths:
        from torch._inductor import aoti_load_package

        compiled = aoti_load_package(str(paths["pt2"]))
        target = torch.full((batch,), -1, dtype=torch.long)
        with torch.inference_mode():
            row["pt2"] = best_ms(lambda: compiled(x, target), batch, repeats)
    return row


def print_row(model: str, size: int, stride: int, threads: int, batch: int, row: dict[str, float]) -> None:
    cells = [f"{row[c]:.2f}" if c in row else "-" for c in COLUMNS]
    fused_ratio = row["fused"] / row["classifier"]
    onnx_ratio = row["onnx"] / row["classifier ort"]
    share = (row["fused"] - row["classifier"]) / row["fused"]
    print(
        f"| {model} | {size} | {stride} | {threads} | {batch} | " + " | ".join(cells)
        + f" | {fused_ratio:.2f} | {onnx_ratio:.2f} | {share:.0%} | {row['|maps|']:.1e} |",
        flush=True,
    )  # fmt: skip


def gflops(fn: Callable[[torch.Tensor], object], x: torch.Tensor) -> float:
    """The GFLOPs ``fn(x)`` runs, without autograd."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn(x)
    return counter.get_total_flops() / 1e9


def print_flops(models: list[str], sizes: list[int], strides: list[int], decoder: str) -> None:
    """The work table: per model, size and stride, the classifier's and the prediction-and-map's GFLOPs an image.

    timm's fused attention is switched off first: on the CPU it runs an op flop_counter has no formula for (counted
    as 0), while the unfused path's matrix products are counted; the models are built after the switch.
    """
    from timm.layers import set_fused_attn

    set_fused_attn(False)
    print("| model | px | stride | classifier GFLOPs | fused GFLOPs | fused / classifier | decoder share |")
    print("|---|---|---|---|---|---|---|")
    for model in models:
        for size in sizes:
            classifier = build(model, size)
            x = torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(0))
            base = gflops(classifier, x)
            for stride in strides:
                aha = AHA(classifier, AHAConfig(decoder=decoder, decoder_stride=stride), img_size=size)
                fused = gflops(aha.predict_and_explain, x)
                print(f"| {model} | {size} | {stride} | {base:.2f} | {fused:.2f} | {fused / base:.2f} | "
                      f"{(fused - base) / fused:.0%} |", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--sizes", default="224,64")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts (torch and onnxruntime)")
    parser.add_argument("--strides", default="1,4,8", help="comma-separated AHAConfig.decoder_stride values")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-pt2", action="store_true", help="skip the AOTInductor package (a compile of minutes)")
    parser.add_argument("--decoder", choices=("full", "light"), default="full", help="AHAConfig.decoder")
    parser.add_argument("--flops", action="store_true", help="print GFLOPs an image (batch 1) instead of timing")
    args = parser.parse_args()
    models = args.models.split(",")
    sizes, strides = [int(s) for s in args.sizes.split(",")], [int(s) for s in args.strides.split(",")]
    if args.flops:
        print_flops(models, sizes, strides, args.decoder)
        return
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"decoder {args.decoder}", flush=True)
    print(
        "| model | px | stride | threads | batch | " + " | ".join(COLUMNS) + " | fused / classifier "
        "| onnx / classifier ort | decoder share | max map diff |"
    )
    print("|" + "---|" * (len(COLUMNS) + 9))
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            for size in sizes:
                classifier = build(model, size)
                root = Path(tmp) / f"{model}-{size}"
                root.mkdir()
                clf_path = export_classifier(classifier, size, root / "classifier.onnx")
                explainers = {}
                for stride in strides:
                    aha = AHA(classifier, AHAConfig(decoder=args.decoder, decoder_stride=stride), img_size=size)
                    (root / str(stride)).mkdir()
                    explainers[stride] = aha, export_explainer(aha, root / str(stride), not args.no_pt2)
                for threads in (int(t) for t in args.threads.split(",")):
                    for batch in (int(b) for b in args.batches.split(",")):
                        x = torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(0))
                        base = measure_classifier(classifier, clf_path, x, threads, args.repeats)
                        for stride, (aha, paths) in explainers.items():
                            print_row(
                                model,
                                size,
                                stride,
                                threads,
                                batch,
                                {**base, **measure(aha, paths, x, threads, args.repeats)},
                            )
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
