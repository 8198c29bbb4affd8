"""attr_engine/explainer.py: the one protocol (AHA, the pullbacks and the baselines are all Explainers), the one
target resolver, and the registry - methods registered in Python or through a plugin entry point are usable by name
from the CLI (explain and evaluate)."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

import attr_engine
from attr_engine import explainer as registry
from attr_engine.aha import AHA, AHAConfig
from attr_engine.baselines import Gradient
from attr_engine.classifier import resolve_targets
from attr_engine.cli import main
from attr_engine.explainer import Explainer, get_explainer, list_explainers, register_explainer
from attr_engine.metrics._checks import resolve_target
from attr_engine.metrics.robustness import resolve_explainer_target
from attr_engine.pullback import SemanticPullback
from tests.aha_helpers import colour_classifier, colour_images
from tests.eval_helpers import images, single_thread, tiny_convnet, untrained_resnet_checkpoint

AHA_FAST = {"n_fractions": 6, "n_iters": 8, "decoder_dim": 16, "class_dim": 8, "grid_range": (2, 6)}


class ConstantMap(Explainer):
    """A throw-away method: every pixel gets ``value`` (so a test can tell its maps from any other method's)."""

    name = "constant-map"
    needs_grad = False
    options: ClassVar[dict[str, Any]] = {"value": 0.5}

    def _check_options(self, options: dict[str, Any]) -> None:
        options["value"] = float(options["value"])  # the CLI passes --option values as parsed YAML scalars

    def _attribute(self, x: torch.Tensor, target: torch.Tensor, *, value: float) -> torch.Tensor:
        return torch.full((x.shape[0], *x.shape[2:]), value, dtype=torch.float32, device=x.device)


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a test registers (or discovers as a plugin) is gone afterwards."""
    registry.list_explainers()  # the built-ins first, so they are part of the snapshot
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_plugins", None)


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained small ResNet at 32 px with 6 classes, saved as train-classifier would."""
    return untrained_resnet_checkpoint(tmp_path_factory.mktemp("clf"))


def _photos(root: Path, n: int = 2) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.fromarray((rng.random((32, 32, 3)) * 255).astype(np.uint8)).save(root / f"p{i}.png")
    return root


def _explain_with(checkpoint: Path, tmp_path: Path, method: str, *extra: str) -> Path:
    src, out = _photos(tmp_path / "photos"), tmp_path / f"maps-{method}"
    argv = ["explain", str(src), "--classifier", str(checkpoint), "--out", str(out), "--method", method]
    assert main([*argv, "--no-progress", *extra]) == 0
    assert json.loads((out / "explain.json").read_text())["method"] == method
    return out


# ---------------------------------------------------------------------------------------------------------------
# One protocol
# ---------------------------------------------------------------------------------------------------------------


def test_our_methods_are_explainers_built_by_name_and_at_the_top_level() -> None:
    clf = colour_classifier()
    aha = AHA(clf, AHAConfig(**AHA_FAST))
    assert isinstance(aha, Explainer) and isinstance(SemanticPullback(clf), Explainer)
    assert attr_engine.get_explainer is get_explainer and attr_engine.list_explainers is list_explainers
    assert attr_engine.register_explainer is register_explainer and attr_engine.Explainer is Explainer
    soft = get_explainer("pullback-soft", clf)
    assert isinstance(soft, SemanticPullback) and soft.name == "pullback-soft" and soft.defaults["method"] == "soft"
    by_name = get_explainer("aha", clf, aha=aha, refine_steps=1)
    # A configured copy: the same trained decoder, the caller's explainer and its defaults untouched.
    assert isinstance(by_name, AHA) and by_name is not aha and by_name.decoder is aha.decoder
    assert by_name.defaults["refine_steps"] == 1 and aha.defaults["refine_steps"] == 0
    x, _ = colour_images(2)
    torch.testing.assert_close(by_name.attribute(x, 0, refine_steps=0), aha.attribute(x, 0), atol=0, rtol=0)
    # Captum's call shape everywhere: the third positional argument is ``baselines``.
    with pytest.raises(ValueError, match="aha takes no baselines"):
        aha.attribute(x, 0, 0.5)
    with pytest.raises(ValueError, match="aha has no option 'steps'; its options: refine_steps, seed"):
        aha.attribute(x, 0, steps=3)


def test_the_pullback_options_are_per_call_and_construction_defaults() -> None:
    clf = tiny_convnet()
    x, y = images(2, 16), torch.tensor([0, 1])
    sp = SemanticPullback(clf, method="soft")
    torch.testing.assert_close(sp.attribute(x, y), SemanticPullback(clf).attribute(x, y, method="soft"))
    ascent = sp.attribute(x, y, method="ascent", steps=2, alpha=0.5, reduce="norm")
    torch.testing.assert_close(
        ascent, SemanticPullback(clf).attribute(x, y, steps=2, alpha=0.5, reduce=None).norm(dim=1)
    )
    with pytest.raises(ValueError, match="method must be one of"):
        SemanticPullback(clf, method="smooth")


def test_option_values_take_their_defaults_type_or_are_refused_by_name() -> None:
    """Hardening #10: values from --option / a config file (YAML scalars and lists) are coerced to the type of the
    option's default: ``abs=maybe`` was taken as true, a bool passed for a count, an int for a float stayed an int."""
    clf = tiny_convnet()
    x = images(1, 16)
    with pytest.raises(ValueError, match="saliency option 'abs' must be true or false, got 'maybe'"):
        get_explainer("saliency", clf, abs="maybe")
    with pytest.raises(ValueError, match="saliency option 'abs' must be true or false, got 1"):
        get_explainer("saliency", clf).attribute(x, 0, abs=1)  # per call too
    with pytest.raises(ValueError, match="integrated-gradients option 'n_steps' must be an integer or null, got True"):
        get_explainer("integrated-gradients", clf, n_steps=True)
    with pytest.raises(ValueError, match=r"option 'n_steps' must be an integer or null, got 4\.5"):
        get_explainer("integrated-gradients", clf).with_options(n_steps=4.5)
    with pytest.raises(ValueError, match="pullback option 'method' must be a string or null, got 3"):
        SemanticPullback(clf, method=3)
    assert get_explainer("saliency", clf, abs=False).defaults["abs"] is False
    stdevs = get_explainer("smoothgrad", clf, stdevs=1).defaults["stdevs"]  # an int where a float is expected
    assert stdevs == 1.0 and isinstance(stdevs, float)
    # None where the method means "choose for me", and a list for a side pair, still pass to its own checks
    assert get_explainer("integrated-gradients", clf, internal_batch_size=None).defaults["internal_batch_size"] is None
    assert get_explainer("occlusion", clf, window=[4, 4]).defaults["sliding_window_shapes"] == (3, 4, 4)


# ---------------------------------------------------------------------------------------------------------------
# One target resolver
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (True, "target must be integer class indices, got booleans"),
        (1.5, "target must hold integer class indices, got dtype torch.float32"),
        ([0, 1, 2], r"target must be an int or have one entry per image \(2\), got shape \(3,\)"),
        (3, r"target classes must lie in \[0, 3\), got \[3, 3\]"),
        (torch.tensor([0, -1]), r"target classes must lie in \[0, 3\), got \[0, -1\]"),
        ("cat", "target must be an int, ints or an integer tensor, got 'cat'"),
    ],
)
def test_methods_and_metrics_refuse_a_bad_target_with_the_same_error(target: Any, message: str) -> None:
    clf = tiny_convnet(num_classes=3)
    x = images(2, 16)
    with torch.no_grad():
        logits = clf(x)
    calls = {
        "resolver": lambda: resolve_targets(clf, x, target),
        "method": lambda: Gradient(clf).attribute(x, target),
        "deletion metrics": lambda: resolve_target(target, logits),
        "perturbed-input metrics": lambda: resolve_explainer_target(Gradient(clf), x, target),
    }
    for who, call in calls.items():
        with pytest.raises(ValueError, match=message):
            call()
            pytest.fail(f"{who} accepted {target!r}")


