"""Small classifiers for the evaluation-suite tests (metrics, baselines, leaderboard): fast on a CPU, seeded; and
the hand-made files the export and serve tests share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attr_engine.artifact import OnnxArtifact
from attr_engine.classifier import Classifier, load_classifier
from attr_engine.pixels import DataConfig

MEAN = (0.5, 0.4, 0.3)
STD = (0.25, 0.2, 0.5)


def tiny_convnet(num_classes: int = 5, seed: int = 0) -> Classifier:
    """Conv-ReLU-MaxPool-Conv-ReLU-pool-linear on 16 px images: nonlinear, so explanations differ per input."""
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32, num_classes),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    return Classifier(model, MEAN, STD)


class LinearLogits(nn.Module):
    """logits[:, k] = sum(weight[k] * z) for normalised input z (B, 3, H, W): every explanation is known exactly."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # (K, 3, H, W)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bchw,kchw->bk", z, self.weight)


def linear_classifier(num_classes: int = 4, size: int = 8, seed: int = 0) -> Classifier:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_classes, 3, size, size, generator=gen)
    return Classifier(LinearLogits(weight), MEAN, STD, input_size=(3, size, size), num_classes=num_classes)


def tiny_vit(num_classes: int = 4, seed: int = 0) -> Classifier:
    """A 2-block timm ViT on 32 px (4 x 4 patch grid, class token)."""
    torch.manual_seed(seed)
    return load_classifier(
        "vit_tiny_patch16_224", num_classes=num_classes, img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2
    )


def tiny_resnet(num_classes: int = 4, seed: int = 0) -> Classifier:
    """timm resnet10t at channels (8, 16, 32, 64), for 32 px images."""
    torch.manual_seed(seed)
    return load_classifier("resnet10t", num_classes=num_classes, img_size=32, channels=[8, 16, 32, 64])


def images(n: int, size: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run torch ops on one thread, then restore the count.

    These models are tiny: with several threads on a loaded machine every op waits for its threads to be scheduled
    (about 10 ms per op on 2 shared cores), which is far slower than doing the work on one.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def untrained_resnet_checkpoint(directory: Path) -> Path:
    """An untrained small ResNet at 32 px with 6 classes (seed 0), saved in ``directory`` as train-classifier
    would: the classifier the CLI and registry tests explain."""
    from attr_engine.classifier import save_classifier
    from attr_engine.classifier_training import small_model_config

    torch.manual_seed(0)
    path = directory / "classifier.safetensors"
    save_classifier(small_model_config("resnet", 32).build(6), path)
    return path


def onnx_session(path: Path) -> Any:
    """An onnxruntime CPU session of ``path`` on one thread, as the tests' torch runs (an ``InferenceSession``)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def logits_read_the_target(path: Path) -> OnnxArtifact:
    """A hand-written file of export's inputs and outputs (3 classes, 4 x 4 images) whose logits read ``target``:
    ``logits[b, k] = mean(images[b, k]) + target[b]``, so its classifier cannot be cut out alone."""
    import onnx
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("ReduceMean", ["images"], ["pooled"], axes=[2, 3], keepdims=0),
        helper.make_node("Cast", ["target"], ["shift"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["shift", "one"], ["column"]),
        helper.make_node("Add", ["pooled", "column"], ["logits"]),
        helper.make_node("ReduceMean", ["images"], ["maps"], axes=[1], keepdims=0),
    ]
    value = helper.make_tensor_value_info
    inputs = [value("images", TensorProto.FLOAT, ["B", 3, 4, 4]), value("target", TensorProto.INT64, ["B"])]
    outputs = [value("logits", TensorProto.FLOAT, ["B", 3]), value("maps", TensorProto.FLOAT, ["B", 4, 4])]
    one = helper.make_tensor("one", TensorProto.INT64, [1], [1])
    graph = helper.make_graph(nodes, "logits_read_the_target", inputs, outputs, [one])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return OnnxArtifact(str(path), 3, DataConfig((4, 4)))
