"""Local parallel validation: ``refattn-oracle validate --workers N``.

:func:`oracle.run.validate.validate` with ``workers=N`` runs the cases in N supervised worker
processes (:class:`oracle.run.supervise.Supervisor`, each loading the implementation once and
kept across its cases) instead of one. A thread per worker takes the next case from a shared
queue, builds its fixture, sends it to its worker and waits (the wait releases the GIL: the
workers compute concurrently); the results are handed back **in case order**, so the report,
the progress bar, the first-case guidance of :mod:`oracle.diagnose.guidance` and the invariance
checks
(run by the worker that judged the case, right after it) are those of the serial run. Only
wall time changes.

Examples
--------
>>> from oracle.run.validate import validate
>>> report = validate("refattn-float64", suite="smoke", dtype="float64", progress=False,
...                   workers=2)
>>> [r.verdict for r in report.results]
['pass', 'pass']
"""

from __future__ import annotations

import queue
import threading

from oracle.run.supervise import Supervisor

__all__ = ["more_supervisors", "start_concurrently", "run_in_order"]


def more_supervisors(first, count: int) -> list:
    """``count`` more :class:`~oracle.run.supervise.Supervisor` like ``first`` (not started)."""
    made = type(first) if isinstance(first, Supervisor) else Supervisor
    return [
        made(first.impl_ref, timeout=first.timeout, memory_limit=first.memory_limit)
        for _ in range(max(0, count))
    ]


def start_concurrently(workers) -> None:
    """Start every worker at once (each imports the implementation: in parallel, not in
    turn). A worker that cannot start is started again, and its cases made errors, by
    :meth:`~oracle.run.supervise.Supervisor.run`."""
    threads = [threading.Thread(target=w.start, daemon=True) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def run_in_order(items, workers, run_item, done) -> None:
    """``done(run_item(item, worker))`` for every item, in item order, the items run
    concurrently by ``workers`` (one thread each). An exception of ``run_item`` or of
    ``done`` (a guidance error after the first cases) stops the run and is raised here."""
    jobs: queue.Queue = queue.Queue()
    for index, item in enumerate(items):
        jobs.put((index, item))
    finished: queue.Queue = queue.Queue()
    stop = threading.Event()

    def serve(worker) -> None:
        while not stop.is_set():
            try:
                index, item = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                finished.put((index, run_item(item, worker), None))
            except BaseException as err:  # noqa: BLE001 - raised again in the caller
                finished.put((index, None, err))
                return

    threads = [threading.Thread(target=serve, args=(w,), daemon=True) for w in workers]
    for thread in threads:
        thread.start()
    ready: dict = {}
    try:
        for next_index in range(len(items)):
            while next_index not in ready:
                index, found, err = finished.get()
                if err is not None:
                    raise err
                ready[index] = found
            done(ready.pop(next_index))
    finally:
        stop.set()
        # a worker still judging a case is closed by the caller (which ends its wait)
        for thread in threads:
            thread.join(0 if threading.current_thread() is thread else 0.1)
