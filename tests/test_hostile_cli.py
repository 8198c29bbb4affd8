"""Hostile inputs, round 2 (issue #34, and #33's slow metrics): one line and exit 2 for every error the user can fix,
whenever it comes; bounds checked before any work; hub names offline in one line; Ray quiet and its actors' errors
unwrapped; --no-progress for the libraries' bars; a wrong-size input to a ViT named as such.

The README's "Hostile inputs" table lists each case with the test here that covers it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from attr_engine import jobs, model_sources
from attr_engine.cli import main, user_error_message
from tests.eval_helpers import single_thread, untrained_resnet_checkpoint

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return untrained_resnet_checkpoint(tmp_path_factory.mktemp("clf"))


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for name in ("a.png", "b.png", "c.png", "d.png"):
        Image.fromarray((rng.random((32, 32, 3)) * 255).astype(np.uint8)).save(root / name)
    return root


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the local engine is ever started: a bound must refuse before any work."""

    def run(*args, **kwargs):
        raise AssertionError("the job started its work before the bound refused it")

    monkeypatch.setattr(jobs, "explain", run)


def _explain(checkpoint: Path, src: Path, out: Path, *extra: str) -> int:
    args = ["--threads", "1", "explain", str(src), "--classifier", str(checkpoint), "--out", str(out), "--no-progress"]
    return main([*args, *extra])


def _error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "warning:" not in line]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


# ---------------------------------------------------------------------------------------------------------------
# 1. One error boundary: one line and exit 2 after the work has started too; a bug says to use --debug
# ---------------------------------------------------------------------------------------------------------------


def test_a_layer_a_method_cannot_use_is_one_line_after_work_started(checkpoint, images, tmp_path, capsys):
    """Issue #34.1: captum:LayerGradCam on the fc layer was a 24-line RuntimeError traceback, rc 1."""
    status = _explain(checkpoint, images, tmp_path / "out", "--method", "captum:LayerGradCam", "--option", "layer=fc")
    line = _error_line(capsys)
    assert status == 2
    assert "gave a layer attribution of shape" in line and "layer=NAME" in line


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 71.00 GiB"), "not enough memory"),
        (MemoryError("Unable to allocate 71.1 PiB for an array"), "not enough memory"),
        (RuntimeError("Calculated padded input size per channel: (7 x 7). Kernel size: (16 x 16). Kernel size can't "
                      "be greater than actual input size"), "too small for this model"),
        (NotImplementedError("Cannot copy out of meta tensor; no data!"), "the device cannot run the model"),
    ],
)  # fmt: skip
def test_resource_and_torch_errors_during_work_are_one_line_and_2(
    checkpoint, images, tmp_path, monkeypatch, capsys, error, expected
):
    """Issue #34.1: an allocation the limits refuse, a kernel larger than the input, a device that cannot run the
    model, raised by the method at its first batch."""

    def broken(self, x, target=None, *args, **kwargs):
        raise error

    from attr_engine.baselines import Gradient

    monkeypatch.setattr(Gradient, "attribute", broken)
    assert _explain(checkpoint, images, tmp_path / "out", "--method", "gradient") == 2
    line = _error_line(capsys)
    assert line.startswith("attr-engine explain: error: ") and expected in line, line


def test_an_internal_error_is_one_line_that_points_to_debug(checkpoint, images, tmp_path, monkeypatch, capsys):
    """A genuine bug (here a KeyError) is not dressed as the user's mistake: one line, rc 1, naming --debug; with
    --debug the traceback."""
    from attr_engine.baselines import Gradient

    def broken(self, x, target=None, *args, **kwargs):
        raise KeyError("a key the code forgot")

    monkeypatch.setattr(Gradient, "attribute", broken)
    assert _explain(checkpoint, images, tmp_path / "out", "--method", "gradient") == 1
    line = _error_line(capsys)
    assert "internal error: KeyError" in line and "--debug" in line
    with pytest.raises(KeyError):
        main(["--debug", "explain", str(images), "--classifier", str(checkpoint), "--out", str(tmp_path / "o2"),
              "--method", "gradient", "--no-progress"])  # fmt: skip


