"""refattn.attention_vjp: exact path vs mpmath central differences of the independent loop
reference, float64 path within its derived bound, GQA/broadcast reductions, empty rows."""

from __future__ import annotations

import mpmath
import numpy as np
import pytest
from hypothesis import given

import refattn
from oracle.judging.tolerance import ulp
from refattn.bounds import float64_vjp_bound
from tests.helpers import assert_within
from tests.naive.attention import naive_attention
from tests.strategies import attention_cases

STEP = mpmath.mpf(2) ** -40  # central-difference step; truncation ~ STEP**2 |f'''|


def _objective(q, k, v, bias, do, gl, opts):
    out, lse, _ = naive_attention(q, k, v, bias=bias, dps=60, **opts)
    total = mpmath.mpf(0)
    for h, row_h in enumerate(out):
        for i, row in enumerate(row_h):
            total += mpmath.fsum(x * do[h, i, e] for e, x in enumerate(row))
            if gl is not None and mpmath.isfinite(lse[h][i]):
                total += lse[h][i] * gl[h, i]
    return total


def _central_differences(arrays, name, do, gl, opts):
    """d objective / d arrays[name], elementwise, with a Richardson error estimate."""
    base = arrays[name]
    grad, err = np.zeros(base.shape), np.zeros(base.shape)
    with mpmath.workdps(60):
        for index in np.ndindex(base.shape):
            if not np.isfinite(float(base[index])):
                continue
            estimates = []
            for step in (STEP, 2 * STEP):
                values = []
                for sign in (1, -1):
                    moved = {n: a.copy() for n, a in arrays.items()}
                    moved[name][index] = mpmath.mpf(float(base[index])) + sign * step
                    values.append(
                        _objective(moved["q"], moved["k"], moved["v"], moved["bias"], do, gl, opts)
                    )
                estimates.append((values[0] - values[1]) / (2 * step))
            grad[index] = float(estimates[0])
            err[index] = float(abs(estimates[1] - estimates[0]))  # ~ 3x the error of [0]
    return grad, err


