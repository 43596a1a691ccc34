"""The attention call stated once: the canonical spec, the option layout and the allowed set.

This module is the one home of the rules every path reads (the float64 path, the
arbitrary-precision referee, the fast exact engine, the Numba CPU and CUDA kernels, the
variants' masks and the oracle): see ``docs/architecture.md``.

* **The allowed set** (docs/conventions.md, "allowed set"): row i of batch row b may read key j
  when

  .. math::

      \\mathcal{A}_{ij} = [\\text{lo}_i \\le j < \\text{hi}_i] \\wedge \\mathrm{mask}_{ij}
          \\wedge [\\mathrm{bias}_{ij} \\ne -\\infty]

  where the structural interval ``[lo_i, hi_i)`` (:func:`key_interval`) holds causal
  (``j <= i + o``), the window (``i + o - left <= j <= i + o + right``) and the row's key length
  (``j < S_b``, ``kv_lengths``), with the offset ``o = 0`` for ``align="top_left"`` and
  ``o = S_b - L`` for ``align="bottom_right"`` (:func:`offset_of`). :func:`key_interval` is plain
  Python on ints so that each backend compiles the same text: :data:`key_interval_jit` (Numba
  CPU), ``numba.cuda.jit(device=True)(key_interval)`` (CUDA); the NumPy forms
  (:func:`key_intervals`, :func:`structural_mask`, :func:`allowed_mask`,
  :meth:`AttentionSpec.allowed`) are built on it. :func:`position_allowed` is the per-position
  half (explicit mask, -inf bias). Sparse key indices (``key_indices``,
  ``key_block_indices``: :mod:`refattn.sparse_indices`) are one more factor
  ``[j \\in I_{b, g(h), i}]``: :func:`canonicalize` ANDs their set into the mask, so every
  path reads them through this rule.
* **The options** of :func:`refattn.attention`: :data:`OPTIONS`, one :class:`Option` record
  per keyword (name, default, kind, what it folds into, a doc line, its gradient). The
  signatures of :func:`refattn.attention` and :func:`refattn.attention_vjp` state them for
  their readers (a test holds them to the table); everything else reads the table
  (:func:`option_names`, :func:`defaults`, :func:`options_in`): :func:`canonicalize` checks
  each option by its kind, :func:`fold` and the multiset gather reset the options they write
  out, the transformer passes the ``core`` ones through, the oracle lists them.
* **The canonical call**: :func:`canonicalize` validates the arguments of
  :func:`refattn.attention` once and returns an :class:`AttentionSpec` whose arrays have a flat
  batch axis: q (B, H, L, D), k (B, K, S, D), v (B, K, S, E), and bias / mask / dropout_mask as
  (B, H, L, S) views (zero strides where they were broadcast, so no (B, H, L, S) copy is made
  unless a reshape forces one).
* **Folding** (:func:`fold`): an equivalent spec with fewer options for the paths that do not
  implement an option natively (see the docstring of :func:`fold`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from . import _checks, _option_checks, sparse_indices
from ._fold import fold, needs_fold, split_sink_grads, with_indices
from ._option_checks import check_cotangent
from ._qv import split_qv_grads
from .quantized import FP8_DTYPES

__all__ = [
    "ALIGNS",
    "AttentionSpec",
    "EMPTY_ROWS",
    "FOLDS",
    "FP8_DTYPES",
    "GQA_MODES",
    "NORMALIZERS",
    "OPTIONS",
    "OPTION_KINDS",
    "SCALAR_KINDS",
    "Option",
    "UNBOUNDED",
    "WINDOW_CAP",
    "allowed_mask",
    "canonicalize",
    "check_cotangent",
    "check_option_names",
    "check_window",
    "defaults",
    "field_defaults",
    "fold",
    "key_interval",
    "key_interval_jit",
    "key_intervals",
    "needs_fold",
    "offset_of",
    "option",
    "option_names",
    "options_in",
    "position_allowed",
    "position_allowed_jit",
    "split_qv_grads",
    "split_sink_grads",
    "structural_mask",
    "window_sides",
]

# --------------------------------------------------------------------------------------
# the allowed set: the one rule
# --------------------------------------------------------------------------------------
ALIGNS = ("top_left", "bottom_right")


def offset_of(align: str, length: int, keys: int) -> int:
    """Diagonal offset o: 0 for "top_left", S - L for "bottom_right"."""
    _checks.choice(align, "align", ALIGNS)
    return 0 if align == "top_left" else keys - length


WINDOW_CAP = 2**62  # larger than any array axis (int64 index arithmetic stays exact)


def check_window(window):
    """Validate ``window=(left, right)``: non-negative ints or None (unbounded side)."""
    if window is None:
        return None
    if not isinstance(window, tuple | list) or len(window) != 2:
        raise ValueError(f"window: expected a pair (left, right), got {window!r}")
    sides = []
    for name, side in zip(("left", "right"), window, strict=True):
        if side is None:
            sides.append(None)
            continue
        if isinstance(side, bool) or not isinstance(side, int | np.integer):
            raise TypeError(f"window: {name} size must be an int or None, got {side!r}")
        if side < 0:
            raise ValueError(f"window: {name} size must be >= 0, got {side}")
        # any size beyond every index difference is the same window; capping it keeps the
        # index arithmetic in int64 (a size of 2**70 is valid and means "unbounded")
        sides.append(min(int(side), WINDOW_CAP))
    return tuple(sides)


#: The compiled form of a window side that is None (unbounded).
UNBOUNDED = -1


def window_sides(window) -> tuple[int, int]:
    """A checked ``window`` as the compiled rule's ``(left, right)`` ints (-1: unbounded)."""
    if window is None:
        return UNBOUNDED, UNBOUNDED
    left, right = window
    return (UNBOUNDED if left is None else int(left)), (UNBOUNDED if right is None else int(right))


