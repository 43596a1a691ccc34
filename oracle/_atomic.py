"""Writing into a fixture directory safely: atomic files, the writer lock, stale temp files.

Every file goes to a temporary file of this process (``.refattn-<pid>-<12 hex>.tmp``, created
exclusively with mode 0666 so the umask decides the final mode) in the same directory and is
moved into place with ``os.replace``: a reader sees the old file or the new one, never half of
one. One writer at a time holds an exclusive ``fcntl.flock`` on :data:`LOCK_FILE`. A writer
killed with SIGKILL cannot remove its temporary file; the next writer, holding the lock,
removes the temporary files whose process is gone (:func:`remove_stale_temps`), so a resumed
directory is byte-identical to one written in a single run. Files of any other name are never
touched.

Examples
--------
>>> import tempfile
>>> from pathlib import Path
>>> out = destination(tempfile.mkdtemp())
>>> with writer_lock(out, wait=False):
...     write_atomic(out / "x.json", b"{}")
>>> sorted(p.name for p in out.iterdir())
['.refattn-oracle.lock', 'x.json']
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
from pathlib import Path

__all__ = [
    "LOCK_FILE",
    "TMP_SUFFIX",
    "FixtureError",
    "FixtureLockError",
    "destination",
    "is_temp_name",
    "temp_name",
    "remove_stale_temps",
    "write_atomic",
    "writer_lock",
]

TMP_SUFFIX = ".tmp"
LOCK_FILE = ".refattn-oracle.lock"
#: the temporary files this module writes: the writer's pid, then 12 random hex digits
_TEMP_NAME = re.compile(r"\.refattn-([0-9]{1,10})-[0-9a-f]{12}\.tmp")


class FixtureError(ValueError):
    """A fixture directory or destination that cannot be read or written (one-line message)."""


class FixtureLockError(FixtureError):
    """Another writer holds the lock of the output directory."""


def temp_name() -> str:
    """A fresh temp-file name of this process (its pid, so a resume can tell dead writers)."""
    return f".refattn-{os.getpid()}-{secrets.token_hex(6)}{TMP_SUFFIX}"


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is a temporary file name of :func:`write_atomic` (of any process)."""
    return _TEMP_NAME.fullmatch(name) is not None


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file of this process + ``os.replace``.

    The temporary file is created exclusively with mode 0666, so the umask decides the final
    mode (as for any file a user's program writes); only that file is removed on failure.
    """
    temp = path.parent / temp_name()
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def _alive(pid: int) -> bool:
    if pid <= 0:  # 0 and negative pids name process groups, never one writer
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    except (OverflowError, OSError):
        return False
    return True


def remove_stale_temps(out: Path) -> list[str]:
    """Remove the temporary files of writers that are gone; return their names.

    Call it holding :class:`writer_lock` and before writing anything: the lock says no other
    run writes here, so a temporary file is a leftover of a killed run unless its process is
    still alive (a straggling worker of that run, which then moves it into place itself).
    A pid equal to this process's is a leftover too (an earlier process with the same pid:
    this run has written nothing yet).
    """
    removed = []
    for path in sorted(out.iterdir()):
        match = _TEMP_NAME.fullmatch(path.name)
        if match is None or path.is_symlink() or not path.is_file():
            continue
        pid = int(match.group(1))
        if pid != os.getpid() and _alive(pid):
            continue
        path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


def destination(out_dir) -> Path:
    """The output directory, created if missing; FixtureError for anything unusable."""
    if out_dir is None or str(out_dir) == "":
        raise FixtureError("out: expected a directory path, got an empty string")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FixtureError(f"out: {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FixtureError(f"out: cannot create directory {out} ({exc.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise FixtureError(f"out: directory {out} is not writable")
    return out


class writer_lock:
    """Exclusive ``flock`` on ``LOCK_FILE`` in ``out`` for one writer at a time."""

    def __init__(self, out: Path, wait: bool):
        self.path, self.wait, self.fd = out / LOCK_FILE, wait, None

    def __enter__(self):
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise FixtureError(
                f"out: cannot create lock file {self.path} ({exc.strerror})"
            ) from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | (0 if self.wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(self.fd)
            raise FixtureLockError(
                f"out: another `generate` is writing into {self.path.parent} (lock "
                f"{self.path.name} is held); wait for it or pass --wait"
            ) from None
        return self

    def __exit__(self, *exc_info):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
