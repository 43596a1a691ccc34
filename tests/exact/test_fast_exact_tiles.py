"""The tiled double-precision first step of the fast exact forward: its building blocks equal the
ones they replace (exp_d_core and exp_d bit for bit, the one-pass key and value facts and
row_facts), and the step agrees with the referee on shapes that exercise the padding (S and E
not multiples of the register tile, rows spanning several 32-row blocks), on the plain path
(no mask, bias, dropout, softcap or ALiBi) and the general one."""

from __future__ import annotations

import ml_dtypes
import numba
import numpy as np
import pytest

import refattn
from refattn import config
from refattn.exact.fast import doubledouble as D
from refattn.exact.fast import facts as FF
from refattn.exact.fast import forward_kernels as FK
from refattn.exact.fast._params import frozen


@numba.njit(cache=False)
def _both_exps(x, a, b):
    for n in range(x.size):
        a[n] = D.exp_d(x[n])
        b[n] = D.exp_d_core(x[n])


def test_exp_d_core_is_exp_d_bit_for_bit():
    """On exp_d's whole domain, including the multiples of ln2/64 (rint's ties) and +-0."""
    rng = np.random.default_rng(0)
    lo, hi = D.EXP_MIN_ARG - 1.0, D.EXP_MAX_ARG + 1.0
    steps = np.arange(int(lo * 64 / np.log(2)) + 1, int(hi * 64 / np.log(2)), 97)
    x = np.concatenate(
        [rng.uniform(lo, hi, 20000), rng.uniform(-1e-3, 1e-3, 2000), steps * np.log(2) / 64]
    )
    x = np.concatenate([x, np.nextafter(x, 0.0), [0.0, -0.0, lo, hi]])
    a, b = np.empty_like(x), np.empty_like(x)
    _both_exps(x, a, b)
    assert np.array_equal(a.view(np.int64), b.view(np.int64))


def _row_facts(flat):
    out = [np.empty(flat.shape[0], t) for t in (np.bool_, np.float64, np.float64)]
    FF.row_facts(frozen(flat), frozen(flat).view(np.int64), out[1], out[2], out[0])
    return out


@pytest.mark.parametrize("keys,dim", [(1, 3), (45, 16), (70, 40)])
def test_key_and_value_facts_equal_row_facts(keys, dim):
    """key_facts: K^T and the keys' (ok, norm, scale) of row_facts; value_facts: the features'
    (ok, norm) of row_facts over V^T and max |v| (zero padding features do not count)."""
    rng = np.random.default_rng(keys)
    k = rng.standard_normal((2, 3, keys, dim)).astype(ml_dtypes.bfloat16).astype(np.float64)
    k[0, 1, 0, :] = 0.0
    k[1, 2, -1, 0] = np.inf
    k[0, 0, -1, -1] = 2.0**-1040  # subnormal: outside the first steps' range
    k = frozen(k)
    pad = FK.KEY_TILE
    kT = np.full((2, 3, dim, keys + pad), 7.0)
    kn, ks = np.empty(k.shape[:3]), np.empty(k.shape[:3])
    ok = np.empty(k.shape[:3], np.bool_)
    FF.plane_key_facts(k, kT, kn, ks, ok)
    assert np.array_equal(kT[..., :keys], np.swapaxes(k, 2, 3))
    assert (kT[..., keys:] == 7.0).all()  # the pad is the caller's
    want = _row_facts(k.reshape(-1, dim))
    for got, ref in zip((ok, kn, ks), want, strict=True):
        assert np.array_equal(got.reshape(-1), ref)
    epad = -(-dim // pad) * pad
    v = np.zeros(k.shape[:3] + (epad,))
    v[..., :dim] = k
    vn = np.empty((2, 3, dim))
    vm = np.empty((2, 3, dim))
    v_ok = np.empty((2, 3, dim), np.bool_)
    FF.plane_value_facts(frozen(v), vn, vm, v_ok)
    want = _row_facts(np.ascontiguousarray(np.swapaxes(k, 2, 3)).reshape(-1, keys))
    assert np.array_equal(v_ok.reshape(-1), want[0])
    finite = want[0]
    assert np.array_equal(vn.reshape(-1)[finite], want[1][finite])
    assert np.array_equal(
        vm.reshape(-1)[finite], np.abs(np.swapaxes(k, 2, 3)).max(axis=3).reshape(-1)[finite]
    )


def _exact(engine, q, k, v, out_dtype, **opts):
    saved = config.EXACT_ENGINE
    config.EXACT_ENGINE = engine
    try:
        return refattn.attention(
            q, k, v, precision="exact", out_dtype=out_dtype, return_lse=True, **opts
        )
    finally:
        config.EXACT_ENGINE = saved


@pytest.mark.parametrize(
    "opts",
    [
        dict(causal=True, align="bottom_right"),
        dict(window=(9, 0), causal=True),
        dict(mask=np.random.default_rng(5).random((1, 1, 70, 75)) < 0.8),
        dict(causal=True, softcap=3.0),
    ],
    ids=["plain-causal", "window", "mask", "softcap"],
)
def test_tiled_step_matches_the_referee(opts):
    """70 rows (three 32-row blocks, the last partial) over 75 keys (not a multiple of the
    32-key tile), E = 9 (padded to 32): the fast engine's bits are the referee's."""
    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, 2, 70, 16)).astype(ml_dtypes.bfloat16)
    k = rng.standard_normal((1, 2, 75, 16)).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((1, 2, 75, 9)).astype(ml_dtypes.bfloat16)
    for out_dtype in ("bfloat16", "float32"):
        fast = _exact("fast", q, k, v, out_dtype, **opts)
        stats = refattn.exact.fast.fallback_stats()
        assert stats["double_rows"] == 140
        ref = _exact("referee", q, k, v, out_dtype, **opts)
        for a, b in zip(fast, ref, strict=True):
            assert np.array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))
