"""Supervised worker processes kept across validation runs in one process.

``validate(..., keep_worker=True)`` takes its :class:`~oracle.run.supervise.Supervisor` from here
and leaves it running: the next run of the same implementation (same reference, calling
convention, timeout and memory limit) in this process reuses the worker, which has already
imported the implementation and its framework (seconds for torch). The Dask executor
(:mod:`oracle.run.distribute`) sets it, so each Dask worker keeps one supervised child across its
tasks and across ``validate_many`` calls. A kept worker that died is restarted by its next
case as usual; every kept worker is closed when this process exits.

Examples
--------
>>> first = kept_supervisor("refattn-float64", timeout=60.0)
>>> first is kept_supervisor("refattn-float64", timeout=60.0)
True
>>> close_kept()
"""

from __future__ import annotations

import atexit
import pickle

from oracle.run.supervise import Supervisor

__all__ = ["kept_supervisor", "close_kept"]

_KEPT: dict = {}


def kept_supervisor(impl_ref, *, timeout, memory_limit=None):
    """The kept :class:`~oracle.run.supervise.Supervisor` of ``impl_ref`` with these limits (made,
    not started, on first use)."""
    key = (pickle.dumps(impl_ref), float(timeout), memory_limit)
    if key not in _KEPT:
        _KEPT[key] = Supervisor(impl_ref, timeout=timeout, memory_limit=memory_limit)
    return _KEPT[key]


def close_kept() -> None:
    """Stop every kept worker process."""
    while _KEPT:
        _, supervisor = _KEPT.popitem()
        supervisor.close()


atexit.register(close_kept)
