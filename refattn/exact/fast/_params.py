"""The parameter vectors of the fast exact engine's kernels, read by NAME.

Each vector is laid out by one tuple of slot names; the kernels index it by module-level int
constants generated from that tuple (compile-time constants in Numba), never by a bare number:

* ``prm`` (B, H, 16) float64 of the forward's first steps (:data:`PRM`, constants ``P_*``,
  built by :func:`refattn.exact.fast.forward.kernel_params`);
* ``opts`` int64 of the vjp (:data:`VJP_OPTS`, constants ``VO_*``; the ALiBi offsets of the B
  batch rows follow from slot ``VO_OFFSETS``);
* ``fopts`` float64 of the vjp (:data:`VJP_FOPTS`, constants ``VF_*``);
* the allowed-set rule (:data:`RULE`, constants ``R_*``).
"""

from __future__ import annotations

import numpy as np

from ..._arrays import read_only


def frozen(a, dtype=None):
    """``a`` as a C-contiguous, read-only array in ``dtype`` (a view when it already is
    C-contiguous in that dtype): :func:`refattn._arrays.read_only` after the layout, so each
    compiled pass has one specialisation per dtype.

    Examples
    --------
    >>> frozen(np.arange(3.0)).flags.writeable
    False
    """
    return read_only(np.ascontiguousarray(a, dtype=dtype))


#: Slots of the forward's ``prm``: the scale as a double-double with its error, the relative
#: bound of a D-term Dot2 dot product, the softcap (0: off), the head's ALiBi slope and the
#: batch row's ALiBi offset, the relative bound of the sum of Z, the keep scale 1/(1-p) as a
#: double-double with its error, gamma_D and gamma of the blocked sums, the keys ALiBi applies
#: to, whether there is a sink, and the head's sink logit.
PRM = (
    "scale_hi",
    "scale_lo",
    "scale_err",
    "dot_rel",
    "softcap",
    "slope",
    "alibi_offset",
    "sum_rel",
    "keep_hi",
    "keep_lo",
    "keep_err",
    "gamma_dim",
    "gamma_sum",
    "alibi_keys",
    "has_sink",
    "sink",
)
#: Slots of the vjp's integer ``opts`` (the B ALiBi offsets follow).
VJP_OPTS = (
    "has_bias",
    "has_alibi",
    "has_softcap",
    "alibi_keys",
    "dropout",
    "has_mask",
    "has_dropout_mask",
    "offsets",
)
#: Slots of the vjp's float ``fopts``: the scale (double-double and error), the softcap (1 when
#: off), the keep scale (double-double and error) and the Dot2 bounds of dot products of
#: length D (scores), E (dp), S (dq) and G L (dk, dv).
VJP_FOPTS = (
    "scale_hi",
    "scale_lo",
    "scale_err",
    "softcap",
    "keep_hi",
    "keep_lo",
    "keep_err",
    "dot_d",
    "dot_e",
    "dot_s",
    "dot_gl",
)


#: Fields of the allowed-set rule the kernels take
#: (:meth:`refattn.exact.fast.allowed_set.AllowedRule.kernel_args`, constants ``R_*``).
RULE = (
    "rows_lo",
    "rows_hi",
    "mask",
    "mask_strides",
    "bias",
    "bias_strides",
    "keep",
    "keep_strides",
    "has_mask",
    "has_bias",
    "has_keep",
)


def index_constants(prefix: str, names) -> dict:
    """``{PREFIX + NAME: slot}`` for a tuple of slot names.

    Examples
    --------
    >>> index_constants("P_", ("scale_hi", "scale_lo"))
    {'P_SCALE_HI': 0, 'P_SCALE_LO': 1}
    """
    return {prefix + name.upper(): slot for slot, name in enumerate(names)}


# P_SCALE_HI ... P_SINK, VO_HAS_BIAS ... VO_OFFSETS, VF_SCALE_HI ... VF_DOT_GL,
# R_ROWS_LO ... R_HAS_KEEP
_SLOTS = {
    **index_constants("P_", PRM),
    **index_constants("VO_", VJP_OPTS),
    **index_constants("VF_", VJP_FOPTS),
    **index_constants("R_", RULE),
}
globals().update(_SLOTS)

__all__ = ["PRM", "VJP_OPTS", "VJP_FOPTS", "RULE", "index_constants", *_SLOTS]  # noqa: PLE0604
