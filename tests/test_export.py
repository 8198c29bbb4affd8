"""AHA exported as one serving artifact: onnxruntime against eager PyTorch on every classifier family, the dynamic
batch, the target input, the metadata, the refusals, ``attr-engine export`` and the README's onnxruntime snippet run
where attr_engine (and torch) cannot be imported. One ``.pt2`` (AOTInductor) case on the tiniest model, marked slow
(a C++ compile).

Tolerances. onnxruntime runs the same float32 graph with its own kernels (other convolution algorithms, fused GELU
and reductions summed in another order), so it differs from eager by float32 rounding: a few ulps per op, summed over
the backbone's and decoder's layers. The maps are standardised (unit standard deviation per image), so 1e-4 is about
800 ulps of 1.0: room for that reassociation, while any real fault (a missed standardisation, another class
explained, batch images mixed up) moves a map by O(1). The logits are compared at 1e-5 relative + 1e-5 absolute.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from attr_engine.aha import AHA, AHAConfig
from attr_engine.classifier import classifier_fingerprint
from attr_engine.cli import main
from attr_engine.explainer import get_explainer
from attr_engine.pixels import DataConfig
from tests.aha_helpers import tiny_aha
from tests.conftest import ZOO
from tests.eval_helpers import logits_read_the_target, onnx_session, single_thread, untrained_resnet_checkpoint

ort = pytest.importorskip("onnxruntime", reason="the export extra (onnxruntime) is not installed")
pytest.importorskip("onnxscript", reason="the export extra (onnxscript) is not installed")

MAP_ATOL = 1e-4
LOGIT_TOL = {"rtol": 1e-5, "atol": 1e-5}
README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with single_thread():
        yield


def _images(n: int, seed: int = 2) -> torch.Tensor:
    return torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=ZOO)
def exported(request, tmp_path_factory) -> tuple[AHA, Path, ort.InferenceSession]:
    """One ONNX export per family (traced at batch 2), shared by the tests of this module."""
    aha = tiny_aha(request.getfixturevalue(request.param))
    path = aha.export(tmp_path_factory.mktemp(request.param) / "aha.onnx")
    return aha, path, onnx_session(path)


def _run(session: ort.InferenceSession, x: torch.Tensor, target: list[int]) -> tuple[np.ndarray, np.ndarray]:
    logits, maps = session.run(["logits", "maps"], {"images": x.numpy(), "target": np.array(target, np.int64)})
    return logits, maps


def test_onnxruntime_matches_eager_at_other_batch_sizes(exported) -> None:
    aha, _, session = exported
    for batch in (1, 5):  # traced at 2: the batch is dynamic
        x = _images(batch)
        logits, maps = _run(session, x, [-1] * batch)
        eager_logits, eager_maps = aha.predict_and_explain(x)
        assert logits.shape == (batch, 5) and maps.shape == (batch, 32, 32) and maps.dtype == np.float32
        np.testing.assert_allclose(logits, eager_logits.numpy(), **LOGIT_TOL)
        np.testing.assert_array_equal(logits.argmax(1), eager_logits.argmax(1).numpy())
        np.testing.assert_allclose(maps, eager_maps.numpy(), rtol=0, atol=MAP_ATOL)


@pytest.mark.parametrize("family", ZOO)
def test_the_low_resolution_decoder_exports_on_every_family(family, request, tmp_path) -> None:
    """AHAConfig.decoder_stride 4 with the guided upsampling (pixel unshuffle, averaged taps, the 3 x 3 softmax
    weights): the same maps in onnxruntime as eager; on the CNNs at a side that is not a multiple of the stride (the
    ViTs take their own side only)."""
    classifier = request.getfixturevalue(family)
    side = 32 if "vit" in family else 30
    aha = AHA(classifier, AHAConfig(decoder_dim=8, class_dim=4, decoder_stride=4), img_size=side)
    session = onnx_session(aha.export(tmp_path / "aha.onnx"))
    x = torch.nn.functional.interpolate(_images(3), size=(side, side), mode="bilinear")
    logits, maps = _run(session, x, [-1, 1, -1])
    eager_logits, _ = aha.predict_and_explain(x)
    classes = [int(eager_logits[0].argmax()), 1, int(eager_logits[2].argmax())]
    assert maps.shape == (3, side, side)
    np.testing.assert_allclose(logits, eager_logits.numpy(), **LOGIT_TOL)
    np.testing.assert_allclose(maps, aha.attribute(x, target=classes).numpy(), rtol=0, atol=MAP_ATOL)


def test_the_target_input_picks_the_class_per_image(exported) -> None:
    aha, _, session = exported
    x = _images(4, seed=3)
    target = [-1, 3, 0, -1]
    logits, maps = _run(session, x, target)
    predicted = logits.argmax(1)
    classes = [int(predicted[i]) if t < 0 else t for i, t in enumerate(target)]
    eager = aha.attribute(x, target=classes).numpy()
    np.testing.assert_allclose(maps, eager, rtol=0, atol=MAP_ATOL)
    other = aha.attribute(x, target=[(c + 1) % 5 for c in classes]).numpy()
    assert np.abs(maps - other).max() > 100 * MAP_ATOL  # the class does change the map: the test can fail
    with pytest.raises(Exception, match="out of data bounds"):  # nothing in the graph checks values: the runtime does
        _run(session, x[:1], [5])


def test_the_classifier_alone_is_cut_out_of_the_file_on_every_family(exported) -> None:
    """A server's :predict session: the file's subgraph from ``images`` to ``logits``, which takes no target and
    gives the eager classifier's logits (onnxruntime runs every node of the whole file whatever is asked for)."""
    from attr_engine.artifact import read_artifact

    aha, path, _ = exported
    session = read_artifact(path).logits_session()
    assert [i.name for i in session.get_inputs()] == ["images"]
    assert [o.name for o in session.get_outputs()] == ["logits"]
    x = _images(3, seed=4)
    (logits,) = session.run(["logits"], {"images": x.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(logits, aha.classifier(x).numpy(), **LOGIT_TOL)


def test_a_file_whose_logits_need_the_target_gets_no_logits_session(tmp_path) -> None:
    """The cut is refused (None: a server runs the whole file) where the logits read ``target`` too."""
    artifact = logits_read_the_target(tmp_path / "target.onnx")
    feeds = {"images": np.ones((2, 3, 4, 4), np.float32), "target": np.array([0, 2], np.int64)}
    assert artifact.session().run(["logits"], feeds)[0][:, 0].tolist() == [1.0, 3.0]  # the graph itself runs
    assert artifact.logits_session() is None


def test_the_metadata_travels_in_the_file(exported) -> None:
    aha, _, session = exported
    meta = session.get_modelmeta().custom_metadata_map
    clf = aha.classifier
    assert meta["classifier_fingerprint"] == classifier_fingerprint(clf)
    assert json.loads(meta["input_size"]) == [3, 32, 32]
    assert json.loads(meta["mean"]) == pytest.approx(clf.mean) and json.loads(meta["std"]) == pytest.approx(clf.std)
    assert meta["num_classes"] == "5" and meta["method"] == "aha"
    from attr_engine.imageops import data_config

    assert json.loads(meta["preprocess"]) == data_config(clf, img_size=32).to_dict()  # the crop a server cuts with
    assert re.fullmatch(r"[0-9a-f]{16}", meta["settings_digest"])
    assert json.loads(meta["settings"])["refine_steps"] == 0
    from attr_engine import __version__

    assert meta["attr_engine_version"] == __version__
    assert [i.name for i in session.get_inputs()] == ["images", "target"]
    assert [o.name for o in session.get_outputs()] == ["logits", "maps"]


def test_class_names_and_a_changed_decoder_change_the_metadata(timm_cnn) -> None:
    from attr_engine.aha.export import export_metadata

    aha = tiny_aha(timm_cnn)
    names = ["cat", "dog", "cow", "ant", "bee"]
    meta = export_metadata(aha, 32, names)
    assert json.loads(meta["class_names"]) == names
    with torch.no_grad():
        aha.decoder.out.weight.mul_(2)
    assert export_metadata(aha, 32)["settings_digest"] != meta["settings_digest"]
    assert "class_names" not in export_metadata(aha, 32)  # a timm model built from scratch knows no names


def test_what_cannot_be_exported_is_refused_in_one_line(timm_cnn, timm_vit, tmp_path) -> None:
    out = tmp_path / "a.onnx"
    cases = [
        (tiny_aha(timm_cnn).with_options(refine_steps=2), {}, "refine_steps > 0 cannot be exported"),
        (get_explainer("saliency", timm_cnn), {}, "only AHA exports"),
        (tiny_aha(timm_vit), {"img_size": 48}, "takes 32 x 32 images"),
        (tiny_aha(timm_cnn), {"img_size": 0}, "one fixed integer side"),
        (tiny_aha(timm_cnn), {"format": "tflite"}, "format must be one of"),
        (tiny_aha(timm_cnn), {"class_names": ["a"]}, "1 names for 5 classes"),
        (tiny_aha(timm_cnn), {"preprocess": DataConfig((16, 16))}, "preprocess crops (16, 16) images"),
    ]
    for explainer, kwargs, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)) as info:
            from attr_engine.aha.export import export

            export(explainer, out, **kwargs)
        assert "\n" not in str(info.value)
    assert not out.exists()


