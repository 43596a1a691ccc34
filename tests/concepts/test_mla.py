"""refattn.mla: the absorbed MLA decode call equals the non-absorbed multi-head computation.

Inputs on a coarse dyadic grid make every product and sum of the up-projections exact in
float64, so the absorbed and non-absorbed calls have the same real scores: their exact lse
agree bit for bit, and so do their exact outputs when ``w_uv`` selects latent features; with
a general ``w_uv`` the projected absorbed output is within the projection's rounding of the
non-absorbed exact one. Both kernel forms (FlashMLA's 576-wide key, FlashAttention 3's qv) give
the same bits on the exact path.
"""

from __future__ import annotations

import numpy as np
import pytest

import refattn
from refattn import mla
from refattn.bounds import float64_forward_bound, gamma
from tests.helpers import assert_same_bits, assert_within

H, L, S, NOPE, ROPE, C, DV = 4, 2, 6, 4, 2, 8, 3


def _grid(rng, shape, bits=3):
    """Integers in [-8, 8] times 2**-bits: products and short sums are exact in float64."""
    return rng.integers(-8, 9, size=shape) * 2.0**-bits


def _weights(seed):
    rng = np.random.default_rng(seed)
    return {
        "q_nope": _grid(rng, (H, L, NOPE)),
        "q_rope": _grid(rng, (H, L, ROPE)),
        "latent": _grid(rng, (S, C)),
        "k_rope": _grid(rng, (S, ROPE)),
        "w_uk": _grid(rng, (H, NOPE, C)),
    }, _grid(rng, (H, DV, C))


@pytest.mark.parametrize("form", mla.FORMS)
@pytest.mark.parametrize("options", [{}, {"causal": True, "align": "bottom_right"}], ids=str)
def test_absorbed_equals_multihead_exactly(form, options):
    inputs, w_uv = _weights(1)
    call = mla.absorbed_inputs(**inputs, form=form)
    assert call["scale"] == mla.model_scale(NOPE, ROPE)  # the model's head dim, not C + ROPE
    if form == "flashmla":
        assert np.shares_memory(call["v"], call["k"]) and call["k"].shape[-3] == 1
    latent, lse = refattn.attention(**call, **options, return_lse=True, precision="exact")
    select = np.zeros((H, DV, C))
    select[:, np.arange(DV), np.arange(DV) + 1] = 1.0  # w_uv picks latent features 1..DV
    full = mla.multihead_inputs(**inputs, w_uv=select)
    want, want_lse = refattn.attention(**full, **options, return_lse=True, precision="exact")
    assert_same_bits(lse, want_lse, what="lse", case=f"absorbed {form} {options}")
    assert_same_bits(mla.output_projection(latent, select), want, what="out", case=form)
    # a general w_uv: one rounding of the latent output, then the projection's
    general = refattn.attention(**mla.multihead_inputs(**inputs, w_uv=w_uv), **options,
                                precision="exact")  # fmt: skip
    bound = np.abs(mla.output_projection(np.abs(latent), np.abs(w_uv))) * gamma(C + 1)
    assert_within(mla.output_projection(latent, w_uv), general, bound, what="out", case=form)


def test_the_two_forms_are_the_same_call():
    inputs, _ = _weights(2)
    got = {
        form: refattn.attention(**mla.absorbed_inputs(**inputs, form=form), precision="exact")
        for form in mla.FORMS
    }
    assert_same_bits(got["fa3"], got["flashmla"], what="out", case="fa3 vs flashmla")


def test_float64_absorbed_inside_its_bound():
    rng = np.random.default_rng(3)
    inputs = {
        "q_nope": rng.standard_normal((H, L, NOPE)),
        "q_rope": rng.standard_normal((H, L, ROPE)),
        "latent": rng.standard_normal((S, C)),
        "k_rope": rng.standard_normal((S, ROPE)),
        "w_uk": rng.standard_normal((H, NOPE, C)),
    }
    call = mla.absorbed_inputs(**inputs)
    got = refattn.attention(**call)
    bound, _ = float64_forward_bound(**call)
    assert_within(got, refattn.attention(**call, precision="exact"), bound, what="out", case="mla")


def test_bad_weights_name_themselves():
    inputs, _ = _weights(0)
    with pytest.raises(ValueError, match="w_uk: expected \\(H, d_h, C\\)"):
        mla.absorbed_inputs(**{**inputs, "w_uk": inputs["w_uk"][:, :, :3]})
    with pytest.raises(ValueError, match="form"):
        mla.absorbed_inputs(**inputs, form="paged")