def key_interval(i, offset, keys, causal, left, right):
    """The structural key interval ``[lo, hi)`` of query row ``i``: the one home of the rule.

    Row i may read key j exactly when ``lo <= j < hi`` (before the explicit mask, the -inf
    bias and dropout): ``j <= i + o`` (causal), ``i + o - left <= j <= i + o + right``
    (window; a side of -1, :data:`UNBOUNDED`, is unbounded) and ``0 <= j < keys``, where
    ``keys`` is the row's key count (``S``, or ``S_b`` under ``kv_lengths``) and ``o`` its
    offset (:func:`offset_of` of that count). Always ``0 <= lo <= hi <= keys``; an empty
    interval has ``lo == hi``.

    Plain Python on ints: :data:`key_interval_jit` is its Numba CPU compilation and the CUDA
    kernels compile the same function as a device function.

    Parameters
    ----------
    i, offset, keys : int
        Query row, alignment offset o and key count.
    causal : bool
    left, right : int
        Window sides, -1 for unbounded (:func:`window_sides`).

    Returns
    -------
    (lo, hi) : tuple of int

    Examples
    --------
    >>> key_interval(1, 0, 4, True, -1, -1)
    (0, 2)
    >>> key_interval(0, 2, 4, False, 1, 0)  # bottom-right L=2, S=4, window (1, 0)
    (1, 3)
    """
    diag = i + offset
    lo = 0
    hi = keys
    if causal:
        hi = min(hi, diag + 1)
    if left >= 0:
        lo = max(lo, diag - left)
    if right >= 0:
        hi = min(hi, diag + right + 1)
    lo = min(lo, keys)
    hi = max(hi, lo)
    return lo, hi


def position_allowed(has_mask, mask_value, has_bias, bias_value):
    """The per-position half of the allowed set: the explicit mask allows it and the bias is
    not -inf (plain Python, compiled by the kernels like :func:`key_interval`).

    Examples
    --------
    >>> position_allowed(True, True, True, -float("inf"))
    False
    """
    return (not has_mask or bool(mask_value)) and (not has_bias or bias_value != -math.inf)


#: The rules compiled for the Numba CPU paths, made on first access (module ``__getattr__``):
#: ``key_interval_jit`` is :func:`key_interval` (integer arithmetic only), ``position_allowed_jit``
#: is :func:`position_allowed`. Made lazily so that importing refattn does not import Numba (0.4 s
#: of start-up) for the NumPy paths, which never dispatch a compiled function.
_COMPILED = {"key_interval_jit": "key_interval", "position_allowed_jit": "position_allowed"}
key_interval_jit: object  # declared here, made by __getattr__
position_allowed_jit: object


