"""The decode step of the fast exact forward: a few query rows against long keys, k and v read
in place from their storage dtype (the host side; the kernels are in
:mod:`refattn.exact.fast.decode_kernels`).

A decode call (L = 1 or a few query rows, S long) does little arithmetic per key: the dense
first step's set-up (float64 copies of k and v, a transposed padded K^T and the facts of every
key and value, :mod:`refattn.exact.fast.facts`) costs several times its double step. This step
replaces that set-up and the dense double step's first pass for targets of at most 24 bits
(float32, float16, bfloat16) when L <= :data:`DECODE_ROWS`, k and v are plain arrays (not
codes) of bfloat16, float16, float32 or float64. Per (batch row, kv head) plane, in one pass
over its keys and one over its values:

* each key row is read as integer bits and widened to float64 as it loads (exact: every
  bfloat16, float16 and float32 value is a float64). Its facts are those of
  :func:`refattn.exact.fast.facts.row_fact`: in range (zero or a magnitude in [SAFE_MIN,
  SAFE_MAX]: for bfloat16, float16 and float32, no Inf or NaN in the stored bits); a 2-norm
  bound ``fl(sum_d k_d^2)^(1/2) (1 + 2**-30) + 2**-1000`` (the squares summed in 8 lanes, each
  square through at most D roundings: gamma_D < 2**-30 relative, Higham 2002, eq. (3.5), for
  any order of the sum); the exactness scale ``||k|| / 2**g`` with g the exponent of the least
  ulp of its elements read from the bits (a lower bound of the lowest set bit, so an upper
  bound of the scale), and the lowest set bit itself only for the keys where that bound does
  not prove every row's dot product exact. Every query row of the plane's heads (G L rows)
  takes its dot product with the widened row at once;
* each value row likewise, SUM_BLOCK keys per tile, with max |v_je| and the sum of squares per
  feature (the 2-norm bound as for the keys).

The arithmetic per row is that of the dense double step's first pass
(:func:`refattn.exact.fast.forward_kernels.forward_d`, whose bounds the module docstring of
:mod:`refattn.exact.fast.forward` states) but for the order of the dot products: ``q_i . k_j``
is 8 lane fma chains (lane l over d = l mod 8, from +0) whose lanes are then added in order.
Each product passes through at most D roundings, so ``|error| <= gamma_D |q_i|.|k_j| <=
gamma_D ||q_i|| ||k_j||`` (Higham 2002, eq. (3.5), which holds for any order of the sum, and
Cauchy-Schwarz), zero where the exactness scales prove every partial sum representable
(``qs_i ks_j < 2**52``: every partial sum, in any order, is a multiple of ``2**(g_q + g_k)``
of magnitude below ``||q|| ||k||``); each later rounding is bounded by
``1.01 u |result|`` (Higham 2002, eq. (2.5)); ``e = exp_d(x)`` with relative error EXP_D_REL;
Z and ``N_e = sum_j e_j v_je`` are blocked sums (SUM_BLOCK keys per block, aligned on the key
index; ``gamma_{B + S/B}``, Higham 2002, sec. 4.2) with ``|N - N^| <= (gamma + rho) A_e`` and
``A_e <= min(max_j |v_je| Z, (sum_j e_j^2)^(1/2) ||v_e||)`` (Cauchy-Schwarz); ``out = N / Z``
(the quotient of enclosures, ``(rN + |N/Z| rZ) / (Z - rZ)``) and ``lse = m + log Z`` are
decided by :func:`~refattn.exact.fast.rounding_decision.decide_one` (every element; the dense
step tries a cheaper sufficient test first). For float32 and
float64 k and v (whose dot products are rarely proven exact) two bounds of the dense second
pass are taken in the same passes: the dot product's error is also bounded by its running error
bound ``u sab`` (``sab`` the float sum of the magnitudes of its rounded results: each rounding
errs by at most u times its result, Higham 2002, eq. (2.5) and sec. 3.1), the smaller bound
kept, and ``A_e <= fl(sum_j e_j |v_je|) (1 + 4 gamma)`` (the same blocked sums over |v|). The
maximum and the 2-norm of the values are
taken over the keys the plane's rows read (``[lo, hi)``, the union of their intervals), which
bounds the same sums; the keys outside it are read only for the range test, so a NaN anywhere
in a plane's k or v sends the plane to the referee as in the dense step. The enclosures are
therefore of the dense first pass's width; the dot products and norms are summed in another
order, so their last bits may differ, and a row within a few ulps of a decision may be decided
by one step and left by the other: either way its result is the referee's (the exact result
rounded once).

The rows it leaves undecided go on through the dense steps exactly as before: the second
double pass with magnitude-sum bounds, the double-double step, the refined step, the referee
(:func:`refattn.exact.fast.forward.fast_exact_forward` builds their inputs only when a row is
left). Planes whose inputs, scale, softcap, ALiBi slope or sink are out of range, rows with a
bias out of range and empty rows are left undecided (the referee's, as in the dense step).

The work items are the (batch row, kv head) planes; each row's arithmetic is fixed by the
shapes alone, so no bit depends on the thread count. Steps of at most
:data:`SERIAL_ELEMENTS` elements of k and v, and steps of one plane, run on one thread (on a
small step a parallel region costs more than it saves).
"""

from __future__ import annotations

import numpy as np

from ..._arrays import read_only
from ...spec import AttentionSpec
from .allowed_set import allowed_rule
from .decode_kernels import BF16, F16, F32, F64, HALF_SCALES, decode_parallel, decode_serial

