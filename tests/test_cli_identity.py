"""The command line's behaviour pinned byte for byte: a fixed set of `explain` runs (every kind of method, both
frames, both formats, overlays, resume, one-line errors) and their exit codes, printed lines and output files.

Refactors of the orchestration (the job layer, the engines, cli/) must leave every digest here unchanged; so must
any change that is not meant to change results. A change that is meant to (a new default, a fixed bug) updates
the record, and its commit says why:

    ATTR_ENGINE_UPDATE_IDENTITY=1 python -m pytest -q tests/test_cli_identity.py

The record holds SHA-256 digests of every output file (maps, overlays, settings, the per-rank manifest without its
timing). The maps are float32 results of one thread, so their bytes are specific to a torch build and a CPU (model
and vector width: on an AVX2 AMD EPYC every map of this record differed in its last bits from the earlier record's
machine). The record names both; on another machine the map files' digests are left out of the comparison (their
names still count) and everything else is compared. `test_ray.py` checks that the Ray engine's outputs equal these
runs' (the local engine's) byte for byte on any machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from attr_engine.aha import AHA, AHAConfig
from attr_engine.checkpoint import load_safetensors
from attr_engine.classifier import load_classifier
from attr_engine.cli import main
from tests.eval_helpers import single_thread, untrained_resnet_checkpoint

RECORD = Path(__file__).with_name("data") / "cli_identity.json"
UPDATE = os.environ.get("ATTR_ENGINE_UPDATE_IDENTITY", "") not in ("", "0")
FAST_AHA = {"n_fractions": 6, "n_iters": 8, "decoder_dim": 16, "class_dim": 8, "grid_range": (2, 6)}

# name -> the arguments after `explain INPUT --classifier CKPT --out OUT` (AHA's directory as {aha}).
RUNS: dict[str, list[str]] = {
    "gradient-png": ["--method", "gradient", "--png"],
    "pullback-default-safetensors-model-frame": ["--format", "safetensors", "--model-frame"],
    "pullback-soft-label": ["--method", "pullback-soft", "--target", "label"],
    "aha-refined-png": ["--method", "aha", "--aha", "{aha}", "--refine-steps", "1", "--png"],
    "smoothgrad-options": ["--method", "smoothgrad", "--option", "nt_samples=3", "--option", "seed=5"],
    "integrated-gradients-target": ["--method", "ig", "--option", "n_steps=4", "--target", "2"],
    "captum-occlusion": [
        "--method",
        "captum:Occlusion",
        "--option",
        "sliding_window_shapes=[3,8,8]",
        "--option",
        "strides=[3,8,8]",
    ],
    "grad-cam": ["--method", "grad-cam"],
    "gradient-x-input": ["--method", "gxi"],
    "occlusion": ["--method", "occlusion", "--option", "sliding_window_shapes=[3,8,8]"],
    "rise": ["--method", "rise", "--option", "n_masks=8"],
    "deeplift": ["--method", "deeplift"],
    "guided-grad-cam": ["--method", "guided-grad-cam"],
    "rollout-on-a-cnn": ["--method", "attention-rollout"],
    "unknown-method": ["--method", "gradeint"],
    "bad-target": ["--method", "gradient", "--target", "9"],
    "refine-without-aha": ["--method", "gradient", "--refine-steps", "2"],
}
# Runs in one directory, one after another: an interrupted run (--limit) finished by the same command.
RESUMED = [["--method", "saliency", "--limit", "2"], ["--method", "saliency"], ["--method", "saliency"]]


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A classifier checkpoint, an AHA for it and an ImageFolder tree of five images (two sizes, one greyscale)."""
    root = tmp_path_factory.mktemp("identity")
    checkpoint = untrained_resnet_checkpoint(root)
    _, meta = load_safetensors(checkpoint)
    torch.manual_seed(0)
    AHA(load_classifier(meta["model_name"], checkpoint=checkpoint), AHAConfig(**FAST_AHA)).save(root / "aha")
    rng = np.random.default_rng(0)
    for k, name in enumerate(["cat/0.png", "cat/1.jpg", "dog/0.png", "dog/1.png", "dog/2.png"]):
        (root / "images" / name).parent.mkdir(parents=True, exist_ok=True)
        size = (40, 36) if k % 2 else (33, 48)
        pixels = (rng.random((*size, 3)) * 255).astype(np.uint8)
        image = Image.fromarray(pixels).convert("L") if k == 3 else Image.fromarray(pixels)
        image.save(root / "images" / name, quality=95)
    return {"checkpoint": checkpoint, "aha": root / "aha", "images": root / "images", "root": root}


