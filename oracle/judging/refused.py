"""An implementation's refusal of a case: "unsupported" with its message, not "error".

A kernel that cannot take a shape or an option often says so with the exception its framework
uses for bad arguments (``ValueError: head dim of q and v must match``, ``RuntimeError:
FlashAttention only supports head dimension at most 256``) rather than NotImplementedError.
:func:`as_refusal` reads such an exception as a refusal, and
:func:`oracle.judging.judge.call_forward`
then raises NotImplementedError("refused by the implementation: <Type>: <message>"): the case
is "unsupported" (never a pass), listed in the report's unsupported table with the message and
counted as refused. The rule, all three conditions:

1. raised while calling the implementation's forward, so before any output exists (a wrong
   output, a wrong shape or NaN is judged as always: "fail");
2. raised by the implementation itself: the innermost Python frame of its traceback is not the
   oracle's own code (the conversions of :mod:`oracle.conventions.layouts` and
   :mod:`oracle.conventions.signatures`, the judge); adapters (:mod:`oracle.adapters`) count as
   implementations;
3. of type ValueError, RuntimeError, TypeError (other than a refused keyword, handled by the
   judge already) or AssertionError, with a message that reads as a refusal
   (:data:`REFUSAL_PATTERN`: "not supported", "unsupported", "not implemented", "only
   supports", "does not support", "must be", "must match", "must equal", "must divide", "must
   have", "should be", "cannot handle", "is not allowed", "too large" / "too long" ...).

Frameworks raise their own exception classes; they are recognised by class name and module
(the class or any base: its ``__module__``'s top package and ``__name__``), without importing
the framework (:data:`FRAMEWORK_REFUSALS`, :data:`FRAMEWORK_ARGUMENT_ERRORS`):

* classes that *mean* "not implemented" are a refusal whatever their message, like
  NotImplementedError: ONNX Runtime's ``NotImplemented``, Paddle's ``Unimplemented`` /
  ``UnimplementedError``, TensorFlow's ``UnimplementedError``;
* argument errors count as condition 3's types (a refusal when the message reads as one):
  ONNX Runtime's ``InvalidArgument`` and ``Fail`` ("head_size must be a multiple of 8"),
  Triton's ``InterpreterError`` and ``CompilationError`` (which wrap the kernel's own message,
  "Both operands must be same dtype", searched through the whole text and the exception's
  cause), Paddle's ``NotFound`` / ``InvalidArgument`` (and ``...Error``; "kernel ... is not
  registered"), TensorFlow's ``InvalidArgumentError``; JAX raises the built-in TypeError and
  ValueError from its shape checks (already condition 3's types).

Paddle also writes its error kind in the message, ``(Unimplemented) ...`` or ``(NotFound) ...``:
those tags count like the classes. The line shown is the first line of the message that reads as
a refusal (a compiler's error shows its source first).

NotImplementedError is "unsupported" as before, with its own message (the implementation said
so explicitly). Anything else (a crash, ``IndexError``, ``ZeroDivisionError``, a ValueError
with another message) stays "error". ``validate(..., refusals_are_errors=True)``
(``refattn-oracle validate --refusals-are-errors``) turns the refusals back into errors.

Examples
--------
>>> def refuses(q, k, v):
...     raise ValueError("head dim of q and v must match")
>>> try:
...     refuses(None, None, None)
... except ValueError as err:
...     print(as_refusal(err))
refused by the implementation: ValueError: head dim of q and v must match
>>> as_refusal(ZeroDivisionError("division by zero")) is None
True
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "REFUSED",
    "REFUSAL_PATTERN",
    "as_refusal",
    "framework_kind",
    "FRAMEWORK_REFUSALS",
    "FRAMEWORK_ARGUMENT_ERRORS",
    "refusing",
    "is_refusal",
    "refusals_as_errors",
]

#: The prefix of a refusal's message (the verdict is "unsupported").
REFUSED = "refused by the implementation"

#: Messages that read as a refusal (searched case-insensitively).
REFUSAL_PATTERN = re.compile(
    r"not (?:yet )?supported|\bunsupported\b|not (?:yet )?implemented|\bonly supports?\b"
    r"|\bsupports? only\b|\b(?:does not|doesn't|do not|don't|cannot|can't) (?:support|handle)"
    r"|\bmust (?:be|match|equal|divide|have)\b|\bshould (?:be|match|equal)\b"
    r"|\bis not allowed\b|\bnot allowed\b|\btoo (?:large|long|big|small)\b"
    r"|\bis not registered\b|\(unimplemented\)",
    re.IGNORECASE,
)

#: (top package, class name) of framework exceptions that mean "not implemented": a refusal
#: whatever the message.
FRAMEWORK_REFUSALS = frozenset(
    {
        ("onnxruntime", "NotImplemented"),
        ("paddle", "Unimplemented"),
        ("paddle", "UnimplementedError"),
        ("tensorflow", "UnimplementedError"),
    }
)

#: (top package, class name) of framework argument errors: a refusal when the message reads as
#: one (:data:`REFUSAL_PATTERN`), like ValueError.
FRAMEWORK_ARGUMENT_ERRORS = frozenset(
    {
        ("onnxruntime", "InvalidArgument"),
        ("onnxruntime", "Fail"),
        ("triton", "InterpreterError"),
        ("triton", "CompilationError"),
        ("paddle", "NotFound"),
        ("paddle", "NotFoundError"),
        ("paddle", "InvalidArgument"),
        ("paddle", "InvalidArgumentError"),
        ("tensorflow", "InvalidArgumentError"),
    }
)

_TYPES = (ValueError, RuntimeError, TypeError, AssertionError)
_ORACLE = Path(__file__).resolve().parents[1]  # the oracle package, not this stage's folder
_IMPLEMENTATIONS = _ORACLE / "adapters"


def _innermost_file(err: BaseException) -> Path | None:
    tb = err.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename).resolve()


def _oracle_raised(err: BaseException) -> bool:
    """Whether the oracle's own code (not an adapter) raised ``err``."""
    where = _innermost_file(err)
    if where is None:
        return False
    inside = _ORACLE in where.parents
    return inside and _IMPLEMENTATIONS not in where.parents