def test_the_boundary_judges_errors_by_kind_and_message():
    from attr_engine.cli._common import UsageError
    from attr_engine.ray import RemoteWorkerError

    assert user_error_message(ValueError("bad")) == "bad"
    assert user_error_message(UsageError("bad flag")) == "bad flag"
    assert user_error_message(FileNotFoundError(2, "No such file or directory", "x.png")).endswith("x.png")
    assert user_error_message(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x2 and 3x5)"))
    assert user_error_message(RuntimeError("something inside went wrong")) is None
    assert user_error_message(KeyError("k")) is None and user_error_message(AssertionError()) is None
    # An actor's error is judged by the class the actor raised.
    assert user_error_message(RemoteWorkerError("no such layer", "ValueError")) == "no such layer"
    assert user_error_message(RemoteWorkerError("x", "KeyError")) is None
    assert "not enough memory" in user_error_message(RemoteWorkerError("Tried to allocate", "OutOfMemoryError"))


# ---------------------------------------------------------------------------------------------------------------
# 2. Bounds before any work
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--method", "integrated-gradients", "--option", "n_steps=100000000"), "100,000,000 classifier passes"),
        (("--method", "captum:IntegratedGradients", "--option", "n_steps=100000000"), "over the budget of 20,000"),
        (("--method", "smoothgrad", "--option", "n_samples=1000000"), "--max-cost"),
        (("--method", "rise", "--option", "n_masks=50000"), "n_masks=50000"),
        (("--method", "integrated-gradients", "--option", "internal_batch_size=100000000"), "pixels in one"),
        (("--method", "gradcam:AblationCAM", "--option", "ratio_channels_to_ablate=5"), "must be in (0, 1]"),
        (("--method", "mda", "--option", "prior=legrad", "--option", "grid=4"), "'legrad' does not apply to"),
        (("--method", "mda", "--option", "grid=200"), "grid=200"),
        (("--device", "meta"), "--device meta cannot run a model"),
        (("--num-classes", "10000000", "--model", "resnet18"), "--num-classes must be between 1 and 100,000"),
    ],
)
def test_bounds_are_refused_before_any_work(checkpoint, images, tmp_path, capsys, no_work, extra, message):
    """Issue #34.1/2: n_steps=10^8 ran 51 s into a 71 PiB allocation; AblationCAM's ratio 5 ran with NumPy warnings;
    an MDA prior was resolved at the first map; --device meta and --num-classes 10^7 reached the model."""
    out = tmp_path / "out"
    assert _explain(checkpoint, images, out, *extra) == 2
    assert message in _error_line(capsys)
    assert not (out / "explain.json").exists()


def test_max_cost_lifts_the_budget(checkpoint, images, tmp_path, capsys):
    out = tmp_path / "out"
    args = ("--method", "rise", "--option", "n_masks=30000", "--option", "batch_size=512", "--limit", "1")
    assert _explain(checkpoint, images, out, *args) == 2
    assert "--max-cost 30000" in _error_line(capsys)
    from attr_engine.baselines.cost import method_cost
    from attr_engine.classifier import load_classifier
    from attr_engine.cli._common import check_cost
    from attr_engine.explainer import get_explainer

    clf = load_classifier("resnet18", num_classes=3)
    rise = get_explainer("rise", clf, n_masks=30000)
    assert method_cost(rise, 32, 32).passes == 30000
    check_cost(rise, 32, 30000, "rise")  # within the lifted budget: no error
    check_cost(rise, 32, 0, "rise")  # 0: no bound


@pytest.mark.parametrize(
    ("model", "img_size", "method", "message"),
    [
        ("vit_tiny_patch16_224", "7", "saliency", "smaller than the model's 16 px patches"),
        ("vit_tiny_patch16_224", "8", "legrad", "smaller than the model's 16 px patches"),
        ("resnet18", "100000", "saliency", "--img-size must be between 1 and 4096"),
    ],
)
def test_an_image_size_the_model_cannot_take_is_refused_first(
    images, tmp_path, capsys, no_work, model, img_size, method, message
):
    """Issue #34.1: --img-size 7 on a /16 ViT was a 64-line conv2d traceback; 100000 tried 30 GB in PIL."""
    args = ["--threads", "1", "explain", str(images), "--model", model, "--num-classes", "3", "--img-size", img_size,
            "--method", method, "--out", str(tmp_path / "out"), "--no-progress"]  # fmt: skip
    assert main(args) == 2
    assert message in _error_line(capsys)


