"""Supervised case runs: an implementation under test runs in a worker process.

A validation must not pass by accident: an implementation that calls ``sys.exit`` or
``os._exit``, hangs, crashes the interpreter (segfault) or exhausts memory would otherwise end
the run with rc 0 and no report, or hang it. :class:`Supervisor` runs each case in a worker
process that it reuses from case to case and restarts only after it died, and turns each of
those events into the verdict "error" with the reason; the run goes on with the next case.

The worker is a fork of this process when that is safe (:mod:`oracle.run.forked`: it has
every module this process imported, and only imports the implementation), else a fresh
interpreter (``python -m oracle.run.supervise``, with this process's ``sys.path``); it talks
over two pipes with :mod:`multiprocessing.connection`. Unlike the ``spawn`` start method it
never re-imports the caller's ``__main__``, so a script that calls
:func:`oracle.run.validate` needs no ``if __name__ == "__main__"`` guard.

Protocol: the worker resolves the implementation once (a ``module:function`` string or an
adapter name, or a picklable callable) and answers "ready" or "fatal" (why it could not: the
caller refuses the run, see :meth:`Supervisor.start`), then answers each request ``(fixture,
grads, diagnose, reproduce, check, tolerance)`` with the judged
:class:`oracle.run.validate.CaseResult` ("result"), or "error" and one line when the implementation
raised a BaseException the judge does not turn into a verdict (KeyboardInterrupt...); ``None``
asks it to stop. Before its answer the worker may send ("note", text) progress notes (a long
diagnosis, :mod:`oracle.diagnose.budget`), handed to :attr:`Supervisor.on_note`. The
worker ignores SIGINT: a Ctrl-C stops the parent, which kills it.

Examples
--------
>>> from oracle.fixtures import golden
>>> from oracle.catalogue import get
>>> fixture = golden.build(get("basic-H2K2-L5S7-D8E8-f64"))
>>> with Supervisor("refattn-float64", timeout=120) as supervisor:
...     supervisor.run(fixture).verdict
'pass'
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None

from oracle.run.forked import fork_problem, fork_worker
from oracle.run.stored import Batch, serve_batch

__all__ = ["Supervisor", "DEFAULT_TIMEOUT", "LOAD_TIMEOUT", "MAX_TIMEOUT"]

#: seconds one case may take (implementation call, gradients and judging) before it is an error;
#: generous because a JIT-compiled implementation compiles on its first call.
DEFAULT_TIMEOUT = 300.0
#: seconds the worker may take to load the implementation (at least; longer with a longer
#: case timeout) before the run is refused
LOAD_TIMEOUT = DEFAULT_TIMEOUT
#: the longest timeout (about 11.6 days); waits beyond it overflow the OS's clock types
MAX_TIMEOUT = 1e6


def _one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (resolve_impl's own errors already read as a sentence)."""
    text = str(exc).strip().strip('"')
    first = text.splitlines()[0] if text else ""
    if isinstance(exc, (ImportError, AttributeError, TypeError, ValueError, KeyError)) and (
        first.startswith("impl:")
    ):
        return first
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


#: seconds between two looks for the answers of a batch of stored cases (but its last):
#: waiting on the pipe instead woke this process for every answer, and the scheduler ran it
#: at once on the core the worker had been using (238 wake-ups over the float32 cases of
#: ``default``; paced, the run's median wall time fell by about 0.03 s of 1.2 s); an answer
#: is taken at most this late, and a case's timeout is unchanged
RESULT_PACE = 0.01

#: bytes a pipe to or from the worker buffers (the Linux default is 64 KiB): a worker whose
#: result is bigger waits, and a busy machine may schedule the reader late
PIPE_BYTES = 2**20


