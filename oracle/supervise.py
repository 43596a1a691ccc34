"""Supervised case runs: an implementation under test runs in a worker process.

A validation must not pass by accident: an implementation that calls ``sys.exit`` or
``os._exit``, hangs, crashes the interpreter (segfault) or exhausts memory would otherwise end
the run with rc 0 and no report, or hang it. :class:`Supervisor` runs each case in a worker
process (``multiprocessing`` with the spawn start method) that it reuses from case to case and
restarts only after it died, and turns each of those events into the verdict "error" with the
reason; the run goes on with the next case.

Protocol: the worker resolves the implementation once (a ``module:function`` string or an
adapter name, or a picklable callable), then answers each request ``(fixture, grads, diagnose,
reproduce)`` with the judged :class:`oracle.validate.CaseResult`; ``None`` asks it to stop.

Examples
--------
>>> from oracle import golden
>>> from oracle.cases import get
>>> fixture = golden.build(get("basic-H2K2-L5S7-D8E8-f64"))
>>> with Supervisor("refattn-float64", timeout=120) as supervisor:
...     supervisor.run(fixture).verdict
'pass'
"""

from __future__ import annotations

import multiprocessing
import signal
import time

__all__ = ["Supervisor", "DEFAULT_TIMEOUT"]

#: seconds one case may take (implementation call, gradients and judging) before it is an error;
#: generous because a JIT-compiled implementation compiles on its first call.
DEFAULT_TIMEOUT = 300.0


def _serve(connection, impl_ref, memory_limit) -> None:  # pragma: no cover - runs in a worker
    """Worker loop: resolve the implementation, then judge fixtures until told to stop."""
    if memory_limit:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    from . import validate as _validate

    try:
        impl, _ = _validate.resolve_impl(impl_ref)
    except Exception as exc:  # noqa: BLE001 - reported to the parent as every case's error
        connection.send(("fatal", f"{type(exc).__name__}: {exc}"))
        return
    connection.send(("ready", None))
    while True:
        request = connection.recv()
        if request is None:
            return
        fixture, grads, diagnose, reproduce = request
        result = _validate.judge_fixture(impl, fixture, grads=grads, diagnose=diagnose,
                                         reproduce=reproduce)
        connection.send(("result", result))


class Supervisor:
    """Run cases of one implementation in a reusable worker process.

    Parameters
    ----------
    impl_ref : str or callable
        ``"module:function"``, an adapter name, or a picklable callable (a module-level
        function); resolved once in the worker.
    timeout : float
        Seconds one case may take before the worker is killed and the case is an "error".
    memory_limit : int, optional
        Bytes of address space the worker may use (``RLIMIT_AS``); beyond it the case raises
        MemoryError or the worker dies, both an "error".
    """

    def __init__(self, impl_ref, *, timeout: float = DEFAULT_TIMEOUT,
                 memory_limit: int | None = None):
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout: expected seconds > 0, got {timeout!r}")
        if memory_limit is not None and (not isinstance(memory_limit, int) or memory_limit <= 0):
            raise ValueError(f"memory_limit: expected bytes > 0, got {memory_limit!r}")
        self.impl_ref, self.timeout, self.memory_limit = impl_ref, float(timeout), memory_limit
        self._process = self._connection = None
        self.starts = 0  # worker processes started (1 unless a case killed one)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def _start(self) -> str | None:
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, self.impl_ref,
                                                             self.memory_limit), daemon=True)
        self._process.start()
        child.close()
        self._connection = parent
        kind, message = self._receive(self.timeout, "starting the worker")
        if kind != "ready":
            self._stop()
            return message
        return None

    def _receive(self, timeout, doing):
        """("result"/"ready"/"fatal", payload) or ("died", reason) for timeout and death."""
        try:
            if self._connection.poll(timeout):
                return self._connection.recv()
        except (EOFError, OSError):
            pass
        else:
            self._stop()
            return "died", (f"timeout: no result within {self.timeout:g} s while {doing} "
                            f"(the worker was killed; raise --timeout if the case is just "
                            f"slow)")
        return "died", self._death(doing)

    def _death(self, doing) -> str:
        self._process.join(5)
        code = self._process.exitcode
        self._stop()
        if code is None:
            return f"the worker stopped answering while {doing}"
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ \
                else f"signal {-code}"
            hint = " (out of memory?)" if name == "SIGKILL" else ""
            return f"the implementation crashed the worker ({name}{hint}) while {doing}"
        return (f"the worker exited with code {code} while {doing} (the implementation called "
                f"os._exit or exit)")

    def _stop(self) -> None:
        if self._process is not None and self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        if self._connection is not None:
            self._connection.close()
        self._process = self._connection = None

    def run(self, fixture, *, grads=False, diagnose=True, reproduce=""):
        """Judge one fixture in the worker; any way the worker fails is an "error" result."""
        from .validate import CaseResult

        start = time.perf_counter()
        problem = None
        if self._process is None:
            self.starts += 1
            problem = self._start()
        if problem is None:
            try:
                self._connection.send((fixture, grads, diagnose, reproduce))
            except (OSError, EOFError):
                kind, problem = "died", self._death("sending the case")
            else:
                kind, payload = self._receive(self.timeout, f"running {fixture.case.name}")
                if kind == "result":
                    return payload
                problem = payload
        case = fixture.case
        result = CaseResult(case.name, case.category, case.dtype, "error", message=problem,
                            reproduce=reproduce, description=getattr(case, "description", ""))
        result.seconds = time.perf_counter() - start
        return result

    def close(self) -> None:
        """Ask the worker to stop (and kill it if it does not)."""
        if self._connection is not None:
            try:
                self._connection.send(None)
            except (OSError, EOFError):
                pass
            if self._process is not None:
                self._process.join(5)
        self._stop()
