"""One output directory, one settings digest: jobs claim a directory for their settings while they write to it.

Two ``explain`` jobs with different settings writing into one directory would mix their maps (each alone is
consistent; together the folder is not). A job therefore *claims* the directory for its settings digest before it
writes: a claim is a file in ``OUT/_manifest/claims/`` named after the digest, held under an exclusive OS lock
(``fcntl.flock``) for the job's lifetime. A job whose digest differs from a live claim is refused; jobs with the
same settings (the shards of a torchrun job, a rerun) share the directory. The lock dies with its process, so the
claim of a killed job is recognised as stale and removed, and never blocks a rerun.

Claims are checked and made under a short exclusive lock on ``OUT/_manifest/claims/.lock``, together with the
caller's own check of the settings already recorded in the directory, so two jobs started at the same moment
cannot both pass. Where ``fcntl`` does not exist (Windows) claims are not made: the recorded settings are still
checked, without the guarantee against a concurrent job.
"""

from __future__ import annotations

import contextlib
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

__all__ = ["CLAIMS_DIR", "OutputInUseError", "claim_output"]

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
