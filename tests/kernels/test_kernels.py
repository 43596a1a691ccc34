"""Tests of the Numba CPU attention kernels (refattn.kernels, backend="numba").

* forward and backward equal the float64 NumPy path within the kernels' a-priori bounds
  (:func:`refattn.kernels.numba_cpu.forward_error_bound`, ``backward_error_bound``) plus the
  float64 path's own bound, on a representative set of option combinations;
* poison (NaN/Inf) at excluded k, v, bias positions leaves the results bit-identical;
* bit-identical results for NUMBA_NUM_THREADS=1 and 2 (subprocesses) and across runs;
* a NUMBA_DISABLE_JIT=1 tier (subprocess) runs the kernel bodies as Python;
* the polynomial exp kernels against mpmath.

The first run compiles the kernels (about a minute per dtype); ``cache=True`` keeps them in
refattn/kernels/__pycache__ for later runs.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import mpmath
import numpy as np
import pytest

import refattn
from oracle.judging.tolerance import ulp_distance
from refattn.kernels import numba_cpu
from refattn.spec import canonicalize
from tests.helpers import assert_within, digest_with_threads

ROOT = Path(__file__).resolve().parents[2]

# name -> (shape overrides, options builder(rng, B, H, L, S) -> dict)
_B, _H = 2, 2


def _mask(rng, L, S, p=0.3):
    return rng.random((_B, _H, L, S)) > p


def _bias(rng, L, S):
    bias = rng.standard_normal((L, S))
    bias[rng.random((L, S)) < 0.2] = -np.inf
    return bias


def _empty_mask(rng, L, S):
    mask = _mask(rng, L, S)
    mask[:, :, 3] = False  # row 3 has no allowed key
    return mask


CASES = {
    "plain": ({}, lambda rng, L, S: {}),
    "causal": ({}, lambda rng, L, S: {"causal": True}),
    "causal_bottom_right": ({}, lambda rng, L, S: {"causal": True, "align": "bottom_right"}),
    "window": ({}, lambda rng, L, S: {"window": (5, 3)}),
    "window_open_left": ({}, lambda rng, L, S: {"window": (None, 0)}),
    "mask": ({}, lambda rng, L, S: {"mask": _mask(rng, L, S)}),
    "bias_neginf": ({}, lambda rng, L, S: {"bias": _bias(rng, L, S)}),
    "softcap": ({}, lambda rng, L, S: {"softcap": 1.5, "scale": 0.7}),
    "alibi": ({}, lambda rng, L, S: {"alibi_slopes": np.array([0.5, 0.125])}),
    "dropout": ({}, lambda rng, L, S: {"dropout_mask": _mask(rng, L, S, 0.2), "dropout_p": 0.2}),
    "gqa_interleave": ({"H": 4, "K": 2}, lambda rng, L, S: {"causal": True}),
    "gqa_tile": ({"H": 4, "K": 2}, lambda rng, L, S: {"gqa": "tile"}),
    "empty_zero": ({}, lambda rng, L, S: {"mask": _empty_mask(rng, L, S)}),
    "empty_nan": ({}, lambda rng, L, S: {"mask": _empty_mask(rng, L, S), "empty_rows": "nan"}),
    "everything": (
        {},
        lambda rng, L, S: {
            "mask": _empty_mask(rng, L, S),
            "bias": _bias(rng, L, S),
            "softcap": 2.0,
            "alibi_slopes": np.array([0.25, 0.5]),
            "dropout_mask": _mask(rng, L, S, 0.1),
            "dropout_p": 0.1,
            "causal": True,
            "align": "bottom_right",
            "empty_rows": "nan",
        },
    ),
    "decode": ({"L": 1, "S": 300}, lambda rng, L, S: {"causal": True, "align": "bottom_right"}),
    "decode_split_gqa": (
        {"L": 1, "S": 2100, "H": 4, "K": 2},
        lambda rng, L, S: {
            "mask": _mask(rng, L, S, 0.1),
            "bias": _bias(rng, L, S),
            "softcap": 2.0,
            "alibi_slopes": np.array([0.25, 0.5]),
            "dropout_mask": _mask(rng, L, S, 0.1),
            "dropout_p": 0.1,
            "causal": True,
            "align": "bottom_right",
        },
    ),
    "decode_split_window": (
        {"L": 3, "S": 2600, "H": 4, "K": 2},
        lambda rng, L, S: {"gqa": "tile", "window": (1500, 0), "align": "bottom_right"},
    ),
    # one query row per kv head: k and v read in place (D, E multiples of the lanes)
    "decode_split_mha": (
        {"L": 1, "S": 2100, "D": 32, "E": 16},
        lambda rng, L, S: {
            "mask": _mask(rng, L, S, 0.1),
            "bias": _bias(rng, L, S),
            "softcap": 2.0,
            "alibi_slopes": np.array([0.25, 0.5]),
            "causal": True,
            "align": "bottom_right",
        },
    ),
    "decode_split_mha_dropout": (
        {"L": 1, "S": 2100, "D": 32, "E": 16},
        lambda rng, L, S: {"dropout_mask": _mask(rng, L, S, 0.1), "dropout_p": 0.1},
    ),
    "odd_dims": ({"L": 130, "S": 5, "D": 3, "E": 70}, lambda rng, L, S: {"window": (2, 2)}),
    "tiny": ({"L": 3, "S": 5, "D": 4, "E": 2}, lambda rng, L, S: {"causal": True}),
}
F32_CASES = [
    "plain",
    "causal",
    "everything",
    "gqa_tile",
    "odd_dims",
    "decode_split_gqa",
    "decode_split_mha",
]


def _build(name, dtype, seed=0):
    overrides, options = CASES[name]
    dims = {"H": _H, "K": _H, "L": 70, "S": 90, "D": 20, "E": 12} | overrides
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((_B, dims["H"], dims["L"], dims["D"])).astype(dtype)
    k = rng.standard_normal((_B, dims["K"], dims["S"], dims["D"])).astype(dtype)
    v = rng.standard_normal((_B, dims["K"], dims["S"], dims["E"])).astype(dtype)
    opts = options(rng, dims["L"], dims["S"])
    if dims["H"] != _H:
        opts = {
            key: (
                np.repeat(val, 2, axis=1)
                if isinstance(val, np.ndarray) and val.ndim == 4
                else np.tile(val, 2)
                if key == "alibi_slopes"
                else val
            )
            for key, val in opts.items()
        }
    grad_out = rng.standard_normal((_B, dims["H"], dims["L"], dims["E"]))
    grad_lse = rng.standard_normal((_B, dims["H"], dims["L"]))
    return q, k, v, opts, grad_out, grad_lse


def _reference(q, k, v, opts):
    return refattn.attention(q, k, v, return_lse=True, return_weights=True, **opts)


def _forward_bounds(spec, weights, dtype):
    kernel = numba_cpu.forward_error_bound(spec, weights, refattn.kernels.compute_dtype(dtype))
    ref = numba_cpu.forward_error_bound(spec, weights, np.float64)
    return kernel[0] + ref[0], kernel[1] + ref[1]


# float32 runs a representative subset
DTYPE_CASES = [pytest.param(n, np.float64, id=f"{n}-float64") for n in CASES] + [
    pytest.param(n, np.float32, id=f"{n}-float32") for n in F32_CASES
]


@pytest.mark.parametrize("name, dtype", DTYPE_CASES)
def test_forward_matches_float64(name, dtype):
    q, k, v, opts, _, _ = _build(name, dtype)
    out, lse = refattn.attention(q, k, v, return_lse=True, backend="numba", **opts)
    ref_out, ref_lse, weights = _reference(q, k, v, opts)
    spec = canonicalize(q, k, v, **opts)
    out_bound, lse_bound = _forward_bounds(spec, weights, dtype)
    assert out.dtype == refattn.kernels.compute_dtype(dtype), f"{name}: out dtype {out.dtype}"
    assert_within(out, ref_out, out_bound, what="out", case=name)
    assert_within(lse, ref_lse, lse_bound, what="lse", case=name)


@pytest.mark.parametrize("name, dtype", DTYPE_CASES)
def test_backward_matches_float64(name, dtype):
    q, k, v, opts, grad_out, grad_lse = _build(name, dtype)
    got = refattn.attention_vjp(q, k, v, grad_out, grad_lse=grad_lse, backend="numba", **opts)
    ref = refattn.attention_vjp(q, k, v, grad_out, grad_lse=grad_lse, **opts)
    _, _, weights = _reference(q, k, v, opts)
    spec = canonicalize(q, k, v, **opts)
    ct = refattn.kernels.compute_dtype(dtype)
    kernel = numba_cpu.backward_error_bound(spec, weights, grad_out, grad_lse, ct)
    own = numba_cpu.backward_error_bound(spec, weights, grad_out, grad_lse, np.float64)
    names = ("dq", "dk", "dv", "dbias")
    for what, value, truth, b1, b2 in zip(names, got, ref, kernel, own, strict=True):
        if truth is None:
            assert value is None, f"{name}: {what} should be None without bias"
            continue
        bound = b1 + b2
        if what == "dbias":  # summed back to the bias's own shape, like the gradient
            bound = bound.reshape(bound.shape[1:]) if bound.shape[0] == 1 else bound
            bound = bound.sum(axis=tuple(range(bound.ndim - truth.ndim)))
        assert_within(value, truth, bound, what=what, case=name)


def test_empty_rows_have_zero_gradients():
    q, k, v, opts, grad_out, grad_lse = _build("empty_nan", np.float64)
    dq, _, _, _ = refattn.attention_vjp(
        q, k, v, grad_out, grad_lse=grad_lse, backend="numba", **opts
    )
    assert np.all(dq[:, :, 3] == 0), f"empty row 3: dq {dq[:, :, 3].ravel()[:4]} is not 0"


@pytest.mark.parametrize("where", ["k", "v", "bias", "q_empty_row"])
def test_poison_at_excluded_positions_is_bit_invisible(where):
    rng = np.random.default_rng(7)
    L, S, D = 70, 90, 16
    q, k, v = (rng.standard_normal((1, 2, n, D)) for n in (L, S, S))
    mask = rng.random((1, 2, L, S)) > 0.3
    mask[..., 10] = False  # key 10 is excluded for every row
    mask[:, :, 5] = False  # query row 5 is empty
    bias = rng.standard_normal((1, 2, L, S))
    opts = {"mask": mask, "bias": bias, "causal": True, "align": "bottom_right"}
    clean = refattn.attention(q, k, v, return_lse=True, backend="numba", **opts)
    grads = refattn.attention_vjp(q, k, v, np.ones((1, 2, L, D)), backend="numba", **opts)
    for poison in (np.nan, np.inf, -np.inf):
        pq, pk, pv, pb = q.copy(), k.copy(), v.copy(), bias.copy()
        if where == "k":
            pk[..., 10, :] = poison
        elif where == "v":
            pv[..., 10, :] = poison
        elif where == "bias":
            pb[~mask] = poison
        else:
            pq[:, :, 5] = poison
        popts = opts | {"bias": pb}
        dirty = refattn.attention(pq, pk, pv, return_lse=True, backend="numba", **popts)
        for what, a, b in zip(("out", "lse"), dirty, clean, strict=True):
            assert np.array_equal(a, b), (
                f"poison {poison} in excluded {where} changed {what}: max diff "
                f"{np.nanmax(np.abs(a - b))}"
            )
        if where in ("k", "v", "bias"):
            pgrads = refattn.attention_vjp(
                pq, pk, pv, np.ones((1, 2, L, D)), backend="numba", **popts
            )
            for what, a, b in zip(
                ("dq", "dv", "dbias"), pgrads[::2] + pgrads[3:], grads[::2] + grads[3:], strict=True
            ):
                assert np.array_equal(a, b), f"poison {poison} in excluded {where}: {what}"


def test_nan_in_allowed_value_propagates_to_its_rows_only():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 1, 70, 8)) for _ in range(3))
    v[0, 0, 40, 0] = np.nan
    out = refattn.attention(q, k, v, causal=True, backend="numba")
    nan_rows = np.isnan(out[0, 0, :, 0])
    assert not nan_rows[:40].any() and nan_rows[40:].all(), (
        f"NaN in v[40] must reach rows >= 40 only; NaN rows {np.flatnonzero(nan_rows)[:5]}"
    )
    assert not np.isnan(out[0, 0, :, 1:]).any(), "NaN in column 0 leaked into other columns"


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        if a is not None:
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


_DIGEST_SCRIPT = """
import numpy as np, refattn
from tests.kernels.test_kernels import _build, _digest
q, k, v, opts, go, gl = _build("everything", np.float64, seed=11)
out, lse = refattn.attention(q, k, v, return_lse=True, backend="numba", **opts)
g = refattn.attention_vjp(q, k, v, go, grad_lse=gl, backend="numba", **opts)
q, k, v, opts, go, gl = _build("gqa_interleave", np.float32, seed=12)
o32 = refattn.attention(q, k, v, backend="numba", **opts)
g32 = refattn.attention_vjp(q, k, v, go, backend="numba", **opts)
q, k, v, opts, go, gl = _build("decode_split_gqa", np.float64, seed=13)
split = refattn.attention(q, k, v, return_lse=True, backend="numba", **opts)
q, k, v, opts, go, gl = _build("decode_split_mha", np.float32, seed=14)
mha = refattn.attention(q, k, v, return_lse=True, backend="numba", **opts)
print(_digest([out, lse, *g, o32, *g32, *split, *mha]))
"""


def test_bit_identical_for_1_and_2_threads():
    one, two = (
        digest_with_threads(_DIGEST_SCRIPT, n, flags=("-W", "error"), timeout=600) for n in (1, 2)
    )
    assert one == two, f"results differ between NUMBA_NUM_THREADS=1 ({one}) and 2 ({two})"


def test_bit_identical_across_runs():
    q, k, v, opts, go, gl = _build("everything", np.float64, seed=5)
    first = [
        *refattn.attention(q, k, v, return_lse=True, backend="numba", **opts),
        *refattn.attention_vjp(q, k, v, go, grad_lse=gl, backend="numba", **opts),
    ]
    again = [
        *refattn.attention(q, k, v, return_lse=True, backend="numba", **opts),
        *refattn.attention_vjp(q, k, v, go, grad_lse=gl, backend="numba", **opts),
    ]
    assert _digest(first) == _digest(again), "two runs of the same call differ"


def test_kernel_bodies_run_without_jit():
    """NUMBA_DISABLE_JIT=1: the kernels run as Python (coverage of their bodies)."""
    env = dict(os.environ, NUMBA_DISABLE_JIT="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(ROOT / "tests" / "kernels" / "test_kernels.py"),
        "-q",
        "-p",
        "no:cacheprovider",
        "-x",
        "-W",
        "ignore::RuntimeWarning",
        "-k",
        "(test_forward_matches or test_backward_matches) and (tiny or everything) "
        "and not float32 or test_exp",
    ]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"NUMBA_DISABLE_JIT=1 tier failed:\n{done.stdout[-3000:]}"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_exp_kernels_within_one_ulp(dtype):
    rng = np.random.default_rng(1)
    lo = -740.0 if dtype == "float64" else -100.0
    x = np.concatenate(
        [rng.uniform(lo, 0.0, 300), rng.uniform(-1, 1, 100), [0.0, -0.0, lo]]
    ).astype(dtype)
    fn = numba_cpu.exp_float64 if dtype == "float64" else numba_cpu.exp_float32
    got = np.array([fn(t) for t in x], dtype=np.float64)
    with mpmath.workprec(200):
        truth = np.array([float(mpmath.exp(mpmath.mpf(float(t)))) for t in x])
    truth = truth.astype(dtype).astype(np.float64)
    dist = ulp_distance(got, truth, dtype)
    worst = int(np.argmax(dist))
    assert dist[worst] <= 1, (
        f"exp_{dtype}({x[worst]!r}) = {got[worst]!r}, correctly rounded "
        f"{truth[worst]!r}: {dist[worst]} ulp > 1"
    )
    special = np.array(
        [fn(np.dtype(dtype).type(t)) for t in (-np.inf, np.inf, np.nan, -1e4)], np.float64
    )
    assert special[0] == 0 and special[1] == np.inf and np.isnan(special[2]) and special[3] == 0, (
        f"exp_{dtype} at -inf, inf, nan, -1e4 gave {special}"
    )


def test_memory_is_linear_in_length():
    """No (L, S) plane: peak Python-visible allocation grows like L, not L*S."""
    import tracemalloc

    rng = np.random.default_rng(0)
    peaks = []
    for length in (512, 2048):
        q = rng.standard_normal((1, 1, length, 16))
        refattn.attention(q, q, q, backend="numba", causal=True)  # warm
        tracemalloc.start()
        refattn.attention(q, q, q, backend="numba", causal=True)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    plane = 2048 * 2048 * 8
    assert peaks[1] < plane / 4, f"peak {peaks[1]} bytes at L=S=2048 is near an (L, S) plane"


def test_return_weights_is_not_supported():
    q = np.ones((1, 1, 2, 4))
    with pytest.raises(NotImplementedError, match="return_weights"):
        refattn.attention(q, q, q, backend="numba", return_weights=True)


def test_compute_dtype_argument_is_checked():
    spec = canonicalize(np.ones((2, 4)), np.ones((3, 4)), np.ones((3, 2)))
    with pytest.raises(ValueError, match="dtype"):
        refattn.kernels.attention(spec, dtype=np.float16)
    out = refattn.kernels.attention(spec, dtype=np.float32)
    assert out.dtype == np.float32 and out.shape == (1, 1, 2, 2), f"got {out.dtype} {out.shape}"
