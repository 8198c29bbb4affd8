"""The README's commands and Python examples, as a newcomer copies them (issue #33): the quick start's commands,
the Python API, "Use with Captum" and "Use with Quantus" examples run with tiny stand-ins for the models they name,
the demo table is the recorded seed-0 run (and, marked slow, still what `demo --quick` gives), and the command
line's help agrees with the README."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.eval_helpers import single_thread, tiny_convnet, tiny_resnet

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
RECORD = REPO / "tests" / "data" / "demo_quick.json"


def code_block(heading: str, language: str = "python") -> str:
    """The first ``language`` code block after ``heading`` in the README."""
    start = README.index(heading)
    opening = f"```{language}\n"
    begin = README.index(opening, start) + len(opening)
    return README[begin : README.index("```\n", begin)]


def substituted(code: str, replacements: dict[str, str]) -> str:
    """``code`` with each stand-in put in; each original must occur, so a README edit cannot skip a stand-in."""
    for old, new in replacements.items():
        assert old in code, f"the README example no longer has {old!r}: update the stand-ins"
        code = code.replace(old, new)
    return code


def run_example(code: str, namespace: dict) -> dict:
    with single_thread():
        exec(compile(code, "README.md", "exec"), namespace)
    return namespace


# ---------------------------------------------------------------------------------------------------------------
# Quick start
# ---------------------------------------------------------------------------------------------------------------


def test_the_quick_start_installs_the_core_and_tests_install_dev() -> None:
    first = code_block("## Quick start", "bash").strip()
    assert first == "pip install -e . && attr-engine demo --quick"
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in code_block("CPU-only torch", "bash")
    test_command = code_block("The test suite needs", "bash").strip()
    assert test_command == 'pip install -e ".[dev]" && python -m pytest -q'
    # .ci/run installs the dev extra (pinned) and then runs exactly the README's test command, last
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert any('-e ".[dev]"' in line and "pip install" in line for line in ci)
    assert ci[-1] == test_command.split(" && ")[1]


# The demo's code path imports none of the extras: a fresh interpreter where importing them fails runs a tiny demo.
_BLOCKED_DEMO = """
import sys
BLOCKED = {"ray", "transformers", "pytorch_grad_cam", "quantus", "skimage", "open_clip", "legrad"}

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is an extra the demo must not need")
        return None

sys.meta_path.insert(0, Block())
from attr_engine.cli import main
status = main(["demo", "--quick", "--out", sys.argv[1], "--no-progress", "--num-train", "16", "--epochs", "1",
               "--aha-steps", "1", "--aha-batch", "8", "--num-eval", "2", "--num-show", "1", "--refine-steps", "0",
               "--img-size", "32"])
print("LOADED", sorted({m.split(".")[0] for m in sys.modules} & BLOCKED))
sys.exit(status)
"""


def test_the_demo_needs_none_of_the_extras(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _BLOCKED_DEMO, str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "LOADED []" in done.stdout
    report = (tmp_path / "demo" / "report.md").read_text()
    for method in ("| AHA |", "| Grad-CAM |", "| Integrated gradients |", "| Saliency |", "| Soft pullback |"):
        assert method in report


# ---------------------------------------------------------------------------------------------------------------
# The demo table: generated from a recorded seed-0 run
# ---------------------------------------------------------------------------------------------------------------


def test_the_readme_demo_table_is_the_recorded_run() -> None:
    from attr_engine.cli.demo import QUICK, readme_block, readme_table

    record = json.loads(RECORD.read_text())
    assert record["command"] == "attr-engine demo --quick --seed 0" and record["seed"] == 0
    assert record["sizes"] == QUICK.__dict__  # the preset the README's command runs
    assert readme_block(README, "quick") == readme_table(record)
    assert f"{record['classifier_accuracy']:.1%}".replace("%", " %") in README  # the accuracy quoted above it


@pytest.mark.slow
def test_demo_quick_still_gives_the_readme_scores(tmp_path: Path) -> None:
    """`attr-engine demo --quick` (seed 0, one thread) gives the recorded scores to the README's 3 decimals. About
    1.5 minutes on one quiet core. A run that moves them is regenerated with `python docs/demo_table.py`. Compared
    on the recorded CPU model and vector width only: training's floats differ from one to another."""
    from attr_engine.cli import main
    from attr_engine.cli._common import cpu_model

    record = json.loads(RECORD.read_text())
    if torch.__version__ != record["torch"]:
        pytest.skip(f"the record is of torch {record['torch']}, this is {torch.__version__}: floats may differ")
    if cpu_model() != record["cpu"]:
        pytest.skip(f"the record is of a {record['cpu']} CPU, this is a {cpu_model()}: floats may differ")
    threads = torch.get_num_threads()
    try:
        assert main(["demo", "--quick", "--seed", "0", "--no-progress", "--out", str(tmp_path / "d")]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = json.loads((tmp_path / "d" / "results.json").read_text())["leaderboard"]

    def rounded(table: list[dict]) -> list[dict]:
        return [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items() if k != "ms/image"} for r in table]

    assert rounded(rows) == rounded(record["rows"])


# ---------------------------------------------------------------------------------------------------------------
# The Python examples, with tiny stand-ins for the models they name
# ---------------------------------------------------------------------------------------------------------------


def _write_folder(root: Path, per_class: int) -> None:
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    for label in ("cat", "dog"):
        (root / label).mkdir(parents=True)
        for k in range(per_class):
            pixels = (torch.rand(40, 48, 3, generator=gen) * 255).to(torch.uint8).numpy()
            Image.fromarray(pixels).save(root / label / f"{k}.png")