def _digest(path: Path) -> str:
    """SHA-256 of a file's bytes, except where two identical runs legitimately differ in bytes, not content."""
    if path.name.startswith("rank") and path.suffix == ".json":
        manifest = json.loads(path.read_text())
        manifest.pop("seconds", None)  # the only field that may differ between two identical runs
        return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    if path.name == "explain.json":
        settings = json.loads(path.read_text())
        # The AHA checkpoint's identity is its file's hash, and safetensors writes its metadata in hash-map order,
        # so the fixture's checkpoint (saved afresh each session) has another one each time.
        if "aha" in settings:
            settings["aha"] = "AHA-FILE-DIGEST"
        return hashlib.sha256(json.dumps(settings, indent=2).encode()).hexdigest()
    if path.suffix == ".safetensors":
        # The same: metadata order varies between writes; the tensors and the metadata are what must not change.
        tensors, meta = load_safetensors(path)
        digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
        for name in sorted(tensors):
            digest.update(name.encode() + tensors[name].numpy().tobytes())
        return digest.hexdigest()
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run(setup: dict[str, Path], out: Path, extra: list[str], capsys) -> dict:
    args = [a.replace("{aha}", str(setup["aha"])) for a in extra]
    status = main(["explain", str(setup["images"]), "--classifier", str(setup["checkpoint"]), "--out", str(out),
                   "--no-progress", "--batch-size", "2", "--seed", "3", *args])  # fmt: skip
    captured = capsys.readouterr()

    def clean(text: str) -> list[str]:
        text = text.replace(str(out), "OUT").replace(str(setup["root"]), "ROOT")
        return [re.sub(r"in \d+\.\d s$", "in T s", line) for line in text.splitlines() if line.strip()]

    files = {}
    if out.is_dir():
        for path in sorted(out.rglob("*")):
            # The journal's lines carry time stamps; claims exist only while a job runs.
            if path.is_file() and path.suffix != ".jsonl" and "claims" not in path.parts:
                files[path.relative_to(out).as_posix()] = _digest(path)
    return {"status": status, "stdout": clean(captured.out), "stderr": clean(captured.err), "files": files}


def record_runs(setup: dict[str, Path], capsys) -> dict:
    """Every run of :data:`RUNS` and the resumed sequence, as the record stores them."""
    results = {name: _run(setup, setup["root"] / "out" / name, extra, capsys) for name, extra in RUNS.items()}
    resumed = setup["root"] / "out" / "resumed"
    results["resumed"] = [_run(setup, resumed, extra, capsys) for extra in RESUMED]
    return results


# Files whose bytes are float results (maps, and overlays drawn from them): machine-specific, see the docstring.
FLOAT_OUTPUTS = (".npy", ".safetensors", ".overlay.png")


def _without_float_digests(run: dict) -> dict:
    files = {name: "FLOAT" if name.endswith(FLOAT_OUTPUTS) else d for name, d in run["files"].items()}
    return {**run, "files": files}


def machine() -> dict[str, str]:
    """What the map files' bytes depend on: torch's build and the CPU (:func:`attr_engine.cli._common.cpu_model`)."""
    from attr_engine.cli._common import cpu_model

    return {"torch": torch.__version__, "cpu": cpu_model()}


def test_explain_outputs_exit_codes_and_messages_are_unchanged(setup, capsys):
    results = record_runs(setup, capsys)
    if UPDATE:
        RECORD.parent.mkdir(exist_ok=True)
        RECORD.write_text(json.dumps({"machine": machine(), "runs": results}, indent=1, sort_keys=True) + "\n")
    record = json.loads(RECORD.read_text())
    expected = record["runs"]
    assert set(results) == set(expected)
    same_machine = record["machine"] == machine()
    for name in expected:
        if same_machine:
            assert results[name] == expected[name], name
        elif name == "resumed":
            assert [_without_float_digests(r) for r in results[name]] == [
                _without_float_digests(r) for r in expected[name]
            ], name
        else:
            assert _without_float_digests(results[name]) == _without_float_digests(expected[name]), name
    # The record itself holds what it should: maps for every image, overlays where asked, one-line errors.
    assert len([f for f in expected["gradient-png"]["files"] if f.endswith(".overlay.png")]) == 5
    assert [r["status"] for r in expected["resumed"]] == [0, 0, 0]
    assert expected["unknown-method"]["status"] == 2 and len(expected["unknown-method"]["stderr"]) == 1
