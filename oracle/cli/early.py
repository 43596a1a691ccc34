"""``refattn-oracle validate`` starts its worker before the command line's own imports.

Importing the command line (:mod:`oracle.cli`: refattn, NumPy, Numba, SciPy) takes 2-3 s on
a busy machine, and so does the supervised worker's start (:mod:`oracle.run.supervise`: the
same imports, then the implementation). This module, imported first by :mod:`oracle.cli`,
starts the worker at once (:func:`oracle.run.supervise.preload_worker`) when the process is the
command line running ``validate`` in a worker (no ``--in-process``, ``--memory-limit``,
``--executor``, ``--merge-convention`` or ``--help``), so both load side by side. Anything
else that imports :mod:`oracle.cli` starts nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

from oracle.run.supervise import preload_worker

__all__ = ["wanted"]

_NOT_PRELOADED = ("--in-process", "--memory-limit", "--executor", "--merge-convention")


def wanted(argv) -> bool:
    """Whether ``argv`` (``sys.argv``) is the command line's isolated ``validate``.

    Examples
    --------
    >>> wanted(["refattn-oracle", "validate", "--adapter", "refattn-float64"])
    True
    >>> wanted(["pytest", "validate"]), wanted(["refattn-oracle", "validate", "--in-process"])
    (False, False)
    """
    if len(argv) < 2 or argv[1] != "validate":
        return False
    program = Path(argv[0]).name
    if program != "refattn-oracle" and not argv[0].endswith(
        ("oracle/__main__.py", "cli/__main__.py")
    ):
        return False
    flags = {word.split("=", 1)[0] for word in argv[2:]}
    return not flags & {*_NOT_PRELOADED, "-h", "--help"}


if wanted(sys.argv):
    preload_worker()
