"""The exact path cross-checked by an independent library: FLINT's arb balls
(refattn.exact.certify) must certify every result and contradict none."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import refattn
from tests.strategies import attention_cases

pytest.importorskip("flint", reason="python-flint (the 'certify' extra) is not installed")
from refattn.exact.certify import certify_attention  # noqa: E402

DTYPES = {
    "float64": np.float64,
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
}


@pytest.mark.parametrize("name", sorted(DTYPES))
@given(data=st.data())
def test_arb_certifies_the_exact_path(name, data):
    q, k, v, opts = data.draw(attention_cases(max_len=6, max_dim=5))
    out, lse = refattn.attention(
        q, k, v, precision="exact", out_dtype=DTYPES[name], return_lse=True, **opts
    )
    report = certify_attention(q, k, v, out, lse, out_dtype=DTYPES[name], **opts)
    assert report.ok, (
        f"arb contradicts {int(report.contradicted.sum())} element(s) "
        f"({name}, options {sorted(opts)})"
    )
    # exact ties (equal scores) may stay undecided for arb; everything else is certified
    assert report.certified.sum() + report.undecided.sum() == report.certified.size


def test_arb_contradicts_a_one_ulp_change():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((4, 6)), rng.standard_normal((5, 6)), rng.standard_normal((5, 3))
    out = refattn.attention(q, k, v, precision="exact")
    tampered = out.copy()
    tampered[2, 1] = np.nextafter(tampered[2, 1], np.inf)
    report = certify_attention(q, k, v, tampered)
    assert not report.ok and report.contradicted.sum() == 1
