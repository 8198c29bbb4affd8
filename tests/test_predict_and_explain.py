"""AHA.predict_and_explain: the prediction and its map from one backbone pass, on every classifier family.

The maps must be the ones ``attribute`` gives for the explained class, bit for bit (same levels, same decoder), the
logits the classifier's, and the backbone must run once where ``attribute(x)`` runs it twice (prediction, then
levels): counted with a hook on the network's first convolution or patch embedding.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from tests.aha_helpers import colour_classifier, tiny_aha
from tests.conftest import ZOO
from tests.eval_helpers import single_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


def _images(n: int = 3) -> torch.Tensor:
    return torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _count_passes(model: nn.Module) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    """A counter of forward passes through ``model``'s first convolution (every family has one at its input)."""
    first = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    calls = [0]
    handle = first.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls, handle


@pytest.mark.parametrize("model", ZOO)
def test_maps_equal_attribute_of_the_predicted_class_from_one_pass(model: str, request) -> None:
    clf = request.getfixturevalue(model)
    aha = tiny_aha(clf)
    x = _images()
    calls, handle = _count_passes(clf.model)
    try:
        logits, maps = aha.predict_and_explain(x)
        fused_passes = calls[0]
        calls[0] = 0
        predicted = aha.attribute(x)
        attribute_passes = calls[0]
    finally:
        handle.remove()
    assert aha.backbone.fuses_logits
    assert (fused_passes, attribute_passes) == (1, 2)
    assert logits.shape == (3, 5) and maps.shape == (3, 32, 32) and maps.dtype == torch.float32
    torch.testing.assert_close(logits, clf(x), rtol=0, atol=1e-6)
    assert torch.equal(maps, aha.attribute(x, target=logits.argmax(dim=1)))
    assert torch.equal(maps, predicted)  # the same predicted classes as attribute resolves itself


@pytest.mark.parametrize("model", ["timm_cnn", "hf_vit"])
def test_a_given_target_is_explained_and_checked(model: str, request) -> None:
    aha = tiny_aha(request.getfixturevalue(model))
    x = _images()
    _, maps = aha.predict_and_explain(x, target=[4, 0, 2])
    assert torch.equal(maps, aha.attribute(x, target=[4, 0, 2]))
    assert torch.equal(aha.predict_and_explain(x, target=1)[1], aha.attribute(x, target=1))
    with pytest.raises(ValueError, match=r"target classes must lie in \[0, 5\)"):
        aha.predict_and_explain(x, target=5)
    with pytest.raises(ValueError, match="NaN or infinite"):
        aha.predict_and_explain(torch.full((1, 3, 32, 32), float("nan")))
    with pytest.raises(ValueError, match="RGB"):
        aha.predict_and_explain(torch.rand(1, 1, 32, 32))
    empty_logits, empty_maps = aha.predict_and_explain(x[:0])
    assert empty_logits.shape == (0, 5) and empty_maps.shape == (0, 32, 32)


def test_refinement_shares_the_pass_and_equals_attribute(timm_cnn) -> None:
    aha = tiny_aha(timm_cnn).with_options(refine_steps=1, seed=3)
    x = _images(2)
    logits, maps = aha.predict_and_explain(x)
    assert torch.equal(maps, aha.attribute(x, target=logits.argmax(dim=1)))
    assert not torch.equal(maps, tiny_aha(timm_cnn).predict_and_explain(x)[1])  # refinement did change the maps
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        aha.predict_and_explain(x)


def test_a_model_without_forward_head_falls_back_to_a_second_pass() -> None:
    clf = colour_classifier()  # forward_intermediates gives the levels only: no final features, no head
    aha = tiny_aha(clf)
    x = _images(2)
    logits, maps = aha.predict_and_explain(x)
    assert not aha.backbone.fuses_logits
    assert torch.equal(logits, clf(x))
    assert torch.equal(maps, aha.attribute(x, target=logits.argmax(dim=1)))
