"""Golden fixtures in the formats other harnesses read: safetensors, ONNX, FlashInfer-Trace.

``oracle.export(format, fixtures, out)`` (and ``refattn-oracle export --format F --fixtures DIR
--out DIR``) reads a fixture directory written by :func:`oracle.generate` one case at a time
and writes ``out``:

``"safetensors"`` (:mod:`oracle.export.safetensors_format`)
    ``<case>.safetensors`` per case, native bfloat16/float16/float8 tensors, the case spec and
    the precision contract in the metadata; :func:`load_safetensors` reads them back as NumPy
    arrays or as torch tensors on a device.
``"onnx"`` (:mod:`oracle.export.onnx_format`)
    an ONNX backend-test folder (``model.onnx`` + ``test_data_set_0/``) per case one
    ``Attention`` node (opset 24) can state, expected output = refattn's exact one.
``"flashinfer-trace"`` (:mod:`oracle.export.flashinfer_format`)
    FlashInfer-Trace definitions, workloads (safetensors blobs) and the exact outputs.

Every format writes ``export.json`` last: the precision contract, counts and one entry per
case, either its files or ``"skipped"``: why the target cannot state the case (never exported
under other semantics). Writes are atomic as in :func:`oracle.fixtures.golden.generate`.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

from oracle.export._driver import EXPORT_MANIFEST, ExportError, run_export
from oracle.export.safetensors_format import load_safetensors

__all__ = ["export", "FORMATS", "ExportError", "EXPORT_MANIFEST", "load_safetensors"]

#: format name -> module holding its ``FORMAT``.
FORMATS = {
    "safetensors": "oracle.export.safetensors_format",
    "onnx": "oracle.export.onnx_format",
    "flashinfer-trace": "oracle.export.flashinfer_format",
}


def export(format: str, fixtures, out, *, names=None, progress: bool = True, check=True) -> Path:
    """Export the fixture directory ``fixtures`` to ``out`` in ``format``; return ``out``.

    Parameters
    ----------
    format : {"safetensors", "onnx", "flashinfer-trace"}
    fixtures : path
        A directory written by :func:`oracle.generate` (its sha256s are checked).
    out : path
        Created if missing; must not be ``fixtures``.
    names : iterable of str, optional
        Only these cases.
    progress : bool
        Progress bar on stderr.
    check : bool
        Compare each fixture's sha256 with its manifest while reading.

    Raises
    ------
    ExportError
        (a ValueError) for an unknown format, a missing package, a bad fixture directory or
        an unusable destination; one line naming the problem.

    Examples
    --------
    >>> import tempfile, oracle
    >>> from oracle import catalogue
    >>> fixtures = oracle.generate("smoke", tempfile.mkdtemp(), progress=False,
    ...                            cases=[catalogue.get("basic-H2K2-L5S7-D8E8-f16")])
    >>> out = oracle.export("safetensors", fixtures, tempfile.mkdtemp(), progress=False)
    >>> sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    ['basic-H2K2-L5S7-D8E8-f16.safetensors', 'export.json']
    """
    if format not in FORMATS:
        raise ExportError(f"format: expected one of {sorted(FORMATS)}, got {format!r}")
    try:
        module = importlib.import_module(FORMATS[format])
    except ImportError as exc:
        raise ExportError(
            f"format {format!r} needs the package {exc.name!r} (pip install 'refattn[export]')"
        ) from None
    return run_export(module.FORMAT, fixtures, out, names=names, progress=progress, check=check)


class _CallableModule(types.ModuleType):
    """``oracle.export`` is both this package and the function (as ``oracle.run.validate``)."""

    def __call__(self, format, fixtures, out, **kwargs) -> Path:
        return export(format, fixtures, out, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
