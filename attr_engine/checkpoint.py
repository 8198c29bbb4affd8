"""Pickle-free persistence: safetensors for tensors, JSON for everything else, every write atomic.

Nothing here calls ``torch.load`` or unpickles: a checkpoint downloaded from someone else can only ever yield
tensors, strings and JSON values. Nested training state (``optimizer.state_dict()``, scheduler and RNG state) is
split by :func:`flatten_state` into a flat ``{name: tensor}`` dict plus a JSON skeleton that records where each tensor
went and which containers were tuples or had integer keys, so :func:`unflatten_state` rebuilds it exactly;
:func:`save_state` / :func:`load_state` store both in one safetensors file (the skeleton in its metadata).

Every write is atomic, through :mod:`attr_engine.atomic` (a temporary file in the destination directory, fsynced,
renamed over the target), the torch-free home of those helpers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from attr_engine.atomic import atomic_path, atomic_write

__all__ = [
    "flatten_state",
    "load_json",
    "load_safetensors",
    "load_state",
    "save_json",
    "save_safetensors",
    "save_state",
    "unflatten_state",
]

# Metadata key under which save_state stores the JSON skeleton of the nested state.
_SKELETON_KEY = "attr_engine.state_skeleton"
# numpy dtypes torch cannot hold (np.random's MT19937 key is uint32) are stored widened to int64.
_WIDEN_TO_INT64 = {"uint16", "uint32", "uint64"}


def save_safetensors(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Atomically write ``{name: tensor}`` (any device) and string metadata to a safetensors file.

    Tensors that share storage with an earlier entry (tied weights) are copied, since safetensors refuses aliases.
    """
    if not isinstance(tensors, Mapping):
        raise ValueError(f"tensors must be a mapping of str -> torch.Tensor, got {type(tensors).__name__}")
    seen_storages: set[int] = set()
    flat: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise ValueError(f"tensor names must be str, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"tensors[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
        t = t.detach().cpu()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() > 0 and ptr in seen_storages:
            t = t.clone()
        seen_storages.add(ptr)
        flat[name] = t.contiguous()
    meta = None
    if metadata is not None:
        bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise ValueError(f"metadata must map str -> str; offending keys: {bad}")
        meta = dict(metadata)
    with atomic_path(path) as tmp:
        save_file(flat, str(tmp), metadata=meta)


def load_safetensors(
    path: str | os.PathLike[str], device: str | torch.device = "cpu", *, finite: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a safetensors file into ``({name: tensor}, metadata)``.

    Args:
        finite: check that every floating-point tensor is finite, as the weight loaders do (maps may hold NaN
            borders; weights never hold NaN or infinity, so a weights file that does was damaged after it was
            written: safetensors has no checksum, bytes overwritten in its data section still parse, and every map
            made with it would be NaN).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: naming the file, if it is not a readable safetensors file (truncated, corrupt, other format)
            or, with ``finite``, a tensor holds NaN or infinite values (naming the tensor).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {p}")
    try:
        with safe_open(str(p), framework="pt", device=str(device)) as f:
            metadata = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, RuntimeError) as err:
        raise ValueError(f"{p} is not a valid safetensors file (corrupt or truncated?): {err}") from err
    if finite:
        for name, tensor in tensors.items():
            if (tensor.is_floating_point() or tensor.is_complex()) and not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"{p} is corrupt: tensor {name!r} holds NaN or infinite values")
    return tensors, metadata


def check_state_shapes(model: torch.nn.Module, state: Mapping[str, torch.Tensor], source: object, what: str) -> None:
    """Raise a ValueError naming ``source`` unless ``state`` has exactly ``model``'s state-dict keys and shapes.

    Meant for a ``model`` built on the meta device from sizes a file claims (shapes only, no memory): the claims are
    then confirmed by the stored weights before the real model is allocated.
    """
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for key, tensor in state.items():
        if key in expected and tuple(tensor.shape) != expected[key]:
            raise ValueError(
                f"{source} does not match {what}: {key} is {tuple(tensor.shape)} in the file, {expected[key]} in the "
                "model (corrupt metadata?)"
            )
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        found = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(unexpected[:3])}"
        raise ValueError(f"{source} does not match {what}: {found}")


def save_json(obj: Any, path: str | os.PathLike[str]) -> None:
    """Atomically write ``obj`` as indented JSON (non-finite floats are kept as ``NaN`` / ``Infinity``)."""
    text = json.dumps(obj, indent=2)
    with atomic_write(path, "w") as f:
        f.write(text + "\n")


