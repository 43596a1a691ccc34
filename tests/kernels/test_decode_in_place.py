"""The key-split forward with one query row per kv head (an MHA decode step) reads k and v in
place (refattn.kernels._cpu_decode): bfloat16 k and v as their bits, widened as they load,
give the bits of the same inputs widened to float32 first; a non-finite value row of an
excluded key reaches no result; the range check reads max |x| from the bits
(refattn.kernels.abs_max) and still refuses scores beyond float32."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import refattn
from refattn.kernels import abs_max

BF16 = ml_dtypes.bfloat16


def _decode(rng, dtype, keys=2100, dim=32, vdim=32):
    q = rng.standard_normal((1, 2, 1, dim)).astype(dtype)
    k = rng.standard_normal((1, 2, keys, dim)).astype(dtype)
    v = rng.standard_normal((1, 2, keys, vdim)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("options", [{}, {"causal": True, "window": (1500, 0)}])
def test_bfloat16_bits_match_float32_inputs(options):
    q, k, v = _decode(np.random.default_rng(0), BF16)
    bits = refattn.attention(q, k, v, return_lse=True, backend="numba", **options)
    wide = [np.asarray(a, np.float32) for a in (q, k, v)]
    ref = refattn.attention(*wide, return_lse=True, backend="numba", **options)
    for what, a, b in zip(("out", "lse"), bits, ref, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b), (
            f"bfloat16 decode {what} differs from the float32-widened inputs' "
            f"(max diff {np.max(np.abs(a.astype(np.float64) - b))})"
        )


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_nonfinite_value_of_an_excluded_key_is_invisible(dtype):
    rng = np.random.default_rng(1)
    q, k, v = _decode(rng, dtype)
    mask = np.ones((1, 2, 1, k.shape[2]), bool)
    mask[..., 10] = False
    clean = refattn.attention(q, k, v, mask=mask, return_lse=True, backend="numba")
    for poison in (np.nan, np.inf, -np.inf):
        pv = v.copy()
        pv[:, :, 10] = poison
        dirty = refattn.attention(q, k, pv, mask=mask, return_lse=True, backend="numba")
        for what, a, b in zip(("out", "lse"), dirty, clean, strict=True):
            assert np.array_equal(a, b), f"poison {poison} in excluded v row 10 changed {what}"


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, BF16])
def test_abs_max_is_the_largest_finite_magnitude(dtype):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(3001) * 3).astype(dtype)
    x[[5, 7, 9]] = (np.nan, np.inf, -np.inf)
    wide = x.astype(np.float64)
    expected = float(np.max(np.abs(wide[np.isfinite(wide)])))
    assert abs_max(x) == expected, f"{np.dtype(dtype).name}: {abs_max(x)} != {expected}"
    assert abs_max(x[[5, 7, 9]]) == 0.0, "no finite value: 0"
    wide_view = np.broadcast_to(x[None, ::2], (1000, 1501))  # read without materialising
    assert abs_max(wide_view) == float(np.max(np.abs(wide[::2][np.isfinite(wide[::2])])))


def test_range_check_reads_bfloat16_bits():
    q, k, v = _decode(np.random.default_rng(3), BF16)
    k[0, 1, 7, 3] = 1e30
    with pytest.raises(ValueError, match="max \\|k\\| 1e\\+30"):
        refattn.attention(q, k, v, backend="numba")