def __getattr__(name):
    rule = _COMPILED.get(name)
    if rule is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import numba  # measured start-up cost (0.4 s): only the Numba paths import it

    compiled = numba.njit(cache=True, fastmath=False)(globals()[rule])
    return globals().setdefault(name, compiled)


def _intervals(rows, offset, keys, causal, left, right):
    """:func:`key_interval` of every row of the int64 array ``rows``, its steps done on whole
    arrays (int64, as the compiled rule; checked against it row by row in the tests). NumPy
    rather than :data:`key_interval_jit`: the NumPy paths then never dispatch a compiled
    function, whose first call in a process costs Numba's start-up (0.5 s and more)."""
    diag = rows + offset
    lo = np.zeros(rows.shape, np.int64)
    hi = np.full(rows.shape, keys, np.int64)
    if causal:
        hi = np.minimum(hi, diag + 1)
    if left >= 0:
        lo = np.maximum(lo, diag - left)
    if right >= 0:
        hi = np.minimum(hi, diag + right + 1)
    lo = np.minimum(lo, keys)
    hi = np.maximum(hi, lo)
    return lo, hi


def key_intervals(length: int, offset: int, keys: int, *, causal=False, window=None):
    """:func:`key_interval` of every row ``0 <= i < length``: int64 arrays (lo, hi) of shape
    (L,).

    Examples
    --------
    >>> [x.tolist() for x in key_intervals(3, 0, 4, causal=True, window=(1, None))]
    [[0, 0, 1], [1, 2, 3]]
    """
    left, right = window_sides(check_window(window))
    rows = np.arange(length, dtype=np.int64)
    return _intervals(rows, int(offset), int(keys), bool(causal), left, right)