def load_json(path: str | os.PathLike[str]) -> Any:
    """Read a JSON file; a missing file raises FileNotFoundError, a malformed one ValueError naming it."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"JSON file not found: {p}")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        # RecursionError: nesting deeper than the parser's stack (a crafted file), not a bug of ours.
        raise ValueError(f"{p} is not valid JSON: {type(err).__name__}: {err}") from None


def flatten_state(state: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Split a nested state (dicts, lists, tuples, scalars, tensors, numpy arrays) into tensors + a JSON skeleton.

    Containers are encoded so that tuples stay tuples and non-string dict keys (optimizer state is keyed by int
    parameter index) keep their type; each tensor is replaced by a reference to its entry in the returned dict,
    named after its path (``"state.0.exp_avg"``).

    Returns:
        ``(tensors, skeleton)``: ``skeleton`` is JSON-serialisable; ``unflatten_state(tensors, skeleton)`` rebuilds
        ``state``.

    Raises:
        TypeError: naming the path of a value that is not one of the supported types.
    """
    tensors: dict[str, torch.Tensor] = {}

    def new_name(path: str) -> str:
        name = path or "value"
        suffix = 0
        while name in tensors:
            suffix += 1
            name = f"{path}#{suffix}"
        return name

    def encode(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            name = new_name(path)
            tensors[name] = value.detach()
            return {"__tensor__": name}
        if isinstance(value, np.ndarray):
            name = new_name(path)
            stored = value.astype(np.int64) if value.dtype.name in _WIDEN_TO_INT64 else value
            tensors[name] = torch.from_numpy(np.ascontiguousarray(stored).copy())
            return {"__ndarray__": name, "dtype": value.dtype.name}
        if isinstance(value, np.generic):
            return encode(value.item(), path)
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, Mapping):
            items = [[k, encode(v, f"{path}.{k}" if path else str(k))] for k, v in value.items()]
            for k, _ in items:
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise TypeError(f"unsupported dict key {k!r} at {path or '<root>'}: only str and int keys")
            return {"__dict__": items}
        if isinstance(value, (list, tuple)):
            encoded = [encode(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value)]
            return {"__tuple__": encoded} if isinstance(value, tuple) else encoded
        raise TypeError(f"cannot serialise {type(value).__name__} at {path or '<root>'} without pickle")

    return tensors, encode(state, "")


def unflatten_state(tensors: Mapping[str, torch.Tensor], skeleton: Any) -> Any:
    """Inverse of :func:`flatten_state`.

    Raises:
        ValueError: if the skeleton refers to a tensor missing from ``tensors`` or is malformed.
    """

    def lookup(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"state skeleton refers to tensor {name!r}, which is missing")
        return tensors[name]

    def decode(node: Any) -> Any:
        if isinstance(node, list):
            return [decode(v) for v in node]
        if isinstance(node, dict):
            if "__tensor__" in node:
                return lookup(node["__tensor__"])
            if "__ndarray__" in node:
                return lookup(node["__ndarray__"]).cpu().numpy().astype(node["dtype"])
            if "__tuple__" in node:
                return tuple(decode(v) for v in node["__tuple__"])
            if "__dict__" in node:
                return {k: decode(v) for k, v in node["__dict__"]}
            raise ValueError(f"malformed state skeleton node with keys {sorted(node)}")
        return node

    return decode(skeleton)


def save_state(state: Any, path: str | os.PathLike[str], metadata: Mapping[str, str] | None = None) -> None:
    """Atomically save a nested state (e.g. ``{"model": ..., "optimizer": opt.state_dict(), "epoch": 3}``).

    Tensors go into the safetensors body; the skeleton from :func:`flatten_state` into its metadata, next to
    ``metadata`` (whose keys must not collide with the reserved skeleton key).
    """
    tensors, skeleton = flatten_state(state)
    meta = dict(metadata or {})
    if _SKELETON_KEY in meta:
        raise ValueError(f"metadata key {_SKELETON_KEY!r} is reserved")
    meta[_SKELETON_KEY] = json.dumps(skeleton)
    save_safetensors(tensors, path, meta)


def load_state(path: str | os.PathLike[str], device: str | torch.device = "cpu") -> tuple[Any, dict[str, str]]:
    """Load what :func:`save_state` wrote: ``(state, metadata)`` with the skeleton key removed from ``metadata``."""
    tensors, meta = load_safetensors(path, device=device, finite=True)
    if _SKELETON_KEY not in meta:
        raise ValueError(f"{path} holds plain tensors, not a nested state saved by save_state")
    try:
        skeleton = json.loads(meta.pop(_SKELETON_KEY))
        return unflatten_state(tensors, skeleton), meta
    except (json.JSONDecodeError, ValueError) as err:
        raise ValueError(f"{path}: corrupt state skeleton: {err}") from err
