"""LeGrad (attr_engine/baselines/legrad.py) against the official package (legrad-torch 1.1 on open_clip 2.23) on an
untrained open_clip ViT ported to timm, against a float64 run by hand, and its hooks, flags and threads."""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Iterator
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from attr_engine.baselines import LeGrad
from attr_engine.checkpoint import load_safetensors
from attr_engine.classifier import Classifier, save_classifier
from attr_engine.classifier_training import small_model_config
from attr_engine.cli import main
from attr_engine.explainer import get_explainer, list_explainers
from tests import vit_twins
from tests.eval_helpers import images, single_thread, tiny_resnet, tiny_vit, untrained_resnet_checkpoint
from tests.tolerances import tol

FP32 = torch.float32

with warnings.catch_warnings():  # open_clip 2.23 imports timm.models.layers, deprecated in timm 1.0
    warnings.simplefilter("ignore", FutureWarning)
    from legrad import LeWrapper
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


@pytest.fixture(scope="module")
def vit() -> Classifier:
    return tiny_vit()


# ---------------------------------------------------------------------------------------------------------------
# The official package on an open_clip ViT, and the same network in timm
# ---------------------------------------------------------------------------------------------------------------

WIDTH, DEPTH, EMBED, PROMPTS = 32, 3, 16, 3


def tiny_clip(seed: int = 0) -> CLIP:
    """An untrained open_clip CLIP: a 3-block ViT (width 32, 2 heads, layer scale) on 32 px with 8 px patches.

    Every parameter gets noise on top of open_clip's init, so LayerNorm, layer-scale and bias terms that start as
    constants take part in the comparison (a wrong mapping of any of them changes the maps)."""
    torch.manual_seed(seed)
    vision = CLIPVisionCfg(layers=DEPTH, width=WIDTH, head_width=16, image_size=32, patch_size=8, ls_init_value=0.5)
    text = CLIPTextCfg(context_length=8, vocab_size=64, width=16, heads=2, layers=1)
    clip = CLIP(embed_dim=EMBED, vision_cfg=vision, text_cfg=text).eval()
    with torch.no_grad():
        for p in clip.visual.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return clip


