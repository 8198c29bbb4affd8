"""One output directory, one settings digest: jobs claim a directory for their settings while they write to it.

Two ``explain`` jobs with different settings writing into one directory would mix their maps (each alone is
consistent; together the folder is not). A job therefore *claims* the directory for its settings digest before it
writes: a claim is a file in ``OUT/_manifest/claims/`` named after the digest, held under an exclusive OS lock
(``fcntl.flock``) for the job's lifetime. A job whose digest differs from a live claim is refused; jobs with the
same settings (the shards of a torchrun job, a rerun) share the directory. The lock dies with its process, so the
claim of a killed job is recognised as stale and removed, and never blocks a rerun.

Within a directory, jobs of the same settings share the *items*: :class:`ItemClaims` holds one byte-range lock
per output (``fcntl.lockf`` on ``OUT/_manifest/claims/items.lock`` at an offset hashed from the output's name) while
a job computes and writes it, so a second job skips what the first is working on and comes back to it at the end
(done by then, or its job died and the lock with it). One file serves any number of items; a killed job's locks go
with its process.

Claims are checked and made under a short exclusive lock on ``OUT/_manifest/claims/.lock``, together with the
caller's own check of the settings already recorded in the directory, so two jobs started at the same moment
cannot both pass. Where ``fcntl`` does not exist (Windows) claims are not made: the recorded settings are still
checked, without the guarantee against a concurrent job.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["CLAIMS_DIR", "ItemClaims", "OutputInUseError", "claim_output"]

CLAIMS_DIR = Path("_manifest") / "claims"
_SUFFIX = ".claim"
# How long a job waits for another job's short check-and-claim section (milliseconds of work) before giving up.
_LOCK_TIMEOUT_S = 60.0


class OutputInUseError(ValueError):
    """The output directory is being written by a live job with other settings."""


def _held_by_someone(path: Path) -> bool:
    """Whether another open file description holds ``path``'s lock (a live job), tested without blocking."""
    assert fcntl is not None
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases the shared lock if it was taken
    return False


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    assert fcntl is not None
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + _LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise OutputInUseError(f"{path.parent.parent.parent} stays locked by another job") from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def claim_output(
    out: str | os.PathLike[str], digest: str, describe: str, check: Callable[[], None] | None = None
) -> Iterator[int]:
    """Hold directory ``out`` for a job with settings ``digest`` until the block ends; yields how many other live
    jobs (of the same settings) share it, so a caller knows whether files in flight may be another job's.

    Args:
        out: the output directory (created by the caller).
        digest: the job's settings digest; live claims of the same digest share the directory.
        describe: a few words naming the job (``"method saliency"``), shown to a job that is refused.
        check: called under the claims lock before the claim is made, e.g. to compare the settings already recorded
            in ``out``; what it raises propagates and no claim is made.

    Raises:
        OutputInUseError: a live job with another digest holds ``out``; the message names it.
    """
    root = Path(out) / CLAIMS_DIR
    if fcntl is None:
        if check is not None:
            check()
        yield 0
        return
    root.mkdir(parents=True, exist_ok=True)
    mine = root / f"{digest}-{os.getpid()}-{secrets.token_hex(4)}{_SUFFIX}"
    sharing = 0
    with _exclusive(root / ".lock"):
        for other in sorted(root.glob(f"*{_SUFFIX}")):
            if not _held_by_someone(other):
                other.unlink(missing_ok=True)  # its job died: the OS released its lock
                continue
            sharing += 1
            if other.name.split("-", 1)[0] != digest:
                try:
                    who = json.loads(other.read_text(encoding="utf-8")).get("describe", "")
                except (OSError, ValueError):
                    who = ""
                raise OutputInUseError(
                    f"{out} is being written right now by another job with other settings ({who or other.name}); "
                    "wait for it to finish or use another --out"
                )
        if check is not None:
            check()
        fd = os.open(mine, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, json.dumps({"digest": digest, "pid": os.getpid(), "describe": describe}).encode())
        except BaseException:
            # A claim half made (disk full) must not stay held for the rest of a long-lived process.
            mine.unlink(missing_ok=True)
            os.close(fd)
            raise
    try:
        yield sharing
    finally:
        mine.unlink(missing_ok=True)
        os.close(fd)


class ItemClaims:
    """Per-output claims in one directory, shared by the live jobs of one settings digest (see the module docstring).

    A process holds at most one lock per output; POSIX record locks belong to the process, so two claimers in one
    process do not exclude each other (jobs sharing a directory are separate processes). Without ``fcntl`` every
    claim succeeds: each job then does all of its items, as before claims existed.

    Args:
        out: the output directory.
    """

    # Offsets below 2**62: a byte-range lock needs no file that large, and 62 bits make collisions negligible.
    _SPAN = 1 << 62

    def __init__(self, out: str | os.PathLike[str]) -> None:
        self._fd: int | None = None
        self._held: set[int] = set()
        if fcntl is not None:
            root = Path(out) / CLAIMS_DIR
            root.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(root / "items.lock", os.O_RDWR | os.O_CREAT, 0o666)

    def _offset(self, key: str) -> int:
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % self._SPAN

    def try_claim(self, key: str) -> bool:
        """Claim output ``key`` (its path under the directory) without waiting; False when another job holds it."""
        if self._fd is None:
            return True
        offset = self._offset(key)
        if offset in self._held:
            return True
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
        except OSError:  # EACCES or EAGAIN: held by another process
            return False
        self._held.add(offset)
        return True

    def release(self, key: str) -> None:
        """Give output ``key`` back (after its files and journal line are written, or when it is skipped)."""
        offset = self._offset(key)
        if self._fd is None or offset not in self._held:
            return
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, offset)
        self._held.discard(offset)

    def close(self) -> None:
        """Release every claim (closing the file drops the process's locks on it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._held.clear()
