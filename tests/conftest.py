"""Test-suite set-up: Triton kernels run through the CPU interpreter, so no GPU is needed.

TRITON_INTERPRET must be in the environment before triton is imported (triton.jit reads it when a kernel is
decorated), hence it is set here, at the very top, before anything imports torch, triton or kernels.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("ATTR_ENGINE_BACKEND", "auto")

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _deterministic_seed() -> None:
    torch.manual_seed(0)


# ---------------------------------------------------------------------------------------------------------------
# Five tiny classifiers, one per model family attr-engine explains (session-scoped: built once, shared by the
# method matrix, the soft-adjoint and the loader tests). Each is frozen, 5 classes, 32 px, built with its own seed.
# ---------------------------------------------------------------------------------------------------------------

ZOO = ("timm_cnn", "timm_vit", "tv_resnet", "tv_vit", "hf_vit")
ZOO_CLASSES = 5


def _seeded(build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build()


@pytest.fixture(scope="session")
def timm_cnn():
    from attr_engine.classifier import load_classifier

    return _seeded(lambda: load_classifier("resnet10t", num_classes=ZOO_CLASSES, img_size=32, channels=[8, 16, 32, 64]))


@pytest.fixture(scope="session")
def timm_vit():
    from attr_engine.classifier import load_classifier

    kwargs = dict(img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2)
    return _seeded(lambda: load_classifier("vit_tiny_patch16_224", num_classes=ZOO_CLASSES, **kwargs))


@pytest.fixture(scope="session")
def tv_resnet():
    """A torchvision ResNet with one BasicBlock per stage (resnet18's layout at a quarter of its depth)."""
    from torchvision.models.resnet import BasicBlock, ResNet

    from attr_engine.classifier import Classifier
    from attr_engine.model_sources import IMAGENET_MEAN, IMAGENET_STD

    model = _seeded(lambda: ResNet(BasicBlock, [1, 1, 1, 1], num_classes=ZOO_CLASSES))
    return Classifier(model, IMAGENET_MEAN, IMAGENET_STD, input_size=(3, 32, 32))


@pytest.fixture(scope="session")
def tv_vit():
    """A 2-layer torchvision VisionTransformer on 32 px (4 x 4 patches); its zero-initialised head made random, else
    every logit (and every gradient) would be zero."""
    import torchvision

    from attr_engine.classifier import Classifier
    from attr_engine.model_sources import IMAGENET_MEAN, IMAGENET_STD

    def build():
        model = torchvision.models.VisionTransformer(
            image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=ZOO_CLASSES
        )
        torch.nn.init.normal_(model.heads.head.weight, std=0.5)
        return model

    return Classifier(_seeded(build), IMAGENET_MEAN, IMAGENET_STD)


def tiny_hf_vit(attn_implementation: str = "sdpa"):
    """A 2-layer transformers ViTForImageClassification on 32 px (4 x 4 patches), untrained, built offline."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=32, patch_size=8, num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
        intermediate_size=64, num_labels=ZOO_CLASSES, attn_implementation=attn_implementation,
    )  # fmt: skip
    return _seeded(lambda: ViTForImageClassification(config))


@pytest.fixture(scope="session")
def hf_vit():
    from attr_engine.classifier import Classifier
    from attr_engine.model_sources import HFImageClassifier

    return Classifier(HFImageClassifier(tiny_hf_vit()), (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