def test_train_classifier_bounds_its_image_size_before_reading_data(tmp_path, capsys):
    args = ["train-classifier", "--img-size", "100000", "--num-images", "4", "--epochs", "1", "--out",
            str(tmp_path / "clf"), "--no-progress"]  # fmt: skip
    assert main(args) == 2
    assert "--img-size must be between 1 and 4096" in _error_line(capsys)


def test_train_aha_on_the_meta_device_says_so(checkpoint, tmp_path, capsys):
    """Issue #34.1: train-aha --device meta said "move it to the classifier's device (meta)"."""
    args = ["train-aha", "--classifier", str(checkpoint), "--num-images", "4", "--img-size", "32", "--device", "meta",
            "--out", str(tmp_path / "aha"), "--no-progress"]  # fmt: skip
    assert main(args) == 2
    line = _error_line(capsys)
    assert "--device meta cannot run a model" in line and "move it" not in line


def test_option_ranges_are_checked_when_the_method_is_built():
    from attr_engine import get_explainer
    from attr_engine.classifier import load_classifier

    clf = load_classifier("resnet18", num_classes=3)
    with pytest.raises(ValueError, match=r"ratio_channels_to_ablate' must be in \(0, 1\]"):
        get_explainer("gradcam:AblationCAM", clf, ratio_channels_to_ablate=0.0)
    with pytest.raises(ValueError, match=r"'k' must be in \(0, inf\)"):
        get_explainer("gradcam:FEM", clf, k=0)
    with pytest.raises(ValueError, match="does not apply"):
        get_explainer("mda", clf, prior="legrad")
    get_explainer("gradcam:AblationCAM", clf, ratio_channels_to_ablate=0.5)  # inside the range: built


# ---------------------------------------------------------------------------------------------------------------
# 3. A path where a name goes, a file where a folder goes, and the reverse: one line naming the flag to use
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def aha_dir(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from attr_engine.classifier import load_classifier
    from tests.aha_helpers import tiny_aha

    root = tmp_path_factory.mktemp("aha")
    tiny_aha(load_classifier(checkpoint=checkpoint)).save(root)
    return root


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["explain", "{images}", "--model", "{ckpt}"], "--model takes a model name, but {ckpt} is a checkpoint "
         "file: pass it as --classifier {ckpt}"),
        (["explain", "{images}", "--model", "{clf_dir}"], "--model takes a model name, but {clf_dir} is a directory: "
         "pass the classifier checkpoint in it, --classifier {ckpt}"),
        (["explain", "{images}", "--classifier", "{clf_dir}"], "--classifier {clf_dir} is a directory: pass the "
         "classifier checkpoint in it, --classifier {ckpt}"),
        (["explain", "{images}", "--classifier", "{aha}"], "--classifier {aha} is an AHA checkpoint directory (an "
         "explainer, not a classifier): pass it as --aha {aha}"),
        (["explain", "{images}", "--classifier", "{aha}/explainer.safetensors"], "is an AHA explainer's weights, not "
         "a classifier checkpoint: pass their directory as --aha {aha}"),
        (["explain", "{images}", "--classifier", "resnet18"], "classifier checkpoint not found: resnet18 (a model "
         "name goes to --model resnet18)"),
        (["explain", "{images}", "--classifier", "{ckpt}", "--method", "aha", "--aha", "{aha}/explainer.safetensors"],
         "--aha {aha}/explainer.safetensors is a file: an AHA checkpoint is the directory that holds it, --aha {aha}"),
        (["explain", "{images}", "--classifier", "{ckpt}", "--method", "aha", "--aha", "{ckpt}"], "--aha {ckpt} is a "
         "classifier checkpoint, not an AHA one: pass it as --classifier {ckpt}"),
        (["explain", "{images}", "--classifier", "{ckpt}", "--method", "aha", "--aha", "{clf_dir}"], "--aha {clf_dir} "
         "holds a classifier (classifier.safetensors), not an AHA checkpoint"),
        (["explain", "{images}", "--model", "hf:./no-such-folder"], "hf:./no-such-folder: no such directory"),
        (["explain", "{images}", "--model", "hf:{ckpt}"], "is a classifier checkpoint, not a transformers directory: "
         "pass it as --classifier {ckpt}"),
        (["evaluate", "--classifier", "{ckpt}", "--data", "{images}/a.png"], "--data {images}/a.png is a file; pass "
         "the ImageFolder directory"),
        (["train-aha", "--classifier", "{ckpt}", "--data", "{images}/a.png", "--out", "{out}"], "--data "
         "{images}/a.png is a file"),
        (["train-classifier", "--model", "resnet18", "--init", "{clf_dir}", "--out", "{out}"], "--init {clf_dir} is a "
         "directory: pass the classifier checkpoint in it, --init {ckpt}"),
        (["train-classifier", "--model", "{ckpt}", "--out", "{out}"], "--model takes a model name, but {ckpt} is a "
         "checkpoint file: pass it as --init {ckpt}"),
        (["export", "--classifier", "{ckpt}", "--aha", "{aha}/explainer.safetensors", "-o", "{out}/x.onnx"], "--aha "
         "{aha}/explainer.safetensors is a file: an AHA checkpoint is the directory that holds it, --aha {aha}"),
        (["export", "--classifier", "{ckpt}", "--aha", "{aha}", "-o", "{out}/x.onnx", "--class-names", "{images}"],
         "--class-names {images} is a directory; pass the JSON file of class names"),
    ],
)  # fmt: skip
def test_a_path_of_the_wrong_kind_names_the_flag_it_goes_to(checkpoint, aha_dir, images, tmp_path, capsys, argv,
                                                            message):  # fmt: skip
    """A checkpoint given as --model failed inside timm with advice about Hugging Face Hub prefixes; a folder given
    as --classifier was "not found"; an AHA weights file as --aha was "directory not found"."""
    where = {"ckpt": checkpoint, "clf_dir": checkpoint.parent, "aha": aha_dir, "images": images, "out": tmp_path}
    args = [arg.format(**where) for arg in argv]
    assert main(["--threads", "1", *args]) == 2
    assert message.format(**where) in _error_line(capsys)


