"""Converted artifacts (:mod:`attr_engine.artifact_precision`, ``attr-engine export --artifact``): float16 weights,
int8 decoder weights and saved graph optimisations against the float32 export of one untrained tiny AHA.

Tolerances. float16 rounds every weight and activation to 11 significant bits, int8 the decoder's weights to 256
levels: the maps move, so they are compared by rank (Spearman per image, what deletion / insertion read of a map)
and the predictions by argmax. The float16 bound 0.99 and the int8 bound 0.95 leave room below what this tiny model
gives (benches/README.md has the trained model's); a map of another class or image ranks near 0. A saved
optimisation is the graph onnxruntime builds at load anyway (level all by default), so its maps equal float32's
within onnxruntime's own reassociation (1e-4 on standardised maps, as tests/test_export.py compares).
"""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from attr_engine.artifact import read_artifact
from attr_engine.artifact_precision import OPTIMIZATIONS, PRECISIONS, convert_artifact, decoder_nodes
from attr_engine.cli import main
from attr_engine.metrics import pearson_similarity, pixel_ranks
from tests.aha_helpers import tiny_aha
from tests.eval_helpers import single_thread, untrained_resnet_checkpoint

ort = pytest.importorskip("onnxruntime", reason="the export extra (onnxruntime) is not installed")
onnx = pytest.importorskip("onnx", reason="the export extra (onnx) is not installed")
pytest.importorskip("onnxscript", reason="the export extra (onnxscript) is not installed")

REPO = Path(__file__).resolve().parents[1]
MAP_ATOL = 1e-4
MIN_SPEARMAN = {"float16": 0.99, "int8-decoder": 0.95}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``attr-engine export`` of an untrained small ResNet's tiny AHA at 32 px (float32), and its conversions by
    precision and by optimisation level, all made once."""
    from attr_engine.classifier import load_classifier

    root = tmp_path_factory.mktemp("precision")
    checkpoint = untrained_resnet_checkpoint(root)
    with single_thread():
        tiny_aha(load_classifier("resnet10t", checkpoint=checkpoint)).save(root / "aha")
        argv = ["export", "--classifier", str(checkpoint), "--aha", str(root / "aha"), "-o", str(root / "f32.onnx")]
        assert main([*argv, "--device", "cpu"]) == 0
    files = {"float32": root / "f32.onnx", "checkpoint": checkpoint, "aha": root / "aha"}
    for precision in PRECISIONS[1:]:
        files[precision] = convert_artifact(files["float32"], root / f"{precision}.onnx", precision=precision)
    for level in OPTIMIZATIONS[1:]:
        files[level] = convert_artifact(files["float32"], root / f"opt-{level}.onnx", optimize=level)
    return files


def _run(path: Path, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(logits (8, K), maps (8, 32, 32))`` of the file at ``path`` for 8 random images, predicted classes."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(seed).random((8, 3, 32, 32), dtype=np.float32)
    logits, maps = session.run(["logits", "maps"], {"images": x, "target": np.full(8, -1, np.int64)})
    return logits, maps


def spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman's rank correlation per image of maps ``a`` and ``b`` (N, H, W) -> (N,): the Pearson correlation of
    the pixel ranks deletion / insertion perturb by."""
    ranks = [pixel_ranks(torch.from_numpy(np.ascontiguousarray(m))) for m in (a, b)]
    return pearson_similarity(*ranks).numpy()


def _io(path: Path) -> list[tuple[str, str]]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return [(v.name, v.type) for v in (*session.get_inputs(), *session.get_outputs())]


@pytest.mark.parametrize("precision", PRECISIONS[1:])
def test_reduced_weights_keep_the_predictions_and_the_maps_ranks(exported, precision) -> None:
    reference_logits, reference_maps = _run(exported["float32"])
    logits, maps = _run(exported[precision])
    np.testing.assert_array_equal(logits.argmax(1), reference_logits.argmax(1))
    assert spearman(maps, reference_maps).min() >= MIN_SPEARMAN[precision]
    assert np.abs(maps - reference_maps).max() > 1e-6  # the weights did change
    shuffled = spearman(maps, reference_maps[::-1])
    assert shuffled.max() < 0.9  # another image's map ranks otherwise: the bound can fail
    assert (
        _io(exported[precision])
        == _io(exported["float32"])
        == [
            ("images", "tensor(float)"),
            ("target", "tensor(int64)"),
            ("logits", "tensor(float)"),
            ("maps", "tensor(float)"),
        ]
    )


