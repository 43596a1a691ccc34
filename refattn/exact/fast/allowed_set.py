"""The allowed set of attention without (L, S) arrays: what the streaming exact kernels read.

Row i of batch row b may read key j when ``lo_i <= j < hi_i`` (the structural key interval of
:meth:`refattn.spec.AttentionSpec.intervals`: causal, window, key length) and, only where the
caller passed them, the mask allows it and the bias is not -inf
(:func:`refattn.spec.position_allowed`, compiled there); the dropout keep-mask then selects the
kept keys. The mask, bias and keep-mask are read from their un-broadcast elements
(:func:`compact_view`). Together this is the one rule of
:meth:`refattn.spec.AttentionSpec.allowed`, taken from :mod:`refattn.spec`; the forward
(:func:`key_state`, per key) and the vjp (:func:`allowed_row`, per run of keys) read it from
the same :class:`AllowedRule`.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from ...spec import AttentionSpec, position_allowed_jit
from ._params import R_ROWS_HI, R_ROWS_LO, RULE

__all__ = [
    "AllowedRule",
    "allowed_rule",
    "compact_view",
    "key_state",
    "allowed_row",
    "rule_allowed",
    "allowed_plane",
]

_JIT = dict(nopython=True, cache=True, fastmath=False, error_model="numpy", nogil=True)


def compact_view(view, dtype):
    """A (B, H, L, S) view (zero strides where broadcast) as (flat C array of its distinct
    elements, int64 (4,) element strides, 0 along broadcast axes); (one zero, zeros) for None.
    Only the un-broadcast elements are copied: never a (B, H, L, S) array for a broadcast
    view.

    Examples
    --------
    >>> data, strides = compact_view(np.broadcast_to(np.arange(3.0), (2, 4, 5, 3)), np.float64)
    >>> data.tolist(), strides.tolist()
    ([0.0, 1.0, 2.0], [0, 0, 0, 1])
    """
    if view is None:
        return np.zeros(1, dtype), np.zeros(4, np.int64)
    view = np.asarray(view)
    core = view[
        tuple(
            slice(0, 1) if st == 0 or n == 1 else slice(None)
            for st, n in zip(view.strides, view.shape, strict=True)
        )
    ]
    core = np.require(core, dtype, ["C", "W"])  # writable: the kernels see one array type
    strides = np.array(
        [
            0 if n == 1 else st // core.itemsize
            for st, n in zip(core.strides, core.shape, strict=True)
        ],
        np.int64,
    )
    return core.ravel(), strides


class AllowedRule(NamedTuple):
    """The allowed set of every plane without an (L, S) array: the structural key intervals
    (int64 (B, L) ``rows_lo``, ``rows_hi``) and the compact mask, bias and dropout keep-mask
    with their element strides (:func:`compact_view`; a 1-element dummy with zero strides
    when absent, so a read of an absent array is a read of its one element).

    The kernels take :meth:`kernel_args` (a plain tuple in this field order)."""

    rows_lo: np.ndarray
    rows_hi: np.ndarray
    mask: np.ndarray
    mask_strides: np.ndarray
    bias: np.ndarray
    bias_strides: np.ndarray
    keep: np.ndarray
    keep_strides: np.ndarray
    has_mask: bool
    has_bias: bool
    has_keep: bool

    def kernel_args(self) -> tuple:
        """The fields as a plain tuple: the form every compiled kernel takes."""
        return tuple(self)


def allowed_rule(spec: AttentionSpec) -> AllowedRule:
    """The rule the kernels read the allowed set and the dropout keep-mask from; equal to
    :meth:`AttentionSpec.allowed` (``tests/exact/test_fast_exact.py`` checks it).

    Examples
    --------
    >>> from refattn.spec import canonicalize
    >>> spec = canonicalize(np.zeros((3, 2)), np.zeros((4, 2)), np.zeros((4, 1)), causal=True)
    >>> rule = allowed_rule(spec)
    >>> rule.rows_hi.tolist(), rule.has_mask
    ([[1, 2, 3]], False)
    """
    rows_lo, rows_hi = spec.intervals()
    return AllowedRule(
        rows_lo,
        rows_hi,
        *compact_view(spec.mask, np.bool_),
        *compact_view(spec.bias, np.float64),
        *compact_view(spec.dropout_mask, np.bool_),
        spec.mask is not None,
        spec.bias is not None,
        spec.dropout_mask is not None,
    )


@numba.jit(**_JIT)
def key_state(rule, b, h, i, j):
    """(state, bias) of key j inside row i's structural interval: state 0 excluded (mask, or
    bias -inf: :func:`refattn.spec.position_allowed`), 1 allowed, 2 allowed and kept (dropout);
    the bias value (0 without bias). ``rule``: :meth:`AllowedRule.kernel_args`."""
    _, _, mask, mask_st, bias, bias_st, keep, keep_st, has_mask, has_bias, has_keep = rule
    mask_value = mask[b * mask_st[0] + h * mask_st[1] + i * mask_st[2] + j * mask_st[3]]
    bias_value = bias[b * bias_st[0] + h * bias_st[1] + i * bias_st[2] + j * bias_st[3]]
    if not position_allowed_jit(has_mask, mask_value, has_bias, bias_value):
        return 0, 0.0
    bv = bias_value if has_bias else 0.0
    if has_keep and not keep[b * keep_st[0] + h * keep_st[1] + i * keep_st[2] + j * keep_st[3]]:
        return 1, bv
    return 2, bv


@numba.jit(**_JIT)
def allowed_row(rule, b, h, i, lo, hi, allowed, kept):
    """Keys ``lo .. hi`` of row i of plane (b, h) of the allowed set
    (:func:`refattn.spec.position_allowed`) and of the kept set (allowed and the dropout
    keep-mask) into ``allowed[:hi - lo]``, ``kept[:hi - lo]``; ``[lo, hi)`` lies inside the
    row's structural key interval. ``rule``: :meth:`AllowedRule.kernel_args`."""
    _, _, mask, mask_st, bias, bias_st, keep, keep_st, has_mask, has_bias, has_keep = rule
    m0 = b * mask_st[0] + h * mask_st[1] + i * mask_st[2]
    k0 = b * keep_st[0] + h * keep_st[1] + i * keep_st[2]
    b0 = b * bias_st[0] + h * bias_st[1] + i * bias_st[2]
    for j in range(lo, hi):
        ok = position_allowed_jit(
            has_mask, mask[m0 + j * mask_st[3]], has_bias, bias[b0 + j * bias_st[3]]
        )
        allowed[j - lo] = ok
        kept[j - lo] = ok and (not has_keep or keep[k0 + j * keep_st[3]])


