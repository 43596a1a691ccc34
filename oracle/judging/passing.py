"""What an implementation under test is handed and offers: which of a case's options it receives
(:func:`passed_options`) and its vector-Jacobian product (:func:`vjp_of`)."""

from __future__ import annotations

import functools
import inspect
import sys
import weakref

import numpy as np

from oracle.conventions.signatures import function_defaults
from refattn.attention import attention

__all__ = ["passed_options", "vjp_of"]


@functools.cache
def _refattn_defaults() -> dict:
    parameters = inspect.signature(attention).parameters.items()
    return {
        name: p.default
        for name, p in parameters
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not p.empty
    }


def passed_options(options, impl=None) -> dict:
    """The options an implementation receives: those equal to :func:`refattn.attention`'s
    defaults are left out (the implementation's own defaults then apply), so a function that
    follows the calling convention but lacks a keyword (``align``, ``gqa``, ``empty_rows``...)
    is still judged on every case that uses that keyword's default. A keyword ``impl``'s
    signature declares with another default (``align="bottom_right"``) is compared with that
    default instead (:func:`oracle.conventions.signatures.function_defaults`)."""
    defaults = {**_refattn_defaults(), **_declared_defaults(impl)}
    return {
        name: np.copy(x) if isinstance(x, np.ndarray) else x
        for name, x in options.items()
        if isinstance(x, np.ndarray)
        or name not in defaults
        or type(x) is not type(defaults[name])
        or x != defaults[name]
    }


#: :func:`function_defaults` of the implementations seen (their signatures are read once, not
#: on every case: 0.3-0.8 ms a case)
_DECLARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _declared_defaults(impl) -> dict:
    try:
        return _DECLARED[impl]
    except (KeyError, TypeError):  # not seen, or not weakly referenceable (read each time)
        pass
    found = function_defaults(impl)
    try:
        _DECLARED[impl] = found
    except TypeError:
        pass
    return found


def vjp_of(impl):
    """``impl.vjp``, or for a plain function ``f`` the ``f_vjp`` beside it: in its module or,
    for a function defined in a package's private module (``refattn.gmm._forward``), in the
    nearest enclosing package that has one (``refattn.gmm.attention_vjp``); None without one."""
    vjp = getattr(impl, "vjp", None)
    if vjp is not None:
        return vjp
    name = getattr(impl, "__name__", None)
    parts = (getattr(impl, "__module__", None) or "").split(".")
    while name and parts and parts[0]:
        found = getattr(sys.modules.get(".".join(parts)), f"{name}_vjp", None)
        if found is not None:
            return found
        parts.pop()
    return None
