"""Hostile inputs (issue #20): crafted checkpoints reach nothing outside themselves, sizes a file sets are bounded
by its weights, corrupted weights and non-finite maps are refused, concurrent jobs never mix one output directory.

Each crafted file is built here from a real one; the README's "Hostile inputs" table lists the cases.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from attr_engine.aha import AHA, AHAConfig
from attr_engine.aha.network import build_backbone
from attr_engine.aha.persistence import CONFIG_FILE, WEIGHTS_FILE
from attr_engine.checkpoint import load_safetensors, save_safetensors
from attr_engine.classifier import load_classifier
from attr_engine.cli import main
from tests.aha_helpers import FAST
from tests.eval_helpers import single_thread, untrained_resnet_checkpoint

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def classifier_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return untrained_resnet_checkpoint(tmp_path_factory.mktemp("clf"))


def _classifier(path: Path):
    _, meta = load_safetensors(path)
    return load_classifier(meta["model_name"], checkpoint=path)


@pytest.fixture(scope="module")
def aha_dir(classifier_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An (untrained) AHA saved for the classifier of ``classifier_file``, as train-aha would leave it."""
    out = tmp_path_factory.mktemp("aha")
    AHA(_classifier(classifier_file), AHAConfig(**FAST)).save(out)
    return out


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for name in ("a.png", "b.png", "c.png"):
        Image.fromarray((rng.random((36, 40, 3)) * 255).astype(np.uint8)).save(root / name)
    return root


def _crafted_aha(aha_dir: Path, tmp_path: Path, **config_changes) -> Path:
    crafted = tmp_path / "crafted-aha"
    shutil.copytree(aha_dir, crafted)
    meta = json.loads((crafted / CONFIG_FILE).read_text())
    for key, value in config_changes.items():
        if key in meta["config"]:
            meta["config"][key] = value
        else:
            meta[key] = value
    (crafted / CONFIG_FILE).write_text(json.dumps(meta))
    return crafted


def _one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line]
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def _explain(classifier_file: Path, src: Path, out: Path, *extra: str) -> int:
    args = ["explain", str(src), "--classifier", str(classifier_file), "--out", str(out), "--no-progress"]
    return main([*args, "--batch-size", "2", *extra])


# ---------------------------------------------------------------------------------------------------------------
# 1. A checkpoint is data: it names no hub, folder or URL, and downloads nothing
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backbone", "pretrained", "message"),
    [
        ("hf-hub:evil/model", True, "refusing backbone 'hf-hub:evil/model'"),
        ("hf:evil/model", True, "refusing backbone 'hf:evil/model'"),  # transformers: always a hub or a folder
        ("torchvision:resnet18", False, "refusing backbone 'torchvision:resnet18'"),  # timm's registry only
        ("local-dir:/some/folder", False, "refusing backbone 'local-dir:/some/folder'"),
        ("https://example.invalid/model", False, "refusing backbone"),
        ("resnet10t", True, "does not hold its weights, so loading would download"),
    ],
)
def test_a_crafted_aha_backbone_is_refused_before_any_io(
    classifier_file, aha_dir, images, tmp_path, monkeypatch, capsys, backbone, pretrained, message
):
    crafted = _crafted_aha(aha_dir, tmp_path, backbone=backbone, backbone_pretrained=pretrained)
    builds: list[str] = []
    # Any build of the named backbone (and so any hub request or folder read timm would make) is recorded.
    monkeypatch.setattr("attr_engine.aha.network.load_classifier", lambda name, **kw: builds.append(name))
    clf = _classifier(classifier_file)
    with pytest.raises(ValueError, match=message):
        AHA.load(crafted, clf)
    status = _explain(classifier_file, images, tmp_path / "maps", "--method", "aha", "--aha", str(crafted))
    assert status == 2 and message.split("'")[0] in _one_error_line(capsys)
    assert builds == [] and not (tmp_path / "maps" / "explain.json").exists()