def framework_kind(err: BaseException) -> str | None:
    """ "refusal" or "argument" for a framework exception class of the module docstring's
    tables (the class or one of its bases, read by top package and name), else None.

    >>> NotImplemented_ = type("NotImplemented", (Exception,), {"__module__": "onnxruntime.capi"})
    >>> framework_kind(NotImplemented_("no kernel for this dtype"))
    'refusal'
    """
    for cls in type(err).__mro__:
        key = ((cls.__module__ or "").split(".")[0], cls.__name__)
        if key in FRAMEWORK_REFUSALS:
            return "refusal"
        if key in FRAMEWORK_ARGUMENT_ERRORS:
            return "argument"
    return None


def _refusal_text(err: BaseException) -> str:
    """The exception's message and those of the exceptions it wraps (a compiler's error
    wraps the kernel's own)."""
    texts, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        texts.append(str(err).strip())
        err = err.__cause__ or err.__context__
    return "\n".join(t for t in texts if t)


def as_refusal(err: BaseException) -> NotImplementedError | None:
    """The NotImplementedError("refused by the implementation: ...") that ``err``, raised by
    an implementation's forward call, stands for, or None when it is no refusal (see the
    module's rule)."""
    kind = framework_kind(err)
    if (kind is None and not isinstance(err, _TYPES)) or _oracle_raised(err):
        return None
    text = _refusal_text(err)
    if kind != "refusal" and not REFUSAL_PATTERN.search(text):
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    said = [line for line in lines if REFUSAL_PATTERN.search(line)] or lines or [""]
    return NotImplementedError(f"{REFUSED}: {type(err).__name__}: {said[0]}".rstrip(": "))


@contextmanager
def refusing():
    """Raise an exception of the block that reads as a refusal (:func:`as_refusal`) as its
    NotImplementedError; any other passes unchanged.

    Examples
    --------
    >>> with refusing():
    ...     raise RuntimeError("only supports D <= 256")
    Traceback (most recent call last):
    ...
    NotImplementedError: refused by the implementation: RuntimeError: only supports D <= 256
    """
    try:
        yield
    except NotImplementedError:
        raise
    except Exception as err:  # noqa: BLE001 - re-raised unless it is a refusal
        refusal = as_refusal(err)
        if refusal is None:
            raise
        raise refusal from err


def is_refusal(result) -> bool:
    """Whether a :class:`~oracle.judging.results.CaseResult` is "unsupported" by a refusal."""
    return result.verdict == "unsupported" and (result.message or "").startswith(REFUSED)


def refusals_as_errors(results) -> None:
    """Turn the refusals among ``results`` into the verdict "error" (in place)."""
    for result in results:
        if is_refusal(result):
            result.verdict = "error"
