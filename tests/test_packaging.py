"""The wheel a user installs: honest metadata, names of its own, and it runs from a clean directory without the
source tree, beside Hugging Face's ``kernels`` (which owns that top-level name).

Built offline (``pip wheel --no-deps --no-build-isolation``: the installed setuptools, nothing downloaded) from a copy
of the sources, so the checkout is never written to; installed with ``pip install --no-deps`` into a new virtual
environment that sees this machine's packages (torch, transformers, kernels), then ``pip check``. The editable install
is checked from outside the checkout too.
"""

from __future__ import annotations

import email
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import tomllib
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
    assert "attr_engine/py.typed" in names and "attr_engine_kernels/py.typed" in names
    assert not any(n.startswith(("tests/", "benches/")) for n in names)


# Imports every module of both packages and transformers' hub-kernel integration (which imports Hugging Face's
# `kernels` when installed) in a fresh interpreter, and prints where each module and the bare name `kernels` come from.
_IMPORT_ALL = """
import importlib, json, pkgutil, sys
found = {}
for package in ("attr_engine", "attr_engine_kernels"):
    root = importlib.import_module(package)
    found[package] = root.__file__
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        importlib.import_module(info.name)
        found[info.name] = sys.modules[info.name].__file__
hub = importlib.util.find_spec("kernels")
import transformers.activations  # imports Hugging Face's kernels when it is installed
print(json.dumps({"modules": found, "kernels": hub.origin if hub else None}))
"""


def _import_all(python: str | Path, cwd: Path, env: dict[str, str]) -> dict:
    done = subprocess.run([str(python), "-c", _IMPORT_ALL], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def _clean_env() -> dict[str, str]:
    """This process's environment without what would point Python at the checkout or pick a kernel backend."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ATTR_ENGINE_BACKEND", "VIRTUAL_ENV")}


def test_the_wheel_installs_only_names_of_its_own(wheel):
    """Top-level import names: ours alone. ``kernels`` is Hugging Face's kernel hub (transformers requires it); a
    wheel that shipped it would overwrite theirs or be overwritten. Neither name below is a project on PyPI."""
    with zipfile.ZipFile(wheel) as zf:
        tops = {n.split("/")[0] for n in zf.namelist() if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"attr_engine", "attr_engine_kernels"}


def test_every_package_folder_is_listed():
    """pyproject.toml lists the packages (find_packages cannot follow the kernels' folder mapping): a new
    subpackage left out of the list would be missing from the wheel."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = config["package-dir"]
    assert folders == {"attr_engine_kernels": "kernels/attr_engine_kernels"}
    assert not (REPO / "kernels" / "__init__.py").exists()  # kernels/ must never be a package named `kernels`
    on_disk = set()
    for name, folder in {"attr_engine": "attr_engine", **folders}.items():
        for init in (REPO / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO / folder).parts
            on_disk.add(".".join((name, *parts)))
    assert set(config["packages"]) == on_disk


@pytest.mark.parametrize("where", ["outside", "root"])
def test_every_module_imports_from_any_folder(where, tmp_path):
    """The installed (editable) package, from a folder outside the checkout and from the repository's root (on
    ``sys.path`` first, as under ``python -m pytest``): every module imports, the kernels resolve to this project's
    code, and the bare name ``kernels`` is left to whoever owns it, so transformers still finds its own."""
    result = _import_all(sys.executable, tmp_path if where == "outside" else REPO, _clean_env())
    modules = result["modules"]
    assert {"attr_engine.aha", "attr_engine.serve", "attr_engine.cli.explain", "attr_engine_kernels.sinkhorn"} <= set(
        modules
    )
    kernels_file = Path(modules["attr_engine_kernels"]).resolve()
    assert kernels_file == (REPO / "kernels" / "attr_engine_kernels" / "__init__.py").resolve(), kernels_file
    # Hugging Face's kernel hub is installed beside us (the dev extra): it keeps its name, we keep ours.
    assert result["kernels"] is not None and not Path(result["kernels"]).resolve().is_relative_to(REPO), result


def test_the_wheel_runs_in_a_fresh_venv_beside_huggingface_kernels(wheel, tmp_path):
    """A new virtual environment (it sees the machine's torch, transformers and Hugging Face's ``kernels``), the wheel
    installed into it as a user would, ``pip check``, then from a folder outside the checkout: every module imports
    from the venv's copy, the console script answers, and a tiny explain writes its map."""
    # --without-pip: the machine's pip installs into the venv; a bundled one would also bring the venv an old
    # setuptools of its own, below torch's requirement, and pip check would report that instead of our wheel.
    venv, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True, timeout=180
    )
    python = venv / "bin" / "python"
    env = _clean_env()
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "-q"]
    done = subprocess.run([*pip, "install", "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True,
                          env=env, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr
    checked = subprocess.run([*pip[:-1], "check"], capture_output=True, text=True, env=env, timeout=180)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    result = _import_all(python, work, env)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip())  # fmt: skip
    for name, file in result["modules"].items():
        assert Path(file).is_relative_to(site), (name, file)
    # Hugging Face's package, from the machine's site-packages: the wheel brought no `kernels` into the venv.
    assert result["kernels"] is not None and not Path(result["kernels"]).is_relative_to(site), result["kernels"]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(venv / "bin" / "attr-engine"), *args], capture_output=True, text=True, env=env,
                              cwd=work, timeout=300)  # fmt: skip

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
