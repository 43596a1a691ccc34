"""Adapters: third-party attention implementations behind refattn's calling convention.

An adapter is a callable ``impl(q, k, v, **options)`` that takes NumPy arrays of the case
dtype (float64, float32, float16 or ``ml_dtypes.bfloat16``) and :func:`refattn.attention`'s
keyword names, and returns ``out`` (..., H, L, E), or ``(out, lse)`` with ``lse`` (..., H, L)
when ``return_lse=True``, as NumPy arrays. Adapters that can differentiate also expose
``impl.vjp(q, k, v, grad_out, **options) -> (dq, dk, dv, dbias)`` (and a fifth value,
dsinks (H,), where the peer takes sinks).

Rules every adapter follows (the oracle must see the peer's real behaviour):

* **Map options, never fix results.** An option is translated into the peer's own API or,
  when the peer has no way to express it, the call raises :class:`NotImplementedError` whose
  message names the option and the peer (the oracle reports such a case as "unsupported").
  Where the peer's convention differs from refattn's (fully masked rows, softcap order, float
  precision of the softmax) nothing is corrected: the oracle judges and diagnoses the output.
* ``empty_rows`` is not an option of any peer: it names what the *truth* does with rows that
  have no allowed key. ``"zero"`` (the pinned convention) is passed through unchanged, so the
  oracle sees what the peer really does with such rows (JAX averages every value, onnxruntime
  float64 gives NaN). ``"nan"`` is an alternative no peer can be asked for: when the problem
  has a row with no allowed key the call raises NotImplementedError (without one, the value
  changes nothing and the call proceeds).
* A value is never rounded on its way to the peer. An option whose value the peer can only
  take in a narrower format (ONNX's 32-bit ``scale`` and ``softcap`` attributes, a float bias
  in another dtype than q) is passed when it converts exactly and is unsupported otherwise.
* float8 and float4 (block-scaled) inputs reach no peer here (an adapter would have to
  dequantise them: another problem); sinks reach only peers with an attention-sink input;
  ``kv_lengths`` is mapped to a peer's per-row key lengths or, where the adapter can state
  the same allowed set exactly, to a boolean mask (see each module's table).
* ALiBi is unsupported by every peer here: folding it into a float bias would round the bias
  to the case dtype (a float16 bias of ``-slope * |i - j|`` is not the exact ALiBi term), so
  the oracle would judge the adapter's rounding, not the peer.
* Shapes: refattn's leading batch dims broadcast; 2-D q, k, v are one head. Adapters flatten
  the batch to one axis (via :func:`refattn.spec.canonicalize`, which also validates every
  option exactly as :func:`refattn.attention` does) and restore it on the way out.

Adapters (:func:`get` by name, :func:`available` for the importable ones; pip extra):

* ``torch``: torch.nn.functional.scaled_dot_product_attention on the CPU (``refattn[torch]``);
* ``torch-flex``: torch.nn.attention.flex_attention, eager on the CPU (``refattn[torch]``);
* ``jax``: jax.nn.dot_product_attention, xla implementation (``refattn[jax]``);
* ``onnxruntime``: an ONNX ``Attention`` node (opset 24) in onnxruntime (``refattn[onnx]``);
* ``onnxruntime-gqa``: onnxruntime's contrib ``GroupQueryAttention`` (KV cache: per-row
  cache lengths, attention sinks; causal bottom-right only) (``refattn[onnx]``);
* ``onnx-reference``: an ONNX ``Attention`` node (newest opset) in onnx.reference
  (``refattn[onnx]``);
* ``refattn-float64`` / ``refattn-exact``: refattn.attention's own paths (no extra);
* ``refattn-numba`` / ``refattn-cuda``: refattn's kernels (:mod:`oracle.adapters.refattn_kernels`;
  ``refattn[cuda]``, or ``NUMBA_ENABLE_CUDASIM=1`` for the simulator).

Each peer module's docstring has its option table and the peer behaviour measured against the
exact path (run ``tools/measure_peers.py`` for the accuracy figures).

Examples
--------
>>> from oracle import adapters
>>> "refattn-float64" in adapters.names()
True
>>> adapters.get("no-such-peer")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
KeyError: "unknown adapter 'no-such-peer'; known: torch, torch-flex, jax, onnxruntime, ..."
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np

from oracle.catalogue.names import ATTENTION_OPTIONS
from refattn.spec import canonicalize

__all__ = [
    "Adapter",
    "OPTION_NAMES",
    "get",
    "available",
    "names",
    "exact_cast",
]

#: The keyword names of refattn.attention an adapter accepts (the oracle's calling convention).
OPTION_NAMES = (*ATTENTION_OPTIONS, "return_lse")


@dataclass(frozen=True)
class _Entry:
    module: str
    attribute: str
    peer: str  # the top-level package that must import
    extra: str | None  # pip extra of refattn that installs it
    probe: bool = False  # available() must construct it (construction checks a device)


_REGISTRY = {
    "torch": _Entry("oracle.adapters.torch", "TorchSDPA", "torch", "torch"),
    "torch-flex": _Entry("oracle.adapters.torch_flex", "TorchFlexAttention", "torch", "torch"),
    "jax": _Entry("oracle.adapters.jax", "JaxDotProductAttention", "jax", "jax"),
    "onnxruntime": _Entry(
        "oracle.adapters.onnxruntime", "OnnxRuntimeAttention", "onnxruntime", "onnx"
    ),
    "onnx-reference": _Entry(
        "oracle.adapters.onnx_reference", "OnnxReferenceAttention", "onnx", "onnx"
    ),
    "onnxruntime-gqa": _Entry(
        "oracle.adapters.onnxruntime_gqa", "OnnxRuntimeGQA", "onnxruntime", "onnx"
    ),
    "refattn-float64": _Entry("oracle.adapters.refattn_numpy", "RefattnFloat64", "refattn", None),
    "refattn-exact": _Entry("oracle.adapters.refattn_numpy", "RefattnExact", "refattn", None),
    "refattn-numba": _Entry("oracle.adapters.refattn_kernels", "RefattnNumba", "numba", None),
    "refattn-cuda": _Entry(
        "oracle.adapters.refattn_kernels", "RefattnCuda", "numba.cuda", "cuda", probe=True
    ),
}

_INSTANCES: dict[str, object] = {}


def names() -> list[str]:
    """Every adapter name :func:`get` knows (importable or not)."""
    return list(_REGISTRY)


def _load(name: str):
    """The adapter class of ``name`` (imports the peer)."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown adapter {name!r}; known: {', '.join(_REGISTRY)}")
    entry = _REGISTRY[name]
    try:
        module = importlib.import_module(entry.module)
    except ImportError as err:
        hint = f"pip install refattn[{entry.extra}]" if entry.extra else "reinstall refattn"
        raise ImportError(
            f"adapter {name!r} needs {entry.peer}, which does not import here ({err}); "
            f"install it with: {hint}"
        ) from err
    return getattr(module, entry.attribute)