__all__ = ["DECODE_ROWS", "GROUP_ROWS", "SERIAL_ELEMENTS", "decode_applies", "decode_first_step"]

#: Query rows per plane (L) up to which the decode step replaces the dense first pass.
DECODE_ROWS = 8
#: Query rows per kv plane (G L, the rows of a work item) up to which it does: its working
#: memory is a few (G L, S) float64 arrays, as the dense step's (D_ROW_BLOCK, S) per worker.
GROUP_ROWS = 32
#: Elements of k and v up to which the decode step runs on one thread (and with one plane it
#: always does), as the Numba decode kernels. Measured on a shared 2-core machine (B1 H8 L1
#: D128 bfloat16, S = 2048): two threads took 2.1 ms against 3.1 ms on one at load 3.1, but
#: 14 ms against 2.9 ms at load 3.4 (a parallel region waits for its slowest thread).
SERIAL_ELEMENTS = 2**23

#: Storage dtype name -> (kind of :mod:`refattn.exact.fast.decode_kernels`, bits dtype).
_KINDS = {
    "bfloat16": (BF16, np.int16),
    "float16": (F16, np.int16),
    "float32": (F32, np.int32),
    "float64": (F64, np.int64),
}


def decode_applies(spec: AttentionSpec, kv, fmt) -> bool:
    """Whether :func:`decode_first_step` takes the call: a target of at most 24 bits, k and v
    plain arrays (``kv`` None) of one of bfloat16, float16, float32, float64 (the same for
    both), q of one of them, 1 <= L <= :data:`DECODE_ROWS`, at most :data:`GROUP_ROWS` query
    rows per kv head (G L) and S >= 1.

    Examples
    --------
    >>> from refattn.spec import canonicalize
    >>> from refattn.exact.rounding import FORMATS
    >>> spec = canonicalize(np.zeros((1, 4)), np.zeros((64, 4)), np.zeros((64, 4)))
    >>> [decode_applies(spec, None, FORMATS[name]) for name in ("float32", "float64")]
    [True, False]
    """
    _, _, _, length, keys, _, _ = spec.dims
    names = {np.dtype(a.dtype).name for a in (spec.k, spec.v)}
    group = int(np.bincount(np.asarray(spec.kv_head)).max()) if spec.kv_head.size else 0
    return (
        kv is None
        and fmt.p <= 24
        and 1 <= length <= DECODE_ROWS
        and group * length <= GROUP_ROWS
        and keys >= 1
        and len(names) == 1
        and names <= set(_KINDS)
        and np.dtype(spec.q.dtype).name in _KINDS
    )


def _bits(a: np.ndarray) -> np.ndarray:
    """``a`` C-contiguous, viewed as the integer bits of its dtype (read-only; no copy when it
    already is C-contiguous)."""
    _, bits = _KINDS[np.dtype(a.dtype).name]
    return read_only(np.ascontiguousarray(a).view(bits))


def decode_first_step(spec: AttentionSpec, kv, fmt, asked, results, params) -> int:
    """Run the decode step on every plane when :func:`decode_applies`; returns the rows it
    evaluated (0: it does not apply, and ``status`` is untouched).

    ``asked`` = (return_lse, return_weights); ``results`` = (out (B, H, L, E), lse (B, H, L),
    weights (B, H, L, S) or a (1, 1, 1, 1) dummy, status int8 (B, H, L)) float64, written row
    by row (status OK, EMPTY or UNDECIDED of :mod:`refattn.exact.fast.forward_kernels`);
    ``params``: :func:`refattn.exact.fast.forward.kernel_params` (the plane parameters and
    which planes are in range).

    Examples
    --------
    >>> from refattn.spec import canonicalize
    >>> from refattn.exact.rounding import FORMATS
    >>> from refattn.exact.fast.forward import kernel_params
    >>> spec = canonicalize(np.zeros((1, 2)), np.zeros((2, 2)), np.array([[1.0], [2.0]]))
    >>> out, lse, w = np.zeros((1, 1, 1, 1)), np.zeros((1, 1, 1)), np.zeros((1, 1, 1, 1))
    >>> status = np.full((1, 1, 1), 2, np.int8)
    >>> decode_first_step(spec, None, FORMATS["float32"], (False, False),
    ...                   (out, lse, w, status), kernel_params)
    1
    >>> out.ravel().tolist(), status.ravel().tolist()
    ([1.5], [0])
    """
    if not decode_applies(spec, kv, fmt):
        return 0
    batch, heads, kv_heads, length, _, _, _ = spec.dims
    kind, _ = _KINDS[np.dtype(spec.k.dtype).name]
    prm, ok = params(spec)
    q = read_only(np.ascontiguousarray(spec.q, dtype=np.float64))  # G L rows per plane: small
    ok = np.ascontiguousarray(ok & (length > 0))
    kvh = np.ascontiguousarray(spec.kv_head, dtype=np.int64)
    inputs = (q, _bits(spec.k), _bits(spec.v), kind, HALF_SCALES, read_only(prm), ok, kvh)
    items = np.array([(b, g) for b in range(batch) for g in range(kv_heads)], np.int64)
    items = items.reshape(-1, 2)
    target = (bool(asked[0]), bool(asked[1]), fmt.p, fmt.emin, float(fmt.max_finite))
    small = spec.k.size + spec.v.size <= SERIAL_ELEMENTS or items.shape[0] < 2
    step = decode_serial if small else decode_parallel
    step(items, inputs, allowed_rule(spec).kernel_args(), target, results)
    return batch * heads * length