def test_a_failed_export_leaves_no_file(timm_cnn, tmp_path, monkeypatch) -> None:
    out = tmp_path / "aha.onnx"

    def broken(*args, **kwargs):
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(torch.onnx, "export", broken)
    aha = tiny_aha(timm_cnn)
    aha.decoder.train()  # mid-training, say: tracing runs in eval mode and gives the mode back
    state = torch.random.get_rng_state()
    with pytest.raises(RuntimeError, match="conversion failed"):
        aha.export(out)
    assert list(tmp_path.iterdir()) == []
    assert aha.decoder.training and all(m.training for m in aha.decoder.modules())
    assert torch.equal(torch.random.get_rng_state(), state)  # the example images came from a generator of its own


# ---------------------------------------------------------------------------------------------------------------
# The command line, and the README's snippet run without attr_engine or torch
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_artifact(tmp_path_factory) -> tuple[Path, Path, Path]:
    """``attr-engine export`` of an untrained small ResNet's AHA: (classifier checkpoint, AHA dir, artifact)."""
    from attr_engine.classifier import load_classifier

    root = tmp_path_factory.mktemp("cli")
    checkpoint = untrained_resnet_checkpoint(root)
    aha_dir = root / "aha"
    tiny_aha(load_classifier("resnet10t", checkpoint=checkpoint)).save(aha_dir)
    names = root / "names.json"
    names.write_text(json.dumps([f"class {i}" for i in range(6)]))
    out = root / "out" / "model.onnx"
    argv = ["export", "--classifier", str(checkpoint), "--aha", str(aha_dir), "-o", str(out)]
    assert main([*argv, "--class-names", str(names), "--device", "cpu"]) == 0
    return checkpoint, aha_dir, out


