"""How arrays are handed to compiled kernels: one array type per kernel argument.

Numba compiles one specialisation per combination of its arguments' types, and an array's type
includes its layout and whether it is writeable. The Numba CPU kernels (:mod:`refattn.kernels`)
and the exact engine's compiled passes (:mod:`refattn.exact.fast`) take every array they only
read through :func:`read_only`, so each compiles once per dtype whatever the caller passed
(memory-mapped fixtures, broadcast views, arrays of its own), and no input is copied just to
make it writeable.
"""

from __future__ import annotations

__all__ = ["read_only"]


def read_only(array):
    """A read-only view of ``array`` (no copy).

    The kernels only read their inputs: passing every input as a read-only view gives Numba
    one array type whatever the caller's flags (one compiled specialisation), and never copies
    an input just to make it writeable.

    Examples
    --------
    >>> import numpy as np
    >>> a = np.arange(3.0)
    >>> view = read_only(a)
    >>> view.flags.writeable, a.flags.writeable, np.shares_memory(a, view)
    (False, True, True)
    """
    view = array.view()
    view.flags.writeable = False
    return view
