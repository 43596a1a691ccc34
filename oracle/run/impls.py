"""Resolving the implementation under test: a callable, ``"module:function"`` or an adapter
name (shared by :mod:`oracle.run.validate` and the worker processes of
:mod:`oracle.run.supervise`)."""

from __future__ import annotations

import importlib
import importlib.util

from oracle import adapters

__all__ = ["resolve_impl", "callable_spec", "is_module_spec", "locate_impl", "adapter_located"]


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
        return adapters.get(impl), None
    module_name, attr = _split(impl)
    obj = _import(module_name, impl)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except Exception:  # noqa: BLE001 - a module __getattr__ may raise anything
            raise AttributeError(
                f"impl: module {module_name!r} has no attribute {attr!r} (from {impl!r})"
            ) from None
    if not callable(obj):
        raise TypeError(f"impl: {impl!r} is a {type(obj).__name__}, not a callable")
    return obj, impl


def _split(impl: str) -> tuple[str, str]:
    module_name, _, attr = impl.partition(":")
    if not module_name or not attr:
        raise ValueError(f"impl: {impl!r} is not of the form 'module:function'")
    return module_name, attr


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _import(module_name: str, impl: str):
    """Import the module of ``impl``; whatever its import does wrong is an ImportError with a
    one-line message (an exception, a SyntaxError, or ``sys.exit()`` at import, which would
    otherwise end the caller's process, with rc 0 for ``sys.exit(0)``). KeyboardInterrupt
    (a real Ctrl-C) is not caught."""
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(
            f"impl: cannot import module {module_name!r} of {impl!r}: {_first_line(err)} "
            f"(is it on sys.path / PYTHONPATH?)"
        ) from err
    except SystemExit as err:
        raise ImportError(
            f"impl: importing module {module_name!r} of {impl!r} called exit({err.code!r})"
        ) from None
    except Exception as err:  # noqa: BLE001 - any error of the user's module, on one line
        raise ImportError(
            f"impl: importing module {module_name!r} of {impl!r} raised "
            f"{type(err).__name__}: {_first_line(err)}"
        ) from err


def is_module_spec(impl) -> bool:
    """Whether ``impl`` is a ``"module:function"`` string (not an adapter name or callable)."""
    return isinstance(impl, str) and ":" in impl


def locate_impl(impl) -> None:
    """Check ``impl`` without running any of the user's code: the form of a
    ``"module:function"`` string and that its top-level module exists on ``sys.path``, or an
    adapter name (:func:`oracle.adapters.get`). Raises what :func:`resolve_impl` raises.

    The supervised worker imports the module itself (:mod:`oracle.run.supervise`), so a module
    that exits, crashes or hangs at import cannot end or stall the calling process.

    Examples
    --------
    >>> locate_impl("no_such_module_xyz:attention")
    Traceback (most recent call last):
    ...
    ImportError: impl: cannot import module 'no_such_module_xyz' ...
    """
    if not is_module_spec(impl):
        if not adapter_located(impl):
            resolve_impl(impl)
        return
    module_name, _ = _split(impl)
    top = module_name.partition(".")[0]
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):  # a relative or malformed name
        found = False
    if not found:
        raise ImportError(
            f"impl: cannot import module {module_name!r} of {impl!r}: no module named "
            f"{top!r} (is it on sys.path / PYTHONPATH?)"
        )


def adapter_located(impl) -> bool:
    """Whether ``impl`` names an adapter whose peer package is installed, found without
    importing it (the supervised worker imports it; the caller need not pay for torch too).

    Examples
    --------
    >>> adapter_located("refattn-float64"), adapter_located("mypkg:attention")
    (True, False)
    """
    entry = adapters._REGISTRY.get(impl) if isinstance(impl, str) else None
    if entry is None or entry.probe:
        return False
    try:
        return importlib.util.find_spec(entry.peer.partition(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def callable_spec(impl):
    module = getattr(impl, "__module__", None)
    qualname = getattr(impl, "__qualname__", None)
    if module and qualname and "<" not in qualname and module != "__main__":
        return f"{module}:{qualname}"
    return None