def test_the_cli_export_writes_an_artifact_that_matches_explain(cli_artifact, capsys) -> None:
    from attr_engine.classifier import load_classifier

    checkpoint, aha_dir, out = cli_artifact
    assert out.is_file() and not [p for p in out.parent.iterdir() if p != out]  # one file, no temporaries
    clf = load_classifier("resnet10t", checkpoint=checkpoint)
    aha = AHA.load(aha_dir, clf)
    session = onnx_session(out)
    x = _images(3)
    logits, maps = _run(session, x, [-1, -1, -1])
    eager_logits, eager_maps = aha.predict_and_explain(x)
    np.testing.assert_allclose(maps, eager_maps.numpy(), rtol=0, atol=MAP_ATOL)
    np.testing.assert_allclose(logits, eager_logits.numpy(), **LOGIT_TOL)
    meta = session.get_modelmeta().custom_metadata_map
    assert json.loads(meta["class_names"])[5] == "class 5" and meta["classifier_name"] == "resnet10t"


def test_the_artifact_names_no_path_of_the_machine_that_exported_it(cli_artifact) -> None:
    """torch.onnx records a traceback per node (``pkg.torch.onnx.stack_trace``) naming this checkout's and torch's
    source files; export drops it and keeps the module scopes (which name modules, not files)."""
    import attr_engine

    _, _, out = cli_artifact
    data = out.read_bytes()
    for root in (Path(attr_engine.__file__).parents[1], Path(torch.__file__).parents[1]):
        assert str(root).encode() not in data, root
    assert b"pkg.torch.onnx.name_scopes" in data and b"stack_trace" not in data


