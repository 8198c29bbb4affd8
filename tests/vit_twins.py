"""Tiny torchvision and transformers ViTs and their timm twins: a timm ``VisionTransformer`` given the same weights,
so a method's maps on either model can be checked against its timm path (itself checked against the official code
where there is one: tests/test_legrad.py, tests/test_gradcam.py)."""

from __future__ import annotations

from functools import partial

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from attr_engine.classifier import Classifier
from attr_engine.model_sources import HFImageClassifier

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def tv_vit(image_size: int = 32, patch_size: int = 8, seed: int = 0) -> Classifier:
    """A 2-layer torchvision VisionTransformer; its zero-initialised head made random (else every gradient is 0)."""
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.VisionTransformer(
        image_size=image_size, patch_size=patch_size, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
        num_classes=4,
    )  # fmt: skip
    nn.init.normal_(model.heads.head.weight, std=0.5)
    return Classifier(model, MEAN, STD)


def hf_vit(image_size: int = 32, patch_size: int = 8, seed: int = 0, attn: str = "sdpa") -> Classifier:
    """A 2-layer transformers ViTForImageClassification, wrapped as the README says."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    config = ViTConfig(
        image_size=image_size, patch_size=patch_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=4, attn_implementation=attn,
    )  # fmt: skip
    model = ViTForImageClassification(config)
    nn.init.normal_(model.classifier.weight, std=0.5)
    return Classifier(HFImageClassifier(model), MEAN, STD)


def _timm_vit(image_size: int, patch_size: int, eps: float) -> VisionTransformer:
    return VisionTransformer(
        img_size=image_size, patch_size=patch_size, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0,
        num_classes=4, qkv_bias=True, global_pool="token", norm_layer=partial(nn.LayerNorm, eps=eps),
    )  # fmt: skip


def _load(net: VisionTransformer, state: dict[str, torch.Tensor]) -> Classifier:
    missing, unexpected = net.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    return Classifier(net, MEAN, STD)


def timm_twin_of_torchvision(clf: Classifier) -> Classifier:
    """The torchvision ViT ``clf.model`` as a timm VisionTransformer with the same weights."""
    tv = clf.model.state_dict()
    state = {
        "cls_token": tv["class_token"],
        "pos_embed": tv["encoder.pos_embedding"],
        "patch_embed.proj.weight": tv["conv_proj.weight"],
        "patch_embed.proj.bias": tv["conv_proj.bias"],
        "norm.weight": tv["encoder.ln.weight"],
        "norm.bias": tv["encoder.ln.bias"],
        "head.weight": tv["heads.head.weight"],
        "head.bias": tv["heads.head.bias"],
    }
    names = {
        "norm1": "ln_1", "attn.qkv": "self_attention.in_proj", "attn.proj": "self_attention.out_proj",
        "norm2": "ln_2", "mlp.fc1": "mlp.0", "mlp.fc2": "mlp.3",
    }  # fmt: skip
    for i in range(2):
        for ours, theirs in names.items():
            for kind in ("weight", "bias"):
                key = f"{theirs}_{kind}" if theirs.endswith("in_proj") else f"{theirs}.{kind}"
                state[f"blocks.{i}.{ours}.{kind}"] = tv[f"encoder.layers.encoder_layer_{i}.{key}"]
    model = clf.model
    return _load(_timm_vit(int(model.image_size), int(model.patch_size), 1e-6), state)


def timm_twin_of_transformers(clf: Classifier) -> Classifier:
    """The transformers ViT inside ``clf.model`` (HFImageClassifier) as a timm VisionTransformer, same weights."""
    hf = clf.model.hf
    w = hf.state_dict()
    state = {
        "cls_token": w["vit.embeddings.cls_token"],
        "pos_embed": w["vit.embeddings.position_embeddings"],
        "patch_embed.proj.weight": w["vit.embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": w["vit.embeddings.patch_embeddings.projection.bias"],
        "norm.weight": w["vit.layernorm.weight"],
        "norm.bias": w["vit.layernorm.bias"],
        "head.weight": w["classifier.weight"],
        "head.bias": w["classifier.bias"],
    }
    names = {
        "norm1": "layernorm_before", "attn.proj": "attention.o_proj", "norm2": "layernorm_after",
        "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2",
    }  # fmt: skip
    for i in range(2):
        layer = f"vit.layers.{i}"
        for ours, theirs in names.items():
            for kind in ("weight", "bias"):
                state[f"blocks.{i}.{ours}.{kind}"] = w[f"{layer}.{theirs}.{kind}"]
        for kind in ("weight", "bias"):
            parts = [w[f"{layer}.attention.{p}_proj.{kind}"] for p in "qkv"]
            state[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat(parts)
    config = hf.config
    return _load(_timm_vit(int(config.image_size), int(config.patch_size), float(config.layer_norm_eps)), state)
