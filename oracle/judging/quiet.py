"""Whether an implementation's call is running in this process, so that the judge's own
background work waits for it to end.

Fixtures read in a thread (:class:`oracle.run.prefetch.Prefetched` with ``pause=wait_quiet``)
while cases are judged are Python work (ZIP directories, npy headers, judging parts): run
beside the implementation's call it takes the interpreter lock and a core from it, and a fast
implementation's forward took twice its own time in the worker. The judge marks each call of
the implementation (:func:`implementation_call`); such a reader waits (:func:`wait_quiet`)
before each fixture while one runs. (The worker of :mod:`oracle.run.stored` now reads each
fixture itself before its case, in no thread.) The implementation's own threads and settings
are left as they are.

Examples
--------
>>> with implementation_call():
...     running()
True
>>> running(), wait_quiet(0)
(False, True)
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

__all__ = ["implementation_call", "running", "wait_quiet"]

_LOCK = threading.Lock()
_QUIET = threading.Event()
_QUIET.set()
_CALLS = [0]  # implementation calls running now (several threads may judge at once)


@contextmanager
def implementation_call():
    """Mark the block as a call of the implementation (nested and concurrent calls count)."""
    with _LOCK:
        _CALLS[0] += 1
        _QUIET.clear()
    try:
        yield
    finally:
        with _LOCK:
            _CALLS[0] -= 1
            if not _CALLS[0]:
                _QUIET.set()


def running() -> bool:
    """Whether a call of the implementation is running in this process."""
    return not _QUIET.is_set()


def wait_quiet(timeout: float | None = None) -> bool:
    """Wait until no call of the implementation runs (at most ``timeout`` seconds); whether
    none does."""
    return _QUIET.wait(timeout)