def _interval_mask(rows, cols, offset, keys, causal, left, right) -> np.ndarray:
    """(rows, cols) bool: ``lo_i <= j < hi_i`` with :func:`key_interval` of each row."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    cols = np.asarray(cols, dtype=np.int64).reshape(-1)
    lo, hi = _intervals(rows, int(offset), int(keys), bool(causal), left, right)
    return (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])


def structural_mask(
    rows, cols, *, causal: bool = False, window=None, offset: int = 0
) -> np.ndarray:
    """Causal/window part of the allowed set for query rows ``rows`` and key columns ``cols``.

    Parameters
    ----------
    rows, cols : array_like of int
        Query indices i (length L') and key indices j (length S').
    causal : bool
        Allow only ``j <= i + offset``.
    window : (left, right) or None
        Allow only ``i + offset - left <= j <= i + offset + right`` (None side: unbounded).
    offset : int
        The alignment offset o (see :func:`offset_of`).

    Returns
    -------
    ndarray of bool, shape (L', S')

    Examples
    --------
    >>> structural_mask(range(2), range(3), causal=True, offset=1).astype(int).tolist()
    [[1, 1, 0], [1, 1, 1]]
    """
    left, right = window_sides(check_window(window))
    return _interval_mask(rows, cols, offset, WINDOW_CAP, causal, left, right)


def allowed_mask(
    length: int,
    keys: int,
    *,
    mask=None,
    bias=None,
    causal: bool = False,
    window=None,
    align: str = "top_left",
) -> np.ndarray:
    """The full allowed set, shape broadcast of mask/bias with (L, S).

    Parameters
    ----------
    length, keys : int
        L and S.
    mask : array_like of bool, optional
        True = attend; broadcastable to (..., L, S).
    bias : array_like of float, optional
        Positions with bias -inf are excluded.
    causal, window, align
        As in :func:`refattn.attention`.

    Returns
    -------
    ndarray of bool, shape (..., L, S)

    Examples
    --------
    >>> allowed_mask(2, 2, causal=True).astype(int).tolist()
    [[1, 0], [1, 1]]
    """
    offset = offset_of(align, length, keys)
    allowed = structural_mask(
        range(length), range(keys), causal=causal, window=check_window(window), offset=offset
    )
    if mask is not None:
        allowed = allowed & _checks.bool_array(mask, "mask")
    if bias is not None:
        allowed = allowed & ~np.isneginf(np.asarray(bias, dtype=np.float64))
    return allowed


GQA_MODES = ("interleave", "tile")
EMPTY_ROWS = ("zero", "nan")
#: The score normalisers: "softmax" (weights ``exp(t - lse)``) and "sigmoid" (weights
#: ``sigmoid(t)``, no normaliser; Ramapuram et al. 2024, docs/conventions.md).
NORMALIZERS = ("softmax", "sigmoid")


# --------------------------------------------------------------------------------------
# the options of refattn.attention: one table
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    """One keyword option of :func:`refattn.attention` and :func:`refattn.attention_vjp`: a
    row of :data:`OPTIONS`.

    Attributes
    ----------
    name : str
        The keyword (and the :class:`AttentionSpec` field that holds its checked value, for
        the options that :func:`canonicalize` does not fold into another field).
    default
        Its default: the option is off (or the convention is the common one).
    kind : str
        How :func:`canonicalize` checks it (one of :data:`OPTION_KINDS`).
    into : str
        What it folds into (one of :data:`FOLDS`): "scores" (the score ``t~``), "interval"
        (the structural key interval of :func:`key_interval`), "allowed" (the allowed set's
        per-position half), "heads" (the kv head of each query head), "normaliser", "output"
        (the weights' use: dropout, empty rows), "inputs" (q, k, v themselves: dequantised or
        extended before anything else reads them), "indices" (the sparse key indices).
    doc : str
        One line: what it is.
    choices : tuple
        The values of a "choice" option.
    unit : str
        What one element of a per-head array is (named in its error messages).
    core : bool
        One of the options of plain scaled dot-product attention (scores, masking, heads,
        dropout, empty rows: all but sinks, key lengths, quantised inputs, sparse indices,
        normalisers and latent queries). :mod:`refattn.transformer` passes exactly these
        through (its ``**attention_kwargs``).
    gradient : str or None
        The field of :func:`refattn.attention_vjp`'s result that holds its own gradient.
    batch_axis : int or None
        The axis (from the end) of an array option's batch dimensions (None: it has none).
    """

    name: str
    default: object
    kind: str
    into: str
    doc: str
    choices: tuple = ()
    unit: str = ""
    core: bool = False
    gradient: str | None = None
    batch_axis: int | None = None

    @property
    def is_array(self) -> bool:
        """Whether its value is an array (a plane, per-head, per-batch, indices, scales, qv)."""
        return self.kind not in SCALAR_KINDS


#: The kinds of :attr:`Option.kind`, each with one check in :mod:`refattn._option_checks`
#: (the kinds of the "inputs" and "indices" options are checked by the code they fold into:
#: :func:`refattn.quantized.dequantize_inputs`, :func:`refattn._qv.fold_qv`,
#: :func:`refattn.sparse_indices.canonical_indices`).
OPTION_KINDS = (
    "float",
    "positive float",
    "probability",
    "bool",
    "choice",
    "window",
    "float plane",
    "bool plane",
    "per-head",
    "per-batch",
    "descale",
    "block scale",
    "latent",
    "indices",
    "int",
)
#: The kinds whose value is a scalar (or a pair, ``window``): the other options are arrays.
SCALAR_KINDS = ("float", "positive float", "probability", "bool", "choice", "window", "int")
#: The values of :attr:`Option.into`.
FOLDS = ("scores", "interval", "allowed", "heads", "normaliser", "output", "inputs", "indices")

#: The options of :func:`refattn.attention`, in its signature's order: the one list every
#: path, the transformer pass-through and the oracle read (see docs/architecture.md).
OPTIONS = (
    Option("scale", None, "float", "scores", "s in t = s q.k (None: 1/sqrt(D))", core=True),
    Option(
        "bias",
        None,
        "float plane",
        "scores",
        "added to the scores after softcap; -inf excludes a position",
        core=True,
        gradient="dbias",
        batch_axis=-4,
    ),
    Option("mask", None, "bool plane", "allowed", "True = attend", core=True, batch_axis=-4),
    Option("causal", False, "bool", "interval", "allow only j <= i + o", core=True),
    Option(
        "window",
        None,
        "window",
        "interval",
        "(left, right): allow only i + o - left <= j <= i + o + right",
        core=True,
    ),
    Option(
        "align",
        "top_left",
        "choice",
        "interval",
        "the diagonal offset o: 0 or S - L",
        choices=ALIGNS,
        core=True,
    ),
    Option(
        "softcap",
        None,
        "positive float",
        "scores",
        "c tanh(t / c) on the raw scores",
        core=True,
    ),
    Option(
        "alibi_slopes",
        None,
        "per-head",
        "scores",
        "m_h: adds -m_h |i + o - j| (the float64 paths fold it into the bias)",
        unit="slope",
        core=True,
    ),
    Option(
        "gqa",
        "interleave",
        "choice",
        "heads",
        "query head h reads kv head h // G or h % K",
        choices=GQA_MODES,
        core=True,
    ),
    Option(
        "dropout_mask",
        None,
        "bool plane",
        "output",
        "the keep-mask kappa",
        core=True,
        batch_axis=-4,
    ),
    Option(
        "dropout_p",
        0.0,
        "probability",
        "output",
        "kept weights scaled by 1/(1 - p)",
        core=True,
    ),
    Option(
        "empty_rows",
        "zero",
        "choice",
        "output",
        "rows with no allowed key: out 0, lse -inf, or NaN",
        choices=EMPTY_ROWS,
        core=True,
    ),
    Option(
        "sinks",
        None,
        "per-head",
        "normaliser",
        "a logit per query head added to every row's normaliser (one more key when folded)",
        unit="logit",
        gradient="dsinks",
    ),
    Option(
        "kv_lengths",
        None,
        "per-batch",
        "interval",
        "per batch row key length S_b (a mask when folded)",
        batch_axis=-1,
    ),
    Option(
        "q_descale", None, "descale", "inputs", "float8 q dequantised as q * descale", batch_axis=-2
    ),
    Option(
        "k_descale", None, "descale", "inputs", "float8 k dequantised as k * descale", batch_axis=-2
    ),
    Option(
        "v_descale", None, "descale", "inputs", "float8 v dequantised as v * descale", batch_axis=-2
    ),
    Option(
        "key_indices", None, "indices", "indices", "token-level sparse key indices", batch_axis=-4
    ),
    Option(
        "key_block_indices",
        None,
        "indices",
        "indices",
        "block-sparse key block numbers",
        batch_axis=-4,
    ),
    Option("key_block_size", None, "int", "indices", "keys per block of key_block_indices"),
    Option(
        "index_reading",
        "set",
        "choice",
        "indices",
        "a key listed twice counts once (set) or twice (multiset)",
        choices=sparse_indices.INDEX_READINGS,
    ),
    Option(
        "q_block_scale", None, "block scale", "inputs", "float4 q's per-block scales", batch_axis=-4
    ),
    Option(
        "k_block_scale", None, "block scale", "inputs", "float4 k's per-block scales", batch_axis=-4
    ),
    Option(
        "v_block_scale", None, "block scale", "inputs", "float4 v's per-block scales", batch_axis=-4
    ),
    Option(
        "normalizer",
        "softmax",
        "choice",
        "normaliser",
        "softmax, or sigmoid weights with no normaliser",
        choices=NORMALIZERS,
    ),
    Option(
        "qv",
        None,
        "latent",
        "inputs",
        "latent queries: t = s (q.k + qv.v), held as q' = [q, qv], k' = [k, v]",
        gradient="dqv",
        batch_axis=-4,
    ),
)


def option_names() -> tuple[str, ...]:
    """The names of :data:`OPTIONS`, in order.

    Examples
    --------
    >>> option_names()[:3]
    ('scale', 'bias', 'mask')
    """
    return tuple(option.name for option in OPTIONS)


def option(name: str) -> Option:
    """The :class:`Option` called ``name`` (a KeyError names the known options)."""
    for row in OPTIONS:
        if row.name == name:
            return row
    raise KeyError(
        f"{name!r} is not an option of refattn.attention; expected one of {option_names()}"
    )


def defaults(*into: str) -> dict:
    """``{name: default}`` of every option, or of those folding into one of ``into``.

    Examples
    --------
    >>> defaults("interval")
    {'causal': False, 'window': None, 'align': 'top_left', 'kv_lengths': None}
    """
    return {o.name: o.default for o in OPTIONS if not into or o.into in into}


def field_defaults(*into: str) -> dict:
    """:func:`defaults` of the options folding into one of ``into`` that
    :class:`AttentionSpec` holds as fields: what a rewritten spec (:func:`fold`, the gather
    of :mod:`refattn.sparse_multiset`) sets to switch them off.

    Examples
    --------
    >>> field_defaults("indices")
    {'key_indices': None, 'index_reading': 'set'}
    """
    fields = {field.name for field in dataclasses.fields(AttentionSpec)}
    return {name: value for name, value in defaults(*into).items() if name in fields}


def options_in(namespace) -> dict:
    """``{name: namespace[name]}`` for every option: a function's ``locals()`` passed on as
    keywords (``canonicalize(q, k, v, **options_in(locals()))``) without spelling the list."""
    return {name: namespace[name] for name in option_names()}


def check_option_names(names, where: str) -> None:
    """A TypeError naming the first of ``names`` that is not an option (``where``: the
    function that was called)."""
    known = set(option_names())
    unknown = [name for name in names if name not in known]
    if unknown:
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}")


@dataclass(frozen=True)
class AttentionSpec:
    q: np.ndarray  # (B, H, L, D), input dtype
    k: np.ndarray  # (B, K, S, D)
    v: np.ndarray  # (B, K, S, E)
    batch_shape: tuple
    single_head: bool  # inputs were 2-D: outputs drop the batch and head axes
    scale: float | None  # None: 1/sqrt(D)
    bias: np.ndarray | None  # (B, H, L, S) float64 view
    bias_shape: tuple | None  # the caller's bias shape (dbias has it)
    mask: np.ndarray | None  # (B, H, L, S) bool view
    causal: bool
    window: tuple | None
    align: str
    offset: int
    softcap: float | None
    alibi_slopes: np.ndarray | None  # (H,) float64
    gqa: str
    kv_head: np.ndarray  # (H,) int: kv head read by each query head
    dropout_mask: np.ndarray | None  # (B, H, L, S) bool view
    dropout_p: float
    empty_rows: str
    kv_lengths: np.ndarray | None = None  # (B,) int64: keys j >= kv_lengths[b] excluded
    sinks: np.ndarray | None = None  # (H,) float64: a logit added to every row's normaliser
    # set by refattn.spec for the exact paths only (None on canonical specs):
    alibi_offsets: np.ndarray | None = None  # (B,) int64: ALiBi's o_b, overriding row_offset
    alibi_keys: int | None = None  # ALiBi applies to keys j < alibi_keys (a folded sink: none)
    dbias_index: np.ndarray | None = None  # (B, H, L, S) int64 slot of each dS in dbias (-1: none)
    # sparse key selection (refattn.sparse_indices): the validated (B, K, L, T) int64 indices
    # (-1 for ignored entries; blocks already expanded). With index_reading="set" their set is
    # already ANDed into ``mask``; "multiset" is computed by refattn.sparse_multiset's gather.
    key_indices: np.ndarray | None = None
    index_reading: str = "set"
    normalizer: str = "softmax"  # "softmax" or "sigmoid" (NORMALIZERS)
    # qv (FlashAttention 3, MLA): q holds [q, qv] and k holds [k, v] (refattn._qv.fold_qv);
    # the last qv_features of their D features are the latent part (0: no qv)
    qv_features: int = 0

    @property
    def dims(self):
        """(B, H, K, L, S, D, E)."""
        batch, heads, length, dim = self.q.shape
        _, kv_heads, keys, vdim = self.v.shape
        return batch, heads, kv_heads, length, keys, dim, vdim

    @property
    def scale_float(self) -> float:
        """The scale as a float64 (1/sqrt(D) rounded once when defaulted)."""
        return 1.0 / math.sqrt(self.q.shape[-1]) if self.scale is None else self.scale

    @property
    def scale_exact(self):
        """The exact scale: a Fraction, or ("invsqrt", D) when 1/sqrt(D) is irrational."""
        if self.scale is not None:
            return Fraction(self.scale)
        dim = self.q.shape[-1]
        root = math.isqrt(dim)
        return Fraction(1, root) if root * root == dim else ("invsqrt", dim)

    @property
    def keep_scale(self) -> Fraction:
        """1 / (1 - p), exactly."""
        return 1 / (1 - Fraction(self.dropout_p))

    def row_offset(self, b: int = 0) -> int:
        """The alignment offset o of batch row b: with ``kv_lengths``, ``align="bottom_right"``
        aligns to the row's own key length (o = S_b - L), else o is :attr:`offset`."""
        if self.kv_lengths is None:
            return self.offset
        length = self.q.shape[-2]
        return offset_of(self.align, length, int(self.kv_lengths[b]))

    def key_count(self, b: int = 0) -> int:
        """The key count of batch row b: ``S``, or ``S_b`` under ``kv_lengths``."""
        keys = self.k.shape[-2]
        return keys if self.kv_lengths is None else int(self.kv_lengths[b])

    def intervals(self) -> tuple[np.ndarray, np.ndarray]:
        """(lo, hi): int64 (B, L) structural key intervals of every row (:func:`key_interval`
        with the row's offset and key count: causal, window, key length).

        Examples
        --------
        >>> spec = canonicalize(np.zeros((3, 2)), np.zeros((4, 2)), np.zeros((4, 1)),
        ...                     causal=True, window=(1, None))
        >>> [x.ravel().tolist() for x in spec.intervals()]
        [[0, 0, 1], [1, 2, 3]]
        """
        batch, _, _, length, _, _, _ = self.dims
        left, right = window_sides(self.window)
        rows = np.arange(length, dtype=np.int64)
        lo = np.empty((batch, length), np.int64)
        hi = np.empty((batch, length), np.int64)
        for b in range(batch):
            lo[b], hi[b] = _intervals(
                rows, self.row_offset(b), self.key_count(b), self.causal, left, right
            )
        return lo, hi

    def structural(self, rows=None, cols=None, b: int = 0) -> np.ndarray:
        """Causal/window (and key-length) allowed set of batch row b for the given query rows
        and key columns (:func:`key_interval`)."""
        _, _, _, length, keys, _, _ = self.dims
        rows = np.arange(length) if rows is None else rows
        cols = np.arange(keys) if cols is None else cols
        left, right = window_sides(self.window)
        return _interval_mask(
            rows, cols, self.row_offset(b), self.key_count(b), self.causal, left, right
        )

    def allowed(self, b: int, h: int) -> np.ndarray:
        """Allowed set (L, S) of batch b, query head h (mask, causal, window, key length,
        finite bias)."""
        allowed = self.structural(b=b)
        if self.mask is not None:
            allowed = allowed & self.mask[b, h]
        if self.bias is not None:
            allowed = allowed & ~np.isneginf(self.bias[b, h])
        return allowed

    def alibi_offset(self, b: int = 0) -> int:
        """ALiBi's offset o_b of batch row b: :meth:`row_offset`, unless a folded spec pins it
        (:attr:`alibi_offsets`, the rows' offsets before their key lengths became a mask)."""
        return self.row_offset(b) if self.alibi_offsets is None else int(self.alibi_offsets[b])

    def alibi_distance(self, b: int = 0) -> np.ndarray:
        """|i + o_b - j| as int64 (L, S): the ALiBi distance of batch row b (0 for the keys
        j >= :attr:`alibi_keys` of a folded spec: a sink has no position)."""
        _, _, _, length, keys, _, _ = self.dims
        dist = np.abs(np.arange(length)[:, None] + self.alibi_offset(b) - np.arange(keys)[None, :])
        if self.alibi_keys is not None:
            dist[:, self.alibi_keys :] = 0
        return dist

    def dbias_slots(self) -> tuple[np.ndarray, tuple]:
        """(index, shape): the slot of dbias (flat, C order of ``shape``) that each dS_ij of
        the (B, H, L, S) plane adds to, -1 where none, and dbias's shape. By default
        ``shape`` is :attr:`bias_shape` and the slots sum over bias's broadcast dimensions; a
        folded spec (:attr:`dbias_index`) sends a sink's column to its own slots (dsinks)."""
        batch, heads, _, length, keys, _, _ = self.dims
        if self.dbias_index is not None:
            return (
                np.broadcast_to(self.dbias_index, (batch, heads, length, keys)),
                self.bias_shape,
            )
        shape = tuple(self.bias_shape)
        full = tuple(self.batch_shape) + (heads, length, keys)
        index = np.broadcast_to(np.arange(int(np.prod(shape))).reshape(shape), full)
        return index.reshape((batch, heads, length, keys)), shape

    def alibi(self, h: int, b: int = 0) -> np.ndarray | None:
        """ALiBi term -slope_h * |i + o_b - j| as float64 (L, S), or None."""
        if self.alibi_slopes is None:
            return None
        return -self.alibi_slopes[h] * self.alibi_distance(b)

    def without(self, into: str, *more: str, **changes) -> AttentionSpec:
        """This spec with the options folding into ``into`` (and ``more``) switched off (their
        defaults, :func:`field_defaults`) and ``changes`` applied: how a rewrite (:func:`fold`,
        the multiset gather) drops the options it has written out."""
        return dataclasses.replace(self, **{**field_defaults(into, *more), **changes})

    def unflatten(self, array: np.ndarray) -> np.ndarray:
        """(B, H, ...) -> batch_shape + (H, ...); for 2-D inputs the head axis is dropped."""
        array = array.reshape(self.batch_shape + array.shape[1:])
        return array[0] if self.single_head else array


