"""Fixtures read in a thread while the first cases are judged.

:func:`oracle.run.validate.validate` over a fixture directory used to read every selected
fixture before the first case was sent to the worker (1.2 s for the 235 float32 fixtures of
``default``, more on a busy machine), while the worker, already started, waited.
:class:`Prefetched` reads them in a thread, in order, and hands each to the run as soon as it
is read: the run waits only when it is ahead of the reading. Its length is known from the
manifest before anything is read. A file that cannot be read raises its
:class:`~oracle.fixtures.golden.FixtureError` when the run reaches it (the cases before it are
judged by then; the run stops there, as a run that read it first would have stopped).

Examples
--------
>>> items = Prefetched(iter(range(3)), 3)
>>> len(items), list(items), list(items)
(3, [0, 1, 2], [0, 1, 2])
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

__all__ = ["Prefetched"]


class Prefetched:
    """The items of ``source`` (``count`` of them), read by a thread from construction on.

    Iterating (any number of times) yields them in order, waiting for each as needed; an
    exception of ``source`` is raised where its item would have come. ``pause``: called by
    the thread before it reads each item (a worker waits there while the implementation runs:
    :func:`oracle.judging.quiet.wait_quiet`).
    """

    def __init__(self, source: Iterator, count: int, pause=None):
        self._count = int(count)
        self._pause = pause
        self._items: list = []
        self._error: BaseException | None = None
        self._done = False
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(source,), daemon=True)
        self._thread.start()

    def _read(self, source) -> None:
        try:
            for item in self._paced(source):
                with self._ready:
                    self._items.append(item)
                    self._ready.notify_all()
        except BaseException as exc:  # noqa: BLE001 - raised again where the run reaches it
            with self._ready:
                self._error = exc
        finally:
            with self._ready:
                self._done = True
                self._ready.notify_all()

    def _paced(self, source):
        """The items of ``source``, each read after ``pause()`` returned (when given)."""
        items = iter(source)
        while True:
            if self._pause is not None:
                self._pause()
            try:
                yield next(items)
            except StopIteration:
                return

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self):
        index = 0
        while True:
            with self._ready:
                self._ready.wait_for(lambda i=index: i < len(self._items) or self._done)
                if index < len(self._items):
                    item = self._items[index]
                elif self._error is not None:
                    raise self._error
                else:
                    return
            yield item
            index += 1
