"""The tiled sigmoid kernels (refattn.kernels._cpu_sigmoid_tiles) against the scalar per-row
kernels (refattn.kernels._cpu_sigmoid): bit for bit (the same operations in the same order,
by construction), forward and vjp, over random shapes and options (masks, causal, windows,
softcap, bias, ALiBi, dropout, empty rows, key blocks cut short, decode steps, non-finite
values); and the same bits with 1 and 2 Numba threads. Their error bounds are checked by
tests/kernels/test_sigmoid_kernels.py (the dispatch runs the tiled kernels).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from refattn.kernels import _cpu_sigmoid, _cpu_sigmoid_tiles
from refattn.spec import canonicalize
from tests.helpers import digest_with_threads


def _spec(seed, dtype=np.float64, nonfinite=False):
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 3))
    K = int(rng.integers(1, 3))
    H = K * int(rng.integers(1, 3))
    L = int(rng.choice([1, 3, 64, 70]))
    S = int(rng.choice([1, 5, 64, 130]))
    D, E = int(rng.integers(1, 20)), int(rng.integers(1, 20))
    q = rng.standard_normal((B, H, L, D)) * 2
    k = rng.standard_normal((B, K, S, D))
    v = rng.standard_normal((B, K, S, E))
    if nonfinite:
        v[0, 0, rng.integers(S), rng.integers(E)] = rng.choice([np.inf, -np.inf, np.nan])
    opts = {"normalizer": "sigmoid"}
    if rng.random() < 0.5:
        opts["causal"] = True
        opts["align"] = str(rng.choice(["top_left", "bottom_right"]))
    if rng.random() < 0.3:
        opts["window"] = (int(rng.integers(0, 9)), int(rng.integers(0, 9)))
    if rng.random() < 0.4:
        mask = rng.random((B, H, L, S)) > 0.3
        mask[..., 0, :] = False  # an empty row
        opts["mask"] = mask
    if rng.random() < 0.5:
        bias = rng.standard_normal((B, H, L, S))
        bias[rng.random(bias.shape) < 0.1] = -np.inf
        opts["bias"] = bias
    if rng.random() < 0.3:
        opts["softcap"] = float(rng.uniform(1, 5))
    if rng.random() < 0.3:
        opts["alibi_slopes"] = rng.uniform(0.1, 1, H)
    if rng.random() < 0.3:
        opts["dropout_p"] = 0.25
        opts["dropout_mask"] = rng.random((B, H, L, S)) > 0.25
    spec = canonicalize(q.astype(dtype), k.astype(dtype), v.astype(dtype), **opts)
    return spec, rng.standard_normal((B, H, L, E)).astype(dtype)


def _same_bits(got, want, what):
    assert (got is None) == (want is None), what
    if got is None:
        return
    assert got.dtype == want.dtype and got.shape == want.shape, what
    same = (got == want) & (np.signbit(got) == np.signbit(want)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"{what}: {np.count_nonzero(~same)} elements differ"


@pytest.mark.parametrize("seed", range(6))
def test_tiled_equals_scalar_float64(seed):
    spec, grad = _spec(seed)
    for name, nonfinite in (("", False), (" non-finite v", True)):
        spec, grad = _spec(seed, nonfinite=nonfinite)
        got = _cpu_sigmoid_tiles.sigmoid_forward_tiled(spec, np.float64)
        _same_bits(got, _cpu_sigmoid.sigmoid_forward(spec, np.float64), f"out{name} seed {seed}")
    spec, grad = _spec(seed)
    tiled = _cpu_sigmoid_tiles.sigmoid_backward_tiled(spec, grad, np.float64)
    scalar = _cpu_sigmoid.sigmoid_backward(spec, grad, np.float64)
    for what, got, want in zip(("dq", "dk", "dv", "dbias"), tiled, scalar, strict=True):
        _same_bits(got, want, f"{what} seed {seed}")


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_tiled_equals_scalar_float32(seed):
    spec, grad = _spec(seed, np.float32)
    got = _cpu_sigmoid_tiles.sigmoid_forward_tiled(spec, np.float32)
    _same_bits(got, _cpu_sigmoid.sigmoid_forward(spec, np.float32), f"out seed {seed}")
    tiled = _cpu_sigmoid_tiles.sigmoid_backward_tiled(spec, grad, np.float32)
    scalar = _cpu_sigmoid.sigmoid_backward(spec, grad, np.float32)
    for what, got, want in zip(("dq", "dk", "dv", "dbias"), tiled, scalar, strict=True):
        _same_bits(got, want, f"{what} seed {seed}")


def digest(arrays) -> str:
    """sha256 of the arrays' bytes, in order (None as a marker)."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(b"none" if a is None else np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


_SCRIPT = """
import numpy as np, refattn
from tests.kernels.test_sigmoid_tiles import digest
rng = np.random.default_rng(3)
q, k, v = (rng.standard_normal((2, 4, 200, 16)) for _ in range(3))
go = rng.standard_normal((2, 4, 200, 16))
opts = dict(normalizer="sigmoid", causal=True, bias=rng.standard_normal((200, 200)), softcap=3.0)
out = refattn.attention(q, k, v, backend="numba", **opts)
g = refattn.attention_vjp(q, k, v, go, backend="numba", **opts)
step = refattn.attention(q[:, :, -1:], k, v, backend="numba", **dict(opts, bias=opts["bias"][-1:],
                         align="bottom_right"))
print(digest([out, *g, step]))
"""


def test_bit_identical_for_1_and_2_threads():
    one, two = (digest_with_threads(_SCRIPT, n, timeout=600) for n in (1, 2))
    assert one == two, f"sigmoid kernels differ between 1 ({one}) and 2 ({two}) threads"
