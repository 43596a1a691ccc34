"""Resolving the implementation under test: a callable, ``"module:function"`` or an adapter
name (shared by :mod:`oracle.validate` and the worker processes of :mod:`oracle.supervise`)."""

from __future__ import annotations

import importlib

__all__ = ["resolve_impl", "callable_spec"]


def resolve_impl(impl):
    """A callable from a callable, ``"module:function"`` (dots allowed after the colon) or an
    adapter name (:func:`oracle.adapters.get`). Returns ``(callable, spec_string_or_None)``."""
    if callable(impl):
        return impl, callable_spec(impl)
    if not isinstance(impl, str):
        raise TypeError(
            f"impl: expected a callable, 'module:function' or an adapter name, "
            f"got {type(impl).__name__}"
        )
    if ":" not in impl:
        from . import adapters

        return adapters.get(impl), None
    module_name, _, attr = impl.partition(":")
    if not module_name or not attr:
        raise ValueError(f"impl: {impl!r} is not of the form 'module:function'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(
            f"impl: cannot import module {module_name!r} of {impl!r}: {err} "
            f"(is it on sys.path / PYTHONPATH?)"
        ) from err
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AttributeError(
                f"impl: module {module_name!r} has no attribute {attr!r} (from {impl!r})"
            ) from None
    if not callable(obj):
        raise TypeError(f"impl: {impl!r} is a {type(obj).__name__}, not a callable")
    return obj, impl


def callable_spec(impl):
    module = getattr(impl, "__module__", None)
    qualname = getattr(impl, "__qualname__", None)
    if module and qualname and "<" not in qualname and module != "__main__":
        return f"{module}:{qualname}"
    return None
