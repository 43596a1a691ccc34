"""Fixtures as safetensors: one ``<case>.safetensors`` per case, native dtypes.

Each file holds the fixture's arrays under the ``.npz`` member names (``inputs/q``,
``truth/out``, ``truth/out_f64``...) in their own dtypes -- ``BF16``, ``F16``, ``F8_E4M3``,
``F8_E5M2``, ``F32``, ``F64``, ``BOOL``, ``I32`` -- never as integer bit views, and in
``__metadata__`` (string to string, as the format requires) the case spec (``case``, JSON),
the implementation keywords (``options``, JSON), the precision contract
(``precision_contract``, JSON: truth = exact real result rounded once to the stored dtype,
ties to even; conventions and refattn versions) and ``format = refattn-fixture/1``.

The bytes are written here (the format is an 8-byte little-endian header length, a JSON
header, then the raw little-endian tensor bytes; huggingface/safetensors README, "Format"):
``safetensors.numpy`` cannot name bfloat16 or float8 (it has no NumPy dtype for them), so the
writer and the NumPy reader need no package, and the bytes are a pure function of the fixture
(sorted keys, tensors ordered by item size then name, header padded to 8 bytes). Any
safetensors reader loads them; :func:`load_safetensors` with ``framework="torch"`` uses
``safetensors.torch`` and puts the tensors on the device.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from oracle.catalogue.case import Case
from oracle.export._driver import EXPORT_MANIFEST, ExportError, Format, precision_contract
from oracle.fixtures import atomic as _atomic
from oracle.fixtures import golden

__all__ = [
    "FORMAT",
    "safetensors_bytes",
    "read_safetensors",
    "read_metadata",
    "load_safetensors",
]

FILE_FORMAT = "refattn-fixture/1"

#: NumPy / ml_dtypes name -> safetensors dtype tag.
_TAGS = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
_DTYPES = {tag: name for name, tag in _TAGS.items()}


def _numpy_dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def safetensors_bytes(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    """The bytes of a safetensors file holding ``tensors`` (native dtypes) and ``metadata``.

    Examples
    --------
    >>> import ml_dtypes, numpy as np
    >>> data = safetensors_bytes({"x": np.ones(3, ml_dtypes.bfloat16)}, {"k": "v"})
    >>> tensors, meta = read_safetensors(data)
    >>> tensors["x"].dtype.name, meta
    ('bfloat16', {'k': 'v'})
    """
    arrays = {name: np.ascontiguousarray(a) for name, a in tensors.items()}
    # largest items first keeps every tensor aligned to its item size (as safetensors does)
    order = sorted(arrays, key=lambda n: (-arrays[n].dtype.itemsize, n))
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    chunks, offset = [], 0
    for name in order:
        array = arrays[name]
        if array.dtype.name not in _TAGS:
            raise TypeError(f"safetensors: unsupported dtype {array.dtype} for {name!r}")
        data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {
            "dtype": _TAGS[array.dtype.name],
            "shape": [int(n) for n in array.shape],
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def read_safetensors(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of safetensors bytes, as NumPy / ml_dtypes arrays (no package)."""
    if len(data) < 8:
        raise ExportError("safetensors: file shorter than its 8-byte header length")
    (length,) = struct.unpack("<Q", data[:8])
    if length > len(data) - 8:
        raise ExportError(f"safetensors: header length {length} exceeds the file")
    header = json.loads(data[8 : 8 + length])
    metadata = header.pop("__metadata__", {}) or {}
    body = memoryview(data)[8 + length :]
    tensors = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ExportError(f"safetensors: {name!r} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        dtype = _numpy_dtype(_DTYPES[info["dtype"]])
        flat = np.frombuffer(body[begin:end], dtype=dtype.newbyteorder("<"))
        tensors[name] = flat.astype(dtype).reshape(info["shape"])
    return tensors, metadata


def fixture_tensors(fixture: golden.Fixture) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A fixture's arrays (``inputs/<name>``, ``truth/<name>``) and its metadata strings."""
    tensors = {f"inputs/{k}": v for k, v in fixture.inputs.items()}
    tensors.update({f"truth/{k}": v for k, v in fixture.truth.items()})
    spec = fixture.case.spec()
    metadata = {
        "format": FILE_FORMAT,
        "case": json.dumps(spec, sort_keys=True, separators=(",", ":")),
        "options": json.dumps(spec["options"], sort_keys=True, separators=(",", ":")),
        "precision_contract": json.dumps(precision_contract(fixture.truth_kind), sort_keys=True),
    }
    return tensors, metadata


def _write(fixture: golden.Fixture, staging: Path, out: Path) -> dict:
    data = safetensors_bytes(*fixture_tensors(fixture))
    file_name = f"{fixture.name}.safetensors"
    _atomic.write_atomic(out / file_name, data)
    return {
        "name": fixture.name,
        "dtype": fixture.case.dtype,
        "files": [file_name],
        "bytes": len(data),
    }


FORMAT = Format("safetensors", _write)


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _files(path: Path, names: Iterable[str] | None) -> list[Path]:
    if path.is_file():
        return [path]
    manifest_path = path / EXPORT_MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"load_safetensors: {manifest_path}: unreadable ({exc})") from None
    if manifest.get("format") != "safetensors":
        raise ExportError(
            f"load_safetensors: {manifest_path} is a {manifest.get('format')!r} export"
        )
    entries = [e for e in manifest["cases"] if e.get("skipped") is None]
    if names is not None:
        wanted = {names} if isinstance(names, str) else set(names)
        unknown = wanted - {e["name"] for e in entries}
        if unknown:
            raise KeyError(f"load_safetensors: no case named {sorted(unknown)} in {path}")
        entries = [e for e in entries if e["name"] in wanted]
    files = []
    for entry in entries:
        (file_name,) = entry["files"]
        if golden.file_name_problem(file_name.removesuffix(".safetensors") + ".npz"):
            raise ExportError(f"load_safetensors: {manifest_path}: bad file entry {file_name!r}")
        files.append(path / file_name)
    return files


