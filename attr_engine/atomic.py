"""Atomic file writes without PyTorch: a temporary file in the destination's folder, fsynced, then renamed over
the target with ``os.replace``, so a crash mid-write leaves the old file intact, never a truncated one.

Temporary files are named ``.<target name>.<random>.tmp`` (:func:`stale_temporaries` finds those a killed writer
left) and created with the ordinary permissions, i.e. ``0o666`` less the process umask (``0o644`` under the usual
``022``), as the final file would be by a plain ``open``. :mod:`attr_engine.checkpoint` (safetensors, JSON) writes
through these; so does the serving side, which has no torch (:mod:`attr_engine.artifact_precision`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["TMP_SUFFIX", "atomic_path", "atomic_write", "fresh_dir", "fsync_dir", "stale_temporaries"]

TMP_SUFFIX = ".tmp"


def _unique_name(directory: Path, prefix: str) -> Path:
    return directory / f"{prefix}{secrets.token_hex(4)}{TMP_SUFFIX}"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path`` for a writer that takes a file name (safetensors, onnxruntime);
    on success fsync it and rename it over ``path``; on any error remove it."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = _unique_name(target.parent, f".{target.name}.")
        try:
            # Mode 0o666 filtered by the umask, like open(): tempfile.mkstemp would make every output 0600.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        break
    mode = stat.S_IMODE(tmp.stat().st_mode)
    try:
        yield tmp
        # A writer that replaces the file (safetensors' save_file writes 0600) gets the umask's mode back.
        os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


def fresh_dir(parent: str | os.PathLike[str], prefix: str) -> Path:
    """Create a new empty directory ``parent/<prefix><random>.tmp`` with the ordinary (umask) permissions."""
    root = Path(parent)
    root.mkdir(parents=True, exist_ok=True)
    while True:
        path = _unique_name(root, prefix)
        try:
            path.mkdir(mode=0o777)
        except FileExistsError:
            continue
        return path


def stale_temporaries(directory: str | os.PathLike[str]) -> list[Path]:
    """Temporary files :func:`atomic_write` (or a save) left in ``directory`` and below when its process was killed.

    Only names of the form ``.<name>.<8 hex digits>.tmp`` count, so no user file is ever matched.
    """
    found = []
    for p in Path(directory).rglob(f".*{TMP_SUFFIX}"):
        stem = p.name[: -len(TMP_SUFFIX)]
        _, dot, token = stem.rpartition(".")
        if dot and len(token) == 8 and all(c in "0123456789abcdef" for c in token) and p.is_file():
            found.append(p)
    return sorted(found)


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Flush a directory entry (a rename in it) to disk, where the platform allows opening a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "wb", encoding: str | None = None) -> Iterator[IO[Any]]:
    """Open a temporary file for writing that replaces ``path`` only if the ``with`` block completes.

    Args:
        path: destination; missing parent directories are created.
        mode: ``"wb"`` or ``"w"``.
        encoding: text encoding for ``mode="w"`` (UTF-8 when omitted).

    Example:
        >>> with atomic_write("out/log.txt", "w") as f:  # doctest: +SKIP
        ...     f.write("done")
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    if mode == "w" and encoding is None:
        encoding = "utf-8"
    with atomic_path(path) as tmp, open(tmp, mode, encoding=encoding) as f:
        yield f
        f.flush()