if AllowedRule._fields != RULE:  # pragma: no cover (the one layout, read by name in the kernels)
    raise AssertionError("AllowedRule: its fields must be refattn.exact.fast._params.RULE")


def rule_allowed(rule: AllowedRule, b: int, h: int, keys: int) -> tuple[np.ndarray, np.ndarray]:
    """(allowed, kept) (L, S) of plane (b, h) as the forward kernels read them from ``rule``
    (the key intervals and :func:`key_state`), for tests."""
    args = rule.kernel_args()
    allowed = np.zeros((rule.rows_lo.shape[1], keys), dtype=bool)
    kept = np.zeros_like(allowed)
    for i, (lo, hi) in enumerate(zip(rule.rows_lo[b], rule.rows_hi[b], strict=True)):
        for j in range(lo, hi):
            state, _ = key_state(args, b, h, i, j)
            allowed[i, j], kept[i, j] = state > 0, state == 2
    return allowed, kept


@numba.jit(**_JIT)
def _allowed_plane(rule, b, h, allowed, kept):
    rows_lo, rows_hi = rule[R_ROWS_LO], rule[R_ROWS_HI]
    for i in range(allowed.shape[0]):
        lo, hi = rows_lo[b, i], rows_hi[b, i]
        allowed_row(rule, b, h, i, lo, hi, allowed[i, lo:], kept[i, lo:])


def allowed_plane(spec: AttentionSpec, b: int, h: int) -> tuple[np.ndarray, np.ndarray]:
    """(allowed, kept) bool (L, S) of plane (b, h) as the vjp kernels compute them row by row
    (:func:`allowed_row`): for tests, which compare them with
    :meth:`refattn.spec.AttentionSpec.allowed`."""
    _, _, _, length, keys, _, _ = spec.dims
    allowed = np.zeros((length, keys), np.bool_)
    kept = np.zeros((length, keys), np.bool_)
    _allowed_plane(allowed_rule(spec).kernel_args(), b, h, allowed, kept)
    return allowed, kept