# ---------------------------------------------------------------------------------------------------------------
# 4. Offline hub names
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["hf:google/vit-base-patch16-224", "hf-hub:timm/resnet18.a1_in1k"])
def test_a_hub_name_offline_is_one_line_without_retries(images, tmp_path, monkeypatch, capfd, model):
    """Issue #34.3: hf:google/vit-base-patch16-224 without --pretrained took 51 s and 11 "Retrying" lines. The hub
    is made unreachable here (a closed local port), whatever the network of the machine."""
    import huggingface_hub.constants as hub_constants

    with socket.socket() as s:  # bound, never listening: a connection is refused at once
        s.bind(("127.0.0.1", 0))
        monkeypatch.setattr(model_sources, "HUB_HOST", ("127.0.0.1", s.getsockname()[1]))
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
        args = ["--threads", "1", "explain", str(images), "--model", model, "--out", str(tmp_path / "out"),
                "--no-progress"]  # fmt: skip
        status = main(args)
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip() and "warning:" not in line]
    assert status == 2 and len(err) == 1, err
    assert "Retrying" not in err[0] and model.partition(":")[2] in err[0]


# ---------------------------------------------------------------------------------------------------------------
# 5. --no-progress silences the libraries' bars
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["gradcam:ScoreCAM", "gradcam:AblationCAM"])
def test_no_progress_silences_pytorch_grad_cam(checkpoint, images, tmp_path, capfd, method):
    """Issue #34.7: ScoreCAM and AblationCAM drew their own tqdm bars under --no-progress."""
    out = tmp_path / "out"
    assert _explain(checkpoint, images, out, "--method", method, "--limit", "1", "--batch-size", "1") == 0
    err = capfd.readouterr().err
    assert "it/s" not in err and "%|" not in err, err
    assert len(list(out.glob("*.npy"))) == 1
    import tqdm

    assert tqdm.tqdm is tqdm.std.tqdm  # restored after the command


def test_no_progress_silences_transformers_loading_bar(images, tmp_path, monkeypatch, capfd):
    """Issue #34.7: transformers' "Loading weights" bar under --no-progress."""
    from transformers import ViTImageProcessor

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a local directory: no hub probe (and nothing left set afterwards)

    from tests.conftest import tiny_hf_vit

    root = tmp_path / "hf-vit"
    tiny_hf_vit().save_pretrained(root)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(root)
    capfd.readouterr()  # save_pretrained's own "Writing model shards" bar is not the command's
    args = ["--threads", "1", "explain", str(images), "--model", f"hf:{root}", "--pretrained", "--method", "saliency",
            "--out", str(tmp_path / "out"), "--no-progress", "--limit", "1"]  # fmt: skip
    assert main(args) == 0
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "%|" not in err, err


