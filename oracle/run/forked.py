"""Supervised workers started by forking this process instead of a fresh interpreter.

A fresh worker interpreter imports numpy, numba, refattn and the judge again (1.5-1.8 s on an
idle machine, about as long as the cases of ``default`` in one dtype take a fast
implementation). A process that has imported them already can fork its worker instead: the
child has every module loaded and only imports the implementation. The child is a separate
process like the fresh one (an exit, a crash, a hang or memory exhaustion of the
implementation ends the child, never the run) and runs the same loop
(:func:`oracle.run.supervise._serve`).

Forking is safe only in a known state, so :func:`fork_problem` allows it only when

* the platform is Linux (``os.fork``; macOS' system libraries are not fork-safe);
* this process runs one Python thread (a lock held by another thread would stay locked in
  the child forever), so the worker is forked before the fixture-reading thread starts;
* numba's threading layer has not started (its workqueue and OpenMP layers are not
  fork-safe) and no framework that starts native thread pools (torch, jax, tensorflow, ...)
  is imported;
* no memory limit is asked for (the limit must hold while the worker imports its modules:
  a fresh interpreter);
* :data:`FORK_VARIABLE` is not ``0``.

Otherwise the worker is a fresh interpreter, as before; both kinds give the same verdicts.
The child forgets the parent's exit handlers, reads no stdin, ignores SIGINT (a Ctrl-C stops
the parent, which kills it) and always leaves with ``os._exit``. The parent's objects are
frozen for the child's garbage collector (:func:`gc.freeze` across the fork): a collection in
the child would otherwise write into every page it shares with the parent, and the child's
malloc keeps the memory it frees for its next cases (:func:`keep_freed_memory`) instead of
having the kernel fault in and zero fresh pages for every case's arrays.

Examples
--------
>>> fork_problem(memory_limit=2**30)
'a memory limit must hold while the worker imports its modules'
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import select
import signal
import subprocess
import sys
import threading
import time
import warnings

__all__ = ["FORK_VARIABLE", "ForkedProcess", "fork_problem", "fork_worker", "keep_freed_memory"]

#: glibc ``mallopt`` parameters (malloc.h): M_TRIM_THRESHOLD, M_MMAP_THRESHOLD
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: blocks up to this size come from the heap, freed memory up to this much is kept there
_MMAP_THRESHOLD, _TRIM_THRESHOLD = 256 << 20, 1 << 30

#: environment variable: ``0`` (or ``off``, ``no``) starts every worker as a fresh interpreter
FORK_VARIABLE = "REFATTN_ORACLE_FORK"

#: modules whose import may have started native thread pools that do not survive a fork
_THREAD_POOLS = (
    "torch",
    "jax",
    "jaxlib",
    "tensorflow",
    "paddle",
    "onnxruntime",
    "openvino",
    "mxnet",
    "cupy",
    "triton",
    "tinygrad",
)


def fork_problem(memory_limit=None) -> str | None:
    """Why a worker cannot be forked from this process now (None: it can)."""
    if os.environ.get(FORK_VARIABLE, "").strip().lower() in ("0", "off", "no", "false"):
        return f"{FORK_VARIABLE} is off"
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return "forking is used on Linux only"
    if memory_limit:
        return "a memory limit must hold while the worker imports its modules"
    if threading.active_count() != 1:
        return "this process runs other threads"
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    if parallel is not None and getattr(parallel, "_is_initialized", True):
        return "numba's threading layer has started"
    loaded = [name for name in _THREAD_POOLS if name in sys.modules]
    if loaded:
        return f"{loaded[0]} is imported (its thread pools do not survive a fork)"
    return None


class ForkedProcess:
    """The forked child, with the part of :class:`subprocess.Popen`'s interface the supervisor
    uses (``poll``, ``wait``, ``kill``, ``returncode``: negative for a signal)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                self.returncode = 1
            else:
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, once the child has exited (within ``timeout`` seconds, else
        :class:`subprocess.TimeoutExpired`). The wait ends as the child exits (a Linux
        process descriptor); elsewhere it polls, at most 0.05 s apart."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            if _exit_within(self.pid, left) is None:  # no process descriptor: poll
                time.sleep(delay if left is None else min(delay, left))
                delay = min(delay * 2, 0.05)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _exit_within(pid: int, timeout: float | None) -> bool | None:
    """Whether the child ``pid`` exits within ``timeout`` seconds (None: no limit), told by
    the kernel as it happens (``os.pidfd_open``, Linux >= 5.3); None where there is no
    process descriptor (another OS, an old kernel, a child already reaped)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(None if timeout is None else max(timeout, 0.0) * 1000.0))
    finally:
        os.close(fd)


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep the memory this process frees for its next allocations
    (blocks up to 256 MB from the heap, up to 1 GB of freed memory kept), instead of returning
    each large block to the system as it is freed; False where there is no ``mallopt``.

    A worker judges one case after the other, each allocating its fixture's arrays and the
    implementation's temporaries afresh: with glibc's defaults every large block was a new
    mapping whose pages the kernel faulted in and zeroed again (about 105 000 page faults over
    the float32 cases of ``default`` with refattn-float64, against 33 000 with the memory
    kept). The implementation's arithmetic is unchanged; only where its arrays lie is.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's C library (glibc on Linux)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )


def fork_worker(serve, read_fd: int, write_fd: int, parent_fds, *arguments) -> ForkedProcess:
    """Fork a child that runs ``serve(read_fd, write_fd, *arguments)`` and exits; the
    parent's ends of the pipes (``parent_fds``) are closed in the child, so it sees the end of
    its requests when the parent goes away."""
    for stream in (sys.stdout, sys.stderr):  # nothing buffered is written twice
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    # the parent's objects frozen across the fork: the child's garbage collections skip them
    # instead of writing into every page it shares with the parent (its first full collection
    # copied them all, 0.07-0.1 s on a busy machine, inside whatever call it interrupted)
    gc.freeze()
    try:
        with warnings.catch_warnings():
            # Python >= 3.12 warns about a fork in a process with several OS threads: here
            # only native pools with fork handlers (OpenBLAS), fork_problem having checked
            # the rest
            warnings.filterwarnings("ignore", ".*multi-threaded.*fork", DeprecationWarning)
            pid = os.fork()
    except BaseException:
        gc.unfreeze()
        raise
    if pid:
        gc.unfreeze()  # the parent collects its objects as before
        return ForkedProcess(pid)
    code = 1
    try:  # pragma: no cover - the child (coverage does not follow a fork)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        atexit._clear()  # the parent's exit handlers are the parent's
        for fd in parent_fds:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        keep_freed_memory()  # the cases' arrays reuse the memory the previous ones freed
        serve(read_fd, write_fd, *arguments)
        atexit._run_exitfuncs()  # the implementation's own
        code = 0
    finally:  # pragma: no cover - the child never returns into the parent's code
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        os._exit(code)