CASES = {
    "plain": {},
    "gqa-causal-bottom-right": {"causal": True, "align": "bottom_right", "gqa": "tile"},
    "softcap-alibi-window": {
        "softcap": 1.5,
        "alibi_slopes": np.array([0.5, 0.25]),
        "window": (1, 0),
    },
    "dropout-mask-empty-row": {
        "dropout_p": 0.25,
        "mask": np.array([[[1, 1, 0], [0, 0, 0]], [[1, 0, 1], [1, 1, 1]]], dtype=bool),
    },
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_exact_vjp_matches_central_differences(name):
    rng = np.random.default_rng(sorted(CASES).index(name))
    q = rng.standard_normal((2, 2, 2))
    k, v = rng.standard_normal((1, 3, 2)), rng.standard_normal((1, 3, 2))
    bias = rng.standard_normal((2, 2, 3))
    do, gl = rng.standard_normal((2, 2, 2)), rng.standard_normal((2, 2))
    opts = dict(CASES[name])
    if "dropout_p" in opts:
        opts["dropout_mask"] = rng.random((2, 2, 3)) < 0.7
    grads = refattn.attention_vjp(q, k, v, do, grad_lse=gl, bias=bias, precision="exact", **opts)
    arrays = {
        "q": q.astype(object),
        "k": k.astype(object),
        "v": v.astype(object),
        "bias": bias.astype(object),
    }
    for label, exact in zip(("q", "k", "v", "bias"), grads[:4], strict=True):
        fd, richardson = _central_differences(arrays, label, do, gl, opts)
        # exact is the correctly rounded derivative: within half an ulp of it, plus the
        # finite-difference truncation (Richardson estimate, doubled for safety)
        bound = 0.5 * ulp(fd, "float64") + 2 * richardson
        assert_within(exact, fd, bound, what=f"d{label}", case=name)


@given(case=attention_cases(max_len=5, max_dim=4))
def test_float64_vjp_within_bound(case):
    q, k, v, opts = case
    rng = np.random.default_rng(q.size)
    do = rng.standard_normal(q.shape[:-1] + v.shape[-1:])
    gl = rng.standard_normal(q.shape[:-1])
    f64 = refattn.attention_vjp(q, k, v, do, grad_lse=gl, **opts)
    exact = refattn.attention_vjp(q, k, v, do, grad_lse=gl, precision="exact", **opts)
    bounds = float64_vjp_bound(q, k, v, do, grad_lse=gl, **opts)
    for label, a, b, bound in zip(("dq", "dk", "dv"), f64[:3], exact[:3], bounds[:3], strict=True):
        assert_within(a, b, bound, what=label, case=str(sorted(opts)))
    if "bias" in opts:
        assert exact.dbias.shape == np.shape(opts["bias"])
        plane = bounds[3].sum(axis=0)  # bias (L, S) was broadcast over H
        assert_within(f64.dbias, exact.dbias, plane, what="dbias", case=str(sorted(opts)))
    else:
        assert exact.dbias is None and f64.dbias is None


@pytest.mark.parametrize("precision", ["float64", "exact"])
def test_gqa_gradients_sum_over_the_group(precision):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((4, 3, 2))
    k, v = rng.standard_normal((2, 5, 2)), rng.standard_normal((2, 5, 3))
    do = rng.standard_normal((4, 3, 3))
    grouped = refattn.attention_vjp(q, k, v, do, precision=precision)
    index = np.arange(4) // 2
    repeated = refattn.attention_vjp(q, k[index], v[index], do, precision=precision)
    assert grouped.dk.shape == (2, 5, 2) and grouped.dv.shape == (2, 5, 3)
    summed_dk = repeated.dk.reshape(2, 2, 5, 2).sum(axis=1)
    summed_dv = repeated.dv.reshape(2, 2, 5, 3).sum(axis=1)
    # two correctly rounded terms summed in float64: within 1.5 ulp of the exact sum
    for got, want, label in ((grouped.dk, summed_dk, "dk"), (grouped.dv, summed_dv, "dv")):
        assert_within(
            got,
            want,
            1.5 * ulp(want, "float64")
            + 2
            * ulp(
                np.abs(repeated.dk if label == "dk" else repeated.dv)
                .reshape(2, 2, *got.shape[1:])
                .max(axis=1),
                "float64",
            ),
            what=label,
        )


@pytest.mark.parametrize("precision", ["float64", "exact"])
def test_empty_rows_have_zero_gradients(precision):
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((3, 2)), rng.standard_normal((4, 2)), rng.standard_normal((4, 2))
    mask = np.ones((3, 4), dtype=bool)
    mask[1] = False
    do = rng.standard_normal((3, 2))
    grads = refattn.attention_vjp(q, k, v, do, mask=mask, precision=precision)
    assert (grads.dq[1] == 0).all()
    without = refattn.attention_vjp(
        q[[0, 2]], k, v, do[[0, 2]], mask=mask[[0, 2]], precision=precision
    )
    np.testing.assert_array_equal(grads.dk, without.dk)
    np.testing.assert_array_equal(grads.dv, without.dv)


def test_dbias_has_the_shape_of_bias():
    rng = np.random.default_rng(6)
    q, k, v = (
        rng.standard_normal((2, 3, 4, 2)),
        rng.standard_normal((2, 3, 5, 2)),
        rng.standard_normal((2, 3, 5, 2)),
    )
    do = rng.standard_normal((2, 3, 4, 2))
    for shape in [(4, 5), (3, 1, 5), (2, 1, 4, 5), (1, 1, 1, 5)]:
        bias = rng.standard_normal(shape)
        for precision in ("float64", "exact"):
            grads = refattn.attention_vjp(q, k, v, do, bias=bias, precision=precision)
            assert grads.dbias.shape == shape, (shape, precision)


def test_bad_cotangent_shape_is_named():
    with pytest.raises(ValueError, match=r"grad_out: expected shape \(2, 1\)"):
        refattn.attention_vjp(
            np.zeros((2, 2)), np.zeros((3, 2)), np.zeros((3, 1)), np.zeros((2, 2))
        )
    with pytest.raises(ValueError, match=r"grad_lse: expected shape \(2,\)"):
        refattn.attention_vjp(
            np.zeros((2, 2)),
            np.zeros((3, 2)),
            np.zeros((3, 1)),
            np.zeros((2, 1)),
            grad_lse=np.zeros(3),
        )
