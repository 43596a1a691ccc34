"""A small dependency-free progress bar on stderr.

On a terminal the bar redraws one line (``\\r``); elsewhere (CI logs, pipes) it prints a line
at every tenth of the work so logs stay short. Disabled bars print nothing. :meth:`Progress.note`
shows what the current step is doing (a long diagnosis: "diagnosing <case>: reading 7 of 23",
with the steps left) on the bar's line; in logs at most one such line every
:data:`NOTE_EVERY` seconds.

Examples
--------
>>> import io
>>> stream = io.StringIO()
>>> with Progress(2, "demo", stream=stream) as bar:
...     bar.advance("first")
...     bar.advance("second")
>>> "2/2" in stream.getvalue()
True
>>> with Progress(3, "demo", stream=stream) as bar:
...     bar.note("diagnosing case-a")
>>> stream.getvalue().splitlines()[-1]
'demo [............................] 0/3  diagnosing case-a (3 left)'
"""

from __future__ import annotations

import sys
import threading
import time

__all__ = ["Progress"]

_WIDTH = 28
#: Seconds between two note lines in a log (not a terminal).
NOTE_EVERY = 10.0


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """``with Progress(total, label) as bar: bar.advance(note)``.

    Parameters
    ----------
    total : int
        Number of steps.
    label : str
        Shown before the bar.
    enabled : bool
        False makes every method a no-op.
    stream : file, optional
        Defaults to ``sys.stderr`` (looked up when the bar starts).
    """

    def __init__(self, total: int, label: str = "", *, enabled: bool = True, stream=None):
        self.total = max(int(total), 0)
        self.label = label
        self.enabled = enabled
        self.stream = stream
        self.done = 0
        self._start = 0.0
        self._reported_tenth = -1
        self._tty = False
        self._noted = -NOTE_EVERY
        self._lock = threading.Lock()  # notes may come from the threads of parallel workers
        self._written = 0  # length of the last note on a terminal: the next line covers it

    def __enter__(self) -> Progress:
        self.stream = self.stream or sys.stderr
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._start = time.monotonic()
        return self

    def __exit__(self, *exc) -> bool:
        if self.enabled and self._tty:
            self.stream.write("\n")
            self.stream.flush()
        return False

    def advance(self, note: str = "", n: int = 1) -> None:
        """Record ``n`` finished steps; ``note`` names the last one."""
        self.done = min(self.done + n, self.total)
        if not self.enabled or n == 0:
            return
        tenth = 10 * self.done // self.total if self.total else 10
        if not self._tty and tenth == self._reported_tenth and self.done != self.total:
            return
        self._reported_tenth = tenth
        self.stream.write(
            ("\r" if self._tty else "") + self._line(note) + ("" if self._tty else "\n")
        )
        self.stream.flush()

    def note(self, text: str) -> None:
        """Show what the current step is doing, with the number of steps left."""
        if not self.enabled:
            return
        now = time.monotonic()
        with self._lock:
            if not self._tty and now - self._noted < NOTE_EVERY:
                return
            self._noted = now
            left = self.total - self.done
            if self._tty:
                line = self._line("", width=0) + f"  {text[:72]} ({left} left)"
                self._written = len(line)
                self.stream.write("\r" + line)
            else:
                self.stream.write(f"{self.label} [{self._bar()}] {self.done}/{self.total}  ")
                self.stream.write(f"{text} ({left} left)\n")
            self.stream.flush()

    def _bar(self) -> str:
        fraction = self.done / self.total if self.total else 1.0
        filled = int(round(_WIDTH * fraction))
        return "#" * filled + "." * (_WIDTH - filled)

    def _line(self, note: str, width: int = 100) -> str:
        fraction = self.done / self.total if self.total else 1.0
        filled = int(round(_WIDTH * fraction))
        elapsed = time.monotonic() - self._start
        eta = elapsed / fraction - elapsed if 0 < fraction < 1 else 0.0
        bar = "#" * filled + "." * (_WIDTH - filled)
        tail = f"{_clock(elapsed)} elapsed" + (f", ~{_clock(eta)} left" if fraction < 1 else "")
        line = f"{self.label} [{bar}] {self.done}/{self.total} {tail}"
        if note:
            line += f"  {note[:48]}"
        return line.ljust(max(width, self._written if width else 0)) if self._tty else line
