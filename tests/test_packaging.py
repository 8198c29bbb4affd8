"""The wheel a user installs: honest metadata, and it runs from a clean directory without the source tree.

Built offline (``pip wheel --no-deps --no-build-isolation``: the installed setuptools, nothing downloaded) from a copy
of the sources, so the checkout is never written to; installed with ``pip install --no-deps --target`` into a
temporary directory that alone is put on ``PYTHONPATH``.
"""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from attr_engine.classifier import save_classifier
from attr_engine.classifier_training import small_model_config

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "attr_engine", "kernels")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(REPO / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    done = subprocess.run([*command, "-w", str(dist), str(src)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    (path,) = dist.glob("attr_engine-*.whl")
    return path


def test_wheel_metadata_declares_lower_bounds_license_and_types(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_string(zf.read(meta_name).decode())
    requires = meta.get_all("Requires-Dist")
    core = [r for r in requires if "extra ==" not in r]
    # Exact pins belong to .ci/constraints.txt (the marker `extra == "dev"` is not a pin).
    assert not any("==" in r.split(";")[0] for r in requires), requires
    bare = {r.split(">")[0].split("=")[0].split("<")[0].strip().lower() for r in core}
    assert {"torch", "timm", "pillow", "captum", "numpy", "matplotlib"} <= bare
    assert "torchvision" not in bare  # never imported; timm declares it
    assert meta["License"] == "Apache-2.0" and "LICENSE" in (meta.get_all("License-File") or [])
    assert any(n.endswith("licenses/LICENSE") for n in names)
    assert "attr_engine/py.typed" in names and "kernels/py.typed" in names
    assert not any(n.startswith(("tests/", "benches/")) for n in names)


def test_installed_wheel_runs_help_and_a_tiny_explain(wheel, tmp_path):
    target, work = tmp_path / "site", tmp_path / "work"
    work.mkdir()
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(target)]
    done = subprocess.run([*command, str(wheel)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # Only the installed copy is importable as attr_engine: PYTHONPATH comes before the editable install's entries,
    # and the working directory is not the checkout.
    env = {**os.environ, "PYTHONPATH": str(target)}
    env.pop("ATTR_ENGINE_BACKEND", None)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "attr_engine", *args], capture_output=True, text=True, env=env, cwd=work, timeout=180
        )

    where = subprocess.run(
        [sys.executable, "-c", "import attr_engine; print(attr_engine.__file__)"],
        capture_output=True, text=True, env=env, cwd=work, timeout=60,
    )  # fmt: skip
    assert Path(where.stdout.strip()).is_relative_to(target), where.stdout
    assert (target / "bin" / "attr-engine").is_file()  # the console script is installed
    helped = cli("--help")
    assert helped.returncode == 0 and "explain" in helped.stdout, helped.stderr

    torch.manual_seed(0)
    save_classifier(small_model_config("resnet", 32).build(6), work / "clf.safetensors")
    rgb = (np.random.default_rng(0).random((30, 40, 3)) * 255).astype(np.uint8)
    Image.fromarray(rgb).save(work / "photo.png")
    ran = cli("--threads", "1", "explain", "photo.png", "--classifier", "clf.safetensors", "--method", "gradient",
              "--out", "maps", "--png", "--no-progress")  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert (work / "maps" / "photo.npy").is_file() and (work / "maps" / "photo.overlay.png").is_file()
