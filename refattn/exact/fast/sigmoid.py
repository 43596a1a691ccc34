"""Fast exact sigmoid attention forward (``normalizer="sigmoid"``): the compiled first step,
the referee for the rest (the host side).

:func:`fast_sigmoid_forward` runs :func:`refattn.exact.fast.sigmoid_kernels.sigmoid_dd` (its
module docstring holds the error analysis: double-double scores, ``sigma`` from the proven
``exp_dd_fast`` enclosure with a rigorous bound on ``1 / (1 + e^{-t})``, Dot2 sums with
midpoint-radius bounds, the rounding decision per element) on every query row of the planes
it can take, and sends the rows it leaves undecided -- and whole planes with NaN/Inf or
magnitudes outside [SAFE_MIN, SAFE_MAX] in q, k or v, or a scale, softcap or ALiBi slope
outside it -- to the referee, :func:`refattn.exact.attention_sigmoid.exact_sigmoid_forward`,
restricted to those rows (:func:`refattn.exact.fast.forward.row_spec`). The results are
bit-identical to the referee's alone (``config.SIGMOID_EXACT_ENGINE = "referee"``).

For targets of at most 24 bits (float32, float16, bfloat16) without weights, a cheaper
dense double-precision step (:func:`refattn.exact.fast.sigmoid_dense.sigmoid_dense`: the
softmax engine's tiled fma-chain scores with ``gamma_D`` bounds, the branch-free ``exp_d``,
blocked tiled sums with ``gamma_{SUM_BLOCK + S / SUM_BLOCK}``; radii about 2**-40 relative;
its module docstring holds the error analysis) runs first; only the rows it leaves undecided
run the double-double step.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import parallel_chunksize

from ...spec import AttentionSpec
from ..attention_sigmoid import exact_sigmoid_forward
from ..rounding import format_of
from ._params import frozen
from .allowed_set import allowed_rule
from .forward import DenseInputs, redo_blocks, referee_runs, row_spec
from .forward_kernels import D_ROW_BLOCK, ROW_BLOCK, bias_in_range
from .sigmoid_dense import sigmoid_dense
from .sigmoid_kernels import UNDECIDED, sigmoid_dd

__all__ = ["fast_sigmoid_forward", "sigmoid_enclosures", "sigmoid_fallback_stats"]

_LAST_STATS: dict = {}


def _inputs(spec: AttentionSpec):
    """(double-double step's record, dense step's record, planes (B, H) the first steps take),
    from the softmax engine's one compiled pass over q, K and V (:class:`~refattn.exact.fast.
    forward.DenseInputs`: K^T with KEY_TILE zero keys past S, V with zero features up to a multiple
    of KEY_TILE); the double-double step reads V unpadded, the dense step |V| too."""
    x = DenseInputs(spec)
    vdim = spec.v.shape[3]
    facts = (x.qn, x.kn, x.qs, x.ks, x.vmax, x.vnorm, x.prm, x.kvh)
    v = frozen(np.ascontiguousarray(x.v[..., :vdim]))
    record = tuple(frozen(a) for a in (x.q, x.kT, v, *facts))
    dense = (tuple(frozen(a) for a in (x.q, x.kT, x.v, *facts)), frozen(np.abs(x.v)))
    return record, dense, x.ok


def _row_groups(todo: np.ndarray) -> np.ndarray:
    """(n, 3 + ROW_BLOCK) int64 (b, h, count, rows...): the rows ``todo`` (B, H, L) marks,
    grouped by plane in increasing order, at most ROW_BLOCK a group."""
    items = np.argwhere(todo)
    groups = []
    for b, h in np.unique(items[:, :2], axis=0):
        rows = np.flatnonzero(todo[b, h])
        for start in range(0, rows.size, ROW_BLOCK):
            chunk = rows[start : start + ROW_BLOCK]
            groups.append([b, h, chunk.size, *chunk, *([0] * (ROW_BLOCK - chunk.size))])
    return np.array(groups, dtype=np.int64).reshape(-1, 3 + ROW_BLOCK)


def _blocks(planes: np.ndarray, length: int) -> np.ndarray:
    """(n, 4) int64 (b, h, first row, rows) of the dense step's row blocks (D_ROW_BLOCK rows)
    of the planes taken."""
    starts = np.arange(0, length, D_ROW_BLOCK)
    taken = np.argwhere(planes)
    blocks = np.empty((taken.shape[0] * starts.size, 4), dtype=np.int64)
    blocks[:, :2] = np.repeat(taken, starts.size, axis=0)
    blocks[:, 2] = np.tile(starts, taken.shape[0])
    blocks[:, 3] = np.minimum(D_ROW_BLOCK, length - blocks[:, 2])
    return blocks


def sigmoid_enclosures(spec: AttentionSpec, step: str = "double-double"):
    """(hi, lo, radius) (B, H, L, E, 3) of one first step's enclosures of out (before the
    rounding decision; ``step`` "double-double", "double" (the dense step's two passes: the
    rows the first leaves run the second) or "double-magnitude" (its second pass alone, on
    every row)) and the status (B, H, L) of each row (OK where the row was enclosed and
    decided for float64, or float32 for the dense steps; rows of other status hold zeros or
    partial enclosures), for tests.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.spec import canonicalize
    >>> spec = canonicalize(np.zeros((1, 2)), np.zeros((2, 2)), np.array([[1.0], [2.0]]),
    ...                     normalizer="sigmoid")
    >>> enclosure, status = sigmoid_enclosures(spec)
    >>> hi, lo, radius = enclosure[0, 0, 0, 0]
    >>> float(hi), float(lo), bool(0 < radius < 1e-25), status.tolist()
    (1.5, 0.0, True, [[[0]]])
    """
    batch, heads, _, length, _, _, vdim = spec.dims
    enclosure = np.zeros((batch, heads, length, vdim, 3))
    fmt = format_of(np.float64 if step == "double-double" else np.float32)
    _, _, status = _first_step(spec, fmt, False, (enclosure, step))
    return enclosure, status


def _constant_bias(rule: tuple) -> tuple:
    """(rule, bias) for the dense step: a bias constant over (B, H, L, S) (all strides zero:
    a scalar), finite and in the first steps' range, and no mask or keep-mask, taken out of
    the rule (``has_bias`` False) and returned as a float to add to every score; else the rule
    as it is and 0.0."""
    rows_lo, rows_hi, mask, mask_st, bias, bias_st, keep, keep_st, has_mask, has_bias, has_keep = (
        rule
    )
    if has_bias and not has_mask and not has_keep and not np.any(bias_st):
        value = float(bias[0])
        if value != 0.0 and math.isfinite(value) and bias_in_range(value):
            plain = (rows_lo, rows_hi, mask, mask_st, bias, bias_st, keep, keep_st)
            return (*plain, has_mask, False, has_keep), value
    return rule, 0.0


def _first_step(spec, fmt, want_weights, enclosure=None):
    """(out, weights, status) of the compiled first steps on the planes they take;
    ``enclosure`` = (array, step name) runs that step alone and records its enclosures."""
    batch, heads, _, length, keys, _, vdim = spec.dims
    out = np.zeros((batch, heads, length, vdim))
    weights = np.zeros((batch, heads, length, keys) if want_weights else (1, 1, 1, 1))
    status = np.full((batch, heads, length), UNDECIDED, dtype=np.int8)
    if out.size and spec.sinks is None:
        inputs, dense, ok = _inputs(spec)
        todo = np.broadcast_to(ok[:, :, None], status.shape)
        want_enclosure = enclosure is not None
        steps = ("double", "double-double") if enclosure is None else (enclosure[1],)
        enclosure = np.zeros((1, 1, 1, 1, 3)) if enclosure is None else enclosure[0]
        target = (bool(want_weights), want_enclosure, fmt.p, fmt.emin, float(fmt.max_finite))
        rule = allowed_rule(spec).kernel_args()
        results = (out, weights, status, enclosure)
        # chunks of one block: causal blocks differ in cost, and equal contiguous chunks per
        # thread would leave the costly late rows to one thread
        with parallel_chunksize(1):
            dense = dense if fmt.p <= 24 and not want_weights and todo.any() else None
            rule_d, bias = _constant_bias(rule)
            workers = 4 * numba.get_num_threads()  # the dense step's scratch sets
            if dense and "double" in steps:
                first = (False, np.zeros(0, np.int64), bias, workers)
                sigmoid_dense(_blocks(ok, length), *dense, rule_d, target, results, first)
                todo = todo & (status == UNDECIDED)
            if dense and ("double" in steps or "double-magnitude" in steps):
                blocks, row_list = redo_blocks(todo)  # again, with tighter dot-product bounds
                if blocks.size:
                    second = (True, row_list, bias, workers)
                    sigmoid_dense(blocks, *dense, rule_d, target, results, second)
                    todo = todo & (status == UNDECIDED)
            if todo.any() and "double-double" in steps:
                sigmoid_dd(_row_groups(todo), inputs, rule, target, results)
    return out, weights, status


def fast_sigmoid_forward(spec: AttentionSpec, out_dtype, *, return_lse=False, return_weights=False):
    """Correctly rounded (out, None, weights) of a sigmoid call in the flat (B, H, ...) layout,
    bit-identical to :func:`refattn.exact.attention_sigmoid.exact_sigmoid_forward` (see the
    module docstring). Shapes: out (B, H, L, E), weights (B, H, L, S).

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.spec import canonicalize
    >>> spec = canonicalize(np.zeros((1, 2)), np.zeros((2, 2)), np.array([[1.0], [2.0]]),
    ...                     normalizer="sigmoid")
    >>> fast_sigmoid_forward(spec, np.float64)[0].tolist()  # (1 + 2) / 2
    [[[[1.5]]]]
    """
    if return_lse:
        raise ValueError("return_lse: normalizer='sigmoid' has no log-sum-exp")
    fmt = format_of(out_dtype)
    batch, heads, _, length, _, _, _ = spec.dims
    out, weights, status = _first_step(spec, fmt, return_weights)
    results, asked = (out, None, weights), (False, return_weights)
    referee_rows = referee_runs(
        spec, status, out_dtype, results, asked, row_spec, exact_sigmoid_forward
    )
    _LAST_STATS.clear()
    _LAST_STATS.update(rows=batch * heads * length, referee_rows=referee_rows)
    dtype = fmt.dtype
    return out.astype(dtype), None, weights.astype(dtype) if return_weights else None


def sigmoid_fallback_stats() -> dict:
    """``rows`` and ``referee_rows`` (rows the referee recomputed) of the last
    :func:`fast_sigmoid_forward` call.

    Examples
    --------
    >>> set(sigmoid_fallback_stats()) <= {"rows", "referee_rows"}
    True
    """
    return dict(_LAST_STATS)
