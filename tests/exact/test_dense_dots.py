"""The dense double-precision step's second pass (refattn.exact.fast.dense_dots): the
magnitude-sum bound of its dot products encloses the exact dot product (mpmath, exact at the
working precision used), the quick rounding decision (decide_quick) decides only correctly
rounded values, and rows the second pass decides equal the referee's."""

from __future__ import annotations

from fractions import Fraction

import mpmath
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import refattn
from refattn import config
from refattn.exact.fast import dense_dots as DD
from refattn.exact.fast import doubledouble as D
from refattn.exact.fast import forward as FA
from refattn.exact.fast.rounding_decision import decide_one, decide_quick
from refattn.exact.rounding import FORMATS, round_exact

NAMES = sorted(FORMATS)


def _padded_keys(k):
    """K^T (D, S + pad) with zero keys up to a multiple of KEY_TILE and KEY_TILE more."""
    keys, dim = k.shape
    npad = max(DD.KEY_TILE, -(-keys // DD.KEY_TILE) * DD.KEY_TILE)
    kT = np.zeros((dim, npad + DD.KEY_TILE))
    kT[:, :keys] = k.T
    return kT, npad


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 6),
    keys=st.integers(1, 40),
    dim=st.integers(1, 70),
    spread=st.integers(0, 40),
    zeros=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_magnitude_bound_encloses_the_exact_dot_product(rows, keys, dim, spread, zeros, seed):
    """|s - q.k| <= mag_error(sab, D) against the dot product summed by mpmath at a working
    precision where it is exact (products of doubles, exponents within +-2 (spread + 60))."""
    rng = np.random.default_rng(seed)

    def draw(shape):
        x = rng.standard_normal(shape) * np.exp2(rng.integers(-spread, spread + 1, shape))
        if zeros:
            x[rng.random(shape) < 0.3] = 0.0
        return x

    q, k = draw((rows, dim)), draw((keys, dim))
    kT, npad = _padded_keys(k)
    s = np.zeros((rows, npad + DD.KEY_TILE))
    sab = np.zeros_like(s)
    DD.block_dots_mag(q, kT, np.arange(rows), rows, 0, npad, s, sab)
    with mpmath.workprec(8 * (spread + 64) + 2 * dim):
        for r in range(rows):
            for j in range(keys):
                exact = mpmath.fsum(
                    mpmath.mpf(a) * mpmath.mpf(b) for a, b in zip(q[r], k[j], strict=True)
                )
                err = abs(mpmath.mpf(s[r, j]) - exact)
                assert err <= mpmath.mpf(DD.mag_error(sab[r, j], dim)), (r, j)
    assert not s[:, keys:npad].any()  # the zero padding keys give exact zeros


def test_magnitude_bound_is_tighter_than_the_a_priori_one():
    """On random data the magnitude sums sit well inside gamma_D ||q|| ||k|| (Higham 2002,
    eq. (3.5)): that is what lets the second pass decide rows the first left."""
    rng = np.random.default_rng(0)
    dim = 64
    q, k = rng.standard_normal((8, dim)), rng.standard_normal((96, dim))
    kT, npad = _padded_keys(k)
    s = np.zeros((8, npad + DD.KEY_TILE))
    sab = np.zeros_like(s)
    DD.block_dots_mag(q, kT, np.arange(8), 8, 0, npad, s, sab)
    prior = D.gamma_up(dim) * np.outer(np.linalg.norm(q, axis=1), np.linalg.norm(k, axis=1))
    mag = np.vectorize(lambda x: DD.mag_error(x, dim))(sab[:, : k.shape[0]])
    assert (mag < prior).all()


@st.composite
def _enclosures(draw):
    name = draw(st.sampled_from(NAMES))
    fmt = FORMATS[name]
    mant = draw(st.integers(2 ** (fmt.p - 1), 2**fmt.p - 1))
    exp = draw(st.integers(-20, 20))
    grid = Fraction(mant) * Fraction(2) ** (exp - fmt.p + 1)  # a value of the format
    half = Fraction(2) ** (exp - fmt.p)  # half its spacing above
    where = draw(st.sampled_from(["on", "midpoint", "between"]))
    offset = {"on": 0, "midpoint": half, "between": half * Fraction(draw(st.integers(1, 99)), 100)}
    x = grid + offset[where] + Fraction(draw(st.integers(-(2**20), 2**20))) * half * 2.0**-60
    x = -x if draw(st.booleans()) else x
    mh = float(x)
    ml = float(x - Fraction(mh))
    r = float(abs(x)) * 2.0 ** -draw(st.integers(fmt.p - 2, 70)) * draw(st.sampled_from([0, 1]))
    return fmt, mh, ml, r


@settings(max_examples=400, deadline=None)
@given(case=_enclosures())
def test_decide_quick_decides_only_the_rounding_of_the_whole_enclosure(case):
    """Where decide_quick decides, both ends of mh + ml +- r round to its value (exact rational
    rounding), and it decides wherever decide_one does, with the same value."""
    fmt, mh, ml, r = case
    args = (fmt.p, fmt.emin, float(fmt.max_finite))
    value, decided = decide_quick(mh, ml, r, *args)
    one, one_decided = decide_one(mh, ml, r, *args)
    mid = Fraction(mh) + Fraction(ml)
    if decided:
        for end in (mid - Fraction(r), mid + Fraction(r)):
            assert round_exact(end, fmt) == value
    if one_decided:
        assert decided and value == one


def _exact(engine, q, k, v):
    saved = config.EXACT_ENGINE
    config.EXACT_ENGINE = engine
    try:
        return refattn.attention(q, k, v, precision="exact", out_dtype=np.float32, return_lse=True)
    finally:
        config.EXACT_ENGINE = saved


def test_rows_of_the_second_pass_equal_the_referee():
    """A float32 shape where the first pass leaves rows (its a-priori dot bound) and the
    second pass decides them all: bit-identical to the referee engine."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, 32, 64)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 128, 64)).astype(np.float32) for _ in range(2))
    fast = _exact("fast", q, k, v)
    stats = FA.fallback_stats()
    assert stats["double_magnitude_rows"] > 0
    assert stats["double_double_rows"] == 0 and stats["referee_rows"] == 0
    slow = _exact("referee", q, k, v)
    for a, b in zip(fast, slow, strict=True):
        assert np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