# ---------------------------------------------------------------------------------------------------------------
# #33.5: slow metrics announce their cost; evaluate's bar moves per metric
# ---------------------------------------------------------------------------------------------------------------


def test_a_slow_metric_is_announced_before_it_runs():
    """Issue #33.5: evaluate on 2 images at 224 px with infidelity_quantus ran 18 minutes without a word."""
    from attr_engine import get_explainer
    from attr_engine.classifier import load_classifier
    from attr_engine.evaluate import METRICS, warn_slow_metrics

    clf = load_classifier("resnet18", num_classes=3)
    methods = {"saliency": get_explainer("saliency", clf)}
    quantus = {"infidelity_quantus": dict(METRICS["infidelity_quantus"].defaults)}
    with pytest.warns(UserWarning, match=r"infidelity_quantus on saliency: about 3,136 classifier passes per image"):
        warn_slow_metrics(methods, quantus, (224, 224), 2)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_slow_metrics(methods, quantus, (32, 32), 2)  # 64 passes per image: quiet


def test_evaluate_steps_through_each_metric(checkpoint, tmp_path, capfd):
    args = ["--threads", "1", "evaluate", "--classifier", str(checkpoint), "--methods", "gradient", "--metrics",
            "deletion,insertion", "--num-images", "2", "--img-size", "32"]  # fmt: skip
    assert main(args) == 0
    err = capfd.readouterr().err
    assert "3/3" in err and "step" in err, err  # the maps, then two metrics


# ---------------------------------------------------------------------------------------------------------------
# 9. The API: a wrong-size input to a ViT
# ---------------------------------------------------------------------------------------------------------------


def test_a_wrong_size_input_to_a_vit_is_a_value_error_naming_the_size():
    """Issue #34.9: timm's AssertionError instead of the project's ValueError."""
    from attr_engine import get_explainer
    from attr_engine.classifier import load_classifier

    clf = load_classifier("vit_tiny_patch16_224", num_classes=3, img_size=32)
    with pytest.raises(ValueError, match="takes 32 x 32 images"):
        clf(torch.rand(1, 3, 48, 48))
    with pytest.raises(ValueError, match="takes 32 x 32 images"):
        get_explainer("saliency", clf).attribute(torch.rand(1, 3, 64, 64), 0)


# ---------------------------------------------------------------------------------------------------------------
# 4. Ray: quiet, a closed address refused at once, an actor's error as the local engine prints it
# ---------------------------------------------------------------------------------------------------------------


def test_ray_closed_loopback_address_is_one_line(checkpoint, images, tmp_path):
    """Issue #34.4: --address 127.0.0.1:1 (a closed loopback port) refused in one line, nothing written."""
    pytest.importorskip("ray")
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "attr_engine", "explain", str(images), "--classifier", str(checkpoint), "--out",
         str(out), "--engine", "ray", "--address", "127.0.0.1:1"],
        capture_output=True, text=True, cwd=REPO, timeout=300, env={**os.environ, "RAY_ADDRESS": ""},
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "cannot reach the Ray cluster at 127.0.0.1:1" in lines[0]
    assert not out.exists()


def test_ray_is_quiet_and_an_actor_error_reads_as_the_local_engine_s(checkpoint, images, tmp_path, capsys):
    """Issue #34.4: every Ray run printed a logging.cc RAY_BACKEND_LOG_LEVEL line, and an actor's error ended in
    Ray's retry boilerplate. A per-batch failure inside the actor (a layer the method cannot use) now ends in the
    very line the local engine prints, rc 2, and Ray prints nothing of its own."""
    pytest.importorskip("ray")
    method = ("--method", "captum:LayerGradCam", "--option", "layer=fc")
    assert _explain(checkpoint, images, tmp_path / "local", *method) == 2
    local = _error_line(capsys)
    done = subprocess.run(
        [sys.executable, "-m", "attr_engine", "--threads", "1", "explain", str(images), "--classifier",
         str(checkpoint), "--out", str(tmp_path / "ray"), "--no-progress", *method, "--engine", "ray", "--actors",
         "1"],
        # Workers at niceness 0, as tests.ray_helpers.start_local_ray starts them: Ray's 15 starves them beside a busy
        # process.
        capture_output=True, text=True, cwd=REPO, timeout=600,
        env={**os.environ, "RAY_ADDRESS": "", "RAY_worker_niceness": "0"},
    )  # fmt: skip
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and lines == [local], done.stderr
