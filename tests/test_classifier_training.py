"""train_classifier / small_model_config / evaluate_accuracy on tiny ShapesDataset runs (a few seconds each)."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from attr_engine.classifier import Classifier
from attr_engine.classifier_training import ModelConfig, evaluate_accuracy, small_model_config, train_classifier
from attr_engine.data import ShapesDataset


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # These models are so small that intra-op threading only adds synchronisation; on a shared, oversubscribed CPU
    # every OpenMP barrier can wait a scheduler tick, which made these runs ~10x slower with two threads.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_small_model_configs_build() -> None:
    vit = small_model_config("vit", 64).build(6)
    assert vit.model.patch_embed.grid_size == (8, 8) and len(vit.model.blocks) == 4
    assert vit.model.embed_dim == 96 and vit.input_size == (3, 64, 64)
    resnet = small_model_config("resnet", 48).build(3)
    assert resnet.model.fc.in_features == 256 and resnet.input_size == (3, 48, 48)
    for clf, size, k in ((vit, 64, 6), (resnet, 48, 3)):
        assert clf(torch.rand(2, 3, size, size)).shape == (2, k)
    with pytest.raises(ValueError, match="multiple of 8"):
        small_model_config("vit", 60)
    with pytest.raises(ValueError, match="kind"):
        small_model_config("mlp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="img_size"):
        ModelConfig("resnet10t", 0)


@pytest.mark.parametrize(("kind", "min_acc"), [("vit", 0.65), ("resnet", 0.8)])
def test_training_learns_and_returns_frozen_classifier(kind: str, min_acc: float) -> None:
    train = ShapesDataset(160, img_size=32, num_classes=2, seed=0, with_masks=False)
    held_out = ShapesDataset(100, img_size=32, num_classes=2, seed=1)  # 3-tuples are fine too
    logs: list[dict[str, float]] = []
    clf = train_classifier(
        small_model_config(kind, 32), train, epochs=3, batch_size=16, lr=2e-3, seed=0, log=logs.append
    )
    assert [entry["epoch"] for entry in logs] == [1.0, 2.0, 3.0]
    assert logs[-1]["loss"] < logs[0]["loss"]
    assert evaluate_accuracy(clf, held_out) >= min_acc  # chance is 0.5
    assert isinstance(clf, Classifier) and clf.num_classes == 2 and clf.model_name is not None
    assert not clf.training and not clf.model.training
    assert not any(p.requires_grad for p in clf.parameters())


def test_training_is_deterministic_and_leaves_global_rng_alone() -> None:
    data = ShapesDataset(32, img_size=32, num_classes=3, seed=2)
    config = small_model_config("resnet", 32)
    rng_before = torch.get_rng_state()
    runs = [train_classifier(config, data, epochs=1, batch_size=8, seed=s).model.state_dict() for s in (7, 7, 8)]
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert not all(torch.equal(runs[0][k], runs[2][k]) for k in runs[0] if runs[0][k].is_floating_point())


def test_fine_tunes_a_given_classifier_in_place() -> None:
    data = ShapesDataset(24, img_size=32, num_classes=2, seed=4)
    clf = small_model_config("resnet", 32).build(2)
    before = {k: v.clone() for k, v in clf.model.state_dict().items()}
    out = train_classifier(clf, data, epochs=1, batch_size=8, augment=False, cache=False)
    assert out is clf and not any(p.requires_grad for p in clf.parameters())
    assert any(not torch.equal(before[k], v) for k, v in clf.model.state_dict().items())


def test_train_by_timm_name_takes_image_size_from_data() -> None:
    data = ShapesDataset(16, img_size=40, num_classes=2, seed=5)
    clf = train_classifier("resnet10t", data, epochs=1, batch_size=8, model_kwargs={"channels": (8, 16, 32, 64)})
    assert clf.input_size == (3, 40, 40) and clf.model_kwargs == {"channels": (8, 16, 32, 64)}


class _SignOfRed(nn.Module):
    """Predicts class 1 when the (normalised) red channel is positive on average, else class 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        red = x[:, 0].mean(dim=(1, 2))
        return torch.stack([-red, red], dim=1)


def test_evaluate_accuracy_counts_exactly() -> None:
    clf = Classifier(_SignOfRed(), (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    red = torch.tensor([0.9, 0.8, 0.1, 0.2, 0.7, 0.3, 0.6, 0.4, 0.95, 0.05])
    images = red.view(-1, 1, 1, 1).expand(-1, 3, 4, 4).clone()
    predicted = (red > 0.5).long()
    labels = predicted.clone()
    labels[[1, 4, 7]] = 1 - labels[[1, 4, 7]]
    assert evaluate_accuracy(clf, TensorDataset(images, labels), batch_size=3) == pytest.approx(0.7)
    with pytest.raises(ValueError, match="unlabelled"):
        evaluate_accuracy(clf, TensorDataset(images, torch.full((10,), -1)))


def test_training_input_errors() -> None:
    images, labels = torch.rand(8, 3, 32, 32), torch.randint(0, 2, (8,))
    config = small_model_config("resnet", 32)
    with pytest.raises(ValueError, match="num_classes"):
        train_classifier(config, TensorDataset(images, labels), epochs=1)  # no class_names on a TensorDataset
    with pytest.raises(ValueError, match=r"labels must be in \[0, 2\)"):
        train_classifier(config, TensorDataset(images, labels - 1), epochs=1, num_classes=2)
    with pytest.raises(ValueError, match="epochs"):
        train_classifier(config, TensorDataset(images, labels), epochs=0, num_classes=2)
    with pytest.raises(ValueError, match="empty"):
        train_classifier(config, TensorDataset(images[:0], labels[:0]), num_classes=2)


def test_warmup_cosine_ramps_then_decays_to_zero() -> None:
    from attr_engine._training import warmup_cosine

    factor = warmup_cosine(10, 2)
    assert [factor(s) for s in range(3)] == [0.5, 1.0, 1.0]  # linear ramp, then the cosine starts at its peak
    assert factor(6) == pytest.approx(0.5)  # half-way through the 8 decay steps
    assert factor(10) == pytest.approx(0.0, abs=1e-12) and factor(25) == pytest.approx(0.0, abs=1e-12)
    assert warmup_cosine(4, 0)(0) == 1.0  # no warm-up: the decay starts at once


def test_collate_keeps_images_and_labels_only() -> None:
    from attr_engine._training import collate_images_labels

    items = [(torch.full((3, 2, 2), float(i)), i, torch.zeros(2, 2, dtype=torch.bool)) for i in range(3)]
    images, labels = collate_images_labels(items)
    assert images.shape == (3, 3, 2, 2) and images[2].eq(2.0).all()
    assert labels.dtype == torch.long and labels.tolist() == [0, 1, 2]
