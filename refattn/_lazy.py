"""Names of a package imported on first access (PEP 562 module ``__getattr__``).

The packages whose modules import Numba (:mod:`refattn.kernels`, :mod:`refattn.exact.fast`)
re-export their names through :func:`exports`, so that ``import refattn`` and the NumPy paths do
not import Numba: its start-up (0.4 s) is paid by the first call that runs a kernel. The
package keeps its imports under ``if TYPE_CHECKING:`` too, for readers, type checkers and
:mod:`refattn._numba_cache`'s import graph.
"""

from __future__ import annotations

import importlib
import importlib.util

__all__ = ["exports", "module"]


def exports(package: str, homes: dict[str, str]):
    """A module ``__getattr__`` and ``__dir__`` for ``package``: a name of ``homes`` (name ->
    relative module) is imported from its module on first access, any other name from the
    package's submodule of that name; both are then kept in the package's namespace.

    Parameters
    ----------
    package : str
        The package's ``__name__``.
    homes : dict of str to str
        Each re-exported name and the module (relative to ``package``) that defines it.

    Returns
    -------
    (callable, callable)
        The package's ``__getattr__`` and ``__dir__``.

    Examples
    --------
    >>> getattr_, dir_ = exports("json", {"loads": ".decoder"})
    >>> "loads" in dir_()
    True
    """
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name):
        home = homes.get(name)
        if home is not None:
            value = getattr(importlib.import_module(home, package), name)
        elif not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}"):
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return namespace.setdefault(name, value)

    def __dir__():
        return sorted(set(namespace) | set(homes))

    return __getattr__, __dir__


class module:  # noqa: N801 - used as a module
    """A module imported on its first attribute access: ``exact = module("refattn.exact.logspace")``
    at the top of a module whose float64 path never needs it, ``exact.softmax(...)`` in its
    exact path. The exact engine's modules load mpmath (a fifth of ``import refattn``), which
    no float64 call uses.

    Examples
    --------
    >>> fractions = module("fractions")
    >>> fractions.Fraction(1, 3) + fractions.Fraction(1, 6)
    Fraction(1, 2)
    """

    __slots__ = ("_name",)

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute):
        return getattr(importlib.import_module(self._name), attribute)

    def __repr__(self) -> str:
        return f"<refattn._lazy.module {self._name!r}>"
