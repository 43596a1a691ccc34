"""A small dependency-free progress bar on stderr.

On a terminal the bar redraws one line (``\\r``); elsewhere (CI logs, pipes) it prints a line
at every tenth of the work so logs stay short. Disabled bars print nothing.

Examples
--------
>>> import io
>>> stream = io.StringIO()
>>> with Progress(2, "demo", stream=stream) as bar:
...     bar.advance("first")
...     bar.advance("second")
>>> "2/2" in stream.getvalue()
True
"""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]

_WIDTH = 28


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

    def _line(self, note: str) -> str:
        fraction = self.done / self.total if self.total else 1.0
        filled = int(round(_WIDTH * fraction))
        elapsed = time.monotonic() - self._start
        eta = elapsed / fraction - elapsed if 0 < fraction < 1 else 0.0
        bar = "#" * filled + "." * (_WIDTH - filled)
        tail = f"{_clock(elapsed)} elapsed" + (f", ~{_clock(eta)} left" if fraction < 1 else "")
        line = f"{self.label} [{bar}] {self.done}/{self.total} {tail}"
        if note:
            line += f"  {note[:48]}"
        return line.ljust(100) if self._tty else line
