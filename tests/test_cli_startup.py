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