def _torch_tensors(path: Path, device) -> dict:
    try:
        # optional packages (export and torch extras)
        from safetensors.torch import load_file
    except ImportError:
        raise ExportError(
            "load_safetensors: framework='torch' needs the safetensors and torch packages "
            "(pip install 'refattn[export,torch]')"
        ) from None
    return load_file(str(path), device=str(device))


def load_safetensors(
    path, *, framework: str = "numpy", device="cpu", names: Iterable[str] | None = None
) -> Iterator[golden.Fixture]:
    """Yield the exported fixtures in ``path`` (an export directory or one file).

    Parameters
    ----------
    path : path
        A directory written by ``refattn-oracle export --format safetensors`` or one
        ``.safetensors`` file of it.
    framework : {"numpy", "torch"}
        NumPy / ml_dtypes arrays (no package needed), or torch tensors (bfloat16, float8 and
        bool natively) on ``device``, ready to pass to a kernel.
    device : str or torch.device
        Where torch tensors are put ("cpu", "cuda", "cuda:1"...).
    names : iterable of str, optional
        Only these cases (directory only).

    Returns
    -------
    Iterator of :class:`oracle.fixtures.golden.Fixture` whose ``inputs``, ``truth`` and array
    ``options`` are of ``framework``.

    Examples
    --------
    >>> import tempfile, oracle
    >>> from oracle import catalogue
    >>> from oracle.fixtures import golden
    >>> fixtures = golden.generate("smoke", tempfile.mkdtemp(), progress=False,
    ...                            cases=[catalogue.get("basic-H2K2-L5S7-D8E8-bf16")])
    >>> out = oracle.export("safetensors", fixtures, tempfile.mkdtemp(), progress=False)
    >>> fixture = next(load_safetensors(out))
    >>> fixture.inputs["q"].dtype.name, fixture.truth["out"].shape
    ('bfloat16', (1, 2, 5, 8))
    """
    if framework not in ("numpy", "torch"):
        raise ExportError(f"framework: expected 'numpy' or 'torch', got {framework!r}")
    for file in _files(Path(path), names):
        if framework == "torch":
            tensors, metadata = _torch_tensors(file, device), read_metadata(file)
        else:
            tensors, metadata = read_safetensors(file.read_bytes())
        if metadata.get("format") != FILE_FORMAT:
            raise ExportError(f"load_safetensors: {file.name}: not a refattn fixture file")
        case = Case.from_spec(json.loads(metadata["case"]))
        inputs = {k.split("/", 1)[1]: t for k, t in tensors.items() if k.startswith("inputs/")}
        truth = {k.split("/", 1)[1]: t for k, t in tensors.items() if k.startswith("truth/")}
        contract = json.loads(metadata["precision_contract"])
        yield golden.Fixture(
            case=case,
            inputs=inputs,
            options=golden.call_options(case, inputs),
            truth=truth,
            truth_kind=contract["truth_kind"],
        )


def read_metadata(file) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (reads the header only)."""
    with open(file, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length)).get("__metadata__", {}) or {}
