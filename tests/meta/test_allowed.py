"""The oracle's one allowed-set helper (oracle.reading.allowed) and the diagnosis alternatives that
move
the causal frontier, each checked against a loop over (i, j) that states the rule directly."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from oracle.diagnose.diagnosis import alternatives
from oracle.reading.allowed import allowed_positions
from oracle.reading.baseline import textbook_attention

SETTINGS = [
    dict(causal=causal, window=window, align=align)
    for causal, window, align in itertools.product(
        (False, True), (None, (1, None), (None, 0), (2, 1)), ("top_left", "bottom_right")
    )
]


def _loop(L, S, *, causal, window, align, key_count=None, frontier=0):
    """Row i reads key j: j < S_b, causal j <= i + o + frontier, window sides around i + o."""
    keys = S if key_count is None else key_count
    offset = 0 if align == "top_left" else keys - L
    allowed = np.zeros((L, S), dtype=bool)
    for i in range(L):
        for j in range(keys):
            diag = i + offset
            ok = not causal or j <= diag + frontier
            if window is not None:
                left, right = window
                ok &= left is None or j >= diag - left
                ok &= right is None or j <= diag + right
            allowed[i, j] = ok
    return allowed


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("L, S", [(3, 5), (5, 3), (4, 4)])
def test_allowed_positions_is_the_rule(setting, L, S):
    np.testing.assert_array_equal(allowed_positions(L, S, **setting), _loop(L, S, **setting))


@pytest.mark.parametrize("setting", SETTINGS)
def test_kv_lengths_align_each_row_to_its_own_length(setting):
    L, S, lengths = 3, 6, np.array([0, 2, 4, 6])
    allowed = allowed_positions(L, S, kv_lengths=lengths, **setting)
    assert allowed.shape == (4, 1, L, S)
    for b, length in enumerate(lengths):
        np.testing.assert_array_equal(allowed[b, 0], _loop(L, S, key_count=int(length), **setting))


def test_mask_and_neginf_bias_exclude():
    mask = np.array([[True, False, True]])
    bias = np.array([[0.0, 0.0, -np.inf]])
    allowed = allowed_positions(1, 3, mask=mask, bias=bias)
    assert allowed.astype(int).tolist() == [[1, 0, 0]]


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("window", [None, (2, None), (1, 0)])
@pytest.mark.parametrize("kv_lengths", [None, np.array([3, 6])])
def test_causal_frontier_alternatives_move_the_frontier_by_one_key(align, window, kv_lengths):
    L, S, H = 4, 6, 2
    batch = 2
    options = {"causal": True, "window": window, "align": align, "kv_lengths": kv_lengths}
    shape = (batch, H)
    q = np.ones(shape + (L, 4))
    k = np.ones(shape + (S, 4))
    found = {
        a.label: a
        for a in alternatives(
            options, H=H, K=H, L=L, S=S, D=4, E=4, has_empty=False, has_excluded=True
        )
    }
    for label, frontier in (
        ("causal excludes the diagonal (j < i + offset)", -1),
        ("causal admits one key past the diagonal", 1),
    ):
        changed, _ = found[label].apply(dict(options), {})
        allowed = np.broadcast_to(
            textbook_attention(q, k, k, dtype="float64", **changed).allowed, shape + (L, S)
        )
        for b in range(batch):
            keys = S if kv_lengths is None else int(kv_lengths[b])
            expected = _loop(
                L, S, causal=True, window=window, align=align, key_count=keys, frontier=frontier
            )
            if frontier > 0 and window is not None and window[1] is not None:
                # the alternative widens the window's right side to the new frontier too
                expected = _loop(
                    L,
                    S,
                    causal=True,
                    window=(window[0], None),
                    align=align,
                    key_count=keys,
                    frontier=frontier,
                )
            for h in range(H):
                np.testing.assert_array_equal(allowed[b, h], expected, err_msg=label)