def test_the_python_api_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_folder(tmp_path / "my_images" / "train", 16)  # one batch of 32
    _write_folder(tmp_path / "my_images" / "val", 2)
    monkeypatch.chdir(tmp_path)
    code = substituted(
        code_block("## Python API"),
        {
            'load_classifier("resnet50.a1_in1k", pretrained=True)': "tiny_resnet(num_classes=2)",
            "img_size=224": "img_size=32",
        },
    )
    code = code.replace(
        "aha.fit(train_set, epochs=1, batch_size=32)", "aha.fit(train_set, epochs=1, batch_size=32, progress=False)"
    )
    ns = run_example(code, {"tiny_resnet": tiny_resnet})
    assert ns["maps"].shape == (4, 32, 32) and ns["pa"].shape == (4, 32, 32)  # the last batch: the 4 val images
    assert ns["scores"].deletion.shape == (4,) and torch.isfinite(ns["scores"].insertion).all()


def test_the_captum_example_runs() -> None:
    code = substituted(
        code_block("### Use with Captum"),
        {'load_classifier("resnet18", num_classes=10, img_size=64)': "tiny_convnet(num_classes=10)"},
    )
    ns = run_example(code, {"tiny_convnet": tiny_convnet})  # its asserts: Captum's result, either order
    assert ns["maps"].shape == (4, 64, 64) and ns["attr"].shape == (4, 3, 64, 64)


def test_the_quantus_example_runs() -> None:
    code = substituted(
        code_block("### Use with Quantus"),
        {'load_classifier("resnet18", num_classes=10, img_size=64)': "tiny_convnet(num_classes=10)"},
    )
    ns = run_example(code, {"tiny_convnet": tiny_convnet})
    assert ns["explain"](ns["clf"], ns["x"].numpy(), ns["y"].numpy()).shape == (4, 1, 64, 64)


# ---------------------------------------------------------------------------------------------------------------
# Help texts and README agree
# ---------------------------------------------------------------------------------------------------------------

# Flags the README shows for other programs: torchrun's, and the benchmark scripts'.
OTHER_PROGRAMS = {"--nproc_per_node", "--nnodes", "--rdzv_backend", "--rdzv_endpoint", "--index-url", "--smoke",
                  "--images", "--full", "--from"}  # fmt: skip


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from attr_engine.cli import build_parser

    parser, commands = build_parser()
    return {"": parser, **commands}


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: a for a in parser._actions for flag in a.option_strings if flag.startswith("--")}


def test_every_flag_the_readme_names_exists() -> None:
    known = set().union(*(_options(p) for p in _parsers().values()))
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*)", README)) - OTHER_PROGRAMS
    assert named - known == set()


def _states(text: str, default: object) -> bool:
    """Whether a help text gives ``default``: as written, with its digits grouped (20,000 / 25 000 000), a whole
    float as an integer (10.0 as 10), a byte count in MiB, or through argparse's ``%(default)s``."""
    forms = {str(default)}
    if isinstance(default, int | float) and not isinstance(default, bool) and float(default).is_integer():
        whole = int(default)
        forms |= {str(whole), f"{whole:,}", f"{whole:,}".replace(",", " ")}
        if whole >= 2**20 and whole % 2**20 == 0:
            forms.add(f"{whole // 2**20} MiB")
    return "%(default)" in text or any(form in text for form in forms)


def test_every_default_is_in_its_help() -> None:
    """``--epochs``, ``--seed``, ``--batch-size`` and the others say their default in --help."""
    missing = []
    for command, parser in _parsers().items():
        for flag, action in _options(parser).items():
            default = action.default
            if default in (None, False, argparse.SUPPRESS) or action.help == argparse.SUPPRESS or flag == "--help":
                continue
            if not _states(action.help or "", default):
                missing.append(f"{command} {flag} (default {default!r})")
    assert missing == []


def test_help_texts_say_what_the_readme_says() -> None:
    from attr_engine.evaluate import METRICS

    parsers = _parsers()
    # --model takes timm, torchvision: and hf: names (README "Any classifier")
    model_help = _options(parsers["explain"])["--model"].help
    assert "torchvision:<builder>" in README and "torchvision:<builder>" in model_help and "hf:" in model_help
    # --threads: one per core by default, the demo one (README quick start)
    threads = _options(parsers[""])["--threads"].help
    assert "one per core" in threads and "demo: 1" in threads and "The demo runs on one CPU thread" in README
    # evaluate --metrics names every metric
    metrics_help = _options(parsers["evaluate"])["--metrics"].help
    assert [m for m in METRICS if not re.search(rf"\b{m}\b", metrics_help)] == []
    # the demo's help quotes no timing (the README does, with the machine and its load)
    demo_help = parsers["demo"].format_help()
    assert not re.search(r"\d+\s*(min|s)\b", demo_help)
    # defaults the README states are the parsers' and the help's
    stated = {("train-aha", "--epochs"): "1", ("explain", "--png-max-side"): "2048"}
    for (command, flag), value in stated.items():
        action = _options(parsers[command])[flag]
        assert f"`{flag}` (default {value}" in README and f"default {value}" in action.help.replace(
            "%(default)s", str(action.default)
        )
    assert "`--device auto` (the default)" in README and _options(parsers["explain"])["--device"].default == "auto"


def test_no_stray_indentation_in_examples() -> None:
    for heading in ("## Python API", "### Use with Captum", "### Use with Quantus"):
        assert textwrap.dedent(code_block(heading)) == code_block(heading)
