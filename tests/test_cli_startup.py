"""`attr-engine --help` starts at once: neither the top-level help nor any subcommand's imports torch or timm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter: this test process has long imported torch.
_PROBE = """
import contextlib, io, json, sys
from attr_engine.cli import build_parser, main
_, commands = build_parser()
texts = {}
for argv in [[], *([name] for name in commands)]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        try:
            main([*argv, "--help"])
        except SystemExit as stop:
            assert stop.code == 0, (argv, stop.code)
    texts[" ".join(argv) or "-"] = buffer.getvalue()
heavy = ("torch", "timm", "triton", "attr_engine_kernels", "numpy", "matplotlib", "PIL")
heavy = sorted(m for m in heavy if m in sys.modules)
print(json.dumps({"heavy": heavy, "texts": texts}))
"""


def test_help_of_every_command_imports_neither_torch_nor_timm():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, cwd=REPO, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["heavy"] == [], f"--help imported {result['heavy']}"
    texts = result["texts"]
    assert {"-", "demo", "explain", "evaluate", "train-classifier", "train-aha", "bench"} <= set(texts)
    assert all(text.startswith("usage: attr-engine") for text in texts.values())


def test_python_m_attr_engine_help_exits_0_without_torch():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = (
        "import runpy, sys\n"
        "sys.argv = ['attr-engine', 'explain', '--help']\n"
        "try:\n"
        "    runpy.run_module('attr_engine', run_name='__main__')\n"
        "except SystemExit as stop:\n"
        "    assert not stop.code\n"
        "assert 'torch' not in sys.modules and 'timm' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--method" in done.stdout


# Each refusal is one line and exit status 2, and none of them needs a model: all are made before torch or timm is
# imported (attr_engine.guards holds the checks the library shares). {dir} holds the fixtures the test writes.
REFUSALS: list[list[str]] = [
    ["explain", "{dir}/images", "--model", "resnet18", "--num-classes", "0"],
    ["explain", "{dir}/images", "--model", "resnet18", "--img-size", "100000"],
    ["explain", "{dir}/missing", "--model", "resnet18"],
    ["explain", "{dir}/images", "--classifier", "{dir}/clf/classifier.safetensors", "--refine-steps", "-1"],
    ["explain", "{dir}/images", "--classifier", "{dir}/clf/classifier.safetensors", "--batch-size", "0"],
    ["explain", "{dir}/images", "--classifier", "{dir}/clf"],
    ["explain", "{dir}/images", "--classifier", "{dir}/missing.safetensors"],
    ["explain", "{dir}/images", "--model", "{dir}/clf/classifier.safetensors"],
    ["explain", "{dir}/images", "--classifier", "{dir}/clf/classifier.safetensors", "--aha", "{dir}/clf"],
    ["explain", "{dir}/images", "--model", "hf:./no-such-folder"],
    ["explain", "{dir}/images", "--model", "resnet18", "--crop-pct", "2"],
    ["evaluate", "--model", "resnet18", "--num-classes", "0"],
    ["evaluate", "--classifier", "{dir}/clf/classifier.safetensors", "--data", "{dir}/images/a.png"],
    ["train-classifier", "--img-size", "100000", "--out", "{dir}/out"],
    ["train-classifier", "--epochs", "0", "--out", "{dir}/out"],
    ["train-classifier", "--model", "resnet18", "--init", "{dir}/missing.safetensors", "--out", "{dir}/out"],
    ["train-aha", "--classifier", "{dir}/clf/classifier.safetensors", "--n-fractions", "1", "--out", "{dir}/out"],
    ["train-aha", "--classifier", "{dir}/clf/classifier.safetensors", "--max-steps", "0", "--out", "{dir}/out"],
    ["export", "--classifier", "{dir}/clf/classifier.safetensors", "--aha", "{dir}/missing", "-o", "{dir}/x.onnx"],
    ["export", "--classifier", "{dir}/clf/classifier.safetensors", "--aha", "{dir}/clf", "--img-size", "4", "-o",
     "{dir}/x.onnx"],
    ["demo", "--img-size", "30", "--out", "{dir}/out"],
    ["bench", "--img-size", "16"],
    ["serve", "--model", "resnet18", "--num-classes", "0"],
    ["--threads", "0", "explain", "{dir}/images", "--model", "resnet18"],
]  # fmt: skip

_REFUSAL_PROBE = """
import contextlib, io, json, sys
from attr_engine.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(argv)
    results.append({"argv": argv, "status": status, "stderr": err.getvalue().splitlines()})
heavy = sorted(m for m in ("torch", "timm", "triton", "kernels") if m in sys.modules)
print(json.dumps({"heavy": heavy, "results": results}))
"""


def test_refusals_that_need_no_model_import_neither_torch_nor_timm(tmp_path):
    """A bad flag used to cost the whole import of torch and timm before its one line (seconds, a minute on a busy
    machine); each of these is refused first, in a fresh interpreter that never imports them."""
    from PIL import Image

    from tests.eval_helpers import untrained_resnet_checkpoint

    (tmp_path / "images").mkdir()
    Image.new("RGB", (32, 32)).save(tmp_path / "images" / "a.png")
    (tmp_path / "clf").mkdir()
    untrained_resnet_checkpoint(tmp_path / "clf")
    argvs = [[arg.format(dir=tmp_path) for arg in argv] for argv in REFUSALS]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", _REFUSAL_PROBE, json.dumps(argvs)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    for run in result["results"]:
        lines = [line for line in run["stderr"] if line.strip()]
        assert run["status"] == 2 and len(lines) == 1, run
        assert lines[0].startswith("attr-engine") and " error: " in lines[0], run
    assert result["heavy"] == [], f"a refusal imported {result['heavy']}"
    assert not (tmp_path / "out").exists()
