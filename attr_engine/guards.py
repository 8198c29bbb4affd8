"""Checks of what a user passes that need neither torch nor a model: the bounds of sizes and counts, and paths
given where a name, a file or a folder goes.

The library's validators and the command line both call these, so each bound and each file layout is stated once,
and a command refuses a bad flag before it imports torch or timm: the refusal does not wait for those imports.
This module imports only the standard library (``test_import_graph.py`` checks it; ``test_cli_startup.py`` that a
refusal imports neither torch nor timm).

The path checks tell apart what the package writes and reads, by its layout and its files' own metadata (the
JSON header of a safetensors file, read without torch):

- a classifier checkpoint: one ``.safetensors`` file (``train-classifier`` writes ``OUT/classifier.safetensors``),
  given as ``checkpoint=`` / ``--classifier``;
- an AHA checkpoint: a directory (``config.json`` with ``explainer.safetensors``, or a training directory with
  ``checkpoints/``), given to ``AHA.load`` / ``--aha``;
- a transformers ``save_pretrained`` directory (``hf:DIR``) or a timm one (``local-dir:DIR``), named as a model;
- a model name: a registry name, ``torchvision:<builder>`` or ``hf:<repo id>``.

Each check that finds one given where another goes raises one line naming what it found and what to pass instead,
in the words of the caller: the API's arguments, or with ``cli=True`` the command line's flags.
"""

from __future__ import annotations

import json
import numbers
import os
import re
import struct
from pathlib import Path
from typing import Any

__all__ = [
    "AHA_CHECKPOINTS_DIR",
    "AHA_CONFIG_FILE",
    "AHA_FORMAT",
    "AHA_WEIGHTS_FILE",
    "CLASSIFIER_FILE",
    "CLASSIFIER_FORMAT",
    "COUNT_MINIMUM",
    "HF_PREFIX",
    "MAX_IMG_SIZE",
    "MAX_NUM_CLASSES",
    "MIN_EXPORT_SIDE",
    "SMALL_MODEL_MIN_SIDE",
    "SMALL_VIT_GRID",
    "TORCHVISION_PREFIX",
    "check_aha_dir",
    "check_checkpoint_file",
    "check_count",
    "check_crop_pct",
    "check_data_dir",
    "check_export_side",
    "check_img_size",
    "check_model_name_path",
    "check_num_classes",
    "check_small_model_side",
    "checkpoint_given_as_name",
    "not_a_classifier_hint",
    "safetensors_metadata",
    "split_source",
]

# ---------------------------------------------------------------------------------------------------------------
# Bounds
# ---------------------------------------------------------------------------------------------------------------

# A classification head of this many classes is 400 MB at 1024 features; ImageNet-21k has 21,843 classes.
MAX_NUM_CLASSES = 100_000
# The largest input side a flag or a file may set. A CNN's weights do not depend on its input size, so nothing in a
# file can confirm an img_size; without a bound, a crafted "img_size": "100000" makes every image a 100000 x 100000
# tensor. 4096 px is above any classifier's training size we know of; a caller passes a larger img_size itself.
MAX_IMG_SIZE = 4096
# The smallest side an exported graph is traced at.
MIN_EXPORT_SIDE = 8
# The small presets (classifier_training.small_model_config): a ResNet's four stages need 32 px; the ViT has an
# 8 x 8 patch grid, so its side is a multiple of 8.
SMALL_MODEL_MIN_SIDE = 32
SMALL_VIT_GRID = 8
# The least value of each count both the library and the command line take, by the library's option name: a
# refinement may take no step, a perturbation curve needs two points, the others at least one (a teacher of no step
# would be the decoder's own maps).
COUNT_MINIMUM: dict[str, int] = {
    "refine_steps": 0,
    "batch_size": 1,
    "epochs": 1,
    "max_steps": 1,
    "checkpoint_every": 1,
    "val_every": 1,
    "patience": 1,
    "n_fractions": 2,
    "teacher_steps": 1,
}


