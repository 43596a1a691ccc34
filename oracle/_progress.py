"""A small dependency-free progress bar on stderr (skeleton)."""

from __future__ import annotations

__all__ = ["Progress"]


class Progress:
    """``with Progress(total, label) as bar: bar.advance(note)``."""

    def __init__(self, total: int, label: str = "", *, enabled: bool = True, stream=None):
        self.total, self.label, self.enabled, self.stream = total, label, enabled, stream
        self.done = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def advance(self, note: str = "", n: int = 1) -> None:
        self.done += n