def test_a_separate_backbone_is_saved_with_the_decoder_and_loads_offline(classifier_file, tmp_path, monkeypatch):
    """A pretrained separate backbone round-trips from the checkpoint alone: it is built without timm's weights
    (nothing is downloaded) and gets the stored ones, so the maps are the saved explainer's exactly."""
    clf = _classifier(classifier_file)
    torch.manual_seed(1)
    backbone = build_backbone(clf, "test_resnet", None)  # stands in for weights a download would have given
    aha = AHA(clf, AHAConfig(backbone="test_resnet", backbone_pretrained=True, **FAST), backbone=backbone)
    aha.save(tmp_path)
    stored, _ = load_safetensors(tmp_path / WEIGHTS_FILE)
    assert any(k.startswith("backbone.") for k in stored)

    calls: list[dict] = []
    real = load_classifier

    def spy(name, **kwargs):
        calls.append({"name": name, **kwargs})
        return real(name, **kwargs)

    monkeypatch.setattr("attr_engine.aha.network.load_classifier", spy)
    torch.manual_seed(2)  # other random weights: only the stored ones can give the same maps
    loaded = AHA.load(tmp_path, clf)
    assert [c["pretrained"] for c in calls] == [False]
    x = torch.rand(2, 3, 32, 32)
    torch.testing.assert_close(loaded.attribute(x), aha.attribute(x), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# 2. Every size a file sets is bounded by what its weights imply
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"img_size": "100000"}, "img_size must be an integer >= 1 <= 4096"),
        ({"img_size": "-3"}, "img_size must be an integer >= 1"),
        ({"num_classes": "10000000"}, "does not match"),
        ({"num_classes": "many"}, "num_classes must be an integer"),
    ],
)
def test_crafted_classifier_sizes_are_refused_before_allocation(
    classifier_file, images, tmp_path, capsys, changes, message
):
    state, meta = load_safetensors(classifier_file)
    crafted = tmp_path / "crafted.safetensors"
    save_safetensors(state, crafted, {**meta, **changes})
    assert _explain(crafted, images, tmp_path / "maps", "--method", "gradient") == 2
    assert message in _one_error_line(capsys)