def canonicalize(q, k, v, **options) -> AttentionSpec:
    """Validate refattn.attention's arguments and return the canonical :class:`AttentionSpec`.

    ``options`` are keywords of :data:`OPTIONS` (the rest take their defaults); each is
    checked by its kind (:attr:`Option.kind`). With ``qv`` the spec holds ``q' = [q, qv]``
    and ``k' = [k, v]`` (D + E features, the last ``qv_features = E`` of them latent):
    ``q' . k' = q . k + qv . v`` exactly, so every path computes the FlashAttention 3 score
    unchanged, and the default scale ``1/sqrt(D')`` is FlashAttention 3's ``1/sqrt(D + E)``.
    :func:`split_qv_grads` maps the gradients back.
    """
    check_option_names(options, "canonicalize")
    values = {**defaults(), **options}
    _option_checks.normalizer(values["normalizer"], values["sinks"], NORMALIZERS)
    q, k, v = _option_checks.dequantised(q, k, v, values)
    q, k, v, single = _option_checks.split_heads(q, k, v)
    shape = _option_checks.core_shape(q, k, v)
    fields = _checked_fields(values, shape)
    batch_shape = shape.batch_shape
    spec = AttentionSpec(
        q=_option_checks.flat(q, batch_shape, q.shape[-3:]),
        k=_option_checks.flat(k, batch_shape, k.shape[-3:]),
        v=_option_checks.flat(v, batch_shape, v.shape[-3:]),
        batch_shape=batch_shape,
        single_head=single,
        offset=offset_of(fields["align"], shape.length, shape.keys),
        kv_head=_option_checks.kv_heads(fields["gqa"], shape.heads, k.shape[-3]),
        qv_features=0 if values["qv"] is None else int(v.shape[-1]),
        **fields,
    )
    indices = sparse_indices.canonical_indices(
        values["key_indices"],
        values["key_block_indices"],
        values["key_block_size"],
        values["index_reading"],
        batch_shape=batch_shape,
        kv_heads=k.shape[-3],
        length=shape.length,
        keys=shape.keys,
        single_head=single,
    )
    if indices is not None:
        spec = with_indices(spec, indices, values["index_reading"])
    _option_checks.bad_bias_values(spec)
    return spec


