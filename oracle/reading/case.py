"""The oracle's one reading of an attention fixture: :class:`CaseView`, built once per fixture.

Every part of the oracle that judges or explains an attention output -- the judge
(:mod:`oracle.judging.judge`), the baseline (:mod:`oracle.reading.baseline`), the tolerance
policy's floors and scales (:mod:`oracle.judging.tolerance`) and the diagnoses
(:mod:`oracle.diagnose.diagnosis`) -- reads the case through one view instead of re-deriving
it from the raw ``(q, k, v, **options)``:

* the inputs at their exact values: float8 (and float4 with their block scales) q, k, v
  dequantised once (:func:`oracle.reading.baseline.dequantised_inputs`), the options without
  ``return_lse``, the descales and the block scales;
* the case's shapes by the conventions' letters ``B H K G L S D E`` (:attr:`CaseView.shapes`);
* derived data, each computed on first use and then kept: the float64 textbook
  (:attr:`CaseView.exact64`: weights, lse, the allowed set -- sparse key indices read as
  their set and ``qv`` folded as :func:`oracle.reading.baseline.textbook_attention` reads
  them), the post-dropout weights, the score magnitudes ``a_ij`` (T4) and the signed scaled
  dots ``s_ij`` (T6) of :mod:`oracle.judging.tolerance`, k and v expanded to the query heads.

The view is immutable: its fields cannot be rebound and its arrays are read-only views
(an implementation is always called on copies of the fixture's own arrays).

Examples
--------
>>> import numpy as np
>>> from oracle.catalogue import get
>>> from oracle.fixtures.golden import build
>>> view = read_case(build(get("basic-H2K2-L5S7-D8E8-f64")))
>>> view.shapes["H"], view.shapes["S"], view.exact64.weights.shape
(2, 7, (1, 2, 5, 7))
>>> view.q.flags.writeable
False
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import MappingProxyType

import numpy as np

from oracle.judging import tolerance as tol
from oracle.reading.baseline import Textbook, dequantised_inputs, textbook_attention
from oracle.reading.heads import with_heads
from refattn.broadcast import expand_kv

__all__ = ["CaseView", "read_case", "fixture_key", "loaded_key"]


def _frozen(x):
    """A read-only view of an array (the caller's array keeps its own flags)."""
    if isinstance(x, np.ndarray):
        x = x.view()
        x.flags.writeable = False
    return x


@dataclass(frozen=True, eq=False)
class CaseView:
    """One attention fixture as the oracle reads it (see the module docstring).

    Attributes
    ----------
    name, dtype : str
        The case's name and dtype (the storage and output dtype).
    q, k, v : ndarray
        (..., H, L, D), (..., K, S, D), (..., K, S, E) at their exact values (float64 for
        float8/float4 inputs, else as stored); read-only.
    options : mapping
        :func:`refattn.attention`'s keywords of the case (no ``return_lse``, no descales or
        block scales); read-only.
    shapes : mapping
        ``B H K G L S D E`` of the case (``B`` the number of batch rows, 1 without a batch
        axis; ``G = H / K``).
    single : bool
        q is 2-D (one head, no head axis).
    key : str
        sha256 of the fixture's content (case spec, inputs, options and truth): the identity
        under which its judging parts are kept (:mod:`oracle.judging.parts`).
    """

    name: str
    dtype: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    options: MappingProxyType
    shapes: MappingProxyType
    single: bool
    key: str

    @cached_property
    def exact64(self) -> Textbook:
        """The float64 textbook (:func:`oracle.reading.baseline.textbook_attention`)."""
        return textbook_attention(self.q, self.k, self.v, dtype="float64", **self.options)

    def textbook(self, dtype=None) -> Textbook:
        """The textbook in ``dtype`` (the case dtype by default): the baseline of (T2); each
        dtype's evaluated once."""
        dtype = self.dtype if dtype is None else str(dtype)
        if dtype not in self._textbooks:
            self._textbooks[dtype] = textbook_attention(
                self.q, self.k, self.v, dtype=dtype, **self.options
            )
        return self._textbooks[dtype]

    @cached_property
    def _textbooks(self) -> dict:
        return {}

    @cached_property
    def dropped(self) -> np.ndarray:
        """The float64 weights after dropout (``keep / (1 - p)``), (..., H, L, S)."""
        weights = self.exact64.weights
        if self.options.get("dropout_mask") is None:
            return weights
        keep = np.asarray(self.options["dropout_mask"], dtype=bool)
        return np.where(keep, weights, 0) / (1 - (self.options.get("dropout_p") or 0.0))

    @cached_property
    def magnitude(self) -> np.ndarray:
        """``a_ij`` of (T4) (:func:`oracle.judging.tolerance.score_magnitude`), (..., H, L, S)."""
        return tol.score_magnitude(self.q, self.k, **self.options)

    @cached_property
    def dots(self) -> np.ndarray:
        """Signed ``s_ij = scale q_i . k_j`` (:func:`oracle.judging.tolerance.scaled_dots`)."""
        return tol.scaled_dots(self.q, self.k, **self.options)

    @cached_property
    def allowed(self) -> np.ndarray:
        """The allowed set, broadcast to the weights' shape (..., H, L, S)."""
        return np.broadcast_to(self.exact64.allowed, self.exact64.weights.shape)

    @cached_property
    def n_stored(self) -> int:
        """Score stages stored in the case dtype: scores, softcap, bias or ALiBi (T4)."""
        options = self.options
        additive = options.get("bias") is not None or options.get("alibi_slopes") is not None
        return 1 + (options.get("softcap") is not None) + additive

    @cached_property
    def k_heads(self) -> np.ndarray:
        """k expanded to the query heads (GQA), (..., H, S, D)."""
        return expand_kv(with_heads(self.k, "k"), self.shapes["H"], self.gqa)

    @cached_property
    def v_heads(self) -> np.ndarray:
        """v expanded to the query heads (GQA), (..., H, S, E)."""
        return expand_kv(with_heads(self.v, "v"), self.shapes["H"], self.gqa)

    @property
    def gqa(self) -> str:
        """The grouped-query head mapping of the case ("interleave" unless pinned)."""
        return self.options.get("gqa") or "interleave"

    @property
    def sizes(self) -> dict:
        """``D S L E G``, as :func:`oracle.judging.tolerance.forward_floors` takes them."""
        return {n: self.shapes[n] for n in ("D", "S", "L", "E", "G")}


def _shapes(q, k, v) -> dict:
    q3, k3 = with_heads(q, "q"), with_heads(k, "k")
    H, L, D = q3.shape[-3:]
    K, S = k3.shape[-3], k3.shape[-2]
    batch = np.broadcast_shapes(q3.shape[:-3], k3.shape[:-3])
    return {
        "B": int(np.prod(batch)) if batch else 1,
        "H": H,
        "K": K,
        "G": max(H // K, 1),
        "L": L,
        "S": S,
        "D": D,
        "E": np.shape(v)[-1],
    }


def fixture_key(fixture) -> str:
    """sha256 of a fixture's content: its case spec and every input, option and truth array
    (dtype, shape and bytes). Two fixtures with the same key are judged the same way; a
    fixture changed in place gets a new key."""
    digest = hashlib.sha256(json.dumps(fixture.case.spec(), sort_keys=True).encode())
    for group, values in (
        ("inputs", fixture.inputs),
        ("options", fixture.options),
        ("truth", fixture.truth),
    ):
        for name in sorted(values):
            digest.update(f"{group}/{name}".encode())
            _update(digest, values[name])
    return digest.hexdigest()


#: the modules that turn a fixture file's bytes into its arrays (a change to any: new keys)
_LOADER_MODULES = (
    "oracle/fixtures/golden.py",
    "oracle/fixtures/npz.py",
    "oracle/fixtures/compact.py",
)


def _loader_version() -> str:
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for name in _LOADER_MODULES:
        path = root / name
        digest.update(name.encode() + (path.read_bytes() if path.is_file() else b"absent"))
    return digest.hexdigest()[:16]


_LOADER_VERSION = _loader_version()


def loaded_key(fixture) -> str:
    """The content key of a fixture just read by :func:`oracle.fixtures.golden.load` from a
    file whose sha256 it checked against the manifest (``verified_sha256``), without hashing
    its arrays again: its inputs and truth are that file's bytes as the loader reads them
    (a compact fixture's regenerated inputs are checked bit for bit against the hashes the
    file records, :mod:`oracle.fixtures.compact`), so the key hashes the file's sha256, the
    loader's source and the case spec, plus the options (derived from the case by the
    catalogue; an array option that is one of the inputs is named, not hashed again).

    Only for a fixture nobody has changed since it was read (the worker keys each fixture it
    reads at once, :mod:`oracle.run.stored`); any other fixture: :func:`fixture_key`.
    """
    sha = getattr(fixture, "verified_sha256", None)
    if not sha:
        return fixture_key(fixture)
    digest = hashlib.sha256(f"file/{sha}/{_LOADER_VERSION}/".encode())
    digest.update(json.dumps(fixture.case.spec(), sort_keys=True).encode())
    inputs = {id(x): name for name, x in fixture.inputs.items()}
    for name in sorted(fixture.options):
        value = fixture.options[name]
        digest.update(f"options/{name}".encode())
        if isinstance(value, np.ndarray) and id(value) in inputs:
            digest.update(f"=inputs/{inputs[id(value)]}".encode())
        else:
            _update(digest, value)
    return "f" + digest.hexdigest()[1:]


def _update(digest, value) -> None:
    """Hash ``value`` as :func:`fixture_key` does (an array's dtype, shape and bytes)."""
    array = np.ascontiguousarray(value) if isinstance(value, np.ndarray) else None
    if array is not None and array.dtype.kind != "O":
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(array.view(np.uint8).reshape(-1).data)
    else:  # scalars, strings, tuples such as window=(8, None)
        digest.update(repr(value).encode())


def read_case(fixture, key: str | None = None) -> CaseView:
    """The :class:`CaseView` of an attention fixture (``key``: its :func:`fixture_key`, when
    the caller has it already)."""
    inputs = fixture.inputs
    options = {n: x for n, x in fixture.options.items() if n != "return_lse"}
    q, k, v, options = dequantised_inputs(inputs["q"], inputs["k"], inputs["v"], options)
    return CaseView(
        name=fixture.case.name,
        dtype=fixture.case.dtype,
        q=_frozen(q),
        k=_frozen(k),
        v=_frozen(v),
        options=MappingProxyType({n: _frozen(x) for n, x in options.items()}),
        shapes=MappingProxyType(_shapes(q, k, v)),
        single=np.ndim(q) == 2,
        key=fixture_key(fixture) if key is None else key,
    )