def test_a_vit_checkpoint_claiming_another_size_is_refused_by_its_position_embedding(tmp_path):
    """A ViT's img_size shapes its weights: the claim is checked against them on the meta device."""
    from attr_engine.classifier import save_classifier

    torch.manual_seed(0)
    vit = load_classifier("test_vit", num_classes=3, img_size=32)
    path = tmp_path / "vit.safetensors"
    save_classifier(vit, path)
    state, meta = load_safetensors(path)
    save_safetensors(state, path, {**meta, "img_size": "4000"})
    with pytest.raises(ValueError, match="pos_embed is"):
        load_classifier("test_vit", checkpoint=path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"img_size": 100000}, "img_size must be an integer >= 1 <= 4096"),
        ({"decoder_dim": 1_000_000}, "does not match the decoder"),
        ({"class_dim": 3}, "does not match the decoder"),
        ({"feature_channels": [10**9]}, "feature_channels must be an integer"),
        ({"n_fractions": 10**9}, "n_fractions must be <= 1024"),
        ({"n_iters": 10**8}, "n_iters must be <= 10000"),
    ],
)
def test_crafted_aha_sizes_are_refused(classifier_file, aha_dir, tmp_path, changes, message):
    crafted = _crafted_aha(aha_dir, tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        AHA.load(crafted, _classifier(classifier_file))


# ---------------------------------------------------------------------------------------------------------------
# 3. Corrupted weights and non-finite maps
# ---------------------------------------------------------------------------------------------------------------


def _overwrite_tail(path: Path, n: int = 64) -> None:
    """0xff over ``n`` bytes at the end of the data section (NaN as float32): the header still parses."""
    data = bytearray(path.read_bytes())
    data[-n:] = b"\xff" * n
    path.write_bytes(bytes(data))


def test_corrupted_weights_are_refused_at_load(classifier_file, aha_dir, images, tmp_path, capsys):
    crafted = _crafted_aha(aha_dir, tmp_path)
    _overwrite_tail(crafted / WEIGHTS_FILE)
    with pytest.raises(ValueError, match="holds NaN or infinite values"):
        AHA.load(crafted, _classifier(classifier_file))
    status = _explain(classifier_file, images, tmp_path / "maps", "--method", "aha", "--aha", str(crafted))
    assert status == 2 and "holds NaN or infinite values" in _one_error_line(capsys)

    broken = tmp_path / "classifier.safetensors"
    shutil.copy(classifier_file, broken)
    _overwrite_tail(broken)
    assert _explain(broken, images, tmp_path / "maps2", "--method", "gradient") == 2
    assert "holds NaN or infinite values" in _one_error_line(capsys)


def test_a_non_finite_map_is_an_error_for_its_image_and_the_exit_status(
    classifier_file, images, tmp_path, capsys, monkeypatch
):
    """A method that returns NaN for one image: that map is not written, the others are, and the run exits 1."""
    from attr_engine import explainer as registry
    from attr_engine.explainer import FunctionExplainer, register_explainer

    registry.list_explainers()  # the built-ins first; what this test registers is gone afterwards
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    def nan_for_bright(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        maps = x.mean(1).clone()
        maps[x.mean(dim=(1, 2, 3)) > x.mean()] = float("nan")
        return maps

    register_explainer(
        "test-nan-for-bright", lambda clf, **kw: FunctionExplainer(clf, nan_for_bright, name="nan"), description="t"
    )
    out = tmp_path / "maps"
    status = _explain(classifier_file, images, out, "--method", "test-nan-for-bright", "--batch-size", "3")
    captured = capsys.readouterr()
    manifest = json.loads((out / "_manifest" / "rank0-of-1.json").read_text())
    assert status == 1
    assert manifest["failed"] and all("NaN" in f["reason"] for f in manifest["failed"])
    written = sorted(p.name for p in out.glob("*.npy"))
    assert len(written) + len(manifest["failed"]) == 3 and written
    assert all(np.isfinite(np.load(out / name)).any() for name in written)
    assert "failed: non-finite maps" in captured.out


# ---------------------------------------------------------------------------------------------------------------
# 4-6. Concurrent and repeated jobs: one directory one digest, seeded builds, canonical method names
# ---------------------------------------------------------------------------------------------------------------

# A real `attr-engine explain` process whose method waits, inside the run, until the test opens a gate file.
_WAITING_JOB = """
import pathlib, sys, time
from attr_engine.cli import main
from attr_engine.explainer import FunctionExplainer, register_explainer

gate = pathlib.Path(sys.argv[1])

def waiting(x, target):
    (gate.parent / "started").touch()
    while not gate.exists():
        time.sleep(0.05)
    return x.mean(1)

register_explainer("test-waits", lambda clf, **kw: FunctionExplainer(clf, waiting, name="test-waits"))
sys.exit(main(["--threads", "1", *sys.argv[2:]]))
"""


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "attr_engine", "--threads", "1", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def test_two_jobs_with_other_settings_never_share_an_output_directory(classifier_file, images, tmp_path):
    out = tmp_path / "r"
    common = ["explain", str(images), "--classifier", str(classifier_file), "--out", str(out), "--no-progress"]
    gate = tmp_path / "gate"
    first = subprocess.Popen(
        [sys.executable, "-c", _WAITING_JOB, str(gate), *common, "--method", "test-waits", "--batch-size", "1"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "started").exists():
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first job never started its work"
            time.sleep(0.1)
        # The first job is inside its run and has written nothing: only its claim tells that the folder is taken.
        second = _cli(*common, "--method", "saliency")
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "being written right now by another job" in lines[0] and "test-waits" in lines[0]
    finally:
        gate.touch()
        _, stderr = first.communicate(timeout=240)
    assert first.returncode == 0, stderr
    assert json.loads((out / "explain.json").read_text())["method"] == "test-waits"
    assert len(list(out.glob("*.npy"))) == 3
    # Once the first job is gone its recorded settings still refuse the other method, and nothing was mixed in.
    again = _cli(*common, "--method", "saliency")
    assert again.returncode == 2 and "holds maps made with other settings" in again.stderr
    assert not list((out / "_manifest" / "claims").glob("*.claim"))


def test_claims_of_dead_jobs_are_stale_and_same_settings_share(tmp_path):
    from attr_engine.claims import CLAIMS_DIR, OutputInUseError, claim_output

    (tmp_path / CLAIMS_DIR).mkdir(parents=True)
    (tmp_path / CLAIMS_DIR / "other-1-00000000.claim").write_text("{}")  # no process holds its lock
    with claim_output(tmp_path, "mine", "first") as sharing:
        assert sharing == 0 and not (tmp_path / CLAIMS_DIR / "other-1-00000000.claim").exists()
        with claim_output(tmp_path, "mine", "second") as sharing_too:
            assert sharing_too == 1
        with pytest.raises(OutputInUseError, match=r"other settings \(first\)"), claim_output(tmp_path, "x", "y"):
            pass
    with claim_output(tmp_path, "x", "after"):
        pass


def test_seed_fixes_the_random_weights_of_a_model_in_the_local_engine(images, tmp_path):
    runs = []
    for name in ("o1", "o2"):
        args = ["explain", str(images), "--model", "resnet10t", "--num-classes", "4", "--img-size", "32"]
        assert main([*args, "--method", "saliency", "--seed", "0", "--out", str(tmp_path / name), "--no-progress"]) == 0
        runs.append(json.loads((tmp_path / name / "explain.json").read_text())["classifier"])
        torch.rand(7)  # the global generator moves on between runs, as it does in a longer program
    assert runs[0] == runs[1]
    np.testing.assert_array_equal(np.load(tmp_path / "o1" / "a.npy"), np.load(tmp_path / "o2" / "a.npy"))


def test_method_names_resolve_once_to_their_canonical_name():
    from attr_engine.explainer import UnknownExplainerError, resolve_explainer

    assert resolve_explainer(" AHA") == resolve_explainer("aha") == "aha"
    assert resolve_explainer("Pullback") == resolve_explainer("PA") == "pullback-ascent"
    assert resolve_explainer("Integrated_Gradients") == "integrated-gradients"
    assert resolve_explainer("Captum:DeepLift") == "captum:DeepLift"
    with pytest.raises(UnknownExplainerError) as info:
        resolve_explainer("salency")
    assert "saliency" in info.value.close


@pytest.mark.parametrize("spelling", ["AHA", " aha", "Aha"])
def test_any_spelling_of_aha_records_the_checkpoint_and_refinement(
    classifier_file, aha_dir, images, tmp_path, spelling
):
    out = tmp_path / "maps"
    extra = ["--method", spelling, "--aha", str(aha_dir), "--refine-steps", "1"]
    assert _explain(classifier_file, images, out, *extra) == 0
    settings = json.loads((out / "explain.json").read_text())
    assert settings["method"] == "aha" and len(settings["aha"]) == 16 and settings["refine_steps"] == 1


def test_the_command_line_lists_methods_from_the_registry(capsys, monkeypatch):
    from attr_engine import explainer as registry
    from attr_engine.explainer import FunctionExplainer, list_explainers, register_explainer

    registry.list_explainers()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    register_explainer("test-listed", lambda clf, **kw: FunctionExplainer(clf, lambda x, t: x.mean(1)), description="d")
    assert main(["methods"]) == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert set(list_explainers()) <= set(listed) and "test-listed" in listed and "captum:<Class>" in listed
    assert "pa, pullback" in listed["pullback-ascent"]  # the aliases come from the registry too


# ---------------------------------------------------------------------------------------------------------------
# Review findings: more crafted AHA checkpoints, each one line
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"feature_channels": [8] * 20000}, "feature_channels must be a list of 1 to 64 ints"),
        ({"layers": [99]}, "cannot tap the checkpoint's layers"),
        ({"layers": [1, 1]}, "layers must be up to 64 distinct block indices"),
        ({"steps_trained": [1]}, "steps_trained must be an int"),
        ({"steps_trained": 1e400}, "steps_trained must be an int"),
    ],
)
def test_more_crafted_aha_metadata_is_one_value_error(classifier_file, aha_dir, tmp_path, changes, message):
    crafted = _crafted_aha(aha_dir, tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        AHA.load(crafted, _classifier(classifier_file))


def test_a_missing_fingerprint_and_a_deeply_nested_config_are_one_value_error(classifier_file, aha_dir, tmp_path):
    crafted = _crafted_aha(aha_dir, tmp_path)
    meta = json.loads((crafted / CONFIG_FILE).read_text())
    del meta["classifier"]
    (crafted / CONFIG_FILE).write_text(json.dumps(meta))
    stored, weights_meta = load_safetensors(crafted / WEIGHTS_FILE)
    save_safetensors(stored, crafted / WEIGHTS_FILE, {k: v for k, v in weights_meta.items() if k != "classifier"})
    with pytest.raises(ValueError, match="no classifier fingerprint"):
        AHA.load(crafted, _classifier(classifier_file))
    (crafted / CONFIG_FILE).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="not valid JSON: RecursionError"):
        AHA.load(crafted, _classifier(classifier_file))


def test_a_checkpoint_step_that_links_elsewhere_is_refused(classifier_file, aha_dir, tmp_path):
    """A training directory whose step-N is a link to another folder holding a valid pair of files."""
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(aha_dir, elsewhere)
    training = tmp_path / "training"
    (training / "checkpoints").mkdir(parents=True)
    (training / "checkpoints" / "step-00000001").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ValueError, match="is a link"):
        AHA.load(training, _classifier(classifier_file))


def test_the_local_engine_refuses_a_class_the_classifier_lacks_as_ray_does(classifier_file, images):
    """From Python (no CLI check in front): the local engine checked the target only after indexing the logits."""
    from attr_engine import jobs
    from attr_engine.imageops import data_config

    job = jobs.AttributionJob(method="gradient", classifier=str(classifier_file), target=9, batch_size=2)
    clf = job.load_classifier()
    results = jobs.run(
        job, jobs.list_inputs(images, "npy"), classifier=clf, explainer=job.get_explainer(clf),
        config=data_config(clf, img_size=32, crop_pct=1.0),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"target classes must lie in \[0, 6\), got"):
        next(results)