def get(name: str):
    """The adapter called ``name`` (one instance per process).

    Raises
    ------
    KeyError
        ``name`` is not an adapter.
    ImportError
        The peer is not installed; the message says which pip extra installs it.
    """
    if name not in _INSTANCES:
        _INSTANCES[name] = _load(name)()
    return _INSTANCES[name]


def available() -> list[str]:
    """Names of the adapters whose peer imports on this machine.

    Only adapters whose construction checks for a device (refattn-cuda) are constructed here;
    the others are imported only (constructing the jax adapter turns on jax_enable_x64).
    """
    found = []
    for name, entry in _REGISTRY.items():
        try:
            get(name) if entry.probe else _load(name)
        except ImportError:
            continue
        found.append(name)
    return found


def exact_cast(array: np.ndarray, dtype, option: str, peer: str) -> np.ndarray:
    """``array`` in ``dtype`` when every value converts exactly, else NotImplementedError.

    Used where a peer takes an option only in a narrower format: passing a rounded value
    would make the oracle judge the adapter's rounding instead of the peer.
    """
    array = np.asarray(array)
    dtype = np.dtype(dtype)
    if array.dtype == dtype:
        return array
    with np.errstate(over="ignore", invalid="ignore"):
        converted = array.astype(dtype)
        back = converted.astype(array.dtype)
    same = (back == array) | (np.isnan(back) & np.isnan(array))
    if not np.all(same):
        raise NotImplementedError(
            f"{peer}: {option} of dtype {array.dtype.name} does not convert exactly to "
            f"{dtype.name}, the only {option} dtype it takes here"
        )
    return converted