def test_float16_is_smaller_and_int8_quantises_only_the_decoder(exported) -> None:
    assert exported["float16"].stat().st_size < 0.6 * exported["float32"].stat().st_size
    quantised = onnx.load(str(exported["int8-decoder"]))
    integer = [node for node in quantised.graph.node if node.op_type == "ConvInteger"]
    source = onnx.load(str(exported["float32"]))
    in_decoder = set(decoder_nodes(source))
    assert integer and len(integer) == sum(
        node.op_type == "Conv" and node.name in in_decoder for node in source.graph.node
    )
    # The classifier's logits come from float32 weights only: equal to the float32 file's to float32 rounding.
    np.testing.assert_allclose(_run(exported["int8-decoder"])[0], _run(exported["float32"])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("level", OPTIMIZATIONS[1:])
def test_a_saved_optimisation_gives_the_float32_maps(exported, level) -> None:
    logits, maps = _run(exported[level], seed=1)
    reference_logits, reference_maps = _run(exported["float32"], seed=1)
    np.testing.assert_allclose(maps, reference_maps, rtol=0, atol=MAP_ATOL)
    np.testing.assert_allclose(logits, reference_logits, rtol=1e-5, atol=1e-5)


def test_the_metadata_is_kept_and_says_what_was_done(exported) -> None:
    def meta(path: Path) -> dict[str, str]:
        return {entry.key: entry.value for entry in onnx.load(str(path)).metadata_props}

    source = meta(exported["float32"])
    assert "precision" not in source and "graph_optimization" not in source
    for name, recorded in [("float16", ("float16", "none")), ("int8-decoder", ("int8-decoder", "none")),
                           ("extended", ("float32", "extended"))]:  # fmt: skip
        converted = meta(exported[name])
        assert (converted.pop("precision"), converted.pop("graph_optimization")) == recorded
        assert converted == source
    artifact, reference = read_artifact(exported["float16"]), read_artifact(exported["float32"])
    assert (artifact.num_classes, artifact.preprocess, artifact.names) == (
        reference.num_classes, reference.preprocess, reference.names
    )  # fmt: skip


def test_a_converted_file_serves(exported) -> None:
    """The server's onnxruntime back end (as test_serve builds it, without a Ray cluster) answers from the float16
    file with the float32 file's classes and maps of the same ranks."""
    pytest.importorskip("ray.serve")
    from PIL import Image

    from attr_engine.serve import ModelServer, ServeSettings

    buffer = io.BytesIO()
    Image.fromarray((np.random.default_rng(3).random((40, 36, 3)) * 255).astype(np.uint8)).save(buffer, "PNG")
    instance = {"image": {"b64": base64.b64encode(buffer.getvalue()).decode("ascii")}, "target": None}
    answers = {}
    for name in ("float32", "float16", "int8-decoder"):
        server = ModelServer(read_artifact(exported[name]), ServeSettings(min_side=8))
        answers[name] = server.backend.compute(server._rows([instance], True))[0]
    for name in ("float16", "int8-decoder"):
        assert answers[name].target == answers["float32"].target
        served, reference = answers[name].map, answers["float32"].map
        inside = np.isfinite(reference)  # the image frame: NaN where the crop cut
        assert spearman(served[inside][None, :, None], reference[inside][None, :, None])[0] >= MIN_SPEARMAN[name]


def test_the_command_converts_without_torch(exported, tmp_path) -> None:
    """``attr-engine export --artifact`` in a process where any import of torch fails: the library module and the
    command import neither torch nor timm, and the file they write is read back."""
    out = tmp_path / "half.onnx"
    program = f"""
import sys
sys.modules["torch"] = None  # any import of torch fails
import attr_engine.artifact_precision
from attr_engine.cli import main
status = main(["export", "--artifact", {str(exported["float32"])!r}, "--precision", "float16", "-o", {str(out)!r}])
from attr_engine.artifact import read_artifact
print(status, read_artifact({str(out)!r}).num_classes, sorted(m for m in ("torch", "timm") if sys.modules.get(m)))
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'kernels'}"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "0 6 []"
    assert {e.key: e.value for e in onnx.load(str(out)).metadata_props}["precision"] == "float16"
    assert [p.name for p in tmp_path.iterdir()] == ["half.onnx"]  # no temporaries left


def test_export_from_aha_converts_right_after(exported, tmp_path, capsys) -> None:
    out = tmp_path / "model.onnx"
    argv = ["export", "--classifier", str(exported["checkpoint"]), "--aha", str(exported["aha"]), "-o", str(out)]
    with single_thread():
        assert main([*argv, "--device", "cpu", "--precision", "int8-decoder", "--optimize", "basic"]) == 0
    assert "int8-decoder, graph optimisation basic" in capsys.readouterr().out
    meta = {e.key: e.value for e in onnx.load(str(out)).metadata_props}
    assert (meta["precision"], meta["graph_optimization"]) == ("int8-decoder", "basic")
    assert [p.name for p in tmp_path.iterdir()] == ["model.onnx"]


def test_unsound_or_unknown_conversions_are_refused_in_one_line(exported, tmp_path) -> None:
    plain = tmp_path / "plain.onnx"
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )  # fmt: skip
    onnx.save(onnx.helper.make_model(graph), str(plain))
    (tmp_path / "text.onnx").write_text("not a model")
    cases = [
        (exported["float32"], {"precision": "int4"}, "precision must be one of float32, float16, int8-decoder"),
        (exported["float32"], {"optimize": "max"}, "optimize must be one of none, basic, extended, all"),
        (tmp_path / "missing.onnx", {}, "no such file"),
        (tmp_path / "text.onnx", {}, "text.onnx is not an ONNX file"),
        (plain, {"precision": "float16"}, "has no attr_engine.export/1 metadata"),
        (exported["float16"], {"precision": "int8-decoder"}, "holds float16 weights, which cannot become int8"),
        (exported["int8-decoder"], {"precision": "float32"}, "holds int8-decoder weights"),
        (exported["all"], {"precision": "float16"}, "is already optimised (all)"),
        (exported["basic"], {"optimize": "extended"}, "is already optimised (basic)"),
    ]
    for source, options, words in cases:
        with pytest.raises(ValueError, match=None) as info:
            convert_artifact(source, tmp_path / "out.onnx", **options)
        assert words in str(info.value) and "\n" not in str(info.value), (words, str(info.value))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.onnx", "text.onnx"]
    # The same precision and level again is a copy; None keeps the source's precision.
    again = convert_artifact(exported["float16"], tmp_path / "again.onnx", optimize="basic")
    assert {e.key: e.value for e in onnx.load(str(again)).metadata_props}["precision"] == "float16"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--aha", "{aha}"], "it takes no --aha (a flag of an export from --aha)"),
        (["--precision", "int8-decoder", "--artifact", "{float16}"], "holds float16 weights"),
        (["-o", "{tmp}/x.pt2"], "--output must be an .onnx file"),
        (["--artifact", "{tmp}/missing.onnx"], "missing.onnx: no such file"),
        (["--precision", "float16", "--aha", "{aha}", "--classifier", "{checkpoint}", "--format", "pt2"],
         "--precision and --optimize convert ONNX artifacts"),
    ],
)  # fmt: skip
def test_the_command_refuses_in_one_line_with_status_2(exported, tmp_path, capsys, extra, message) -> None:
    fill = {"tmp": tmp_path, **{k: str(v) for k, v in exported.items()}}
    argv = ["export", "--artifact", str(exported["float32"]), "-o", str(tmp_path / "x.onnx")]
    if "--classifier" in extra:
        argv = ["export", "-o", str(tmp_path / "x.pt2")]
    extra = [arg.format(**fill) for arg in extra]
    with single_thread():
        assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and err.startswith("attr-engine export: error:"), err
    assert list(tmp_path.iterdir()) == []