@pytest.mark.parametrize("name", ["gradient", "pullback-soft"])  # pullback-soft checks against its logits
@pytest.mark.parametrize("target", [7, torch.tensor(7), -1])
def test_an_empty_batch_still_refuses_a_class_out_of_range(name: str, target: Any) -> None:
    """Hardening #11: an int target spread over an empty batch left nothing to check, so 7 passed for 4 classes."""
    explainer = get_explainer(name, tiny_convnet(num_classes=4))
    empty = torch.rand(0, 3, 16, 16)
    with pytest.raises(ValueError, match=r"target classes must lie in \[0, 4\), got (7|-1)"):
        explainer.attribute(empty, target)
    with pytest.raises(ValueError, match=r"target classes must lie in \[0, 4\)"):
        resolve_targets(explainer.classifier, empty, target)
    assert explainer.attribute(empty, 3).shape == (0, 16, 16)


def test_images_above_one_warn_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hardening #11: float images in [0, 255] were explained silently (the classifier normalises anything)."""
    monkeypatch.setattr(registry, "_range_warned", False)
    explainer = get_explainer("gradient", tiny_convnet())
    x = images(2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # [0, 1] images, and a small noise overshoot, say nothing
        explainer.attribute(x, 0)
        explainer.attribute(x + 0.02, 0)
    with pytest.warns(registry.ImageRangeWarning, match=r"the images reach 2\d\d(\.\d+)?, but explainers take"):
        explainer.attribute(x * 255, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: not again for the next batch, nor for another method
        explainer.attribute(x * 255, 0)
        get_explainer("saliency", explainer.classifier).attribute(x * 255, 0)
    with pytest.raises(ValueError, match="x contains NaN or infinite values"):
        explainer.attribute(torch.full((1, 3, 16, 16), float("nan")), 0)


def test_the_resolver_takes_the_prediction_from_given_logits_without_a_classifier() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    assert resolve_targets(None, logits, None, logits=logits).tolist() == [1, 0]
    assert resolve_targets(None, logits, 2, logits=logits).tolist() == [2, 2]
    with pytest.raises(ValueError, match="needs a classifier; pass target explicitly"):
        resolve_targets(None, logits, None)


# ---------------------------------------------------------------------------------------------------------------
# The registry and plugins
# ---------------------------------------------------------------------------------------------------------------


def test_register_explainer_refuses_taken_names_and_non_callables(clean_registry) -> None:
    register_explainer("constant_map", ConstantMap, description="a constant")
    assert "constant-map" in list_explainers()  # names are case-insensitive, '_' and '-' the same
    with pytest.raises(ValueError, match="already registered"):
        register_explainer("Constant-Map", ConstantMap)
    with pytest.raises(ValueError, match="must be callable"):
        register_explainer("not-a-factory", 3)  # type: ignore[arg-type]
    clf = tiny_convnet()
    maps = get_explainer("constant-map", clf, value=0.25).attribute(images(2, 16))
    assert maps.shape == (2, 16, 16) and torch.all(maps == 0.25)


def test_a_method_registered_in_python_runs_from_explain_and_evaluate(clean_registry, checkpoint, tmp_path) -> None:
    register_explainer("constant-map", ConstantMap, description="every pixel the same value")
    out = _explain_with(checkpoint, tmp_path, "constant-map", "--option", "value=0.25")
    maps = [np.load(p) for p in sorted(out.glob("*.npy"))]
    assert len(maps) == 2 and all(np.all(m[np.isfinite(m)] == 0.25) for m in maps)

    ev = tmp_path / "eval"
    argv = ["evaluate", "--classifier", str(checkpoint), "--methods", "constant-map,gradient", "--out", str(ev)]
    assert main([*argv, "--num-images", "3", "--metrics", "deletion", "--no-progress"]) == 0
    rows = json.loads((ev / "results.json").read_text())["leaderboard"]
    assert [r["method"] for r in rows] == ["constant-map", "gradient"]


def _fake_distribution(root: Path, entry_points: str, module: str | None = None) -> None:
    """A distribution installed in ``root`` (put on sys.path): metadata, entry points and an optional module."""
    info = root / "toy_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[attr_engine.explainers]\n{entry_points}\n")
    if module is not None:
        (root / "toy_plugin_methods.py").write_text(module)


_PLUGIN_MODULE = '''
import torch
from attr_engine.explainer import Explainer


class RowIndex(Explainer):
    """Each pixel's row index: a map no built-in method gives."""

    name = "row-index"
    needs_grad = False

    def _attribute(self, x, target):
        rows = torch.arange(x.shape[2], dtype=torch.float32, device=x.device)
        return rows.view(1, -1, 1).expand(x.shape[0], -1, x.shape[3])
'''


def test_a_plugin_entry_point_is_found_lazily_and_runs_from_the_cli(
    clean_registry, checkpoint, tmp_path, monkeypatch
) -> None:
    site = tmp_path / "site"
    _fake_distribution(site, "row-index = toy_plugin_methods:RowIndex", _PLUGIN_MODULE)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "toy_plugin_methods", raising=False)
    assert "row-index" in list_explainers()
    assert "toy_plugin_methods" not in sys.modules  # listed from the metadata alone, not imported

    maps = get_explainer("row_index", tiny_convnet()).attribute(images(1, 16))
    assert "toy_plugin_methods" in sys.modules
    torch.testing.assert_close(maps[0, :, 5], torch.arange(16, dtype=torch.float32))

    out = _explain_with(checkpoint, tmp_path, "row-index", "--model-frame")
    for path in sorted(out.glob("*.npy")):  # the model's own 32 x 32 frame: the rows as they are
        np.testing.assert_array_equal(np.load(path)[:, 0], np.arange(32, dtype=np.float32))