class Adapter:
    """Base of every adapter: option checking, batch flattening, output restoring.

    Subclasses set :attr:`name` and :attr:`peer` and implement :meth:`_forward`, which
    receives the canonical :class:`refattn.spec.AttentionSpec` (q (B, H, L, D), k (B, K, S, D),
    v (B, K, S, E), bias / mask (B, H, L, S) views) and ``return_lse`` and returns
    ``out`` (B, H, L, E) and ``lse`` (B, H, L) or None.
    """

    name = "adapter"
    peer = "peer"
    #: What the peer does with rows that have no allowed key, as measured (informational).
    fully_masked_rows = "unknown"
    #: Whether float8 q, k, v (with q_descale, k_descale, v_descale) reach the peer as such.
    takes_float8 = False

    def __call__(self, q, k, v, **options):
        spec, return_lse = self._canonical(q, k, v, options)
        out, lse = self._forward(spec, return_lse)
        out = spec.unflatten(np.asarray(out))
        if not return_lse:
            return out
        return out, spec.unflatten(np.asarray(lse))

    def _canonical(self, q, k, v, options):
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(
                f"{self.name}: unknown option(s) {unknown}; an adapter takes "
                f"{', '.join(OPTION_NAMES)}"
            )
        options = dict(options)
        return_lse = bool(options.pop("return_lse", False))
        if any(np.asarray(a).dtype.name.startswith("float4") for a in (q, k, v)):
            self.unsupported("k", "<float4_e2m1fn>", "no fp4 inputs with block scales")
        dtypes = {np.asarray(a).dtype for a in (q, k, v)}
        if len(dtypes) != 1:
            raise TypeError(
                f"{self.name}: q, k, v must share one dtype, got "
                f"{[np.asarray(a).dtype.name for a in (q, k, v)]}"
            )
        (dtype,) = dtypes
        if dtype.name.startswith("float8") and not self.takes_float8:
            self.unsupported(
                "q",
                f"<{dtype.name}>",
                "no float8 inputs with descale factors "
                "(dequantising them here would hand it another problem)",
            )
        spec = canonicalize(q, k, v, **options)
        if spec.empty_rows == "nan" and has_empty_rows(spec):
            self.unsupported(
                "empty_rows",
                "nan",
                f"no option for rows without an allowed key (its own: {self.fully_masked_rows})",
            )
        return spec, return_lse

    def unsupported(self, option: str, value, why: str):
        """Raise NotImplementedError naming the option, its value and the peer."""
        raise NotImplementedError(f"{self.peer} has no equivalent of {option}={value!r}: {why}")

    def _forward(self, spec, return_lse):  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} does not implement _forward")

    def __repr__(self) -> str:
        return f"<oracle adapter {self.name!r}: {self.peer}>"


def has_empty_rows(spec) -> bool:
    """Whether some query row of the canonical spec has no allowed key."""
    batch, heads = spec.q.shape[:2]
    return any(
        not spec.allowed(b, h).any(axis=-1).all() for b in range(batch) for h in range(heads)
    )


def alignment_matters(spec) -> bool:
    """True when align changes the problem (causal, window or ALiBi with L != S)."""
    length, keys = spec.q.shape[2], spec.k.shape[2]
    uses_offset = spec.causal or spec.window is not None or spec.alibi_slopes is not None
    return uses_offset and length != keys


def reject_common(
    adapter: Adapter,
    spec,
    *,
    softcap=False,
    window=False,
    lse=None,
    return_lse=False,
    sinks=False,
    kv_lengths=False,
    alibi=False,
    sigmoid=False,
    qv=False,
) -> None:
    """Raise NotImplementedError for the options most peers lack.

    ``softcap`` / ``window`` / ``sinks`` / ``kv_lengths`` / ``qv``: whether the peer takes them;
    ``lse``: whether it returns lse; ``sigmoid``: whether it takes ``normalizer="sigmoid"``;
    ``alibi``: whether the peer computes ALiBi itself (a
    score function of its own, never a bias folded by the adapter). Caller-given dropout
    masks and ``gqa="tile"`` (with H != K) are never supported.
    """
    if spec.key_indices is not None:  # no peer takes sparse key indices
        adapter.unsupported("key_indices", "<indices>", "no sparse key-index option")
    if spec.normalizer == "sigmoid" and not sigmoid:
        adapter.unsupported("normalizer", "sigmoid", "no sigmoid normaliser (softmax only)")
    if spec.qv_features and not qv:
        adapter.unsupported("qv", "<latent queries>", "no qv (FlashAttention 3's latent term)")
    if spec.sinks is not None and not sinks:
        adapter.unsupported(
            "sinks",
            "<logits>",
            "no attention-sink option (a logit in every row's normaliser with no value)",
        )
    if spec.kv_lengths is not None and not kv_lengths:
        adapter.unsupported("kv_lengths", spec.kv_lengths.tolist(), "no per-row key lengths")
    if spec.alibi_slopes is not None and not alibi:
        adapter.unsupported(
            "alibi_slopes",
            "<slopes>",
            "ALiBi would have to be folded into a "
            "bias rounded to the case dtype (see oracle.adapters)",
        )
    if spec.dropout_mask is not None or spec.dropout_p != 0.0:
        adapter.unsupported(
            "dropout_mask",
            "<keep-mask>",
            "its dropout draws its own random mask; a caller-given keep-mask cannot be passed",
        )
    if spec.gqa == "tile" and spec.q.shape[1] != spec.k.shape[1]:
        adapter.unsupported("gqa", "tile", "query head h reads kv head h // G (interleave)")
    if spec.softcap is not None and not softcap:
        adapter.unsupported("softcap", spec.softcap, "no logit soft-capping option")
    if spec.window is not None and not window:
        adapter.unsupported("window", spec.window, "no sliding-window option")
    if return_lse and not lse:
        adapter.unsupported("return_lse", True, "it does not return the log-sum-exp")