def _widen(fd) -> None:
    """Let the pipe of ``fd`` buffer :data:`PIPE_BYTES` where the OS allows (Linux)."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (AttributeError, OSError, ValueError):
        pass  # another OS, or more than /proc/sys/fs/pipe-max-size: the default size


def _error_result(case, problem, reproduce, start, check=None):
    """The "error" result of ``case`` (or of its invariance ``check``) whose worker failed."""
    # keeps this module light: the worker runs it as __main__ before its memory limit
    from oracle.judging.results import CaseResult

    name, category = (
        (case.name, case.category) if check is None else (f"{case.name}::{check}", "invariance")
    )
    result = CaseResult(
        name,
        category,
        case.dtype,
        "error",
        message=problem,
        reproduce=reproduce,
        description=getattr(case, "description", ""),
    )
    result.seconds = time.perf_counter() - start
    return result


def _features(stored, index, grads):
    """The features of a stored case the worker did not read (read here, as a run that reads
    its fixtures here would have: an unreadable file raises its error)."""
    # keeps this module light, as _error_result
    from oracle.fixtures import golden
    from oracle.reading.features import case_features

    fixture = next(golden.load(stored.directory, names=[stored.names[index]]))
    return case_features(fixture.case, grads, fixture.inputs)


def _serve(receive, connection, impl_ref, memory_limit) -> None:  # pragma: no cover - worker
    """Worker loop: resolve the implementation, then judge fixtures until told to stop.

    Anything the implementation raises, BaseExceptions included (KeyboardInterrupt: the worker
    ignores SIGINT, so only the implementation can raise it here), is reported on one line:
    "fatal" while loading it, "error" for one case (the worker goes on serving).
    """
    convention = None
    if isinstance(impl_ref, tuple):  # (reference, calling convention of oracle.conventions.layouts)
        impl_ref, convention = impl_ref
    try:
        if memory_limit:
            # POSIX only; set before the worker loads anything else
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
        # the worker's modules load under its memory limit, inside the try (failure: 'fatal')
        from oracle.judging import judge  # noqa: F401 - loaded before the first case's clock starts
        from oracle.run.impls import resolve_impl

        impl, _ = resolve_impl(impl_ref)
        if convention:
            # the worker's modules load after its memory limit (see above)
            from oracle.conventions.layouts import wrap

            impl = wrap(impl, **convention)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which refuses the run
        connection.send(("fatal", _one_line(exc)))
        return
    connection.send(("ready", None))
    # worker side, as judge above (module-level imports run before the memory limit)
    from oracle.diagnose.budget import set_reporter

    set_reporter(lambda note: connection.send(("note", note)))  # the parent's progress bar
    while True:
        request = receive.recv()
        if request is None:
            return
        if isinstance(request, Batch):  # cases of a fixture directory (oracle.run.stored)
            if not serve_batch(impl, request, receive, connection.send, _judge, _one_line):
                return
            continue
        try:
            result = _judge(impl, request)
        except BaseException as exc:  # noqa: BLE001 - the case's verdict is "error"
            connection.send(("error", f"the implementation raised {_one_line(exc)}"))
        else:
            connection.send(("result", result))


def _judge(impl, request):  # pragma: no cover - worker
    # worker side: loaded by _serve after the memory limit (module-level imports run first)
    from oracle.judging.judge import check_fixture

    fixture, grads, diagnose, reproduce, check, tolerance = request
    if check is None:
        return check_fixture(
            impl, fixture, grads=grads, diagnose=diagnose, reproduce=reproduce, tolerance=tolerance
        )
    # worker side: loaded by _serve after the memory limit (module-level imports run first)
    from oracle.run.invariance import check_invariance

    return check_invariance(impl, fixture, check, reproduce=reproduce)


class Supervisor:
    """Run cases of one implementation in a reusable worker process.

    Parameters
    ----------
    impl_ref : str or callable
        ``"module:function"``, an adapter name, or a picklable callable (a module-level
        function); resolved once in the worker.
    timeout : float
        Seconds one case may take before the worker is killed and the case is an "error"
        (loading the implementation may take up to ``max(timeout, LOAD_TIMEOUT)``).
    memory_limit : int, optional
        Bytes of address space the worker may use (``RLIMIT_AS``); beyond it the case raises
        MemoryError or the worker dies, both an "error".
    """

    def __init__(
        self, impl_ref, *, timeout: float = DEFAULT_TIMEOUT, memory_limit: int | None = None
    ):
        if isinstance(timeout, bool) or not (
            isinstance(timeout, (int, float)) and 0 < timeout <= MAX_TIMEOUT
        ):
            raise ValueError(f"timeout: expected seconds in (0, {MAX_TIMEOUT:g}], got {timeout!r}")
        if memory_limit is not None and (not isinstance(memory_limit, int) or memory_limit <= 0):
            raise ValueError(f"memory_limit: expected bytes > 0, got {memory_limit!r}")
        self.impl_ref, self.timeout, self.memory_limit = impl_ref, float(timeout), memory_limit
        self._process = self._connection = self._send_connection = None
        self._loading = False  # launched, its "ready" not yet received
        self.starts = 0  # worker processes started (1 unless a case killed one)
        #: whether the last worker started is a fork of this process (:mod:`oracle.run.forked`)
        self.forked = False
        #: ``on_note(text)`` receives the worker's progress notes (a long diagnosis); None: dropped
        self.on_note = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def start(self) -> str | None:
        """Start the worker now if none runs (it loads the implementation): None, or why it
        could not (the import failed, exited, crashed or timed out: no case can be judged)."""
        self.launch()
        if not self._loading:
            return None
        self._loading = False
        # loading (imports, a JIT warm-up) is not a case: --timeout bounds cases, and a busy
        # machine must not turn a slow import into a refused run
        kind, message = self._receive(max(self.timeout, LOAD_TIMEOUT), "loading the implementation")
        if kind != "ready":
            self._stop()
            return message
        return None

    def launch(self) -> None:
        """Begin starting the worker if none runs, without waiting for it to load the
        implementation (:meth:`start` waits). Called from the only thread of a process that
        may fork (:func:`oracle.run.forked.fork_problem`), the worker is a fork of this
        process; else a fresh interpreter."""
        if self._process is not None:
            return
        reap_closed()  # a worker closed without waiting is gone before the next starts
        self.starts += 1
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        _widen(to_child_w), _widen(to_parent_w)
        self.forked = forked = fork_problem(self.memory_limit) is None
        try:
            if forked:
                self._process = fork_worker(
                    _serve_pipes,
                    to_child_r,
                    to_parent_w,
                    (to_child_w, to_parent_r),
                    self.impl_ref,
                    self.memory_limit,
                )
            else:
                self._process = self._spawn(to_child_r, to_parent_w)
        except BaseException:
            os.close(to_child_w)
            os.close(to_parent_r)
            raise
        finally:
            os.close(to_child_r)
            os.close(to_parent_w)
        self._send_connection = Connection(to_child_w, readable=False)
        self._connection = Connection(to_parent_r, writable=False)
        if not forked:
            self._send_connection.send_bytes(pickle.dumps((self.impl_ref, self.memory_limit)))
        self._loading = True

    def _spawn(self, read_fd, write_fd):
        """A fresh interpreter serving the pipes (``python -m oracle.run.supervise``)."""
        paths = [p or os.getcwd() for p in sys.path]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
        return subprocess.Popen(
            [sys.executable, "-m", "oracle.run.supervise", str(read_fd), str(write_fd)],
            pass_fds=(read_fd, write_fd),
            env=env,
            stdin=subprocess.DEVNULL,
        )

    def _receive(self, timeout, doing, limit=None):
        """("result"/"ready"/"fatal"/"note", payload) or ("died", reason) for timeout and
        death; ``limit`` is the timeout the reason names (default ``timeout``)."""
        try:
            if self._connection.poll(timeout):
                return self._connection.recv()
        except (EOFError, OSError):
            pass
        else:
            self._stop()
            return "died", (
                f"timeout: no result within {limit or timeout:g} s while {doing} "
                f"(the worker was killed; raise --timeout if the case is just "
                f"slow)"
            )
        return "died", self._death(doing)

    def _death(self, doing) -> str:
        try:
            code = self._process.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        self._stop()
        if code is None:
            return f"the worker stopped answering while {doing}"
        if code < 0:
            name = (
                signal.Signals(-code).name
                if -code in signal.Signals._value2member_map_
                else f"signal {-code}"
            )
            hint = " (out of memory?)" if name == "SIGKILL" else ""
            return f"the implementation crashed the worker ({name}{hint}) while {doing}"
        return (
            f"the worker exited with code {code} while {doing} (the implementation called "
            f"os._exit or exit)"
        )

    def _stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(5)
        for connection in (self._connection, self._send_connection):
            if connection is not None:
                connection.close()
        self._process = self._connection = self._send_connection = None
        self._loading = False

    def run(
        self, fixture, *, grads=False, diagnose=True, reproduce="", check=None, tolerance="default"
    ):
        """Judge one fixture in the worker (or run the invariance ``check`` of
        :mod:`oracle.run.invariance` on it); any way the worker fails is an "error" result."""
        start = time.perf_counter()
        problem = self.start()
        if problem is None:
            try:
                self._send_connection.send((fixture, grads, diagnose, reproduce, check, tolerance))
            except (OSError, EOFError):
                kind, problem = "died", self._death("sending the case")
            else:
                try:
                    kind, payload = self._result(fixture.case.name, start)
                except KeyboardInterrupt:  # Ctrl-C: stop the worker now, not after the case
                    self._stop()
                    raise
                if kind == "result":
                    return payload
                problem = payload
        return _error_result(fixture.case, problem, reproduce, start, check)

    def run_stored(
        self,
        stored,
        reproduce,
        *,
        grads=False,
        diagnose=True,
        tolerance="default",
        keep_arrays=True,
    ):
        """Judge the cases of ``stored`` (:class:`oracle.run.stored.StoredCases`; ``reproduce``:
        their reproduce commands) in the worker, which reads their fixtures: yields each
        case's result in order, its features set (``keep_arrays=False``: passing checks
        without their per-element arrays, :meth:`oracle.judging.results.Check.lighten`). Any
        way the worker fails is that case's "error" and a new worker goes on from the next
        case; a fixture that cannot be read raises its error when its case is reached."""
        index, total = 0, len(stored)
        while index < total:
            start = time.perf_counter()
            problem, features = self.start(), None
            if problem is None:
                batch = Batch(
                    stored.directory,
                    tuple(stored.names[index:]),
                    tuple(reproduce[index:]),
                    grads,
                    diagnose,
                    tolerance,
                    keep_arrays,
                )
                try:
                    self._send_connection.send(batch)
                except (OSError, EOFError):
                    problem = self._death("sending the cases")
            while problem is None and index < total:
                try:
                    kind, payload = self._result(
                        stored.names[index], start, paced=index < total - 1
                    )
                except KeyboardInterrupt:  # Ctrl-C: stop the worker now, not after the case
                    self._stop()
                    raise
                if kind == "raise":  # the fixture could not be read
                    raise payload
                if kind == "died":
                    problem = payload
                    break
                if kind == "case":  # its fixture was slow to read: the case's own clock starts
                    start, features = time.perf_counter(), payload
                    continue
                features, result = payload
                if kind == "error":
                    result = _error_result(stored.cases[index], result, reproduce[index], start)
                start = time.perf_counter()  # the worker is on the next case
                result.features, result.shape_classes = features or _features(stored, index, grads)
                features, index = None, index + 1
                yield result
            if problem is not None:
                result = _error_result(stored.cases[index], problem, reproduce[index], start)
                result.features, result.shape_classes = features or _features(stored, index, grads)
                index += 1
                yield result

    def _result(self, name, start, paced=False):
        """The case's answer; progress notes on the way go to :attr:`on_note` (the case's
        timeout runs from ``start`` across them). ``paced``: more answers follow this one, so
        the answer is looked for every :data:`RESULT_PACE` seconds instead of waking this
        process as it arrives (:meth:`run_stored`)."""
        while True:
            left = max(self.timeout - (time.perf_counter() - start), 0.0)
            if paced:
                left = self._paced_wait(left)
            kind, payload = self._receive(left, f"running {name}", self.timeout)
            if kind != "note":
                return kind, payload
            if self.on_note is not None:
                self.on_note(payload)

    def _paced_wait(self, left: float) -> float:
        """Sleep in steps of :data:`RESULT_PACE` until an answer (or the worker's end) is
        there or at most ``left`` seconds are left; returns the seconds left."""
        end = time.perf_counter() + left
        while left > RESULT_PACE:
            try:
                if self._connection.poll(0):
                    break
            except (EOFError, OSError):
                break
            time.sleep(RESULT_PACE)
            left = end - time.perf_counter()
        return max(left, 0.0)

    def close(self, wait: bool = True) -> None:
        """Ask the worker to stop (and kill it if it does not within 5 s). ``wait=False``:
        return at once; the worker is reaped (waited for, or killed after those 5 s) by the
        next worker's start or at this process's exit (:func:`reap_closed`), so that a run's
        report is written while the worker exits (its freed memory takes 10-20 ms to unmap)."""
        if self._send_connection is not None:
            try:
                self._send_connection.send(None)
            except (OSError, EOFError):
                pass
            if not wait and self._process.poll() is None:
                _CLOSING.append((self._process, time.monotonic() + 5.0))
                self._process = None
                self._stop()
                return
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self._stop()


#: workers asked to stop and not waited for (:meth:`Supervisor.close` with ``wait=False``),
#: each with the time after which it is killed
_CLOSING: list = []


def reap_closed() -> None:
    """Wait for the workers closed without waiting; one still running after its 5 s is
    killed."""
    while _CLOSING:
        process, deadline = _CLOSING.pop()
        try:
            process.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            process.kill()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                pass


atexit.register(reap_closed)


def _serve_pipes(read_fd, write_fd, impl_ref, memory_limit) -> None:  # pragma: no cover
    """The forked worker's loop (:mod:`oracle.run.forked`) over the two pipes."""
    _serve(
        Connection(read_fd, writable=False),
        Connection(write_fd, readable=False),
        impl_ref,
        memory_limit,
    )


def _main(argv) -> None:  # pragma: no cover - the worker's entry point
    """``python -m oracle.run.supervise READ_FD WRITE_FD``: serve cases over the two pipes."""
    # Ctrl-C in a terminal signals the whole process group: only the parent should react (it
    # stops the run and this worker); a KeyboardInterrupt here is then the implementation's own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    receive = Connection(int(argv[0]), writable=False)
    send = Connection(int(argv[1]), readable=False)
    impl_ref, memory_limit = pickle.loads(receive.recv_bytes())
    _serve(receive, send, impl_ref, memory_limit)
    # told to stop: the exit handlers (the implementation's too) and the streams, then out
    # without tearing every module down (0.2-0.4 s a worker, which the parent waits for)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


if __name__ == "__main__":  # pragma: no cover
    _main(sys.argv[1:])