def test_a_server_reads_the_recorded_crop_and_an_older_file_gets_the_whole_side(cli_artifact, tmp_path) -> None:
    """``attr-engine export`` of a checkpoint records the crop ``explain`` cuts it with (crop_pct 1.0); the reader
    of ``serve --artifact`` takes it, ``crop_pct`` replaces it, a file without the record is cut with the whole
    shorter side, and a damaged record is one line."""
    import onnx

    from attr_engine.artifact import read_artifact
    from attr_engine.classifier import load_classifier
    from attr_engine.imageops import data_config

    checkpoint, _, out = cli_artifact
    expected = data_config(load_classifier("resnet10t", checkpoint=checkpoint), img_size=32, crop_pct=1.0)
    artifact = read_artifact(out)
    assert artifact.preprocess == expected and artifact.num_classes == 6 and artifact.method == "aha"
    assert artifact.names == tuple(f"class {i}" for i in range(6)) and artifact.frame == "image"
    assert read_artifact(out, crop_pct=0.875, frame="model").preprocess.crop_pct == 0.875

    def rewritten(name: str, key: str, value: str | None) -> Path:
        proto = onnx.load(str(out))
        props = {p.key: p.value for p in proto.metadata_props if p.key != key}
        if value is not None:
            props[key] = value
        del proto.metadata_props[:]
        for k, v in props.items():
            proto.metadata_props.add(key=k, value=v)
        onnx.save(proto, str(tmp_path / name))
        return tmp_path / name

    old = rewritten("old.onnx", "preprocess", None)
    assert read_artifact(old).preprocess == DataConfig((32, 32), 1.0, "bicubic", "center")
    assert read_artifact(old, crop_pct=0.9).preprocess == DataConfig((32, 32), 0.9)
    damaged = [
        ("preprocess", json.dumps({**expected.to_dict(), "input_size": [16, 16]}), "the recorded preprocess crops"),
        ("preprocess", "{}", "a preprocessing record must hold"),
        ("class_names", '["a"]', "class_names are not 6 names"),
        ("num_classes", "many", "many"),
        ("format", "other/1", "has no attr_engine.export/1 metadata"),
    ]
    for key, value, words in damaged:
        with pytest.raises(ValueError, match=re.escape(words)) as info:
            read_artifact(rewritten(f"{key}.onnx", key, value))
        assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)
    with pytest.raises(ValueError, match=re.escape("crop_pct must be in (0, 1]")):
        read_artifact(out, crop_pct=0.0)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--method", "saliency"], "saliency cannot be exported"),
        (["--refine-steps", "2"], "--refine-steps must be 0"),
        (["--img-size", "4"], "--img-size must be >= 8"),
        (["--crop-pct", "0"], "--crop-pct must be in (0, 1], got 0.0"),
        (["--format", "pt2", "--img-size", "40", "--method", "grad-cam"], "grad-cam cannot be exported"),
    ],
)
def test_the_cli_refuses_in_one_line_with_status_2(cli_artifact, tmp_path, capsys, extra, message) -> None:
    checkpoint, aha_dir, _ = cli_artifact
    out = tmp_path / "x.onnx"
    argv = ["export", "--classifier", str(checkpoint), "--aha", str(aha_dir), "-o", str(out), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and err.startswith("attr-engine export: error:")
    assert not out.exists()


def _readme_snippet() -> str:
    """The README's five-line onnxruntime snippet (the python block after the marker comment)."""
    text = README.read_text()
    block = re.search(r"<!-- onnxruntime-snippet -->\s*```python\n(.*?)```", text, re.S)
    assert block is not None, "README.md lost its onnxruntime snippet"
    return block.group(1)


def test_the_readme_snippet_runs_without_attr_engine_or_torch(cli_artifact, tmp_path) -> None:
    from PIL import Image

    _, _, artifact = cli_artifact
    snippet = _readme_snippet()
    assert len([line for line in snippet.splitlines() if line.strip()]) <= 5
    Image.fromarray((np.random.default_rng(0).random((50, 40, 3)) * 255).astype(np.uint8)).save(tmp_path / "cat.png")
    program = textwrap.dedent(
        """
        import sys
        sys.modules["attr_engine"] = None  # any import of attr_engine (or torch) fails
        sys.modules["torch"] = None
        {snippet}
        assert logits.shape == (1, 6) and maps.shape == (1, 32, 32), (logits.shape, maps.shape)
        print(int(logits.argmax()), float(maps.std()))
        """
    ).format(snippet=snippet.replace("224", "32").replace("aha.onnx", str(artifact)))
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    predicted, spread = done.stdout.split()
    assert 0 <= int(predicted) < 6 and abs(float(spread) - 1.0) < 1e-3  # standardised maps


# ---------------------------------------------------------------------------------------------------------------
# AOTInductor
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_pt2_package_matches_eager_with_its_metadata(timm_cnn, tmp_path) -> None:
    """The tiniest model only: the package is a C++ compile of the graph (tens of seconds on one CPU core)."""
    from torch._inductor import aoti_load_package

    aha = tiny_aha(timm_cnn)
    path = aha.export(tmp_path / "aha.pt2")
    assert path.is_file() and list(tmp_path.iterdir()) == [path]
    compiled = aoti_load_package(str(path))
    meta = compiled.get_metadata()
    assert meta["classifier_fingerprint"] == classifier_fingerprint(timm_cnn) and meta["method"] == "aha"
    x = _images(3)  # traced at 2
    logits, maps = compiled(x, torch.tensor([-1, 2, -1]))
    eager_logits, _ = aha.predict_and_explain(x)
    classes = torch.where(torch.tensor([-1, 2, -1]) < 0, eager_logits.argmax(1), torch.tensor([-1, 2, -1]))
    torch.testing.assert_close(logits, eager_logits, **LOGIT_TOL)
    torch.testing.assert_close(maps, aha.attribute(x, target=classes), rtol=0, atol=MAP_ATOL)
