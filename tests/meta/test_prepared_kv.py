"""A diagnosis prepares its case's k and v once for all its readings
(oracle.reading.baseline.PreparedKV): every evaluation with the prepared arrays equals the
unprepared one to the bit, whatever the reading (GQA layout, softcap order, poisoned k or v,
key lengths, masks, ALiBi), and the prepared arrays apply only to the k and v they were made
for."""

from __future__ import annotations

import numpy as np
import pytest

from oracle.diagnose import diagnosis
from oracle.diagnose.models import exact_parts
from oracle.judging import tolerance as tol
from oracle.reading.baseline import PreparedKV, textbook_attention

H, K, L, S, D, E = 4, 2, 3, 37, 8, 6


def _inputs(seed, poison=None):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, H, L, D)).astype(np.float32)
    k = rng.standard_normal((2, K, S, D)).astype(np.float32)
    v = rng.standard_normal((2, K, S, E)).astype(np.float32)
    if poison == "k":
        k[0, 1, 5, 2] = np.nan
    if poison == "v":
        v[1, 0, 7, 3] = np.inf
    return q, k, v


def _same(a, b):
    """Equal to the bit (NaN where NaN), shapes and dtypes too."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


_READINGS = [
    {},
    {"gqa": "tile"},
    {"causal": True, "align": "bottom_right"},
    {"window": (4, 0), "softcap": 2.0},
    {"kv_lengths": np.array([30, 37])},
    {"mask": np.arange(S) % 3 != 0},
    {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625]), "causal": True},
    {"sinks": np.array([0.1, -0.2, 0.3, 0.0])},
]


@pytest.mark.parametrize("poison", [None, "k", "v"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_textbook_with_prepared_kv_is_bit_identical(poison, dtype):
    q, k, v = _inputs(1, poison)
    kv = PreparedKV(k, v)
    for options in _READINGS:
        for order in ("before_bias", "after_bias", "after_mask"):
            plain = textbook_attention(q, k, v, dtype=dtype, softcap_order=order, **options)
            again = textbook_attention(
                q, k, v, dtype=dtype, softcap_order=order, prepared=kv, **options
            )
            for a, b in zip(plain, again, strict=True):
                assert (a is None and b is None) or _same(a, b), (options, order)
    assert any(key[0] == "k" for key in kv._kept) and any(key[0] == "v" for key in kv._kept)


@pytest.mark.parametrize("poison", [None, "v"])
def test_parts_and_scales_with_prepared_kv_are_bit_identical(poison):
    q, k, v = _inputs(2, poison)
    kv = PreparedKV(k, v)
    for options in _READINGS[:3]:
        base, w3, v_h = exact_parts(q, k, v, options)
        base2, w3b, v_hb = exact_parts(q, k, v, options, prepared=kv)
        assert _same(w3, w3b) and _same(v_h, v_hb) and _same(base.out, base2.out)
        gqa = options.get("gqa")
        assert _same(
            tol.output_scale(w3, v, gqa=gqa), tol.output_scale(w3, v, gqa=gqa, prepared=kv)
        )
        for extras in ({"reweight": lambda w: w * 0.5}, {"zero_rows": 1}):
            plain = diagnosis._kernel_out(q, k, v, options, extras)
            again = diagnosis._kernel_out(q, k, v, options, extras, prepared=kv)
            assert all(_same(a, b) for a, b in zip(plain, again, strict=True))


def test_prepared_kv_applies_only_to_its_own_arrays():
    q, k, v = _inputs(3)
    other = PreparedKV(k.copy(), v.copy())  # equal values, other arrays: not used
    assert not other.applies(k, v)
    plain = textbook_attention(q, k, v, dtype="float64")
    again = textbook_attention(q, k, v, dtype="float64", prepared=other)
    assert _same(plain.out, again.out)
    assert not other._kept  # nothing was prepared for arrays it was not made for
