"""Which of a case's options an implementation receives (:func:`passed_options`)."""

from __future__ import annotations

import inspect

import numpy as np

from oracle.conventions.signatures import function_defaults
from refattn.attention import attention

__all__ = ["passed_options"]


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
    defaults = {**_refattn_defaults(), **function_defaults(impl)}
    return {
        name: np.copy(x) if isinstance(x, np.ndarray) else x
        for name, x in options.items()
        if isinstance(x, np.ndarray)
        or name not in defaults
        or type(x) is not type(defaults[name])
        or x != defaults[name]
    }