def check_count(value: object, option: str, *, flag: str | None = None) -> int:
    """Check the count ``option`` (a key of :data:`COUNT_MINIMUM`) against its least value; returns it.

    ``flag`` names it in the error as the command line does (``--refine-steps``), whose value argparse has already
    made an integer.

    Raises:
        ValueError: a bool, a non-integer or a count below the minimum.
    """
    minimum = COUNT_MINIMUM[option]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        if flag is not None:
            raise ValueError(f"{flag} must be >= {minimum}, got {value}")
        raise ValueError(f"{option} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_between(value: object, name: str, high: int, bound: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        shown = f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else repr(value)
        raise ValueError(f"{name} must be between 1 and {bound}, got {shown}")
    return value


def check_num_classes(value: object, name: str = "num_classes") -> int:
    """``value`` as a number of classes, 1 to :data:`MAX_NUM_CLASSES`; a ValueError naming ``name`` if not."""
    return _check_between(value, name, MAX_NUM_CLASSES, f"{MAX_NUM_CLASSES:,}")


def check_img_size(value: object, name: str = "img_size") -> int:
    """``value`` as an input side, 1 to :data:`MAX_IMG_SIZE` px; a ValueError naming ``name`` if not."""
    return _check_between(value, name, MAX_IMG_SIZE, f"{MAX_IMG_SIZE} px")


def check_crop_pct(value: object, name: str = "crop_pct") -> float:
    """The fraction of the resized image a centre crop keeps, in ``(0, 1]``; returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < float(value) <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return float(value)


def check_small_model_side(value: object, kind: str, name: str = "img_size") -> int:
    """The input side of a small preset (``kind`` ``"vit"`` or ``"resnet"``): at least :data:`SMALL_MODEL_MIN_SIDE`,
    and for the ViT a multiple of :data:`SMALL_VIT_GRID`."""
    vit = kind == "vit"
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < SMALL_MODEL_MIN_SIDE
        or (vit and value % SMALL_VIT_GRID)
    ):
        need = f"a multiple of {SMALL_VIT_GRID} and >= " if vit else ">= "
        raise ValueError(f"{name} must be {need}{SMALL_MODEL_MIN_SIDE}, got {value!r}")
    return value


def check_export_side(value: object, *, flag: str | None = None) -> int:
    """The one fixed side an exported graph takes: an integer >= :data:`MIN_EXPORT_SIDE` (``flag`` names it as the
    command line does)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < MIN_EXPORT_SIDE:
        if flag is not None:
            raise ValueError(f"{flag} must be >= {MIN_EXPORT_SIDE}, got {value}")
        raise ValueError(
            f"img_size must be one fixed integer side >= {MIN_EXPORT_SIDE} (the graph is traced per input size), "
            f"got {value!r}"
        )
    return value


# ---------------------------------------------------------------------------------------------------------------
# Model names and layouts: what the package reads and writes, told apart without torch
# ---------------------------------------------------------------------------------------------------------------

TORCHVISION_PREFIX = "torchvision:"
HF_PREFIX = "hf:"


def split_source(name: str) -> tuple[str, str]:
    """``("torchvision", builder)``, ``("hf", repo id or directory)`` or ``("timm", name)`` for a model name
    (:mod:`attr_engine.model_sources` builds them).

    Raises:
        ValueError: a torchvision / hf prefix with nothing after it.
    """
    for source, prefix in (("torchvision", TORCHVISION_PREFIX), ("hf", HF_PREFIX)):
        if name.lower().startswith(prefix):
            ident = name[len(prefix) :].strip()
            if not ident:
                raise ValueError(f"model name {name!r} names no model after {prefix!r}")
            return source, ident
    return "timm", name


CLASSIFIER_FILE = "classifier.safetensors"
CLASSIFIER_FORMAT = "attr_engine.classifier/1"
AHA_FORMAT = "attr_engine.aha/1"
AHA_CONFIG_FILE = "config.json"
AHA_WEIGHTS_FILE = "explainer.safetensors"
AHA_CHECKPOINTS_DIR = "checkpoints"
# Weight files by their usual suffixes: a model name never ends in one.
_WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")
# "hf:", "hf-hub:", "local-dir:", "torchvision:", "https:": a source prefix (two characters at least, so a Windows
# drive letter is not one).
_SOURCE_PREFIX = re.compile(r"^[A-Za-z][A-Za-z0-9_.+-]+:")
# A safetensors header is JSON; one larger than this is not a checkpoint of ours and is not read here.
_MAX_HEADER = 100 << 20


def safetensors_metadata(path: str | os.PathLike[str]) -> dict[str, str] | None:
    """The ``__metadata__`` of the safetensors file ``path`` (``{}`` if it has none), read from its JSON header
    without torch; None for a file that is not safetensors (or cannot be read)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                return None
            (size,) = struct.unpack("<Q", head)
            if not 2 <= size <= _MAX_HEADER:
                return None
            header = json.loads(f.read(size))
    except (OSError, ValueError):
        return None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}


def _json_object(path: Path) -> dict[str, Any]:
    """A small JSON object file (``config.json``), ``{}`` if it is missing, large or not an object."""
    try:
        if path.stat().st_size > 1 << 20:
            return {}
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _is_aha_dir(path: Path) -> bool:
    config = path / AHA_CONFIG_FILE
    return (path / AHA_CHECKPOINTS_DIR).is_dir() or (
        config.is_file() and ((path / AHA_WEIGHTS_FILE).is_file() or _json_object(config).get("format") == AHA_FORMAT)
    )


def _dir_kind(path: Path) -> str:
    """What a directory holds: ``"aha"``, ``"classifier"`` (a train-classifier output), ``"hf"`` (transformers'
    save_pretrained), ``"timm"`` (timm's local-dir) or ``"other"``."""
    if _is_aha_dir(path):
        return "aha"
    if (path / CLASSIFIER_FILE).is_file():
        return "classifier"
    config = _json_object(path / "config.json")
    if "model_type" in config:
        return "hf"
    if "architecture" in config:
        return "timm"
    return "other"


def _file_kind(path: Path) -> str:
    """What a file is: ``"classifier"`` (save_classifier's), ``"aha"`` (an AHA explainer's weights),
    ``"safetensors"`` (another one) or ``"other"``."""
    meta = safetensors_metadata(path)
    if meta is None:
        return "other"
    return {CLASSIFIER_FORMAT: "classifier", AHA_FORMAT: "aha"}.get(meta.get("format", ""), "safetensors")


class _Words:
    """How the caller names each thing: the API's arguments or the command line's flags."""

    def __init__(self, cli: bool, checkpoint_flag: str = "--classifier") -> None:
        self.cli = cli
        self.checkpoint_flag = checkpoint_flag

    def checkpoint(self, path: object) -> str:
        return f"{self.checkpoint_flag} {path}" if self.cli else f"load_classifier(checkpoint='{path}')"

    def model(self, name: str) -> str:
        return f"--model {name}" if self.cli else f"load_classifier('{name}')"

    def aha(self, path: object) -> str:
        if not self.cli:
            return f"AHA.load('{path}', classifier)"
        # train-classifier takes no AHA checkpoint: say which commands do.
        where = "" if self.checkpoint_flag == "--classifier" else " (explain, evaluate, export)"
        return f"--aha {path}{where}"

    def aha_taker(self) -> str:
        return "--aha" if self.cli else "AHA.load"


def _directory_hint(path: Path, words: _Words) -> str:
    """What a directory holds and how to pass it (or the file in it) instead."""
    kind = _dir_kind(path)
    if kind == "aha":
        return f"{path} is an AHA checkpoint directory (an explainer, not a classifier): pass it as {words.aha(path)}"
    if kind == "classifier":
        file = path / CLASSIFIER_FILE
        return f"{path} is a directory: pass the classifier checkpoint in it, {words.checkpoint(file)}"
    if kind == "hf":
        return f"{path} is a transformers save_pretrained directory: name it as a model, {words.model(f'hf:{path}')}"
    if kind == "timm":
        return f"{path} is a timm model directory: name it as a model, {words.model(f'local-dir:{path}')}"
    return (
        f"{path} is a directory; a classifier checkpoint is one .safetensors file (train-classifier writes "
        f"OUT/{CLASSIFIER_FILE})"
    )


def checkpoint_given_as_name(name: object) -> bool:
    """Whether ``name``, given where a model name goes, is a path to a checkpoint file instead: no source prefix,
    and an existing file named with a path separator, or a name ending in a weight file's suffix
    (``.safetensors``, ``.pt``, ...).

    No registry name contains a path separator without a source prefix or ends in such a suffix, so the two never
    collide; a bare name (``resnet18``) stays a name even when a file of that name lies in the working directory.
    """
    if not isinstance(name, str | os.PathLike) or not str(name).strip():
        return False
    text = os.fspath(name)
    if not isinstance(text, str) or _SOURCE_PREFIX.match(text):
        return False
    if text.lower().endswith(_WEIGHT_SUFFIXES):
        return not Path(text).is_dir()
    return (os.sep in text or "/" in text) and Path(text).is_file()


def check_model_name_path(name: str, *, cli: bool = False, checkpoint_flag: str = "--classifier") -> None:
    """Refuse a model name that is a path the model loaders would misread: a directory (what it holds named, with
    the name or argument it goes as), an ``hf:`` directory that does not exist or is a file, and on the command
    line a checkpoint file given to ``--model`` (named with ``checkpoint_flag``, the flag such a file goes to).

    ``hf:<id>`` names a hub repo (``org/name``) or, when ``<id>`` is a path (absolute, ``./``, ``../``, ``~``, or
    an existing one), a local directory: such a path must be a directory, or transformers would report the
    missing folder as a malformed repo id.
    """
    words = _Words(cli, checkpoint_flag)
    source, ident = split_source(name)
    if source == "hf":
        local = Path(ident)
        if local.is_dir() or not (ident.startswith(("/", "./", "../", "~", ".\\", "..\\")) or local.exists()):
            return
        if not local.exists():
            raise FileNotFoundError(
                f"{name}: no such directory (hf: takes a hub repo id org/name or a save_pretrained directory)"
            )
        if _file_kind(local) == "classifier":
            raise ValueError(
                f"{name}: {local} is a classifier checkpoint, not a transformers directory: pass it as "
                f"{words.checkpoint(local)}"
            )
        raise ValueError(f"{name}: {local} is a file; hf: takes a save_pretrained directory or a hub repo id")
    if _SOURCE_PREFIX.match(name):
        return
    path = Path(name)
    takes = "--model takes a model name, but" if cli else "load_classifier takes a model name, but"
    if path.is_dir() and (os.sep in name or "/" in name or name.startswith(".")):
        raise ValueError(f"{takes} {_directory_hint(path, words)}")
    if not cli:
        return  # a checkpoint file as the name is loaded as checkpoint= (load_classifier)
    if path.is_file() or name.lower().endswith(_WEIGHT_SUFFIXES):
        if path.is_file() and _file_kind(path) == "aha":
            raise ValueError(
                f"{takes} {name} is an AHA explainer's weights: pass their directory as --aha {path.parent}"
            )
        found = "a checkpoint file" if path.is_file() else "a checkpoint file name (no such file exists)"
        raise ValueError(f"{takes} {name} is {found}: pass it as {words.checkpoint(name)}")


def check_checkpoint_file(path: str | os.PathLike[str], *, cli: bool = False, flag: str = "--classifier") -> Path:
    """``path`` as a classifier checkpoint file; refused in one line if it is missing (a model name given in its
    place is named as such), a directory (saying what it holds) or an AHA explainer's weights. ``flag`` is the
    command line's name for it (with ``cli``).

    Raises:
        FileNotFoundError: no such file. ValueError: a directory or an AHA weights file.
    """
    words = _Words(cli, flag)
    p = Path(path)
    where = f"{flag} " if cli else ""
    missing = f"{flag} checkpoint not found" if cli and flag != "--classifier" else "classifier checkpoint not found"
    if p.is_dir():
        raise ValueError(where + _directory_hint(p, words))
    if not p.exists():
        text = str(path)
        if _SOURCE_PREFIX.match(text) or not ("/" in text or os.sep in text or text.lower().endswith(_WEIGHT_SUFFIXES)):
            raise FileNotFoundError(f"{missing}: {p} (a model name goes to {words.model(text)})")
        raise FileNotFoundError(f"{missing}: {p}")
    if _file_kind(p) == "aha":
        raise ValueError(
            f"{where}{p} is an AHA explainer's weights, not a classifier checkpoint: pass their directory as "
            f"{words.aha(p.parent)}"
        )
    return p


def check_aha_dir(path: str | os.PathLike[str], *, cli: bool = False) -> Path:
    """``path`` as an AHA checkpoint directory; refused in one line if it is missing, a file (its directory, or
    the flag a classifier checkpoint goes to, named) or a classifier's directory. Which step of a training
    directory loads is :func:`attr_engine.aha.persistence.checkpoint_dir`'s to say.

    Raises:
        FileNotFoundError: no such directory. ValueError: a file, or a directory that holds a classifier only.
    """
    words = _Words(cli)
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"AHA checkpoint directory not found: {p}")
    where = "--aha " if cli else ""
    if p.is_file():
        kind = _file_kind(p)
        if kind == "aha" or (p.name == AHA_WEIGHTS_FILE and _is_aha_dir(p.parent)):
            raise ValueError(
                f"{where}{p} is a file: an AHA checkpoint is the directory that holds it, {words.aha(p.parent)}"
            )
        if kind == "classifier":
            raise ValueError(
                f"{where}{p} is a classifier checkpoint, not an AHA one: pass it as {words.checkpoint(p)}; "
                f"{words.aha_taker()} takes the directory train-aha (or AHA.save) wrote"
            )
        raise ValueError(f"{where}{p} is a file; {words.aha_taker()} takes the directory train-aha (or AHA.save) wrote")
    if not _is_aha_dir(p) and (p / CLASSIFIER_FILE).is_file():
        raise ValueError(
            f"{where}{p} holds a classifier ({CLASSIFIER_FILE}), not an AHA checkpoint: pass that file as "
            f"{words.checkpoint(p / CLASSIFIER_FILE)}; {words.aha_taker()} takes the directory train-aha (or "
            "AHA.save) wrote"
        )
    return p


def check_data_dir(value: str, *, flag: str = "--data", embedded: str = "shapes") -> Path | None:
    """``--data``: the embedded dataset's name (None) or an existing ImageFolder directory."""
    if value == embedded:
        return None
    p = Path(value)
    if p.is_file():
        raise ValueError(
            f"{flag} {p} is a file; pass the ImageFolder directory (one subfolder per class) or '{embedded}'"
        )
    if not p.is_dir():
        raise FileNotFoundError(f"data folder not found: {p} (use '{embedded}' for the embedded dataset)")
    return p


def not_a_classifier_hint(value: object) -> str:
    """What to do with a name or path given where a loaded classifier goes, as the end of an error sentence (``""``
    for anything else): a model is built from its name (or checkpoint) first."""
    if not isinstance(value, str | os.PathLike):
        return ""
    text = os.fspath(value)
    if checkpoint_given_as_name(text) or Path(text).is_file():
        return f"; load the classifier first: load_classifier(checkpoint='{text}')"
    return f"; build the classifier first: load_classifier('{text}')"