def test_a_broken_plugin_names_itself(clean_registry, tmp_path, monkeypatch, capsys) -> None:
    site = tmp_path / "site"
    _fake_distribution(site, "broken-method = no_such_module_here:Method")
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(ImportError, match=r"explainer plugin 'broken-method' \(no_such_module_here:Method\)"):
        get_explainer("broken-method", tiny_convnet())
    with pytest.warns(UserWarning, match="broken-method"):  # filtering by model loads plugins; a broken one is skipped
        monkeypatch.setattr(registry, "_plugins", None)
        assert "broken-method" not in list_explainers(tiny_convnet())


def test_a_name_or_path_where_a_loaded_classifier_goes_says_to_load_it_first(tmp_path: Path) -> None:
    """Methods, metrics and the leaderboard take a loaded Classifier: a model name or a checkpoint path given in
    its place names the load_classifier call that builds one; swapped arguments are named as such."""
    from attr_engine.evaluate import evaluate
    from attr_engine.metrics import deletion_insertion

    clf = tiny_convnet()
    checkpoint = untrained_resnet_checkpoint(tmp_path)
    x = torch.rand(2, 3, 16, 16)
    build = r"got str; build the classifier first: load_classifier\('resnet18'\)"
    with pytest.raises(ValueError, match=build):
        get_explainer("gradient", "resnet18")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"got str; load the classifier first: load_classifier\(checkpoint="):
        get_explainer("gradient", str(checkpoint))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"arguments swapped\?"):
        get_explainer(clf, "gradient")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=build):
        evaluate("resnet18", {"gradient": "gradient"}, (x, torch.zeros(2, dtype=torch.long)), ["deletion"])
    with pytest.raises(ValueError, match=build):
        deletion_insertion("resnet18", x, torch.rand(2, 16, 16), 0)  # type: ignore[arg-type]
