"""The double-precision step of the fast exact gather ends rows cheaply where it may: float32
outputs decided from one-word quotients (refattn.exact.fast.gather_kernels.float32_outputs),
the exponential's error bound (exp_rel), the value sums without their magnitude sums and
those summed one feature at a time (gather_lanes.sums_rows, magnitude_sum: the bits of
weighted_rows), and the work items' head blocks."""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numba
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refattn.exact.fast import gather_kernels as GK
from refattn.exact.fast import gather_lanes as GL
from refattn.exact.fast.forward_kernels import RHO_MAX, SUM_BLOCK
from refattn.exact.rounding import format_of, round_exact

F32 = format_of(np.float32)

_finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
_scale = st.integers(-140, 130)


def _corners(n, nr, z, zr):
    """The four corner quotients (N +- r_N) / (Z -+ r_Z), exact."""
    n, nr, z, zr = (Fraction(x) for x in (n, nr, z, zr))
    return [(n + a * nr) / (z + c * zr) for a in (-1, 1) for c in (-1, 1)]


@given(
    st.lists(st.tuples(_finite, _scale, st.integers(-70, 0)), min_size=1, max_size=6),
    st.floats(0.5, 2.0),
    _scale,
    st.integers(-80, -1),
)
def test_float32_outputs_decide_only_the_rounding_of_every_enclosed_value(cols, zm, ze, zre):
    z = math.ldexp(zm, ze)
    zr = math.ldexp(z, zre)
    ns = np.array([math.ldexp(math.frexp(x)[0], e) for x, e, _ in cols])
    nr = np.array([abs(x) * 2.0**r for x, (_, _, r) in zip(ns, cols, strict=True)])
    out = np.full((1, 1, 1, ns.size), np.nan)
    flags = np.zeros(ns.size, np.bool_)
    count = GK.float32_outputs((0, 0, 0), (z, zr), (ns, nr), out, flags)
    if not zr < 0.5 * z:
        assert count == -1 and flags.all()
        return
    assert count == flags.sum()
    for e in np.flatnonzero(~flags):
        want = {round_exact(q, F32) for q in _corners(ns[e], nr[e], z, zr)}
        signs = {math.copysign(1.0, w) for w in want}
        assert want == {out[0, 0, 0, e]} and len(signs) == 1
        assert math.copysign(1.0, out[0, 0, 0, e]) in signs
        assert abs(out[0, 0, 0, e]) <= F32.max_finite


def test_float32_outputs_flag_midpoints_zero_and_overflow_and_redo_only_flagged():
    near = 1.0 + 2.0**-23 + 2.0**-30  # a float32 neighbour of 1 plus a hair
    ns = np.array([near, 1.5, 0.0, 1e39, -1e-50, 1e-50])
    nr = np.array([2.0**-22, 0.0, 2.0**-80, 0.0, 0.0, 1e-49])
    out = np.zeros((1, 1, 1, ns.size))
    flags = np.zeros(ns.size, np.bool_)
    assert GK.float32_outputs((0, 0, 0), (1.0, 0.0), (ns, nr), out, flags) == 4
    assert flags.tolist() == [True, False, True, True, False, True]
    assert out[0, 0, 0, 1] == 1.5
    assert out[0, 0, 0, 4] == 0.0 and math.copysign(1.0, out[0, 0, 0, 4]) == -1.0
    nr[0] = 0.0  # the radius shrinks: only the flagged features are redone
    out[0, 0, 0, 1] = 7.0
    assert GK.float32_outputs((0, 0, 0), (1.0, 0.0), (ns, nr), out, flags) == 3
    assert out[0, 0, 0, 1] == 7.0 and not flags[0]
    assert out[0, 0, 0, 0] == round_exact(Fraction(near), F32) == 1.0 + 2.0**-23


@given(st.floats(0.0, 2.0**-40), st.floats(0.0, 1.0))
def test_exp_rel_bounds_the_exponentials_relative_error(rel, xe):
    bound = GK.exp_rel(rel, xe)
    with mpmath.workprec(200):
        worst = max(
            abs((1 + mpmath.mpf(a) * rel) * mpmath.exp(mpmath.mpf(d) * xe) - 1)
            for a in (-1, 1)
            for d in (-1, 1)
        )
    assert worst <= bound
    assert math.isinf(GK.exp_rel(rel, 1.5)) and math.isinf(GK.exp_rel(rel, math.nan))
    assert GK.exp_rel(0.0, RHO_MAX / 2) <= RHO_MAX


@pytest.mark.skipif(numba.config.DISABLE_JIT, reason="bit equality holds for compiled loops")
@pytest.mark.parametrize("vdim,rows", [(512, 16), (45, 11), (3, 1)])
def test_value_sums_alone_and_one_magnitude_sum_keep_the_bits(vdim, rows):
    rng = np.random.default_rng(vdim + rows)
    n = 2 * SUM_BLOCK + 13
    vp = rng.standard_normal((n + 7, vdim))
    cols = rng.permutation(n + 7)[:n]
    wts = rng.random((rows, n)) * 2.0 ** rng.integers(-60, 2, (rows, n))
    use = rng.random((rows, n)) > 0.2
    want_n, want_a = np.zeros((rows, vdim)), np.zeros((rows, vdim))
    got_n = np.zeros((rows, vdim))
    for j0 in range(0, n, SUM_BLOCK):
        j1 = min(j0 + SUM_BLOCK, n)
        for r in range(rows):
            GL.weighted_block(vp, cols, j0, j1, wts[r], use[r], want_n[r], want_a[r])
        GL.sums_rows(vp, cols, j0, j1, rows, wts, use, got_n)
    assert got_n.tobytes() == want_n.tobytes()
    for r in range(rows):
        for e in (0, vdim // 2, vdim - 1):
            got = GL.magnitude_sum(vp, cols, n, SUM_BLOCK, wts[r], use[r], e)
            assert got == want_a[r, e]


@pytest.mark.parametrize("heads,kv,length,threads", [(16, 1, 1, 2), (128, 1, 1, 2), (6, 2, 3, 4)])
def test_work_items_take_every_head_once(heads, kv, length, threads):
    from refattn.exact.fast.gather import _Gathered
    from refattn.kernels import gather_spec
    from refattn.spec import canonicalize

    rng = np.random.default_rng(heads)
    q = rng.standard_normal((heads, length, 4))
    k = rng.standard_normal((kv, 9, 4))
    spec = canonicalize(q, k, k)
    spec = gather_spec(spec, rng.integers(-1, 9, (kv, length, 5)))
    items = _Gathered(spec).items(length, threads)
    seen = sorted((int(it[0]), int(it[1]), int(h)) for it in items for h in it[3 : 3 + it[2]])
    assert seen == sorted((0, i, h) for h in range(heads) for i in range(length))
    assert all(0 < it[2] <= GK.HEAD_BLOCK for it in items)