def _field_check(row: Option):
    """The check of an option's kind: ``check(value, name, shape) -> {field: value}``."""
    if row.kind == "choice":
        return _option_checks.choice(row.choices)
    if row.kind == "per-head":
        return _option_checks.per_head(row.unit)
    if row.kind == "window":
        return lambda value, name, shape: {name: check_window(value)}
    return _KIND_CHECKS[row.kind]


_KIND_CHECKS = {
    "float": _option_checks.real,
    "positive float": _option_checks.positive,
    "probability": _option_checks.probability,
    "bool": _option_checks.flag,
    "float plane": _option_checks.float_plane,
    "bool plane": _option_checks.bool_plane,
    "per-batch": _option_checks.per_batch_length,
}


def _checked_fields(values: dict, shape) -> dict:
    """The :class:`AttentionSpec` fields of the options that keep their own field (all but
    the "inputs" and "indices" ones), each checked by its kind, in :data:`OPTIONS`' order."""
    fields = {}
    for row in OPTIONS:
        if row.into not in ("inputs", "indices"):
            fields.update(_field_check(row)(values[row.name], row.name, shape))
    if fields["dropout_p"] > 0 and fields["dropout_mask"] is None:
        raise ValueError(
            "dropout_mask: dropout is deterministic in refattn; dropout_p > 0 needs a boolean "
            "keep-mask broadcastable to (..., H, L, S)"
        )
    return fields