class Normalize(nn.Module):
    """The unit-length image embedding of CLIP's similarity."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1)


_BLOCK_NAMES = {
    "ln_1.": "norm1.",
    "attn.in_proj_weight": "attn.qkv.weight",  # both stack q, k, v and split each into heads the same way
    "attn.in_proj_bias": "attn.qkv.bias",
    "attn.out_proj.": "attn.proj.",
    "ls_1.": "ls1.",
    "ln_2.": "norm2.",
    "mlp.c_fc.": "mlp.fc1.",
    "mlp.c_proj.": "mlp.fc2.",
    "ls_2.": "ls2.",
}


def timm_twin(clip: CLIP, text: torch.Tensor) -> Classifier:
    """The open_clip ViT as a timm VisionTransformer, its class logits the image-text similarities.

    The official LeGrad scores block l by ``normalize(ln_post(mean over all tokens of z^l) @ proj) @ text.T``;
    a timm ViT whose own head reads its tokens that way is ``global_pool="avg"`` with ``pool_include_prefix``
    (the class token counted in the mean), ``fc_norm`` (the LayerNorm after the pooling, as ``ln_post``) and a head
    proj -> normalize -> text embeddings. open_clip's LayerNorm eps is torch's 1e-5 (timm's ViT default is 1e-6).
    """
    model = VisionTransformer(
        img_size=32, patch_size=8, embed_dim=WIDTH, depth=DEPTH, num_heads=2, mlp_ratio=4.0, qkv_bias=True,
        init_values=0.5, pre_norm=True, global_pool="avg", fc_norm=True, pool_include_prefix=True,
        norm_layer=nn.LayerNorm, act_layer=nn.GELU, num_classes=EMBED,
    )  # fmt: skip
    model.head = nn.Sequential(
        nn.Linear(WIDTH, EMBED, bias=False), Normalize(), nn.Linear(EMBED, len(text), bias=False)
    )
    v = clip.visual.state_dict()
    state = {
        "cls_token": v["class_embedding"].view(1, 1, WIDTH),
        "pos_embed": v["positional_embedding"][None],
        "patch_embed.proj.weight": v["conv1.weight"],  # no bias on either side (pre-norm ViT)
        "norm_pre.weight": v["ln_pre.weight"],
        "norm_pre.bias": v["ln_pre.bias"],
        "fc_norm.weight": v["ln_post.weight"],
        "fc_norm.bias": v["ln_post.bias"],
        "head.0.weight": v["proj"].t(),
        "head.2.weight": text,
    }
    for key, tensor in v.items():
        if key.startswith("transformer.resblocks."):
            name = key.replace("transformer.resblocks.", "blocks.")
            for theirs, ours in _BLOCK_NAMES.items():
                name = name.replace(theirs, ours)
            state[name] = tensor
    model.load_state_dict(state, strict=True)  # every parameter of the twin is set from open_clip
    return Classifier(model.eval(), mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))  # both see the same pixels


def official_legrad(clip: CLIP, text: torch.Tensor, image: torch.Tensor, layer_index: int) -> torch.Tensor:
    """legrad-torch's maps of one image (1, 3, H, W) for every prompt: (P, H, W)."""
    wrapped = LeWrapper(clip, layer_index=layer_index)  # patches the model's blocks in place (a fresh CLIP each)
    return wrapped.compute_legrad(text_embedding=text, image=image)[0].detach()


@pytest.mark.parametrize("layer_index", [-2, 0])
def test_maps_equal_the_official_legrad_on_the_same_vit(layer_index, capsys) -> None:
    text = F.normalize(torch.randn(PROMPTS, EMBED, generator=torch.Generator().manual_seed(1)), dim=-1)
    twin = timm_twin(tiny_clip(), text)
    explainer = LeGrad(twin, layer_index=layer_index)
    for k, image in enumerate(images(2, 32, seed=4)):
        ref = official_legrad(tiny_clip(), text, image[None], layer_index)
        # The official code repeats the image once per prompt and explains prompt p on copy p.
        maps = explainer.attribute(image[None].repeat(PROMPTS, 1, 1, 1), target=torch.arange(PROMPTS))
        assert ref.shape == maps.shape == (PROMPTS, 32, 32)
        assert ref.std() > 0.1, "the official maps are not constant (the test would prove nothing)"
        torch.testing.assert_close(maps, ref, **tol("baselines", FP32), msg=f"image {k}")
    assert "Hooks and gradients activated" in capsys.readouterr().out  # the official wrapper did run


def test_official_maps_differ_between_layer_ranges() -> None:
    """The layer range matters on this model, so the two parametrisations above check different sums."""
    text = F.normalize(torch.randn(PROMPTS, EMBED, generator=torch.Generator().manual_seed(1)), dim=-1)
    twin = timm_twin(tiny_clip(), text)
    x, y = images(1, 32, seed=4).repeat(PROMPTS, 1, 1, 1), torch.arange(PROMPTS)
    assert (LeGrad(twin, layer_index=0).attribute(x, y) - LeGrad(twin).attribute(x, y)).abs().max() > 0.05


# ---------------------------------------------------------------------------------------------------------------
# The formula by hand, in float64
# ---------------------------------------------------------------------------------------------------------------


def legrad_by_hand(clf: Classifier, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Run the timm ViT block by block with each block's softmax weights as a leaf, score each block through the
    model's norm and head, and sum relu(d score / d weights) over heads and query rows: (B, H, W) in [0, 1]."""
    model = clf.model
    tokens = model.norm_pre(model._pos_embed(model.patch_embed(clf.normalize(x))))
    total = torch.zeros(x.shape[0], 16, dtype=x.dtype)
    for block in model.blocks:
        attn, h = block.attn, block.norm1(tokens)
        qkv = attn.qkv(h).reshape(h.shape[0], h.shape[1], 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
        a = ((qkv[0] * attn.scale) @ qkv[1].transpose(-2, -1)).softmax(dim=-1).detach().requires_grad_(True)
        mixed = attn.proj((a @ qkv[2]).transpose(1, 2).reshape(h.shape))
        tokens = tokens + block.ls1(mixed)
        tokens = tokens + block.ls2(block.mlp(block.norm2(tokens)))
        score = model.forward_head(model.norm(tokens)).gather(1, target[:, None]).sum()
        (grad,) = torch.autograd.grad(score, a)
        total = total + grad.relu().mean(dim=(1, 2))[:, 1:]  # one class token
    up = F.interpolate(total.view(-1, 1, 4, 4), size=(32, 32), mode="bilinear", align_corners=False)[:, 0]
    low, high = up.amin(dim=(1, 2), keepdim=True), up.amax(dim=(1, 2), keepdim=True)
    return (up - low) / (high - low)


def test_float64_maps_equal_a_hand_run_of_the_formula() -> None:
    clf = tiny_vit(seed=2).double()
    x, y = images(2, 32, seed=5).double(), torch.tensor([1, 3])
    ref = legrad_by_hand(clf, x, y).float()
    maps = LeGrad(clf, layer_index=0).attribute(x, y)
    torch.testing.assert_close(maps, ref, **tol("baselines", FP32))
    assert maps.amin() == 0 and maps.flatten(1).amax(1).eq(1).all()  # min-max per image


# ---------------------------------------------------------------------------------------------------------------
# Batches, flags, hooks, threads
# ---------------------------------------------------------------------------------------------------------------


def test_a_map_does_not_depend_on_its_batch(vit) -> None:
    x = images(3, 32, seed=6)
    explainer = get_explainer("legrad", vit)
    together = explainer.attribute(x, target=[0, 2, 1])
    torch.testing.assert_close(explainer.attribute(x[1:2], target=2), together[1:2], **tol("baselines", FP32))
    torch.testing.assert_close(
        explainer.attribute(x[[2, 0]], target=[1, 0]), together[[2, 0]], **tol("baselines", FP32)
    )
    assert (together[0] - together[1]).abs().max() > 0.05  # different images, different maps


def _hooks(clf: Classifier) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in clf.modules())


def test_fused_attention_and_hooks_are_restored_also_on_an_exception(vit) -> None:
    attns = [block.attn for block in vit.model.blocks]
    attns[1].fused_attn = False  # a mix, so each module must get back its own flag
    try:
        before = [a.fused_attn for a in attns]
        LeGrad(vit).attribute(images(2, 32), target=1)
        assert [a.fused_attn for a in attns] == before and _hooks(vit) == 0

        def fail(_module, _inputs, _output):
            assert not attns[0].fused_attn  # the explicit softmax path is on inside the call
            raise KeyboardInterrupt  # not an Exception: cleanup must not depend on the kind of error

        handle = vit.model.blocks[1].register_forward_hook(fail)
        try:
            with pytest.raises(KeyboardInterrupt):
                LeGrad(vit).attribute(images(2, 32), target=1)
        finally:
            handle.remove()
        assert [a.fused_attn for a in attns] == before and _hooks(vit) == 0
    finally:
        attns[1].fused_attn = True


@pytest.mark.parametrize("first_method", ["legrad", "attention-rollout"])
def test_overlapping_calls_in_two_threads_keep_the_flags_and_their_own_maps(vit, first_method) -> None:
    """Thread "first" (LeGrad, or attention rollout, which shares the mechanism) enters, then "second" (LeGrad)
    enters while "first" is inside its forward; "first" returns while "second" waits inside its forward before
    block 0. A save-and-restore of fused_attn would switch the fused path back on under "second" (no weights to
    capture) and leave the flags False for good."""
    x, y = images(2, 32, seed=7), torch.tensor([1, 2])
    methods = {"first": get_explainer(first_method, vit), "second": LeGrad(vit)}
    alone = {name: method.attribute(x, y) for name, method in methods.items()}
    flags = [block.attn.fused_attn for block in vit.model.blocks]
    first_in, second_in, first_done = threading.Event(), threading.Event(), threading.Event()

    def pause(_module, _inputs):
        if threading.current_thread().name == "first":
            first_in.set()
            assert second_in.wait(timeout=30)
        elif threading.current_thread().name == "second":
            second_in.set()
            assert first_done.wait(timeout=30)

    results, errors = {}, []

    def run(name: str) -> None:
        try:
            if name == "second":
                assert first_in.wait(timeout=30)
            results[name] = methods[name].attribute(x, y)
        except BaseException as err:  # surfaced below: a failing thread must fail the test
            errors.append(err)
        finally:
            if name == "first":
                first_done.set()

    handle = vit.model.blocks[0].register_forward_pre_hook(pause)
    try:
        threads = [threading.Thread(target=run, args=(name,), name=name) for name in ("first", "second")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        handle.remove()
    assert not errors, errors
    assert [block.attn.fused_attn for block in vit.model.blocks] == flags and _hooks(vit) == 0
    for name in ("first", "second"):
        torch.testing.assert_close(results[name], alone[name], **tol("baselines", FP32), msg=name)


def test_another_threads_forward_is_neither_captured_nor_changed(vit) -> None:
    """While a LeGrad call is inside its forward, another thread runs the same model and a second model: its
    outputs are the plain ones (no gradient leaves handed to it), the other model's flags are untouched, and the
    LeGrad call captures only its own blocks."""
    other = tiny_vit(seed=1)
    x = images(2, 32, seed=8)
    with torch.no_grad():
        plain, plain_other = vit(x), other(x)
    alone = LeGrad(vit).attribute(x, 0)
    seen = {}

    def meanwhile(_module, _inputs):
        if threading.current_thread().name != "legrad" or seen:
            return
        seen["flags"] = [block.attn.fused_attn for block in other.model.blocks]

        def run_plain() -> None:
            with torch.enable_grad():  # grad mode on, so a leaked leaf would make the logits require grad
                seen["out"], seen["out_other"] = vit(x), other(x)

        worker = threading.Thread(target=run_plain)
        worker.start()
        worker.join(timeout=30)

    results: dict[str, torch.Tensor] = {}
    handle = vit.model.blocks[1].register_forward_pre_hook(meanwhile)
    try:
        t = threading.Thread(target=lambda: results.setdefault("map", LeGrad(vit).attribute(x, 0)), name="legrad")
        t.start()
        t.join(timeout=60)
    finally:
        handle.remove()
    assert seen["flags"] == [True, True]
    assert not seen["out"].requires_grad
    torch.testing.assert_close(seen["out"], plain, **tol("baselines", FP32))  # the explicit softmax path
    torch.testing.assert_close(seen["out_other"], plain_other, rtol=0, atol=0)  # fused, untouched
    torch.testing.assert_close(results["map"], alone, **tol("baselines", FP32))


# ---------------------------------------------------------------------------------------------------------------
# Registry, bad models and options, the command line
# ---------------------------------------------------------------------------------------------------------------


def test_refuses_models_it_does_not_fit_with_one_reason(vit) -> None:
    resnet = tiny_resnet()
    assert "legrad" in list_explainers(vit) and "legrad" not in list_explainers(resnet)
    message = "explainer 'legrad' does not apply to ResNet (LeGrad, gradients w.r.t. attention maps, ViTs)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        get_explainer("legrad", resnet)
    with pytest.raises(ValueError, match=r"LeGrad needs a ViT .* got ResNet"):
        LeGrad(resnet)


@pytest.mark.parametrize("bad", [2, -3, None, True, 0.5, "last"])
def test_a_layer_index_outside_the_blocks_is_one_clear_error(vit, bad) -> None:
    with pytest.raises(ValueError, match=r"layer_index'? must be an integer"):
        LeGrad(vit, layer_index=bad)
    with pytest.raises(ValueError, match=r"layer_index'? must be an integer"):
        LeGrad(vit).attribute(images(1, 32), 0, layer_index=bad)


class _ScaledViT(VisionTransformer):
    """A ViT whose logits are not forward_head(norm(tokens)): LeGrad's block scores would mean nothing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * super().forward(x)


def test_a_model_whose_head_does_not_give_its_logits_is_refused() -> None:
    torch.manual_seed(0)
    net = _ScaledViT(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=4)
    clf = Classifier(net, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match=r"final norm and head of _ScaledViT.*not give the classifier's logits"):
        LeGrad(clf).attribute(images(2, 32), 0)
    assert all(block.attn.fused_attn for block in net.blocks) and _hooks(clf) == 0


def test_the_command_line_explains_with_legrad_and_refuses_a_cnn(tmp_path, capsys) -> None:
    torch.manual_seed(0)
    vit_ckpt = tmp_path / "vit.safetensors"
    save_classifier(small_model_config("vit", 32).build(3), vit_ckpt)
    rng = np.random.default_rng(0)
    for name in ("a.png", "b.png"):
        Image.fromarray((rng.random((32, 32, 3)) * 255).astype(np.uint8)).save(tmp_path / name)
    args = ["explain", str(tmp_path / "a.png"), "--out", str(tmp_path / "maps"), "--no-progress"]
    legrad = ["--method", "legrad", "--option", "layer_index=0", "--format", "safetensors"]
    assert main([*args, "--classifier", str(vit_ckpt), *legrad]) == 0
    tensors, meta = load_safetensors(tmp_path / "maps" / "a.safetensors")
    assert meta["method"] == "legrad" and tensors["map"].shape == (32, 32)
    assert tensors["map"].min() == 0 and tensors["map"].max() == 1  # the model's frame is the image's
    (tmp_path / "cnn").mkdir()
    cnn = untrained_resnet_checkpoint(tmp_path / "cnn")
    assert main([*args, "--classifier", str(cnn), "--method", "legrad"]) != 0
    assert "explainer 'legrad' does not apply to ResNet" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("deit_tiny_distilled_patch16_224", {}),  # class + distillation token, two heads averaged
        ("eva02_tiny_patch14_224", {}),  # EVA attention with rotary embeddings, SwiGLU
        ("vit_tiny_patch16_224", {"reg_tokens": 2, "global_pool": "avg"}),  # register tokens, mean pooling
    ],
)
def test_deit_eva_and_register_token_vits(name, extra) -> None:
    from attr_engine.classifier import load_classifier

    torch.manual_seed(0)
    clf = load_classifier(name, num_classes=4, img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2, **extra)
    explainer = get_explainer("legrad", clf, layer_index=0)
    x = images(2, 32, seed=9)
    maps = explainer.attribute(x, target=1)  # the last block's score matched the logits (checked on each call)
    assert maps.shape == (2, 32, 32) and maps.amin() == 0 and maps.flatten(1).amax(1).eq(1).all()
    assert (explainer.attribute(x, target=2) - maps).abs().max() > 1e-3  # the target class matters
    assert all(block.attn.fused_attn for block in clf.model.blocks) and _hooks(clf) == 0


def test_a_map_without_evidence_is_zero_not_nan() -> None:
    """A head that ignores the tokens gives every block a zero gradient: the official min-max gives NaN (0 / 0)."""
    clf = tiny_vit(seed=3)
    with torch.no_grad():
        clf.model.head.weight.zero_()
    maps = LeGrad(clf, layer_index=0).attribute(images(2, 32), target=1)
    assert torch.equal(maps, torch.zeros(2, 32, 32))


# ---------------------------------------------------------------------------------------------------------------
# torchvision and transformers ViTs (issue #33 item 8)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["tv_vit", "hf_vit", "hf_vit_eager"])
def test_torchvision_and_transformers_vits_equal_their_timm_twin(family) -> None:
    """LeGrad refused both families. Their attention weights are read by recomputing ``nn.MultiheadAttention`` /
    ``ViTAttention`` from a weight leaf; the blocks' scores go through their own final norm and class-token head.
    The oracle is the timm path (checked against the official legrad-torch above) on a timm ViT given the same
    weights (tests/vit_twins.py): equal maps for every layer range, for SDPA and eager transformers attention."""
    eager = partial(vit_twins.hf_vit, attn="eager")
    clf = {"tv_vit": vit_twins.tv_vit, "hf_vit": vit_twins.hf_vit, "hf_vit_eager": eager}[family]()
    twin = vit_twins.timm_twin_of_torchvision(clf) if family == "tv_vit" else vit_twins.timm_twin_of_transformers(clf)
    x, y = images(2, 32, seed=4), torch.tensor([3, 1])
    assert "legrad" in list_explainers(clf)
    for layer_index in (-2, 0, -1):
        maps = LeGrad(clf, layer_index=layer_index).attribute(x, y)
        assert maps.shape == (2, 32, 32) and float(maps.amax()) == 1.0
        torch.testing.assert_close(maps, LeGrad(twin, layer_index=layer_index).attribute(x, y), rtol=1e-4, atol=1e-5)
    other = LeGrad(clf).attribute(x, torch.tensor([0, 2]))
    assert float((other - maps).abs().amax()) > 0.1  # the classes' maps differ: the equality above is not trivial
    assert _hooks(clf) == 0
    torch.testing.assert_close(clf(x), twin(x), rtol=1e-5, atol=1e-5)  # the forward is the model's own again
